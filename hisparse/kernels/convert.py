"""Triton body of the logical -> physical top-k index conversion.

Launcher, validation and the torch reference live in ``hisparse.staging.convert``;
the semantics are spelled out there. One program per query token walks its K
entries in tiles of BLOCK_N, so the valid entries can be compacted to the front of
the row with a running prefix sum (no atomics, no scratch memory).

Loop bounds are constexpr (NUM_TILES): Triton's CPU interpreter cannot iterate over a
runtime int argument under NumPy >= 2.4 (it calls int() on a 1-element array), and K
is fixed per model anyway, so one compiled variant serves every step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def convert_topk_kernel(
    topk_ptr,  # int32 [T, K] request-local positions, -1 = padding
    req_ptr,  # int32 [T] row of the block table of each token
    bt_ptr,  # int32 [R, NB] block table (physical block of each logical block)
    out_ptr,  # int32 [T, K] physical rows / workspace offsets, -1 = padding
    counts_ptr,  # int32 [T] valid entries per token (written when WRITE_COUNTS)
    pre_ptr,  # int32 [T] prefill request of each token, -1 = decode (HAS_PREFILL)
    ws_start_ptr,  # int32 [P] workspace row where each prefill request starts (HAS_PREFILL)
    ws_len_ptr,  # int32 [P] rows of each prefill request in the workspace (HAS_WS_LENS)
    seq_ptr,  # int32 [R] valid positions of each block-table row (HAS_SEQ_LENS)
    K,  # entries per token
    R,  # block-table rows
    NB,  # blocks per block-table row
    P,  # prefill requests
    block_stride,  # rows between consecutive physical blocks (>= BLOCK_SIZE)
    stride_topk,  # elements between rows of topk
    stride_out,  # elements between rows of out
    stride_bt,  # elements between rows of the block table
    BLOCK_SIZE: tl.constexpr,  # logical positions per block
    BLOCK_N: tl.constexpr,  # entries per tile (power of two)
    NUM_TILES: tl.constexpr,  # cdiv(K, BLOCK_N); constexpr loop bound (see module docstring)
    HAS_PREFILL: tl.constexpr,
    HAS_WS_LENS: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    COMPACT: tl.constexpr,
    WRITE_COUNTS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    req_ok = (req >= 0) & (req < R)
    req_safe = tl.where(req_ok, req, 0)
    seq_len = tl.full((), 2**62, tl.int64)
    if HAS_SEQ_LENS:
        seq_len = tl.load(seq_ptr + req_safe, mask=req_ok, other=0).to(tl.int64)

    if HAS_PREFILL:
        p = tl.load(pre_ptr + t).to(tl.int64)
        is_pre = p >= 0
        pre_ok = is_pre & (p < P)
        p_safe = tl.where(pre_ok, p, 0)
        ws_start = tl.load(ws_start_ptr + p_safe, mask=pre_ok, other=0).to(tl.int64)
        ws_len = tl.full((), 2**62, tl.int64)
        if HAS_WS_LENS:
            ws_len = tl.load(ws_len_ptr + p_safe, mask=pre_ok, other=0).to(tl.int64)

    cols = tl.arange(0, BLOCK_N)
    count = tl.zeros((), tl.int32)
    for i in range(NUM_TILES):
        offs = i * BLOCK_N + cols
        in_row = offs < K
        pos = tl.load(topk_ptr + t * stride_topk + offs, mask=in_row, other=-1).to(tl.int64)
        nonneg = pos >= 0
        # decode token: through the block table
        blk = pos // BLOCK_SIZE
        dec_ok = nonneg & req_ok & (blk < NB) & (pos < seq_len)
        if HAS_PREFILL:
            dec_ok = dec_ok & (~is_pre)
        pblk = tl.load(bt_ptr + req_safe * stride_bt + blk, mask=dec_ok, other=-1).to(tl.int64)
        dec_ok = dec_ok & (pblk >= 0)
        dec_val = pblk * block_stride + pos % BLOCK_SIZE
        val = dec_val
        ok = dec_ok
        if HAS_PREFILL:
            # prefill token: offset into the staged workspace
            ok_pre = nonneg & pre_ok & (pos < ws_len)
            val = tl.where(is_pre, ws_start + pos, dec_val)
            ok = tl.where(is_pre, ok_pre, dec_ok)
        ok = ok & (val < 2147483648)  # rows are int32: a larger one would wrap onto a real row
        val = tl.where(ok, val, -1).to(tl.int32)
        if COMPACT:
            ok_i = ok.to(tl.int32)
            dest = count + tl.cumsum(ok_i, axis=0) - 1
            tl.store(out_ptr + t * stride_out + dest, val, mask=ok)
            count += tl.sum(ok_i, axis=0)
        else:
            tl.store(out_ptr + t * stride_out + offs, val, mask=in_row)
            count += tl.sum(ok.to(tl.int32), axis=0)
    if COMPACT:
        for i in range(NUM_TILES):
            offs = i * BLOCK_N + cols
            pad = (offs < K) & (offs >= count)
            tl.store(out_ptr + t * stride_out + offs, tl.full((BLOCK_N,), -1, tl.int32), mask=pad)
    if WRITE_COUNTS:
        tl.store(counts_ptr + t, count)
