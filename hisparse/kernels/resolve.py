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

Leader phases. The group is a [GQ, KB] tile (token j of the group, entry k), held
in registers from P1 to P5; global memory hand-offs between phases are separated by
``tl.debug_barrier`` (a CTA-wide barrier), and values written by atomics are read back
with ``.cg`` loads (L2, not a possibly stale L1 line). The only sort is of the misses:
  P1  load the group's positions; invalid ones (out of [0, seq_len), or an unmapped
      block) are counted and treated as padding. Look every row key up in row_slot.
  P2  hits: ``atomic_xchg`` their slot stamp to the new step; the lanes that changed
      a stamp are the unique hits. If there is no miss, skip to P5 (the all-hit path:
      one pass over the tile, no barrier). Misses: each miss lane bids a marker < -1
      for its row with ``atomic_min`` (the first lane in row-major order bids the
      smallest); the lane that reads its own marker back is the row's first
      occurrence. First occurrences get their miss rank i (row-major exclusive cumsum)
      and park (row key, position) at entry i of the group's staging slice
      stage_*[t0*K : (t0+n)*K] (the slice belongs to the group alone); the rest of
      the slice is cleared to -1. The m parked entries are then sorted by position
      (``tl.sort`` over a tile of SMALL_SORT entries when m is small, else of the
      group tile), so miss i is the i-th smallest missed position.
  P3  victims = the m smallest eviction keys among slots 0..S-1 with a stamp older
      than the new step: the empty slots first (by slot), then the occupied ones by
      (stamp, position), selected by bisecting for the threshold stamp and then for
      the threshold position inside that stamp (each probe one masked count over the
      S slots).
  P4  the victims, in ascending slot order, are ranked and listed (victim i's slot
      at entry i of a scratch list in the group's own rows of ``physical``, which P5
      overwrites); then, over the group tile's lanes (GQ x KB, masked to the m victims)
      instead of the S slot lanes, victim i reads the miss parked in
      entry i, logs its old position and stamp, unmaps its old row, maps the miss
      (slot_pos, slot_stamp, row_slot, overwriting the marker), writes its flat hot
      row to stage_dst[t0*K + i] and the miss's host row (through host_block where alias
      ids exist) to stage_src[t0*K + i]. The gathers run over the group tile's lanes.
  P5  per token of the group, from the tile: physical = r * (S + 1) + slot (the miss
      lanes re-read their final slot), -1 for padding/invalid; valid count; optional
      stable compaction.

A resident request (``resident[r]`` = 1, the elastic tier) is resolved by its leader
alone, without touching LRU state: physical = pool_base + page_table[r, p // PB] * PB +
p % PB for each valid position (an unmapped page: invalid), nothing staged, its entries
counted in STAT_RESIDENT; its step does not move. The split hit phase does the same
lookup and stamps nothing.

Robustness with validation off: every load and store index is range checked
(request id, request slot, block, row key, slot), so a corrupt input or state costs
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
def _row_key(pos, ok, bt_row_ptr, NB, B, HV):
    """Row key (int64: block id * B + pos % B, ``state``) of positions ``pos`` through
    one block-table row. pos: int32 tensor; ok: bool tensor (lanes to look up).
    Returns (row, good): row is -1 where not good; good = ok and the block is mapped
    and the key < HV (row_slot's length)."""
    safe = tl.where(ok, pos, 0)
    blk = safe // B
    okb = ok & (blk < NB)
    hb = tl.load(bt_row_ptr + blk, mask=okb, other=-1)
    row = hb.to(tl.int64) * B + (safe % B)
    good = okb & (hb >= 0) & (row < HV)
    return tl.where(good, row, -1), good


@triton.jit
def _page_row(pos, ok, pt_row_ptr, MP, PB, pool_base, NPG):
    """Flat device row (int64) of positions ``pos`` of a resident request through its
    page-table row. Returns (row, good): row is -1 where not good; good = ok and the
    page is mapped and one of the pool's NPG pages."""
    safe = tl.where(ok, pos, 0)
    pg = safe // PB
    okp = ok & (pg < MP)
    page = tl.load(pt_row_ptr + pg, mask=okp, other=-1)
    good = okp & (page >= 0) & (page < NPG)
    row = pool_base + page.to(tl.int64) * PB + (safe % PB)
    return tl.where(good, row, -1), good


@triton.jit
def _sort_parked(stage_src_ptr, stage_dst_ptr, base, m, bt_r, NB, B, HV, TILE: tl.constexpr):
    """Rewrite the m parked misses (entries [base, base + m) of stage_src = row key,
    stage_dst = -2 - position; m <= TILE) in ascending position order."""
    i = tl.arange(0, TILE)
    im = i < m
    enc = tl.load(stage_dst_ptr + base + i, mask=im, other=-1)
    pos = tl.sort(tl.where(im, -2 - enc, _I32_MAX))
    tl.debug_barrier()  # every parked entry is read before any is rewritten
    row, _good = _row_key(pos, im, bt_r, NB, B, HV)
    tl.store(stage_src_ptr + base + i, row.to(tl.int32), mask=im)
    tl.store(stage_dst_ptr + base + i, -2 - pos, mask=im)


@triton.jit
def _list_victims(vic, si, m, scratch_ptr, K, phys_stride):
    """P4, first half: rank the victims ``vic`` (bool [SB]) of the slots ``si`` in
    ascending slot order and write the slot of victim i < m to entry i of the group's
    scratch list (entry i: row i // K, column i % K of the group's rows of
    ``physical``, which P5 overwrites). Returns the number of victims."""
    vi = vic.to(tl.int32)
    vrank = tl.cumsum(vi, 0) - vi
    keep = vic & (vrank < m)
    tl.store(scratch_ptr + (vrank // K).to(tl.int64) * phys_stride + vrank % K, si, mask=keep)
    return tl.sum(vi, axis=0)


@triton.jit
def _pair_listed(nv, m, s_new, rbase, base, scratch_ptr, K, phys_stride, S, slot_pos_r, slot_stamp_r,
                 row_slot_ptr, stage_src_ptr, stage_dst_ptr, undo_vpos_ptr, undo_vstamp_ptr, bt_r, NB,
                 B, HV, host_block_ptr, N: tl.constexpr, ALIASED: tl.constexpr):
    """P4, second half, over N >= m lanes: victim i < min(nv, m) takes the miss parked at
    entry i: logs the victim's old position and stamp, unmaps its old row, maps the miss,
    rewrites the entry's row key as its host row (through host_block with ALIASED).
    Loads before a CTA barrier, stores after (threads that share a lane when N < the
    block's threads never read an entry another rewrote). Returns the victims paired."""
    i = tl.arange(0, N)
    im = i < tl.minimum(nv, m)
    vs = tl.load(scratch_ptr + (i // K).to(tl.int64) * phys_stride + i % K, mask=im, other=-1)
    mrow = tl.load(stage_src_ptr + base + i, mask=im, other=-1)
    menc = tl.load(stage_dst_ptr + base + i, mask=im, other=-1)
    okv = im & (vs >= 0) & (vs < S) & (menc <= -2) & (mrow >= 0) & (mrow < HV)
    spo = tl.load(slot_pos_r + vs, mask=okv, other=-1)
    st = tl.load(slot_stamp_r + vs, mask=okv, other=-1, cache_modifier=".cg")
    orow, ogood = _row_key(spo, okv & (spo >= 0), bt_r, NB, B, HV)
    if ALIASED:  # mrow < HV = NV x B, so its block id indexes host_block
        hb = tl.load(host_block_ptr + tl.where(okv, mrow, 0) // B, mask=okv, other=-1)
    else:
        hb = mrow
    tl.debug_barrier()
    tl.store(row_slot_ptr + orow, tl.full([N], -1, tl.int32), mask=ogood)
    tl.store(undo_vpos_ptr + base + i, spo, mask=okv)
    tl.store(undo_vstamp_ptr + base + i, st, mask=okv)
    tl.store(slot_pos_r + vs, -2 - menc, mask=okv)
    tl.store(slot_stamp_r + vs, tl.zeros([N], tl.int64) + s_new, mask=okv)
    tl.store(row_slot_ptr + mrow, vs, mask=okv)
    tl.store(stage_dst_ptr + base + i, rbase + vs, mask=okv)
    if ALIASED:
        hrow = tl.where(hb >= 0, hb.to(tl.int64) * B + mrow % B, -1)
        tl.store(stage_src_ptr + base + i, hrow.to(tl.int32), mask=okv)
    return tl.sum(okv.to(tl.int32), axis=0)


@triton.jit
def _group_len(t, my_id, live, req_ids_ptr, T, Q: tl.constexpr):
    """Tokens of leader t's group: t and the following tokens with the same id, at most Q."""
    n = t * 0 + 1
    cont = live
    for j in tl.static_range(1, Q):
        nj = t + j
        nxt = tl.load(req_ids_ptr + nj, mask=nj < T, other=0)
        cont = cont & (nj < T) & (nxt == my_id)
        n += cont.to(tl.int32)
    return n


@triton.jit
def _token_group(t, req_ids_ptr, id_to_slot_ptr, max_request_id, R, Q: tl.constexpr,
                 CH: tl.constexpr):
    """(my_id, off, r, live) of query token t: its request id, its offset in its run of
    equal ids (capped at Q), the request slot and whether the token belongs to a group
    that is resolved (a live id, offset < Q, and the first run of that id)."""
    my_id = tl.load(req_ids_ptr + t)
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
    # a run whose request id already occurs before it is not resolved: scan
    # req_ids[0 : t - off]. A bounded while over chunks (not range() with a runtime
    # bound); every load is masked to the scanned prefix.
    lead = tl.where(live, t - off, 0)
    dup = t < 0
    c0 = t * 0
    while c0 < lead:
        ci = c0 + tl.arange(0, CH)
        cm = ci < lead
        v = tl.load(req_ids_ptr + ci, mask=cm, other=0)
        dup = dup | (tl.sum((cm & (v == my_id)).to(tl.int32), axis=0) > 0)
        c0 += CH
    return my_id, off, r, live & (dup == 0)


# Sizes and strides vary between calls; specialising on them (== 1, % 16) would
# recompile the kernel (tens of seconds) for each new divisibility class. The
# per-layer state pointers are views at arbitrary 4-byte offsets, and only scalar
# or gathered accesses use them, so their alignment is not specialised either.
@triton.jit(
    do_not_specialize=["topk_stride", "max_request_id", "R", "bt_stride", "NB", "HV",
                       "pt_stride", "MP", "pool_base", "PB", "NPG", "phys_stride", "T", "K", "S", "B"],
    do_not_specialize_on_alignment=["slot_pos_ptr", "slot_stamp_ptr", "row_slot_ptr",
                                    "step_ptr", "stats_ptr", "id_to_slot_ptr", "seq_lens_ptr",
                                    "bt_ptr", "resident_ptr", "pt_ptr", "valid_ptr", "undo_hit_ptr",
                                    "undo_vpos_ptr", "undo_vstamp_ptr", "miss_cnt_ptr",
                                    "stage_cnt_ptr", "host_block_ptr"],
)
def resolve_kernel(
    req_ids_ptr,  # int32 [T], request id per query token
    topk_ptr,  # int32 [T, K] (row stride topk_stride), -1 = padding
    topk_stride,
    id_to_slot_ptr,  # int32 [max_request_id], request slot of a live id, -1 = none
    max_request_id,
    seq_lens_ptr,  # int32 [R] of this layer: rows appended to the layer per request slot
    R,
    bt_ptr,  # int32 [R, NB] (row stride bt_stride), block id (< NV) per logical block
    bt_stride,
    NB,
    slot_pos_ptr,  # int32 [R, S + 1] of this layer (contiguous), -1 = empty
    slot_stamp_ptr,  # int64 [R, S + 1] of this layer (contiguous), -1 = empty
    row_slot_ptr,  # int32 [HV] of this layer, by row key, -1 = not hot
    HV,  # row keys: NV x B
    step_ptr,  # int64 [R] of this layer
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
    stage_src_ptr,  # int32 [>= T * K], output: host row to stage, -1 = nothing
    stage_dst_ptr,  # int32 [>= T * K], output: flat hot row, -1 = nothing
    undo_hit_ptr,  # int64 [>= T * K], output: a hit lane's stamp before this step, -2 = no hit
    undo_vpos_ptr,  # int32 [>= T * K], output: victim i's old position at t0 * K + i
    undo_vstamp_ptr,  # int64 [>= T * K], output: victim i's old stamp at t0 * K + i
    miss_phys_ptr,  # int32 [>= T, >= K] (row stride phys_stride), output when MISS_LISTS
    miss_host_ptr,  # int32 [>= T, >= K] (row stride phys_stride), row keys, output when MISS_LISTS
    miss_cnt_ptr,  # int32 [>= T], output when MISS_LISTS
    stage_cnt_ptr,  # int32 [>= T], output: m at the group's first token, 0 at the others
    host_block_ptr,  # int32 [NV], host block of each block id (read with ALIASED)
    T,
    K,
    S,  # LRU slots per (layer, request); slot S is reserved
    B,  # host block size
    STAT_HITS: tl.constexpr,
    STAT_MISSES: tl.constexpr,
    STAT_INVALID: tl.constexpr,
    STAT_RESOLVES: tl.constexpr,
    STAT_PREFETCH: tl.constexpr,  # rows staged by prefetch resolves
    STAT_RESIDENT: tl.constexpr,  # entries resolved to resident rows
    HAS_POOL: tl.constexpr,  # the elastic tier: some request slots may be resident
    STAMPED: tl.constexpr,  # the hits were stamped (and counted) by resolve_lookup_kernel
    MISS_LISTS: tl.constexpr,  # write each token's miss entries, compacted (split decode)
    PREFETCH: tl.constexpr,  # a prefetch: only misses are counted, as STAT_PREFETCH
    Q: tl.constexpr,  # max_query_len
    KB: tl.constexpr,  # next power of two >= K
    GQ: tl.constexpr,  # next power of two >= Q (rows of the group tile)
    SMALL_SORT: tl.constexpr,  # tile of the miss sort when m <= SMALL_SORT (power of two)
    SB: tl.constexpr,  # next power of two >= S
    COMPACT: tl.constexpr,
    CH: tl.constexpr,  # chunk of req_ids scanned per step when looking for an earlier run
    ALIASED: tl.constexpr,  # block ids past the host blocks exist (prefix caching)
):
    t = tl.program_id(0)
    my_id, off, r, live = _token_group(t, req_ids_ptr, id_to_slot_ptr, max_request_id, R, Q, CH)

    kk = tl.arange(0, KB)
    kmask = kk < K
    base = t.to(tl.int64) * K
    minus1_k = tl.full([KB], -1, tl.int32)
    if HAS_POOL:
        is_res = tl.load(resident_ptr + r, mask=live, other=0)
    else:
        is_res = r * 0

    if live & (is_res != 0):
        if off == 0:
            # ---- a resident request: positions map through its page table; no LRU
            # state, no misses, nothing staged (the leader writes its group's outputs)
            n = _group_len(t, my_id, live, req_ids_ptr, T, Q)
            jj = tl.arange(0, GQ)
            gj = jj[:, None]
            gk = tl.arange(0, KB)[None, :]
            gmask = (gj < n) & (gk < K)
            goff = gj.to(tl.int64) * K + gk
            minus1_g = tl.full([GQ, KB], -1, tl.int32)
            seq = tl.load(seq_lens_ptr + r)
            gpos = tl.load(topk_ptr + (t + gj).to(tl.int64) * topk_stride + gk, mask=gmask, other=-1)
            gok = gmask & (gpos >= 0) & (gpos < seq)
            prow, v = _page_row(gpos, gok, pt_ptr + r.to(tl.int64) * pt_stride, MP, PB, pool_base, NPG)
            vi2 = v.to(tl.int32)
            nbad = tl.sum(tl.sum((gmask & (gpos != -1) & (v == 0)).to(tl.int32), axis=1), axis=0)
            cnt = tl.sum(vi2, axis=1)
            if COMPACT:
                ii = (gmask & (v == 0)).to(tl.int32)
                dest = tl.where(v, tl.cumsum(vi2, 1) - vi2, cnt[:, None] + tl.cumsum(ii, 1) - ii)
            else:
                dest = gk + gj * 0
            tl.store(phys_ptr + (t + gj).to(tl.int64) * phys_stride + dest, prow.to(tl.int32), mask=gmask)
            tl.store(valid_ptr + t + jj, cnt, mask=jj < n)
            tl.store(stage_cnt_ptr + t + jj, tl.zeros([GQ], tl.int32), mask=jj < n)
            tl.store(stage_src_ptr + base + goff, minus1_g, mask=gmask)
            tl.store(stage_dst_ptr + base + goff, minus1_g, mask=gmask)
            if not STAMPED:
                tl.store(undo_hit_ptr + base + goff, tl.full([GQ, KB], -2, tl.int64), mask=gmask)
            if MISS_LISTS:
                tl.store(miss_cnt_ptr + t + jj, tl.zeros([GQ], tl.int32), mask=jj < n)
            if not PREFETCH:
                if not STAMPED:
                    tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
                    nres = tl.sum(cnt, axis=0)
                    tl.atomic_add(stats_ptr + STAT_RESIDENT, nres.to(tl.int64))
                tl.atomic_add(stats_ptr + STAT_RESOLVES, tl.full([], 1, tl.int64))
    elif live:
        if off == 0:
            # ---- group size: following tokens with the same id, at most Q in all
            n = _group_len(t, my_id, live, req_ids_ptr, T, Q)

            SP = S + 1
            rbase = r * SP  # first flat hot row of this request slot
            slot_pos_r = slot_pos_ptr + r.to(tl.int64) * SP
            slot_stamp_r = slot_stamp_ptr + r.to(tl.int64) * SP
            bt_r = bt_ptr + r.to(tl.int64) * bt_stride
            seq = tl.load(seq_lens_ptr + r)
            s_new = tl.load(step_ptr + r) + 1
            scratch_ptr = phys_ptr + t.to(tl.int64) * phys_stride  # the victim list of P4

            # the group tile [GQ, KB]: entry k of the group's token j
            jj = tl.arange(0, GQ)
            gj = jj[:, None]
            gk = tl.arange(0, KB)[None, :]
            gmask = (gj < n) & (gk < K)
            goff = gj.to(tl.int64) * K + gk  # offset within the group's staging slice
            minus1_g = tl.full([GQ, KB], -1, tl.int32)

            # P1: positions, host rows and current slots of the whole group
            gpos = tl.load(topk_ptr + (t + gj).to(tl.int64) * topk_stride + gk,
                           mask=gmask, other=-1)
            gok = gmask & (gpos >= 0) & (gpos < seq)
            grow, ggood = _row_key(gpos, gok, bt_r, NB, B, HV)
            nbad = tl.sum(tl.sum((gmask & (gpos != -1) & (ggood == 0)).to(tl.int32), axis=1), axis=0)
            gslot = tl.load(row_slot_ptr + grow, mask=ggood, other=-1)
            ghit = ggood & (gslot >= 0) & (gslot <= S)
            gmiss = ggood & (ghit == 0)

            # P2: stamp the hits; the lanes that changed a stamp are the unique hits
            # (every stamp before this step is < s_new; duplicates see s_new)
            if STAMPED:
                nhit = n * 0
            else:
                old = tl.atomic_xchg(slot_stamp_r + gslot, tl.zeros([GQ, KB], tl.int64) + s_new,
                                     mask=ghit, sem="relaxed")
                tl.store(undo_hit_ptr + base + goff, tl.where(ghit, old, -2), mask=gmask)
                nhit = tl.sum(tl.sum((ghit & (old != s_new)).to(tl.int32), axis=1), axis=0)
            m = tl.sum(tl.sum(gmiss.to(tl.int32), axis=1), axis=0)
            if m > 0:
                # dedupe the misses without sorting: every miss lane bids a marker
                # < -1 for its row, smallest for the first lane (row-major); the lane
                # that reads back its own marker is the row's first occurrence
                marker = (gj * KB + gk) - GQ * KB - 1
                tl.atomic_min(row_slot_ptr + grow, marker, mask=gmiss, sem="relaxed")
                tl.debug_barrier()
                claim = tl.load(row_slot_ptr + grow, mask=gmiss, other=0, cache_modifier=".cg")
                win = (gmiss & (claim == marker)).to(tl.int32)
                m = tl.sum(tl.sum(win, axis=1), axis=0)
                wrow = tl.sum(win, axis=1)
                mrank = tl.cumsum(win, 1) - win + (tl.cumsum(wrow, 0) - wrow)[:, None]
                # the miss of rank i parks (row key, -2 - position) at entry i of the
                # group's staging slice for its victim to pick up in P4; entries >= m
                # are cleared (the two masks address disjoint entries)
                tl.store(stage_src_ptr + base + mrank, grow.to(tl.int32), mask=win != 0)
                tl.store(stage_dst_ptr + base + mrank, -2 - gpos, mask=win != 0)
                tail = gmask & (goff >= m)
                tl.store(stage_src_ptr + base + goff, minus1_g, mask=tail)
                tl.store(stage_dst_ptr + base + goff, minus1_g, mask=tail)
                if m > 1:
                    # put the parked misses in ascending position order: the staging
                    # copy then reads each host block's rows together (fewer distinct
                    # host pages in flight; 17-29% faster copies at 128K+ misses). Only
                    # the m parked entries are sorted, in a small tile when m is small.
                    tl.debug_barrier()
                    if m <= SMALL_SORT:
                        _sort_parked(stage_src_ptr, stage_dst_ptr, base, m, bt_r, NB, B, HV,
                                     SMALL_SORT)
                    else:
                        _sort_parked(stage_src_ptr, stage_dst_ptr, base, m, bt_r, NB, B, HV,
                                     GQ * KB)
            else:
                tl.store(stage_src_ptr + base + goff, minus1_g, mask=gmask)
                tl.store(stage_dst_ptr + base + goff, minus1_g, mask=gmask)

            tl.store(step_ptr + r, s_new)
            tl.store(stage_cnt_ptr + t + jj, tl.where(jj == 0, m, 0), mask=jj < n)
            if PREFETCH:
                tl.atomic_add(stats_ptr + STAT_PREFETCH, m.to(tl.int64))
            else:
                if not STAMPED:
                    tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
                    tl.atomic_add(stats_ptr + STAT_HITS, nhit.to(tl.int64))
                tl.atomic_add(stats_ptr + STAT_MISSES, m.to(tl.int64))
                tl.atomic_add(stats_ptr + STAT_RESOLVES, tl.full([], 1, tl.int64))

            if m > 0:
                tl.debug_barrier()
                # P3: victims = the m smallest keys among slots 0..S-1 whose stamp is
                # < s_new: first the empty slots (by slot), then the occupied ones by
                # (stamp, position), found by two bisections (threshold stamp, then
                # threshold position within it) instead of a sort
                si = tl.arange(0, SB)
                smask = si < S
                st = tl.load(slot_stamp_r + si, mask=smask, other=_I64_MAX, cache_modifier=".cg")
                spo = tl.load(slot_pos_r + si, mask=smask, other=-1)
                cand = smask & (st < s_new)
                emp = (cand & (spo < 0)).to(tl.int32)
                occ = cand & (spo >= 0)
                vic = (emp != 0) & (tl.cumsum(emp, 0) - emp < m)
                m2 = m - tl.sum(emp, axis=0)
                if m2 > 0:
                    lo = tl.min(tl.where(occ, st, _I64_MAX), axis=0)
                    hi = tl.max(tl.where(occ, st, -1), axis=0)
                    while lo < hi:  # smallest stamp tau with #(occ, stamp <= tau) >= m2
                        mid = lo + (hi - lo) // 2
                        ge = tl.sum((occ & (st <= mid)).to(tl.int32), axis=0) >= m2
                        hi = tl.where(ge, mid, hi)
                        lo = tl.where(ge, lo, mid + 1)
                    below = occ & (st < lo)
                    eq = occ & (st == lo)
                    r2 = m2 - tl.sum(below.to(tl.int32), axis=0)
                    plo = tl.min(tl.where(eq, spo, _I32_MAX), axis=0)
                    phi = tl.max(tl.where(eq, spo, -1), axis=0)
                    if tl.sum(eq.to(tl.int32), axis=0) <= r2:
                        plo = phi  # the whole tier goes
                    while plo < phi:  # smallest position with #(eq, position <= p) >= r2
                        mid = plo + (phi - plo) // 2
                        ge = tl.sum((eq & (spo <= mid)).to(tl.int32), axis=0) >= r2
                        phi = tl.where(ge, mid, phi)
                        plo = tl.where(ge, plo, mid + 1)
                    vic = vic | below | (eq & (spo <= plo))
                # P4: victims in ascending slot order; the one of rank i takes miss i
                nv = _list_victims(vic, si, m, scratch_ptr, K, phys_stride)
                tl.debug_barrier()  # the victim list is written before it is read
                npaired = _pair_listed(nv, m, s_new, rbase, base, scratch_ptr, K, phys_stride, S,
                                       slot_pos_r, slot_stamp_r, row_slot_ptr, stage_src_ptr,
                                       stage_dst_ptr, undo_vpos_ptr, undo_vstamp_ptr, bt_r, NB, B, HV,
                                       host_block_ptr, GQ * KB, ALIASED)
                if npaired != m:
                    # only with a corrupt state: unmark and drop the unpaired misses
                    tl.debug_barrier()
                    d = tl.load(stage_dst_ptr + base + goff, mask=gmask, other=-1)
                    unpaired = gmask & (d < -1)
                    urow = tl.load(stage_src_ptr + base + goff, mask=unpaired, other=-1)
                    urow_ok = unpaired & (urow >= 0) & (urow < HV)
                    tl.store(row_slot_ptr + urow, minus1_g, mask=urow_ok)
                    tl.store(stage_dst_ptr + base + goff, minus1_g, mask=unpaired)
                    tl.store(stage_src_ptr + base + goff, minus1_g, mask=unpaired)
                tl.debug_barrier()
                # the miss lanes' final slots (every duplicate included)
                fresh = tl.load(row_slot_ptr + grow, mask=gmiss, other=-1, cache_modifier=".cg")
                gslot = tl.where(gmiss, fresh, gslot)

            # P5: physical rows of every token of the group, from the tile
            v = ggood & (gslot >= 0) & (gslot <= S)
            ph = tl.where(v, rbase + gslot, -1)
            vi2 = v.to(tl.int32)
            cnt = tl.sum(vi2, axis=1)
            if COMPACT:
                ii = (gmask & (v == 0)).to(tl.int32)
                dest = tl.where(v, tl.cumsum(vi2, 1) - vi2, cnt[:, None] + tl.cumsum(ii, 1) - ii)
            else:
                dest = gk + gj * 0
            tl.store(phys_ptr + (t + gj).to(tl.int64) * phys_stride + dest, ph, mask=gmask)
            tl.store(valid_ptr + t + jj, cnt, mask=jj < n)
            if MISS_LISTS:
                # every miss lane of each token (duplicates included), compacted: the
                # miss side of a split decode attends over these rows once they landed
                mv = gmiss & v
                mi = mv.to(tl.int32)
                mdest = tl.cumsum(mi, 1) - mi
                mrow_off = (t + gj).to(tl.int64) * phys_stride + mdest
                tl.store(miss_phys_ptr + mrow_off, ph, mask=mv)
                tl.store(miss_host_ptr + mrow_off, grow.to(tl.int32), mask=mv)
                tl.store(miss_cnt_ptr + t + jj, tl.sum(mi, axis=1), mask=jj < n)
    else:
        p = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + kk, mask=kmask, other=-1)
        nbad = tl.sum((p != -1).to(tl.int32), axis=0)
        if not PREFETCH:
            tl.atomic_add(stats_ptr + STAT_INVALID, nbad.to(tl.int64))
        tl.store(stage_cnt_ptr + t, 0)
        if MISS_LISTS:
            tl.store(miss_cnt_ptr + t, 0)
        tl.store(phys_ptr + t.to(tl.int64) * phys_stride + kk, minus1_k, mask=kmask)
        tl.store(valid_ptr + t, 0)
        tl.store(stage_src_ptr + base + kk, minus1_k, mask=kmask)
        tl.store(stage_dst_ptr + base + kk, minus1_k, mask=kmask)
