"""Soak: long ``hisparse stress`` runs with churn and byte-exact verification, watching
host and GPU memory for growth.

  python -m benchmarks.soak --preset 16k --out soak_16k.json        # 32 req x 16K x 2 layers
  python -m benchmarks.soak --preset 128k --out soak_128k.json      # 16 req x 128K x 2 layers
  python -m benchmarks.soak --preset 16k-fast                       # 8 req x 16K x 1 layer
  python -m benchmarks.soak --preset 128k-fast                      # 4 req x 128K x 1 layer
  python -m benchmarks.soak --preset tiny                           # CPU, seconds (checks the script)

Each run is one ``hisparse_tools.stress.run_stress`` (a fresh cache; requests join,
prefill and leave with probability ``--churn`` a step; ``--verify`` rows per layer and
step checked byte-exact against the hot and host copies; the Belady bound off, so the
tracker's history does not grow the host memory being watched). Runs use seeds seed,
seed + 1, ...

Time: ``--budget-s`` bounds the whole call. A first short run (``--calibrate-steps``)
measures steps/s (its steps count too; it includes compiling the kernels, so the run
after it replaces its rate); every later run gets ``--steps`` or as many as 85% of the
remaining budget holds at the slowest warm rate, and no run starts that would get fewer
than ``--min-steps``. ``--calibrate-steps 0``: no calibration; the first run gets
``--steps`` whatever the budget (the caller knows it fits). So one call fits the device tool's 10 minutes, and reaching a
total means repeating the call with other seeds (the JSON lists each run).

Memory, per run: host RSS (``VmRSS`` of /proc/self/status) and
``torch.cuda.memory_allocated`` just before the run and just after it (the cache
collected), and, from a sampler thread every 0.5 s, the peak and the medians over the
first and the last fifth of the run (growth while the cache is live shows as late >
early). The stress result's own peaks (``host_rss_peak_bytes`` is the process's
``ru_maxrss``, ``gpu_peak_bytes`` the allocator's peak) are copied too.

Prints one ``[soak]`` line per run and a total; exit status 0 when every run passed its
verification, 1 when one failed (the run stops at the first mismatch), 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import threading
import time

import torch

from benchmarks import common
from hisparse import CapacityError
from hisparse_tools.exit_codes import MissingDependency
from hisparse_tools.fields import plain_dict
from hisparse_tools.stress import StressOptions, StressRun, run_stress

PRESETS = {
    "16k": dict(num_requests=32, context=16384, context_min=12288, num_layers=2, steps=5000,
                runs=4),
    "128k": dict(num_requests=16, context=131072, context_min=98304, num_layers=2, steps=3000,
                 runs=1),
    # fewer requests and one layer: many more verified steps per second (the step count
    # is what the soak is for; the 16k / 128k presets keep more requests in flight)
    "16k-fast": dict(num_requests=8, context=16384, context_min=12288, num_layers=1, steps=12000,
                     runs=3),
    "128k-fast": dict(num_requests=4, context=131072, context_min=98304, num_layers=1, steps=2500,
                      runs=1),
    "tiny": dict(num_requests=4, context=256, context_min=128, num_layers=2, steps=30, runs=2,
                 top_k=16, buffer_size=32, calibrate_steps=10, min_steps=5, device="cpu"),
}
DEFAULTS = dict(top_k=2048, buffer_size=4096, churn=0.05, verify=256, calibrate_steps=200,
                min_steps=500, device=None)
SAMPLE_S = 0.5
FIT = 0.85  # share of the remaining budget a run may plan to use


def vm_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def gpu_allocated(dev: torch.device) -> int | None:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None


class Sampler:
    """A thread recording (seconds since start, host RSS, GPU allocated) every 0.5 s."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.samples = dev, []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.samples.append((time.perf_counter() - self._t0, vm_rss(), gpu_allocated(self.dev)))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """Peak and the medians over the first and last fifth of the samples."""
        s = self.samples
        if not s:
            return {"samples": 0}
        k = max(1, len(s) // 5)
        out = {"samples": len(s), "rss_max": max(x[1] for x in s),
               "rss_early": statistics.median(x[1] for x in s[:k]),
               "rss_late": statistics.median(x[1] for x in s[-k:])}
        if s[0][2] is not None:
            out.update(gpu_max=max(x[2] for x in s),
                       gpu_early=statistics.median(x[2] for x in s[:k]),
                       gpu_late=statistics.median(x[2] for x in s[-k:]))
        return out


def one_run(o: StressOptions, dev: torch.device) -> dict:
    """One stress run with memory figures around and during it."""
    gc.collect()
    start = {"rss": vm_rss(), "gpu_allocated": gpu_allocated(dev)}
    t0 = time.perf_counter()
    with Sampler(dev) as sampler:
        res = run_stress(o)
    wall = time.perf_counter() - t0
    gc.collect()
    end = {"rss": vm_rss(), "gpu_allocated": gpu_allocated(dev)}
    ov = res["overall"]
    return {"seed": o.seed, "steps_planned": o.steps, "steps": res["workload"]["steps_run"],
            "wall_s": wall, "steps_per_s": res["workload"]["steps_run"] / wall, "ok": res["ok"],
            "failures": res["failures"][:10], "joined": res["workload"]["joined"],
            "left": res["workload"]["left"], "hit_rate": ov["hit_rate"],
            "rows_verified": ov["rows_verified"], "step_ms_p50": ov["step_ms_p50"],
            "step_ms_p99": ov["step_ms_p99"], "host_pool_bytes": ov["host_pool_bytes"],
            "memory": {"start": start, "end": end, "during": sampler.summary(),
                       "stress_host_rss_peak": ov["host_rss_peak_bytes"],
                       "stress_gpu_peak": ov["gpu_peak_bytes"]},
            "kernels": res["kernels"], "device": res["device"]}


def gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def line(i: int, runs: int, name: str, r: dict) -> str:
    m = r["memory"]
    d = m["during"]
    return (f"[soak] run {i + 1}/{runs} {name} seed {r['seed']}: {r['steps']} steps in "
            f"{r['wall_s']:.1f} s ({r['steps_per_s']:.1f}/s), {'PASS' if r['ok'] else 'FAIL'}, "
            f"hit rate {r['hit_rate']:.4f}, {r['rows_verified']} rows verified, "
            f"{r['joined']} joined / {r['left']} left; host RSS start {gib(m['start']['rss'])} "
            f"end {gib(m['end']['rss'])} (during: early {gib(d.get('rss_early'))}, late "
            f"{gib(d.get('rss_late'))}, max {gib(d.get('rss_max'))}); GPU allocated start "
            f"{gib(m['start']['gpu_allocated'])} end {gib(m['end']['gpu_allocated'])} (during: "
            f"early {gib(d.get('gpu_early'))}, late {gib(d.get('gpu_late'))}, max "
            f"{gib(d.get('gpu_max'))})")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="16k")
    for flag, typ in (("--requests", int), ("--context", int), ("--context-min", int),
                      ("--layers", int), ("--top-k", int), ("--buffer", int), ("--steps", int),
                      ("--runs", common.positive_int), ("--churn", float), ("--verify", int),
                      ("--calibrate-steps", int), ("--min-steps", int)):
        ap.add_argument(flag, type=typ, default=None, help="overrides the preset")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first run (then +1 per run)")
    ap.add_argument("--budget-s", type=common.positive_float, default=540.0,
                    help="wall-clock seconds the whole call may take [540]")
    ap.add_argument("--out", help="write the runs as JSON here (rewritten after every run)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "soak"):
        return 2
    t_start = time.perf_counter()
    p = {**DEFAULTS, **PRESETS[a.preset]}
    for key, flag in (("num_requests", "requests"), ("context", "context"),
                      ("context_min", "context_min"), ("num_layers", "layers"), ("top_k", "top_k"),
                      ("buffer_size", "buffer"), ("steps", "steps"), ("runs", "runs"),
                      ("churn", "churn"), ("verify", "verify"),
                      ("calibrate_steps", "calibrate_steps"), ("min_steps", "min_steps")):
        if getattr(a, flag) is not None:
            p[key] = getattr(a, flag)
    runs, steps, cal, min_steps = p.pop("runs"), p.pop("steps"), p.pop("calibrate_steps"), p.pop("min_steps")
    if p["device"] is None and not torch.cuda.is_available():
        print("soak: no CUDA GPU; --preset tiny runs on the CPU", file=sys.stderr)
        return 2
    try:
        base = StressOptions(steps=steps, optimal=False, progress=False, seed=a.seed, **p)  # checked here
        StressRun(base)  # and the cache config, device, kernels and memory (allocates nothing)
    except (TypeError, ValueError, CapacityError, MissingDependency) as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    dev = torch.device(base.device or "cuda")
    result = {"benchmark": "soak", "preset": a.preset, "env": common.environment(dev),
              "options": plain_dict(base), "budget_s": a.budget_s, "runs": []}
    print(f"[soak] {a.preset}: {base.num_requests} requests, contexts {base.context_min}-"
          f"{base.context}, {base.num_layers} layers, K={base.top_k}, S={base.buffer_size}, churn "
          f"{base.churn}, verify {base.verify}; up to {runs} run(s) of {steps} steps within "
          f"{a.budget_s:.0f} s", flush=True)
    rate = None
    plan = [cal] + [steps] * runs if 0 < cal < steps else [steps] * runs
    for i, n in enumerate(plan):
        left = a.budget_s - (time.perf_counter() - t_start)
        if rate is not None:
            n = min(n, int(FIT * left * rate))
            if n < min_steps:
                print(f"[soak] stopping: {left:.0f} s left hold {max(n, 0)} steps at {rate:.1f} "
                      f"steps/s, fewer than --min-steps {min_steps}", flush=True)
                break
        r = one_run(dataclasses.replace(base, steps=n, seed=a.seed + i), dev)
        r["calibration"] = rate is None and n < steps
        # the calibration run includes the kernels' compile time: later runs plan with the
        # slowest warm run's rate once there is one
        if r["calibration"] or rate is None or result["runs"] and result["runs"][-1].get("calibration"):
            rate = r["steps_per_s"]
        else:
            rate = min(rate, r["steps_per_s"])
        result["runs"].append(r)
        print(line(i, len(plan), a.preset, r), flush=True)
        if a.out:
            common.write_json(a.out, result)
        if not r["ok"]:
            break
    total = sum(r["steps"] for r in result["runs"])
    ok = bool(result["runs"]) and all(r["ok"] for r in result["runs"])
    result.update(total_steps=total, ok=ok)
    if a.out:
        common.write_json(a.out, result)
    print(f"[soak] total {a.preset}: {total} verified decode steps in {len(result['runs'])} runs "
          f"(seeds {a.seed}..{a.seed + len(result['runs']) - 1}), "
          f"{'all PASS' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
