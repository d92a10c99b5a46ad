"""``@triton.jit`` blocks of the ``tl`` sparse-MLA kernels: the tiled decode body
(``mla_decode``) is built from them; the fused-tile decode (``mla_decode_wide``) and the
miss attention (``mla_miss``) use the small ones (``split_range``, ``entries``,
``dequant``, ``prefetch_block`` / ``prefetch_lines``, ``online_softmax``, ``finish``)
and write the rest out (see "Debug scopes").

Notation: BLOCK_H heads per program, BLOCK_N index entries gathered per iteration, D_V
= 512 output columns. The blocks take the tiles as tuples (Triton flattens them into
the values they hold):

  q    bf16 query tiles (q0, q1, q2, q3, q_rope): [BLOCK_H, 128] x 4 and [BLOCK_H, 64]
  k    the gathered rows' bf16 tiles, k[i] [BLOCK_N, width of q[i]]
  acc  float32 p . v accumulators, acc[i] [BLOCK_H, D_V / len(acc)] for the latent
       tiles k[0], ..., k[len(acc) - 1]
  m_i, l_i  float32 [BLOCK_H]: running max and sum of the base-2 online softmax

Rows are fp8_ds_mla (uint8 [N, 656]: 512 e4m3 codes, 4 float32 tile scales, 64 bf16
RoPE values) or bf16 (bf16 [N, 576]); an entry is valid when its index is in [0, N) and
it lies before the range's end; invalid entries are masked, never dereferenced.

Debug scopes: Triton inlines every block, so a kernel's PTX instructions are the same
whether a block is called or written out. With line info on (Triton's default) the PTX
also carries a label at each inlined call's start and end, and ptxas schedules around
those labels: moving code into or out of a call can reorder the SASS (same
instructions and registers, another schedule). ``python -m benchmarks.kernel_ptx``
compares the PTX and SASS of two trees at every launch specialisation. The tiled decode
kernel built from these blocks assembles to the SASS it had written out; the fused-tile
decode and the miss kernel did not for some specialisations (fp8_ds_mla rows), so they
keep their loop bodies written out until a GPU measures the difference.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def split_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC: tl.constexpr):
    """[lo, hi): the entries of split sp of token t's index row (valid counts
    ``vc_ptr`` int32 [T] honoured when HAS_VC)."""
    k_end = K
    if HAS_VC:
        k_end = tl.minimum(tl.maximum(tl.load(vc_ptr + t), 0), K)
    lo = sp * rows_per_split
    return lo, tl.minimum(lo + rows_per_split, k_end)


@triton.jit
def load_q(q_ptr, t, heads, hmask, q_stride_t, q_stride_h):
    """The tiled bodies' q of token t (q_ptr bf16 [T, H, 576]) for ``heads`` int32
    [BLOCK_H] (rows where ``hmask`` is False read 0): (q0, q1, q2, q3, q_rope)."""
    d = tl.arange(0, 128)
    q_row = q_ptr + t * q_stride_t + heads.to(tl.int64)[:, None] * q_stride_h
    q0 = tl.load(q_row + d[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + 128 + d[None, :], mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + 256 + d[None, :], mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + 384 + d[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0)
    return q0, q1, q2, q3, qr


@triton.jit
def entries(idx_row, kk, hi, N):
    """(rows int32, valid bool) of the entries ``kk`` int [BLOCK_N] of one index row:
    valid = kk < hi and the row in [0, N); entries at or past hi read -1."""
    inr = kk < hi
    idx = tl.load(idx_row + kk, mask=inr, other=-1)
    valid = inr & (idx >= 0) & (idx < N)
    return idx, valid


@triton.jit
def load_rows(kv_ptr, idx, valid, kv_stride, IS_FP8: tl.constexpr):
    """The rows ``idx`` int32 [BLOCK_N] where ``valid`` (elsewhere zeros; the memory of
    an invalid entry is never touched) as bf16 tiles (k0, k1, k2, k3, k_rope): latent
    [BLOCK_N, 128] x 4, RoPE [BLOCK_N, 64]. fp8 codes are dequantised to code x tile
    scale (exact: the scales are powers of two) after all of the block's loads are
    issued. kv_stride: bytes (fp8_ds_mla) or bf16 elements between rows."""
    row_off = tl.where(valid, idx, 0).to(tl.int64) * kv_stride
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
        return dequant(c0, s0), dequant(c1, s1), dequant(c2, s2), dequant(c3, s3), kr
    else:
        k0 = tl.load(ptrs, mask=vm, other=0.0)
        k1 = tl.load(ptrs + 128, mask=vm, other=0.0)
        k2 = tl.load(ptrs + 256, mask=vm, other=0.0)
        k3 = tl.load(ptrs + 384, mask=vm, other=0.0)
        kr = tl.load(kv_ptr + row_off[:, None] + 512 + r[None, :], mask=vm, other=0.0)
        return k0, k1, k2, k3, kr


@triton.jit
def dequant(c, s):
    """bf16 [BLOCK_N, 128] from e4m3 codes uint8 [BLOCK_N, 128] and their tile scales
    float32 [BLOCK_N]."""
    return (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]).to(tl.bfloat16)


@triton.jit
def prefetch_block(kv_ptr, idx_row, start, hi, N, kv_stride, BLOCK_N: tl.constexpr,
                   IS_FP8: tl.constexpr):
    """Ask L2 for the rows of the entries [start, start + BLOCK_N) of an index row
    (``prefetch.global.L2``, one per 128-byte line of each row; no registers held, no
    wait). Invalid entries and those at or past ``hi`` prefetch row 0, which is always
    mapped. GPU only: the interpreter has no inline PTX. The index load is written out
    rather than calling ``entries``: see "Debug scopes" in the module docstring."""
    kk = start + tl.arange(0, BLOCK_N)
    inr = kk < hi
    idx = tl.load(idx_row + kk, mask=inr, other=-1)
    valid = inr & (idx >= 0) & (idx < N)
    if IS_FP8:
        prefetch_lines(kv_ptr, tl.where(valid, idx, 0).to(tl.int64) * kv_stride, 656, 8)
    else:
        prefetch_lines(kv_ptr, tl.where(valid, idx, 0).to(tl.int64) * (kv_stride * 2), 1152, 16)


@triton.jit
def prefetch_lines(kv_ptr, row_byte, ROW_BYTES: tl.constexpr, LINES: tl.constexpr):
    """row_byte: int64 [BLOCK_N] byte offsets of rows of ROW_BYTES bytes. The line
    offsets 0, 128, ... are clamped to the row's last byte: every 128-byte line a row
    touches holds one of these addresses, whatever the row's alignment."""
    off = tl.minimum(tl.arange(0, LINES) * 128, ROW_BYTES - 1)
    ptrs = kv_ptr.to(tl.pointer_type(tl.uint8)) + row_byte[:, None] + off[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def softmax_state(BLOCK_H: tl.constexpr, TILES: tl.constexpr, WIDTH: tl.constexpr):
    """The empty online-softmax state: (m_i = -inf, l_i = 0, acc = TILES zero tiles
    float32 [BLOCK_H, WIDTH])."""
    acc = ()
    for _ in tl.static_range(TILES):
        acc = acc + (tl.zeros([BLOCK_H, WIDTH], dtype=tl.float32),)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    return m_i, tl.zeros([BLOCK_H], dtype=tl.float32), acc


@triton.jit
def scores(q, k, one, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ISOLATE_QK: tl.constexpr):
    """Raw scores float32 [BLOCK_H, BLOCK_N] = sum_i q[i] . k[i]^T.

    ISOLATE_QK: Triton (3.6) lays out a dot that has another dot in its use-def slice
    within the same region as warpsPerCTA [num_warps, 1]; with BLOCK_H = 64 and 8 warps
    both warpgroups then compute the same q . k^T. One dot per loop region (trip count
    ``one``, a runtime 1 the compiler cannot fold) keeps each out of the others'
    slices, so it gets [4, 2]: the warpgroups split the rows instead."""
    if ISOLATE_QK:
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(len(q)):
            for _ in range(one):
                s = tl.dot(q[i], tl.trans(k[i]), s)
    else:
        s = tl.dot(q[0], tl.trans(k[0]))
        for i in tl.static_range(1, len(q)):
            s = tl.dot(q[i], tl.trans(k[i]), s)
    return s


@triton.jit
def online_softmax(s, valid, m_i, l_i, qk_scale_log2):
    """One block of the base-2 online softmax. s: float32 [BLOCK_H, BLOCK_N] raw scores;
    valid: bool [BLOCK_N]. Returns (p [BLOCK_H, BLOCK_N], alpha [BLOCK_H] (rescale of
    the accumulator), m_new, l_new)."""
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def attend_block(q, k, valid, m_i, l_i, acc, qk_scale_log2, one, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, ISOLATE_QK: tl.constexpr):
    """One iteration of the attention over a block of gathered rows: the scores
    (``scores``), the online-softmax update and p . v into each accumulator (bf16
    operands, float32 accumulation). valid: bool [BLOCK_N] (invalid entries get p = 0).
    Returns (m_i, l_i, acc) updated."""
    s = scores(q, k, one, BLOCK_H, BLOCK_N, ISOLATE_QK)
    p, alpha, m_new, l_i = online_softmax(s, valid, m_i, l_i, qk_scale_log2)
    pb = p.to(tl.bfloat16)
    out = ()
    for i in tl.static_range(len(acc)):
        out = out + (tl.dot(pb, k[i], acc[i] * alpha[:, None]),)
    return m_new, l_i, out


@triton.jit
def finish(m_i, l_i):
    """(1 / l or 0, base-2 lse or -inf) per head: a head with no valid entry gets 0 / -inf."""
    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    return inv_l, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))


@triton.jit
def store_tiles(o_ptr, base, hmask, acc, inv_l):
    """o_ptr[base, :512] = acc * inv_l in o_ptr's element type (bf16 or float32), rows
    where ``hmask``. o_ptr: [rows, 512] contiguous; base: int64 [BLOCK_H] row numbers;
    inv_l: float32 [BLOCK_H]."""
    W: tl.constexpr = acc[0].shape[1]
    d = tl.arange(0, W)
    o_row = o_ptr + base[:, None] * 512 + d[None, :]
    hm = hmask[:, None]
    for i in tl.static_range(len(acc)):
        if i == 0:  # no pointer add of 0
            tl.store(o_row, (acc[i] * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=hm)
        else:
            tl.store(o_row + i * W, (acc[i] * inv_l[:, None]).to(o_ptr.dtype.element_ty),
                     mask=hm)
