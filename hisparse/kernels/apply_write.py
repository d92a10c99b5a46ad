"""Triton body of a batched append's device updates (``HiSparseCache.write``):
one launch applies a ``WritePlan`` to one layer's hot tier, where the torch path takes
eleven small ops; :func:`apply_write_layers_kernel` applies one plan to a range of
layers in one launch, reading the rows from the host pool (a ``host_written`` step:
``hisparse.cache.write_pooled``).

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


@triton.jit
def _apply_entries(pid, flat_ptr, rows_ptr, hot_ptr, bt_ptr, bt_stride, row_slot_ptr, slot_pos_ptr,
                   slot_stamp_ptr, step_ptr, seq_lens_ptr, stats_ptr,
                   n_bt, n_hot, n_rs, n_unmap, n_host, n_len,
                   STAT_D2H: tl.constexpr, WW: tl.constexpr, WB: tl.constexpr, BLOCK: tl.constexpr):
    """Entries ``pid * BLOCK ..`` of every list of the plan at ``flat_ptr``, applied to
    one layer (its pointers given; the module docstring says what each list does)."""
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
    _apply_entries(tl.program_id(0), flat_ptr, rows_ptr, hot_ptr, bt_ptr, bt_stride, row_slot_ptr, slot_pos_ptr,
                   slot_stamp_ptr, step_ptr, seq_lens_ptr, stats_ptr, n_bt, n_hot, n_rs, n_unmap, n_host, n_len,
                   STAT_D2H, WW, WB, BLOCK)


@triton.jit(do_not_specialize=["layer0", "n_hot", "n_rs", "n_unmap", "n_host", "n_len", "extra"])
def apply_write_layers_kernel(
    flat_ptr,  # int64 [5 n_hot + 2 n_rs + n_unmap + 2 n_host + 2 n_len]: a plan with no block-table entries
    rows_ptr,  # int32 [L, H, WW]: the host pool's rows of every layer (pinned, over UVA); hot_tok holds host rows
    rows_layer,  # elements between two layers of rows_ptr
    hot_ptr,  # int32 [L, device_rows_per_layer, WW]: every layer's device rows as words
    hot_layer,  # elements between two layers of hot_ptr
    row_slot_ptr, row_slot_layer,  # int32 [L, HV] and its layer stride
    slot_pos_ptr, slot_pos_layer,  # int32 [L, R * (S + 1)]
    slot_stamp_ptr, slot_stamp_layer,  # int64 [L, R * (S + 1)]
    step_ptr, step_layer,  # int64 [L, R]
    seq_lens_ptr, seq_lens_layer,  # int32 [L, R]
    stats_ptr, stats_layer,  # int64 [L, NUM_STATS]
    layer0,  # the first layer written: program (p, j) writes layer layer0 + j
    n_hot, n_rs, n_unmap, n_host, n_len,  # list lengths
    extra,  # rows program (0, j) adds to the layer's device->host counter (a host_written step's rows)
    STAT_D2H: tl.constexpr, WW: tl.constexpr, WB: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    lay = (layer0 + tl.program_id(1)).to(tl.int64)
    stats = stats_ptr + lay * stats_layer
    _apply_entries(pid, flat_ptr, rows_ptr + lay * rows_layer, hot_ptr + lay * hot_layer, stats_ptr, 0,
                   row_slot_ptr + lay * row_slot_layer, slot_pos_ptr + lay * slot_pos_layer,
                   slot_stamp_ptr + lay * slot_stamp_layer, step_ptr + lay * step_layer,
                   seq_lens_ptr + lay * seq_lens_layer, stats, 0, n_hot, n_rs, n_unmap, n_host, n_len,
                   STAT_D2H, WW, WB, BLOCK)
    if pid == 0:
        if extra > 0:
            tl.atomic_add(stats + STAT_D2H, extra.to(tl.int64), sem="relaxed")
