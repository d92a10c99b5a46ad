"""Triton bodies of sparse-MLA attention (decode over bf16 / fp8_ds_mla rows; prefill
reuses the bf16 path over the staged workspace). Launcher: ``hisparse.attention.triton_backend``.

Notation: T query tokens, H heads, K selected entries per token, N rows, D_QK = 576
(4 latent tiles of 128 + 64 RoPE), D_V = 512 (the 4 latent tiles).

Grid of the main kernel: (T, cdiv(H, BLOCK_H), NUM_SPLITS). Program (t, hb, sp) takes
the head block hb of token t and the entries [sp * rows_per_split, (sp + 1) *
rows_per_split) of its index row (split-KV, so small T still fills the GPU); PREFETCH > 0
asks L2 for the rows PREFETCH blocks ahead at the top of every iteration. ISOLATE_QK
puts each q . k^T dot in its own loop region (see the kernel body). Per iteration it
gathers BLOCK_N rows *once* for all BLOCK_H heads, dequantizes them to bf16 in registers
(fp8: e4m3 bytes bitcast to float8e4nv times the tile scale, exact since scales are
powers of two; RoPE bf16 as stored), and runs an online softmax (base 2) with tl.dot for
q . k^T and p . v. Invalid entries (index -1, index outside [0, N), or k >= valid_counts[t])
are masked and never dereferenced.

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
def _load_block(kv_ptr, idx_row, start, hi, N, kv_stride, BLOCK_N: tl.constexpr,
                IS_FP8: tl.constexpr):
    """Issue the loads of the BLOCK_N entries [start, start + BLOCK_N) of an index row.

    Returns (valid bool [BLOCK_N], c0..c3, s0..s3, kr): for fp8 rows c_i are the raw
    e4m3 codes uint8 [BLOCK_N, 128] of latent tile i (columns [128 i, 128 i + 128)) and
    s_i its float32 scales [BLOCK_N]; for bf16 rows c_i are the bf16 tiles themselves and
    s_i unused zeros. kr: bf16 [BLOCK_N, 64] RoPE part. Invalid entries (beyond ``hi``,
    index -1 or outside [0, N)) are masked: their memory is never touched and they read
    as 0.
    """
    kk = start + tl.arange(0, BLOCK_N)
    inr = kk < hi
    idx = tl.load(idx_row + kk, mask=inr, other=-1)
    valid = inr & (idx >= 0) & (idx < N)
    row_off = tl.where(valid, idx, 0).to(tl.int64) * kv_stride  # bytes (fp8) / elements (bf16)
    cols = tl.arange(0, 128)
    ptrs = kv_ptr + row_off[:, None] + cols[None, :]
    vm = valid[:, None]
    r = tl.arange(0, 64)
    if IS_FP8:
        c0 = tl.load(ptrs, mask=vm, other=0)
        c1 = tl.load(ptrs + 128, mask=vm, other=0)
        c2 = tl.load(ptrs + 256, mask=vm, other=0)
        c3 = tl.load(ptrs + 384, mask=vm, other=0)
        sptr = (kv_ptr + row_off + 512).to(tl.pointer_type(tl.float32))
        s0 = tl.load(sptr, mask=valid, other=0.0)
        s1 = tl.load(sptr + 1, mask=valid, other=0.0)
        s2 = tl.load(sptr + 2, mask=valid, other=0.0)
        s3 = tl.load(sptr + 3, mask=valid, other=0.0)
        rbase = (kv_ptr + row_off + 528).to(tl.pointer_type(tl.bfloat16))
        kr = tl.load(rbase[:, None] + r[None, :], mask=vm, other=0.0)
    else:
        c0 = tl.load(ptrs, mask=vm, other=0.0)
        c1 = tl.load(ptrs + 128, mask=vm, other=0.0)
        c2 = tl.load(ptrs + 256, mask=vm, other=0.0)
        c3 = tl.load(ptrs + 384, mask=vm, other=0.0)
        s0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        s1 = s0
        s2 = s0
        s3 = s0
        kr = tl.load(kv_ptr + row_off[:, None] + 512 + r[None, :], mask=vm, other=0.0)
    return valid, c0, c1, c2, c3, s0, s1, s2, s3, kr


@triton.jit
def _prefetch_block(kv_ptr, idx_row, start, hi, N, kv_stride, BLOCK_N: tl.constexpr,
                    IS_FP8: tl.constexpr):
    """Ask L2 for the rows of the entries [start, start + BLOCK_N) of an index row
    (``prefetch.global.L2``, one per 128-byte line of each row; no registers held, no
    wait). Entries beyond ``hi`` or invalid prefetch row 0, which is always mapped.
    GPU only: the interpreter has no inline PTX."""
    kk = start + tl.arange(0, BLOCK_N)
    inr = kk < hi
    idx = tl.load(idx_row + kk, mask=inr, other=-1)
    valid = inr & (idx >= 0) & (idx < N)
    if IS_FP8:
        _prefetch_rows(kv_ptr, tl.where(valid, idx, 0).to(tl.int64) * kv_stride, 656, 8)
    else:
        _prefetch_rows(kv_ptr, tl.where(valid, idx, 0).to(tl.int64) * (kv_stride * 2), 1152, 16)


@triton.jit
def _prefetch_rows(kv_ptr, row_byte, ROW_BYTES: tl.constexpr, LINES: tl.constexpr):
    """row_byte: int64 [BLOCK_N] byte offsets of rows of ROW_BYTES bytes. The line
    offsets 0, 128, ... are clamped to the row's last byte: every 128-byte line a row
    touches holds one of these addresses, whatever the row's alignment."""
    off = tl.minimum(tl.arange(0, LINES) * 128, ROW_BYTES - 1)
    ptrs = kv_ptr.to(tl.pointer_type(tl.uint8)) + row_byte[:, None] + off[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile(c, s, IS_FP8: tl.constexpr):
    """bf16 [BLOCK_N, 128] latent tile from what ``_load_block`` loaded (fp8: code x
    scale, exact since scales are powers of two; bf16: as loaded)."""
    if IS_FP8:
        return (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]).to(tl.bfloat16)
    else:
        return c


@triton.jit
def _split_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC: tl.constexpr):
    """[lo, hi): the entries of split sp of token t's index row (valid counts honoured)."""
    k_end = K
    if HAS_VC:
        k_end = tl.minimum(tl.maximum(tl.load(vc_ptr + t), 0), K)
    lo = sp * rows_per_split
    return lo, tl.minimum(lo + rows_per_split, k_end)


@triton.jit
def _online_softmax(s, valid, m_i, l_i, qk_scale_log2):
    """One block of the base-2 online softmax. s: float32 [BLOCK_H, BLOCK_N] raw scores;
    valid: bool [BLOCK_N]; m_i, l_i: float32 [BLOCK_H] running max and sum. Returns
    (p [BLOCK_H, BLOCK_N], alpha [BLOCK_H] (rescale of the accumulator), m_new, l_new)."""
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _finish(m_i, l_i):
    """(1 / l or 0, base-2 lse or -inf) per head: a head with no valid entry gets 0 / -inf."""
    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    return inv_l, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))


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
    ISOLATE_QK: tl.constexpr = False,  # each q . k^T dot in its own one-trip loop (see below)
    PREFETCH: tl.constexpr = 0,  # L2-prefetch the rows PREFETCH blocks ahead (0 = off; GPU only)
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

    lo, hi = _split_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    idx_row = idx_ptr + t * idx_stride
    # a runtime 1 for ISOLATE_QK's one-trip loops (lo >= 0 always; lo depends on the
    # program id, so the compiler cannot fold the loops away, whatever K is specialised to)
    one = (lo >= 0).to(tl.int32)
    for j in tl.static_range(1, PREFETCH):
        _prefetch_block(kv_ptr, idx_row, lo + j * BLOCK_N, hi, N, kv_stride, BLOCK_N, IS_FP8)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH > 0:
            # the gathers below are not software-pipelined (see ISOLATE_QK): have L2
            # fetch a later block's rows while this one is dequantised and multiplied
            _prefetch_block(kv_ptr, idx_row, start + PREFETCH * BLOCK_N, hi, N, kv_stride,
                            BLOCK_N, IS_FP8)
        valid, c0, c1, c2, c3, s0, s1, s2, s3, kr = _load_block(
            kv_ptr, idx_row, start, hi, N, kv_stride, BLOCK_N, IS_FP8)
        k0 = _tile(c0, s0, IS_FP8)
        k1 = _tile(c1, s1, IS_FP8)
        k2 = _tile(c2, s2, IS_FP8)
        k3 = _tile(c3, s3, IS_FP8)
        if ISOLATE_QK:
            # Triton (3.6) lays out a dot that has another dot in its use-def slice within
            # the same region as warpsPerCTA [num_warps, 1]; with BLOCK_H = 64 and 8 warps
            # both warpgroups then compute the same q . k^T. One dot per loop region
            # (trip count a runtime 1) keeps each out of the others' slices, so it gets
            # [4, 2]: the warpgroups split the rows instead.
            s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
            for _ in range(0, one):
                s = tl.dot(q0, tl.trans(k0), s)
            for _ in range(0, one):
                s = tl.dot(q1, tl.trans(k1), s)
            for _ in range(0, one):
                s = tl.dot(q2, tl.trans(k2), s)
            for _ in range(0, one):
                s = tl.dot(q3, tl.trans(k3), s)
            for _ in range(0, one):
                s = tl.dot(qr, tl.trans(kr), s)
        else:
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
            s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s)
            s = tl.dot(qr, tl.trans(kr), s)
        p, alpha, m_new, l_i = _online_softmax(s, valid, m_i, l_i, qk_scale_log2)
        pb = p.to(tl.bfloat16)
        acc0 = tl.dot(pb, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, k3, acc3 * alpha[:, None])
        m_i = m_new

    inv_l, lse2 = _finish(m_i, l_i)
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
