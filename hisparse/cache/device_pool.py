"""The elastic device tier: one fixed pool of device rows per layer, in pages.

``HiSparseConfig(device_pool_rows=N)`` gives each layer's flat device view
``hot[l]`` (uint8 [N', row_bytes]) the hot buffers first (rows ``0 .. R * (S + 1)``,
rounded up to 64) and then ``cfg.pool_pages`` pages of ``PB`` = 64 rows. A request is

- **resident**: every appended row is also written to its pages (the same pages in
  every layer); a position maps through the device page table
  (``state.page_table[r, p // PB]``), so a resolve has no LRU state and no misses; or
- **hot**: today's LRU buffer of S + 1 slots.

A request is admitted resident when the pool has pages at all (with no pool every
request is hot, exactly as without the tier). Its pages are taken when a write needs
them. When a write needs more pages than are free, the **spill policy** demotes
resident requests to hot, one at a time, the one whose demotion frees the most pages
first (pages no other resident request references, counted when the write is planned;
ties: the lowest request slot), until the write's pages fit (a request that holds no
page and is not written is never demoted: that frees nothing; one whose pages are all
shared frees pages only together with their other holders, so it comes last); a
request that can't fit the pool at all (more than ``cfg.max_pages_per_request`` pages)
is demoted too. A
demotion seeds the new hot buffer device to device from the request's own resident
rows, in every layer: a context of at most S rows keeps every row (slot = position, as
writes place them); a longer one keeps its newest row in the reserved slot S and, in
slots 0..S-1, the rows the layer's last resolve selected (from its pages: with shared
pages, rows another request selected there count too), then the newest others (what
a hot buffer would have held: the next step's selection overlaps the last one most).
Then its references to its pages are dropped. The host copy of every row is complete
either way (rows are mirrored at append), so a demotion never loses a row. Hot
requests are not promoted back to resident (``promotions`` stays 0): freed pages go
to the requests admitted later.

**Shared prefix pages** (prefix caching, ``cfg.share_prefix_pages``): a request that
joins with ``c`` cached tokens, when a resident request (the *holder*: the lowest
request slot among those whose published leading blocks are the same cached blocks)
holds them, joins resident on the holder's pages: it references the holder's first
``c // PB`` pages (the same positions, the same bytes: one device copy of the prefix
for every request that uses it) and, when ``c % PB`` rows are left, takes the lowest
free page and copies those rows into it from the holder's next page, device to device,
in every layer. Without a holder, or with no free page for that copy, it joins hot. A
page is freed when the last request referencing it is freed or demoted. A request
never writes a referenced page: it appends only past its cached tokens, and a page
that holds positions past a holder's prefix is the holder's alone.

Everything here is host-side bookkeeping; the device updates of a demotion and of a
grant (page table, residency flag, seeded rows and slot state) are made by
:func:`apply_changes` on the current stream.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np
import torch

from ..config import DEVICE_PAGE_ROWS, HiSparseConfig, ceil_div
from ..device import device_ints
from .state import HotState


@dataclasses.dataclass(frozen=True)
class PoolChanges:
    """What a write does to the pool (``DevicePool.plan``): ``demote`` request slots
    (in order), then ``grants[r]``: the pages appended to resident slot r's list, as the
    pool will hand them out. ``pages[r]``: every page of each resident slot of the
    write after the change (what the write plan addresses)."""

    demote: tuple[int, ...]
    grants: dict[int, list[int]]
    pages: dict[int, list[int]]

    @property
    def empty(self) -> bool:
        return not self.demote and not any(self.grants.values())


NO_CHANGES = PoolChanges((), {}, {})


class DevicePool:
    """Pages, residency and the tier's counters (host side; see the module docstring)."""

    def __init__(self, cfg: HiSparseConfig) -> None:
        self.num_pages = cfg.pool_pages
        self.PB = DEVICE_PAGE_ROWS
        self.base = cfg.hot_rows_per_layer
        self.max_pages = cfg.max_pages_per_request
        self.rows_per_layer = cfg.device_rows_per_layer
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() -> lowest
        self._pages: dict[int, list[int]] = {}  # resident request slot -> its pages
        self.refs = np.zeros(self.num_pages, dtype=np.int64)  # resident requests referencing each page
        # the same as arrays over request slots: npages int64 [R] (-1: not resident) and
        # page_of int64 [R, MP] (-1 = none), a host copy of state.page_table
        self.npages = np.full(cfg.max_num_reqs, -1, dtype=np.int64)
        self.page_of = np.full((cfg.max_num_reqs, max(1, self.max_pages)), -1, dtype=np.int64)
        self.spills = 0
        self.promotions = 0
        self.seeded_rows = 0  # rows copied into hot buffers by demotions (all layers)
        self.shared_joins = 0  # requests admitted resident on a holder's prefix pages
        self.epoch = 0  # moves on with every residency change

    # ---- queries ---------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.num_pages > 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_resident(self, r: int) -> bool:
        return r in self._pages

    @property
    def num_resident(self) -> int:
        """Resident request slots (every one a live request's)."""
        return len(self._pages)

    def pages(self, r: int) -> list[int]:
        """Resident slot r's pages (the pool's own list: read it only)."""
        return self._pages[r]

    @property
    def num_shared(self) -> int:
        """Pages referenced by more than one resident request (shared prefixes)."""
        return int((self.refs > 1).sum())

    def exclusive(self, r: int) -> int:
        """Pages of resident slot r that no other resident request references (what its
        demotion frees)."""
        p = self._pages[r]
        return int((self.refs[p] == 1).sum()) if p else 0

    def resident_mask(self, slots: np.ndarray) -> np.ndarray:
        """bool [n]: whether each request slot of ``slots`` (int64 [n]) is resident."""
        return self.npages[slots] >= 0

    def needs_pages(self, slots: np.ndarray, ends: np.ndarray) -> bool:
        """Whether a write of ``ends`` rows (int64 [n]) to request slots ``slots`` (int64
        [n]) needs a page a resident request does not hold yet (else ``plan`` changes
        nothing: no grant, no demotion)."""
        have = self.npages[slots]
        return bool(((have >= 0) & (-(-ends // self.PB) > have)).any())

    def page_rows(self, slots: np.ndarray, positions: np.ndarray, changes: "PoolChanges") -> np.ndarray:
        """int64 [n]: the flat device row of ``positions[i]`` (int64 [n]) of request slot
        ``slots[i]`` once ``changes`` (``plan`` of this write, not made yet) are made,
        for a request resident then; -1 for one that is hot."""
        have = self.npages[slots]
        res = have >= 0
        if changes.demote:
            res &= ~np.isin(slots, changes.demote)
        k = positions // self.PB
        page = self.page_of[slots, np.minimum(k, self.page_of.shape[1] - 1)]
        if changes.grants:  # pages the write is granted come after those held
            at = {s: i for i, s in enumerate(slots.tolist())}
            for r, got in changes.grants.items():
                i = at.get(r)
                if got and i is not None and k[i] >= have[i]:
                    page[i] = got[int(k[i] - have[i])]
        return np.where(res, self.base + page * self.PB + positions % self.PB, -1)

    def resident_slots(self) -> list[int]:
        return sorted(self._pages)

    def rows_used(self, live_requests: int, slots_per_req: int) -> int:
        """Device rows per layer in use: a hot buffer per live request (admission
        reserves one for every request, resident or not) plus every taken page."""
        return live_requests * slots_per_req + (self.num_pages - len(self._free)) * self.PB

    def page_row(self, r: int, p: int) -> int:
        """Flat device row of position p of resident slot r."""
        pg = self._pages[r][p // self.PB]
        return self.base + pg * self.PB + p % self.PB

    # ---- decisions (pure) ------------------------------------------------------
    def plan(self, ends: Sequence[tuple[int, int]]) -> PoolChanges:
        """The changes a write of ``ends`` ((request slot, its length after the write)
        per request written) needs: which resident requests to demote and the pages to
        grant. Changes nothing."""
        if not self._pages:
            return NO_CHANGES
        PB = self.PB
        need = {r: ceil_div(end, PB) - len(self._pages[r]) for r, end in ends if r in self._pages}
        need = {r: n for r, n in need.items() if n > 0}
        if not need:
            return PoolChanges((), {}, {r: self._pages[r] for r, _ in ends if r in self._pages})
        demote: list[int] = []
        dropped: dict[int, int] = {}  # page -> references the demotions so far drop
        freed: list[int] = []  # pages no request references after them

        def drop(r: int) -> None:
            demote.append(r)
            for p in self._pages[r]:
                d = dropped[p] = dropped.get(p, 0) + 1
                if d == self.refs[p]:
                    freed.append(p)

        # a request that can never fit the pool goes hot now
        for r, end in ends:
            if r in need and ceil_div(end, PB) > self.max_pages:
                drop(r)
                del need[r]
        # candidates: a request whose demotion helps the write fit, i.e. one that holds
        # pages or is one of the write's (demoting any other frees nothing)
        order = sorted((r for r in self._pages if r not in demote and (self._pages[r] or r in need)),
                       key=lambda r: (-self.exclusive(r), r))
        for r in order:
            if sum(need.values()) <= len(self._free) + len(freed):
                break
            drop(r)
            need.pop(r, None)
        free = sorted(self._free + freed)
        grants: dict[int, list[int]] = {}
        o = 0
        for r, _ in ends:
            n = need.get(r, 0)
            if n:
                grants[r] = free[o:o + n]
                o += n
        pages = {r: self._pages[r] + grants.get(r, []) for r, _ in ends if r in self._pages and r not in demote}
        return PoolChanges(tuple(demote), grants, pages)

    # ---- changes ---------------------------------------------------------------
    def admit(self, r: int) -> bool:
        """Request slot r joins: resident (no pages yet) when the pool has pages."""
        if self.enabled:
            self._pages[r] = []
            self.npages[r] = 0
            self.epoch += 1
            return True
        return False

    def release(self, r: int) -> list[int]:
        """Slot r leaves the resident tier (freed or demoted): its references are dropped;
        returns the pages that are free now (those no other request references)."""
        pages = self._pages.pop(r, None)
        if pages is None:
            return []
        self.npages[r] = -1
        self.page_of[r] = -1
        held = np.asarray(pages, dtype=np.int64)
        self.refs[held] -= 1
        gone = held[self.refs[held] == 0].tolist()
        self._free.extend(gone)
        self._free.sort(reverse=True)
        self.epoch += 1
        return gone

    def holder_pages(self, holder: int, rows: int) -> tuple[list[int], int] | None:
        """(the pages of resident slot ``holder`` a request sharing its first ``rows``
        positions references, the holder page whose leading ``rows % PB`` rows it copies,
        or -1); None when that copy needs a page and none is free. Changes nothing."""
        k, rem = divmod(rows, self.PB)
        have = self._pages[holder]
        if len(have) * self.PB < rows or (rem and not self._free):
            return None
        return have[:k], (have[k] if rem else -1)

    def share(self, r: int, pages: list[int], copy: bool) -> int:
        """Resident slot r (admitted, no pages yet) references ``pages`` (a
        ``holder_pages`` answer) and, with ``copy``, takes the lowest free page after them
        (returned; -1 without)."""
        own = self._free.pop() if copy else -1
        got = np.array(pages + [own] if copy else pages, dtype=np.int64)
        self._pages[r] = got.tolist()
        self.refs[got] += 1
        self.page_of[r, :len(got)] = got
        self.npages[r] = len(got)
        self.shared_joins += 1
        self.epoch += 1
        return own

    def grant(self, r: int, want: list[int]) -> None:
        """Give resident slot r the pages ``want`` (exactly those ``plan`` predicted)."""
        for p in want:
            self._free.remove(p)
        self._free.sort(reverse=True)
        self.refs[want] = 1
        k0 = len(self._pages[r])
        self._pages[r].extend(want)
        self.page_of[r, k0:k0 + len(want)] = want
        self.npages[r] = k0 + len(want)

    def restore(self, free: list[int], pages: dict[int, list[int]], counters: tuple[int, int, int]) -> None:
        """Put back the free list, every resident slot's pages and (spills, seeded_rows,
        epoch) as recorded before a change (an undo)."""
        self._free[:] = free
        self._pages.clear()
        self._pages.update(pages)
        self.spills, self.seeded_rows, self.epoch = counters
        self.npages[:] = -1
        self.page_of[:] = -1
        self.refs[:] = 0
        for r, p in pages.items():
            self.npages[r] = len(p)
            self.page_of[r, :len(p)] = p
            np.add.at(self.refs, p, 1)


def seeded_reserved(n: int, S: int) -> int:
    """The reserved slot's occupant after a demotion of ``n`` rows: the newest row when
    the context is longer than S, else none (-1: every row sits at slot = position)."""
    return n - 1 if n > S else -1


def seed_positions(n: int, S: int) -> tuple[list[int], list[int], int]:
    """(positions, their slots, reserved occupant or -1) a demoted request of ``n`` rows
    keeps in its hot buffer when nothing was selected from it: every row at slot =
    position when n <= S (as writes place them), else the S rows before the newest in
    slots 0..S-1 and the newest in the reserved slot S. (With a last selection,
    ``apply_changes`` puts its rows first; the reserved occupant is the same.)"""
    if n <= S:
        return list(range(n)), list(range(n)), -1
    pos = list(range(n - 1 - S, n - 1)) + [n - 1]
    return pos, list(range(S)) + [S], n - 1


def _seed(state: HotState, r: int, n: int, layers: torch.Tensor, layer_ids: list[int], pages: int,
          num_pages: int, last: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64 [Lg, m], slots int64 [m]) a demoted resident slot r of ``n`` rows
    (holding ``pages`` of the pool's ``num_pages`` pages) keeps in each of ``layers``
    (int64 [Lg], the ids ``layer_ids``): every row when n <= S; else S of the positions
    before the newest -- the ones the layer's last resolve selected first (``last[l]``:
    the flat int32 physical rows it returned; r's page rows among them are found through
    the inverse of r's page table), then the newest -- in slots 0..S-1, and the newest in
    the reserved slot S. Device ops only (no host sync)."""
    S = state.S
    dev = layers.device
    Lg = layers.numel()
    if n <= S:
        return torch.arange(n, device=dev).expand(Lg, n), torch.arange(n, device=dev)
    cand = n - 1
    score = torch.arange(cand, device=dev, dtype=torch.int64).expand(Lg, cand).clone()
    if last is not None and pages:
        PB = state.PB
        inv = torch.full((num_pages,), -1, dtype=torch.int64, device=dev)  # pool page -> r's logical page
        inv[state.page_table[r, :pages].long()] = torch.arange(pages, device=dev)
        for i, layer in enumerate(layer_ids):
            q = last[layer].long() - state.pool_base
            ok = (q >= 0) & (q < num_pages * PB)
            q = torch.where(ok, q, torch.zeros_like(q))
            lp = inv[q // PB]
            p = lp * PB + q % PB
            ok = ok & (lp >= 0) & (p < cand)
            mark = torch.zeros(cand + 1, dtype=torch.int64, device=dev)  # entry cand: the rest
            mark.scatter_(0, torch.where(ok, p, torch.full_like(p, cand)), 1)
            score[i] += mark[:cand] * (2 * n)
    top = torch.topk(score, S, dim=1).indices  # the selected rows first, then the newest
    top = torch.sort(top, dim=1).values  # in ascending slots by position, as seed_positions
    pos = torch.cat([top, torch.full((Lg, 1), n - 1, dtype=torch.int64, device=dev)], dim=1)
    return pos, torch.arange(S + 1, device=dev)


def apply_changes(ch: PoolChanges, *, pool: DevicePool, state: HotState, hot: torch.Tensor,
                  lengths: Iterable[Sequence[int]], set_reserved,
                  last: Sequence[torch.Tensor] | None = None) -> None:
    """Make ``ch`` on the device (current stream, no host sync) and in ``pool``: each
    demoted slot's hot buffer seeded from its resident rows in every layer (``_seed``;
    ``last[l]``: the flat int32 physical rows of layer l's last resolve, or None), its
    slot state and ``row_slot`` set, its residency flag and page-table row cleared, its
    pages freed (``set_reserved(r, layer, occupant)`` records the reserved slot's
    occupant); then the grants' page-table entries. ``lengths``: per demoted slot (in
    ``ch.demote`` order), its rows per layer."""
    S, SP, B, PB = state.S, state.S + 1, state.B, state.PB
    dev = state.resident.device
    for r, lens in zip(ch.demote, lengths):
        by_len: dict[int, list[int]] = {}
        for layer, n in enumerate(lens):
            by_len.setdefault(n, []).append(layer)
        npages = len(pool.pages(r))
        for n, layers in by_len.items():
            if n == 0:
                continue
            li = device_ints(layers, dev, torch.int64)
            pos, slots = _seed(state, r, n, li, layers, npages, pool.num_pages, last)
            pt = state.page_table[r].long()
            bt = state.block_table[r].long()
            src = state.pool_base + pt[pos // PB] * PB + pos % PB  # int64 [Lg, m]
            hrow = bt[pos // B] * B + pos % B
            dst = r * SP + slots
            for i, layer in enumerate(layers):  # a layer at a time: [m, row_bytes] in flight
                hot[layer, dst] = hot[layer, src[i]]
            state.slot_pos[li[:, None], r, slots[None, :]] = pos.to(torch.int32)
            state.slot_stamp[li[:, None], r, slots[None, :]] = state.step[li, r][:, None]
            state.row_slot[li[:, None], hrow] = slots.to(torch.int32)[None, :].expand(len(layers), -1)
            pool.seeded_rows += pos.shape[1] * len(layers)
        for layer, n in enumerate(lens):  # the host side after the device work
            set_reserved(r, layer, seeded_reserved(n, S))
        state.resident[r] = 0
        state.page_table[r] = -1
        pool.release(r)
        pool.spills += 1
    for r, want in ch.grants.items():
        if want:
            k0 = len(pool.pages(r))
            pool.grant(r, want)
            state.page_table[r, k0:k0 + len(want)] = device_ints(want, dev)


__all__ = ["DevicePool", "PoolChanges", "NO_CHANGES", "apply_changes", "seed_positions", "seeded_reserved"]
