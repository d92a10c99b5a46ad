"""Sparse-MLA decode with the four 128-wide latent tiles fused into one [BLOCK_N, 512]
tile (an alternative body of ``mla_decode.sparse_mla_decode_kernel``; same arguments,
grid, outputs and split/combine contract -- read that module's docstring).

Why: the tiled kernel issues five q . k^T dots and four p . v dots per iteration, each
isolated in its own loop region (``ISOLATE_QK``), so every one ends with a wait on the
tensor cores. Here an iteration issues three: q_lat . k_lat^T (K = 512), q_rope .
k_rope^T (K = 64), each in its own one-trip loop (keeps the [4, 2] warp layout), and one
p . v over all 512 output columns. fp8 rows are loaded as [BLOCK_N, 4, 128] codes,
scaled by their [BLOCK_N, 4] tile scales and reshaped to [BLOCK_N, 512] (exact: the
scales are powers of two).

Its loop body and epilogue are written out rather than built from ``mla_blocks``'
``attend_block`` / ``store_tiles``: see "Debug scopes" in that module.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mla_blocks import LN2, finish, online_softmax, prefetch_block, split_range


@triton.jit
def _gather(kv_ptr, idx_row, start, hi, N, kv_stride, BLOCK_N: tl.constexpr,
            IS_FP8: tl.constexpr):
    """Load the rows of index entries [start, start + BLOCK_N) (entries at or beyond hi,
    -1 or outside [0, N) are masked, never dereferenced). Returns (valid bool [BLOCK_N],
    latent, scales, rope): fp8 rows give the e4m3 codes uint8 [BLOCK_N, 4, 128] and
    their tile scales float32 [BLOCK_N, 4]; bf16 rows give the latent bf16 [BLOCK_N, 512]
    and zeros for the scales. rope: bf16 [BLOCK_N, 64]."""
    kk = start + tl.arange(0, BLOCK_N)
    inr = kk < hi
    idx = tl.load(idx_row + kk, mask=inr, other=-1)
    valid = inr & (idx >= 0) & (idx < N)
    row_off = tl.where(valid, idx, 0).to(tl.int64) * kv_stride  # bytes (fp8) / elements (bf16)
    r = tl.arange(0, 64)
    if IS_FP8:
        tt = tl.arange(0, 4)
        d = tl.arange(0, 128)
        cptr = kv_ptr + row_off[:, None, None] + (tt[None, :, None] * 128 + d[None, None, :])
        lat = tl.load(cptr, mask=valid[:, None, None], other=0)
        sptr = (kv_ptr + row_off + 512).to(tl.pointer_type(tl.float32))
        sc = tl.load(sptr[:, None] + tt[None, :], mask=valid[:, None], other=0.0)
        rbase = (kv_ptr + row_off + 528).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rbase[:, None] + r[None, :], mask=valid[:, None], other=0.0)
    else:
        dl = tl.arange(0, 512)
        lat = tl.load(kv_ptr + row_off[:, None] + dl[None, :], mask=valid[:, None], other=0.0)
        sc = tl.zeros([BLOCK_N, 4], dtype=tl.float32)
        rope = tl.load(kv_ptr + row_off[:, None] + 512 + r[None, :], mask=valid[:, None],
                       other=0.0)
    return valid, lat, sc, rope


@triton.jit
def sparse_mla_decode_wide_kernel(
    q_ptr,  # bf16 [T, H, 576], last-dim stride 1
    kv_ptr,  # uint8 [N, 656] (IS_FP8) or bf16 [N, 576]; last-dim stride 1
    idx_ptr,  # int32 [T, K], -1 = padding
    vc_ptr,  # int32 [T] valid counts (read only when HAS_VC)
    out_ptr,  # bf16 [T, H, 512] contiguous (written when NUM_SPLITS == 1)
    lse_ptr,  # float32 [T, H] natural log (written when NUM_SPLITS == 1)
    part_out_ptr,  # float32 [T, NUM_SPLITS, H, 512] (written when NUM_SPLITS > 1)
    part_lse_ptr,  # float32 [T, NUM_SPLITS, H] base-2 lse (written when NUM_SPLITS > 1)
    N, K, H,  # rows, entries per token, heads
    q_stride_t, q_stride_h,  # elements
    kv_stride,  # bytes (fp8) or elements (bf16) between rows
    idx_stride,  # elements between index rows
    rows_per_split,  # entries per split (a multiple of BLOCK_N)
    qk_scale_log2,  # sm_scale * log2(e)
    HAS_VC: tl.constexpr,
    IS_FP8: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr = 0,  # L2-prefetch the rows PREFETCH blocks ahead (0 = off; GPU only)
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dl = tl.arange(0, 512)
    q_row = q_ptr + t * q_stride_t + heads.to(tl.int64)[:, None] * q_stride_h
    q_lat = tl.load(q_row + dl[None, :], mask=hmask[:, None], other=0.0)  # bf16 [BLOCK_H, 512]
    q_rope = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0)

    lo, hi = split_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC)
    idx_row = idx_ptr + t * idx_stride

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
    one = (lo >= 0).to(tl.int32)  # a runtime 1 for the one-trip loops (see mla_decode)
    for j in tl.static_range(1, PREFETCH):
        prefetch_block(kv_ptr, idx_row, lo + j * BLOCK_N, hi, N, kv_stride, BLOCK_N, IS_FP8)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH > 0:
            prefetch_block(kv_ptr, idx_row, start + PREFETCH * BLOCK_N, hi, N, kv_stride,
                           BLOCK_N, IS_FP8)
        valid, raw_lat, sc, k_rope = _gather(kv_ptr, idx_row, start, hi, N, kv_stride,
                                             BLOCK_N, IS_FP8)
        if IS_FP8:
            c16 = raw_lat.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            k3 = c16.to(tl.float32) * sc[:, :, None]
            k_lat = tl.reshape(k3.to(tl.bfloat16), [BLOCK_N, 512])
        else:
            k_lat = raw_lat
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for _ in range(0, one):
            s = tl.dot(q_lat, tl.trans(k_lat), s)
        for _ in range(0, one):
            s = tl.dot(q_rope, tl.trans(k_rope), s)
        p, alpha, m_new, l_i = online_softmax(s, valid, m_i, l_i, qk_scale_log2)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None])
        m_i = m_new

    inv_l, lse2 = finish(m_i, l_i)
    hm = hmask[:, None]
    if NUM_SPLITS == 1:
        o_row = out_ptr + (t * H + heads.to(tl.int64))[:, None] * 512 + dl[None, :]
        tl.store(o_row, (acc * inv_l[:, None]).to(tl.bfloat16), mask=hm)
        tl.store(lse_ptr + t * H + heads, lse2 * LN2, mask=hmask)
    else:
        base = (t * NUM_SPLITS + sp) * H + heads.to(tl.int64)
        tl.store(part_out_ptr + base[:, None] * 512 + dl[None, :], acc * inv_l[:, None], mask=hm)
        tl.store(part_lse_ptr + base, lse2, mask=hmask)
