"""Pure-torch reference of the decode resolve: the CPU path and the test oracle.

Semantics (the Triton kernel in ``hisparse.kernels.resolve`` implements the same):

Inputs: ``req_ids`` int32 [T] (request id per query token), ``topk`` int32 [T, K]
(request-local positions, -1 = padding). Tokens of one request are contiguous.

1. Groups. Token t is a *leader* when t == 0 or req_ids[t] != req_ids[t-1]. A
   leader's group is itself and the following tokens with the same id, at most
   ``max_query_len`` tokens. A token whose run offset is >= max_query_len (only
   possible when validation is off) is treated as all padding and its non -1
   entries are counted invalid. A leader whose request id already occurs at an
   earlier token of the batch (a second run of the same request, rejected in checked
   mode) is not resolved: all tokens of its group get physical -1 / valid count 0,
   their non -1 entries are counted in STAT_INVALID, and the request's state is
   untouched (so no two groups of one launch ever touch the same request's state).
2. Invalid entries: a token whose id is out of [0, max_request_id) or not live, and
   entries outside [0, seq_lens[layer, r]) other than -1, are treated as -1 and
   counted in STAT_INVALID (one per entry). Lengths are per layer: layer l accepts
   the positions appended to layer l, so a token can resolve rows written to its own
   layer in the same step even before the later layers have written theirs.
3. Per group (layer l, request slot r): step[l, r] += 1 (new step ``s``). The unique
   valid positions U of all tokens of the group are looked up in ``row_slot``. Hits:
   slot_stamp = s (STAT_HITS += |hits|). Misses M (ascending position, STAT_MISSES +=
   |M|) take
   the |M| smallest-key victims among slots 0..S-1 whose stamp < s (see ``state`` for
   the key); the i-th miss takes the i-th victim in ascending *slot* order. A victim's
   old row is unmapped; the miss is mapped, stamped s, and appended to the group's
   staging list stage_src/stage_dst[t0*K : t0*K + |M|] (the host row of the miss's
   row key, ``host_rows_of_keys`` -> flat hot row).
4. physical[t, k] = r * (S + 1) + slot of the entry's row, -1 for padding;
   valid_counts[t] = number of non-padding entries (duplicates count).
   With ``compact`` the valid entries of each row move to its front, in order.

5. A resident request (``state.resident[r]`` = 1, the elastic tier) has no LRU state:
   physical[t, k] = pool_base + page_table[r, p // PB] * PB + p % PB for each valid
   position p (an unmapped page makes the entry invalid), nothing is staged, its step
   does not move, and its valid entries are counted in STAT_RESIDENT (entries, not
   unique rows; with the resolve in STAT_RESOLVES; a prefetch counts nothing).

The Triton kernel pairs misses and victims the same way (the victim order needs no
sort on the GPU; the staging list in position order keeps a host block's rows
together for the copy), so both leave identical state and outputs.
"""

from __future__ import annotations

import torch

from .state import (STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_PREFETCH, STAT_RESIDENT, STAT_RESOLVES,
                    HotState, ResolveBuffers)


def group_offsets(ids: torch.Tensor, max_query_len: int) -> torch.Tensor:
    """Offset of each token within its run of equal ids, capped at ``max_query_len``.

    ids: int64 [T] (CPU or device). Returns int64 [T]; 0 = leader.
    """
    T = ids.numel()
    off = torch.zeros(T, dtype=torch.int64, device=ids.device)
    same = torch.ones(T, dtype=torch.bool, device=ids.device)
    for j in range(1, max_query_len + 1):
        prev = torch.full((T,), -(2**40), dtype=torch.int64, device=ids.device)
        if j < T:
            prev[j:] = ids[:-j]
        same = same & (prev == ids)
        off += same.long()
    return off


def _victim_order(stamp: torch.Tensor, pos: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Candidate slots (int64 [c]) in eviction order (see ``state``): the empty ones
    first, by slot, then the occupied ones by (stamp, position). stamp: int64 [S],
    pos: int32 [S] of the request's LRU slots."""
    empty = cand[pos[cand] < 0]
    occ = cand[pos[cand] >= 0]
    occ = occ[torch.argsort(pos[occ].long(), stable=True)]
    occ = occ[torch.argsort(stamp[occ], stable=True)]
    return torch.cat([torch.sort(empty).values, occ])


def resolve_groups(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
            max_query_len: int):
    """(rslot, off, ok, groups): request slot per token (-1 = not resolved), run offset,
    valid-lane mask and the resolved groups as (leader t0, slot r, tokens n)."""
    T, _ = topk.shape
    dev = topk.device
    ids = req_ids.long()
    id_ok = (ids >= 0) & (ids < state.id_to_slot.numel())
    rslot = torch.full((T,), -1, dtype=torch.int64, device=dev)
    rslot[id_ok] = state.id_to_slot[ids[id_ok]].long()
    off = group_offsets(ids, max_query_len)
    rslot = torch.where(off < max_query_len, rslot, torch.full_like(rslot, -1))
    # a run of a request that already occurred earlier in the batch is not resolved
    seen: set[int] = set()
    dup = [False] * T
    lead_dup = False
    for t, (rid, o) in enumerate(zip(ids.tolist(), off.tolist())):
        if o == 0:
            lead_dup = rid in seen
        dup[t] = lead_dup
        seen.add(rid)
    if any(dup):
        rslot[torch.tensor(dup, device=dev)] = -1
    pos = topk.long()
    seq = torch.zeros(T, dtype=torch.int64, device=dev)
    live = rslot >= 0
    seq[live] = state.seq_lens[layer, rslot[live]].long()
    ok = (pos >= 0) & (pos < seq[:, None])
    groups = []
    for t0 in torch.nonzero((off == 0) & live).flatten().tolist():
        n = 1
        while t0 + n < T and int(off[t0 + n]) == n:
            n += 1
        groups.append((t0, int(rslot[t0]), n))
    return rslot, off, ok, groups


def resident_rows(state: HotState, r: int, pos: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """int64 flat device rows (-1 where not ``ok`` or the page is unmapped) of positions
    ``pos`` (int64, any shape) of resident request slot r."""
    PB = state.PB
    pt = state.page_table[r].long()
    MP = pt.numel()
    safe = torch.where(ok, pos, torch.zeros_like(pos))
    pg = safe // PB
    okp = ok & (pg < MP)
    page = torch.where(okp, pt[torch.where(okp, pg, torch.zeros_like(pg))], torch.full_like(pg, -1))
    good = okp & (page >= 0) & (page < state.pool_pages)
    return torch.where(good, state.pool_base + page * PB + safe % PB, torch.full_like(pos, -1))


def _stamp_hits(state: HotState, layer: int, r: int, s_new: int, g_pos: torch.Tensor, g_ok: torch.Tensor,
                undo: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Stamp the group's hit slots with s_new; fill ``undo`` (int64 [n * K], the group's
    slice) with each hit lane's old stamp (first occurrence, row-major; s_new for the
    repeats; -2 for other lanes). Returns (lane slots int64 [n, K] (-1 = not hot), unique hits)."""
    B = state.B
    dev = g_pos.device
    bt = state.block_table[r].long()
    row_slot = state.row_slot[layer]
    stamp = state.slot_stamp[layer, r]
    safe = torch.where(g_ok, g_pos, torch.zeros_like(g_pos))
    lane_slot = torch.where(g_ok, row_slot[bt[safe // B] * B + safe % B].long(), torch.full_like(g_pos, -1))
    lane_hit = lane_slot >= 0
    flat_pos = torch.where(lane_hit, g_pos, torch.full_like(g_pos, -1)).flatten()
    vals, inv = torch.unique(flat_pos, return_inverse=True)
    lane = torch.arange(flat_pos.numel(), device=dev)
    first_lane = torch.full((vals.numel(),), flat_pos.numel(), dtype=torch.int64, device=dev)
    first_lane = first_lane.scatter_reduce(0, inv, lane, reduce="amin")
    first = torch.zeros_like(flat_pos, dtype=torch.bool)
    first[first_lane] = True
    first &= flat_pos >= 0
    lane_old = stamp[torch.where(lane_hit, lane_slot, 0)].flatten()
    u = torch.where(first, lane_old, torch.full_like(lane_old, s_new))
    undo.copy_(torch.where(lane_hit.flatten(), u, torch.full_like(u, -2)))
    nhit = int(first.sum())
    stamp[lane_slot[lane_hit]] = s_new
    return lane_slot, nhit


def resolve_lookup_reference(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                             hit: torch.Tensor, undo_hit: torch.Tensor, *, max_query_len: int) -> None:
    """The hit phase of a split resolve (``kernels.resolve_lookup.resolve_lookup_kernel``).

    hit: int32 [>= T, >= K] output (flat hot row of each hit entry, -1 otherwise);
    undo_hit: int64 [>= T * K]. Stamps the hits with step + 1 and counts unique hits and
    the invalid entries of resolved tokens; changes no mapping and no step.
    """
    T, K = topk.shape
    SP = state.S + 1
    hit[:T, :K] = -1
    if T == 0:
        return
    rslot, _off, ok, groups = resolve_groups(state, layer, req_ids, topk, max_query_len)
    live = rslot >= 0
    state.stats[layer, STAT_INVALID] += ((topk.long() != -1) & ~ok & live[:, None]).sum()
    pos = topk.long()
    for t0, r, n in groups:
        if state.pool_pages and int(state.resident[r]):
            g_ok = ok[t0:t0 + n]
            rows = resident_rows(state, r, pos[t0:t0 + n], g_ok)
            state.stats[layer, STAT_INVALID] += (g_ok & (rows < 0)).sum()  # an unmapped page
            undo_hit[t0 * K:(t0 + n) * K] = -2
            state.stats[layer, STAT_RESIDENT] += (rows >= 0).sum()
            hit[t0:t0 + n, :K] = rows.to(torch.int32)
            continue
        s_new = int(state.step[layer, r]) + 1
        lane_slot, nhit = _stamp_hits(state, layer, r, s_new, pos[t0:t0 + n], ok[t0:t0 + n],
                                      undo_hit[t0 * K:(t0 + n) * K])
        state.stats[layer, STAT_HITS] += nhit
        hit[t0:t0 + n, :K] = torch.where(lane_slot >= 0, r * SP + lane_slot, torch.full_like(lane_slot, -1)).to(torch.int32)


def resolve_reference(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                      out: ResolveBuffers, *, max_query_len: int, compact: bool = False,
                      stamped: bool = False, miss_lists: tuple | None = None,
                      prefetch: bool = False) -> None:
    """Resolve logical top-k into physical hot rows, updating ``state`` in place.

    req_ids: int32 [T]; topk: int32 [T, K] (-1 = padding); ``out`` buffers of
    capacity >= [T, K] (only the first T rows / T*K entries are written).
    ``stamped``: the hits were already stamped and counted (the miss phase of a split
    resolve, after ``resolve_lookup_reference``). ``miss_lists``: (miss_phys int32
    [T, K], miss_host int32 [T, K] (row keys), miss_counts int32 [T]) receive each
    token's miss entries, compacted. ``prefetch``: only the misses are counted, as STAT_PREFETCH.
    """
    T, K = topk.shape
    S, B = state.S, state.B
    SP = S + 1
    dev = topk.device
    out.stage_src[: T * K].fill_(-1)
    out.stage_dst[: T * K].fill_(-1)
    out.stage_counts[:T] = 0
    if not stamped:
        out.undo_hit[: T * K].fill_(-2)
    if miss_lists is not None:
        miss_lists[2][:T] = 0
    if T == 0:
        return
    rslot, _off, ok, groups = resolve_groups(state, layer, req_ids, topk, max_query_len)
    pos = topk.long()
    live = rslot >= 0
    bad = (pos != -1) & ~ok
    if not prefetch:
        state.stats[layer, STAT_INVALID] += (bad & ~live[:, None]).sum() if stamped else bad.sum()

    row_slot = state.row_slot[layer]  # int32 [HV], by row key
    phys = torch.full((T, K), -1, dtype=torch.int64, device=dev)
    miss_lane = torch.zeros((T, K), dtype=torch.bool, device=dev)
    for t0, r, n in groups:
        g_pos, g_ok = pos[t0:t0 + n], ok[t0:t0 + n]
        if state.pool_pages and int(state.resident[r]):
            rows = resident_rows(state, r, g_pos, g_ok)
            phys[t0:t0 + n] = rows
            if not prefetch:
                state.stats[layer, STAT_RESOLVES] += 1
                if not stamped:
                    state.stats[layer, STAT_INVALID] += (g_ok & (rows < 0)).sum()
                    state.stats[layer, STAT_RESIDENT] += (rows >= 0).sum()
            if miss_lists is not None:
                miss_lists[2][t0:t0 + n] = 0
            continue
        stamp = state.slot_stamp[layer, r]
        spos = state.slot_pos[layer, r]
        bt = state.block_table[r].long()
        s_new = int(state.step[layer, r]) + 1
        if stamped:
            safe = torch.where(g_ok, g_pos, torch.zeros_like(g_pos))
            lane_slot = torch.where(g_ok, row_slot[bt[safe // B] * B + safe % B].long(),
                                    torch.full_like(g_pos, -1))
            nhit = 0
        else:
            lane_slot, nhit = _stamp_hits(state, layer, r, s_new, g_pos, g_ok, out.undo_hit[t0 * K:(t0 + n) * K])
        miss_lane[t0:t0 + n] = g_ok & (lane_slot < 0)
        state.step[layer, r] = s_new
        uniq = torch.unique(g_pos[g_ok & (lane_slot < 0)])  # the missed positions, ascending
        miss_rows = bt[uniq // B] * B + uniq % B
        m = uniq.numel()
        out.stage_counts[t0] = m
        if prefetch:
            state.stats[layer, STAT_PREFETCH] += m
        else:
            state.stats[layer, STAT_RESOLVES] += 1
            state.stats[layer, STAT_HITS] += nhit
            state.stats[layer, STAT_MISSES] += m
        if m:
            cand = torch.nonzero(stamp[:S] < s_new).flatten()
            if cand.numel() < m:
                raise RuntimeError(
                    f"resolve: layer {layer} request slot {r} needs {m} victims but only "
                    f"{cand.numel()} slots are evictable (S={S}); config invariant broken"
                )
            victims = torch.sort(_victim_order(stamp[:S], spos[:S], cand)[:m]).values  # ascending slot
            old = spos[victims].long()
            base = t0 * K
            out.undo_vpos[base:base + m] = spos[victims]
            out.undo_vstamp[base:base + m] = stamp[victims]
            had = old >= 0
            row_slot[bt[old[had] // B] * B + old[had] % B] = -1
            spos[victims] = uniq.to(torch.int32)
            stamp[victims] = s_new
            row_slot[miss_rows] = victims.to(torch.int32)
            out.stage_src[base:base + m] = host_rows_of_keys(
                miss_rows, state.host_block if state.aliased else None, B).to(torch.int32)
            out.stage_dst[base:base + m] = (r * SP + victims).to(torch.int32)

        safe = torch.where(g_ok, g_pos, torch.zeros_like(g_pos))
        g_rows = bt[safe // B] * B + safe % B
        g_phys = r * SP + row_slot[g_rows].long()
        phys[t0:t0 + n] = torch.where(g_ok, g_phys, torch.full_like(g_phys, -1))
        if miss_lists is not None:
            mp, mh, mc = miss_lists
            for j in range(n):
                lanes = miss_lane[t0 + j]
                cnt = int(lanes.sum())
                mp[t0 + j, :cnt] = g_phys[j][lanes].to(torch.int32)
                mh[t0 + j, :cnt] = g_rows[j][lanes].to(torch.int32)
                mc[t0 + j] = cnt

    valid = phys >= 0
    out.valid_counts[:T] = valid.sum(dim=1).to(torch.int32)
    if compact:
        # stable: valid entries first, in their original order
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        phys = torch.gather(phys, 1, order)
    out.physical[:T, :K] = phys.to(torch.int32)


def host_rows_of_keys(keys: torch.Tensor, host_block: torch.Tensor | None, B: int) -> torch.Tensor:
    """Host rows (int64, ``keys``' shape) of row keys ``keys`` (any integer tensor, -1 =
    none): ``host_block[key // B] * B + key % B``, -1 for -1, for a key past the NV
    block ids of ``host_block`` (int32 [NV]) or an unmapped id. ``host_block`` None:
    the identity (the keys, int64)."""
    k = keys.long()
    if host_block is None:
        return k
    hb = host_block.to(k.device).long()
    ok = (k >= 0) & (k < hb.numel() * B)
    safe = torch.where(ok, k, torch.zeros_like(k))
    blk = hb[safe // B]
    return torch.where(ok & (blk >= 0), blk * B + safe % B, torch.full_like(k, -1))


def copy_staged_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
                          counts: torch.Tensor, *, K: int) -> int:
    """``transfer.copy_staged``'s semantics: the first counts[t] entries of each group's
    list, t * K on (a group of q tokens has up to q * K). Returns the number of rows
    copied."""
    n = 0
    T = counts.shape[0]
    for t, m in enumerate(counts.tolist()):
        m = max(0, min(int(m), (T - t) * K))
        if m:
            n += copy_rows_reference(src, src_idx[t * K:t * K + m], dst, dst_idx[t * K:t * K + m])
    return n


def copy_rows_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                        dst_idx: torch.Tensor) -> int:
    """dst[dst_idx[i]] = src[src_idx[i]] for every i with both indices >= 0.

    src: uint8 [Ns, W]; dst: uint8 [Nd, W]; src_idx/dst_idx: int32 [N], -1 = skip.
    Returns the number of rows copied.
    """
    sel = (src_idx >= 0) & (dst_idx >= 0)
    s = src_idx[sel].long()
    d = dst_idx[sel].long()
    if s.numel():
        dst[d.to(dst.device)] = src[s.to(src.device)].to(dst.device)
    return int(s.numel())


def resolve_resident_reference(state: HotState, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                               out: ResolveBuffers, *, max_query_len: int, compact: bool = False) -> None:
    """The resolve of a batch whose live requests are all resident
    (``kernels.resolve_resident``): rule 5 above for every resolved group, no LRU
    state read or changed. A live request that is not resident resolves to -1 with its
    non-padding entries counted invalid. Writes ``out``'s physical, valid counts and
    empty staging lists; counts STAT_RESIDENT, STAT_INVALID and STAT_RESOLVES.

    req_ids: int32 [T]; topk: int32 [T, K] (-1 = padding); ``out`` of capacity >= [T, K].
    """
    T, K = topk.shape
    out.stage_src[: T * K].fill_(-1)
    out.stage_dst[: T * K].fill_(-1)
    out.stage_counts[:T] = 0
    if T == 0:
        return
    rslot, _off, ok, groups = resolve_groups(state, layer, req_ids, topk, max_query_len)
    pos = topk.long()
    phys = torch.full((T, K), -1, dtype=torch.int64, device=topk.device)
    for t0, r, n in groups:
        if state.pool_pages and int(state.resident[r]):
            phys[t0:t0 + n] = resident_rows(state, r, pos[t0:t0 + n], ok[t0:t0 + n])
        state.stats[layer, STAT_RESOLVES] += 1
    valid = phys >= 0
    state.stats[layer, STAT_INVALID] += ((pos != -1) & ~valid).sum()
    state.stats[layer, STAT_RESIDENT] += valid.sum()
    out.valid_counts[:T] = valid.sum(dim=1).to(torch.int32)
    if compact:
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        phys = torch.gather(phys, 1, order)
    out.physical[:T, :K] = phys.to(torch.int32)
