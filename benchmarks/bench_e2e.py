"""End-to-end benchmark: the mini engine served with a resident KV cache and with hisparse.

Runs ``hisparse_tools.mini_engine`` (random-weight sparse-MLA model, real top-k indexer,
chunked prefill then decode, requests finishing at different times) twice on the same
inputs: an ordinary device-resident paged KV cache (the baseline, measured in the same
run) and hisparse with a hot buffer of ``2 x top_k`` slots per (layer, request), far
smaller than the contexts. Contexts are mostly written synthetically (random rows and
indexer keys straight into both caches), the last few hundred prompt tokens are
prefilled for real, then every request decodes.

Reported (stdout and JSON): per run tokens/s, step time and decode-only step time
min / median / p99 (ms, CUDA-synchronised per step); ratios hisparse / resident;
hisparse hit rate, misses, bytes moved host->device and device->host; the output
comparison (max |diff| of the final hidden states, argmax mismatches; expected 0);
the target check "decode step median hisparse <= 1.3 x resident" at the measured hit
rate; GPU name, torch / triton / CUDA versions.

Exit status: 1 when the outputs differ beyond tolerance (a correctness failure), else 0
(a missed speed target is reported, not an error).

Usage:
  python -m benchmarks.bench_e2e --out e2e.json [--quick] [--backend triton|flashmla]
  python -m benchmarks.bench_e2e --layer-graphs --decode-steps 128   # an eager engine, hisparse's per-layer graphs
  python -m benchmarks.bench_e2e --dry-run          # tiny CPU run (checks the script)
Full size (default): 8 layers, 128 heads, 64 requests, ~32K contexts, top-k 2048.
--quick: 4 layers, 16 requests, ~8K contexts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from benchmarks import common

common.interpret_dry_run(with_gpu=True)  # a dry run is on the CPU; before hisparse loads

from hisparse.attention import backend_names  # noqa: E402
from hisparse_tools import mini_engine as me  # noqa: E402

TARGET_RATIO = 1.3
TAIL = 512  # prompt tokens prefilled for real: --context must exceed it


def sizes(args: argparse.Namespace) -> me.MiniEngineConfig:
    if args.dry_run:
        kw = dict(device="cpu", num_requests=3, min_prompt=24, max_prompt=32, synthetic_context=16,
                  min_decode=3, max_decode=4, validate=True)
    else:
        kw = dict(me.PRESETS["h200"])
        ctx = 8192 if args.quick else 32768
        tail = 512 if args.quick else 512
        kw.update(num_layers=4 if args.quick else 8, num_requests=16 if args.quick else 64,
                  min_prompt=ctx - tail, max_prompt=ctx, synthetic_context=ctx - tail - 256,
                  min_decode=16 if args.quick else 24, max_decode=24 if args.quick else 32,
                  chunk=512, max_batch_tokens=8192, validate=False)
    for name, flag in (("num_layers", "layers"), ("num_heads", "heads"), ("num_requests", "requests"),
                       ("top_k", "top_k"), ("backend", "backend"), ("flashmla_lib", "flashmla_lib"),
                       ("locality", "locality"), ("row_format", "row_format")):
        v = getattr(args, flag)
        if v is not None:
            kw[name] = v
    if args.context is not None:
        kw.update(max_prompt=args.context, min_prompt=args.context - TAIL,
                  synthetic_context=max(0, args.context - 768))
    if args.layer_graphs:
        kw["layer_graphs"] = True
    if args.decode_steps is not None:
        kw.update(min_decode=args.decode_steps, max_decode=args.decode_steps)
    if kw.get("backend") is None and not args.dry_run:
        kw["backend"] = "triton"
    kw["flashmla_lib"] = common.flashmla_lib(kw.get("flashmla_lib"))
    return me.MiniEngineConfig(**kw)


def env_info() -> dict:
    """``common.environment`` plus ``num_sms``, this benchmark's name for ``sm_count``."""
    env = common.environment()
    env["num_sms"] = env["sm_count"]
    return env


def warm_up(cfg: me.MiniEngineConfig) -> float:
    """Compile every kernel of both runs at the real shapes: the same requests, arrivals
    and decode lengths (so every decode batch size T occurs: the attention kernel is
    specialised on its split count, which follows T), with short contexts."""
    S = cfg.device_buffer_size or 2 * cfg.top_k
    ctx = min(cfg.max_prompt, S + 1024)
    lo = ctx - 256 if ctx > 512 else max(1, ctx // 2)
    w = dataclasses.replace(cfg, min_prompt=lo, max_prompt=ctx, synthetic_context=max(0, lo - 256))
    t0 = time.perf_counter()
    me.run(w)
    return time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (also how ``profile_e2e_host`` picks the same sizes)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--quick", action="store_true", help="smaller run (4 layers, 16 requests, 8K contexts)")
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU run that only checks the script")
    pos = common.positive_int
    ap.add_argument("--layers", type=pos, default=None)
    ap.add_argument("--heads", type=pos, default=None)
    ap.add_argument("--requests", type=pos, default=None)
    ap.add_argument("--context", type=pos, default=None, help=f"longest prompt (tokens, > {TAIL})")
    ap.add_argument("--top-k", dest="top_k", type=pos, default=None)
    ap.add_argument("--backend", default=None, choices=backend_names(),
                    help="attention backend (default triton; flashmla needs its library)")
    ap.add_argument("--flashmla-lib", dest="flashmla_lib", default=None)
    ap.add_argument("--locality", type=common.locality, default=None, help="indexer locality knob in [0, 1)")
    ap.add_argument("--format", "--row-format", dest="row_format", default=None, choices=["fp8_ds_mla", "bf16"],
                    help="KV row format, as `hisparse mini-engine --format` (--row-format: its former name)")
    ap.add_argument("--decode-steps", type=pos, default=None,
                    help="every request decodes this many tokens (default: 24-32, 16-24 with --quick); "
                         "the per-layer graphs need many steps per bucket to pay back their captures")
    ap.add_argument("--layer-graphs", action="store_true",
                    help="decode-only steps padded to buckets, hisparse's per-layer calls replaying graphs "
                         "of their own (mini-engine --layer-graphs; both engines run the padded forward)")
    ap.add_argument("--no-warmup", action="store_true")
    a = ap.parse_args(argv)
    if a.layer_graphs and a.dry_run:
        ap.error("--layer-graphs replays CUDA graphs; a --dry-run is on the CPU")
    if a.context is not None and a.context <= TAIL:
        ap.error(f"--context {a.context}: the last {TAIL} prompt tokens are prefilled for real, so "
                 f"--context must be > {TAIL}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not common.out_ok(args.out, "bench_e2e"):
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device; use --dry-run for the CPU check", file=sys.stderr)
        return 2
    try:
        cfg = sizes(args)  # the run's config is valid before any work
    except (ValueError, TypeError) as e:
        print(f"bench_e2e: {e}", file=sys.stderr)
        return 2
    result: dict = {"bench": "e2e", "env": env_info(), "quick": args.quick, "dry_run": args.dry_run,
                    "target_ratio": TARGET_RATIO}
    print(f"[bench_e2e] {result['env']}")
    print(f"[bench_e2e] layers={cfg.num_layers} heads={cfg.num_heads} requests={cfg.num_requests} "
          f"prompts {cfg.min_prompt}-{cfg.max_prompt} (synthetic {cfg.synthetic_context}) top_k={cfg.top_k} "
          f"hot slots={cfg.device_buffer_size or 2 * cfg.top_k} decode {cfg.min_decode}-{cfg.max_decode} steps "
          f"rows={cfg.row_format.value} backend={cfg.backend or 'auto'} layer_graphs={cfg.layer_graphs}", flush=True)
    rc = 0
    try:
        if not args.no_warmup:
            result["warmup_s"] = warm_up(cfg)
            print(f"[bench_e2e] warm-up (kernel compilation) {result['warmup_s']:.1f} s", flush=True)
        t0 = time.perf_counter()
        res = me.run(cfg, progress=sys.stderr.isatty())
        result["wall_s"] = time.perf_counter() - t0
        result.update(res)
        print(me.format_report(res))
        ratio = res["ratio"]["decode_step_median_hisparse_over_resident"]
        hit = res["hisparse"]["cache"]["hit_rate"]
        met = ratio is not None and ratio <= TARGET_RATIO
        result["target"] = {"decode_step_ratio": ratio, "hit_rate": hit, "met": met}
        print(f"[bench_e2e] target: decode step median hisparse/resident <= {TARGET_RATIO} at hit rate {hit:.4f}: "
              f"{'MET' if met else 'NOT MET'} (ratio {ratio if ratio is None else round(ratio, 3)})")
        if not res["compare"]["within_tolerance"]:
            print("[bench_e2e] FAIL: outputs differ beyond tolerance", file=sys.stderr)
            rc = 1
    except Exception as e:  # record the failure in the JSON, then fail loudly
        rc = common.record_failure(result, e)
    if args.out:
        common.write_json(args.out, result, indent=2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
