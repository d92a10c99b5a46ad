"""Invariant checks of a HiSparseCache, reusable by test files and by the stress tool:

- :func:`check_cache` checks structural invariants (slot maps mutually consistent,
  hot bytes equal host bytes for every mapped slot, block accounting, clean free
  slots) and, given a sim (``lru_sim.LRUSim``), the exact slot contents, stamps, steps
  and counters.
- :func:`check_result` checks one resolve result: every physical index points at a
  slot that holds that (request, layer, position) now (so nothing referenced this step
  was evicted) and whose bytes equal ``read_host_rows``; padding and invalid -> -1.
- :func:`snapshot` / :func:`assert_same`: everything a failed call must leave unchanged.

The elastic device tier (``HiSparseConfig(device_pool_rows=...)``): ``check_cache``
checks the tier's structure (page table = the pool's pages, disjoint, page bytes =
host bytes, no LRU state of a resident request) and, with a sim, residency, pages and
the tier counters. :mod:`trace_runner` drives a cache and a sim with random ops and
runs these checks after every op.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from hisparse.cache.state import (STAT_D2H_ROWS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_PREFETCH,
                                  STAT_RESIDENT, STAT_RESOLVES)
from lru_sim import LRUSim


# ----------------------------------------------------------------------- checker
def _fail(msg: str) -> None:
    raise AssertionError(msg)


def _cpu_state(cache) -> dict[str, torch.Tensor]:
    if cache.cuda:
        torch.cuda.synchronize(cache.device)
    st = cache.state
    return {k: getattr(st, k).cpu() for k in
            ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot",
             "step", "stats", "resident", "page_table")}


def check_cache(cache, sim: LRUSim | None = None,
                truth: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
    """Structural invariants; with ``sim`` also exact LRU contents and counters;
    with ``truth`` ((req_id, layer) -> uint8 [n, row_bytes] rows appended) host bytes."""
    cfg, S, SP, B = cache.cfg, cache.cfg.device_buffer_size, cache.cfg.slots_per_req, cache.pool.B
    L, R = cfg.num_layers, cfg.max_num_reqs
    st = _cpu_state(cache)
    hot = cache.hot.cpu()
    pool = cache.pool.rows
    live = {rid: cache.request(rid).slot for rid in cache.live_requests()}
    slots_live = set(live.values())
    if len(slots_live) != len(live):
        _fail(f"two live ids share a request slot: {live}")
    # id map
    ids_mapped = torch.nonzero(st["id_to_slot"] >= 0).flatten().tolist()
    if sorted(ids_mapped) != sorted(live):
        _fail(f"id_to_slot maps {sorted(ids_mapped)}, live ids are {sorted(live)}")
    for rid, r in live.items():
        if int(st["id_to_slot"][rid]) != r:
            _fail(f"id_to_slot[{rid}]={int(st['id_to_slot'][rid])}, expected {r}")
    # blocks
    alloc = cache.pool.allocator
    all_blocks: list[int] = []
    for rid, r in live.items():
        blocks = alloc.blocks(r)
        all_blocks += blocks
        bt = st["block_table"][r].tolist()
        if bt[:len(blocks)] != blocks or any(b != -1 for b in bt[len(blocks):]):
            _fail(f"block_table[{r}]={bt} but allocator holds {blocks}")
        lens = list(cache.request(rid).lengths)
        if st["seq_lens"][:, r].tolist() != lens:
            _fail(f"seq_lens[:, {r}]={st['seq_lens'][:, r].tolist()}, layer lengths {lens}")
        if max(lens) > len(blocks) * B or len(blocks) > -(-max(lens) // B):
            _fail(f"request {rid}: {len(blocks)} blocks for layer lengths {lens}")
    if len(set(all_blocks)) != len(all_blocks) or alloc.num_used != len(all_blocks):
        _fail(f"blocks not disjoint or leaked: used {alloc.num_used}, owned {all_blocks}")
    w = cache.writer  # its host copy of the block table
    for r in range(R):
        want = alloc.blocks(r) if r in slots_live else []
        row = w.host_blocks[r].tolist()
        if int(w.num_blocks[r]) != len(want) or row[:len(want)] != want or any(b != -1 for b in row[len(want):]):
            _fail(f"writer's host block table of slot {r}: {int(w.num_blocks[r])} blocks {row[:len(want) + 2]}..., "
                  f"allocator holds {want}")
    for r in range(R):
        if r in slots_live:
            continue
        if ((st["seq_lens"][:, r] != 0).any() or (st["block_table"][r] != -1).any()
                or (st["slot_pos"][:, r] != -1).any() or (st["slot_stamp"][:, r] != -1).any()
                or (st["step"][:, r] != 0).any() or int(st["resident"][r]) != 0
                or (st["page_table"][r] != -1).any()):
            _fail(f"free request slot {r} holds stale state")
    # slot maps, both directions, and hot bytes
    row_owner: dict[int, tuple[int, int]] = {}  # host row -> (slot r, position)
    for rid, r in live.items():
        for i, b in enumerate(alloc.blocks(r)):
            for j in range(B):
                row_owner[b * B + j] = (r, i * B + j)
    for l in range(L):
        rs = st["row_slot"][l]
        for h in torch.nonzero(rs >= 0).flatten().tolist():
            s = int(rs[h])
            if h not in row_owner:
                _fail(f"row_slot[{l}, {h}]={s} but host row {h} belongs to no live request")
            r, p = row_owner[h]
            if not 0 <= s <= S or int(st["slot_pos"][l, r, s]) != p:
                _fail(f"row_slot[{l}, {h}]={s} (req slot {r}, pos {p}) but slot_pos holds "
                      f"{int(st['slot_pos'][l, r, s]) if 0 <= s <= S else 'n/a'}")
        for rid, r in live.items():
            n_l = cache.request(rid).lengths[l]
            blocks = alloc.blocks(r)
            for s in range(SP):
                p = int(st["slot_pos"][l, r, s])
                stamp = int(st["slot_stamp"][l, r, s])
                if (p < 0) != (stamp < 0):
                    _fail(f"slot ({l}, {r}, {s}): position {p} with stamp {stamp}")
                if p < 0:
                    continue
                if p >= n_l:
                    _fail(f"slot ({l}, {r}, {s}) holds position {p} >= layer length {n_l}")
                if stamp > int(st["step"][l, r]):
                    _fail(f"slot ({l}, {r}, {s}) stamp {stamp} > step {int(st['step'][l, r])}")
                h = blocks[p // B] * B + p % B
                if int(st["row_slot"][l, h]) != s:
                    _fail(f"slot ({l}, {r}, {s}) holds pos {p} but row_slot[{l}, {h}]="
                          f"{int(st['row_slot'][l, h])}")
                if not torch.equal(hot[l, r * SP + s], pool[l, h]):
                    _fail(f"hot row ({l}, {r}, {s}) bytes differ from host row of pos {p}")
            if truth is not None:
                want = truth.get((rid, l))
                n_t = 0 if want is None else want.shape[0]
                if n_t != n_l:
                    _fail(f"truth has {n_t} rows for ({rid}, {l}), cache {n_l}")
                if n_l and not torch.equal(cache.read_host_rows(l, rid, list(range(n_l))), want):
                    _fail(f"host rows of request {rid} layer {l} differ from what was appended")
    _check_tier(cache, st, hot, live)
    if sim is not None:
        _check_sim(cache, sim, st, live)


def _check_tier(cache, st: dict[str, torch.Tensor], hot: torch.Tensor, live: dict[int, int]) -> None:
    """The elastic tier's structure: the pool's pages (free + owned = all, disjoint),
    each live request either resident (flag 1, page table = its pages then -1, pages
    covering every layer's length, no slot state, none of its host rows hot, page rows'
    bytes = host rows) or hot (flag 0, page table all -1); the padding rows between
    the hot buffers and the pages stay zero; the stats' tier figures agree."""
    cfg = cache.cfg
    dp = getattr(cache, "dpool", None)
    R, SP, B = cfg.max_num_reqs, cfg.slots_per_req, cache.pool.B
    base = cfg.hot_rows_per_layer
    if hot.shape[1] != cfg.device_rows_per_layer:
        _fail(f"hot has {hot.shape[1]} rows per layer, config says {cfg.device_rows_per_layer}")
    if (hot[:, R * SP:base] != 0).any():
        _fail("the padding rows after the hot buffers are not zero")
    if dp is None:
        return
    PB = dp.PB
    owned = {r: list(dp.pages(r)) for r in dp.resident_slots()}
    free = list(dp._free)
    held = collections.Counter(p for ps in owned.values() for p in ps)
    if any(len(set(ps)) != len(ps) for ps in owned.values()):
        _fail(f"a request holds a page twice: {owned}")
    if sorted(free + list(held)) != list(range(dp.num_pages)):
        _fail(f"pool pages: free {sorted(free)} + held {sorted(held)} != the {dp.num_pages} pages")
    if dp.refs.tolist() != [held.get(p, 0) for p in range(dp.num_pages)]:
        _fail(f"page references {dp.refs.tolist()}, held {dict(held)}")
    if dp.num_shared != sum(n > 1 for n in held.values()):
        _fail(f"num_shared {dp.num_shared}, pages held more than once {sum(n > 1 for n in held.values())}")
    at = {}  # a shared page holds the same positions in every request that holds it
    for r, ps in owned.items():
        for i, p in enumerate(ps):
            if at.setdefault(p, i) != i:
                _fail(f"page {p} is logical page {i} of slot {r} but {at[p]} of another")
    if dp.num_pages != cfg.pool_pages:
        _fail(f"pool has {dp.num_pages} pages, config {cfg.pool_pages}")
    if set(owned) - set(live.values()):
        _fail(f"pages held by request slots {sorted(set(owned) - set(live.values()))} that are not live")
    for r in range(R):  # the pool's arrays: the same pages
        pages = owned.get(r)
        want = (-1, []) if pages is None else (len(pages), pages)
        got = (int(dp.npages[r]), dp.page_of[r, :max(0, int(dp.npages[r]))].tolist())
        rest = dp.page_of[r, max(0, int(dp.npages[r])):]
        if got != want or (rest != -1).any():
            _fail(f"the pool's arrays of slot {r}: {got}, its pages {want}")
    MP = st["page_table"].shape[1]
    for rid, r in live.items():
        pt = st["page_table"][r].tolist()
        flag = int(st["resident"][r])
        if (cache.residency(rid) == "resident") != (r in owned):
            _fail(f"residency({rid}) is {cache.residency(rid)}, the pool says {r in owned}")
        if r not in owned:
            if flag != 0 or any(x != -1 for x in pt):
                _fail(f"hot request {rid}: resident flag {flag}, page table {pt}")
            continue
        pages = owned[r]
        if flag != 1:
            _fail(f"resident request {rid}: resident flag {flag}")
        if pt != pages + [-1] * (MP - len(pages)):
            _fail(f"resident request {rid}: page table {pt}, pool pages {pages}")
        lens = list(cache.request(rid).lengths)
        if len(pages) * PB < max(lens) or len(pages) > cfg.max_pages_per_request:
            _fail(f"resident request {rid}: {len(pages)} pages for lengths {lens} "
                  f"(at most {cfg.max_pages_per_request})")
        if (st["slot_pos"][:, r] != -1).any() or (st["slot_stamp"][:, r] != -1).any():
            _fail(f"resident request {rid} has LRU slot state")
        blocks = cache.pool.allocator.blocks(r)
        rows = [b * B + j for b in blocks for j in range(B)]
        if rows and (st["row_slot"][:, rows] != -1).any():
            _fail(f"resident request {rid} has host rows mapped in row_slot")
        for l, n in enumerate(lens):
            if not n:
                continue
            phys = torch.tensor([base + pages[p // PB] * PB + p % PB for p in range(n)])
            host = cache.read_host_rows(l, rid, list(range(n)))
            if not torch.equal(hot[l, phys], host):
                bad = [p for p in range(n) if not torch.equal(hot[l, int(phys[p])], host[p])]
                _fail(f"resident request {rid} layer {l}: page rows of positions {bad[:8]} differ from host")


def _check_sim(cache, sim: LRUSim, st: dict[str, torch.Tensor], live: dict[int, int]) -> None:
    S = cache.cfg.device_buffer_size
    if sorted(sim.reqs) != sorted(live):
        _fail(f"sim live {sorted(sim.reqs)} != cache live {sorted(live)}")
    for l in range(cache.cfg.num_layers):
        got = st["stats"][l].tolist()
        want = {STAT_HITS: sim.hits[l], STAT_MISSES: sim.misses[l],
                STAT_INVALID: sim.invalid[l], STAT_RESOLVES: sim.resolves[l],
                STAT_D2H_ROWS: sim.rows_written[l], STAT_RESIDENT: sim.resident_rows[l],
                STAT_PREFETCH: sim.prefetch_rows[l]}
        for k, v in want.items():
            if got[k] != v:
                _fail(f"layer {l} stat {k}: cache {got[k]}, sim {v} (all: {got})")
        for rid, r in live.items():
            q = sim.reqs[rid]
            if cache.request(rid).lengths[l] != q.lens[l]:
                _fail(f"({l}, {rid}) length cache {cache.request(rid).lengths[l]} sim {q.lens[l]}")
            if int(st["step"][l, r]) != q.step[l]:
                _fail(f"({l}, {rid}) step cache {int(st['step'][l, r])} sim {q.step[l]}")
            pos, stamp = st["slot_pos"][l, r].tolist(), st["slot_stamp"][l, r].tolist()
            got_hot = {p: s for p, s in zip(pos[:S], stamp[:S]) if p >= 0}
            if got_hot != dict(q.hot[l]):
                _fail(f"({l}, {rid}) LRU slots cache {sorted(got_hot.items())} "
                      f"sim {sorted(q.hot[l].items())}")
            if (pos[S], stamp[S]) != q.reserved[l]:
                _fail(f"({l}, {rid}) reserved slot cache {(pos[S], stamp[S])} sim {q.reserved[l]}")
    dp = getattr(cache, "dpool", None)
    if dp is None:
        return
    for rid, r in live.items():
        q = sim.reqs[rid]
        got = list(dp.pages(r)) if dp.is_resident(r) else None
        if got != q.pages:
            _fail(f"request {rid}: pool pages {got}, sim {q.pages} (None = hot)")
    if (dp.spills, dp.seeded_rows, dp.promotions) != (sim.spills, sim.seeded_rows, 0):
        _fail(f"tier counters (spills, seeded_rows, promotions) cache {(dp.spills, dp.seeded_rows, dp.promotions)}"
              f" sim {(sim.spills, sim.seeded_rows, 0)}")


def check_result(cache, layer: int, req_ids: list[int], topk: list[list[int]], res,
                 sim: LRUSim | None = None, *, compact: bool = False) -> None:
    """One resolve result against the cache state right after it (see module doc).

    ``sim``: the simulation *after* the same resolve (decides entry validity); without
    it every non-(-1) entry must be valid.
    """
    SP = cache.cfg.slots_per_req
    st = _cpu_state(cache)
    hot_l = cache.hot[layer].cpu()
    phys = (res if isinstance(res, torch.Tensor) else res.physical).cpu().tolist()
    vc = None if isinstance(res, torch.Tensor) else res.valid_counts.cpu().tolist()
    if sim is not None:
        valid = sim.entry_valid(layer, req_ids, topk)
    else:
        valid = [[p != -1 for p in row] for row in topk]
    for t, row in enumerate(topk):
        want_pos = [p for k, p in enumerate(row) if valid[t][k]]
        if vc is not None and vc[t] != len(want_pos):
            _fail(f"valid_counts[{t}]={vc[t]}, expected {len(want_pos)}")
        if compact:
            got_idx = phys[t][:len(want_pos)]
            if any(x != -1 for x in phys[t][len(want_pos):]):
                _fail(f"compact row {t} has entries after its {len(want_pos)} valid ones")
        else:
            got_idx = [x for k, x in enumerate(phys[t]) if valid[t][k]]
            bad = [k for k in range(len(row)) if not valid[t][k] and phys[t][k] != -1]
            if bad:
                _fail(f"token {t}: padding/invalid entries {bad} map to {phys[t]}")
        if not want_pos:
            continue
        rid = req_ids[t]
        r = cache.request(rid).slot
        host = cache.read_host_rows(layer, rid, want_pos)
        if int(st["resident"][r]):  # through the page table, into the pool's pages
            base, PB = cache.cfg.hot_rows_per_layer, 64
            pt = st["page_table"][r].tolist()
            for i, (p, x) in enumerate(zip(want_pos, got_idx)):
                if x != base + pt[p // PB] * PB + p % PB:
                    _fail(f"token {t} pos {p} of resident request {rid}: physical {x}, page table {pt}")
                if not torch.equal(hot_l[x], host[i]):
                    _fail(f"token {t} pos {p}: resident row {x} bytes differ from host")
            continue
        for i, (p, x) in enumerate(zip(want_pos, got_idx)):
            if not r * SP <= x < (r + 1) * SP:
                _fail(f"token {t} pos {p}: physical {x} outside request slot {r}")
            s = x - r * SP
            if int(st["slot_pos"][layer, r, s]) != p:
                _fail(f"token {t} pos {p}: slot {s} now holds {int(st['slot_pos'][layer, r, s])}"
                      " (evicted in the step that referenced it)")
            if not torch.equal(hot_l[x], host[i]):
                _fail(f"token {t} pos {p}: hot row {x} bytes differ from host")


# ------------------------------------------------------------------- snapshots
def snapshot(cache) -> dict[str, Any]:
    """Everything a failed call must leave unchanged (CPU copies)."""
    snap: dict[str, Any] = {k: v.clone() for k, v in _cpu_state(cache).items()}
    snap["hot"] = cache.hot.cpu().clone()
    snap["pool"] = cache.pool.rows.clone()
    alloc = cache.pool.allocator
    snap["alloc"] = (alloc.num_free, {o: alloc.blocks(o) for o in alloc.owners()})
    snap["live"] = {rid: (cache.request(rid).slot,
                          list(cache.request(rid).lengths))
                    for rid in cache.live_requests()}
    snap["reserved"] = {rid: list(cache.requests.reserved_list(cache.request(rid).slot))
                        for rid in cache.live_requests()}
    snap["host_blocks"] = torch.from_numpy(cache.writer.host_blocks.copy())
    snap["num_blocks"] = torch.from_numpy(cache.writer.num_blocks.copy())
    dp = getattr(cache, "dpool", None)
    if dp is not None:  # the elastic tier's host side
        snap["dpool"] = (sorted(dp._free), {r: list(dp.pages(r)) for r in dp.resident_slots()},
                         dp.spills, dp.promotions, dp.seeded_rows, dp.epoch, dp.refs.tolist(), dp.shared_joins)
    return snap


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        if not same:
            _fail(f"state '{k}' changed by a call that should have changed nothing")


__all__ = ["check_cache", "check_result", "snapshot", "assert_same"]
