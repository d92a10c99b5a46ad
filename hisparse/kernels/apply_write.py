"""Triton body of a batched append's device updates (``HiSparseCache.write``):
one launch applies a ``WritePlan`` to one layer's hot tier, where the torch path takes
eleven small ops.

The plan's index lists lie back to back in one int64 tensor, in ``write_plan._NAMES``
order: bt_r, bt_k, bt_v (n_bt each), hot_dst, hot_tok, sp_idx, sp_pos, sp_r (n_hot
each), rs_h, rs_v (n_rs), unmap (n_unmap), host_h, host_tok (n_host), len_r, len_v
(n_len). Program p applies entry p * BLOCK + j of every list:

  block_table[bt_r, bt_k] = bt_v
  row_slot[unmap] = -1
  hot[hot_dst] = rows[hot_tok]             (a whole row, as int32 words)
  slot_pos[sp_idx] = sp_pos; slot_stamp[sp_idx] = step[sp_r]   (sp_idx >= 0: a hot slot;
                                           -1: a resident request's page row)
  row_slot[rs_h] = rs_v
  seq_lens[len_r] = len_v
  stats[STAT_D2H] += host rows mirrored    (the valid host_h entries, atomically)

An entry of -1 is padding and skipped (a step plan padded to a CUDA-graph bucket's
fixed lengths, ``hisparse.cache.write_step``): the first list of each group decides.
Every list writes distinct targets, and no host row is both unmapped and mapped in one
plan (an unmapped row is an older position than every row written), so the programs
need no ordering among themselves.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_bt", "n_hot", "n_rs", "n_unmap", "n_host", "n_len"])
def apply_write_plan_kernel(
    flat_ptr,  # int64 [3 n_bt + 5 n_hot + 2 n_rs + n_unmap + 2 n_host + 2 n_len]
    rows_ptr,  # int32 [T, WW]: the new rows (uint8 [T, row_bytes] viewed as words)
    hot_ptr,  # int32 [device_rows_per_layer, WW]: the layer's device rows as words
    bt_ptr,  # int32 [R, max_blocks] block table
    bt_stride,  # elements between block-table rows
    row_slot_ptr,  # int32 [HV] row_slot of the layer, by row key (hisparse.cache.state)
    slot_pos_ptr,  # int32 [R * (S + 1)] slot_pos of the layer
    slot_stamp_ptr,  # int64 [R * (S + 1)] slot_stamp of the layer
    step_ptr,  # int64 [R] step of the layer
    seq_lens_ptr,  # int32 [R] seq_lens of the layer
    stats_ptr,  # int64 [NUM_STATS] stats of the layer
    n_bt, n_hot, n_rs, n_unmap, n_host, n_len,  # list lengths
    STAT_D2H: tl.constexpr,  # index of the device->host row counter in stats
    WW: tl.constexpr,  # int32 words per row
    WB: tl.constexpr,  # next power of two >= WW
    BLOCK: tl.constexpr,  # entries of each list per program
):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    o_hot = 3 * n_bt
    o_rs = o_hot + 5 * n_hot
    o_un = o_rs + 2 * n_rs
    o_host = o_un + n_unmap
    o_len = o_host + 2 * n_host

    m = i < n_bt
    r = tl.load(flat_ptr + i, mask=m, other=-1)
    m = m & (r >= 0)
    k = tl.load(flat_ptr + n_bt + i, mask=m, other=0)
    v = tl.load(flat_ptr + 2 * n_bt + i, mask=m, other=0)
    tl.store(bt_ptr + r * bt_stride + k, v.to(tl.int32), mask=m)

    m = i < n_unmap
    h = tl.load(flat_ptr + o_un + i, mask=m, other=-1)
    m = m & (h >= 0)
    tl.store(row_slot_ptr + h, tl.full([BLOCK], -1, tl.int32), mask=m)

    m = i < n_hot
    dst = tl.load(flat_ptr + o_hot + i, mask=m, other=-1)
    m = m & (dst >= 0)
    tok = tl.load(flat_ptr + o_hot + n_hot + i, mask=m, other=0)
    spi = tl.load(flat_ptr + o_hot + 2 * n_hot + i, mask=m, other=0)
    spp = tl.load(flat_ptr + o_hot + 3 * n_hot + i, mask=m, other=0)
    spr = tl.load(flat_ptr + o_hot + 4 * n_hot + i, mask=m, other=0)
    w = tl.arange(0, WB)
    m2 = m[:, None] & (w < WW)[None, :]
    words = tl.load(rows_ptr + tok[:, None] * WW + w[None, :], mask=m2)
    tl.store(hot_ptr + dst[:, None] * WW + w[None, :], words, mask=m2)
    ms = m & (spi >= 0)  # -1: a resident request's page row, no slot state
    tl.store(slot_pos_ptr + spi, spp.to(tl.int32), mask=ms)
    stamp = tl.load(step_ptr + spr, mask=ms, other=0)
    tl.store(slot_stamp_ptr + spi, stamp, mask=ms)

    m = i < n_rs
    h = tl.load(flat_ptr + o_rs + i, mask=m, other=-1)
    m = m & (h >= 0)
    v = tl.load(flat_ptr + o_rs + n_rs + i, mask=m, other=0)
    tl.store(row_slot_ptr + h, v.to(tl.int32), mask=m)

    m = i < n_len
    r = tl.load(flat_ptr + o_len + i, mask=m, other=-1)
    m = m & (r >= 0)
    v = tl.load(flat_ptr + o_len + n_len + i, mask=m, other=0)
    tl.store(seq_lens_ptr + r, v.to(tl.int32), mask=m)

    m = i < n_host
    h = tl.load(flat_ptr + o_host + i, mask=m, other=-1)
    n_valid = tl.sum((m & (h >= 0)).to(tl.int64), axis=0)
    if n_valid > 0:
        tl.atomic_add(stats_ptr + STAT_D2H, n_valid, sem="relaxed")
