"""Triton body of the hit phase of a split resolve (``resolve_lookup_kernel``): the hits of
a step are stamped and their hot rows written before the miss phase
(``hisparse.kernels.resolve.resolve_kernel`` with STAMPED) maps and stages the misses, so
the hit attention can start at once. Semantics: ``hisparse.cache.resolve_ref.
resolve_lookup_reference``; the helpers are the resolve's own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .resolve import _page_row, _row_key, _token_group


@triton.jit(
    do_not_specialize=["topk_stride", "max_request_id", "R", "bt_stride", "NB", "HV",
                       "pt_stride", "MP", "pool_base", "PB", "NPG", "hit_stride", "T", "K", "S", "B"],
    do_not_specialize_on_alignment=["slot_stamp_ptr", "row_slot_ptr", "step_ptr", "stats_ptr",
                                    "id_to_slot_ptr", "seq_lens_ptr", "bt_ptr", "resident_ptr",
                                    "pt_ptr", "undo_hit_ptr"],
)
def resolve_lookup_kernel(
    req_ids_ptr,  # int32 [T], request id per query token
    topk_ptr,  # int32 [T, K] (row stride topk_stride), -1 = padding
    topk_stride,
    id_to_slot_ptr,  # int32 [max_request_id]
    max_request_id,
    seq_lens_ptr,  # int32 [R] of this layer
    R,
    bt_ptr,  # int32 [R, NB] (row stride bt_stride), block ids
    bt_stride,
    NB,
    slot_stamp_ptr,  # int64 [R, S + 1] of this layer
    row_slot_ptr,  # int32 [HV] of this layer, by row key
    HV,
    step_ptr,  # int64 [R] of this layer (read only: the miss phase increments it)
    stats_ptr,  # int64 [NUM_STATS] of this layer
    resident_ptr,  # int32 [R], 1 = resident request slot
    pt_ptr,  # int32 [R, MP] (row stride pt_stride), pool page per logical page
    pt_stride,
    MP,
    pool_base,  # first flat row of the pool pages
    PB,  # rows per pool page
    NPG,  # pages of the pool
    hit_ptr,  # int32 [>= T, >= K] (row stride hit_stride), output: hot row of a hit, else -1
    hit_stride,
    undo_hit_ptr,  # int64 [>= T * K], output: a hit lane's stamp before this step, -2 = no hit
    T,
    K,
    S,
    B,
    STAT_HITS: tl.constexpr,
    STAT_INVALID: tl.constexpr,
    STAT_RESIDENT: tl.constexpr,
    HAS_POOL: tl.constexpr,  # the elastic tier: some request slots may be resident
    Q: tl.constexpr,  # max_query_len
    CHUNK: tl.constexpr,  # entries per program (power of two)
    CH: tl.constexpr,  # req_ids scanned per step (see _token_group)
):
    """The hit phase of a split resolve: grid (T, cdiv(K, CHUNK)).

    Program (t, c) looks entries [c * CHUNK, (c + 1) * CHUNK) of token t up in
    row_slot and, for a token of a resolved group, stamps each hit slot with the step
    the group's miss phase will record (step + 1), writes the hit's flat hot row to
    ``hit`` (-1 for misses, padding and invalid entries), logs the old stamps, and
    counts unique hits and invalid entries. It changes no slot mapping, so the hot
    rows of the hits can be read as soon as it finished, while the miss phase
    (``resolve_kernel`` with STAMPED) maps and stages the misses on another stream.
    """
    t = tl.program_id(0)
    c = tl.program_id(1)
    my_id, off, r, live = _token_group(t, req_ids_ptr, id_to_slot_ptr, max_request_id, R, Q, CH)
    kk = c * CHUNK + tl.arange(0, CHUNK)
    kmask = kk < K
    out_off = t.to(tl.int64) * hit_stride + kk
    if HAS_POOL:
        is_res = tl.load(resident_ptr + r, mask=live, other=0)
    else:
        is_res = r * 0
    if live & (is_res != 0):
        # a resident request: every valid entry is a hit on its page row; nothing stamped
        seq = tl.load(seq_lens_ptr + r)
        pos = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + kk, mask=kmask, other=-1)
        ok = kmask & (pos >= 0) & (pos < seq)
        prow, good = _page_row(pos, ok, pt_ptr + r.to(tl.int64) * pt_stride, MP, PB, pool_base, NPG)
        nbad = tl.sum((kmask & (pos != -1) & (good == 0)).to(tl.int32), axis=0)
        tl.store(undo_hit_ptr + t.to(tl.int64) * K + kk, tl.full([CHUNK], -2, tl.int64), mask=kmask)
        tl.store(hit_ptr + out_off, prow.to(tl.int32), mask=kmask)
        tl.atomic_add(stats_ptr + STAT_RESIDENT, tl.sum(good.to(tl.int32), axis=0).to(tl.int64))
        tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
    elif live:
        SP = S + 1
        seq = tl.load(seq_lens_ptr + r)
        s_new = tl.load(step_ptr + r) + 1
        bt_r = bt_ptr + r.to(tl.int64) * bt_stride
        pos = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + kk, mask=kmask, other=-1)
        ok = kmask & (pos >= 0) & (pos < seq)
        row, good = _row_key(pos, ok, bt_r, NB, B, HV)
        nbad = tl.sum((kmask & (pos != -1) & (good == 0)).to(tl.int32), axis=0)
        slot = tl.load(row_slot_ptr + row, mask=good, other=-1)
        hit = good & (slot >= 0) & (slot <= S)
        old = tl.atomic_xchg(slot_stamp_ptr + r.to(tl.int64) * SP + slot,
                             tl.zeros([CHUNK], tl.int64) + s_new, mask=hit, sem="relaxed")
        tl.store(undo_hit_ptr + t.to(tl.int64) * K + kk, tl.where(hit, old, -2), mask=kmask)
        nhit = tl.sum((hit & (old != s_new)).to(tl.int32), axis=0)
        tl.store(hit_ptr + out_off, tl.where(hit, r * SP + slot, -1), mask=kmask)
        tl.atomic_add(stats_ptr + STAT_HITS, nhit.to(tl.int64))
        tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
    else:
        tl.store(hit_ptr + out_off, tl.full([CHUNK], -1, tl.int32), mask=kmask)
