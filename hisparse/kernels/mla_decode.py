"""Triton bodies of sparse-MLA attention (decode over bf16 / fp8_ds_mla rows; prefill
reuses the bf16 path over the staged workspace). Launcher: ``hisparse.attention.triton_backend``.

Notation: T query tokens, H heads, K selected entries per token, N rows, D_QK = 576
(4 latent tiles of 128 + 64 RoPE), D_V = 512 (the 4 latent tiles).

Grid of the main kernel: (T, cdiv(H, BLOCK_H), NUM_SPLITS). Program (t, hb, sp) takes
the head block hb of token t and the entries [sp * rows_per_split, (sp + 1) *
rows_per_split) of its index row (split-KV, so small T still fills the GPU); PREFETCH > 0
asks L2 for the rows PREFETCH blocks ahead at the top of every iteration. ISOLATE_QK
puts each q . k^T dot in its own loop region (``mla_blocks.scores``). Per iteration it
gathers BLOCK_N rows *once* for all BLOCK_H heads, dequantizes them to bf16 in registers
(fp8: e4m3 bytes bitcast to float8e4nv times the tile scale, exact since scales are
powers of two; RoPE bf16 as stored), and runs an online softmax (base 2) with tl.dot for
q . k^T and p . v (the blocks of ``mla_blocks``, shared with the miss attention). Invalid
entries (index -1, index outside [0, N), or k >= valid_counts[t]) are masked and never
dereferenced.

With one split the kernel writes ``out`` bf16 and ``lse`` (natural log) directly;
otherwise each split writes a normalised float32 partial output and its base-2 lse,
and ``sparse_mla_combine_kernel`` merges them: lse = log2(sum_s 2^lse_s), out =
sum_s 2^(lse_s - lse) * out_s. A head with no valid entry: out = 0, lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mla_blocks import (LN2, attend_block, entries, finish, load_q, load_rows, prefetch_block,
                         softmax_state, split_range, store_tiles)
from .paged_rows import PAGED_CHUNK, paged_row_ptr, paged_rows_tl

# the paged lookup's sizes, offsets and state views vary between caches, layers and calls:
# specialising on them would compile a kernel per value class
PAGED_NO_SPECIALIZE = ["t0", "max_request_id", "R", "pt_stride", "MP", "pool_base", "PB", "NPG", "phys_stride"]
PAGED_NO_ALIGNMENT = ["req_ids_ptr", "id_to_slot_ptr", "resident_ptr", "seq_lens_ptr", "pt_ptr", "stats_ptr",
                      "phys_ptr", "scratch_ptr"]


@triton.jit(do_not_specialize=PAGED_NO_SPECIALIZE, do_not_specialize_on_alignment=PAGED_NO_ALIGNMENT)
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
    ISOLATE_QK: tl.constexpr = False,  # each q . k^T dot in its own one-trip loop (``scores``)
    PREFETCH: tl.constexpr = 0,  # L2-prefetch the rows PREFETCH blocks ahead (0 = off; GPU only)
    # paged lookups (``paged_rows``): idx_ptr holds the top-k's positions of every token of
    # the call (int32 [T_all, K], row stride idx_stride), mapped in the prologue
    PAGED: tl.constexpr = False,
    t0=0,  # this launch's first token in the call (the top-k, request ids and rows are the call's)
    req_ids_ptr=None,  # int32 [T_all]
    id_to_slot_ptr=None,  # int32 [max_request_id]
    max_request_id=0,
    R=0,
    resident_ptr=None,  # int32 [R]
    seq_lens_ptr=None,  # int32 [R] of the layer
    pt_ptr=None,  # int32 [R, MP] page table (row stride pt_stride)
    pt_stride=0,
    MP=0,
    pool_base=0,
    PB=1,
    NPG=0,
    stats_ptr=None,  # int64 [NUM_STATS] of the layer
    phys_ptr=None,  # int32 [>= T_all, >= K] the resolve's physical rows (row stride phys_stride), output
    phys_stride=0,
    scratch_ptr=None,  # int32 [T_all * (head blocks - 1), K], output
    PQ: tl.constexpr = 1,  # max_query_len
    PCH: tl.constexpr = 64,  # request ids scanned per step (resolve._token_group)
    STAT_INVALID: tl.constexpr = 2,
    STAT_RESOLVES: tl.constexpr = 4,
    STAT_RESIDENT: tl.constexpr = 6,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q = load_q(q_ptr, t, heads, hmask, q_stride_t, q_stride_h)

    lo, hi = split_range(vc_ptr, t, sp, rows_per_split, K, HAS_VC)

    m_i, l_i, acc = softmax_state(BLOCK_H, 4, 128)
    if PAGED:
        tg = (t0 + t).to(tl.int32)
        idx_row = paged_row_ptr(tg, hb, tl.num_programs(1), K, phys_ptr, phys_stride, scratch_ptr)
        paged_rows_tl(tg, hb, sp, lo, hi, idx_ptr, idx_stride, req_ids_ptr, id_to_slot_ptr, max_request_id, R,
                      resident_ptr, seq_lens_ptr, pt_ptr, pt_stride, MP, pool_base, PB, NPG, stats_ptr, idx_row,
                      STAT_INVALID, STAT_RESOLVES, STAT_RESIDENT, PQ, PCH, PAGED_CHUNK)
        tl.debug_barrier()  # every thread's row stores before any thread's loads of them
    else:
        idx_row = idx_ptr + t * idx_stride
    # a runtime 1 for ISOLATE_QK's one-trip loops (lo >= 0 always; lo depends on the
    # program id, so the compiler cannot fold the loops away, whatever K is specialised to)
    one = (lo >= 0).to(tl.int32)
    for j in tl.static_range(1, PREFETCH):
        prefetch_block(kv_ptr, idx_row, lo + j * BLOCK_N, hi, N, kv_stride, BLOCK_N, IS_FP8)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH > 0:
            # the gathers below are not software-pipelined (see ISOLATE_QK): have L2
            # fetch a later block's rows while this one is dequantised and multiplied
            prefetch_block(kv_ptr, idx_row, start + PREFETCH * BLOCK_N, hi, N, kv_stride,
                           BLOCK_N, IS_FP8)
        idx, valid = entries(idx_row, start + tl.arange(0, BLOCK_N), hi, N)
        k = load_rows(kv_ptr, idx, valid, kv_stride, IS_FP8)
        m_i, l_i, acc = attend_block(q, k, valid, m_i, l_i, acc, qk_scale_log2, one, BLOCK_H,
                                     BLOCK_N, ISOLATE_QK)

    inv_l, lse2 = finish(m_i, l_i)
    if NUM_SPLITS == 1:
        store_tiles(out_ptr, t * H + heads.to(tl.int64), hmask, acc, inv_l)
        tl.store(lse_ptr + t * H + heads, lse2 * LN2, mask=hmask)
    else:
        base = (t * NUM_SPLITS + sp) * H + heads.to(tl.int64)
        store_tiles(part_out_ptr, base, hmask, acc, inv_l)
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
