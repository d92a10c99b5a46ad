"""Applying a batched append's ``WritePlan`` to one layer's hot tier: the Triton
launcher (one launch; kernel ``hisparse.kernels.apply_write``) and the torch
reference (the same updates as eleven small torch ops). Both leave identical state.
The ``layers`` pair applies one plan to a range of layers, the rows read from the host
pool (a ``host_written`` step's pooled write, ``hisparse.cache.write_pooled``).

The caller orders the launch: on GPU the current stream must already wait for the
host mirror of any row whose hot slot the plan overwrites (``HiSparseCache``
does this when the plan unmaps a reserved-slot occupant).
"""

from __future__ import annotations

import torch

from ..device import on_device
from ..kernels.fast_launch import fast
from ..kernels.apply_write import apply_write_layers_kernel, apply_write_plan_kernel

from .state import STAT_D2H_ROWS, HotState
from .transfer import row_words
from .write_plan import WritePlan

BLOCK = 16  # entries of each index list per program
POOLED_CHUNK_BYTES = 64 << 20  # the torch reference's pooled write gathers at most this much at a time


def apply_write_plan_reference(state: HotState, hot: torch.Tensor, rows: torch.Tensor,
                               plan: WritePlan, layer: int) -> None:
    """hot: uint8 [device_rows_per_layer, row_bytes], the layer's device rows; rows: uint8
    [T, row_bytes], the new rows the plan's tokens index."""
    _apply_reference(state, hot, lambda tok: rows.index_select(0, tok), plan, layer)


def _valid(first: torch.Tensor, *rest: torch.Tensor) -> list[torch.Tensor]:
    m = first >= 0  # -1 = padding (a step plan padded to a graph bucket)
    return [first[m]] + [x[m] for x in rest]


def _apply_reference(state: HotState, hot: torch.Tensor, gather, plan: WritePlan, layer: int) -> None:
    """The plan applied to ``layer``; ``gather(hot_tok)`` gives the rows (uint8 [n,
    row_bytes] on hot's device) of the valid hot_tok entries (int64 [n] on the plan's
    device)."""
    st = state
    bt_r, bt_k, bt_v = _valid(plan.bt_r, plan.bt_k, plan.bt_v)
    if bt_r.numel():
        st.block_table[bt_r, bt_k] = bt_v
    (unmap,) = _valid(plan.unmap)
    if unmap.numel():
        st.row_slot[layer].index_fill_(0, unmap, -1)
    hot_dst, hot_tok, sp_idx, sp_pos, sp_r = _valid(plan.hot_dst, plan.hot_tok, plan.sp_idx, plan.sp_pos,
                                                    plan.sp_r)
    if hot_dst.numel():
        hot.index_copy_(0, hot_dst, gather(hot_tok))
        slot = sp_idx >= 0  # -1: a resident request's page row, no slot state
        sp_idx, sp_pos, sp_r = sp_idx[slot], sp_pos[slot], sp_r[slot]
        st.slot_pos[layer].view(-1).index_copy_(0, sp_idx, sp_pos)
        st.slot_stamp[layer].view(-1).index_copy_(0, sp_idx, st.step[layer].index_select(0, sp_r))
    rs_h, rs_v = _valid(plan.rs_h, plan.rs_v)
    if rs_h.numel():
        st.row_slot[layer].index_copy_(0, rs_h, rs_v)
    len_r, len_v = _valid(plan.len_r, plan.len_v)
    st.seq_lens[layer].index_copy_(0, len_r, len_v)
    st.stats[layer, STAT_D2H_ROWS] += (plan.host_h >= 0).sum()


def apply_write_layers_reference(state: HotState, hot: torch.Tensor, pool_rows: torch.Tensor, plan: WritePlan,
                                 layers: range, extra: int) -> None:
    """``plan`` (no block-table entries; hot_tok holds host rows) applied to every layer
    of ``layers`` at once (the same updates as ``apply_write_plan_reference``, each op
    over the layers' slice), its rows read from the host pool. hot: uint8 [L,
    device_rows_per_layer, row_bytes]; pool_rows: uint8 [L, H, row_bytes] (CPU);
    ``extra``: rows added to each layer's device -> host counter."""
    check_pooled(hot, pool_rows, plan, layers)
    st, ls = state, slice(layers.start, layers.stop)
    if not len(layers):
        return
    (unmap,) = _valid(plan.unmap)
    if unmap.numel():
        st.row_slot[ls, unmap] = -1
    hot_dst, hot_tok, sp_idx, sp_pos, sp_r = _valid(plan.hot_dst, plan.hot_tok, plan.sp_idx, plan.sp_pos,
                                                    plan.sp_r)
    if hot_dst.numel():
        tok = hot_tok.to(pool_rows.device)
        step = max(1, POOLED_CHUNK_BYTES // (tok.numel() * pool_rows.shape[2]))  # layers per gather
        for l0 in range(layers.start, layers.stop, step):
            l1 = min(l0 + step, layers.stop)
            hot[l0:l1, hot_dst] = pool_rows[l0:l1, tok].to(hot.device)  # uint8 [l1 - l0, n, row_bytes]
        slot = sp_idx >= 0  # -1: a resident request's page row, no slot state
        sp_idx, sp_pos, sp_r = sp_idx[slot], sp_pos[slot], sp_r[slot]
        L = st.slot_pos.shape[0]
        st.slot_pos.view(L, -1)[ls, sp_idx] = sp_pos
        st.slot_stamp.view(L, -1)[ls, sp_idx] = st.step[ls, sp_r]
    rs_h, rs_v = _valid(plan.rs_h, plan.rs_v)
    if rs_h.numel():
        st.row_slot[ls, rs_h] = rs_v
    len_r, len_v = _valid(plan.len_r, plan.len_v)
    st.seq_lens[ls, len_r] = len_v
    st.stats[ls, STAT_D2H_ROWS] += (plan.host_h >= 0).sum() + extra


def check_pooled(hot: torch.Tensor, pool_rows: torch.Tensor, plan: WritePlan, layers: range) -> None:
    """ValueError unless ``layers`` is a range of step 1 inside both hot (uint8 [L, N, W])
    and pool_rows (uint8 [L, H, W]), of the same row width (a multiple of 4), and the
    plan has no block-table entries."""
    W = pool_rows.shape[2]
    if hot.shape[2] != W or W % 4:
        raise ValueError(f"pool rows are {W} bytes and hot rows {hot.shape[2]}: both must be the same "
                         "multiple of 4")
    if not isinstance(layers, range) or layers.step != 1 or layers.start < 0 or \
            layers.stop > min(hot.shape[0], pool_rows.shape[0]):
        raise ValueError(f"layers must be a range of step 1 inside the {hot.shape[0]} layers, got {layers!r}")
    if plan.counts[0]:
        raise ValueError("a pooled write's plan has no block-table entries (a step plan's are written "
                         "when the step is prepared)")


def apply_write_plan_triton(state: HotState, hot: torch.Tensor, rows: torch.Tensor,
                            plan: WritePlan, layer: int) -> None:
    """Same arguments and result as ``apply_write_plan_reference``, one launch on the
    current stream (CPU tensors: the Triton interpreter). Reads no device value."""
    W = rows.shape[1]
    if hot.shape[1] != W or W % 4:
        raise ValueError(f"rows are {W} bytes and hot rows {hot.shape[1]}: both must be the same "
                         "multiple of 4")
    longest = max(plan.counts)
    if longest == 0:
        return
    st = state
    bt = st.block_table
    ls = st.layer(layer)
    ww, wb = row_words(W)
    grid = (-(-longest // BLOCK),)
    with on_device(hot.device if hot.is_cuda else None):
        fast(apply_write_plan_kernel)[grid](
            plan.flat, rows.view(torch.int32), hot.view(torch.int32), bt, bt.stride(0),
            ls.row_slot, ls.slot_pos, ls.slot_stamp, ls.step, ls.seq_lens, ls.stats, *plan.counts,
            STAT_D2H=STAT_D2H_ROWS, WW=ww, WB=wb, BLOCK=BLOCK,
            num_warps=4)


def apply_write_layers_triton(state: HotState, hot: torch.Tensor, pool_rows: torch.Tensor, plan: WritePlan,
                              layers: range, extra: int) -> None:
    """Same arguments and result as ``apply_write_layers_reference``, one launch on the
    current stream (the pool read over UVA; CPU tensors: the Triton interpreter)."""
    check_pooled(hot, pool_rows, plan, layers)
    W = pool_rows.shape[2]
    if not len(layers):
        return
    longest = max(max(plan.counts), 1 if extra else 0)
    if longest == 0:
        return
    st = state
    ww, wb = row_words(W)
    grid = (-(-longest // BLOCK), len(layers))
    t = (st.row_slot, st.slot_pos, st.slot_stamp, st.step, st.seq_lens, st.stats)
    with on_device(hot.device if hot.is_cuda else None):
        fast(apply_write_layers_kernel)[grid](
            plan.flat, pool_rows.view(torch.int32), pool_rows.stride(0) // 4, hot.view(torch.int32),
            hot.stride(0) // 4, *(x for y in t for x in (y, y.stride(0))), layers.start, *plan.counts[1:], extra,
            STAT_D2H=STAT_D2H_ROWS, WW=ww, WB=wb, BLOCK=BLOCK,
            num_warps=4)


__all__ = ["apply_write_plan_reference", "apply_write_plan_triton", "apply_write_layers_reference",
           "apply_write_layers_triton"]
