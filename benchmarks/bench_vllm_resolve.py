"""Same-run comparison of the all-hit resolve: vLLM 0.30's
``torch.ops._C_cache_ops.hisparse_resolve_residency`` against our
``hisparse.cache.resolve_triton``, in one process, at the same shapes.

  python -m benchmarks.bench_vllm_resolve --out vllm_resolve.json
  python -m benchmarks.bench_vllm_resolve --lib /path/to/_C_stable_libtorch.abi3.so

Shapes: K = 2048 top-k entries per request, 4096 hot slots per request, 656-byte rows,
host block size 64, one query token per request, B in {1, 8, 64, 256}; every top-k
entry is already resident (all hits). Our side is set up exactly as the all-hit case of
bench_staging.bench_resolve (same helper, same seed). The vLLM side gets the same
requests: the same block tables (shifted by one block, since vLLM's host block 0 is
its null block), the same top-k positions, and its hot region pre-filled like ours
(slots 0..4095 hold positions 0..4095), then one all-miss call plus
``hisparse_gather_compact`` makes the top-k resident. vLLM's all-hit time depends on
how many of its hot slots are occupied (each occupied slot's row is looked up in the
top-k hash): with only the K top-k rows resident and the other slots empty it is lower
than in this full-region state, which is the state ours is timed in.

Before timing, both sides are checked: the all-hit call reports B*K hits and 0 misses,
returns the same hot rows as the preceding miss step, and every returned hot row holds
the bytes of the expected host row. The script raises on any mismatch.

Timing (bench_staging.Timer): CUDA events around each call after a short GPU sleep,
so only GPU time is measured; warm-up calls first; min / median / p99 over --reps.
Exit code 2 (with a message) when the vLLM library or a CUDA GPU is missing.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import pathlib
import shutil
import sys
import time

import torch

from benchmarks.bench_staging import Timer, environment, fmt, make_resolve_case, random_pool, summary
from benchmarks.common import ROOT, out_ok, write_json
from hisparse.cache import STAT_HITS, STAT_MISSES, copy_rows, resolve_triton

DEFAULT_LIB = ROOT / ".gpu-deps" / "vllm" / "_C_stable_libtorch.abi3.so"
UNPACK_DIR = pathlib.Path("/tmp/hisparse-vllm")

W = 656  # row bytes (fp8_ds_mla)
K = 2048  # top-k entries per request
S = 4096  # hot (LRU) slots per request
BK = 64  # host block size (tokens per block), ours and vLLM's source blocks
HBS = 64  # vLLM hot-cache block size (rows per hot block)
SEQ = 65536  # tokens per request (bench_staging's value when its pool is large enough)
SEED = 1  # bench_staging.bench_resolve's generator seed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default=str(DEFAULT_LIB),
                   help="vLLM's _C_stable_libtorch.abi3.so; if only FILE.xz exists, it is "
                        f"decompressed once into {UNPACK_DIR}")
    p.add_argument("--out", help="write results as JSON to this file")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions per case (default 50)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256],
                   help="numbers of requests B (default 1 8 64 256)")
    return p.parse_args(argv)


def find_library(path: str) -> tuple[pathlib.Path | None, str]:
    """(usable .so path, '') or (None, why not). Decompresses FILE.xz when only it exists."""
    lib = pathlib.Path(path)
    if lib.is_file():
        return lib, ""
    xz = lib.with_name(lib.name + ".xz")
    if not xz.is_file():
        return None, f"vLLM library not found: neither {lib} nor {xz} exists"
    dst = UNPACK_DIR / lib.name
    if dst.is_file() and dst.stat().st_mtime >= xz.stat().st_mtime:
        return dst, ""
    UNPACK_DIR.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".part{os.getpid()}")
    t0 = time.perf_counter()
    try:
        with lzma.open(xz, "rb") as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 16 << 20)
        os.replace(tmp, dst)
    except (OSError, lzma.LZMAError) as e:
        tmp.unlink(missing_ok=True)
        return None, f"could not decompress {xz} into {dst}: {e}"
    print(f"decompressed {xz} -> {dst} in {time.perf_counter() - t0:.1f} s")
    return dst, ""


def load_vllm_ops(lib: pathlib.Path):
    """Load the library; returns torch.ops._C_cache_ops or raises RuntimeError."""
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        raise RuntimeError(f"could not load the vLLM library {lib}: {e}") from e
    ops = getattr(torch.ops, "_C_cache_ops", None)
    for name in ("hisparse_resolve_residency", "hisparse_gather_compact"):
        if ops is None or not hasattr(ops, name):
            raise RuntimeError(f"{lib} loaded but has no torch.ops._C_cache_ops.{name}")
    return ops


def _schema(op) -> str:
    try:
        return str(op.default._schema)
    except AttributeError:
        return "?"


def _stats_pair(stats: torch.Tensor) -> tuple[int, int]:
    """(hits, misses) of vLLM's uint64 [2] stats (read through an int64 view)."""
    v = stats.view(torch.int64).cpu().tolist()
    return int(v[0]), int(v[1])


# ----------------------------------------------------------------------------- ours

def run_ours(dev, timer, pool_flat, Bn: int, reps: int, g) -> tuple[dict, object]:
    """Set up bench_staging's resolve case, make the top-k resident (all-miss resolve +
    copy_rows), check one all-hit resolve, then time all-hit resolves. Returns
    (summary, case)."""
    case = make_resolve_case(dev, pool_flat, Bn, K, S, BK, W, g)
    if case is None:
        raise RuntimeError(f"B={Bn}: pool too small (needs {SEQ} tokens per request)")
    if case.seq != SEQ:
        raise RuntimeError(f"B={Bn}: seq {case.seq}, expected {SEQ} (pool too small)")
    state, out, topk, req, hot, pool = case.state, case.out, case.topk, case.req, case.hot, case.pool
    n = Bn * K

    def resolve():
        resolve_triton(state, 0, req, topk, out, max_query_len=1)

    # all-miss step (as bench_staging: restore, resolve), plus the copy so the rows are there
    case.restore()
    t0 = time.perf_counter()
    resolve()
    copy_rows(pool, out.stage_src[:n], hot, out.stage_dst[:n])
    torch.cuda.synchronize()
    print(f"B={Bn}: ours, first resolve+copy (incl. compile) {time.perf_counter() - t0:.1f} s")
    hits0, miss0 = int(state.stats[0, STAT_HITS]), int(state.stats[0, STAT_MISSES])
    if (hits0, miss0) != (0, n):
        raise RuntimeError(f"ours B={Bn}: all-miss step reported (hits, misses) {(hits0, miss0)}, "
                           f"expected {(0, n)}")
    phys_miss = out.physical[:Bn, :K].clone()

    # one all-hit step, checked
    resolve()
    torch.cuda.synchronize()
    hits1, miss1 = int(state.stats[0, STAT_HITS]), int(state.stats[0, STAT_MISSES])
    if (hits1 - hits0, miss1 - miss0) != (n, 0):
        raise RuntimeError(f"ours B={Bn}: all-hit step reported (hits, misses) "
                           f"{(hits1 - hits0, miss1 - miss0)}, expected {(n, 0)}")
    phys = out.physical[:Bn, :K]
    if not torch.equal(phys, phys_miss):
        raise RuntimeError(f"ours B={Bn}: all-hit step returned other hot rows than the miss step")
    pos = topk.long()
    rows = case.state.block_table.long()[req.long()[:, None].expand_as(pos), pos // BK] * BK + pos % BK
    want = pool.index_select(0, rows.flatten().cpu()).to(dev)
    if not torch.equal(hot[phys.flatten().long()], want):
        raise RuntimeError(f"ours B={Bn}: a hot row returned by the all-hit step holds wrong bytes")

    d = summary(timer.run(resolve, reps))
    miss2 = int(state.stats[0, STAT_MISSES])
    if miss2 != miss1:
        raise RuntimeError(f"ours B={Bn}: {miss2 - miss1} misses while timing the all-hit step")
    return d, case


# ----------------------------------------------------------------------------- vLLM

def run_vllm(ops, dev, timer, pool_flat, case, reps: int) -> tuple[dict, dict]:
    """The same requests through vLLM's resolve. Returns (summary, info)."""
    Bn = case.topk.shape[0]
    n = Bn * K
    nb = case.seq // BK  # source blocks per request
    hot_blocks = S // HBS  # hot blocks per request

    # host_cache: uint8 [H', W] pinned CPU, 2-D contiguous. Row g is host row g; our
    # block b is vLLM's block b + 1 (block 0 is vLLM's null block), so H' = our rows + BK.
    host_rows = case.cfg.num_host_rows + BK
    if host_rows * W > pool_flat.numel():
        raise RuntimeError("pool too small for the vLLM host view")
    host_cache = pool_flat[: host_rows * W].view(host_rows, W)
    # hot_cache: uint8 [Bn * S / HBS, HBS, W] on the GPU (must be 3-D: blocks, rows, bytes)
    hot_cache = torch.zeros(Bn * hot_blocks, HBS, W, dtype=torch.uint8, device=dev)
    hot_flat = hot_cache.view(-1, W)
    # hot_block_table: int32 [Bn, S / HBS]; request r owns hot blocks r*64 .. r*64+63,
    # so hot slot s of request r is flat hot row r * S + s
    hot_block_table = torch.arange(Bn * hot_blocks, dtype=torch.int32, device=dev).view(Bn, hot_blocks)
    # global_indices: int32 [Bn, K], request-relative positions (translated in the
    # kernel through source_block_table, as ours translates through its block table)
    global_indices = case.topk.contiguous()
    # source_block_table: int32 [Bn, nb], our block table + 1 (never the null block 0)
    source_block_table = (case.saved.block_table[:, :nb] + 1).contiguous()
    if int(source_block_table.min()) < 1:
        raise RuntimeError("source block table holds a block < 1")
    # request_ids: int32 [Bn], row -> request (source table row); request_state_indices:
    # int32 [Bn], row -> state row of device_global_indices / lru_slots. Both identity.
    request_ids = torch.arange(Bn, dtype=torch.int32, device=dev)
    request_state_indices = torch.arange(Bn, dtype=torch.int32, device=dev)
    # device_global_indices: int32 [Bn, S], host row held by each hot slot (-1 = empty);
    # pre-filled like ours: slot s holds position s. lru_slots: int16 [Bn, S], slots in
    # LRU order (oldest first).
    p = torch.arange(S, device=dev)
    slot_rows = source_block_table.long()[:, p // BK] * BK + p % BK  # [Bn, S]
    dgi0 = slot_rows.to(torch.int32).contiguous()
    lru0 = torch.arange(S, dtype=torch.int16, device=dev).repeat(Bn, 1).contiguous()
    dgi, lru = dgi0.clone(), lru0.clone()
    # outputs: hot_indices / attention_indices / swap_* int32 [Bn, K]; valid_counts and
    # swap_counts int32 [Bn]; stats uint64 [2] = (hits, misses), accumulated by the kernel
    hot_indices = torch.full((Bn, K), -7, dtype=torch.int32, device=dev)
    attention_indices = torch.full((Bn, K), -7, dtype=torch.int32, device=dev)
    valid_counts = torch.full((Bn,), -7, dtype=torch.int32, device=dev)
    swap_host = torch.full((Bn, K), -7, dtype=torch.int32, device=dev)
    swap_dev = torch.full((Bn, K), -7, dtype=torch.int32, device=dev)
    swap_counts = torch.full((Bn,), -7, dtype=torch.int32, device=dev)
    stats = torch.zeros(2, dtype=torch.uint64, device=dev)

    # expected host row of each top-k entry: int64 [Bn, K]
    pos = global_indices.long()
    want_g = torch.gather(source_block_table.long(), 1, pos // BK) * BK + pos % BK

    def resolve():
        ops.hisparse_resolve_residency(
            host_cache,  # Tensor host_cache: uint8 [H', W] pinned CPU
            hot_cache,  # Tensor! hot_cache: uint8 [blocks, HBS, W] CUDA
            hot_block_table,  # Tensor hot_block_table: int32 [Bn, S / HBS]
            global_indices,  # Tensor global_indices: int32 [Bn, K] positions
            hot_indices,  # Tensor! hot_indices: int32 [Bn, K] out, flat hot row
            dgi,  # Tensor! device_global_indices: int32 [Bn, S] state
            lru,  # Tensor! lru_slots: int16 [Bn, S] state
            request_state_indices,  # Tensor? request_state_indices: int32 [Bn]
            S,  # int region_stride: hot slots per state row (== lru_slots.size(1))
            miss_mask=None,  # Tensor(a!)? int32 [Bn, K]: not needed (compact swaps below)
            stats=stats,  # Tensor(b!)? uint64 [2]: += (hits, misses)
            attention_indices=attention_indices,  # Tensor(c!)? int32 [Bn, K] out
            attention_block_stride=HBS,  # int: rows per attention block (== HBS: same as hot_indices)
            request_ids=request_ids,  # Tensor? int32 [Bn]
            source_block_table=source_block_table,  # Tensor? int32 [Bn, nb]
            source_block_size=BK,  # int: tokens per source (host) block
            resolved_global_indices=None,  # Tensor(d!)? int32 [Bn, K]: not needed
            valid_counts=valid_counts,  # Tensor(e!)? int32 [Bn] out
            swap_host_physical_rows=swap_host,  # Tensor(f!)? int32 [Bn, K] out: miss host rows
            swap_device_physical_rows=swap_dev,  # Tensor(g!)? int32 [Bn, K] out: their hot rows
            swap_counts=swap_counts,  # Tensor(h!)? int32 [Bn] out: misses per row
            resident_block_table=None,  # Tensor? no GPU-resident pages
            resident_block_size=0,
            resident_null_block=0,
        )

    def gather():
        ops.hisparse_gather_compact(
            host_cache,  # Tensor host_cache: uint8 [H', W] pinned CPU
            hot_cache,  # Tensor! hot_cache: uint8 [blocks, HBS, W]
            swap_host,  # Tensor miss_global_indices: int32 [Bn, K]
            swap_dev,  # Tensor miss_hot_indices: int32 [Bn, K]
            swap_counts,  # Tensor miss_counts: int32 [Bn]
        )

    # all-miss step + gather: the top-k becomes resident
    t0 = time.perf_counter()
    resolve()
    torch.cuda.synchronize()
    h0, m0 = _stats_pair(stats)
    if (h0, m0) != (0, n):
        raise RuntimeError(f"vLLM B={Bn}: all-miss step reported (hits, misses) {(h0, m0)}, expected {(0, n)}")
    if not bool((swap_counts == K).all()):
        raise RuntimeError(f"vLLM B={Bn}: all-miss step swap_counts {swap_counts.tolist()[:8]}..., expected {K}")
    if not torch.equal(swap_host.long().sort(dim=1).values, want_g.sort(dim=1).values):
        raise RuntimeError(f"vLLM B={Bn}: all-miss step asks for other host rows than the top-k's")
    gather()
    torch.cuda.synchronize()
    print(f"B={Bn}: vLLM, first resolve + gather_compact {time.perf_counter() - t0:.2f} s")
    hot_miss = hot_indices.clone()
    dgi_miss, lru_miss = dgi.clone(), lru.clone()

    # one all-hit step, checked
    hot_indices.fill_(-7)
    resolve()
    torch.cuda.synchronize()
    h1, m1 = _stats_pair(stats)
    if (h1 - h0, m1 - m0) != (n, 0):
        raise RuntimeError(f"vLLM B={Bn}: all-hit step reported (hits, misses) {(h1 - h0, m1 - m0)}, "
                           f"expected {(n, 0)}")
    if not bool((swap_counts == 0).all()):
        raise RuntimeError(f"vLLM B={Bn}: all-hit step swap_counts not all 0")
    if not bool((valid_counts == K).all()):
        raise RuntimeError(f"vLLM B={Bn}: all-hit step valid_counts {valid_counts.tolist()[:8]}..., "
                           f"expected {K}")
    if not torch.equal(hot_indices, hot_miss):
        raise RuntimeError(f"vLLM B={Bn}: all-hit step returned other hot rows than the miss step")
    if not torch.equal(attention_indices, hot_indices):
        raise RuntimeError(f"vLLM B={Bn}: attention_indices differ from hot_indices")
    hi = hot_indices.long()
    own_lo = torch.arange(Bn, device=dev)[:, None] * S  # request r's hot rows: [r*S, r*S + S)
    if not bool(((hi >= own_lo) & (hi < own_lo + S)).all()):
        raise RuntimeError(f"vLLM B={Bn}: a hot index lies outside its request's hot region")
    want = host_cache.index_select(0, want_g.flatten().cpu()).to(dev)
    if not torch.equal(hot_flat[hi.flatten()], want):
        raise RuntimeError(f"vLLM B={Bn}: a hot row returned by the all-hit step holds wrong bytes")
    state_fixed = torch.equal(dgi, dgi_miss) and torch.equal(lru, lru_miss)

    d = summary(timer.run(resolve, reps))
    h2, m2 = _stats_pair(stats)
    if m2 != m1:
        raise RuntimeError(f"vLLM B={Bn}: {m2 - m1} misses while timing the all-hit step")
    return d, {"state_fixed_point": state_fixed, "timed_calls": (h2 - h1) // n}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not out_ok(args.out, "bench_vllm_resolve"):
        return 2
    lib, why = find_library(args.lib)
    if lib is None:
        print(f"bench_vllm_resolve: {why}. Pass --lib PATH (see ../shared/GPU.md: the vllm 0.30.0 "
              "wheel holds vllm/_C_stable_libtorch.abi3.so).", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_vllm_resolve: no CUDA GPU; vLLM's op and ours need one (nothing measured)",
              file=sys.stderr)
        return 2
    try:
        ops = load_vllm_ops(lib)
    except RuntimeError as e:
        print(f"bench_vllm_resolve: {e}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    results = {"benchmark": "vllm_resolve", "args": vars(args), "env": environment(dev),
               "vllm_lib": str(lib),
               "vllm_schema": {"hisparse_resolve_residency": _schema(ops.hisparse_resolve_residency),
                               "hisparse_gather_compact": _schema(ops.hisparse_gather_compact)},
               "shape": {"K": K, "S": S, "W": W, "host_block_size": BK, "vllm_hot_block_size": HBS,
                         "seq": SEQ, "query_tokens_per_request": 1},
               "results": []}
    print("env:", json.dumps(results["env"]))
    print("vLLM op:", results["vllm_schema"]["hisparse_resolve_residency"])

    # one pool for all B: SEQ tokens for max(B) requests (so bench_staging's helper picks
    # seq = SEQ for every B), plus one block for vLLM's shifted block numbering
    pool_bytes = (SEQ * max(args.batches) + BK) * W
    t0 = time.perf_counter()
    buf = random_pool(pool_bytes, pin=True)
    print(f"pool: {pool_bytes / 2**30:.2f} GiB, pinned={buf.pinned}, ready in {time.perf_counter() - t0:.1f} s")
    ours_pool = buf.tensor[: pool_bytes - BK * W]  # what bench_staging's helper sees
    timer = Timer(True)
    g = torch.Generator().manual_seed(SEED)
    rows = []
    for Bn in args.batches:
        ours, case = run_ours(dev, timer, ours_pool, Bn, args.reps, g)
        vllm, info = run_vllm(ops, dev, timer, buf.tensor, case, args.reps)
        ratio = ours["median_us"] / vllm["median_us"]
        entry = {"B": Bn, "K": K, "S": S, "W": W, "ours_all_hit": ours, "vllm_all_hit": vllm,
                 "ratio_ours_over_vllm_median": ratio, "vllm_state_fixed_point": info["state_fixed_point"]}
        results["results"].append(entry)
        rows.append(entry)
        print(f"B={Bn} K={K} S={S}: all hits, {Bn * K} entries")
        print(fmt("ours  resolve_triton (all hit)", ours))
        print(fmt("vLLM  hisparse_resolve_residency (all hit)", vllm))
        print(f"  ratio ours / vLLM (median) {ratio:.2f}   vLLM state unchanged by a hit: "
              f"{info['state_fixed_point']}")
        del case
        torch.cuda.empty_cache()
    print()
    print(f"{'B':>4s} | {'ours min':>9s} {'med':>9s} {'p99':>9s} | {'vLLM min':>9s} {'med':>9s} "
          f"{'p99':>9s} | ours/vLLM")
    for e in rows:
        o, v = e["ours_all_hit"], e["vllm_all_hit"]
        print(f"{e['B']:4d} | {o['min_us']:9.1f} {o['median_us']:9.1f} {o['p99_us']:9.1f} | "
              f"{v['min_us']:9.1f} {v['median_us']:9.1f} {v['p99_us']:9.1f} | "
              f"{e['ratio_ours_over_vllm_median']:9.2f}")
    print("(us of GPU time per call; ratio < 1 means ours is faster)")
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
