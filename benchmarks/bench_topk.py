"""The mini engine's indexer top-k: the one-program-per-row kernel
(``hisparse.tools.mini_engine.topk``) against ``torch.topk``, which the mini engine used
before, in the same run.

  python -m benchmarks.bench_topk --out results/topk.json
  python -m benchmarks.bench_topk --rows 13 66 --variants 4096,8 8192,16
  python -m benchmarks.bench_topk --dry-run                  # CPU, tiny, interpreter

Per row count (default 13, 66 and 132 rows: the capacity benchmark's two batches at
128K and a full wave of SMs), fp32 scores [rows, --context] as the indexer writes
them (random, each row masked to -inf past a random own position in the last quarter
of the context), K = --top-k. Timed (CUDA events, an L2 flush and a ~0.5 ms GPU sleep
before each sample; min / median / p99 over --reps):
  torch    ``torch.topk(scores, K, sorted=True)``, -inf entries set to -1, as int32
  kernel   ``topk_rows_triton`` with each (block, warps, stages) of --variants
Each kernel variant's selection is compared with the torch reference
(``topk_rows_reference``, exactly) and with the torch.topk selection as a set; a
mismatch is recorded and the script exits 1 after writing its results. The rows'
``PATH_*`` counts say how often the sample missed.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common

common.interpret_dry_run()

import torch  # noqa: E402

from hisparse.tools.mini_engine import topk as T  # noqa: E402

pos = common.number_in(int, 1)


def variant(text: str) -> tuple[int, int, int]:
    try:
        v = [int(x) for x in text.split(",")]
        if len(v) == 2:
            v.append(T.STAGES)
        b, w, st = v
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK,WARPS[,STAGES] (e.g. 4096,8), got {text!r}") from None
    if b < 16 or b & (b - 1) or w not in (1, 2, 4, 8, 16, 32) or not 1 <= st <= 4:
        raise argparse.ArgumentTypeError(f"BLOCK must be a power of two >= 16, WARPS one of 1, 2, 4, 8, 16, 32 "
                                         f"and STAGES 1 to 4; got {text!r}")
    return b, w, st


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_topk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=pos, nargs="+", default=[13, 66, 132], help="rows per call [13 66 132]")
    ap.add_argument("--context", type=pos, default=131072, help="scores per row [131072]")
    ap.add_argument("--top-k", type=pos, default=2048, help="K [2048]")
    ap.add_argument("--variants", type=variant, nargs="+", default=None,
                    help=f"kernel BLOCK,WARPS[,STAGES] [{T.BLOCK},{T.NUM_WARPS},{T.STAGES}: the default]")
    ap.add_argument("--reps", type=pos, default=50, help="timed samples per case [50]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter)")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.rows, a.context, a.top_k, a.reps = [2], 1200, 32, 1
    a.variants = a.variants or [(T.BLOCK, T.NUM_WARPS, T.STAGES)]
    return a


def scores_for(rows: int, C: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, C, generator=g, device=device)
    lim = torch.randint(3 * C // 4, C, (rows,), generator=g, device=device)
    return x.masked_fill(torch.arange(C, device=device)[None, :] > lim[:, None], float("-inf"))


def torch_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    vals, idx = torch.topk(x, min(k, x.shape[1]), dim=1)
    return torch.where(torch.isinf(vals), torch.full_like(idx, -1), idx).to(torch.int32)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "bench_topk"):
        return 2
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("bench_topk: needs a CUDA GPU (or --dry-run for the CPU smoke run)", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    result = {"bench": "topk", "env": common.environment(dev), "dry_run": a.dry_run, "context": a.context,
              "top_k": a.top_k, "cases": []}
    rc = 0
    try:
        flush = common.L2Flush(dev)
        for rows in a.rows:
            x = scores_for(rows, a.context, a.seed + rows, dev)
            want = T.topk_rows_reference(x, a.top_k)
            base = torch_topk(x, a.top_k)
            same_set = torch.equal(torch.sort(base, dim=1).values, torch.sort(want, dim=1).values)
            warm = 0 if a.dry_run else 2
            t_torch = common.time_calls(lambda: torch_topk(x, a.top_k), reps=a.reps, warmup=warm, cuda=cuda,
                                        before=flush.flush, gpu_sleep=cuda)
            case = {"rows": rows, "torch": common.stats(t_torch, unit="_us"), "torch_equals_reference_as_set":
                    same_set, "kernel": []}
            if not same_set:
                rc = 1
            line = f"[topk] rows {rows:4d}  torch.topk {case['torch']['median_us']:8.1f} us"
            for block, warps, stages in a.variants:
                kw = dict(block=block, num_warps=warps, stages=stages)
                got, paths = T.topk_rows_triton(x, a.top_k, return_paths=True, **kw)
                exact = torch.equal(got, want)
                t = common.time_calls(lambda: T.topk_rows_triton(x, a.top_k, **kw),
                                      reps=a.reps, warmup=warm, cuda=cuda, before=flush.flush,
                                      gpu_sleep=cuda)
                st = common.stats(t, unit="_us")
                counts = {name: int((paths == getattr(T, name)).sum()) for name in
                          ("PATH_ALL_CANDIDATES", "PATH_ALL_ROW", "PATH_CANDIDATES", "PATH_ROW")}
                case["kernel"].append({"block": block, "num_warps": warps, "stages": stages, **st, "equals_reference": exact,
                                       "paths": counts,
                                       "torch_over_kernel": case["torch"]["median_us"] / st["median_us"]})
                if not exact:
                    rc = 1
                line += (f" | {block},{warps},{stages}: {st['median_us']:7.1f} us (min {st['min_us']:.1f}, p99 "
                         f"{st['p99_us']:.1f}) {case['torch']['median_us'] / st['median_us']:5.2f}x"
                         f"{'' if exact else ' MISMATCH'}")
            print(line, flush=True)
            result["cases"].append(case)
        if a.dry_run:
            result["note"] = "dry run on the CPU: the timings mean nothing"
    except Exception as e:  # noqa: BLE001 - recorded, then exit 1
        rc = common.record_failure(result, e)
    if a.out:
        common.write_json(a.out, result)
    return rc


if __name__ == "__main__":
    sys.exit(main())
