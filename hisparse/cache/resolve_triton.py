"""Launcher of the Triton resolve kernel (``hisparse.kernels.resolve``).

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
"""

from __future__ import annotations

import contextlib

import torch
import triton

from .._checks import check_int, check_tensor, interpreter_mode
from ..kernels.resolve import resolve_kernel
from .state import (NUM_STATS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_RESOLVES,
                    HotState, ResolveBuffers)


_SCAN_CHUNK = 256  # req_ids scanned per step for an earlier run of the same request
_SMALL_SORT = 256  # misses of a group sorted in a tile of this size when they fit


def _check_vec(name: str, x: object, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    check_tensor(name, x, dtype=dtype, ndim=ndim, device=device)
    if ndim and x.stride(-1) != 1:  # type: ignore[union-attr]
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.stride()}")  # type: ignore[union-attr]


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
    for name, dtype in (("id_to_slot", torch.int32), ("seq_lens", torch.int32), ("block_table", torch.int32),
                        ("slot_pos", torch.int32), ("slot_stamp", torch.int64), ("row_slot", torch.int32),
                        ("step", torch.int64)):
        x = getattr(state, name)
        if x.dtype != dtype or x.device != dev or not x.is_contiguous():
            raise ValueError(f"state.{name} must be a contiguous {dtype} tensor on {dev}")
    if state.seq_lens.dim() != 2 or state.seq_lens.shape != state.step.shape:
        raise ValueError(f"state.seq_lens must be int32 [L, R] like state.step {tuple(state.step.shape)}, "
                         f"got {tuple(state.seq_lens.shape)}")
    if (state.stats.dtype != torch.int64 or state.stats.dim() != 2 or state.stats.shape[1] != NUM_STATS
            or state.stats.device != dev or not state.stats.is_contiguous()):
        raise ValueError(f"state.stats must be a contiguous int64 [L, {NUM_STATS}] tensor on {dev}")
    _check_vec("out.physical", out.physical, torch.int32, 2, dev)
    _check_vec("out.valid_counts", out.valid_counts, torch.int32, 1, dev)
    if out.physical.shape[0] < T or out.physical.shape[1] < K:
        raise ValueError(f"out.physical {tuple(out.physical.shape)} is smaller than [T, K] = [{T}, {K}]")
    if out.valid_counts.shape[0] < T:
        raise ValueError(f"out.valid_counts has {out.valid_counts.shape[0]} entries, need {T}")
    for name, dtype in (("stage_src", torch.int32), ("stage_dst", torch.int32), ("undo_hit", torch.int64),
                        ("undo_vpos", torch.int32), ("undo_vstamp", torch.int64)):
        x = getattr(out, name)
        _check_vec(f"out.{name}", x, dtype, 1, dev)
        if x.shape[0] < T * K:
            raise ValueError(f"out.{name} has {x.shape[0]} entries, need T*K = {T * K}")


def resolve_triton(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                   out: ResolveBuffers, *, max_query_len: int, compact: bool = False) -> None:
    """Resolve logical top-k into physical hot rows with the Triton kernel.

    state: the hot tier's bookkeeping (updated in place); req_ids: int32 [T];
    topk: int32 [T, K] (-1 = padding); out: buffers of capacity >= [T, K]. Launches
    on the current stream; no host synchronisation, no allocation.
    """
    _check_args(state, layer, req_ids, topk, out, max_query_len)
    T, K = topk.shape
    if T == 0:
        return
    dev = topk.device
    if dev.type != "cuda" and not interpreter_mode():
        raise ValueError("resolve_triton on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1); "
                         "use hisparse.cache.resolve_ref.resolve_reference on CPU")
    S = state.S
    KB = triton.next_power_of_2(K)
    GQ = triton.next_power_of_2(max_query_len)
    SB = triton.next_power_of_2(S)
    big = max(GQ * KB, SB)
    num_warps = 4 if big <= 1024 else (8 if big <= 4096 else 16)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        resolve_kernel[(T,)](
            req_ids, topk, topk.stride(0),
            state.id_to_slot, state.id_to_slot.shape[0],
            state.seq_lens[layer], state.seq_lens.shape[1],
            state.block_table, state.block_table.stride(0), state.block_table.shape[1],
            state.slot_pos[layer], state.slot_stamp[layer],
            state.row_slot[layer], state.row_slot.shape[1],
            state.step[layer], state.stats[layer],
            out.physical, out.physical.stride(0), out.valid_counts,
            out.stage_src, out.stage_dst, out.undo_hit, out.undo_vpos, out.undo_vstamp,
            T, K, S, state.B,
            STAT_HITS=STAT_HITS, STAT_MISSES=STAT_MISSES, STAT_INVALID=STAT_INVALID,
            STAT_RESOLVES=STAT_RESOLVES,
            Q=max_query_len, KB=KB, GQ=GQ, SB=SB, SMALL_SORT=min(_SMALL_SORT, GQ * KB),
            COMPACT=bool(compact), CH=_SCAN_CHUNK, num_warps=num_warps,
        )


__all__ = ["resolve_triton"]
