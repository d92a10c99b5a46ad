"""Warp-specialised sparse-MLA decode over fp8_ds_mla rows, written in Gluon (Triton's
explicit-layout dialect, ``triton.experimental.gluon``; Hopper, sm90).

Same arguments, grid, outputs and split/combine contract as
``mla_decode.sparse_mla_decode_kernel`` (read that docstring), with BLOCK_H = 64.

Why: the ``tl`` kernels run one phase at a time in one 8-warp CTA per SM (gather,
dequantise, q . k^T, softmax, p . v; 32% of the stall cycles at CTA barriers, issue
slots 25% busy). Triton 3.6 does not warp-specialise loops whose loads are pointer
gathers. Here three partitions of four warps each run concurrently:

- producer (worker 1): gathers the rows of block j + RAW - 1 with ``cp.async`` into a
  ring of RAW raw slots (codes, scales, RoPE as stored; -1 / out-of-range entries
  zero-filled, never dereferenced), waits for block j's raw slot, dequantises it (code x
  tile scale, exact: scales are powers of two) into the bf16 ring slot j % STAGES
  (latent columns [0, 256) and [256, 512) in two tiles, RoPE in a third) and signals
  ``ready``;
- consumer 0 (the default partition) and consumer 1 (worker 0): each waits for
  ``ready``, computes the same scores s = q . k^T [64, BLOCK_N] on the tensor cores
  (wgmma, A = q from shared memory, B = the transposed bf16 tiles), masks the invalid
  entries with a 0 / -inf score bias it derives from the block's indices itself (read
  from global memory in the scores' column layout, so nothing but the tiles that
  wgmma reads and the mbarriers passes between the partitions), the same online
  softmax (base 2; each score row lives in one warp, so no cross-warp reduction), and
  p . v for its own half of the 512 output columns (accumulator [64, 256] float32:
  half the registers of a full row), then releases the slot (``empty``, two arrivals).

The two consumers duplicate q . k^T (1.5x the tensor-core work of one pass) so that
neither waits for the other; the softmax results are bitwise identical (same inputs,
same operations). A head block is 64 heads (wgmma's M); heads >= H read q as 0 and are
not written.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                              mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .mla_decode import PAGED_NO_ALIGNMENT, PAGED_NO_SPECIALIZE
from .paged_rows_gl import PAGED_CHUNK_GL, paged_row_ptr_gl, paged_rows_gl

BLOCK_H = 64
LOG2_LN2 = gl.constexpr(0.6931471805599453)  # ln(2): base-2 lse -> natural log
# Two Gluon builtins renamed after Triton 3.6, same operations: the CTA-wide barrier
# (thread_barrier -> barrier) and the cp.async gather into shared memory
# (async_copy_global_to_shared -> async_load; the old name raises from 3.9 on).
cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_cp_async = (async_copy.async_load if hasattr(async_copy, "async_load")
             else async_copy.async_copy_global_to_shared)


@gluon.jit
def _ws_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC: gl.constexpr, BLOCK_N: gl.constexpr):
    """(lo, hi, n_blocks) of split sp of token t (valid counts honoured)."""
    k_end = K
    if HAS_VC:
        k_end = gl.minimum(gl.maximum(gl.load(vc_ptr + t), 0), K)
    lo = sp * rows_per_split
    hi = gl.minimum(lo + rows_per_split, k_end)
    n = gl.maximum(hi - lo, 0)
    return lo, hi, (n + BLOCK_N - 1) // BLOCK_N


# Producer layouts (4 warps), spelled out in each function that uses them (layouts held
# in module globals would not be part of Triton's compile-cache key):
#   codes [BN, 512] u8 and a [BN, 128] code tile: 16 bytes a thread, 8 threads a row,
#   BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]); scales [BN, 4] f32:
#   ([1, 1], [8, 4], [4, 1], [1, 0]); RoPE [BN, 64] bf16: ([1, 8], [4, 8], [4, 1], [1, 0]);
#   the scales of a code tile's rows, a row's four in one thread: ([1, 4], [4, 8], [4, 1], [1, 0]).


@gluon.jit
def _load_idx(idx_row, start, hi, BLOCK_N: gl.constexpr):
    """Index entries [start, start + BLOCK_N) (-1 past hi), int32 [BLOCK_N] in the row
    layouts of the codes, scales and RoPE copies (three small loads, no conversion)."""
    _LC: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    _LS: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0])
    _LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rc = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _LC))
    rs = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _LS))
    rr = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _LR))
    return (gl.load(idx_row + rc, mask=rc < hi, other=-1),
            gl.load(idx_row + rs, mask=rs < hi, other=-1),
            gl.load(idx_row + rr, mask=rr < hi, other=-1))


@gluon.jit
def _score_bias(idx_row, start, hi, N, layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Score bias of entries [start, start + BLOCK_N): float32 [BLOCK_N] in ``layout``, 0
    for an index in [0, N), -inf for -1 / out-of-range entries and those past hi (the
    entries ``_issue_raw`` zero-fills)."""
    e = start + gl.arange(0, BLOCK_N, layout=layout)
    i = gl.load(idx_row + e, mask=e < hi, other=-1)
    return gl.where((i >= 0) & (i < N), 0.0, float("-inf"))


@gluon.jit
def _issue_raw(kv_ptr, idx_c, idx_s, idx_r, N, kv_stride, codes_slot, scales_slot, rope_slot):
    """cp.async the rows of one block (its indices in three layouts, ``_load_idx``; -1 /
    outside [0, N) = invalid) into one raw slot: codes uint8 [BLOCK_N, 512], scales
    float32 [BLOCK_N, 4], RoPE bf16 [BLOCK_N, 64]; invalid entries are zero-filled
    without a read (the consumers mask them, ``_score_bias``)."""
    _LC: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    _LS: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0])
    _LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ok_c = (idx_c >= 0) & (idx_c < N)
    off_c = gl.multiple_of(gl.where(ok_c, idx_c, 0).to(gl.int64) * kv_stride, 16)  # bytes
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, _LC))
    _cp_async(
        codes_slot, kv_ptr + off_c[:, None] + cols[None, :], mask=ok_c[:, None])
    ok_s = (idx_s >= 0) & (idx_s < N)
    sbase = (kv_ptr + gl.where(ok_s, idx_s, 0).to(gl.int64) * kv_stride + 512).to(
        gl.pointer_type(gl.float32))
    tt = gl.arange(0, 4, layout=gl.SliceLayout(0, _LS))
    _cp_async(scales_slot, sbase[:, None] + tt[None, :],
                                           mask=ok_s[:, None])
    ok_r = (idx_r >= 0) & (idx_r < N)
    off_r = gl.multiple_of(gl.where(ok_r, idx_r, 0).to(gl.int64) * kv_stride + 528, 16)
    rbase = (kv_ptr + off_r).to(gl.pointer_type(gl.bfloat16))
    rr = gl.arange(0, 64, layout=gl.SliceLayout(0, _LR))
    _cp_async(rope_slot, rbase[:, None] + rr[None, :],
                                           mask=ok_r[:, None])


@gluon.jit
def _producer(kv_ptr, idx_row, vc_ptr, N, K, kv_stride, rows_per_split,
              codes_raw, scales_raw, rope_raw, k_lo, k_hi, k_rope,
              ready, empty, HAS_VC: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, RAW: gl.constexpr):
    _LT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    _LTS: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    _LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    t = gl.program_id(0).to(gl.int64)
    sp = gl.program_id(2)
    lo, hi, n_blocks = _ws_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC, BLOCK_N)
    # fill the first RAW - 1 raw slots; one commit group per block (empty groups too, so
    # that wait_group(RAW - 1) below always means "block j has landed")
    for b in gl.static_range(RAW - 1):
        if b < n_blocks:
            i_c, i_s, i_r = _load_idx(idx_row, lo + b * BLOCK_N, hi, BLOCK_N)
            _issue_raw(kv_ptr, i_c, i_s, i_r, N, kv_stride, codes_raw.index(b),
                       scales_raw.index(b), rope_raw.index(b))
        async_copy.commit_group()
    # the indices of the next block to issue are loaded one iteration early, so their
    # latency hides behind a conversion
    n_c, n_s, n_r = _load_idx(idx_row, lo + (RAW - 1) * BLOCK_N, hi, BLOCK_N)
    tcol = gl.arange(0, 4, layout=gl.SliceLayout(0, _LTS))
    for j in range(n_blocks):
        nxt = j + RAW - 1
        if nxt < n_blocks:
            # raw slot nxt % RAW held block j - 1, converted in the previous iteration.
            # Its scales were read there by other warps than the ones that refill them
            # (gathered as _LS, read as _LTS). What orders those reads before this
            # refill is a producer barrier in the compiled kernel: the one before the
            # conversion's ``ready`` arrive, and one that Triton's shared-memory barrier
            # analysis inserts before these cp.async (the compile test checks the PTX).
            r = nxt % RAW
            _issue_raw(kv_ptr, n_c, n_s, n_r, N, kv_stride, codes_raw.index(r),
                       scales_raw.index(r), rope_raw.index(r))
        async_copy.commit_group()
        n_c, n_s, n_r = _load_idx(idx_row, lo + (nxt + 1) * BLOCK_N, hi, BLOCK_N)
        async_copy.wait_group(RAW - 1)  # block j's copies (this thread's) have landed
        cta_barrier()  # ... and every producer thread's
        r = j % RAW
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        sc = scales_raw.index(r).load(_LTS)  # float32 [BLOCK_N, 4], a row's 4 in one thread
        for tile in gl.static_range(4):
            st = gl.convert_layout(gl.sum(gl.where(tcol[None, :] == tile, sc, 0.0), axis=1),
                                   gl.SliceLayout(1, _LT))
            c = codes_raw.index(r).slice(tile * 128, 128, dim=1).load(_LT)  # uint8 [BN, 128]
            v = (c.to(gl.float8e4nv, bitcast=True).to(gl.float32) * st[:, None]).to(gl.bfloat16)
            if tile < 2:
                k_lo.index(s).slice(tile * 128, 128, dim=1).store(v)
            else:
                k_hi.index(s).slice((tile - 2) * 128, 128, dim=1).store(v)
        k_rope.index(s).store(rope_raw.index(r).load(_LR))
        fence_async_shared()  # generic-proxy stores -> the consumers' wgmma reads
        mbarrier.arrive(ready.index(s), count=1)
    async_copy.wait_group(0)


@gluon.jit
def _consume(q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, ready, empty, idx_row,
             out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, vc_ptr, N, K, H,
             rows_per_split, qk_scale_log2, PART: gl.constexpr, HAS_VC: gl.constexpr,
             NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup: all of q . k^T, output columns [256 PART, 256 PART + 256)."""
    t = gl.program_id(0).to(gl.int64)
    hb = gl.program_id(1)
    sp = gl.program_id(2)
    lo, hi, n_blocks = _ws_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC, BLOCK_N)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 256, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([64, 256], gl.float32, layout=o_l)
    s0 = gl.zeros([64, BLOCK_N], gl.float32, layout=s_l)
    for j in range(n_blocks):
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        kl = k_lo.index(s)
        kh = k_hi.index(s)
        sc = warpgroup_mma(q_lo, kl.permute((1, 0)), s0, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_hi, kh.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma(q_rope, k_rope.index(s).permute((1, 0)), sc, is_async=True)
        # loaded while the tensor cores run q . k^T (issued before the wait, fewer registers
        # held across the ready wait than a load ahead of it)
        b = _score_bias(idx_row, lo + j * BLOCK_N, hi, N, gl.SliceLayout(0, s_l), BLOCK_N)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        x = sc * qk_scale_log2 + b[None, :]
        m_new = gl.maximum(m_i, gl.max(x, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(x - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        pa = gl.convert_layout(p.to(gl.bfloat16), p_l)
        if PART == 0:
            acc = warpgroup_mma(pa, kl, acc, is_async=True)
        else:
            acc = warpgroup_mma(pa, kh, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(s), count=1)

    has = l_i > 0.0
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    o = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_l))[:, None]
    heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
    cols = PART * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, o_l))
    hm = (heads < H)[:, None]
    lheads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))
    if NUM_SPLITS == 1:
        o_row = out_ptr + (t * H + heads.to(gl.int64))[:, None] * 512 + cols[None, :]
        gl.store(o_row, o.to(gl.bfloat16), mask=hm)
        if PART == 0:
            gl.store(lse_ptr + t * H + lheads, lse2 * LOG2_LN2, mask=lheads < H)
    else:
        base = (t * NUM_SPLITS + sp) * H + heads.to(gl.int64)
        gl.store(part_out_ptr + base[:, None] * 512 + cols[None, :], o, mask=hm)
        if PART == 0:
            lbase = (t * NUM_SPLITS + sp) * H + lheads.to(gl.int64)
            gl.store(part_lse_ptr + lbase, lse2, mask=lheads < H)


@gluon.jit
def _consumer1(q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, ready, empty, idx_row,
               out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, vc_ptr, N, K, H,
               rows_per_split, qk_scale_log2, HAS_VC: gl.constexpr, NUM_SPLITS: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _consume(q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, ready, empty, idx_row,
             out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, vc_ptr, N, K, H,
             rows_per_split, qk_scale_log2, 1, HAS_VC, NUM_SPLITS, BLOCK_N, STAGES)


@gluon.jit(do_not_specialize=PAGED_NO_SPECIALIZE, do_not_specialize_on_alignment=PAGED_NO_ALIGNMENT)
def sparse_mla_decode_ws_kernel(
    q_ptr,  # bf16 [T, H, 576], last-dim stride 1
    kv_ptr,  # uint8 [N, 656] fp8_ds_mla rows, 16-byte aligned rows
    idx_ptr,  # int32 [T, K], -1 = padding
    vc_ptr,  # int32 [T] valid counts (read only when HAS_VC)
    out_ptr,  # bf16 [T, H, 512] contiguous (written when NUM_SPLITS == 1)
    lse_ptr,  # float32 [T, H] natural log (written when NUM_SPLITS == 1)
    part_out_ptr,  # float32 [T, NUM_SPLITS, H, 512] (written when NUM_SPLITS > 1)
    part_lse_ptr,  # float32 [T, NUM_SPLITS, H] base-2 lse (written when NUM_SPLITS > 1)
    N, K, H,  # rows, entries per token, heads
    q_stride_t, q_stride_h,  # elements
    kv_stride,  # bytes between rows (a multiple of 16)
    idx_stride,  # elements between index rows
    rows_per_split,  # entries per split (a multiple of BLOCK_N)
    qk_scale_log2,  # sm_scale * log2(e)
    HAS_VC: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,  # bf16 ring slots shared by producer and consumers
    RAW: gl.constexpr,  # raw (cp.async) ring slots: the producer gathers RAW - 1 blocks ahead
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    # paged lookups (``paged_rows``; the arguments of ``mla_decode.sparse_mla_decode_kernel``)
    PAGED: gl.constexpr = False,
    t0=0, req_ids_ptr=None, id_to_slot_ptr=None, max_request_id=0, R=0, resident_ptr=None, seq_lens_ptr=None,
    pt_ptr=None, pt_stride=0, MP=0, pool_base=0, PB=1, NPG=0, stats_ptr=None, phys_ptr=None, phys_stride=0,
    scratch_ptr=None,
    PQ: gl.constexpr = 1, PCH: gl.constexpr = 64,
    STAT_INVALID: gl.constexpr = 2, STAT_RESOLVES: gl.constexpr = 4, STAT_RESIDENT: gl.constexpr = 6,
):
    t = gl.program_id(0).to(gl.int64)
    hb = gl.program_id(1)
    # q of this head block into shared memory (default partition's 4 warps, before the fork)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    heads = hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ql))
    q_row = q_ptr + t * q_stride_t + heads.to(gl.int64)[:, None] * q_stride_h
    hmask = (heads < H)[:, None]
    d256 = gl.arange(0, 256, layout=gl.SliceLayout(0, ql))
    d64 = gl.arange(0, 64, layout=gl.SliceLayout(0, ql))
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    q_lo = gl.allocate_shared_memory(gl.bfloat16, [64, 256], q_sl,
                                     gl.load(q_row + d256[None, :], mask=hmask, other=0.0))
    q_hi = gl.allocate_shared_memory(gl.bfloat16, [64, 256], q_sl,
                                     gl.load(q_row + 256 + d256[None, :], mask=hmask, other=0.0))
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [64, 64], r_sl,
                                       gl.load(q_row + 512 + d64[None, :], mask=hmask, other=0.0))

    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 256], gl.bfloat16)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
    # ring layouts describe one slot (rank of the slot)
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    k_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 256], k_sl)
    k_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 256], k_sl)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], kr_sl)
    codes_raw = gl.allocate_shared_memory(gl.uint8, [RAW, BLOCK_N, 512], plain2)
    scales_raw = gl.allocate_shared_memory(gl.float32, [RAW, BLOCK_N, 4], plain2)
    rope_raw = gl.allocate_shared_memory(gl.bfloat16, [RAW, BLOCK_N, 64], plain2)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if PAGED:  # this program's entries mapped to rows, stored before the barrier below
        sp = gl.program_id(2)
        tg = (t0 + t).to(gl.int32)
        idx_row = paged_row_ptr_gl(tg, hb, gl.num_programs(1), K, phys_ptr, phys_stride, scratch_ptr)
        p_lo, p_hi, _n = _ws_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC, BLOCK_N)
        paged_rows_gl(tg, hb, sp, p_lo, p_hi, idx_ptr, idx_stride, req_ids_ptr, id_to_slot_ptr, max_request_id,
                      R, resident_ptr, seq_lens_ptr, pt_ptr, pt_stride, MP, pool_base, PB, NPG, stats_ptr, idx_row,
                      STAT_INVALID, STAT_RESOLVES, STAT_RESIDENT, PQ, PCH, PAGED_CHUNK_GL)
    else:
        idx_row = idx_ptr + t * idx_stride
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    fence_async_shared()  # q's stores and the barrier inits -> async proxy / other warps
    cta_barrier()  # ... and every warp sees them (and the paged rows) before the partitions start

    gl.warp_specialize([
        (_consume, (q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, ready, empty, idx_row,
                    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, vc_ptr, N, K, H,
                    rows_per_split, qk_scale_log2, 0, HAS_VC, NUM_SPLITS, BLOCK_N, STAGES)),
        (_consumer1, (q_lo, q_hi, q_rope, k_lo, k_hi, k_rope, ready, empty, idx_row,
                      out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, vc_ptr, N, K, H,
                      rows_per_split, qk_scale_log2, HAS_VC, NUM_SPLITS, BLOCK_N,
                      STAGES)),
        (_producer, (kv_ptr, idx_row, vc_ptr, N, K, kv_stride, rows_per_split,
                     codes_raw, scales_raw, rope_raw, k_lo, k_hi, k_rope,
                     ready, empty, HAS_VC, BLOCK_N, STAGES, RAW)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
