"""Triton body of the decode resolve (logical top-k -> physical hot rows, exact LRU).

Semantics: exactly those of ``hisparse.cache.resolve_ref.resolve_reference`` (read
its docstring and ``hisparse.cache.state``), including the pairing of misses with
victims, so the state tensors after a launch equal the reference's bit for bit.

Grid (T,): program t looks at its own run offset (how many directly preceding tokens
carry the same request id, capped at Q = max_query_len):
  - token not part of a live group (bad/free id, offset >= Q, or its run's request
    id already occurs at an earlier token -- a second run of one request, which
    checked mode rejects; found by scanning req_ids[0 : t - offset] in chunks of
    CH with a bounded ``while``): writes its own
    physical row as -1, valid count 0, clears its own staging slice and counts its
    non -1 entries in STAT_INVALID;
  - offset 0 and live (a *leader*): does the whole group of n <= Q tokens;
  - other live tokens: nothing (their leader writes their outputs).
So every output element and every (layer, request) state row has exactly one writer.

Leader phases (global memory hand-offs between phases are separated by
``tl.debug_barrier``, a CTA-wide barrier that also orders global memory):
  P1  load the group's n*K positions; invalid ones (out of [0, seq_len), or an
      unmapped host block) are counted and replaced by a sentinel.
  P2  if every valid position is already hot (all hits), stamp them and skip to P5.
      Otherwise sort the positions (``tl.sort``); a position is unique when it differs from its
      left neighbour (``tl.gather``). Look each unique position up in row_slot: hits
      are stamped with the new step; misses get their rank (exclusive cumsum), which
      is their index in ascending position order, as in the reference. The miss of
      rank i parks its host row and position in entry i of the group's staging slice
      stage_*[t0*K : (t0+n)*K] (the slice belongs to the group alone); the rest of
      the slice is cleared to -1.
  P3  (only if there are misses) compute the eviction key of every slot 0..S-1 whose
      stamp is older than the new step, sort the keys, and give each candidate its
      rank by a branch-free binary search in the sorted keys. The candidates of rank
      < m are the victims.
  P4  the victim of rank i reads the miss parked in entry i, unmaps its old row,
      maps the miss (slot_pos, slot_stamp, row_slot) and writes its flat hot row to
      stage_dst[t0*K + i]. Nothing of the group-sized tensors of P1-P2 stays live
      across the key sort, which keeps register pressure down.
  P5  per token of the group: physical = r * (S + 1) + row_slot[row], -1 for
      padding/invalid; valid count; optional stable compaction.

Robustness with validation off: every load and store index is range checked
(request id, request slot, block, host row, slot), so a corrupt input or state costs
correctness for the affected rows but never an out-of-bounds access. Two groups of
the same request in one launch (non-contiguous tokens, rejected in checked mode)
cannot race on that request's state: only the first run is resolved.
"""

from __future__ import annotations

import triton
import triton.language as tl

_I32_MAX = tl.constexpr(2147483647)
_I64_MAX = tl.constexpr(9223372036854775807)


@triton.jit
def _host_row(pos, ok, bt_row_ptr, NB, B, H):
    """Host row (int64) of positions ``pos`` through one block-table row.

    pos: int32 tensor; ok: bool tensor (lanes to look up). Returns (row, good):
    row is -1 where not good; good = ok and the block is mapped and in range.
    """
    safe = tl.where(ok, pos, 0)
    blk = safe // B
    okb = ok & (blk < NB)
    hb = tl.load(bt_row_ptr + blk, mask=okb, other=-1)
    row = hb.to(tl.int64) * B + (safe % B)
    good = okb & (hb >= 0) & (row < H)
    return tl.where(good, row, -1), good


# Sizes and strides vary between calls; specialising on them (== 1, % 16) would
# recompile the kernel (tens of seconds) for each new divisibility class. The
# per-layer state pointers are views at arbitrary 4-byte offsets, and only scalar
# or gathered accesses use them, so their alignment is not specialised either.
@triton.jit(
    do_not_specialize=["topk_stride", "max_request_id", "R", "bt_stride", "NB", "H",
                       "phys_stride", "T", "K", "S", "B"],
    do_not_specialize_on_alignment=["slot_pos_ptr", "slot_stamp_ptr", "row_slot_ptr",
                                    "step_ptr", "stats_ptr", "id_to_slot_ptr", "seq_lens_ptr",
                                    "bt_ptr", "valid_ptr"],
)
def resolve_kernel(
    req_ids_ptr,  # int32 [T], request id per query token
    topk_ptr,  # int32 [T, K] (row stride topk_stride), -1 = padding
    topk_stride,
    id_to_slot_ptr,  # int32 [max_request_id], request slot of a live id, -1 = none
    max_request_id,
    seq_lens_ptr,  # int32 [R] of this layer: rows appended to the layer per request slot
    R,
    bt_ptr,  # int32 [R, NB] (row stride bt_stride), host block per logical block
    bt_stride,
    NB,
    slot_pos_ptr,  # int32 [R, S + 1] of this layer (contiguous), -1 = empty
    slot_stamp_ptr,  # int32 [R, S + 1] of this layer (contiguous), -1 = empty
    row_slot_ptr,  # int32 [H] of this layer, -1 = not hot
    H,
    step_ptr,  # int32 [R] of this layer
    stats_ptr,  # int64 [NUM_STATS] of this layer
    phys_ptr,  # int32 [>= T, >= K] (row stride phys_stride), output
    phys_stride,
    valid_ptr,  # int32 [>= T], output
    stage_src_ptr,  # int32 [>= T * K], output: host row to stage, -1 = nothing
    stage_dst_ptr,  # int32 [>= T * K], output: flat hot row, -1 = nothing
    T,
    K,
    S,  # LRU slots per (layer, request); slot S is reserved
    B,  # host block size
    STAT_HITS: tl.constexpr,
    STAT_MISSES: tl.constexpr,
    STAT_INVALID: tl.constexpr,
    STAT_RESOLVES: tl.constexpr,
    Q: tl.constexpr,  # max_query_len
    KB: tl.constexpr,  # next power of two >= K
    GB: tl.constexpr,  # next power of two >= Q * KB (group tile)
    SB: tl.constexpr,  # next power of two >= S
    LOG_SB: tl.constexpr,  # log2(SB)
    COMPACT: tl.constexpr,
    CH: tl.constexpr,  # chunk of req_ids scanned per step when looking for an earlier run
):
    t = tl.program_id(0)
    my_id = tl.load(req_ids_ptr + t)

    # run offset of t within its run of equal ids, capped at Q (as group_offsets)
    off = t * 0
    same = t >= 0
    for j in tl.static_range(1, Q + 1):
        pj = t - j
        prev = tl.load(req_ids_ptr + pj, mask=pj >= 0, other=0)
        same = same & (pj >= 0) & (prev == my_id)
        off += same.to(tl.int32)

    id_ok = (my_id >= 0) & (my_id < max_request_id)
    r = tl.load(id_to_slot_ptr + my_id, mask=id_ok, other=-1)
    live = id_ok & (r >= 0) & (r < R) & (off < Q)

    # a run whose request id already occurs before it is not resolved (see docstring):
    # scan req_ids[0 : t - off]. A bounded while over chunks (not range() with a
    # runtime bound); every load is masked to the scanned prefix.
    lead = tl.where(live, t - off, 0)
    dup = t < 0
    c0 = t * 0
    while c0 < lead:
        ci = c0 + tl.arange(0, CH)
        cm = ci < lead
        v = tl.load(req_ids_ptr + ci, mask=cm, other=0)
        dup = dup | (tl.sum((cm & (v == my_id)).to(tl.int32), axis=0) > 0)
        c0 += CH
    live = live & (dup == 0)

    kk = tl.arange(0, KB)
    kmask = kk < K
    base = t.to(tl.int64) * K
    minus1_k = tl.full([KB], -1, tl.int32)

    if live:
        if off == 0:
            # ---- group size: following tokens with the same id, at most Q in all
            n = t * 0 + 1
            cont = live
            for j in tl.static_range(1, Q):
                nj = t + j
                nxt = tl.load(req_ids_ptr + nj, mask=nj < T, other=0)
                cont = cont & (nj < T) & (nxt == my_id)
                n += cont.to(tl.int32)

            SP = S + 1
            rbase = r * SP  # first flat hot row of this request slot
            slot_pos_r = slot_pos_ptr + r.to(tl.int64) * SP
            slot_stamp_r = slot_stamp_ptr + r.to(tl.int64) * SP
            bt_r = bt_ptr + r.to(tl.int64) * bt_stride
            seq = tl.load(seq_lens_ptr + r)
            s_new = tl.load(step_ptr + r) + 1

            gi = tl.arange(0, GB)
            gj = gi // KB
            gk = gi % KB
            gmask = (gj < n) & (gk < K)
            goff = gj.to(tl.int64) * K + gk  # offset within the group's staging slice
            minus1_g = tl.full([GB], -1, tl.int32)

            # P1: positions of the whole group
            gpos = tl.load(topk_ptr + (t + gj).to(tl.int64) * topk_stride + gk,
                           mask=gmask, other=-1)
            gok = gmask & (gpos >= 0) & (gpos < seq)
            _grow, ggood = _host_row(gpos, gok, bt_r, NB, B, H)
            nbad = tl.sum((gmask & (gpos != -1) & (ggood == 0)).to(tl.int32), axis=0)

            # All-hit fast path (every step of a request whose context fits its buffer,
            # and many others): when every valid entry is already hot there is nothing
            # to rank, so skip the sort. Stamps are idempotent; the unique hits are the
            # slots now stamped s_new (every older stamp is < s_new).
            gslot = tl.load(row_slot_ptr + _grow, mask=ggood, other=-1)
            ghit = ggood & (gslot >= 0) & (gslot <= S)
            m_raw = tl.sum((ggood & (ghit == 0)).to(tl.int32), axis=0)
            if m_raw == 0:
                tl.store(slot_stamp_r + gslot, tl.full([GB], 0, tl.int32) + s_new, mask=ghit)
                tl.store(stage_src_ptr + base + goff, minus1_g, mask=gmask)
                tl.store(stage_dst_ptr + base + goff, minus1_g, mask=gmask)
                tl.debug_barrier()
                si0 = tl.arange(0, SB)
                st0 = tl.load(slot_stamp_r + si0, mask=si0 < S, other=0)
                nhit = tl.sum((st0 == s_new).to(tl.int32), axis=0) \
                    + (tl.load(slot_stamp_r + S) == s_new).to(tl.int32)
                m = nhit * 0
            else:
                # P2: unique positions, hits and misses
                sp = tl.sort(tl.where(ggood, gpos, _I32_MAX))
                left = tl.gather(sp, tl.maximum(gi - 1, 0), 0)
                uniq = (sp != _I32_MAX) & ((gi == 0) | (sp != left))
                srow, sgood = _host_row(sp, uniq, bt_r, NB, B, H)
                sslot = tl.load(row_slot_ptr + srow, mask=sgood, other=-1)
                hit = sgood & (sslot >= 0) & (sslot <= S)
                miss = sgood & (hit == 0)
                tl.store(slot_stamp_r + sslot, tl.full([GB], 0, tl.int32) + s_new, mask=hit)
                nhit = tl.sum(hit.to(tl.int32), axis=0)
                mi = miss.to(tl.int32)
                m = tl.sum(mi, axis=0)
                mrank = tl.cumsum(mi, 0) - mi
                # staging slice: the miss of rank i parks (host row, -2 - position) at
                # entry i for its victim to pick up in P3; entries >= m are cleared. The
                # two masks address disjoint entries (ranks < m, offsets >= m).
                tl.store(stage_src_ptr + base + mrank, srow.to(tl.int32), mask=miss)
                tl.store(stage_dst_ptr + base + mrank, -2 - sp, mask=miss)
                tail = gmask & (goff >= m)
                tl.store(stage_src_ptr + base + goff, minus1_g, mask=tail)
                tl.store(stage_dst_ptr + base + goff, minus1_g, mask=tail)

            tl.store(step_ptr + r, s_new)
            tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
            tl.atomic_add(stats_ptr + STAT_HITS, nhit.to(tl.int64))
            tl.atomic_add(stats_ptr + STAT_MISSES, m.to(tl.int64))
            tl.atomic_add(stats_ptr + STAT_RESOLVES, tl.full([], 1, tl.int64))
            tl.debug_barrier()

            if m > 0:
                # P3: victims = the m smallest keys among slots whose stamp < s_new
                si = tl.arange(0, SB)
                smask = si < S
                st = tl.load(slot_stamp_r + si, mask=smask, other=_I32_MAX)
                spo = tl.load(slot_pos_r + si, mask=smask, other=-1)
                cand = smask & (st < s_new)
                occ_key = (st.to(tl.int64) << 32) | spo.to(tl.int64)
                key = tl.where(spo >= 0, occ_key, si.to(tl.int64) - SP)
                key = tl.where(cand, key, _I64_MAX)
                sk = tl.sort(key)
                rank = tl.zeros([SB], tl.int32)
                for b in tl.static_range(LOG_SB):
                    probe = tl.gather(sk, rank + ((SB >> (b + 1)) - 1), 0)
                    rank = tl.where(probe < key, rank + (SB >> (b + 1)), rank)
                vic = cand & (rank < m)
                # P4: the victim of rank i takes the miss of rank i
                vr = tl.where(vic, rank, 0)
                mrow = tl.load(stage_src_ptr + base + vr, mask=vic, other=-1)
                menc = tl.load(stage_dst_ptr + base + vr, mask=vic, other=-1)
                okv = vic & (menc <= -2) & (mrow >= 0) & (mrow < H)
                orow, ogood = _host_row(spo, okv & (spo >= 0), bt_r, NB, B, H)
                tl.store(row_slot_ptr + orow, tl.full([SB], -1, tl.int32), mask=ogood)
                tl.store(slot_pos_r + si, -2 - menc, mask=okv)
                tl.store(slot_stamp_r + si, tl.full([SB], 0, tl.int32) + s_new, mask=okv)
                tl.store(row_slot_ptr + mrow, si, mask=okv)
                tl.store(stage_dst_ptr + base + vr, rbase + si, mask=okv)
                if tl.sum(okv.to(tl.int32), axis=0) != m:
                    # only with a corrupt state (equal keys): drop unpaired misses
                    tl.debug_barrier()
                    d = tl.load(stage_dst_ptr + base + goff, mask=gmask, other=-1)
                    unpaired = gmask & (d < -1)
                    tl.store(stage_dst_ptr + base + goff, minus1_g, mask=unpaired)
                    tl.store(stage_src_ptr + base + goff, minus1_g, mask=unpaired)
                tl.debug_barrier()

            # P5: physical rows of every token of the group
            for j in tl.static_range(Q):
                if j < n:
                    tj = (t + j).to(tl.int64)
                    p = tl.load(topk_ptr + tj * topk_stride + kk, mask=kmask, other=-1)
                    ok = kmask & (p >= 0) & (p < seq)
                    row, good = _host_row(p, ok, bt_r, NB, B, H)
                    sl = tl.load(row_slot_ptr + row, mask=good, other=-1)
                    v = good & (sl >= 0) & (sl <= S)
                    ph = tl.where(v, rbase + sl, -1)
                    vi = v.to(tl.int32)
                    cnt = tl.sum(vi, axis=0)
                    if COMPACT:
                        ii = (kmask & (v == 0)).to(tl.int32)
                        dest = tl.where(v, tl.cumsum(vi, 0) - vi, cnt + tl.cumsum(ii, 0) - ii)
                    else:
                        dest = kk
                    tl.store(phys_ptr + tj * phys_stride + dest, ph, mask=kmask)
                    tl.store(valid_ptr + tj, cnt)
    else:
        p = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + kk, mask=kmask, other=-1)
        nbad = tl.sum((p != -1).to(tl.int32), axis=0)
        tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
        tl.store(phys_ptr + t.to(tl.int64) * phys_stride + kk, minus1_k, mask=kmask)
        tl.store(valid_ptr + t, 0)
        tl.store(stage_src_ptr + base + kk, minus1_k, mask=kmask)
        tl.store(stage_dst_ptr + base + kk, minus1_k, mask=kmask)
