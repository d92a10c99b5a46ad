"""Offline optimal (Belady) hit rate of a trace, under the cache's own slot rules.

Each (layer, request) owns its hot buffer, so the bound decomposes into independent
*streams*, one per (layer, request instance). A stream is a sequence of events:

  ``("append", n)``    the request's length becomes n (positions old_len .. n-1 added)
  ``("resolve", U)``   one decode resolve; U = the unique valid positions selected

Rules shared with the cache (docs/DESIGN.md "Write path", state.py, resolve_ref.py):

- S LRU slots; appended position p < S is placed in slot p at append time (so a
  request whose context fits the buffer never misses);
- the last appended position, if >= S, sits in the reserved newest-token slot (a hit
  while it stays there); the next append displaces it (it remains on host only);
  other appended positions >= S go to host only;
- every unique position of a resolve is a hit (already in an LRU slot or in the
  reserved slot) or a miss, which must be placed in an LRU slot, evicting a row that
  this resolve does not use; counts are unique positions per resolve (STAT_HITS /
  STAT_MISSES).

:func:`belady_stream` evicts the rows whose next use is farthest in the future (empty
slots first): Belady's MIN, optimal for demand paging; serving a step's positions
together with the step's other positions protected is the same as serving them one
by one, so it is optimal here too. No online policy can beat it on the same trace.

:func:`lru_stream` replays the cache's own exact-LRU policy (stamp = step of last use,
ties by smaller position, empties first by slot number) on the same stream; tests check
it against ``resolve_reference`` so both simulators are known to model the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

Event = tuple  # ("append", int) | ("resolve", np.ndarray int64 [u])
_NEVER = np.int64(1) << 60  # next-use time of a row never used again
_EMPTY = _NEVER + 1  # empty slots are evicted before any row


def _check_S(S: int) -> None:
    if isinstance(S, bool) or not isinstance(S, (int, np.integer)) or S <= 0:
        raise ValueError(f"buffer size S must be a positive int, got {S!r}")


def _resolves(events: Sequence[Event]) -> list[np.ndarray]:
    out = []
    for ev in events:
        if ev[0] == "resolve":
            u = np.unique(np.asarray(ev[1], dtype=np.int64))
            out.append(u[u >= 0])
        elif ev[0] != "append":
            raise ValueError(f"unknown event kind {ev[0]!r}; expected 'append' or 'resolve'")
    return out


def _next_uses(res: list[np.ndarray]) -> tuple[list[np.ndarray], dict[int, int] | np.ndarray, int]:
    """Next-use time of each access (aligned with ``res``) and first use of each position."""
    sizes = [u.size for u in res]
    if not sizes or sum(sizes) == 0:
        return [np.zeros(0, np.int64) for _ in res], np.zeros(0, np.int64), 0
    pos = np.concatenate(res)
    t = np.repeat(np.arange(len(res), dtype=np.int64), sizes)
    order = np.lexsort((t, pos))
    sp, st = pos[order], t[order]
    same_next = np.zeros(sp.size, dtype=bool)
    same_next[:-1] = sp[1:] == sp[:-1]
    nxt_sorted = np.full(sp.size, _NEVER, dtype=np.int64)
    nxt_sorted[:-1] = np.where(same_next[:-1], st[1:], _NEVER)
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    first_mask = np.ones(sp.size, dtype=bool)
    first_mask[1:] = sp[1:] != sp[:-1]
    maxpos = int(pos.max())
    first = np.full(maxpos + 1, _NEVER, dtype=np.int64)
    first[sp[first_mask]] = st[first_mask]
    return np.split(nxt, np.cumsum(sizes)[:-1]), first, maxpos


def _max_len(events: Sequence[Event]) -> int:
    return max([int(ev[1]) for ev in events if ev[0] == "append"], default=0)


def belady_stream(events: Sequence[Event], S: int) -> tuple[np.ndarray, np.ndarray]:
    """Optimal hits and misses per resolve of one stream: (int64 [n], int64 [n])."""
    _check_S(S)
    res = _resolves(events)
    nxt, first, maxpos = _next_uses(res)
    size = max(maxpos, _max_len(events)) + 1
    slot_of = np.full(size, -1, dtype=np.int64)
    cpos = np.full(S, -1, dtype=np.int64)
    cnext = np.full(S, _EMPTY, dtype=np.int64)
    hits = np.zeros(len(res), dtype=np.int64)
    misses = np.zeros(len(res), dtype=np.int64)
    length, reserved, i = 0, -1, 0
    for ev in events:
        if ev[0] == "append":
            n = int(ev[1])
            if n < length:
                raise ValueError(f"append to length {n} after length {length}: lengths only grow")
            p = np.arange(length, min(n, S), dtype=np.int64)
            if p.size:
                slot_of[p] = p
                cpos[p] = p
                fu = np.full(p.size, _NEVER, dtype=np.int64)
                known = p < first.size
                fu[known] = first[p[known]]
                cnext[p] = fu
            if n > length and n - 1 >= S:
                reserved = n - 1
            length = n
            continue
        u, nu = res[i], nxt[i]
        if u.size and int(u[-1]) >= length:
            raise ValueError(f"resolve {i} selects position {int(u[-1])} >= length {length}")
        sl = slot_of[u]
        in_lru = sl >= 0
        hit = in_lru | (u == reserved)
        cnext[sl[in_lru]] = nu[in_lru]
        miss = ~hit
        m = int(miss.sum())
        hits[i], misses[i] = u.size - m, m
        if m:
            score = cnext.copy()
            score[sl[in_lru]] = -1  # used by this resolve: not evictable
            victims = np.argpartition(-score, m - 1)[:m] if m < S else np.arange(S)
            if np.any(score[victims] < 0):
                raise ValueError(f"resolve {i} needs {m} free slots; S={S} is too small")
            old = cpos[victims]
            slot_of[old[old >= 0]] = -1
            cpos[victims] = u[miss]
            slot_of[u[miss]] = victims
            cnext[victims] = nu[miss]
        i += 1
    return hits, misses


def lru_stream(events: Sequence[Event], S: int) -> tuple[np.ndarray, np.ndarray]:
    """The cache's exact-LRU hits and misses per resolve of one stream."""
    _check_S(S)
    res = _resolves(events)
    size = max([int(u[-1]) for u in res if u.size] + [_max_len(events) - 1, 0]) + 1
    slot_of = np.full(size, -1, dtype=np.int64)
    cpos = np.full(S, -1, dtype=np.int64)
    stamp = np.full(S, -1, dtype=np.int64)
    slots = np.arange(S, dtype=np.int64)
    hits = np.zeros(len(res), dtype=np.int64)
    misses = np.zeros(len(res), dtype=np.int64)
    length, reserved, step, i = 0, -1, 0, 0
    for ev in events:
        if ev[0] == "append":
            n = int(ev[1])
            p = np.arange(length, min(n, S), dtype=np.int64)
            slot_of[p], cpos[p], stamp[p] = p, p, step
            if n > length and n - 1 >= S:
                reserved = n - 1
            length = n
            continue
        u = res[i]
        step += 1
        sl = slot_of[u]
        in_lru = sl >= 0
        stamp[sl[in_lru]] = step
        miss_pos = u[~(in_lru | (u == reserved))]  # ascending
        m = miss_pos.size
        hits[i], misses[i] = u.size - m, m
        if m:
            cand = slots[stamp < step]
            if cand.size < m:
                raise ValueError(f"resolve {i} needs {m} free slots; S={S} is too small")
            key = np.where(cpos[cand] >= 0, (stamp[cand] << 32) | cpos[cand], cand - (S + 1))
            victims = cand[np.argsort(key, kind="stable")[:m]]
            old = cpos[victims]
            slot_of[old[old >= 0]] = -1
            cpos[victims], stamp[victims] = miss_pos, step
            slot_of[miss_pos] = victims
        i += 1
    return hits, misses


@dataclasses.dataclass
class _Stream:
    layer: int
    events: list
    steps: list  # global step index of each resolve


class OptimalTracker:
    """Records the streams of a run and computes the Belady bound per layer and step.

    ``instance`` identifies one life of a request (ids are reused after free).
    """

    def __init__(self, *, num_layers: int, buffer_size: int) -> None:
        _check_S(buffer_size)
        self.L, self.S = int(num_layers), int(buffer_size)
        self._streams: dict[tuple[int, int], _Stream] = {}

    def _get(self, layer: int, instance: int) -> _Stream:
        key = (layer, instance)
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = _Stream(layer, [], [])
        return st

    def append(self, layer: int, instance: int, new_len: int) -> None:
        self._get(layer, instance).events.append(("append", int(new_len)))

    def resolve(self, layer: int, instance: int, step: int, positions: np.ndarray) -> None:
        u = np.unique(np.asarray(positions, dtype=np.int64))
        st = self._get(layer, instance)
        st.events.append(("resolve", u[u >= 0]))
        st.steps.append(int(step))

    def compute(self, num_steps: int) -> dict:
        """{'hits': int64 [L, num_steps], 'misses': int64 [L, num_steps]} of the optimum."""
        hits = np.zeros((self.L, num_steps), dtype=np.int64)
        misses = np.zeros((self.L, num_steps), dtype=np.int64)
        for st in self._streams.values():
            if not st.steps:
                continue
            h, m = belady_stream(st.events, self.S)
            idx = np.asarray(st.steps, dtype=np.int64)
            np.add.at(hits[st.layer], idx, h)
            np.add.at(misses[st.layer], idx, m)
        return {"hits": hits, "misses": misses}


def hit_rate(hits, misses) -> float:
    """hits / (hits + misses), 1.0 when there was nothing to look up."""
    h, m = int(np.sum(hits)), int(np.sum(misses))
    return 1.0 if h + m == 0 else h / (h + m)
