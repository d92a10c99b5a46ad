"""Host time of the engine façade's per-layer calls, outside any engine: a decode step
of R requests over L layers (``prepare_for_batch``, then per layer ``write_new_rows`` and
``convert_decode_logical_to_physical_topk``), timed with perf_counter (no syncs added),
then the same steps under cProfile to show where that time goes. ``--pad-to N``
prepares each step padded to a bucket of N requests, as a graph-capturing engine's
eager warm-up does; ``--layer-graphs`` (with ``--pad-to``) has the group replay its
per-layer CUDA graphs (``layer_graphs=True``); ``--inputs`` says what the calls are given:
``allocated`` (default) new tensors each step from the caching allocator, as an eager
engine's are (their addresses repeat from step to step, so the graphs read them in
place), ``moving`` a ring of buffers longer than the graphs' window of recent inputs
(``RECENT_INPUTS``): an address they have not seen lately every step, so every call
copies its input, ``in-place`` the group's ``layer_input_buffers``. Prints min /
median / p99 per call, the
per-layer sum against the 50 us target, ``prepare_for_batch`` per step, and on CUDA the
GPU time of the layers' calls per layer (to compare the modes' device cost too). On CUDA it also counts the Triton
launches per layer (Triton's launch hook, in a separate pass) and times the launch of an
empty Triton kernel of 20 arguments and 2 constexprs (fewer than any of those four
takes: the resolve has 32 and 15): launches x that time is a lower bound of what
Triton's launcher takes of the per-layer time, whatever hisparse does.

  python3 -m benchmarks.bench_host_calls [--requests 64] [--layers 8] [--context 4200] [--steps 20]
  python3 -m benchmarks.bench_host_calls --pad-to 64 --layer-graphs      # per-layer graphs (CUDA)
  python3 -m benchmarks.bench_host_calls --pad-to 64 --layer-graphs --inputs in-place  # the group's buffers
  python3 -m benchmarks.bench_host_calls --pad-to 64 --layer-graphs --inputs moving    # every input copied
  python3 -m benchmarks.bench_host_calls --device cpu --kernels torch    # CPU: the torch paths
  python3 -m benchmarks.bench_host_calls --compare [--pad-to 64]          # every mode, steps interleaved

``--compare`` builds one group per mode (eager, padded, and on CUDA the per-layer graphs
with each kind of input) and runs their steps in turn, one step of each mode
after the other, so that a drift in the host's speed reaches every mode alike; it prints
each mode's medians and their ratio to the eager calls, measured in the same run.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time

import torch
import triton
import triton.language as tl
from triton import knobs

from benchmarks import common
from benchmarks.common import percentile
from hisparse import CapacityError, HiSparseConfig
from hisparse.engine import RECENT_INPUTS, HiSparseIndexGroup, SparseMLAMetadata
from hisparse_tools.exit_codes import MissingDependency
from hisparse_tools.preflight import parse_device, require_kernels


@triton.jit
def _empty_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                  n0, n1, n2, n3, C0: tl.constexpr, C1: tl.constexpr):
    pass


def launch_floor(dev: torch.device, n: int = 300) -> dict:
    """Host time of one launch of an empty Triton kernel taking 16 tensors, 4 ints and
    2 constexprs: the launcher's own cost per launch (a kernel with more arguments, as
    hisparse's are, costs more)."""
    ts = [torch.zeros(16, dtype=torch.int32, device=dev) for _ in range(16)]
    times = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        _empty_kernel[(1,)](*ts, 64, 2048, 4096, i, C0=8, C1=16)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize(dev)
    return {"min": min(times) * 1e6, "median": percentile(times, 50) * 1e6, "p99": percentile(times, 99) * 1e6}


def count_launches(step, times: dict, layers: int) -> float:
    """Triton launches of one call of ``step`` (a whole decode step: prepare_for_batch
    launches none) divided by ``layers``, counted with Triton's launch-enter hook."""
    n = [0]

    def hook(*_a, **_k):
        n[0] += 1
    old = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = hook
    try:
        step(times)
    finally:
        knobs.runtime.launch_enter_hook = old
    return n[0] / layers


INPUTS = ("allocated", "moving", "in-place")
NAMES = ("prepare_for_batch", "write_new_rows", "convert", "per_layer", "gpu_per_layer")


def fresh() -> dict:
    return {k: [] for k in NAMES}


def stats_us(v: list[float]) -> dict:
    return {"min": min(v) * 1e6, "median": percentile(v, 50) * 1e6, "p99": percentile(v, 99) * 1e6}


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of making the per-layer calls: ``pad_to`` (None: unpadded), the group's
    ``layer_graphs``, and ``inputs``: "allocated", "moving" or "in-place" (the module
    docstring)."""

    name: str
    pad_to: int | None = None
    layer_graphs: bool = False
    inputs: str = "allocated"


def make_case(a: argparse.Namespace, dev: torch.device, mode: Mode):
    """A group of ``a.requests`` requests with ``a.context`` rows in every layer, and
    ``step(times)``: one decode step of it in ``mode``, its host times appended to
    ``times`` (and on CUDA the GPU time of its layers' calls)."""
    R, L, C, K = a.requests, a.layers, a.context, a.top_k
    cfg = HiSparseConfig(num_layers=L, row_bytes=656, top_k=K, device_buffer_size=2 * K,
                         max_num_reqs=max(R, mode.pad_to or R), host_pool_tokens=R * (C + 2 * a.steps + 64) + 64 * R,
                         host_block_size=64, device=a.device, max_request_id=max(1000, R))
    g = HiSparseIndexGroup(cfg, validate=False, kernels=a.kernels, layer_graphs=mode.layer_graphs)
    for _ in range(L):
        g.register_layer(kv_cache_dtype="fp8_ds_mla")
    ids = list(range(R))
    for r in ids:
        g.add_request(r)
    md = SparseMLAMetadata.build(request_ids=ids, query_lens=[C] * R, seq_lens=[C] * R,
                                 num_decodes=0, device=dev)
    g.prepare_for_batch(md)
    fill = torch.randint(0, 120, (R * C, 656), dtype=torch.uint8, device=dev)
    for layer in range(L):
        g.write_new_rows(layer, fill, md)
    del fill
    gen = torch.Generator(device=dev).manual_seed(0)
    seq = C
    T = R if mode.pad_to is None else mode.pad_to
    ring = [(torch.empty((T, 656), dtype=torch.uint8, device=dev), torch.empty((T, K), dtype=torch.int32, device=dev))
            for _ in range(RECENT_INPUTS + 2)] if mode.inputs == "moving" else []

    def step(times):
        nonlocal seq
        seq += 1
        md = SparseMLAMetadata.build(request_ids=ids, query_lens=[1] * R, seq_lens=[seq] * R,
                                     num_decodes=R, device=dev)
        t0 = time.perf_counter()
        g.prepare_for_batch(md, pad_to=mode.pad_to)
        times["prepare_for_batch"].append(time.perf_counter() - t0)
        rows = torch.randint(0, 120, (T, 656), dtype=torch.uint8, device=dev, generator=gen)
        # 90% of the top-k in the last 4K positions (mostly hits), the rest anywhere
        recent = seq - 1 - torch.randint(0, min(seq, 2 * K), (R, K), device=dev, generator=gen)
        far = torch.randint(0, seq, (R, K), device=dev, generator=gen)
        pick = torch.rand((R, K), device=dev, generator=gen) < 0.9
        topk = torch.where(pick, recent, far).to(torch.int32)
        if T > R:
            topk = torch.cat([topk, torch.full((T - R, K), -1, dtype=torch.int32, device=dev)])
        if mode.inputs == "in-place":
            rows_in, topk_in = g.layer_input_buffers(md)
        elif mode.inputs == "moving":
            rows_in, topk_in = ring[seq % len(ring)]
        if mode.inputs != "allocated":
            rows = rows_in.copy_(rows)
            topk = topk_in.copy_(topk)
        marks = None
        if dev.type == "cuda":
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            marks[0].record()
        for layer in range(L):
            t0 = time.perf_counter()
            g.write_new_rows(layer, rows, md)
            t1 = time.perf_counter()
            g.convert_decode_logical_to_physical_topk(layer, topk, md)
            t2 = time.perf_counter()
            times["write_new_rows"].append(t1 - t0)
            times["convert"].append(t2 - t1)
            times["per_layer"].append(t2 - t0)
        if marks is not None:
            marks[1].record()
            torch.cuda.synchronize(dev)
            # GPU time of the layers' calls (the stream from the first write to the last
            # conversion, which waits for its staging), per layer
            times["gpu_per_layer"].append(marks[0].elapsed_time(marks[1]) / 1e3 / L)

    return g, step


def compare(a: argparse.Namespace, dev: torch.device, modes: list[Mode], cases: list) -> int:
    """``--compare``: the modes' steps in turn (3 warm-up steps each first), then one line
    per mode and its ratio to the first (eager)."""
    for _, step in cases:
        for _ in range(3):
            step(fresh())
    times = [fresh() for _ in modes]
    for _ in range(a.steps):
        for (_, step), t in zip(cases, times):
            step(t)
    R, L, C = a.requests, a.layers, a.context
    print(f"host time per layer, {R} requests, {L} layers, context {C}, kernels {cases[0][0].hisparse_cache.kernels}, "
          f"device {dev}, {a.steps} steps per mode, interleaved:")
    print(f"  {'mode':26s} {'write us':>9s} {'convert us':>11s} {'per layer min/median/p99 us':>29s} "
          f"{'x eager':>8s} {'GPU us/layer':>13s} {'copied':>7s}")
    result = {"benchmark": "host_calls", "compare": True, "env": common.environment(dev),
              "options": {"requests": R, "layers": L, "context": C, "steps": a.steps, "top_k": a.top_k,
                          "pad_to": a.pad_to or R, "kernels": cases[0][0].hisparse_cache.kernels},
              "modes": {}}
    base = None
    for m, (g, _), t in zip(modes, cases, times):
        us = {k: stats_us(t[k]) for k in NAMES if t[k]}
        med = us["per_layer"]["median"]
        base = base if base is not None else med
        result["modes"][m.name] = {"mode": dataclasses.asdict(m), "us": us, "x_eager": med / base,
                                   "layer_graphs": g.layer_graphs()}
        pl = us["per_layer"]
        gpu = f"{us['gpu_per_layer']['median']:13.1f}" if "gpu_per_layer" in us else f"{'-':>13s}"
        lg = g.layer_graphs()  # the share of replayed calls that copied their input
        copied = f"{lg['copies'] / lg['replays']:7.2f}" if lg and lg["replays"] else f"{'-':>7s}"
        print(f"  {m.name:26s} {us['write_new_rows']['median']:9.1f} {us['convert']['median']:11.1f} "
              f"{pl['min']:9.1f} /{pl['median']:7.1f} /{pl['p99']:7.1f}   {med / base:8.3f} {gpu} {copied}")
    print("  the 50 us target per layer: " + ", ".join(
        f"{name} {'met' if d['us']['per_layer']['median'] <= 50 else 'not met'}" for name, d in result["modes"].items()))
    if a.out:
        common.write_json(a.out, result)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pos = common.positive_int
    ap.add_argument("--requests", type=pos, default=64, help="decode requests per step [%(default)s]")
    ap.add_argument("--layers", type=pos, default=8, help="[%(default)s]")
    ap.add_argument("--context", type=pos, default=4200, help="rows per request before the steps [%(default)s]")
    ap.add_argument("--steps", type=pos, default=20, help="timed decode steps [%(default)s]")
    ap.add_argument("--top-k", type=pos, default=2048, help="[%(default)s]")
    ap.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N [%(default)s]")
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"], help="[%(default)s]")
    ap.add_argument("--top", type=pos, default=25, help="functions listed in the profile [%(default)s]")
    ap.add_argument("--pad-to", type=pos, default=None,
                    help="prepare each step padded to this bucket, >= --requests [no padding]")
    ap.add_argument("--layer-graphs", action="store_true",
                    help="the group's per-layer graphs (layer_graphs=True; needs --pad-to and CUDA)")
    ap.add_argument("--inputs", choices=INPUTS, default="allocated",
                    help="with --layer-graphs, what the calls are given: new tensors from the caching allocator "
                         "each step (their addresses repeat: read in place by graphs of their own), a ring of "
                         "buffers (an address not seen lately each step: copied), or the group's layer_input_buffers() "
                         "(written untimed, as an engine producing into them) [%(default)s]")
    ap.add_argument("--compare", action="store_true",
                    help="every mode side by side, steps interleaved (bucket: --pad-to, else --requests)")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if a.pad_to is not None and a.pad_to < a.requests:
        ap.error(f"--pad-to {a.pad_to} is smaller than --requests {a.requests}: a bucket holds the "
                 "whole batch; give --pad-to >= --requests or leave it out")
    if not common.out_ok(a.out, "bench_host_calls"):
        return 2
    if a.compare and (a.layer_graphs or a.inputs != "allocated"):
        print("bench_host_calls: --compare runs every mode; leave out --layer-graphs and --inputs",
              file=sys.stderr)
        return 2
    if a.layer_graphs and a.pad_to is None:
        print("bench_host_calls: --layer-graphs replays padded forwards; give --pad-to N too", file=sys.stderr)
        return 2
    if a.inputs != "allocated" and not a.layer_graphs:
        print(f"bench_host_calls: --inputs {a.inputs} is about the per-layer graphs' inputs; give "
              "--layer-graphs too", file=sys.stderr)
        return 2
    if a.compare:
        bucket = a.pad_to or a.requests
        modes = [Mode("eager"), Mode("padded", pad_to=bucket)]
        if a.device.startswith("cuda"):
            modes += [Mode(f"layer_graphs_{i.replace('-', '_')}", pad_to=bucket, layer_graphs=True, inputs=i)
                      for i in INPUTS]
    else:
        modes = [Mode("run", pad_to=a.pad_to, layer_graphs=a.layer_graphs, inputs=a.inputs)]
    try:
        dev = parse_device(a.device)  # "--device cuda needs a CUDA GPU ...: use --device cpu"
        require_kernels(a.kernels, dev)
        cases = [make_case(a, dev, m) for m in modes]
    except (ValueError, TypeError, CapacityError, MissingDependency) as e:
        print(f"bench_host_calls: {e}", file=sys.stderr)
        return 2
    if a.compare:
        return compare(a, dev, modes, cases)
    g, step = cases[0]
    R, L, C, K = a.requests, a.layers, a.context, a.top_k
    for _ in range(3):
        step(fresh())
    times = fresh()
    for _ in range(a.steps):
        step(times)
    print(f"host time per call, {R} requests, {L} layers, context {C}, kernels {g.hisparse_cache.kernels}, "
          f"device {dev}, pad_to {a.pad_to}, layer graphs {g.layer_graphs()}"
          f"{f', inputs {a.inputs}' if a.layer_graphs else ''}:")
    result = {"benchmark": "host_calls", "env": common.environment(dev),
              "options": {"requests": R, "layers": L, "context": C, "steps": a.steps, "top_k": K,
                          "pad_to": a.pad_to, "kernels": g.hisparse_cache.kernels,
                          "inputs": a.inputs,
                          "layer_graphs": g.layer_graphs()}, "us": {}}
    for k in NAMES:
        v = times[k]
        if not v:  # gpu_per_layer on CPU
            continue
        st = stats_us(v)
        result["us"][k] = st
        print(f"  {k:18s} min {st['min']:7.1f} us  median {st['median']:7.1f} us  p99 {st['p99']:7.1f} us")
    med = result["us"]["per_layer"]["median"]
    print(f"  per layer (write + convert): median {med:.1f} us against the 50 us target "
          f"({'met' if med <= 50 else 'not met'})")
    if dev.type == "cuda":
        floor = launch_floor(dev)
        per_layer = count_launches(step, fresh(), L)
        result["empty_launch_us"] = floor
        result["triton_launches_per_layer"] = per_layer
        lf = floor["median"] * per_layer
        result["launcher_us_per_layer"] = lf
        print(f"  empty Triton launch: min {floor['min']:.1f} us  median {floor['median']:.1f} us  "
              f"p99 {floor['p99']:.1f} us; {per_layer:g} launches per layer = {lf:.1f} us of the "
              f"{med:.1f} us per layer ({100 * lf / med:.0f}%)")
    if a.out:
        common.write_json(a.out, result)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step(fresh())
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
