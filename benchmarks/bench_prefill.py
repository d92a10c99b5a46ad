"""Benchmark: prefill staging throughput, host pool -> workspace, against a bulk copy.

For N in {8K, 64K, 512K} rows and both row formats, the rows of N/8K requests (8K rows
each, 64-row blocks scattered at random over a pinned host pool twice that size) are
staged by ``hisparse.staging.stage_prefill`` into a GPU workspace:
  * fp8_ds_mla -> bf16 workspace (dequantised in-kernel), fp8_ds_mla -> stored uint8,
  * bf16 -> bf16 workspace.
Baseline, measured in the same run: a bulk pinned host -> device ``copy_`` of the
same number of source bytes (one contiguous slice of the same pinned pool).
Reported: min / median / p99 time (us), source GB/s at the median, and the ratio of
staging throughput to the bulk copy (target >= 0.8). A few rows-per-program /
num_warps variants are timed and the best is named. Every staged workspace is checked
byte-exact against the torch reference once.

Each variant (and the bulk copy) is timed twice: eager (``--inner`` back-to-back calls per
sample, Python included) and graph-replayed (the same calls captured once in a CUDA
graph: GPU time only). The host CPU time of one call is reported too (``--profile-host``
prints a cProfile of it for the smallest fp8 -> bf16 case).

    python -m benchmarks.bench_prefill --out prefill.json           # full (H200)
    python -m benchmarks.bench_prefill --quick --out q.json         # 8K and 64K only, fewer reps
    python -m benchmarks.bench_prefill --dry-run                     # tiny, CPU (interpreter)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from benchmarks import common

common.interpret_dry_run()  # without a GPU a dry run needs the interpreter; before hisparse loads

from hisparse.staging import BlockTable, LayerView, StageRequests, stage_prefill  # noqa: E402
from hisparse.device import PinnedBuffer  # noqa: E402

ROW_BYTES = {"fp8_ds_mla": 656, "bf16": 1152}
MODES = [("fp8_ds_mla", "bf16"), ("fp8_ds_mla", "stored"), ("bf16", "bf16")]


def summarize(us: list[float], nbytes: int) -> dict:
    """min / median / p99 microseconds (``*_us``, ``reps``) and GB/s of ``nbytes`` at the median."""
    d = common.stats(us, unit="_us", count="reps")
    d["gbps_median"] = nbytes / (d["median_us"] * 1e-6) / 1e9
    return d


class Timer:
    """CUDA-event timing on GPU, perf_counter on CPU. Each sample times ``inner``
    back-to-back calls (so Python launch overhead overlaps GPU work, as in a serving
    loop) and reports the time per call (microseconds)."""

    def __init__(self, cuda: bool, inner: int = 1) -> None:
        self.cuda = cuda
        self.inner = inner

    def run(self, fn, reps: int, warmup: int) -> list[float]:
        return common.time_calls(fn, reps=reps, warmup=warmup, cuda=self.cuda, inner=self.inner)

    def run_graph(self, fn, reps: int, warmup: int) -> list[float]:
        """Time ``inner`` calls captured once in a CUDA graph and replayed: the GPU time
        of the work without the Python launch cost (CUDA only)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3 / self.inner)
        del graph
        return out


def _graph_cols(b: dict | None) -> str:
    if not b:
        return "  | n/a"
    g = b["graph"]
    return f"  | {g['ratio_vs_bulk']:.2f} {g['median_us']:9.1f} ({b['rows_per_program']}, {b['num_warps']})"


def fill_random(pool: torch.Tensor, fmt: str, dev: torch.device, seed: int) -> None:
    """Valid rows (fp8: no NaN codes, finite scales) written chunk by chunk."""
    g = torch.Generator(device=dev).manual_seed(seed)
    H = pool.shape[0]
    step = 1 << 16
    for a in range(0, H, step):
        n = min(H, a + step) - a
        if fmt == "bf16":
            rows = torch.randn(n, 576, generator=g, device=dev).to(torch.bfloat16).view(torch.uint8)
        else:
            codes = torch.randint(0, 256, (n, 512), generator=g, device=dev, dtype=torch.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x3C
            scales = (torch.rand(n, 4, generator=g, device=dev) * 4 + 0.01).view(torch.uint8)
            rope = torch.randn(n, 64, generator=g, device=dev).to(torch.bfloat16).view(torch.uint8)
            rows = torch.cat([codes, scales, rope], dim=1)
        pool[a:a + n].copy_(rows.cpu() if pool.device.type == "cpu" else rows)


def _host_us_per_call(fn, calls: int = 50, profile: bool = False) -> float:
    """CPU time of one unchecked call (launches are asynchronous; 50 stay well inside the
    launch queue). With ``profile``, print where that time goes (cProfile)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def _time_variant(timer: Timer, base: dict, kw: dict, ws, src_bytes: int, rows: int, warps: int,
                  reps: int, warmup: int) -> dict:
    """Eager (and, on CUDA, graph-replayed) timing of one launch shape."""
    def call():
        stage_prefill(*kw["args"], ws, rows_per_program=rows, num_warps=warps, **kw["opts"])

    s = summarize(timer.run(call, reps, warmup), src_bytes)
    s.update(rows_per_program=rows, num_warps=warps, ratio_vs_bulk=s["gbps_median"] / base["gbps_median"])
    if timer.cuda:
        try:
            gs = summarize(timer.run_graph(call, reps, warmup), src_bytes)
            gs["ratio_vs_bulk"] = gs["gbps_median"] / base["graph"]["gbps_median"]
            s["graph"] = gs
        except Exception as e:  # report, keep the eager figures
            s["graph"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return s


def bench_case(fmt: str, ws_kind: str, N: int, *, dev, timer: Timer, reps: int, warmup: int, req_rows: int,
               variants: list[tuple[int, int]], seed: int, pool_cache: dict,
               profile_host: bool = False) -> dict:
    rb = ROW_BYTES[fmt]
    B = 64
    P = max(1, N // req_rows)
    per = N // P
    nb_per = -(-per // B)
    H = 2 * P * nb_per * B  # pool twice the staged rows: blocks scattered
    key = (fmt, H)
    if key not in pool_cache:
        pool_cache.clear()  # keep one pool alive at a time
        buf = PinnedBuffer(H * rb) if dev.type == "cuda" else None
        pool = buf.tensor.view(H, rb) if buf is not None else torch.empty(H, rb, dtype=torch.uint8)
        fill_random(pool, fmt, dev, seed)
        pool_cache[key] = (buf, pool)
    _, pool = pool_cache[key]
    g = torch.Generator().manual_seed(seed + N)
    bt = torch.randperm(H // B, generator=g)[: P * nb_per].view(P, nb_per).to(torch.int32).to(dev)
    slots = torch.arange(P, dtype=torch.int32, device=dev)
    lens = torch.full((P,), per, dtype=torch.int32, device=dev)
    starts = torch.arange(P, dtype=torch.int32, device=dev) * per
    W = P * per
    ws = (torch.empty((W, 576), dtype=torch.bfloat16, device=dev) if ws_kind == "bf16"
          else torch.empty((W, rb), dtype=torch.uint8, device=dev))
    src_bytes = W * rb
    view = LayerView(host_rows=pool, blocks=BlockTable(bt, B), row_format=fmt)
    reqs = StageRequests(req_slots=slots, seq_lens=lens, starts=starts, max_rows=per)
    kw = dict(args=(view, reqs), opts=dict(validate=False, kernels="triton"))

    # correctness once (checked call, then the reference)
    stage_prefill(view, reqs, ws, validate=True, kernels="triton")
    ref = torch.empty_like(ws)
    stage_prefill(view, reqs, ref, validate=True, kernels="torch")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if not torch.equal(ws.view(torch.uint8), ref.view(torch.uint8)):
        raise RuntimeError(f"staging mismatch vs reference: {fmt} -> {ws_kind}, N={N}")
    del ref

    # baseline: bulk pinned H2D copy of the same source bytes
    flat = pool.view(-1)[:src_bytes]
    dst = torch.empty(src_bytes, dtype=torch.uint8, device=dev)
    base_t = timer.run(lambda: dst.copy_(flat, non_blocking=True), reps, warmup)
    base = summarize(base_t, src_bytes)
    if timer.cuda:
        base["graph"] = summarize(timer.run_graph(lambda: dst.copy_(flat, non_blocking=True), reps, warmup),
                                  src_bytes)
    dst = None  # free it (the lambdas above are done)

    results = [_time_variant(timer, base, kw, ws, src_bytes, rows, warps, reps, warmup)
               for rows, warps in variants]
    host_us = _host_us_per_call(lambda: stage_prefill(view, reqs, ws, **kw["opts"]), calls=50 if timer.cuda else 2,
                                profile=profile_host)
    best = max(results, key=lambda s: s["gbps_median"])
    graphed = [s for s in results if "ratio_vs_bulk" in s.get("graph", {})]
    best_graph = max(graphed, key=lambda s: s["graph"]["gbps_median"]) if graphed else None
    return {"format": fmt, "workspace": ws_kind, "rows": W, "requests": P, "block_size": B,
            "source_bytes": src_bytes, "bulk_h2d": base, "variants": results, "best": best,
            "host_us_per_call": host_us,
            "best_graph": best_graph}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write JSON results here")
    ap.add_argument("--quick", action="store_true", help="8K and 64K rows, fewer reps")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes; runs on CPU (Triton interpreter)")
    ap.add_argument("--rows", type=common.positive_int, nargs="*", help="staged row counts (default 8192 65536 524288)")
    ap.add_argument("--profile-host", action="store_true",
                    help="print a cProfile of the host side of one staging call (fp8 -> bf16, smallest size)")
    ap.add_argument("--reps", type=common.positive_int, help="timed samples (default 30, quick 10)")
    ap.add_argument("--inner", type=common.positive_int, default=None, help="back-to-back calls per sample (default 5, dry run 1)")
    args = ap.parse_args(argv)
    if not common.out_ok(args.out, "bench_prefill"):
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("bench_prefill: no CUDA GPU; use --dry-run for the tiny CPU check", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    if args.dry_run:
        sizes, reps, warmup, req_rows = args.rows or [64, 200], args.reps or 2, 1, 64
        variants = [(8, 4), (16, 4)]
    else:
        sizes = args.rows or ([8192, 65536] if args.quick else [8192, 65536, 524288])
        reps = args.reps or (10 if args.quick else 30)
        warmup, req_rows = 3, 8192
        variants = ([(4, 4), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8)] if not args.quick
                    else [(8, 4), (16, 8)])
    inner = args.inner or (1 if args.dry_run else 5)
    env = {**common.environment(dev), "device": str(dev)}
    env["inner_calls_per_sample"] = inner
    print(f"bench_prefill on {env.get('gpu') or 'CPU (dry run)'}: torch {env['torch']}, triton {env['triton']}")
    print(f"{'format':>10} {'workspace':>9} {'rows':>8} {'bulk GB/s':>10} {'stage GB/s':>10} {'ratio':>6} "
          f"{'min us':>9} {'med us':>9} {'p99 us':>9}  best (rows/prog, warps)  | graph-replayed: ratio, med us, best")
    cases = []
    pool_cache: dict = {}
    for fmt, ws_kind in MODES:
        for N in sizes:
            c = bench_case(fmt, ws_kind, N, dev=dev, timer=Timer(cuda, inner), reps=reps, warmup=warmup,
                           req_rows=req_rows, variants=variants, seed=17, pool_cache=pool_cache,
                           profile_host=args.profile_host and N == min(sizes) and ws_kind == "bf16"
                           and fmt == "fp8_ds_mla")
            b, base = c["best"], c["bulk_h2d"]
            print(f"{fmt:>10} {ws_kind:>9} {c['rows']:>8} {base['gbps_median']:>10.2f} {b['gbps_median']:>10.2f} "
                  f"{b['ratio_vs_bulk']:>6.2f} {b['min_us']:>9.1f} {b['median_us']:>9.1f} {b['p99_us']:>9.1f}  "
                  f"({b['rows_per_program']}, {b['num_warps']})" + _graph_cols(c["best_graph"])
                  + f"  | host {c['host_us_per_call']:.0f} us/call", flush=True)
            cases.append(c)
    pool_cache.clear()
    worst = min(c["best"]["ratio_vs_bulk"] for c in cases)
    target = 0.8
    summary = {"worst_ratio_vs_bulk": worst, "target": target, "meets_target": worst >= target,
               "note": "dry run: CPU interpreter timings, not meaningful" if args.dry_run else ""}
    print(f"worst staging/bulk ratio {worst:.2f} (eager calls, target >= {target}): "
          f"{'OK' if worst >= target else 'BELOW TARGET'}{' [dry run]' if args.dry_run else ''}")
    if all(c["best_graph"] for c in cases):
        wg = min(c["best_graph"]["graph"]["ratio_vs_bulk"] for c in cases)
        summary.update(worst_graph_ratio_vs_bulk=wg, graph_meets_target=wg >= target)
        print(f"worst staging/bulk ratio {wg:.2f} (graph-replayed, both sides; target >= {target}): "
              f"{'OK' if wg >= target else 'BELOW TARGET'}")
    result = {"benchmark": "prefill_staging", "env": env, "quick": args.quick, "dry_run": args.dry_run,
              "cases": cases, "summary": summary}
    if args.out:
        common.write_json(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
