"""An independent exact-LRU simulation of a HiSparseCache (used by
``invariants.check_cache`` and the trace runners).

:class:`LRUSim` models the cache's policy on plain Python dicts, written from
DESIGN.md / the ``state`` and ``resolve_ref`` docstrings, not from the resolver code:
per (layer, request) an ordered dict ``position -> stamp`` for the S LRU slots plus
the reserved newest-token slot; victims are empty slots first, then the oldest stamp,
ties by the smallest position; slots hit this step are never victims.

The elastic device tier (``HiSparseConfig(device_pool_rows=...)``): the sim models it
when built with ``pool_pages`` > 0 (:meth:`LRUSim.for_cache` does that from a cache's
config): a request joins *resident* (no LRU state, its rows in pages of ``PB`` rows,
resolves counted as resident entries, no step), a write that needs pages the pool
lacks demotes resident requests (a request needing more than ``max_pages`` pages
first, then the one holding the most pages no other resident request holds, ties
lowest request slot, among those holding pages or written; a page is free once no
resident request holds it) and seeds each
demoted layer's hot buffer with its newest S + 1 positions (all of them, slot =
position, when it holds at most S), stamped with the layer's step; granted pages are
the lowest free ones, in batch order. :meth:`LRUSim.share` joins a request resident on
another's leading pages (a shared prompt prefix), the caller deciding which.
"""

from __future__ import annotations

from collections import OrderedDict


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
        self.shared_spills = 0  # demotions of a request some of whose pages another holds
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
            self.free_pages.update(p for p in q.pages if not self._held(p))

    def _held(self, page: int, but: frozenset = frozenset()) -> bool:
        """Whether a resident request (other than those in ``but``) holds ``page``."""
        return any(q.pages is not None and page in q.pages for rid, q in self.reqs.items() if rid not in but)

    def share(self, rid: int, holder: int, rows: int) -> bool:
        """Request ``rid`` (just added, resident, no rows of its own yet) shares resident
        ``holder``'s first ``rows`` positions: its whole pages, and the lowest free page
        for the rest (False, and ``rid`` hot, when that page is not there)."""
        k, rem = divmod(rows, self.PB)
        have = self.reqs[holder].pages
        assert have is not None and len(have) * self.PB >= rows
        q = self.reqs[rid]
        if rem and not self.free_pages:
            q.pages = None
            return False
        own = [min(self.free_pages)] if rem else []
        self.free_pages.difference_update(own)
        q.pages = have[:k] + own
        return True

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
        pages, q.pages = q.pages or [], None
        kept = [p for p in pages if self._held(p)]  # another resident request holds them
        self.free_pages.update(p for p in pages if p not in kept)
        self.shared_spills += bool(kept)
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

        def freed() -> int:  # pages no request outside ``demote`` holds
            out = set(p for rid in demote for p in self.reqs[rid].pages)
            return sum(not self._held(p, frozenset(demote)) for p in out)

        def alone(rid: int) -> int:
            return sum(not self._held(p, frozenset([rid])) for p in self.reqs[rid].pages)

        order = sorted((rid for rid in self.reqs if self.resident(rid) and rid not in demote
                        and (self.reqs[rid].pages or rid in need)),  # demoting others frees nothing
                       key=lambda rid: (-alone(rid), self.reqs[rid].slot))
        for rid in order:
            if sum(need.values()) <= len(self.free_pages) + freed():
                break
            demote.append(rid)
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


__all__ = ["LRUSim"]
