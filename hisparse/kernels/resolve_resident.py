"""The resolve of a batch whose requests are all resident (the elastic tier), in one
launch on the caller's stream.

When every live request is resident, nothing can miss: a resolve is a page-table
lookup per entry, physical = pool_base + page_table[r, p // PB] * PB + p % PB, with no
LRU state to update and nothing to stage. ``resolve_resident_kernel`` writes the same
outputs the full resolve (``resolve.resolve_kernel``) writes for resident requests --
physical rows, valid counts, empty staging lists, the counters STAT_RESIDENT,
STAT_INVALID and STAT_RESOLVES -- one program per query token instead of one per
group, so that its cost does not grow with the group tile.

Tokens that are not resolved (an id that is not live, a repeated run of one request,
an offset past max_query_len: ``resolve._token_group``) get -1 rows and a count of 0,
and their non-padding entries count as invalid, as in the full resolve. A live request that is *not* resident has no page table to go
through: its entries come back -1 and are counted as invalid (the caller takes this
path only when the host side says every live request is resident; the counter makes
a disagreement visible instead of silent).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .resolve import _page_row, _token_group


@triton.jit(
    do_not_specialize=["topk_stride", "max_request_id", "R", "pt_stride", "MP", "pool_base", "PB", "NPG",
                       "phys_stride", "T", "K"],
    do_not_specialize_on_alignment=["stats_ptr", "id_to_slot_ptr", "seq_lens_ptr", "resident_ptr", "pt_ptr",
                                    "valid_ptr", "stage_cnt_ptr"],
)
def resolve_resident_kernel(
    req_ids_ptr,  # int32 [T], request id per query token
    topk_ptr,  # int32 [T, K] (row stride topk_stride), -1 = padding
    topk_stride,
    id_to_slot_ptr,  # int32 [max_request_id], request slot of a live id, -1 = none
    max_request_id,
    seq_lens_ptr,  # int32 [R] of this layer
    R,
    stats_ptr,  # int64 [NUM_STATS] of this layer
    resident_ptr,  # int32 [R], 1 = resident request slot
    pt_ptr,  # int32 [R, MP] (row stride pt_stride), pool page per logical page, -1 = none
    pt_stride,
    MP,
    pool_base,  # first flat row of the pool pages
    PB,  # rows per pool page
    NPG,  # pages of the pool
    phys_ptr,  # int32 [>= T, >= K] (row stride phys_stride), output
    phys_stride,
    valid_ptr,  # int32 [>= T], output
    stage_src_ptr,  # int32 [>= T * K], output: -1 (nothing staged)
    stage_dst_ptr,  # int32 [>= T * K], output: -1
    stage_cnt_ptr,  # int32 [>= T], output: 0
    T,
    K,
    STAT_INVALID: tl.constexpr,
    STAT_RESOLVES: tl.constexpr,
    STAT_RESIDENT: tl.constexpr,
    Q: tl.constexpr,  # max_query_len
    KB: tl.constexpr,  # next power of two >= K
    COMPACT: tl.constexpr,  # valid entries moved to the front of each row (stable)
    CH: tl.constexpr,  # req_ids scanned per step (see _token_group)
):
    t = tl.program_id(0)
    kk = tl.arange(0, KB)
    kmask = kk < K
    # the row's entries first: their load overlaps the chain of dependent loads below
    # (request id -> slot -> residency, length, page table)
    pos = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + kk, mask=kmask, other=-1)
    my_id, off, r, live = _token_group(t, req_ids_ptr, id_to_slot_ptr, max_request_id, R, Q, CH)
    base = t.to(tl.int64) * K
    minus1 = tl.full([KB], -1, tl.int32)
    tl.store(stage_src_ptr + base + kk, minus1, mask=kmask)
    tl.store(stage_dst_ptr + base + kk, minus1, mask=kmask)
    tl.store(stage_cnt_ptr + t, 0)
    is_res = tl.load(resident_ptr + r, mask=live, other=0)
    seq = tl.load(seq_lens_ptr + r, mask=live, other=0)
    ok = kmask & live & (is_res != 0) & (pos >= 0) & (pos < seq)
    prow, good = _page_row(pos, ok, pt_ptr + tl.where(live, r, 0).to(tl.int64) * pt_stride, MP, PB,
                           pool_base, NPG)
    gi = good.to(tl.int32)
    cnt = tl.sum(gi, axis=0)
    if COMPACT:
        bad = (kmask & (good == 0)).to(tl.int32)
        dest = tl.where(good, tl.cumsum(gi, 0) - gi, cnt + tl.cumsum(bad, 0) - bad)
    else:
        dest = kk
    tl.store(phys_ptr + t.to(tl.int64) * phys_stride + dest, prow.to(tl.int32), mask=kmask)
    tl.store(valid_ptr + t, cnt)
    nbad = tl.sum((kmask & (pos != -1) & (good == 0)).to(tl.int32), axis=0)  # a token not resolved: all
    # counters only: relaxed (no fence waits for this program's stores)
    tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64), sem="relaxed")
    if live:
        tl.atomic_add(stats_ptr + STAT_RESIDENT, cnt.to(tl.int64), sem="relaxed")
        if off == 0:
            tl.atomic_add(stats_ptr + STAT_RESOLVES, tl.full([], 1, tl.int64), sem="relaxed")


__all__ = ["resolve_resident_kernel"]
