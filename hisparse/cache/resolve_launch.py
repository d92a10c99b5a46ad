"""Launchers of the Triton resolve kernels (``hisparse.kernels.resolve`` and its
resident and lookup variants).

``resolve_triton`` has exactly the signature and semantics of
``hisparse.cache.resolve_ref.resolve_reference`` and pairs misses with victims the
same way, so both leave identical state and outputs.

What the launcher checks (from shapes, dtypes and devices only: it never reads a
device value, never allocates, and sizes the grid from T alone, so a call can be
captured in a CUDA graph): dtypes, ranks, devices, buffer capacities, the layer
index, and ``S >= max_query_len * K`` (the condition under which a group can never
run out of evictable slots). Index *contents* are not checked here: invalid entries
are handled by the kernel (treated as padding and counted in STAT_INVALID).

On CPU tensors the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set
by the test suite); without it a CPU call is a ValueError (the torch path is
``resolve_reference``, chosen by the caller, never substituted here).

For tools that compile or replace the kernel themselves (``benchmarks.resolve_registers``,
``benchmarks.resolve_phases``): ``resolve_launch_sizes`` and ``RESOLVE_SCAN_CHUNK`` /
``RESOLVE_SMALL_SORT`` are the launch shape and constants the launcher compiles it with;
``set_resolve_kernel`` has every launch use an instrumented copy instead.
"""

from __future__ import annotations

import functools

import torch
import triton

from .._checks import check_int, check_tensor, device_type, interpreter_mode
from ..device import on_device
from ..kernels.fast_launch import fast
from ..kernels.resolve import resolve_kernel
from ..kernels.resolve_lookup import resolve_lookup_kernel
from ..kernels.resolve_resident import resolve_resident_kernel
from .state import (NUM_STATS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_PREFETCH, STAT_RESIDENT,
                    STAT_RESOLVES, HotState, ResolveBuffers)


RESOLVE_SCAN_CHUNK = 256  # req_ids scanned per step for an earlier run of the same request
RESOLVE_SMALL_SORT = 256  # misses of a group sorted in a tile of this size when they fit


def _check_vec(name: str, x: object, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    x = check_tensor(name, x, dtype=dtype, ndim=ndim, device=device)
    if ndim and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.stride()}")


def check_state(state: HotState) -> None:
    """The layout the kernels assume of ``state``'s tensors (dtypes, one device,
    contiguous, [L, R] counters, row_slot [L, HV] with HV = NV x B for the NV block ids
    of host_block). A cache checks its own state once, when it is built (nothing
    replaces its tensors afterwards); the public launchers check per call."""
    dev = state.slot_pos.device
    for name, dtype in (("id_to_slot", torch.int32), ("seq_lens", torch.int32), ("block_table", torch.int32),
                        ("slot_pos", torch.int32), ("slot_stamp", torch.int64), ("row_slot", torch.int32),
                        ("host_block", torch.int32), ("step", torch.int64)):
        x = getattr(state, name)
        if x.dtype != dtype or x.device != dev or not x.is_contiguous():
            raise ValueError(f"state.{name} must be a contiguous {dtype} tensor on {dev}")
    if (state.row_slot.dim() != 2 or state.host_block.dim() != 1
            or state.row_slot.shape[1] != state.host_block.shape[0] * state.B):
        raise ValueError(f"state.row_slot must be int32 [L, NV x B] for state.host_block int32 [NV] "
                         f"(B = {state.B}), got row_slot {tuple(state.row_slot.shape)}, host_block "
                         f"{tuple(state.host_block.shape)}")
    if state.seq_lens.dim() != 2 or state.seq_lens.shape != state.step.shape:
        raise ValueError(f"state.seq_lens must be int32 [L, R] like state.step {tuple(state.step.shape)}, "
                         f"got {tuple(state.seq_lens.shape)}")
    if (state.stats.dtype != torch.int64 or state.stats.dim() != 2 or state.stats.shape[1] != NUM_STATS
            or state.stats.device != dev or not state.stats.is_contiguous()):
        raise ValueError(f"state.stats must be a contiguous int64 [L, {NUM_STATS}] tensor on {dev}")
    R = state.step.shape[1]
    for name, x, ndim in (("resident", state.resident, 1), ("page_table", state.page_table, 2)):
        if (x.dtype != torch.int32 or x.dim() != ndim or x.shape[0] != R or x.device != dev
                or not x.is_contiguous()):
            raise ValueError(f"state.{name} must be a contiguous int32 tensor of {R} rows on {dev}")


def _check_args(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                out: ResolveBuffers, max_query_len: int) -> None:
    dev = state.slot_pos.device
    L = state.slot_pos.shape[0]
    check_int("layer", layer, 0, L)
    check_int("max_query_len", max_query_len, 1)
    _check_vec("topk", topk, torch.int32, 2, dev)
    _check_vec("req_ids", req_ids, torch.int32, 1, dev)
    T, K = topk.shape
    if req_ids.shape[0] != T:
        raise ValueError(f"req_ids has {req_ids.shape[0]} entries but topk has {T} rows")
    if T and K == 0:
        raise ValueError("topk must have K >= 1 columns")
    if K and max_query_len * K > state.S:
        raise ValueError(
            f"max_query_len x K = {max_query_len} x {K} exceeds the S = {state.S} LRU slots "
            "per (layer, request); a group could run out of evictable slots"
        )
    check_state(state)
    _check_vec("out.physical", out.physical, torch.int32, 2, dev)
    _check_vec("out.valid_counts", out.valid_counts, torch.int32, 1, dev)
    if out.physical.shape[0] < T or out.physical.shape[1] < K:
        raise ValueError(f"out.physical {tuple(out.physical.shape)} is smaller than [T, K] = [{T}, {K}]")
    if T > 1 and out.physical.stride(0) < K:
        # overlapping rows: the resolve keeps each group's victim list in its own rows
        raise ValueError(f"out.physical rows overlap (row stride {out.physical.stride(0)} < K = {K}); "
                         "give a tensor whose rows are apart, e.g. a contiguous one")
    if out.valid_counts.shape[0] < T:
        raise ValueError(f"out.valid_counts has {out.valid_counts.shape[0]} entries, need {T}")
    _check_vec("out.stage_counts", out.stage_counts, torch.int32, 1, dev)
    if out.stage_counts.shape[0] < T:
        raise ValueError(f"out.stage_counts has {out.stage_counts.shape[0]} entries, need {T}")
    for name, dtype in (("stage_src", torch.int32), ("stage_dst", torch.int32), ("undo_hit", torch.int64),
                        ("undo_vpos", torch.int32), ("undo_vstamp", torch.int64)):
        x = getattr(out, name)
        _check_vec(f"out.{name}", x, dtype, 1, dev)
        if x.shape[0] < T * K:
            raise ValueError(f"out.{name} has {x.shape[0]} entries, need T*K = {T * K}")


def _check_miss_lists(miss_lists, T: int, K: int, phys_stride: int, dev: torch.device) -> None:
    mp, mh, mc = miss_lists
    for name, x in (("miss_phys", mp), ("miss_host", mh)):
        _check_vec(name, x, torch.int32, 2, dev)
        if x.shape[0] < T or x.shape[1] < K or x.stride(0) != phys_stride:
            raise ValueError(f"{name} must be int32 [>= {T}, >= {K}] with row stride {phys_stride} "
                             f"(that of out.physical), got {tuple(x.shape)} strides {x.stride()}")
    _check_vec("miss_counts", mc, torch.int32, 1, dev)
    if mc.shape[0] < T:
        raise ValueError(f"miss_counts has {mc.shape[0]} entries, need {T}")


@functools.lru_cache(maxsize=None)
def resolve_launch_sizes(S: int, K: int, max_query_len: int, *,
                         miss_phase: bool = False) -> tuple[int, int, int, int]:
    """(KB, GQ, SB, num_warps) of a resolve launch: the tiles (powers of two >= K,
    max_query_len and S) and the warps (``miss_phase``: the miss phase of a split resolve)."""
    KB = triton.next_power_of_2(K)
    GQ = triton.next_power_of_2(max_query_len)
    SB = triton.next_power_of_2(S)
    big = max(GQ * KB, SB)
    # 16 warps from 4096 lanes on: the miss phase is a chain of CTA-wide reductions and
    # scans, each faster with fewer lanes per thread. The miss phase of a split resolve
    # (``miss_phase``) takes 32 there: it runs beside the hit attention, whose blocks
    # wait for the SMs it holds, so its length is what counts (BENCHMARKS.md, "Resolve");
    # the whole resolve measured slower at 32 (BENCHMARKS.md, "Measured slower and removed")
    return KB, GQ, SB, (4 if big <= 1024 else (8 if big <= 2048 else (32 if miss_phase else 16)))


def set_resolve_kernel(kernel):
    """Have every resolve launch from now on (``resolve_triton``, a cache's) launch
    ``kernel`` in place of ``hisparse.kernels.resolve.resolve_kernel``; returns the kernel
    it replaces (set it back when done). ``kernel[grid](...)`` takes the real kernel's
    arguments: an instrumented copy of it (``benchmarks.resolve_phases``). A profiling
    hook: not thread-safe, never needed to use the cache."""
    global resolve_kernel
    previous, resolve_kernel = resolve_kernel, kernel
    return previous


def _require_device(dev: torch.device, what: str) -> None:
    if device_type(dev) != "cuda" and not interpreter_mode():
        raise ValueError(f"{what} on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1); "
                         "use the torch references of hisparse.cache.resolve_ref on CPU")


def resolve_triton(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                   out: ResolveBuffers, *, max_query_len: int, compact: bool = False,
                   stamped: bool = False, miss_lists: tuple | None = None,
                   prefetch: bool = False) -> None:
    """Resolve logical top-k into physical hot rows with the Triton kernel.

    state: the hot tier's bookkeeping (updated in place); req_ids: int32 [T];
    topk: int32 [T, K] (-1 = padding); out: buffers of capacity >= [T, K]. ``stamped``,
    ``miss_lists`` (int32 [T, K], int32 [T, K], int32 [T]) and ``prefetch`` as in
    ``resolve_reference``. Launches on the current stream; no host synchronisation,
    no allocation.
    """
    _check_args(state, layer, req_ids, topk, out, max_query_len)
    T, K = topk.shape
    if miss_lists is not None:
        _check_miss_lists(miss_lists, T, K, out.physical.stride(0), state.slot_pos.device)
    if topk.shape[0] == 0:
        return
    _require_device(topk.device, "resolve_triton")
    resolve_unchecked(state, layer, req_ids, topk, out, max_query_len=max_query_len, compact=compact,
                    stamped=stamped, miss_lists=miss_lists, prefetch=prefetch)


def resolve_unchecked(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                    out: ResolveBuffers, *, max_query_len: int, compact: bool = False,
                    stamped: bool = False, miss_lists: tuple | None = None,
                    prefetch: bool = False) -> None:
    """``resolve_triton`` without its checks, for a caller that made them (the cache:
    its state was checked when it was built, its output buffers are its own views of
    [T, K], and ``req_ids`` / ``topk`` / ``layer`` / K <= top_k were checked by the
    call; ``config`` guarantees max_query_len * top_k <= S). T = 0 launches nothing."""
    T, K = topk.shape
    if T == 0:
        return
    dev = topk.device
    S = state.S
    KB, GQ, SB, num_warps = resolve_launch_sizes(S, K, max_query_len, miss_phase=miss_lists is not None)
    mp, mh, mc = miss_lists if miss_lists is not None else (out.physical, out.physical, out.valid_counts)
    ls = state.layer(layer)
    bt = state.block_table
    with on_device(dev if device_type(dev) == "cuda" else None):
        fast(resolve_kernel)[(T,)](
            req_ids, topk, topk.stride(0),
            state.id_to_slot, state.id_to_slot.shape[0],
            ls.seq_lens, ls.seq_lens.shape[0],
            bt, bt.stride(0), bt.shape[1],
            ls.slot_pos, ls.slot_stamp,
            ls.row_slot, ls.row_slot.shape[0],  # HV: row keys (block id x B + offset) index row_slot
            ls.step, ls.stats,
            state.resident, state.page_table, state.page_table.stride(0), state.page_table.shape[1],
            state.pool_base, state.PB, state.pool_pages,
            out.physical, out.physical.stride(0), out.valid_counts,
            out.stage_src, out.stage_dst, out.undo_hit, out.undo_vpos, out.undo_vstamp,
            mp, mh, mc, out.stage_counts, state.host_block,
            T, K, S, state.B,
            STAT_HITS=STAT_HITS, STAT_MISSES=STAT_MISSES, STAT_INVALID=STAT_INVALID,
            STAT_RESOLVES=STAT_RESOLVES, STAT_PREFETCH=STAT_PREFETCH, STAT_RESIDENT=STAT_RESIDENT,
            HAS_POOL=state.pool_pages > 0, STAMPED=bool(stamped),
            MISS_LISTS=miss_lists is not None, PREFETCH=bool(prefetch),
            Q=max_query_len, KB=KB, GQ=GQ, SB=SB, SMALL_SORT=min(RESOLVE_SMALL_SORT, GQ * KB),
            COMPACT=bool(compact), CH=RESOLVE_SCAN_CHUNK, ALIASED=state.aliased, num_warps=num_warps,
        )


def resolve_resident_unchecked(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                             out: ResolveBuffers, *, max_query_len: int, compact: bool = False) -> None:
    """The resolve of a batch whose live requests are all resident
    (``kernels.resolve_resident``), one launch of T programs on the current stream;
    checked by the caller as ``resolve_unchecked`` is. T = 0 launches nothing.

    req_ids: int32 [T]; topk: int32 [T, K] (-1 = padding); out: buffers of capacity
    >= [T, K] (physical, valid_counts and the staging lists are written)."""
    T, K = topk.shape
    if T == 0:
        return
    dev = topk.device
    KB = triton.next_power_of_2(K)
    ls = state.layer(layer)
    with on_device(dev if device_type(dev) == "cuda" else None):
        fast(resolve_resident_kernel)[(T,)](
            req_ids, topk, topk.stride(0),
            state.id_to_slot, state.id_to_slot.shape[0],
            ls.seq_lens, ls.seq_lens.shape[0], ls.stats,
            state.resident, state.page_table, state.page_table.stride(0), state.page_table.shape[1],
            state.pool_base, state.PB, state.pool_pages,
            out.physical, out.physical.stride(0), out.valid_counts,
            out.stage_src, out.stage_dst, out.stage_counts,
            T, K,
            STAT_INVALID=STAT_INVALID, STAT_RESOLVES=STAT_RESOLVES, STAT_RESIDENT=STAT_RESIDENT,
            Q=max_query_len, KB=KB, COMPACT=bool(compact), CH=RESOLVE_SCAN_CHUNK,
            num_warps=4 if KB <= 1024 else 8,
        )


_LOOKUP_CHUNK = 256  # entries per program of the hit phase


def resolve_lookup_triton(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                          hit: torch.Tensor, undo_hit: torch.Tensor, *, max_query_len: int) -> None:
    """The hit phase of a split resolve (see ``resolve_lookup_reference``), one launch of
    ``resolve_lookup_kernel`` over (T, cdiv(K, 256)) programs on the current stream.

    hit: int32 [>= T, >= K] (output); undo_hit: int64 [>= T * K].
    """
    T, K = topk.shape
    dev = state.slot_pos.device
    _check_vec("topk", topk, torch.int32, 2, dev)
    _check_vec("req_ids", req_ids, torch.int32, 1, dev)
    _check_vec("hit", hit, torch.int32, 2, dev)
    _check_vec("undo_hit", undo_hit, torch.int64, 1, dev)
    check_int("layer", layer, 0, state.slot_pos.shape[0])
    check_int("max_query_len", max_query_len, 1)
    if req_ids.shape[0] != T or hit.shape[0] < T or hit.shape[1] < K or undo_hit.shape[0] < T * K:
        raise ValueError(f"resolve_lookup: req_ids {tuple(req_ids.shape)}, hit {tuple(hit.shape)} and "
                         f"undo_hit {tuple(undo_hit.shape)} do not fit topk [{T}, {K}]")
    if T == 0 or K == 0:
        return
    _require_device(dev, "resolve_lookup_triton")
    chunk = min(_LOOKUP_CHUNK, triton.next_power_of_2(K))
    with on_device(dev if device_type(dev) == "cuda" else None):
        fast(resolve_lookup_kernel)[(T, triton.cdiv(K, chunk))](
            req_ids, topk, topk.stride(0),
            state.id_to_slot, state.id_to_slot.shape[0],
            state.seq_lens[layer], state.seq_lens.shape[1],
            state.block_table, state.block_table.stride(0), state.block_table.shape[1],
            state.slot_stamp[layer], state.row_slot[layer], state.row_slot.shape[1],
            state.step[layer], state.stats[layer],
            state.resident, state.page_table, state.page_table.stride(0), state.page_table.shape[1],
            state.pool_base, state.PB, state.pool_pages, hit, hit.stride(0), undo_hit,
            T, K, state.S, state.B,
            STAT_HITS=STAT_HITS, STAT_INVALID=STAT_INVALID, STAT_RESIDENT=STAT_RESIDENT,
            HAS_POOL=state.pool_pages > 0, Q=max_query_len, CHUNK=chunk,
            CH=RESOLVE_SCAN_CHUNK, num_warps=4,
        )


__all__ = ["resolve_triton", "resolve_lookup_triton", "check_state", "resolve_launch_sizes", "RESOLVE_SCAN_CHUNK",
           "RESOLVE_SMALL_SORT", "set_resolve_kernel"]
