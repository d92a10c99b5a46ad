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

Options (constexpr; all off by default -- measured slower on the H200, see
``triton_backend.DEFAULT_SHAPES``):
- F16_MMA (fp8 rows): the latent dots run on float16 tensor cores. Codes become
  float16 in one conversion (e4m3 is a subset of float16) and are multiplied by
  scale / r_max, r_max the largest tile scale of the split's rows (a pre-pass over their
  scales), so every factor is a power of two <= 1; q's latent part is scaled per head by
  a power of two that puts its largest |value| in [2^14, 2^15). Both factors are undone
  in float32 (scores times 2^e_q * r_max, output times r_max). Error: a code x scale
  below 2^-14 r_max loses bits (absolute error <= 2^-25 r_max against values up to
  448 r_max); p is rounded to float16 (finer than bf16 above 2^-14).
- REG_PIPE: the next block's rows are loaded into registers (fp8 codes as int32 words,
  converted by ``cvt.rn.f16x2.e4m3x2`` on GPU) while the current block's dots run.
- MMA_ROWSUM: the softmax row sums come from the tensor cores (p as float16 times a
  ones tile, relative error <= 2^-12) instead of a cross-warp reduction per iteration.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mla_decode import LN2, _finish, _online_softmax, _prefetch_block, _split_range


@triton.jit
def _pow2_normaliser(amax, target_exp: tl.constexpr):
    """(2^(target_exp - e), 2^(e - target_exp)) per element of amax float32 (> 0 or 0),
    where 2^e <= amax < 2^(e + 1): scaling by the first puts amax in [2^target_exp,
    2^(target_exp + 1)). Built from exponent bits, so both are exact powers of two; amax
    = 0 (or subnormal) gives (1, 1)."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(amax >= 1.1754943508222875e-38, e, target_exp)
    e = tl.minimum(tl.maximum(e, target_exp - 126), target_exp + 126)
    fwd = ((target_exp - e + 127) << 23).to(tl.float32, bitcast=True)
    back = ((e - target_exp + 127) << 23).to(tl.float32, bitcast=True)
    return fwd, back


@triton.jit
def _split_max_scale(kv_ptr, idx_row, lo, hi, N, kv_stride, SCALE_OFF: tl.constexpr,
                     CHUNK: tl.constexpr = 512):
    """Largest float32 tile scale among the valid rows of index entries [lo, hi)
    (1.0 when there is none or all are 0). Scales are powers of two, so it is one too."""
    tt = tl.arange(0, 4)
    best = tl.zeros([CHUNK, 4], dtype=tl.float32)
    for start in range(lo, hi, CHUNK):
        kk = start + tl.arange(0, CHUNK)
        inr = kk < hi
        idx = tl.load(idx_row + kk, mask=inr, other=-1)
        valid = inr & (idx >= 0) & (idx < N)
        sptr = (kv_ptr + tl.where(valid, idx, 0).to(tl.int64) * kv_stride + SCALE_OFF).to(
            tl.pointer_type(tl.float32))
        best = tl.maximum(best, tl.load(sptr[:, None] + tt[None, :], mask=valid[:, None], other=0.0))
    r = tl.max(tl.max(best, axis=1), axis=0)
    return tl.where(r > 0.0, r, 1.0)


@triton.jit
def _e4m3_words_to_f16(w, ASM: tl.constexpr):
    """int32 [..., W] words of four e4m3 codes (byte j = code 4i + j) -> float16
    [..., 4 W] in code order, exact. ASM: cvt.rn.f16x2.e4m3x2 on each half-word through
    inline PTX (GPU); else byte extraction in Triton (the interpreter)."""
    if not ASM:
        c0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        x = tl.join(tl.join(c0, c2), tl.join(c1, c3))
        return tl.reshape(x, [w.shape[0], w.shape[1], w.shape[2] * 4])
    lo, hi = tl.inline_asm_elementwise(
        """{
        .reg .b16 a, b;
        mov.b32 {a, b}, $2;
        cvt.rn.f16x2.e4m3x2 $0, a;
        cvt.rn.f16x2.e4m3x2 $1, b;
        }""", "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    # lo = f16x2 (code 0 low, code 1 high), hi = (code 2, code 3)
    c0 = (lo & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    c1 = (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    c2 = (hi & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    c3 = (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [..., W, 2, 2]: (i, k) -> code 2 i + k
    return tl.reshape(x, [w.shape[0], w.shape[1], w.shape[2] * 4])


@triton.jit
def _gather(kv_ptr, idx_row, start, hi, N, kv_stride, BLOCK_N: tl.constexpr,
            IS_FP8: tl.constexpr, WORDS: tl.constexpr = False):
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
        if WORDS:  # int32 [BLOCK_N, 4, 32]: four codes a word (rows are 16-byte aligned)
            w = tl.arange(0, 32)
            wptr = (kv_ptr + row_off).to(tl.pointer_type(tl.int32))
            lat = tl.load(wptr[:, None, None] + (tt[None, :, None] * 32 + w[None, None, :]),
                          mask=valid[:, None, None], other=0)
        else:
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
    PREFETCH_L1: tl.constexpr = False,  # prefetch into L1 instead of L2
    F16_MMA: tl.constexpr = False,  # fp8 rows: float16 tensor-core dots (see the docstring)
    q16_ptr=None,  # float16 [programs, BLOCK_H, 512] scratch (F16_MMA only)
    REG_PIPE: tl.constexpr = False,  # load the next block's rows while this one computes
    PTX: tl.constexpr = False,  # inline PTX allowed (CUDA; not the interpreter)
    MMA_ROWSUM: tl.constexpr = False,  # softmax row sums as p . ones on the tensor cores
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

    lo, hi = _split_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC)
    idx_row = idx_ptr + t * idx_stride
    if F16_MMA:
        # q_lat per head times a power of two 2^-e_q, its largest |value| in [2^14, 2^15)
        # (exact: bf16 values fit float16's mantissa); the scores get 2^e_q back
        q_inv, q_back = _pow2_normaliser(tl.max(tl.abs(q_lat.to(tl.float32)), axis=1), 14)
        # Round trip through this program's own scratch block: tl.dot takes a loaded
        # operand from shared memory, a computed one from registers (which spills here)
        q_blk = q16_ptr + ((t * tl.num_programs(1) + hb) * NUM_SPLITS + sp) * (BLOCK_H * 512)
        q_blk = q_blk + tl.arange(0, BLOCK_H)[:, None] * 512 + dl[None, :]
        tl.store(q_blk, (q_lat.to(tl.float32) * q_inv[:, None]).to(tl.float16))
        tl.debug_barrier()  # the block's stores are visible to all its threads
        q_lat = tl.load(q_blk)  # float16 [BLOCK_H, 512]
        # r_max: the largest tile scale of this split's rows (a power of two); the codes
        # enter the dots as float16 code x (scale / r_max) <= 448
        r_max = _split_max_scale(kv_ptr, idx_row, lo, hi, N, kv_stride, 512)
        r_inv = 1.0 / r_max
        s_back = q_back * r_max  # float32 [BLOCK_H]: q_lat . k_lat^T in true units

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if MMA_ROWSUM:
        l_acc = tl.zeros([BLOCK_H, 16], dtype=tl.float32)  # sum of p, in every column
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(tl.float16)
    acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
    one = (lo >= 0).to(tl.int32)  # a runtime 1 for the one-trip loops (see mla_decode)
    for j in tl.static_range(1, PREFETCH):
        _prefetch_block(kv_ptr, idx_row, lo + j * BLOCK_N, hi, N, kv_stride, BLOCK_N, IS_FP8,
                        PREFETCH_L1)
    if REG_PIPE:
        n_valid, n_lat, n_sc, n_rope = _gather(kv_ptr, idx_row, lo, hi, N, kv_stride, BLOCK_N,
                                               IS_FP8, REG_PIPE)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH > 0:
            _prefetch_block(kv_ptr, idx_row, start + PREFETCH * BLOCK_N, hi, N, kv_stride,
                            BLOCK_N, IS_FP8, PREFETCH_L1)
        if REG_PIPE:
            # this block's rows were loaded during the previous iteration; issue the next
            # block's loads now, so their latency overlaps this block's dots
            valid, raw_lat, sc, k_rope = n_valid, n_lat, n_sc, n_rope
            n_valid, n_lat, n_sc, n_rope = _gather(kv_ptr, idx_row, start + BLOCK_N, hi, N,
                                                   kv_stride, BLOCK_N, IS_FP8, REG_PIPE)
        else:
            valid, raw_lat, sc, k_rope = _gather(kv_ptr, idx_row, start, hi, N, kv_stride,
                                                 BLOCK_N, IS_FP8)
        if IS_FP8:
            if REG_PIPE:
                c16 = _e4m3_words_to_f16(raw_lat, PTX)  # float16 [BLOCK_N, 4, 128]
            else:
                c16 = raw_lat.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            if F16_MMA:
                rel = (sc * r_inv).to(tl.float16)  # powers of two <= 1 (0 below 2^-24)
                k3 = c16 * rel[:, :, None]
                k_lat = tl.reshape(k3, [BLOCK_N, 512])
            else:
                k3 = c16.to(tl.float32) * sc[:, :, None]
                k_lat = tl.reshape(k3.to(tl.bfloat16), [BLOCK_N, 512])
        else:
            k_lat = raw_lat
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for _ in range(0, one):
            s = tl.dot(q_lat, tl.trans(k_lat), s)
        if F16_MMA:
            s = s * s_back[:, None]
        for _ in range(0, one):
            s = tl.dot(q_rope, tl.trans(k_rope), s)
        if MMA_ROWSUM:
            # row max only: the row sums come from the tensor cores (p . ones below), so
            # no cross-warpgroup reduction of p per iteration
            s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            pb = p.to(k_lat.dtype)
            # the row sums read p as float16 (11-bit mantissa: relative error <= 2^-12, so
            # lse within 2.5e-4) whatever the p . v dot reads. The small dot goes first:
            # the wait for the large one then covers it too.
            l_acc = tl.dot(p.to(tl.float16), ones, l_acc * alpha[:, None])
            acc = tl.dot(pb, k_lat, acc * alpha[:, None])
        else:
            p, alpha, m_new, l_i = _online_softmax(s, valid, m_i, l_i, qk_scale_log2)
            acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None])
        m_i = m_new

    if MMA_ROWSUM:
        l_i = tl.max(l_acc, axis=1)  # every column holds the row sum
    inv_l, lse2 = _finish(m_i, l_i)
    if F16_MMA:
        inv_l = inv_l * r_max  # acc is in units of r_max
    hm = hmask[:, None]
    if NUM_SPLITS == 1:
        o_row = out_ptr + (t * H + heads.to(tl.int64))[:, None] * 512 + dl[None, :]
        tl.store(o_row, (acc * inv_l[:, None]).to(tl.bfloat16), mask=hm)
        tl.store(lse_ptr + t * H + heads, lse2 * LN2, mask=hmask)
    else:
        base = (t * NUM_SPLITS + sp) * H + heads.to(tl.int64)
        tl.store(part_out_ptr + base[:, None] * 512 + dl[None, :], acc * inv_l[:, None], mask=hm)
        tl.store(part_lse_ptr + base, lse2, mask=hmask)
