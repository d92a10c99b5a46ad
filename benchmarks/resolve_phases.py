"""Where a decode resolve program's time goes: %globaltimer at its phase boundaries.

  python -m benchmarks.resolve_phases standalone --slots 5120 --batch 66 13 --out X.json
  python -m benchmarks.resolve_phases capacity --out X.json -- --contexts 128K --buffer 5120
  python -m benchmarks.resolve_phases --dry-run      # CPU: build the instrumented kernel only

The resolve runs one program per request (``hisparse.kernels.resolve``), a chain of
CTA-wide phases. This tool builds a copy of that kernel with a tick after each phase
(a CTA barrier, then the SM's %globaltimer written by the program to its row of a
clock tensor), launches it where the real kernel would be launched, and reports the
mean time of each phase over the leader programs:

  0-1 the token's group (request id, run offset)   1-2 P1: positions -> host rows -> slots
  2-3 P2: stamp the hits                            3-4 P2: dedupe and park the misses
  4-5 P2: sort the parked misses                    5-6 step and counters
  6-7 P3: load the slots' stamps and positions, count the empty ones
  7-8 P3: bisection for the threshold stamp         8-9 P3: bisection for the threshold position
  9-10 P4: list the victims in slot order           10-11 P4: pair victims with misses
  11-12 the misses' final slots                     12-13 P5: physical rows (the tile's stores)

Two places to measure:
- ``standalone``: one layer of B requests with CTX-token contexts and S hot slots,
  warmed by ``--warm`` resolves of a trace with about ``--hit`` hits, then the next
  step's resolve repeated from the saved state, with a warm and with a flushed L2. The
  uninstrumented kernel is timed the same way as a CUDA-graph replay (events around
  it, a GPU sleep ahead so the host launch is not counted).
- ``capacity``: ``benchmarks.bench_capacity`` with the instrumented kernel in place of
  the real one (its arguments after ``--``); the phases are those of the last resolve
  the run replayed (its last layer of its last step), with the other kernels of the
  step running around it, as in the capacity benchmark's own figures.

The ticks add a barrier and a store per phase, so the instrumented program is a little
slower than the real one; compare its span with the uninstrumented kernel's time.
Exit status: 2 for bad options or no GPU; 1 when the instrumented kernel cannot be
built from the current source (a phase anchor moved: update ``TICKS``); otherwise 0
(standalone) or bench_capacity's own status (capacity: 1 when its output comparison
fails, e.g. at different batches without ``--same-batch``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import common

KERNEL_SRC = common.ROOT / "hisparse" / "kernels" / "resolve.py"
CLK_COLS = 32  # ticks 0..13, then counters: 24 misses, 25 probes (1000 x position + stamp), 26 tier
NTICKS = 14
PHASES = ("group", "P1 lookup", "P2 stamp hits", "P2 dedupe+park", "P2 sort misses", "step+counters",
          "P3 load slots", "P3 stamp bisection", "P3 position bisection", "P4 list victims",
          "P4 pair", "final slots", "P5 stores")

_TICK_FN = '''
@triton.jit
def _tick(clk_ptr, t, i: tl.constexpr):
    tl.debug_barrier()
    g = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                  is_pure=False, pack=1)
    tl.store(clk_ptr + t.to(tl.int64) * 32 + i, g)


@triton.jit
def _token_group('''

# (anchor in resolve.py, replacement): each anchor must occur exactly once
TICKS = (
    ("\n@triton.jit\ndef _token_group(", _TICK_FN),
    ("def resolve_kernel(\n    req_ids_ptr,", "def resolve_kernel(\n    clk_ptr,\n    req_ids_ptr,"),
    ("    t = tl.program_id(0)\n    my_id, off, r, live = _token_group(t, req_ids_ptr, id_to_slot_ptr, "
     "max_request_id, R, Q, CH)\n\n    kk",
     "    t = tl.program_id(0)\n    _tick(clk_ptr, t, 0)\n    my_id, off, r, live = _token_group(t, req_ids_ptr, "
     "id_to_slot_ptr, max_request_id, R, Q, CH)\n\n    kk"),
    ("            # P1: positions, host rows", "            _tick(clk_ptr, t, 1)\n            # P1: positions, host rows"),
    ("            # P2: stamp the hits", "            _tick(clk_ptr, t, 2)\n            # P2: stamp the hits"),
    ("            m = tl.sum(tl.sum(gmiss.to(tl.int32), axis=1), axis=0)\n            if m > 0:\n",
     "            m = tl.sum(tl.sum(gmiss.to(tl.int32), axis=1), axis=0)\n            _tick(clk_ptr, t, 3)\n"
     "            if m > 0:\n"),
    ("                if m > 1:\n                    # put the parked",
     "                _tick(clk_ptr, t, 4)\n                if m > 1:\n                    # put the parked"),
    ("            tl.store(step_ptr + r, s_new)\n", "            _tick(clk_ptr, t, 5)\n            tl.store(step_ptr + r, s_new)\n"),
    ("            if m > 0:\n                tl.debug_barrier()\n                # P3",
     "            _tick(clk_ptr, t, 6)\n            if m > 0:\n                tl.debug_barrier()\n                # P3"),
    ("                m2 = m - tl.sum(emp, axis=0)\n",
     "                m2 = m - tl.sum(emp, axis=0)\n                _tick(clk_ptr, t, 7)\n                nprobe = m2 * 0\n"),
    ("                        mid = lo + (hi - lo) // 2\n",
     "                        mid = lo + (hi - lo) // 2\n                        nprobe += 1\n"),
    ("                    below = occ & (st < lo)\n", "                    _tick(clk_ptr, t, 8)\n                    below = occ & (st < lo)\n"),
    ("                        mid = plo + (phi - plo) // 2\n",
     "                        mid = plo + (phi - plo) // 2\n                        nprobe += 1000\n"),
    ("                    vic = vic | below | (eq & (spo <= plo))\n",
     "                    vic = vic | below | (eq & (spo <= plo))\n"
     "                    tl.store(clk_ptr + t.to(tl.int64) * 32 + 25, nprobe.to(tl.int64))\n"
     "                    tl.store(clk_ptr + t.to(tl.int64) * 32 + 26, tl.sum(eq.to(tl.int32), axis=0).to(tl.int64))\n"
     "                _tick(clk_ptr, t, 9)\n"),
    ("                tl.debug_barrier()  # the victim list is written before it is read\n",
     "                _tick(clk_ptr, t, 10)\n"),
    ("                if npaired != m:\n", "                _tick(clk_ptr, t, 11)\n                if npaired != m:\n"),
    ("                gslot = tl.where(gmiss, fresh, gslot)\n",
     "                gslot = tl.where(gmiss, fresh, gslot)\n                _tick(clk_ptr, t, 12)\n"),
    ("            if MISS_LISTS:\n                # every miss lane",
     "            _tick(clk_ptr, t, 13)\n            tl.store(clk_ptr + t.to(tl.int64) * 32 + 24, m.to(tl.int64))\n"
     "            if MISS_LISTS:\n                # every miss lane"),
)


class AnchorError(RuntimeError):
    """The resolve kernel's source no longer has a phase anchor this tool inserts at."""


def instrumented_source(src: str | None = None) -> str:
    """resolve.py with the ticks inserted (``clk_ptr``: int64 [T, 32], the first argument)."""
    src = KERNEL_SRC.read_text() if src is None else src
    for i, (old, new) in enumerate(TICKS):
        n = src.count(old)
        if n != 1:
            raise AnchorError(f"anchor {i} occurs {n} times in {KERNEL_SRC.name} (expected once): "
                              f"{old.strip()[:70]!r}; update benchmarks/resolve_phases.TICKS")
        src = src.replace(old, new)
    return src


_KEEP: list = []  # the generated module's directory lives as long as the process (Triton reads the source)


def load_instrumented():
    """The instrumented ``resolve_kernel`` (imported from a temporary file)."""
    d = tempfile.TemporaryDirectory(prefix="hisparse-resolve-phases-")
    _KEEP.append(d)
    path = Path(d.name) / "resolve_phases_kernel.py"
    path.write_text(instrumented_source())
    spec = importlib.util.spec_from_file_location("resolve_phases_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.resolve_kernel


class _Launch:
    """Stands in for ``resolve_kernel`` in the launcher: clears the clock tensor, then
    kernel[grid](clk, *args), so the clocks are those of the last launch only (a program
    skips the ticks of phases it has no work for). Both are captured into a graph."""

    def __init__(self, kernel, clk) -> None:
        self.kernel, self.clk = kernel, clk

    def __getitem__(self, grid):
        def launch(*a, **k):
            self.clk.zero_()
            return self.kernel[grid](self.clk, *a, **k)
        return launch


@contextlib.contextmanager
def _swapped(launcher):
    """The resolve launcher calls ``launcher`` instead of ``resolve_kernel`` inside the block."""
    from hisparse.cache import set_resolve_kernel
    orig = set_resolve_kernel(launcher)
    try:
        yield
    finally:
        set_resolve_kernel(orig)


def summarize(clk) -> dict:
    """Mean phase times (us) over the programs that reached the last tick."""
    import torch
    c = clk.cpu()
    c = c[c[:, NTICKS - 1] > 0]
    if not len(c):
        return {"programs": 0}
    t0 = c[:, 0].min()
    out = {"programs": len(c), "span_us": (c[:, NTICKS - 1].max() - t0).item() / 1e3,
           "start_spread_us": (c[:, 0].max() - t0).item() / 1e3, "phases_us": {}}
    for p in range(NTICKS - 1):
        ok = (c[:, p] > 0) & (c[:, p + 1] > 0)
        if ok.any():
            out["phases_us"][f"{p}-{p + 1} {PHASES[p]}"] = ((c[ok, p + 1] - c[ok, p]).double().mean() / 1e3).item()
    out["misses_per_program"] = float(c[:, 24].double().mean())
    probes = c[:, 25]
    out["stamp_probes"] = float((probes % 1000).double().mean())
    out["position_probes"] = float(torch.div(probes, 1000, rounding_mode="floor").double().mean())
    out["threshold_tier"] = float(c[:, 26].double().mean())
    return out


def _topk(cache, B: int, K: int, S: int, ctx: int, hit: float, g):
    """int32 [B, K]: about hit * K positions drawn from each request's hot slots, the
    rest from its cold positions (never the newest, ctx - 1)."""
    import torch
    sp = cache.state.slot_pos[0, :B, :S].cpu()
    out = torch.empty((B, K), dtype=torch.int32)
    for b in range(B):
        hot = sp[b][sp[b] >= 0].long()
        nh = min(round(hit * K), hot.numel())
        cold_mask = torch.ones(ctx, dtype=torch.bool)
        cold_mask[hot] = False
        cold_mask[ctx - 1] = False
        cold = cold_mask.nonzero().flatten()
        row = torch.cat([hot[torch.randperm(hot.numel(), generator=g)[:nh]],
                         cold[torch.randperm(cold.numel(), generator=g)[:K - nh]]])
        out[b] = row[torch.randperm(K, generator=g)].to(torch.int32)
    return out.cuda()


def standalone(a: argparse.Namespace, kernel) -> list[dict]:
    import torch

    from hisparse import HiSparseCache, HiSparseConfig
    from hisparse.cache import ResolveBuffers, resolve_triton
    K, ctx, Bmax = a.top_k, a.context, max(a.batch)
    names = ("slot_pos", "slot_stamp", "row_slot", "step", "stats", "seq_lens")
    flush = common.L2Flush(torch.device("cuda"))
    cases = []
    for S in a.slots:
        cfg = HiSparseConfig(num_layers=1, host_pool_tokens=Bmax * math.ceil(ctx / 64) * 64, row_bytes=656,
                             top_k=K, device_buffer_size=S, max_num_reqs=Bmax, host_block_size=64,
                             max_request_id=max(16, Bmax), device="cuda")
        cache = HiSparseCache(cfg, kernels="triton")
        rows = torch.randint(0, 256, (ctx, 656), dtype=torch.uint8, device="cuda")
        for b in range(Bmax):
            cache.add_request(b)
            cache.write(0, b, rows)
        cache.streams.join_backup()
        g = torch.Generator().manual_seed(S)
        req_all = torch.arange(Bmax, dtype=torch.int32, device="cuda")
        for w in range(a.warm):
            cache.resolve(0, req_all, _topk(cache, Bmax, K, S, ctx, a.hit if w else 0.0, g), validate=False)
            print(f"[phases] S={S}: warm-up resolve {w + 1}/{a.warm}", end="\r", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        tk_all = _topk(cache, Bmax, K, S, ctx, a.hit, g)
        saved = {n: getattr(cache.state, n).clone() for n in names}
        for B in a.batch:
            req, tk = req_all[:B], tk_all[:B].contiguous()
            out = ResolveBuffers.allocate(B, K, torch.device("cuda"))
            case = {"slots": S, "batch": B, "context": ctx}

            def launch():
                resolve_triton(cache.state, 0, req, tk, out, max_query_len=1)
            for cold in (False, True):
                def before():
                    for n in names:
                        getattr(cache.state, n).copy_(saved[n])
                    if cold:
                        flush.flush()
                before()
                launch()  # compiles
                before()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    launch()
                us = common.time_calls(graph.replay, reps=a.reps, warmup=2, cuda=True, before=before,
                                       gpu_sleep=True)
                clk = torch.zeros((B, CLK_COLS), dtype=torch.int64, device="cuda")
                runs = []
                with _swapped(_Launch(kernel, clk)):
                    for i in range(a.reps + 2):
                        before()
                        launch()
                        torch.cuda.synchronize()
                        if i >= 2:
                            runs.append(summarize(clk))
                s = runs[-1]
                s["span_us"] = statistics.median(r["span_us"] for r in runs)
                s["phases_us"] = {k: statistics.median(r["phases_us"][k] for r in runs) for k in s["phases_us"]}
                case["cold_l2" if cold else "warm_l2"] = {"kernel_graph": common.stats(us, unit="_us"), "instrumented": s}
            misses = int(out.stage_counts[:B].sum())
            case["misses"] = misses
            print(json.dumps(case), flush=True)
            cases.append(case)
        cache = None  # free the cache (launch() shares the name: no del)
        torch.cuda.empty_cache()
    return cases


def capacity(argv: list[str], kernel) -> tuple[int, dict]:
    import torch

    from benchmarks import bench_capacity
    clk = torch.zeros((4096, CLK_COLS), dtype=torch.int64, device="cuda")
    with _swapped(_Launch(kernel, clk)):
        rc = bench_capacity.main(argv)
    torch.cuda.synchronize()
    s = summarize(clk)
    print(f"[phases] capacity, the last resolve: {json.dumps(s)}", flush=True)
    return rc, s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m benchmarks.resolve_phases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("where", nargs="?", choices=["standalone", "capacity"], default="standalone")
    pos = common.positive_int
    ap.add_argument("--slots", type=pos, nargs="+", default=[5120], help="hot slots S [5120]")
    ap.add_argument("--batch", type=pos, nargs="+", default=[66, 13], help="requests B [66 13]")
    ap.add_argument("--context", type=pos, default=131072, help="tokens per request [131072]")
    ap.add_argument("--top-k", type=pos, default=2048)
    ap.add_argument("--hit", type=common.fraction, default=0.936, help="hit fraction of the trace [0.936]")
    ap.add_argument("--warm", type=pos, default=24, help="resolves before the measured one [24]")
    ap.add_argument("--reps", type=pos, default=12)
    ap.add_argument("--dry-run", action="store_true", help="CPU: build the instrumented kernel, launch nothing")
    ap.add_argument("--out", default=None)
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if a.where == "standalone" and rest:
        print("resolve_phases: arguments after -- are for the capacity mode", file=sys.stderr)
        return 2
    if a.where == "standalone" and a.context < max(a.slots) + a.top_k + 1:
        print(f"resolve_phases: --context must be >= S + top-k + 1 = {max(a.slots) + a.top_k + 1}", file=sys.stderr)
        return 2
    if not common.out_ok(a.out, "resolve_phases"):
        return 2
    try:
        kernel = load_instrumented()
    except AnchorError as e:
        print(f"resolve_phases: {e}", file=sys.stderr)
        return 1
    if a.dry_run:
        print(f"resolve_phases: instrumented kernel built ({NTICKS} ticks, first argument {kernel.arg_names[0]}); "
              "nothing launched (--dry-run)")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("resolve_phases: no CUDA device; --dry-run checks the instrumented kernel on CPU", file=sys.stderr)
        return 2
    result = {"bench": "resolve_phases", "where": a.where, "env": common.environment(), "args": vars(a) | {"capacity_args": rest}}
    rc = 0
    if a.where == "standalone":
        result["cases"] = standalone(a, kernel)
    else:
        rc, result["last_resolve"] = capacity(rest, kernel)
        result["capacity_rc"] = rc
    if a.out:
        common.write_json(a.out, result)
    return rc


if __name__ == "__main__":
    sys.exit(main())
