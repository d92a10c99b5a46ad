"""Applying a batched append's ``WritePlan`` to one layer's hot tier: the Triton
launcher (one launch; kernel ``hisparse.kernels.apply_write``) and the torch
reference (the same updates as eleven small torch ops). Both leave identical state.

The caller orders the launch: on GPU the current stream must already wait for the
host mirror of any row whose hot slot the plan overwrites (``HiSparseCache``
does this when the plan unmaps a reserved-slot occupant).
"""

from __future__ import annotations

import torch

from ..device import on_device
from ..kernels.fast_launch import fast
from ..kernels.apply_write import apply_write_plan_kernel

from .state import STAT_D2H_ROWS, HotState
from .transfer import row_words
from .write_plan import WritePlan

BLOCK = 16  # entries of each index list per program


def apply_write_plan_reference(state: HotState, hot: torch.Tensor, rows: torch.Tensor,
                               plan: WritePlan, layer: int) -> None:
    """hot: uint8 [device_rows_per_layer, row_bytes], the layer's device rows; rows: uint8
    [T, row_bytes], the new rows the plan's tokens index."""
    st = state

    def valid(first: torch.Tensor, *rest: torch.Tensor) -> list[torch.Tensor]:
        m = first >= 0  # -1 = padding (a step plan padded to a graph bucket)
        return [first[m]] + [x[m] for x in rest]

    bt_r, bt_k, bt_v = valid(plan.bt_r, plan.bt_k, plan.bt_v)
    if bt_r.numel():
        st.block_table[bt_r, bt_k] = bt_v
    (unmap,) = valid(plan.unmap)
    if unmap.numel():
        st.row_slot[layer].index_fill_(0, unmap, -1)
    hot_dst, hot_tok, sp_idx, sp_pos, sp_r = valid(plan.hot_dst, plan.hot_tok, plan.sp_idx, plan.sp_pos,
                                                   plan.sp_r)
    if hot_dst.numel():
        hot.index_copy_(0, hot_dst, rows.index_select(0, hot_tok))
        slot = sp_idx >= 0  # -1: a resident request's page row, no slot state
        sp_idx, sp_pos, sp_r = sp_idx[slot], sp_pos[slot], sp_r[slot]
        st.slot_pos[layer].view(-1).index_copy_(0, sp_idx, sp_pos)
        st.slot_stamp[layer].view(-1).index_copy_(0, sp_idx, st.step[layer].index_select(0, sp_r))
    rs_h, rs_v = valid(plan.rs_h, plan.rs_v)
    if rs_h.numel():
        st.row_slot[layer].index_copy_(0, rs_h, rs_v)
    len_r, len_v = valid(plan.len_r, plan.len_v)
    st.seq_lens[layer].index_copy_(0, len_r, len_v)
    st.stats[layer, STAT_D2H_ROWS] += (plan.host_h >= 0).sum()


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


__all__ = ["apply_write_plan_reference", "apply_write_plan_triton"]
