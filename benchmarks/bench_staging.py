"""Staging benchmark: the row-copy kernel moving scattered missed rows from a large
pinned host pool to the GPU, against a bulk pinned host->device copy of the same
bytes measured in the same run; then the full resolve + copy of an all-miss decode
step (K = 2048, S = 4096) for B requests, and an all-hit resolve.

  python -m benchmarks.bench_staging --out staging.json            # 32 GiB pool
  python -m benchmarks.bench_staging --quick --out staging.json    # 2 GiB pool
  python -m benchmarks.bench_staging --quick --dry-run             # CPU, tiny, interpreter

Timing: CUDA events around each call, after a short GPU sleep so that the launch
overhead of the host is hidden (GPU time only); warm-up calls first; min / median /
p99 over --reps repetitions. Every measured case is also checked for correctness
(sampled rows compared with the pool) and the script raises on any mismatch or CUDA
error. Ratios are against the bulk copy of the same byte count in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks import common

common.interpret_dry_run(with_gpu=True)  # a dry run is on the CPU; before hisparse loads

from hisparse.cache import (DEFAULT_NUM_WARPS, DEFAULT_PROGRAMS_PER_SM, DEFAULT_ROWS_PER_PROGRAM,  # noqa: E402
                            HotState, ResolveBuffers, copy_rows, resolve_triton)
from hisparse.config import HiSparseConfig  # noqa: E402
from hisparse.device import PinnedBuffer  # noqa: E402

GIB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="2 GiB pool, fewer reps and sweep points")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes; runs on CPU (interpreter)")
    p.add_argument("--pool-gib", type=common.positive_float, default=None,
                   help="pinned pool size (default 32, --quick 2)")
    p.add_argument("--reps", type=common.positive_int, default=None, help="timed repetitions per case (default 30)")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    p.add_argument("--no-resolve", action="store_true", help="skip the resolve + copy part")
    return p.parse_args(argv)


class Timer:
    """The staging benchmarks' timing: ``common.time_calls`` with a GPU sleep before each
    call, so a sample is GPU time only (perf_counter on the CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def run(self, fn, reps: int, warmup: int = 3, before=None) -> list[float]:
        """Microseconds per call. ``before`` (untimed) runs before every call."""
        return common.time_calls(fn, reps=reps, warmup=warmup, cuda=self.cuda, before=before,
                                 gpu_sleep=True)


def summary(us: list[float], nbytes: int | None = None) -> dict:
    """min / median / p99 microseconds (keys ``*_us``, ``reps``), plus GB/s of ``nbytes``."""
    d = common.stats(us, unit="_us", count="reps")
    if nbytes:
        d["bytes"] = nbytes
        d["GBps_median"] = nbytes / (d["median_us"] * 1e-6) / 1e9
        d["GBps_best"] = nbytes / (d["min_us"] * 1e-6) / 1e9
    return d


def fmt(name: str, d: dict, base: dict | None = None) -> str:
    line = f"  {name:<44s} min {d['min_us']:9.1f} us  med {d['median_us']:9.1f} us  p99 {d['p99_us']:9.1f} us"
    if "GBps_median" in d:
        line += f"  {d['GBps_median']:6.1f} GB/s"
    if base is not None:
        line += f"  ratio {base['median_us'] / d['median_us']:.2f}x of bulk"
    return line


def environment(dev: torch.device) -> dict:
    """``common.environment`` plus this benchmark's own names for two of its fields."""
    env = common.environment(dev)
    env.update(cuda_available=dev.type == "cuda", capability=env["sm"])
    return env


def random_pool(pool_bytes: int, pin: bool):
    """A PinnedBuffer of ``pool_bytes`` (pinned when ``pin``): random bytes in the first
    64 MiB, tiled over the pool (the period is not a multiple of either row width, so
    rows differ)."""
    buf = PinnedBuffer(pool_bytes, pin=pin)
    chunk = min(pool_bytes, 64 << 20)
    buf.tensor[:chunk].random_(0, 256)
    for off in range(chunk, pool_bytes, chunk):
        n = min(chunk, pool_bytes - off)
        buf.tensor[off:off + n].copy_(buf.tensor[:n])
    return buf


def bench_copy(args, dev, timer, pool_flat, results):
    cuda = dev.type == "cuda"
    reps = args.reps
    widths = [656, 1152]
    counts = [16, 64] if args.dry_run else [2048, 16384, 131072]
    g = torch.Generator().manual_seed(0)
    sweep = []
    if not args.no_sweep:
        if args.dry_run:
            sweep = [(2, 1, 2), (4, 4, 8)]
        else:
            rows_l = [2, 4, 8] if args.quick else [2, 4, 8, 16]
            warps_l = [4, 8]
            per_sm_l = [4, 8, 16] if args.quick else [4, 8, 16, 32]
            sweep = [(r, w, s) for r in rows_l for w in warps_l for s in per_sm_l]
    default = (DEFAULT_ROWS_PER_PROGRAM, DEFAULT_NUM_WARPS, DEFAULT_PROGRAMS_PER_SM)  # copy_rows' own
    max_n = max(counts)
    for W in widths:
        pool_rows = pool_flat.numel() // W
        pool = pool_flat[: pool_rows * W].view(pool_rows, W)
        dst = torch.empty(max_n, W, dtype=torch.uint8, device=dev)
        bulk_dst = torch.empty(max_n * W, dtype=torch.uint8, device=dev)
        best_cfg = default
        if sweep:
            n = counts[1] if len(counts) > 2 else counts[-1]
            si = torch.randint(0, pool_rows, (n,), generator=g, dtype=torch.int32).to(dev)
            di = torch.randperm(n, generator=g).to(torch.int32).to(dev)
            print(f"[sweep] W={W} N={n}: rows_per_program, num_warps, programs_per_sm")
            best = None
            for cfg in sweep:
                kw = dict(rows_per_program=cfg[0], num_warps=cfg[1], programs_per_sm=cfg[2])
                d = summary(timer.run(lambda: copy_rows(pool, si, dst, di, **kw), max(5, reps // 3)),
                            n * W)
                results["sweep"].append({"W": W, "N": n, "config": list(cfg), **d})
                print(fmt(f"rows={cfg[0]} warps={cfg[1]} per_sm={cfg[2]}", d))
                if best is None or d["median_us"] < best[1]:
                    best = (cfg, d["median_us"])
            best_cfg = best[0]
            print(f"[sweep] W={W}: best {best_cfg}, default {default}")
        configs = {"default": default}
        if best_cfg != default:
            configs["best"] = best_cfg
        for n in counts:
            nbytes = n * W
            si = torch.randint(0, pool_rows, (n,), generator=g, dtype=torch.int32)
            di = torch.randperm(n, generator=g).to(torch.int32)
            si_d, di_d = si.to(dev), di.to(dev)
            off = int(torch.randint(0, max(1, pool_flat.numel() - nbytes), (1,), generator=g)) // 4096 * 4096
            src_bulk = pool_flat[off: off + nbytes]
            bulk = summary(timer.run(lambda: bulk_dst[:nbytes].copy_(src_bulk, non_blocking=True), reps),
                           nbytes)
            print(f"W={W} N={n} ({nbytes / 2**20:.1f} MiB)")
            print(fmt("bulk pinned H2D copy_ (baseline)", bulk))
            entry = {"W": W, "N": n, "bulk_h2d": bulk}
            for name, cfg in configs.items():
                kw = dict(rows_per_program=cfg[0], num_warps=cfg[1], programs_per_sm=cfg[2])
                d = summary(timer.run(lambda: copy_rows(pool, si_d, dst, di_d, **kw), reps), nbytes)
                d["config"] = list(cfg)
                d["ratio_vs_bulk"] = bulk["median_us"] / d["median_us"]
                entry[f"copy_rows_{name}"] = d
                print(fmt(f"copy_rows {name} {cfg}", d, bulk))
            # correctness of the last launch: every staged row equals its pool row
            if cuda:
                torch.cuda.synchronize()
            sample = torch.randperm(n, generator=g)[:256]
            got = dst[di[sample].long().to(dev)].cpu()
            want = pool[si[sample].long()]
            if not torch.equal(got, want):
                raise RuntimeError(f"copy_rows produced wrong rows (W={W}, N={n})")
            # a mostly -1 list of the same length: 3 % of the rows are real
            keep = torch.rand(n, generator=g) < 0.03
            si_s = torch.where(keep, si, torch.full_like(si, -1)).to(dev)
            d = summary(timer.run(lambda: copy_rows(pool, si_s, dst, di_d), reps), int(keep.sum()) * W)
            entry["copy_rows_sparse_3pct"] = d
            print(fmt("copy_rows default, 97% of entries -1", d))
            results["copy"].append(entry)


class ResolveCase:
    """The resolve benchmark's setup for Bn requests (one layer, one query token each).

    Request r owns host blocks perm[r * nb:(r + 1) * nb] of a shuffled pool (nb = seq / Bk);
    its S LRU slots hold positions 0..S-1 (stamp 0) and its newest slot S holds seq - 1.
    ``topk`` (int32 [Bn, K]) holds K distinct positions in [S, seq - 1) per request, so
    the first resolve after ``restore()`` is all misses and a repeat of it all hits.

    cfg: HiSparseConfig; seq: tokens per request; pool: uint8 [cfg.num_host_rows, W], a
    view of the pool; saved: HotState (on dev) as described above; state: HotState (on
    dev), the working copy; topk: int32 [Bn, K]; req: int32 [Bn], request ids 0..Bn-1;
    out: ResolveBuffers (Bn, K); hot: uint8 [cfg.hot_rows_per_layer, W] on dev.
    """

    def __init__(self, cfg, seq, pool, saved, state, topk, req, out, hot):
        self.cfg, self.seq, self.pool, self.saved, self.state = cfg, seq, pool, saved, state
        self.topk, self.req, self.out, self.hot = topk, req, out, hot

    def restore(self):
        """Put the mutable state back to ``saved`` (the block table etc. never change)."""
        for f in ("slot_pos", "slot_stamp", "row_slot", "step", "stats"):
            getattr(self.state, f).copy_(getattr(self.saved, f))


def make_resolve_case(dev, pool_flat, Bn: int, K: int, S: int, Bk: int, W: int, g) -> ResolveCase | None:
    """Build a ResolveCase over ``pool_flat`` (uint8 [bytes]) with rows of W bytes, drawing
    from the torch.Generator ``g``; None when the pool holds too few rows for Bn requests."""
    pool_rows = pool_flat.numel() // W
    seq = min(65536, (pool_rows // Bn) // Bk * Bk)
    if seq < S + K + 1:
        return None
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=seq * Bn, top_k=K, device_buffer_size=S,
                         max_num_reqs=Bn, max_query_len=1, host_block_size=Bk,
                         max_request_id=Bn, device=str(dev))
    pool = pool_flat[: cfg.num_host_rows * W].view(cfg.num_host_rows, W)
    st = HotState.allocate(cfg, torch.device("cpu"))
    nb = seq // Bk
    perm = torch.randperm(cfg.num_host_blocks, generator=g).to(torch.int32)
    p = torch.arange(S)
    for r in range(Bn):
        st.id_to_slot[r] = r
        st.seq_lens[:, r] = seq
        st.block_table[r, :nb] = perm[r * nb:(r + 1) * nb]
        rows = st.block_table[r, p // Bk].long() * Bk + p % Bk
        st.slot_pos[0, r, :S] = p.to(torch.int32)
        st.slot_stamp[0, r, :S] = 0
        st.row_slot[0, rows] = p.to(torch.int32)
        st.slot_pos[0, r, S] = seq - 1
        st.slot_stamp[0, r, S] = 0
        st.row_slot[0, int(st.block_table[r, (seq - 1) // Bk]) * Bk + (seq - 1) % Bk] = S
    fields = ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot", "host_block",
              "step", "stats", "resident", "page_table")
    saved = HotState(**{f: getattr(st, f).to(dev) for f in fields}, S=S, B=Bk)
    state = saved.clone()
    # all-miss step: K distinct positions in [S, seq - 1) per request (none is hot)
    topk = torch.stack([torch.randperm(seq - 1 - S, generator=g)[:K] + S for _ in range(Bn)])
    topk = topk.to(torch.int32).to(dev)
    req = torch.arange(Bn, dtype=torch.int32, device=dev)
    out = ResolveBuffers.allocate(Bn, K, dev)
    hot = torch.zeros(cfg.hot_rows_per_layer, W, dtype=torch.uint8, device=dev)
    return ResolveCase(cfg=cfg, seq=seq, pool=pool, saved=saved, state=state, topk=topk, req=req,
                       out=out, hot=hot)


def bench_resolve(args, dev, timer, pool_flat, results):
    cuda = dev.type == "cuda"
    W = 656
    K, S, Bk = (8, 16, 4) if args.dry_run else (2048, 4096, 64)
    batches = [1, 2] if args.dry_run else [1, 8, 64, 256]
    g = torch.Generator().manual_seed(1)
    for Bn in batches:
        case = make_resolve_case(dev, pool_flat, Bn, K, S, Bk, W, g)
        if case is None:
            print(f"resolve B={Bn}: pool too small for {Bn} requests of >= {S + K + 1} tokens; skipped")
            continue
        seq, pool, state, topk, req, out, hot = (case.seq, case.pool, case.state, case.topk, case.req,
                                                 case.out, case.hot)
        restore = case.restore
        n = Bn * K
        nbytes = n * W

        def resolve_only():
            resolve_triton(state, 0, req, topk, out, max_query_len=1)

        def resolve_copy():
            resolve_triton(state, 0, req, topk, out, max_query_len=1)
            copy_rows(pool, out.stage_src[:n], hot, out.stage_dst[:n])

        t0 = time.perf_counter()
        restore()
        resolve_copy()  # compiles on first use
        if cuda:
            torch.cuda.synchronize()
        print(f"B={Bn}: first resolve+copy (incl. compile) {time.perf_counter() - t0:.1f} s")
        miss = int(state.stats[0, 1])
        if miss != n:
            raise RuntimeError(f"all-miss step reported {miss} misses, expected {n}")
        ph = out.physical[:Bn, :K].long()
        pos = topk.long()
        rows = state.block_table.long()[req.long()[:, None].expand_as(pos), pos // Bk] * Bk + pos % Bk
        samp = torch.randperm(n, generator=g)[:256]
        if not torch.equal(hot[ph.flatten()[samp.to(dev)]].cpu(), pool[rows.flatten()[samp.to(dev)].cpu()]):
            raise RuntimeError(f"resolve+copy staged wrong rows (B={Bn})")

        bulk_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        src_bulk = pool_flat[:nbytes]
        bulk = summary(timer.run(lambda: bulk_dst.copy_(src_bulk, non_blocking=True), args.reps), nbytes)
        r_only = summary(timer.run(resolve_only, args.reps, before=restore))
        both = summary(timer.run(resolve_copy, args.reps, before=restore), nbytes)
        both["ratio_vs_bulk"] = bulk["median_us"] / both["median_us"]
        # mixed steps: a fraction h of each row's K positions is hot (slots 0..S-1 hold
        # positions 0..S-1), the rest are misses from [S, seq - 1)
        mixed = {}
        for h in (0.9, 0.5):
            nh = int(round(h * K))
            rows_k = [torch.cat([torch.randperm(S, generator=g)[:nh],
                                 torch.randperm(seq - 1 - S, generator=g)[:K - nh] + S])
                      for _ in range(Bn)]
            topk_h = torch.stack(rows_k).to(torch.int32).to(dev)
            mixed[h] = summary(timer.run(
                lambda: resolve_triton(state, 0, req, topk_h, out, max_query_len=1), args.reps,
                before=restore))
            restore()
            resolve_triton(state, 0, req, topk_h, out, max_query_len=1)
            got = (int(state.stats[0, 0]), int(state.stats[0, 1]))
            if got != (Bn * nh, Bn * (K - nh)):
                raise RuntimeError(f"hit rate {h}: (hits, misses) {got}, expected {(Bn * nh, Bn * (K - nh))}")
        restore()
        resolve_only()  # the same top-k again: all hits from now on
        hits = summary(timer.run(resolve_only, args.reps))
        print(f"B={Bn} K={K} S={S}: all-miss step moves {nbytes / 2**20:.1f} MiB")
        print(fmt("bulk pinned H2D copy_ (baseline)", bulk))
        print(fmt("resolve only (all miss)", r_only))
        print(fmt("resolve + copy_rows (all miss)", both, bulk))
        print(fmt("resolve only (all hit)", hits))
        for h, v in mixed.items():
            print(fmt(f"resolve only ({h:.0%} hits)", v))
        results["resolve"].append({"B": Bn, "K": K, "S": S, "W": W, "bulk_h2d": bulk,
                                   "resolve_all_miss": r_only, "resolve_copy_all_miss": both,
                                   "resolve_all_hit": hits,
                                   **{f"resolve_hit_{int(h * 100)}": v for h, v in mixed.items()}})


def main(argv=None) -> int:
    args = parse_args(argv)
    if not common.out_ok(args.out, "bench_staging"):
        return 2
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench_staging: no CUDA GPU; use --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.reps is None:
        args.reps = 2 if args.dry_run else (20 if args.quick else 30)
    if args.pool_gib is None:
        args.pool_gib = 2.0 if args.quick else 32.0
    pool_bytes = (1 << 20) if args.dry_run else int(args.pool_gib * GIB)

    results = {"benchmark": "staging", "args": vars(args), "env": environment(dev),
               "sweep": [], "copy": [], "resolve": []}
    print("env:", json.dumps(results["env"]))
    t0 = time.perf_counter()
    buf = random_pool(pool_bytes, pin=cuda)
    print(f"pool: {pool_bytes / GIB:.2f} GiB, pinned={buf.pinned}, ready in {time.perf_counter() - t0:.1f} s")
    results["pool_bytes"] = pool_bytes
    results["pool_pinned"] = buf.pinned
    timer = Timer(cuda)
    bench_copy(args, dev, timer, buf.tensor, results)
    if not args.no_resolve:
        bench_resolve(args, dev, timer, buf.tensor, results)
    if cuda:
        torch.cuda.synchronize()
    if args.out:
        common.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
