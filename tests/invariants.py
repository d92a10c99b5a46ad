"""Invariant checker + independent exact-LRU simulation of a HiSparseCache.

Reusable by test files and by the stress tool:

- :class:`LRUSim` models the cache's policy on plain Python dicts, written from
  DESIGN.md / the ``state`` and ``resolve_ref`` docstrings, not from the resolver code:
  per (layer, request) an ordered dict ``position -> stamp`` for the S LRU slots plus
  the reserved newest-token slot; victims are empty slots first, then the oldest stamp,
  ties by the smallest position; slots hit this step are never victims.
- :func:`check_cache` checks structural invariants (slot maps mutually consistent,
  hot bytes equal host bytes for every mapped slot, block accounting, clean free
  slots) and, given a sim, the exact slot contents, stamps, steps and counters.
- :func:`check_result` checks one resolve result: every physical index points at a
  slot that holds that (request, layer, position) now (so nothing referenced this step
  was evicted) and whose bytes equal ``read_host_rows``; padding and invalid -> -1.
- :class:`TraceRunner` drives a cache and a sim side by side with random ops and runs
  both checkers after every op.

The elastic device tier (``HiSparseConfig(device_pool_rows=...)``): the sim models it
when built with ``pool_pages`` > 0 (:meth:`LRUSim.for_cache` does that from a cache's
config): a request joins *resident* (no LRU state, its rows in pages of ``PB`` rows,
resolves counted as resident entries, no step), a write that needs pages the pool
lacks demotes resident requests (a request needing more than ``max_pages`` pages
first, then the one holding the most pages, ties lowest request slot, among those
holding pages or written) and seeds each
demoted layer's hot buffer with its newest S + 1 positions (all of them, slot =
position, when it holds at most S), stamped with the layer's step; granted pages are
the lowest free ones, in batch order. ``check_cache`` checks the tier's structure
(page table = the pool's pages, disjoint, page bytes = host bytes, no LRU state of a
resident request) and, with a sim, residency, pages and the tier counters.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import torch

from hisparse import CapacityError
from hisparse.cache.state import (STAT_D2H_ROWS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_PREFETCH,
                                  STAT_RESIDENT, STAT_RESOLVES)


# --------------------------------------------------------------------------- sim
class _Req:
    def __init__(self, L: int) -> None:
        self.lens = [0] * L
        self.hot: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(L)]
        self.reserved: list[tuple[int, int]] = [(-1, -1)] * L  # (position, stamp)
        self.step = [0] * L
        self.slot = -1  # request slot (the tier's tie-break), when the caller gave it
        self.pages: list[int] | None = None  # resident: its pool pages; None: hot


class LRUSim:
    """Exact-LRU model of the cache (see module docstring). Counters are cumulative."""

    def __init__(self, *, num_layers: int, S: int, max_query_len: int,
                 max_request_id: int, pool_pages: int = 0, max_pages: int = 0, PB: int = 64,
                 pool_base: int = 0) -> None:
        self.L, self.S, self.q, self.max_id = num_layers, S, max_query_len, max_request_id
        self.reqs: dict[int, _Req] = {}
        self.hits = [0] * num_layers
        self.misses = [0] * num_layers
        self.invalid = [0] * num_layers
        self.resolves = [0] * num_layers
        self.rows_written = [0] * num_layers
        self.resident_rows = [0] * num_layers
        self.prefetch_rows = [0] * num_layers
        # the elastic tier (pool_pages = 0: every request hot, as without the tier)
        self.pool_pages, self.max_pages, self.PB = pool_pages, max_pages, PB
        self.free_pages: set[int] = set(range(pool_pages))
        self.pool_base = pool_base
        # per layer, the page rows its last resolve returned (what a demotion seeds first)
        self.last_rows: list[set[int]] = [set() for _ in range(num_layers)]
        self.spills = 0
        self.seeded_rows = 0
        self.demoted: list[int] = []  # ids demoted, in order (for tests that predict them)

    @classmethod
    def for_cache(cls, cache) -> "LRUSim":
        """A sim of ``cache``'s config (its elastic tier included)."""
        cfg = cache.cfg
        return cls(num_layers=cfg.num_layers, S=cfg.device_buffer_size, max_query_len=cfg.max_query_len,
                   max_request_id=cfg.max_request_id, pool_pages=cfg.pool_pages,
                   max_pages=cfg.max_pages_per_request, PB=64, pool_base=cfg.hot_rows_per_layer)

    def add(self, rid: int, slot: int = -1) -> None:
        """``slot``: the request slot the cache gave (needed by the tier's tie-break)."""
        q = self.reqs[rid] = _Req(self.L)
        q.slot = slot
        if self.pool_pages > 0:
            q.pages = []

    def free(self, rid: int) -> None:
        q = self.reqs.pop(rid)
        if q.pages is not None:
            self.free_pages.update(q.pages)

    def resident(self, rid: int) -> bool:
        return self.reqs[rid].pages is not None

    # ---- the elastic tier -------------------------------------------------------
    def _demote(self, rid: int) -> None:
        q = self.reqs[rid]
        S = self.S
        for l in range(self.L):
            n, s = q.lens[l], q.step[l]
            if n <= S:
                q.hot[l] = OrderedDict((p, s) for p in range(n))
                q.reserved[l] = (-1, -1)
            else:  # the rows the layer's last resolve selected first, then the newest
                sel = {p for p in range(n - 1) if self.page_row(rid, p) in self.last_rows[l]}
                keep = sorted(range(n - 1), key=lambda p: (p in sel, p), reverse=True)[:S]
                q.hot[l] = OrderedDict((p, s) for p in sorted(keep))
                q.reserved[l] = (n - 1, s)
            self.seeded_rows += min(n, S + 1)
        self.free_pages.update(q.pages or [])
        q.pages = None
        self.spills += 1
        self.demoted.append(rid)

    def page_row(self, rid: int, p: int) -> int:
        """The device row of position p of resident request ``rid``."""
        pages = self.reqs[rid].pages
        return self.pool_base + pages[p // self.PB] * self.PB + p % self.PB

    def _pool_write(self, ends: list[tuple[int, int]]) -> None:
        """The pool's part of a write of ``ends`` ((id, its length after the write), in
        batch order): demotions, then page grants (lowest free pages first)."""
        PB = self.PB

        def pages_for(end: int) -> int:
            return -(-end // PB)

        need = {rid: pages_for(end) - len(self.reqs[rid].pages) for rid, end in ends
                if self.resident(rid) and pages_for(end) > len(self.reqs[rid].pages)}
        if not need:
            return
        demote = [rid for rid, end in ends if rid in need and pages_for(end) > self.max_pages]
        for rid in demote:
            del need[rid]
        freed = sum(len(self.reqs[rid].pages) for rid in demote)
        order = sorted((rid for rid in self.reqs if self.resident(rid) and rid not in demote
                        and (self.reqs[rid].pages or rid in need)),  # demoting others frees nothing
                       key=lambda rid: (-len(self.reqs[rid].pages), self.reqs[rid].slot))
        for rid in order:
            if sum(need.values()) <= len(self.free_pages) + freed:
                break
            demote.append(rid)
            freed += len(self.reqs[rid].pages)
            need.pop(rid, None)
        for rid in demote:
            self._demote(rid)
        for rid, _ in ends:
            n = need.get(rid, 0)
            if n:
                got = sorted(self.free_pages)[:n]
                assert len(got) == n, "sim: the spill policy left too few pages"
                self.free_pages.difference_update(got)
                self.reqs[rid].pages += got

    def write(self, layers, items: list[tuple[int, int]]) -> None:
        """A write of ``items`` ((id, rows), batch order) to ``layers`` (one layer, or
        every layer of a step): the pool is planned once, from the first layer's lengths."""
        layers = list(layers)
        if self.pool_pages > 0:
            self._pool_write([(rid, self.reqs[rid].lens[layers[0]] + n) for rid, n in items if n])
        for l in layers:
            for rid, n in items:
                self._append(l, rid, n)

    def append(self, layer: int, rid: int, n: int) -> None:
        self.write([layer], [(rid, n)])

    def _append(self, layer: int, rid: int, n: int) -> None:
        q = self.reqs[rid]
        if q.pages is not None:  # resident: page rows, no slot state
            q.lens[layer] += n
            self.rows_written[layer] += n
            return
        p0, p1 = q.lens[layer], q.lens[layer] + n
        step = q.step[layer]
        for p in range(p0, min(p1, self.S)):
            if p in q.hot[layer]:
                raise AssertionError(f"sim: position {p} appended twice")
            q.hot[layer][p] = step
        if n and p1 - 1 >= self.S:
            q.reserved[layer] = (p1 - 1, step)
        q.lens[layer] = p1
        self.rows_written[layer] += n

    def seq_len(self, rid: int) -> int:
        """Positions appended to every layer."""
        return min(self.reqs[rid].lens)

    def layer_len(self, layer: int, rid: int) -> int:
        """Positions appended to ``layer`` (what a resolve of that layer accepts)."""
        return self.reqs[rid].lens[layer]

    def token_valid(self, ids: list[int]) -> list[bool]:
        """Per token: live id, run offset < max_query_len, and its run is the first
        run of that id in the batch (a later run of the same request is skipped)."""
        ok = []
        run = 0
        first_run = True
        for t, rid in enumerate(ids):
            if t > 0 and ids[t - 1] == rid:
                run += 1
            else:
                run = 1
                first_run = rid not in ids[:t]
            ok.append(rid in self.reqs and run <= self.q and first_run)
        return ok

    def entry_valid(self, layer: int, ids: list[int], topk: list[list[int]]) -> list[list[bool]]:
        tok = self.token_valid(ids)
        return [[tok[t] and 0 <= p < self.layer_len(layer, ids[t]) for p in row]
                for t, row in enumerate(topk)]

    def resolve(self, layer: int, ids: list[int], topk: list[list[int]], *, prefetch: bool = False) -> None:
        """A resolve (a split resolve leaves the same state); ``prefetch``: a prefetch,
        which counts only the rows it stages (hot groups) and nothing else."""
        valid = self.entry_valid(layer, ids, topk)
        tok = self.token_valid(ids)
        if not prefetch:
            for t, row in enumerate(topk):
                self.invalid[layer] += sum(1 for k, p in enumerate(row) if p != -1 and not valid[t][k])
        t = 0
        T = len(ids)
        rows: set[int] = set()
        while t < T:
            if not tok[t] or (t > 0 and ids[t - 1] == ids[t]):
                t += 1
                continue
            rid, end = ids[t], t + 1
            while end < T and ids[end] == rid and tok[end]:
                end += 1
            if self.resident(rid):  # page rows: no LRU state, no step, entries counted
                if not prefetch:
                    self.resolves[layer] += 1
                    self.resident_rows[layer] += sum(sum(valid[u]) for u in range(t, end))
                    rows |= {self.page_row(rid, p) for u in range(t, end)
                             for k, p in enumerate(topk[u]) if valid[u][k]}
            else:
                U = sorted({p for u in range(t, end) for k, p in enumerate(topk[u]) if valid[u][k]})
                self._group(layer, rid, U, prefetch)
            t = end
        if not prefetch:
            self.last_rows[layer] = rows

    def _group(self, layer: int, rid: int, U: list[int], prefetch: bool = False) -> None:
        q = self.reqs[rid]
        q.step[layer] += 1
        s = q.step[layer]
        hot = q.hot[layer]
        misses = []
        hits = 0
        for p in U:
            if p in hot:
                hot[p] = s
                hits += 1
            elif p == q.reserved[layer][0]:
                q.reserved[layer] = (p, s)
                hits += 1
            else:
                misses.append(p)
        if prefetch:
            self.prefetch_rows[layer] += len(misses)
        else:
            self.resolves[layer] += 1
            self.hits[layer] += hits
            self.misses[layer] += len(misses)
        empties = self.S - len(hot)
        evict = max(0, len(misses) - empties)
        cands = sorted((st, p) for p, st in hot.items() if st < s)
        if len(cands) < evict:
            raise AssertionError(f"sim: {evict} victims needed, {len(cands)} evictable")
        for _, p in cands[:evict]:
            del hot[p]
        for p in misses:
            hot[p] = s


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
    every = free + [p for ps in owned.values() for p in ps]
    if sorted(every) != list(range(dp.num_pages)):
        _fail(f"pool pages: free {sorted(free)} + owned {owned} != the {dp.num_pages} pages")
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
                         dp.spills, dp.promotions, dp.seeded_rows, dp.epoch)
    return snap


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        if not same:
            _fail(f"state '{k}' changed by a call that should have changed nothing")


# ---------------------------------------------------------------- trace runner
class TraceRunner:
    """Applies ops to a cache and a sim together, checking after every op.

    Ops are abstract (indices are taken modulo what exists), so any op list is valid
    and hypothesis can shrink freely.
    """

    def __init__(self, cache, *, seed: int = 0, check_every: int = 1) -> None:
        cfg = cache.cfg
        self.cache, self.cfg = cache, cfg
        self.sim = LRUSim.for_cache(cache)  # the elastic tier modelled when the config has one
        self.truth: dict[tuple[int, int], torch.Tensor] = {}
        self.rng = random.Random(seed)
        self.next_id = 0
        self.ops = 0
        self.check_every = check_every
        self.capacity_errors = 0

    def _check(self) -> None:
        self.ops += 1
        if self.ops % self.check_every == 0:
            check_cache(self.cache, self.sim, self.truth)

    def add(self) -> None:
        rid = self.next_id % self.cfg.max_request_id
        while rid in self.sim.reqs:
            rid = (rid + 1) % self.cfg.max_request_id
        self.next_id = rid + 1
        if len(self.sim.reqs) >= self.cfg.max_num_reqs:
            before = snapshot(self.cache)
            try:
                self.cache.add_request(rid)
            except CapacityError:
                self.capacity_errors += 1
                assert_same(before, snapshot(self.cache))
                return
            _fail("add_request past max_num_reqs did not raise CapacityError")
        self.cache.add_request(rid)
        r = self.cache.request(rid).slot
        self.sim.add(rid, r)
        self._check()

    def free(self, which: int) -> None:
        live = sorted(self.sim.reqs)
        if not live:
            return
        rid = live[which % len(live)]
        self.cache.free_request(rid)
        self.sim.free(rid)
        for l in range(self.cfg.num_layers):
            self.truth.pop((rid, l), None)
        self._check()

    def append(self, which: int, layer: int, n: int, all_layers: bool = False) -> None:
        live = sorted(self.sim.reqs)
        if not live:
            return
        rid = live[which % len(live)]
        layers = range(self.cfg.num_layers) if all_layers else [layer % self.cfg.num_layers]
        for l in layers:
            rows = torch.randint(0, 256, (n, self.cfg.row_bytes), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
            before = snapshot(self.cache) if n else None
            try:
                p0 = self.cache.write(l, rid, rows.to(self.cache.device))[0]
            except CapacityError:
                self.capacity_errors += 1
                assert_same(before, snapshot(self.cache))
                return
            if p0 != self.sim.reqs[rid].lens[l]:
                _fail(f"write returned {p0}, expected {self.sim.reqs[rid].lens[l]}")
            self.sim.append(l, rid, n)
            old = self.truth.get((rid, l), torch.empty((0, self.cfg.row_bytes), dtype=torch.uint8))
            self.truth[(rid, l)] = torch.cat([old, rows])
            self._check()

    def append_tokens(self, mask: int, layer: int) -> None:
        """One row to each live request picked by ``mask`` through the batched
        ``write`` of one row per request (a decode step's new tokens)."""
        live = sorted(self.sim.reqs)
        rids = [rid for i, rid in enumerate(live) if (mask >> i) & 1]
        l = layer % self.cfg.num_layers
        rows = torch.randint(0, 256, (len(rids), self.cfg.row_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        before = snapshot(self.cache)
        try:
            pos = self.cache.write(l, self.cache.plan_write(rids, [1] * len(rids)), rows.to(self.cache.device))
        except CapacityError:
            self.capacity_errors += 1
            assert_same(before, snapshot(self.cache))
            return
        for i, rid in enumerate(rids):
            if pos[i] != self.sim.reqs[rid].lens[l]:
                _fail(f"the decode write gave position {pos[i]}, expected "
                      f"{self.sim.reqs[rid].lens[l]}")
            old = self.truth.get((rid, l), torch.empty((0, self.cfg.row_bytes), dtype=torch.uint8))
            self.truth[(rid, l)] = torch.cat([old, rows[i:i + 1]])
        self.sim.write([l], [(rid, 1) for rid in rids])  # one batch: one pool plan
        self._check()

    def _batch(self, mask: int, sizes, equal_layers: bool = False) -> tuple[list[int], list[int]]:
        """Live ids picked by ``mask`` (shuffled: the batch order matters to the pool's
        grants) and a row count each from ``sizes``; ``equal_layers``: only requests whose
        layers hold the same rows (what a step accepts)."""
        live = sorted(self.sim.reqs)
        rids = [rid for i, rid in enumerate(live) if (mask >> i) & 1
                and (not equal_layers or len(set(self.sim.reqs[rid].lens)) == 1)]
        self.rng.shuffle(rids)
        return rids, [self.rng.choice(sizes) for _ in rids]

    def _rows(self, n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, self.cfg.row_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))

    def _record(self, layers, rids: list[int], counts: list[int], rows: torch.Tensor) -> None:
        o = 0
        for rid, n in zip(rids, counts):
            for l in layers:
                old = self.truth.get((rid, l), torch.empty((0, self.cfg.row_bytes), dtype=torch.uint8))
                self.truth[(rid, l)] = torch.cat([old, rows[o:o + n]])
            o += n

    def append_batch(self, mask: int, layer: int, sizes=(0, 1, 3, 17, 40)) -> None:
        """Several rows to each live request picked by ``mask`` in one ``cache.write`` of
        one layer (a prefill chunk's batched append)."""
        rids, counts = self._batch(mask, sizes)
        if not rids:
            return
        l = layer % self.cfg.num_layers
        rows = self._rows(sum(counts))
        before = snapshot(self.cache)
        try:
            firsts = self.cache.write(l, self.cache.plan_write(rids, counts), rows.to(self.cache.device))
        except CapacityError:
            self.capacity_errors += 1
            assert_same(before, snapshot(self.cache))
            return
        want = [self.sim.reqs[rid].lens[l] for rid in rids]
        if firsts != want:
            _fail(f"write returned first positions {firsts}, expected {want}")
        self._record([l], rids, counts, rows)
        self.sim.write([l], list(zip(rids, counts)))
        self._check()

    def step(self, mask: int, sizes=(1, 1, 2, 9)) -> None:
        """A forward's append to every layer: ``prepare_step`` once, then ``write_step``
        per layer (requests whose layers hold the same rows only)."""
        rids, counts = self._batch(mask, sizes, equal_layers=True)
        if not rids:
            return
        rows = self._rows(sum(counts))
        before = snapshot(self.cache)
        try:
            step = self.cache.prepare_step(self.cache.plan_write(rids, counts))
        except CapacityError:
            self.capacity_errors += 1
            assert_same(before, snapshot(self.cache))
            return
        for l in range(self.cfg.num_layers):
            self.cache.write_step(l, step, rows.to(self.cache.device))
        self._record(range(self.cfg.num_layers), rids, counts, rows)
        self.sim.write(range(self.cfg.num_layers), list(zip(rids, counts)))
        self._check()

    def make_step(self, mask: int, pad: float, invalid: bool,
                  layer: int = 0) -> tuple[list[int], list[list[int]]]:
        """req_ids/topk for the live requests selected by ``mask`` (positions below the
        request's length in ``layer``). With ``invalid``: bad positions, bad ids, and
        sometimes a second run of an earlier request appended at the end."""
        K, q = self.cfg.top_k, self.cfg.max_query_len
        ids: list[int] = []
        topk: list[list[int]] = []
        live = sorted(self.sim.reqs)
        for i, rid in enumerate(live):
            if not (mask >> i) & 1:
                continue
            n = self.sim.layer_len(layer, rid)
            for _ in range(self.rng.randint(1, q + (1 if invalid else 0))):
                row = []
                for _ in range(K):
                    u = self.rng.random()
                    if u < pad or n == 0:
                        row.append(-1)
                    elif invalid and u < pad + 0.1:
                        row.append(self.rng.choice([-2, n, n + 3, -7]))
                    else:
                        row.append(self.rng.randrange(n))
                topk.append(row)
                ids.append(rid)
        cap = self.cache.cfg.max_tokens
        ids, topk = ids[:cap], topk[:cap]
        if invalid and ids and self.rng.random() < 0.3:
            ids[self.rng.randrange(len(ids))] = self.rng.choice(
                [-1, self.cfg.max_request_id, self.next_id % self.cfg.max_request_id])
        if invalid and ids and len(ids) < cap and self.rng.random() < 0.3:
            # a second run of a request of this step (split runs): must be skipped
            j = self.rng.randrange(len(ids))
            if len(ids) >= 2 and ids[-1] == ids[j]:
                j = self.rng.randrange(len(ids))
            if ids[-1] != ids[j]:
                ids.append(ids[j])
                topk.append(list(topk[j]))
        return ids, topk

    def _step_tensors(self, layer: int, mask: int, pad: float, invalid: bool):
        """(layer mod L, ids, top-k lists, ids int32 [T], top-k int32 [T, K] on the cache's
        device) of a step of the requests picked by ``mask``."""
        layer %= self.cfg.num_layers
        ids, topk = self.make_step(mask, pad, invalid, layer)
        dev = self.cache.device
        ids_t = torch.tensor(ids, dtype=torch.int32, device=dev)
        topk_t = torch.tensor(topk, dtype=torch.int32, device=dev).reshape(len(ids), self.cfg.top_k)
        return layer, ids, topk, ids_t, topk_t

    def resolve(self, layer: int, mask: int, pad: float = 0.2, invalid: bool = False,
                compact: bool = False) -> None:
        """Resolve a step for the live requests picked by bitmask ``mask``; ``invalid``
        runs unchecked with bad ids/positions mixed in."""
        layer, ids, topk, ids_t, topk_t = self._step_tensors(layer, mask, pad, invalid)
        res = self.cache.resolve(layer, ids_t, topk_t, validate=not invalid, compact=compact)
        self.sim.resolve(layer, ids, topk)
        check_result(self.cache, layer, ids, topk, res, self.sim, compact=compact)
        self._check()

    def resolve_split(self, layer: int, mask: int, pad: float = 0.2, invalid: bool = False,
                      compact: bool = False) -> None:
        """``resolve`` in two phases (``split=True``): the same state and union result; a hit
        row (non-compact) is the union's row, a resident token has no misses."""
        layer, ids, topk, ids_t, topk_t = self._step_tensors(layer, mask, pad, invalid)
        res = self.cache.resolve(layer, ids_t, topk_t, validate=not invalid, compact=compact, split=True)
        self.sim.resolve(layer, ids, topk)
        check_result(self.cache, layer, ids, topk, res, self.sim, compact=compact)
        hit, phys = res.hit_physical.cpu(), res.physical.cpu()
        mc = res.miss_counts.cpu().tolist()
        tok = self.sim.token_valid(ids)
        for t, rid in enumerate(ids):
            if not tok[t] or not self.sim.resident(rid):
                if not compact and ((hit[t] >= 0) & (hit[t] != phys[t])).any():
                    _fail(f"token {t}: hit rows {hit[t].tolist()} not in the union {phys[t].tolist()}")
                continue
            if mc[t] != 0:
                _fail(f"token {t} of resident request {rid}: {mc[t]} misses")
            if not compact and not torch.equal(hit[t], phys[t]):
                _fail(f"token {t} of resident request {rid}: hit rows {hit[t].tolist()}, "
                      f"resolved {phys[t].tolist()}")
        self._check()

    def prefetch(self, layer: int, mask: int, pad: float = 0.2) -> None:
        """A prefetch of a predicted selection (valid positions), then the checks."""
        layer %= self.cfg.num_layers
        ids, topk = self.make_step(mask, pad, False, layer)
        dev = self.cache.device
        ids_t = torch.tensor(ids, dtype=torch.int32, device=dev)
        topk_t = torch.tensor(topk, dtype=torch.int32, device=dev).reshape(len(ids), self.cfg.top_k)
        out = self.cache.prefetch(layer, ids_t, topk_t)
        self.sim.resolve(layer, ids, topk, prefetch=True)
        staged = int((out.stage_dst[:len(ids) * self.cfg.top_k] >= 0).sum())
        tok = self.sim.token_valid(ids)
        if any(tok[t] and self.sim.resident(rid) and int(out.stage_counts[t]) for t, rid in enumerate(ids)):
            _fail("a prefetch staged rows of a resident request")
        self._check()
        if staged != sum(int(x) for x in out.stage_counts[:len(ids)]):
            _fail(f"prefetch staged {staged} rows, stage_counts say otherwise")

    def run(self, ops: list[tuple]) -> None:
        for op in ops:
            kind, args = op[0], op[1:]
            getattr(self, kind)(*args)


def long_trace(runner: "TraceRunner", rng, n_ops: int, *, n_big: int = 9,
               token_appends: bool = True) -> None:
    """A seeded mix of adds, frees, appends (some of ``n_big`` rows), batched token appends
    (when ``token_appends``) and resolves (some unchecked with invalid entries)."""
    for _ in range(n_ops):
        u = rng.random()
        if u < 0.12:
            runner.add()
        elif u < 0.18:
            runner.free(rng.randrange(8))
        elif u < 0.5:
            runner.append(rng.randrange(8), rng.randrange(4), rng.choice([1, 1, 2, 5, n_big]),
                          rng.random() < 0.8)
        elif token_appends and u < 0.58:
            runner.append_tokens(rng.randrange(16), rng.randrange(4))
        else:
            runner.resolve(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]),
                           rng.random() < 0.25, rng.random() < 0.3)


def tier_trace(runner: "TraceRunner", rng, n_ops: int) -> None:
    """A seeded mix of every write path (per-layer appends, token appends, batched
    multi-row writes, steps), every resolve path (resolve, split, prefetch) and
    lifecycle, for a cache with an elastic tier (or without)."""
    for _ in range(n_ops):
        u = rng.random()
        if u < 0.10:
            runner.add()
        elif u < 0.15:
            runner.free(rng.randrange(8))
        elif u < 0.25:
            runner.append(rng.randrange(8), rng.randrange(4), rng.choice([1, 2, 30, 70]), rng.random() < 0.8)
        elif u < 0.32:
            runner.append_tokens(rng.randrange(16), rng.randrange(4))
        elif u < 0.42:
            runner.append_batch(rng.randrange(16), rng.randrange(4))
        elif u < 0.55:
            runner.step(rng.randrange(16))
        elif u < 0.75:
            runner.resolve(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]),
                           rng.random() < 0.25, rng.random() < 0.3)
        elif u < 0.9:
            runner.resolve_split(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]),
                                 rng.random() < 0.25, rng.random() < 0.3)
        else:
            runner.prefetch(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]))


__all__ = ["LRUSim", "check_cache", "check_result", "snapshot", "assert_same", "TraceRunner",
           "long_trace", "tier_trace"]
