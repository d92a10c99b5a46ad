"""Sparse-MLA decode benchmark: hisparse's Triton backend vs FlashMLA and FlashInfer.

Setup per case (H heads, T query tokens, K = 2048 selected rows per token):
  rows:    a flat view of N = T * 4096 rows (like one layer's hot buffers), fp8_ds_mla
           (656 B, quantised by hisparse.formats) or bf16 (1152 B)
  indices: int32 [T, K], uniformly random rows (``--pad-frac`` of them -1)
Backends timed (each skipped with its reason where it can't run):
  triton       hisparse's Triton backend, unchecked path (validate=False, no host sync)
  flashmla     hisparse's FlashMLA wrapper (fp8_ds_mla only), unchecked path
  flashmla_op  the bare FlashMLA op on pre-padded inputs with a cached schedule: the
               library's own number, the baseline for the triton/FlashMLA ratio
  flashinfer   hisparse's FlashInfer wrapper (bf16 only): ``run`` timed after one plan;
               plan + run (host sync) reported as ``plan_run_us``
The float32 reference is used only to spot-check each backend's output on the first
few tokens (max |err| recorded), never timed.

Timing: CUDA events around each call, ``--iters`` calls after ``--warmup``; L2 is
flushed before every call (a 256 MiB write) unless ``--no-flush``. Reported: min /
median / p99 microseconds, effective GB/s of gathered rows (T*K*row_bytes / median),
the same-run device-to-device copy of that many bytes as a ceiling (``vs_copy``), and
``triton_vs_flashmla`` = FlashMLA op time / Triton time (> 1: Triton faster).

Usage (the FlashMLA library: --flashmla-lib, else $HISPARSE_FLASHMLA_LIB, else
.gpu-deps/vllm/_flashmla_C.abi3.so when present, else an installed vllm/sgl_kernel):
  python -m benchmarks.bench_decode --out results/bench_decode.json [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback

import torch

from benchmarks.common import L2Flush, environment, flashmla_lib, out_ok, stats, write_json
from hisparse.attention import (FlashInferBackend, FlashMLABackend, Phase, ReferenceBackend, TritonBackend,
                                default_config, flashinfer_version)
from hisparse.config import RowFormat
from hisparse.formats import quantize_fp8_ds_mla

FP8, BF16 = RowFormat.FP8_DS_MLA, RowFormat.BF16
ROWS_PER_TOKEN = 4096
SPOT_TOKENS = 4


# ------------------------------------------------------------------ timing
class Timer:
    """CUDA-event timing of a callable, with an optional L2 flush before each call.

    On a CPU device (smoke runs only) wall-clock time stands in for events.
    """

    def __init__(self, *, warmup: int, iters: int, flush: bool, device: torch.device) -> None:
        self.warmup, self.iters, self.flush = warmup, iters, flush
        self.cuda = device.type == "cuda"
        self._l2 = L2Flush(device) if flush and self.cuda else None

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            us = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                us.append((time.perf_counter() - t0) * 1e6)
            return stats(sorted(us))
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for i in range(self.iters):
            if self._l2 is not None:
                self._l2.flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return stats(us)


class TritonVariant(TritonBackend):
    """The Triton backend at a default launch shape with some fields replaced (a same-run
    baseline for what the default changed): the ``tl`` kernels' default unless
    ``allow_ws`` (then the backend's own default, the warp-specialised kernel where it
    runs)."""

    def __init__(self, name: str, allow_ws: bool = False, **overrides) -> None:
        super().__init__(validate=False, allow_interpreter=True)
        self.name, self.overrides, self.allow_ws = name, overrides, allow_ws

    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format):
        cfg = default_config(q.shape[0], q.shape[1], indices.shape[1], q.device, row_format,
                             allow_ws=self.allow_ws, kv_rows=kv_rows)
        self.config = dataclasses.replace(cfg, **self.overrides)
        return super().decode(q, kv_rows, indices, valid_counts=valid_counts, sm_scale=sm_scale,
                              row_format=row_format)


# name -> the default launch shape's fields it replaces
VARIANTS = {"triton_noprefetch": {"prefetch": 0},
            # the tl kernels' default (the fused-tile kernel for fp8 rows at 64-head blocks)
            "triton_tl": {},
            # the default kernel in one launch, whatever the waves of SMs (no wave tail)
            "triton_one_launch": {"allow_ws": True, "wave_tail": False}}


def time_backend(backend, q, rows, idx, *, timer: Timer, valid_counts=None, sm_scale: float,
                 row_format: RowFormat) -> dict:
    """Time ``backend.decode`` on fixed inputs; returns ``stats`` of microseconds."""
    return timer(lambda: backend.decode(q, rows, idx, valid_counts=valid_counts,
                                        sm_scale=sm_scale, row_format=row_format))


# ------------------------------------------------------------------ problem
def make_problem(T: int, H: int, K: int, fmt: RowFormat, *, seed: int, pad_frac: float,
                 rows_per_token: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(seed)
    N = T * rows_per_token
    q = torch.randn(T, H, 576, generator=g, device=device).to(torch.bfloat16)
    rows = torch.empty((N, fmt.row_bytes), dtype=torch.uint8, device=device)
    chunk = 1 << 18  # build rows in chunks: bounded float32 scratch
    for r0 in range(0, N, chunk):
        x = torch.randn(min(chunk, N - r0), 576, generator=g, device=device)
        if fmt is FP8:
            rows[r0:r0 + x.shape[0]] = quantize_fp8_ds_mla(x)
        else:
            rows[r0:r0 + x.shape[0]] = x.to(torch.bfloat16).view(torch.uint8)
    if fmt is BF16:
        rows = rows.view(torch.bfloat16)  # [N, 576]
    idx = torch.randint(0, N, (T, K), generator=g, device=device, dtype=torch.int32)
    if pad_frac > 0:
        idx[torch.rand(T, K, generator=g, device=device) < pad_frac] = -1
    return q, rows, idx, N


def spot_check(out, lse, q, rows, idx, sm_scale, fmt) -> dict:
    """Max |err| of the first few tokens against the float32 reference."""
    n = min(SPOT_TOKENS, q.shape[0])
    ref_out, ref_lse = ReferenceBackend().decode(q[:n], rows, idx[:n], sm_scale=sm_scale,
                                                 row_format=fmt)
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[:n][fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    out_err = (out[:n].float() - ref_out.float()).abs().max().item()
    return {"max_err_out": out_err, "max_err_lse": lse_err}


def flashmla_op_fn(fm: FlashMLABackend, q, rows, idx, sm_scale):
    """The bare FlashMLA op on pre-built inputs (padding and schedule done once)."""
    ops, _ = fm.ops()
    T, H = q.shape[0], q.shape[1]
    hp = 64 if H <= 64 else 128
    if H > 128:
        raise ValueError("flashmla_op timing covers H <= 128")
    q4 = torch.zeros((T, 1, hp, 576), dtype=torch.bfloat16, device=q.device)
    q4[:, 0, :H] = q
    N = rows.shape[0]
    if N % 64 != 0:
        raise ValueError(f"FlashMLA needs 64-row pages; N = {N} is not a multiple of 64")
    kv4 = rows.view(N // 64, 64, 1, 656)
    # the SM90 kernels take top-k in tiles of 64: pad with -1 (what the backend's decode does)
    idx3 = torch.nn.functional.pad(idx, (0, (-idx.shape[1]) % 64), value=-1).unsqueeze(1).contiguous()
    args = dict(q=q4, kv=kv4, indices=idx3, topk_length=None, attn_sink=None,
                tile_scheduler_metadata=None, num_splits=None, extra_kv=None,
                extra_indices=None, extra_topk_length=None, d_v=512, sm_scale=sm_scale)
    for name in ops.decode_fill:
        args[name] = None
    res = ops.decode(**args)
    args["tile_scheduler_metadata"], args["num_splits"] = res[2], res[3]
    return lambda: ops.decode(**args)


# ------------------------------------------------------------------ main loop
def run_case(T, H, K, fmt, args, timer, backends, copy_cache) -> list[dict]:
    sm_scale = 1.0 / math.sqrt(576)
    dev = torch.device(args.device)
    q, rows, idx, N = make_problem(T, H, K, fmt, seed=1000 * T + H, pad_frac=args.pad_frac,
                                   rows_per_token=args.rows_per_token, device=dev)
    nbytes = T * K * fmt.row_bytes
    if nbytes not in copy_cache:  # device-to-device copy of the gathered bytes: the ceiling
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        st = timer(lambda: dst.copy_(src))
        copy_cache[nbytes] = {"us": st, "gbps": nbytes / (st["median"] * 1e-6) / 1e9}
        del src, dst
    copy = copy_cache[nbytes]
    base = {"T": T, "H": H, "K": K, "N": N, "format": fmt.value, "gathered_bytes": nbytes,
            "copy_us": copy["us"], "copy_gbps": copy["gbps"]}
    results = []

    def record(name, fn, check=None, extra=None):
        rec = dict(base, backend=name)
        try:
            if check is not None:
                rec.update(check())
            st = timer(fn)
            gbps = nbytes / (st["median"] * 1e-6) / 1e9
            rec.update(status="ok", us=st, gbps=gbps, vs_copy=gbps / copy["gbps"])
            if extra:
                rec.update(extra())
            print(f"  {name:<12} H={H:<3} T={T:<4} {fmt.value:<10} min {st['min']:8.1f}  "
                  f"med {st['median']:8.1f}  p99 {st['p99']:8.1f} us  {gbps:7.1f} GB/s  "
                  f"({rec['vs_copy']:.2f}x copy)"
                  + (f"  err out {rec['max_err_out']:.1e} lse {rec['max_err_lse']:.1e}"
                     if "max_err_out" in rec else ""), flush=True)
        except Exception as e:  # a benchmark records a failure and goes on
            rec.update(status="error", reason=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc(limit=4))
            print(f"  {name:<12} H={H:<3} T={T:<4} {fmt.value:<10} ERROR {rec['reason']}",
                  flush=True)
        results.append(rec)

    for name, be in backends.items():
        reason = be.supports(device=q.device, row_format=fmt, num_heads=H, phase=Phase.DECODE)
        if reason is not None:
            results.append(dict(base, backend=name, status="unavailable", reason=reason))
            print(f"  {name:<12} H={H:<3} T={T:<4} {fmt.value:<10} unavailable: {reason}")
            if name == "flashmla":
                results.append(dict(base, backend="flashmla_op", status="unavailable",
                                    reason=reason))
            continue

        def check(be=be):
            out, lse = be.decode(q, rows, idx, sm_scale=sm_scale, row_format=fmt)
            return spot_check(out, lse, q, rows, idx, sm_scale, fmt)

        if name == "flashinfer":
            def plan_run(be=be):
                t0 = time.perf_counter()
                for _ in range(3):
                    be.run(be.plan(q, rows, idx, sm_scale=sm_scale, row_format=fmt))
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                return {"plan_run_us": (time.perf_counter() - t0) / 3 * 1e6}

            plan = None

            def fi_run(be=be):
                return be.run(plan)

            def fi_check(be=be):
                nonlocal plan
                r = check()
                plan = be.plan(q, rows, idx, sm_scale=sm_scale, row_format=fmt)
                return r

            record(name, fi_run, fi_check, plan_run)
            continue
        def config(name=name, be=be):
            """The Triton launch shape timed (for the default: what default_config picks,
            with ws_off_reason saying why not the warp-specialised kernel)."""
            if name == "triton":
                return {"config": dataclasses.asdict(default_config(
                    T, H, K, dev, fmt, kv_rows=rows if fmt is FP8 else None))}
            return {"config": dataclasses.asdict(be.config)} if name in VARIANTS else {}

        record(name, lambda be=be: be.decode(q, rows, idx, sm_scale=sm_scale, row_format=fmt),
               check, config)
        if name == "flashmla":
            try:
                op = flashmla_op_fn(be, q, rows, idx, sm_scale)
            except Exception as e:
                results.append(dict(base, backend="flashmla_op", status="error",
                                    reason=f"{type(e).__name__}: {e}"))
                continue
            record("flashmla_op", op)
    # ratio triton / FlashMLA throughput (= FlashMLA time / Triton time) in this run
    by = {r["backend"]: r for r in results if r.get("status") == "ok"}
    ref = by.get("flashmla_op") or by.get("flashmla")
    for tname in ("triton", *VARIANTS):
        if tname in by and ref is not None:
            ratio = ref["us"]["median"] / by[tname]["us"]["median"]
            by[tname]["triton_vs_flashmla"] = ratio
            print(f"  -> {tname}/FlashMLA throughput ratio {ratio:.2f} (vs {ref['backend']})")
    if "triton" in by and "flashinfer" in by:
        by["triton"]["triton_vs_flashinfer"] = (by["flashinfer"]["us"]["median"]
                                                / by["triton"]["us"]["median"])
    q = rows = idx = None  # free the case's tensors (the closures above share the names: no del)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--quick", action="store_true", help="T in {1, 64}, fewer iterations")
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--formats", nargs="+", default=["fp8_ds_mla", "bf16"],
                    choices=["fp8_ds_mla", "bf16"])
    ap.add_argument("--backends", nargs="+", default=["triton", "flashmla", "flashinfer"],
                    choices=["triton", *VARIANTS, "flashmla", "flashinfer"],
                    help="triton_noprefetch: the tl kernels' default launch shape with the "
                         "L2 prefetch off (to measure it against the default in the same "
                         "run); triton_tl: the tl kernels' default (what runs where the "
                         "warp-specialised kernel, the fp8 default on SM 9.x, can't); "
                         "triton_one_launch: the default without its wave tail (one launch "
                         "however the programs fill the SMs' waves)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--pad-frac", type=float, default=0.0, help="fraction of -1 indices")
    ap.add_argument("--no-flush", action="store_true", help="don't flush L2 between calls")
    ap.add_argument("--rows-per-token", type=int, default=ROWS_PER_TOKEN,
                    help="N = T x this (default 4096, like hot buffers)")
    ap.add_argument("--device", default="cuda",
                    help="cuda (default); cpu only for a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--flashmla-lib", default=None,
                    help="path of _flashmla_C.abi3.so (default: $HISPARSE_FLASHMLA_LIB, then "
                         ".gpu-deps/vllm/_flashmla_C.abi3.so, then an installed vllm)")
    args = ap.parse_args(argv)
    if not out_ok(args.out, "bench_decode"):
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--device cpu gives a slow smoke run under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if args.quick:
        args.tokens = [t for t in args.tokens if t in (1, 64)] or [1]
        args.iters, args.warmup = min(args.iters, 20), min(args.warmup, 5)
    lib = flashmla_lib(args.flashmla_lib)
    all_backends = {"triton": TritonBackend(validate=False, allow_interpreter=dev.type == "cpu"),
                    **{name: TritonVariant(name, **ov) for name, ov in VARIANTS.items()},
                    "flashmla": FlashMLABackend(library_path=lib, check_ranges=False),
                    "flashinfer": FlashInferBackend()}
    backends = {k: v for k, v in all_backends.items() if k in args.backends}
    timer = Timer(warmup=args.warmup, iters=args.iters, flush=not args.no_flush, device=dev)
    env = environment(dev)
    if dev.type != "cuda":
        env["gpu"] = "none (CPU smoke run: timings are meaningless)"
    ops, fm_reason = all_backends["flashmla"].ops()
    meta = {
        **env, "flashinfer": flashinfer_version(),
        "flashmla_source": ops.source if ops is not None else None,
        "flashmla_reason": fm_reason, "flashmla_lib": lib,
        "args": vars(args), "rows_per_token": args.rows_per_token,
        "l2_flush": not args.no_flush and dev.type == "cuda",
    }
    print(f"bench_decode on {meta['gpu']} (SM {meta['sm']}), torch {meta['torch']}, "
          f"triton {meta['triton']}, flashinfer {meta['flashinfer']}, "
          f"FlashMLA {meta['flashmla_source'] or fm_reason}")
    results, copy_cache = [], {}
    for fmt_name in args.formats:
        fmt = RowFormat.parse(fmt_name)
        for H in args.heads:
            for T in args.tokens:
                print(f"case format={fmt.value} H={H} T={T} K={args.topk}", flush=True)
                results.extend(run_case(T, H, args.topk, fmt, args, timer, backends, copy_cache))
    ratios = [(r["backend"], r["format"], r["H"], r["T"], r["triton_vs_flashmla"]) for r in results
              if "triton_vs_flashmla" in r]
    if ratios:
        print("triton/FlashMLA throughput (FlashMLA time / Triton time; target >= 0.7):")
        for b, f, H, T, r in ratios:
            print(f"  {b} {f} H={H} T={T}: {r:.2f}")
    print(f"{len(results)} records")
    write_json(args.out, {"meta": meta, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
