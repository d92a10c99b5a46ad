"""Launch-shape sweep of hisparse's Triton sparse-MLA decode kernels (to pick
``triton_backend.DEFAULT_CONFIGS`` / ``WS_DEFAULT``).

For each case (row format, T query tokens, H heads, K = 2048) every candidate
``(block_h, block_n, num_warps, num_stages)`` of ``CANDIDATE_SHAPES`` below
(with block_h <= next_pow2(H)) is timed with a few KV-split counts, next to the
baseline = the backend's current ``default_config`` measured in the same run.

Setup: N = T * 4096 rows (like one layer's hot buffers), random rows per token, no
padding; the unchecked path (validate=False). Timing: CUDA events around each call,
L2 flushed (256 MiB write) before every call unless --no-flush. Reported per config:
min / median / p99 us, ``speedup`` = baseline median / config median (> 1: faster
than the default), ``vs_flashmla`` = 108.9 us / median for the fp8 T=64 H=128 case
(FlashMLA's time measured on the H200, ../shared/GPU.md; bench_decode.py measures
FlashMLA live), and max |out err| of the first tokens against the float32 reference.
A config that fails to compile or run is recorded with its error and skipped.

  python -m benchmarks.bench_triton_configs --out results/triton_configs.json [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import L2Flush, environment, out_ok, stats, time_calls
from hisparse.attention import ReferenceBackend, TritonBackend, TritonMLAConfig, auto_splits, default_config
from hisparse.formats import quantize_fp8_ds_mla

FLASHMLA_US = {("fp8_ds_mla", 64, 128): 108.9, ("fp8_ds_mla", 1, 128): 42.6,
               ("fp8_ds_mla", 8, 128): 49.1, ("fp8_ds_mla", 256, 128): 418.5}
SPOT = 4
# (block_h, block_n, num_warps, num_stages) tried by default (--shapes replaces them)
CANDIDATE_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 2), (64, 16, 8, 3),
    (64, 32, 16, 2), (64, 16, 4, 2), (64, 32, 4, 2), (32, 32, 8, 2), (32, 16, 4, 2),
    (16, 64, 8, 2), (16, 16, 4, 2), (16, 32, 4, 2),
)


def time_fn(fn, *, warmup: int, iters: int, flush: bool) -> dict:
    """min / median / p99 us of ``iters`` event-timed calls, L2 flushed before each."""
    before = L2Flush(torch.device("cuda")).flush if flush else None
    return stats(time_calls(fn, reps=iters, warmup=warmup, cuda=True, before=before))


def make_problem(T: int, H: int, K: int, fmt: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = T * 4096
    x = torch.randn(N, 576, device="cuda", generator=g).bfloat16()
    rows = quantize_fp8_ds_mla(x) if fmt == "fp8_ds_mla" else x
    q = torch.randn(T, H, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, N, (T, K), device="cuda", generator=g, dtype=torch.int32)
    return q, rows, idx


def run_case(fmt: str, T: int, H: int, K: int, args) -> dict:
    q, rows, idx = make_problem(T, H, K, fmt, seed=T * 1000 + H)
    scale = 1.0 / math.sqrt(576)
    ref_out, _ = ReferenceBackend().decode(q[:SPOT], rows, idx[:SPOT], sm_scale=scale,
                                           row_format=fmt)
    base_cfg = default_config(T, H, K, q.device, fmt)
    max_bh = min(64, max(16, 1 << max(0, (H - 1).bit_length())))
    shapes = [s for s in CANDIDATE_SHAPES if s[0] <= max_bh]
    if args.quick:
        shapes = [s for s in shapes if s[0] == max_bh]
    results = []

    def measure(name: str, cfg: TritonMLAConfig) -> dict:
        rec = {"config": name, **dataclasses.asdict(cfg)}
        be = TritonBackend(config=cfg, validate=False)
        try:
            t0 = time.time()
            out, _ = be.decode(q, rows, idx, sm_scale=scale, row_format=fmt)
            torch.cuda.synchronize()
            rec["first_call_s"] = round(time.time() - t0, 2)
            rec["max_err"] = (out[:SPOT].float() - ref_out.float()).abs().max().item()
            rec["us"] = time_fn(lambda: be.decode(q, rows, idx, sm_scale=scale, row_format=fmt),
                                warmup=args.warmup, iters=args.iters, flush=not args.no_flush)
        except Exception as e:  # a config that can't compile/run on this GPU: record it, go on
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc(limit=2)
        results.append(rec)
        return rec

    ws_shapes = []
    if args.shapes:
        ws_shapes = [tuple(int(v) for v in sh[3:].split(",")) for sh in args.shapes
                     if sh.startswith("ws:")]
        shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes
                  if not sh.startswith("ws:")]
    base = measure("default", base_cfg)
    # the warp-specialised Gluon kernel: ws:BN,STAGES,RAW[,PRODUCER_REGS]
    for shape in ws_shapes:
        bn, ns, raw = shape[:3]
        preg = shape[3] if len(shape) > 3 else 56
        auto = TritonMLAConfig(block_h=64, block_n=bn, num_warps=4, num_stages=ns, ws=True,
                               ws_raw=raw, ws_producer_regs=preg)
        ws_splits = {auto_splits(T, H, K, auto, q.device), 1} | set(args.splits or ())
        for sp in sorted(ws_splits):
            measure(f"ws_n{bn}s{ns}r{raw}p{preg}x{sp}", dataclasses.replace(auto, num_splits=sp))
    for shape in shapes:
        bh, bn, nw, ns = shape[:4]
        iso = bool(shape[4]) if len(shape) > 4 else False
        pf = shape[5] if len(shape) > 5 else 0
        wide = bool(shape[6]) if len(shape) > 6 else False
        if bh > 2 * max_bh:
            continue
        auto = TritonMLAConfig(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns,
                               isolate_qk=iso, prefetch=pf, wide=wide)
        splits = sorted(({auto_splits(T, H, K, auto, q.device), 1, 2} if not args.quick
                         else {auto_splits(T, H, K, auto, q.device), 1}) | set(args.splits or ()))
        for sp in splits:
            cfg = dataclasses.replace(auto, num_splits=sp)
            name = (f"h{bh}n{bn}w{nw}s{ns}{'i' if iso else ''}{f'p{pf}' if pf else ''}"
                    f"{'W' if wide else ''}x{sp}")
            measure(name, cfg)
    base_med = base.get("us", {}).get("median")
    fm = FLASHMLA_US.get((fmt, T, H))
    for r in results:
        if "us" in r:
            if base_med:
                r["speedup"] = base_med / r["us"]["median"]
            if fm:
                r["vs_flashmla"] = fm / r["us"]["median"]
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"]["median"]) if ok else None
    print(f"\n== {fmt} T={T} H={H} K={K}  (baseline default: {base['config']} "
          f"{dataclasses.asdict(base_cfg)})")
    print(f"{'config':22s} {'min':>8s} {'median':>8s} {'p99':>8s} {'speedup':>8s} "
          f"{'vs_fmla':>8s} {'max_err':>8s}")
    for r in sorted(ok, key=lambda r: r["us"]["median"]):
        print(f"{r['config']:22s} {r['us']['min']:8.1f} {r['us']['median']:8.1f} "
              f"{r['us']['p99']:8.1f} {r.get('speedup', float('nan')):8.2f} "
              f"{r.get('vs_flashmla', float('nan')):8.2f} {r['max_err']:8.4f}")
    for r in results:
        if "error" in r:
            print(f"{r['config']:22s} ERROR {r['error'][:150]}")
    if best:
        print(f"best: {best['config']} median {best['us']['median']:.1f} us"
              + (f" (FlashMLA {fm} us -> ratio {fm / best['us']['median']:.2f}, target >= 0.7)"
                 if fm else ""))
    return {"format": fmt, "T": T, "H": H, "K": K, "baseline": base["config"],
            "best": best["config"] if best else None, "results": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--quick", action="store_true", help="one case, fewer configs and iterations")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-flush", action="store_true", help="don't flush L2 before each call")
    ap.add_argument("--shapes", nargs="+", metavar="BH,BN,W,S[,ISO[,PF[,WIDE]]] or ws:BN,S,RAW[,PREG]",
                    help="launch shapes to try instead of CANDIDATE_SHAPES "
                         "(block_h, block_n, num_warps, num_stages, isolate_qk 0/1, "
                         "prefetch distance 0-3, wide 0/1; ws: block_n, bf16 ring slots, "
                         "raw slots, producer registers)")
    ap.add_argument("--splits", nargs="+", type=int, metavar="N",
                    help="KV splits to try for every shape, besides 1 and auto_splits' choice")
    ap.add_argument("--cases", nargs="+", metavar="FMT,T,H",
                    help="cases to run instead of the built-in list, e.g. fp8_ds_mla,64,128")
    args = ap.parse_args(argv)
    for sp in args.splits or ():
        try:
            TritonMLAConfig(num_splits=sp)  # the range a launch shape takes
        except ValueError as e:
            ap.error(f"--splits {sp}: {e}")
    if not out_ok(args.out, "bench_triton_configs"):
        return 2
    if not torch.cuda.is_available():
        print("bench_triton_configs: no CUDA device; it times the Triton decode kernel's launch "
              "shapes on a GPU", file=sys.stderr)
        return 2
    if args.iters is None:
        args.iters = 20 if args.quick else 50
    K = 2048
    cases = [("fp8_ds_mla", 64, 128)]
    if not args.quick:
        cases += [("fp8_ds_mla", 1, 128), ("fp8_ds_mla", 8, 128), ("fp8_ds_mla", 256, 128),
                  ("bf16", 64, 128), ("fp8_ds_mla", 64, 16)]
    if args.cases:
        cases = [(c.split(",")[0], int(c.split(",")[1]), int(c.split(",")[2])) for c in args.cases]
    env = environment()
    env.update(capability=list(torch.cuda.get_device_capability()), sms=env["sm_count"],
               flush_l2=not args.no_flush, iters=args.iters)
    print("env:", json.dumps(env))
    out = {"env": env, "cases": []}
    for fmt, T, H in cases:
        out["cases"].append(run_case(fmt, T, H, K, args))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))  # partial results survive a timeout
    print("\nsummary (best per case):")
    for c in out["cases"]:
        print(f"  {c['format']:10s} T={c['T']:<4d} H={c['H']:<4d} best={c['best']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
