"""Triton bodies of miss attention: sparse-MLA attention over each query token's *miss*
entries, merged exactly (LSE merge) with the partial result of its *hit* entries.
Launchers, references and the math contract: ``hisparse.attention.miss``.

Notation: T query tokens, H heads, K miss-list capacity per token, N hot rows, S splits
of a token's miss list (NUM_SPLITS), HB = cdiv(H, BLOCK_H) head blocks.
Token t's miss list is entries j < c_t = clamp(counts[t], 0, K) of row t of the index
lists; an entry whose hot row is -1 or out of range is padding:
never dereferenced, never written.

Split s of a token takes the entries [s * r, min((s + 1) * r, c_t)) with r =
cdiv(cdiv(c_t, S), BLOCK_N) * BLOCK_N (``_slice``): the work goes where the misses
are, while the launch shape depends on T, H and S only (no device value reaches the
host; CUDA-graph capturable). A token with c_t = 0 costs each of its programs one
count load (and, where it merges into the hit partial, a load of its hit lse).

Kernels:
- ``miss_merge_kernel``: in-place LSE merge of one partial result into another
  (natural-log lse in and out). Grid (T, cdiv(H, BLOCK_H)); a head whose second lse is
  -inf keeps its first partial (not written), or gets out = 0 where both are -inf.
- ``miss_split_kernel``: the miss rows are already in the hot buffer. Grid (T, HB, S).
  Each program gathers BLOCK_N rows at a time once for BLOCK_H heads (fp8 rows
  dequantised in registers, exact: power-of-two scales), runs a base-2 online softmax
  with tl.dot (``mla_blocks``' online softmax; the q . k^T and p . v dots written out
  as in ``mla_blocks.attend_block``, see its module's "Debug scopes"), and with S = 1
  merges its result into the hit partial in the epilogue (one launch); with S > 1 it
  writes a float32 partial and ``miss_combine_kernel`` merges the splits and the hit
  partial.
- ``miss_combine_kernel``: merges the S float32 partials of a token (base-2 lse) into
  the hit partial in place.

Merge math (natural log at the interface and in the merge; base 2 inside the attention
and across splits): with a, b the two lses and d = a - b, e = 2^(-|d| log2(e)) (in
[0, 1]); the larger side gets the weight 1 / (1 + e), the other e / (1 + e); out = w_a
out_a + w_b out_b; lse = max(a, b) + ln(1 + e). Everything exponentiated derives from
the one difference d, never from a max of rounded values compared with an unrounded one:
the compiled code contracts x * c - m into one fma, so a max taken over the rounded
products x * c is subtracted from the exact product, and at |lse| ~ 1e13 (the x3e4 head
over rows with tile scales 2^30) that rounding difference is ~2^21, which exp2 turns into
inf or 0. A side with lse = -inf is empty: its output is never read and is selected away
(``_side``), not multiplied by its zero weight, so whatever its memory holds (NaN
included) stays out of the result; where both sides are empty the merge writes out = 0
and leaves lse = -inf (also for a token without misses, ``_zero_empty``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mla_blocks import LN2, dequant, entries, finish, online_softmax, prefetch_lines

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


# ------------------------------------------------------------------ helpers
@triton.jit
def _slice(c, sp, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the entries of split sp of a miss list with c entries (see the module
    docstring); empty when the split has no work."""
    rps = tl.cdiv(tl.cdiv(c, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * rps
    return lo, tl.minimum(lo + rps, c)


@triton.jit
def _count(cnt_ptr, t, K):
    """clamp(counts[t], 0, K)."""
    return tl.minimum(tl.maximum(tl.load(cnt_ptr + t), 0), K)


@triton.jit
def _load_rows(kv_ptr, slot, valid, kv_stride, IS_FP8: tl.constexpr):
    """The rows ``slot`` int32 [BLOCK_N] of the hot buffer where ``valid`` (elsewhere
    zeros; the memory of an invalid entry is never touched) as bf16 tiles: the four
    latent tiles [BLOCK_N, 128] and the RoPE part [BLOCK_N, 64]. kv_stride: bytes
    (fp8_ds_mla) or bf16 elements between rows."""
    row_off = tl.where(valid, slot, 0).to(tl.int64) * kv_stride
    cols = tl.arange(0, 128)
    ptrs = kv_ptr + row_off[:, None] + cols[None, :]
    vm = valid[:, None]
    r = tl.arange(0, 64)
    if IS_FP8:
        sptr = (kv_ptr + row_off + 512).to(tl.pointer_type(tl.float32))
        k0 = dequant(tl.load(ptrs, mask=vm, other=0), tl.load(sptr, mask=valid, other=0.0))
        k1 = dequant(tl.load(ptrs + 128, mask=vm, other=0),
                     tl.load(sptr + 1, mask=valid, other=0.0))
        k2 = dequant(tl.load(ptrs + 256, mask=vm, other=0),
                     tl.load(sptr + 2, mask=valid, other=0.0))
        k3 = dequant(tl.load(ptrs + 384, mask=vm, other=0),
                     tl.load(sptr + 3, mask=valid, other=0.0))
        rbase = (kv_ptr + row_off + 528).to(tl.pointer_type(tl.bfloat16))
        kr = tl.load(rbase[:, None] + r[None, :], mask=vm, other=0.0)
    else:
        k0 = tl.load(ptrs, mask=vm, other=0.0)
        k1 = tl.load(ptrs + 128, mask=vm, other=0.0)
        k2 = tl.load(ptrs + 256, mask=vm, other=0.0)
        k3 = tl.load(ptrs + 384, mask=vm, other=0.0)
        kr = tl.load(kv_ptr + row_off[:, None] + 512 + r[None, :], mask=vm, other=0.0)
    return k0, k1, k2, k3, kr


@triton.jit
def _attend(q_ptr, kv_ptr, slot_row, t, hb, lo, hi, N, H, q_stride_t, q_stride_h,
            kv_stride, qk_scale_log2, one, IS_FP8: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ISOLATE_QK: tl.constexpr,
            PREFETCH: tl.constexpr):
    """Online-softmax attention of head block hb of token t over the entries [lo, hi) of
    its miss list. Returns (heads, head mask, acc0..acc3 float32 [BLOCK_H, 128] (not yet
    divided by l), m_i, l_i float32 [BLOCK_H], base 2).

    ISOLATE_QK: each q . k^T dot in its own one-trip loop (``mla_blocks.scores``: keeps
    Triton from laying the dot out over all warps along the heads at BLOCK_H = 64); ``one``
    is the trip count, a runtime 1 the compiler cannot fold (``_runtime_one``).
    PREFETCH: ask L2 for the next block's rows each iteration (inline PTX; CUDA only).
    """
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, 128)
    q_row = q_ptr + t * q_stride_t + heads.to(tl.int64)[:, None] * q_stride_h
    q0 = tl.load(q_row + d[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + 128 + d[None, :], mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + 256 + d[None, :], mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + 384 + d[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kk = start + tl.arange(0, BLOCK_N)
        if PREFETCH > 0:
            nslot, nvalid = entries(slot_row, kk + BLOCK_N, hi, N)
            if IS_FP8:
                prefetch_lines(kv_ptr, tl.where(nvalid, nslot, 0).to(tl.int64) * kv_stride, 656, 8)
            else:
                prefetch_lines(kv_ptr, tl.where(nvalid, nslot, 0).to(tl.int64) * (kv_stride * 2),
                               1152, 16)
        slot, valid = entries(slot_row, kk, hi, N)
        k0, k1, k2, k3, kr = _load_rows(kv_ptr, slot, valid, kv_stride, IS_FP8)
        if ISOLATE_QK:
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
        p, alpha, m_new, l_i = online_softmax(s, valid, m_i, l_i, qk_scale_log2)
        pb = p.to(tl.bfloat16)
        acc0 = tl.dot(pb, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, k3, acc3 * alpha[:, None])
        m_i = m_new
    return heads, hmask, acc0, acc1, acc2, acc3, m_i, l_i


@triton.jit
def _runtime_one(K):
    """1 as a value the compiler cannot fold (K > 0 whenever a kernel runs; K is not
    specialised), the trip count of ISOLATE_QK's loops. A constant 1 would let the
    compiler remove them."""
    return (K > 0).to(tl.int32)


@triton.jit
def _merge_weights(a, b):
    """Weights of the two sides and the merged lse (natural log) of lse a, b float32
    [BLOCK_H] (see the module docstring). Where both are -inf: weights 0, lse -inf."""
    has = tl.maximum(a, b) > float("-inf")
    d = tl.where(has, a, 0.0) - tl.where(has, b, 0.0)  # not -inf - -inf = NaN
    e = tl.exp2(-tl.abs(d) * LOG2E)  # a product only: nothing for an fma to absorb
    big = 1.0 / (1.0 + e)
    small = e * big
    a_wins = d >= 0.0
    wa = tl.where(has, tl.where(a_wins, big, small), 0.0)
    wb = tl.where(has, tl.where(a_wins, small, big), 0.0)
    return wa, wb, tl.where(has, tl.maximum(a, b) + tl.log2(1.0 + e) * LN2, float("-inf"))


@triton.jit
def _side(ptrs, has):
    """A partial's out tile (float32) where its lse is finite (``has`` bool [BLOCK_H],
    one per row of the tile), 0 elsewhere. An empty side is selected away, never read
    and never multiplied by its zero weight: its memory may hold anything, NaN included."""
    x = tl.load(ptrs, mask=has[:, None], other=0.0).to(tl.float32)
    return tl.where(has[:, None], x, 0.0)


@triton.jit
def _merge_tile(out_ptr, o_off, wa, wb, part, read_a, write):
    """out[o_off] = wa * out[o_off] + wb * part for the rows where ``write`` (a
    [BLOCK_H, 128] tile; out is read only where ``read_a``, else taken as 0)."""
    o = _side(out_ptr + o_off, read_a)
    tl.store(out_ptr + o_off, o * wa[:, None] + part * wb[:, None], mask=write[:, None])


@triton.jit
def _merge_into(out_ptr, lse_ptr, t, heads, hmask, H, acc0, acc1, acc2, acc3, inv_l, b2):
    """Merge a normalised-on-the-fly miss result (acc_i * inv_l, base-2 lse b2) into the
    partial (out bf16 [T, H, 512], lse float32 [T, H] natural) of token t in place.
    Heads whose b2 is -inf keep their partial, except those whose partial is empty too
    (out = 0 there; lse stays -inf); an empty partial's out is never read."""
    lp = lse_ptr + t * H + heads
    a = tl.load(lp, mask=hmask, other=float("-inf"))
    has_a = a > float("-inf")
    has_b = hmask & (b2 > float("-inf"))
    write = hmask & (has_b | (a == float("-inf")))
    wa, wb, lse = _merge_weights(a, b2 * LN2)  # both empty: 0, 0, -inf
    wb = wb * inv_l
    read_a = has_b & has_a
    d = tl.arange(0, 128)
    o_off = (t * H + heads.to(tl.int64))[:, None] * 512 + d[None, :]
    _merge_tile(out_ptr, o_off, wa, wb, acc0, read_a, write)
    _merge_tile(out_ptr, o_off + 128, wa, wb, acc1, read_a, write)
    _merge_tile(out_ptr, o_off + 256, wa, wb, acc2, read_a, write)
    _merge_tile(out_ptr, o_off + 384, wa, wb, acc3, read_a, write)
    tl.store(lp, lse, mask=write)


@triton.jit
def _zero_empty(out_ptr, lse_ptr, t, heads, hmask, H):
    """Token t has no miss entry: its heads whose partial (out bf16 [T, H, 512], lse
    float32 [T, H]) is empty too get out = 0 (their lse stays -inf); the others are
    neither read nor written."""
    a = tl.load(lse_ptr + t * H + heads, mask=hmask, other=0.0)
    empty = hmask & (a == float("-inf"))
    if tl.max(empty.to(tl.int32), axis=0) > 0:
        d = tl.arange(0, 128)
        o_off = (t * H + heads.to(tl.int64))[:, None] * 512 + d[None, :]
        zero = tl.zeros([heads.shape[0], 128], dtype=out_ptr.dtype.element_ty)
        for c in tl.static_range(4):
            tl.store(out_ptr + o_off + c * 128, zero, mask=empty[:, None])


@triton.jit
def _store_result(o_ptr, l_ptr, base, hmask, acc0, acc1, acc2, acc3, inv_l, lse2):
    """Store a normalised result: o_ptr[base, :512] = acc_i * inv_l, l_ptr[base] = lse2
    (base 2). base int64 [BLOCK_H] row numbers."""
    d = tl.arange(0, 128)
    o_row = o_ptr + base[:, None] * 512 + d[None, :]
    hm = hmask[:, None]
    tl.store(o_row, acc0 * inv_l[:, None], mask=hm)
    tl.store(o_row + 128, acc1 * inv_l[:, None], mask=hm)
    tl.store(o_row + 256, acc2 * inv_l[:, None], mask=hm)
    tl.store(o_row + 384, acc3 * inv_l[:, None], mask=hm)
    tl.store(l_ptr + base, lse2, mask=hmask)


# ------------------------------------------------------------------ kernels
@triton.jit
def miss_merge_kernel(
    out_ptr,  # bf16 [T, H, 512] contiguous: first partial in, merged result out
    lse_ptr,  # float32 [T, H] natural log, -inf = no entry: in and out
    part_out_ptr,  # float32 or bf16 [T, H, 512] contiguous: second partial
    part_lse_ptr,  # float32 [T, H] natural log, -inf = no entry
    H,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    base = t * H + heads
    a = tl.load(lse_ptr + base, mask=hmask, other=float("-inf"))
    b = tl.load(part_lse_ptr + base, mask=hmask, other=float("-inf"))
    has_a = a > float("-inf")
    has_b = hmask & (b > float("-inf"))
    write = hmask & (has_b | (a == float("-inf")))  # both empty: out = 0, lse -inf
    if tl.max(write.to(tl.int32), axis=0) > 0:
        wa, wb, lse = _merge_weights(a, b)
        d = tl.arange(0, 512)
        off = base[:, None] * 512 + d[None, :]
        o = _side(out_ptr + off, has_b & has_a)
        p = _side(part_out_ptr + off, has_b)
        tl.store(out_ptr + off, o * wa[:, None] + p * wb[:, None], mask=write[:, None])
        tl.store(lse_ptr + base, lse, mask=write)


@triton.jit(do_not_specialize=["N", "K"])
def miss_split_kernel(
    q_ptr,  # bf16 [T, H, 576], last-dim stride 1
    kv_ptr,  # uint8 [N, 656] (IS_FP8) or bf16 [N, 576]; last-dim stride 1
    idx_ptr,  # int32 [T, K] hot rows of the miss entries (-1 / out of range = padding)
    cnt_ptr,  # int32 [T] miss counts (clamped to [0, K])
    out_ptr,  # bf16 [T, H, 512] contiguous: the hit partial, merged in place (NUM_SPLITS 1)
    lse_ptr,  # float32 [T, H] natural log: the hit lse, merged in place (NUM_SPLITS 1)
    part_out_ptr,  # float32 [T, NUM_SPLITS, H, 512] (NUM_SPLITS > 1)
    part_lse_ptr,  # float32 [T, NUM_SPLITS, H] base 2 (NUM_SPLITS > 1)
    N, K, H,  # hot rows, miss-list capacity, heads
    q_stride_t, q_stride_h,  # elements
    kv_stride,  # bytes (fp8) or elements (bf16) between rows
    idx_stride,  # elements between index rows
    qk_scale_log2,  # sm_scale * log2(e)
    IS_FP8: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ISOLATE_QK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    lo, hi = _slice(_count(cnt_ptr, t, K), sp, NUM_SPLITS, BLOCK_N)
    if lo < hi:
        idx_row = idx_ptr + t * idx_stride
        heads, hmask, acc0, acc1, acc2, acc3, m_i, l_i = _attend(
            q_ptr, kv_ptr, idx_row, t, hb, lo, hi, N, H, q_stride_t, q_stride_h,
            kv_stride, qk_scale_log2, _runtime_one(K), IS_FP8, BLOCK_H, BLOCK_N,
            ISOLATE_QK, PREFETCH)
        inv_l, lse2 = finish(m_i, l_i)
        if NUM_SPLITS == 1:
            _merge_into(out_ptr, lse_ptr, t, heads, hmask, H, acc0, acc1, acc2, acc3, inv_l, lse2)
        else:
            base = (t * NUM_SPLITS + sp) * H + heads.to(tl.int64)
            _store_result(part_out_ptr, part_lse_ptr, base, hmask, acc0, acc1, acc2, acc3,
                          inv_l, lse2)
    else:
        if NUM_SPLITS == 1:  # no miss entry (with splits, the combine kernel sees to it)
            heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            _zero_empty(out_ptr, lse_ptr, t, heads, heads < H, H)


@triton.jit(do_not_specialize=["K"])
def miss_combine_kernel(
    part_out_ptr,  # float32 [T, NUM_SPLITS, H, 512]
    part_lse_ptr,  # float32 [T, NUM_SPLITS, H] base 2 (read only for splits with work)
    cnt_ptr,  # int32 [T] miss counts (the same the partials were made from)
    out_ptr,  # bf16 [T, H, 512]: the hit partial, merged in place
    lse_ptr,  # float32 [T, H] natural log: the hit lse, merged in place
    K, H,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the slicing granularity of the partials' kernel
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    c = _count(cnt_ptr, t, K)
    lp = lse_ptr + t * H + heads
    if c > 0:
        rps = tl.cdiv(tl.cdiv(c, NUM_SPLITS), BLOCK_N) * BLOCK_N
        d = tl.arange(0, 512)
        # the miss splits first (online, base 2), then the hit partial
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        tot = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
        for sp in tl.static_range(NUM_SPLITS):
            base = (t * NUM_SPLITS + sp) * H + heads.to(tl.int64)
            b = tl.load(part_lse_ptr + base, mask=hmask & (sp * rps < c), other=float("-inf"))
            m_new = tl.maximum(m, b)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            beta = tl.exp2(b - m_use)
            part = tl.load(part_out_ptr + base[:, None] * 512 + d[None, :],
                           mask=(b > float("-inf"))[:, None], other=0.0)
            acc = acc * alpha[:, None] + part * beta[:, None]
            tot = tot * alpha + beta
            m = m_new
        has_b = hmask & (tot > 0.0)
        inv = tl.where(has_b, 1.0 / tl.where(has_b, tot, 1.0), 0.0)
        b2 = tl.where(has_b, m + tl.log2(tl.where(has_b, tot, 1.0)), float("-inf"))
        off = (t * H + heads.to(tl.int64))[:, None] * 512 + d[None, :]
        a = tl.load(lp, mask=hmask, other=float("-inf"))
        write = hmask & (has_b | (a == float("-inf")))  # both empty: out = 0, lse -inf
        wa, wb, lse = _merge_weights(a, b2 * LN2)
        o = _side(out_ptr + off, has_b & (a > float("-inf")))
        tl.store(out_ptr + off, o * wa[:, None] + acc * (wb * inv)[:, None],
                 mask=write[:, None])
        tl.store(lp, lse, mask=write)
    else:
        _zero_empty(out_ptr, lse_ptr, t, heads, hmask, H)
