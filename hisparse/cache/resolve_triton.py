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

On a CPU tensor the kernel runs only when the Triton interpreter is requested
(``TRITON_INTERPRET=1``, set by the test suite); otherwise the reference runs.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton

from ..kernels.resolve import resolve_kernel
from .resolve_ref import resolve_reference
from .state import (NUM_STATS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_RESOLVES,
                    HotState, ResolveBuffers)


_SCAN_CHUNK = 256  # req_ids scanned per step for an earlier run of the same request
_SMALL_SORT = 256  # misses of a group sorted in a tile of this size when they fit


def interpreter_requested() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_i32(name: str, x: torch.Tensor, ndim: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the cache state is on {device}")
    if ndim and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.stride()}")


def _check_args(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                out: ResolveBuffers, max_query_len: int) -> None:
    dev = state.slot_pos.device
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    L = state.slot_pos.shape[0]
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range [0, {L})")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len must be an int >= 1, got {max_query_len!r}")
    _check_i32("topk", topk, 2, dev)
    _check_i32("req_ids", req_ids, 1, dev)
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
    for name in ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp",
                 "row_slot", "step"):
        x = getattr(state, name)
        if x.dtype != torch.int32 or x.device != dev or not x.is_contiguous():
            raise ValueError(f"state.{name} must be a contiguous int32 tensor on {dev}")
    if state.seq_lens.dim() != 2 or state.seq_lens.shape != state.step.shape:
        raise ValueError(f"state.seq_lens must be int32 [L, R] like state.step {tuple(state.step.shape)}, "
                         f"got {tuple(state.seq_lens.shape)}")
    if (state.stats.dtype != torch.int64 or state.stats.dim() != 2 or state.stats.shape[1] != NUM_STATS
            or state.stats.device != dev or not state.stats.is_contiguous()):
        raise ValueError(f"state.stats must be a contiguous int64 [L, {NUM_STATS}] tensor on {dev}")
    _check_i32("out.physical", out.physical, 2, dev)
    _check_i32("out.valid_counts", out.valid_counts, 1, dev)
    _check_i32("out.stage_src", out.stage_src, 1, dev)
    _check_i32("out.stage_dst", out.stage_dst, 1, dev)
    if out.physical.shape[0] < T or out.physical.shape[1] < K:
        raise ValueError(f"out.physical {tuple(out.physical.shape)} is smaller than [T, K] = [{T}, {K}]")
    if out.valid_counts.shape[0] < T:
        raise ValueError(f"out.valid_counts has {out.valid_counts.shape[0]} entries, need {T}")
    for name in ("stage_src", "stage_dst"):
        if getattr(out, name).shape[0] < T * K:
            raise ValueError(f"out.{name} has {getattr(out, name).shape[0]} entries, need T*K = {T * K}")


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
    if dev.type != "cuda" and not interpreter_requested():
        resolve_reference(state, layer, req_ids, topk, out, max_query_len=max_query_len,
                          compact=compact)
        return
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
            out.stage_src, out.stage_dst,
            T, K, S, state.B,
            STAT_HITS=STAT_HITS, STAT_MISSES=STAT_MISSES, STAT_INVALID=STAT_INVALID,
            STAT_RESOLVES=STAT_RESOLVES,
            Q=max_query_len, KB=KB, GQ=GQ, SB=SB, SMALL_SORT=min(_SMALL_SORT, GQ * KB),
            COMPACT=bool(compact), CH=_SCAN_CHUNK, num_warps=num_warps,
        )


__all__ = ["resolve_triton", "interpreter_requested"]
