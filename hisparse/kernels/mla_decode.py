"""Triton bodies of sparse-MLA attention (decode over bf16 / fp8_ds_mla rows; prefill
reuses the bf16 path over the staged workspace). Launcher: ``hisparse.attention.triton_backend``.

Notation: T query tokens, H heads, K selected entries per token, N rows, D_QK = 576
(4 latent tiles of 128 + 64 RoPE), D_V = 512 (the 4 latent tiles).

Grid of the main kernel: (T, cdiv(H, BLOCK_H), NUM_SPLITS). Program (t, hb, sp) takes
the head block hb of token t and the entries [sp * rows_per_split, (sp + 1) *
rows_per_split) of its index row (split-KV, so small T still fills the GPU). Per
iteration it gathers BLOCK_N rows *once* for all BLOCK_H heads, dequantizes them to
bf16 in registers (fp8: e4m3 bytes bitcast to float8e4nv times the tile scale, exact
since scales are powers of two; RoPE bf16 as stored), and runs an online softmax
(base 2) with tl.dot for q . k^T and p . v. Invalid entries (index -1, index outside
[0, N), or k >= valid_counts[t]) are masked and never dereferenced.

With one split the kernel writes ``out`` bf16 and ``lse`` (natural log) directly;
otherwise each split writes a normalised float32 partial output and its base-2 lse,
and ``sparse_mla_combine_kernel`` merges them: lse = log2(sum_s 2^lse_s), out =
sum_s 2^(lse_s - lse) * out_s. A head with no valid entry: out = 0, lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _latent_tile(kv_ptr, row_off, valid, TILE_I: tl.constexpr, IS_FP8: tl.constexpr):
    """bf16 [BLOCK_N, 128]: latent tile TILE_I of the gathered rows (0 where not valid).

    row_off: int64 [BLOCK_N] row start (bytes for fp8 rows, elements for bf16 rows).
    """
    cols = TILE_I * 128 + tl.arange(0, 128)
    ptrs = kv_ptr + row_off[:, None] + cols[None, :]
    if IS_FP8:
        codes = tl.load(ptrs, mask=valid[:, None], other=0)
        sptr = (kv_ptr + row_off + (512 + 4 * TILE_I)).to(tl.pointer_type(tl.float32))
        scale = tl.load(sptr, mask=valid, other=0.0)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        return x.to(tl.bfloat16)
    else:
        return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def _rope_tile(kv_ptr, row_off, valid, IS_FP8: tl.constexpr):
    """bf16 [BLOCK_N, 64]: the RoPE part of the gathered rows (0 where not valid)."""
    r = tl.arange(0, 64)
    if IS_FP8:
        base = (kv_ptr + row_off + 528).to(tl.pointer_type(tl.bfloat16))
        return tl.load(base[:, None] + r[None, :], mask=valid[:, None], other=0.0)
    else:
        return tl.load(kv_ptr + row_off[:, None] + 512 + r[None, :], mask=valid[:, None],
                       other=0.0)


@triton.jit
def sparse_mla_decode_kernel(
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
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, 128)
    q_row = q_ptr + t * q_stride_t + heads.to(tl.int64)[:, None] * q_stride_h
    q0 = tl.load(q_row + d[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + 128 + d[None, :], mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + 256 + d[None, :], mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + 384 + d[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0)

    k_end = K
    if HAS_VC:
        k_end = tl.minimum(tl.maximum(tl.load(vc_ptr + t), 0), K)
    lo = sp * rows_per_split
    hi = tl.minimum(lo + rows_per_split, k_end)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    idx_row = idx_ptr + t * idx_stride
    for start in range(lo, hi, BLOCK_N):
        kk = start + tl.arange(0, BLOCK_N)
        inr = kk < hi
        idx = tl.load(idx_row + kk, mask=inr, other=-1)
        valid = inr & (idx >= 0) & (idx < N)
        row_off = tl.where(valid, idx, 0).to(tl.int64) * kv_stride
        k0 = _latent_tile(kv_ptr, row_off, valid, 0, IS_FP8)
        k1 = _latent_tile(kv_ptr, row_off, valid, 1, IS_FP8)
        k2 = _latent_tile(kv_ptr, row_off, valid, 2, IS_FP8)
        k3 = _latent_tile(kv_ptr, row_off, valid, 3, IS_FP8)
        kr = _rope_tile(kv_ptr, row_off, valid, IS_FP8)
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
        s = tl.dot(qr, tl.trans(kr), s)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pb = p.to(tl.bfloat16)
        acc0 = tl.dot(pb, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, k3, acc3 * alpha[:, None])
        m_i = m_new

    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    hm = hmask[:, None]
    if NUM_SPLITS == 1:
        o_row = out_ptr + (t * H + heads.to(tl.int64))[:, None] * 512 + d[None, :]
        tl.store(o_row, (acc0 * inv_l[:, None]).to(tl.bfloat16), mask=hm)
        tl.store(o_row + 128, (acc1 * inv_l[:, None]).to(tl.bfloat16), mask=hm)
        tl.store(o_row + 256, (acc2 * inv_l[:, None]).to(tl.bfloat16), mask=hm)
        tl.store(o_row + 384, (acc3 * inv_l[:, None]).to(tl.bfloat16), mask=hm)
        tl.store(lse_ptr + t * H + heads, lse2 * LN2, mask=hmask)
    else:
        base = (t * NUM_SPLITS + sp) * H + heads.to(tl.int64)
        o_row = part_out_ptr + base[:, None] * 512 + d[None, :]
        tl.store(o_row, acc0 * inv_l[:, None], mask=hm)
        tl.store(o_row + 128, acc1 * inv_l[:, None], mask=hm)
        tl.store(o_row + 256, acc2 * inv_l[:, None], mask=hm)
        tl.store(o_row + 384, acc3 * inv_l[:, None], mask=hm)
        tl.store(part_lse_ptr + base, lse2, mask=hmask)


@triton.jit
def sparse_mla_combine_kernel(
    part_out_ptr,  # float32 [T, NUM_SPLITS, H, 512]
    part_lse_ptr,  # float32 [T, NUM_SPLITS, H] base-2 lse, -inf = empty split
    out_ptr,  # bf16 [T, H, 512] contiguous
    lse_ptr,  # float32 [T, H] natural log
    H,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    """One program per (t, h): merge the split partials (see the module docstring)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_P2)
    smask = s < NUM_SPLITS
    base = (t * NUM_SPLITS + s) * H + h  # [SPLITS_P2]
    lse_s = tl.load(part_lse_ptr + base, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_use)  # 0 for empty splits
    tot = tl.sum(w, axis=0)
    has = tot > 0.0
    w = w / tl.where(has, tot, 1.0)
    d = tl.arange(0, 512)
    parts = tl.load(part_out_ptr + base[:, None] * 512 + d[None, :],
                    mask=smask[:, None] & (w[:, None] > 0.0), other=0.0)
    o = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + (t * H + h) * 512 + d, o.to(tl.bfloat16))
    lse = tl.where(has, (m_use + tl.log2(tl.where(has, tot, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + t * H + h, lse)
