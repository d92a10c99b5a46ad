"""The packed lists of a chain of carried decode steps (``Writer.prepare_step``).

A decode step planned from what the last step of the same batch carried
(``write_step.DecodeCarry``) writes one row per request at ``p0`` = the last step's
``p1``, into the reserved slot, and its lists (``DecodeCarry.lists``) differ from the
last step's only where a position or a host row is listed: ``sp_pos`` (p0), ``len_v``
(p1), ``rs_h`` and ``host_h`` (the row's host row h) and their int32 copies move on by
one, and ``unmap`` becomes the last step's h. A request's h moves on by one too, unless
its row is the first of a block (p0 % B == 0: the host row is that block's first).

:class:`CarriedPlan` keeps a carried step's packed lists (``pack_lists`` /
``pad_lists``, the bucket's layout when padded) and derives the next step's from them
with one addition of a fixed ``delta``; the requests whose row starts a block are
known ahead from each one's position modulo B (``crossing``) and get their host rows
looked up. The result is the buffer ``pack_lists`` / ``pad_lists`` makes of the next
step's lists, word for word.

On a CPU cache a plan's tensors are views of its host buffer, so the eager steps of a
chain take two plans in turn (:class:`HostPlans`) and copy their lists in, instead of
making (and later dropping) a plan's tensors every step.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import torch

from .write_plan import _I32_INDEX, _NAMES, PlanLayout, WritePlan

_SP_POS, _RS_H, _UNMAP, _HOST_H, _LEN_V = (_NAMES.index(n) for n in ("sp_pos", "rs_h", "unmap", "host_h", "len_v"))
_MOVED = (_SP_POS, _RS_H, _UNMAP, _HOST_H, _LEN_V)  # the lists whose entries move on by one each step
_H32 = _I32_INDEX.index(_HOST_H)  # host_h's place among the int32 copies


class HostPlans:
    """Two plans over host buffers (a CPU cache's) that a chain's eager steps take in turn.

    A plan is written over (its buffer's words replaced) only once the step that took it
    last is done: dropped, or every layer written and none captured (``owners``: a weak
    reference to that step), so no write reads it again. The step before keeps the
    other plan."""

    def __init__(self, layout: PlanLayout) -> None:
        self.layout = layout
        self.bufs: list[np.ndarray | None] = [None, None]  # int64 [layout.words] each
        self.plans: list[WritePlan | None] = [None, None]
        self.owners: list[weakref.ref | None] = [None, None]

    def take(self, k: int, packed: np.ndarray) -> WritePlan | None:
        """Plan ``k`` (0 or 1) holding ``packed`` (int64 [layout.words]), or None while the
        step that took it last may still write a layer."""
        ref = self.owners[k]
        step = ref() if ref is not None else None
        if step is not None and (step.pending or step.captured):
            return None
        if self.plans[k] is None:
            self.bufs[k] = buf = np.empty_like(packed)
            self.plans[k] = WritePlan(torch.from_numpy(buf), self.layout)
        np.copyto(self.bufs[k], packed)
        return self.plans[k]

    def own(self, k: int, step: object) -> None:
        """``step`` (a StepPlan) took plan ``k``."""
        self.owners[k] = weakref.ref(step)


@dataclasses.dataclass(slots=True)
class CarriedPlan:
    """The packed lists of a carried step of ``n`` requests, and what the next carried
    step's take from them (not changed once made: ``following`` makes the next).

    packed: int64 [layout.words], the step's lists as ``pack_lists`` lays them out in
    ``layout`` (the bucket's with ``capacity``; never written once made); delta: int64
    [layout.words], +1 at every entry of ``_MOVED`` and of their int32 copies (as int32
    halves of its words: those entries are >= 0, so an int64 addition carries nothing
    into the other half), 0 elsewhere; steps: the steps planned from this chain so far;
    crossing: batch index arrays (int64 [m]) of the requests whose row starts a block
    in the next step, keyed by ``steps`` modulo B (absent: none); crossed: the batch
    indices of the requests whose row started a block in this step (their next
    ``unmap`` entry does not follow by one), None when none did; host: the plans the
    chain's eager steps take in turn on a CPU cache (None: a new plan each step)."""

    packed: np.ndarray
    layout: PlanLayout
    capacity: object
    n: int
    delta: np.ndarray
    crossing: dict[int, np.ndarray]
    steps: int
    crossed: np.ndarray | None
    host: HostPlans | None

    @staticmethod
    def start(packed: np.ndarray, layout: PlanLayout, capacity: object, p1: np.ndarray, B: int,
              cpu: bool) -> CarriedPlan:
        """The chain that follows a carried step whose packed lists are ``packed`` (in
        ``layout``, for ``capacity``), its requests holding ``p1`` (int64 [n]) rows;
        ``cpu``: the cache is on the CPU."""
        n = len(p1)
        delta = np.zeros(layout.words, dtype=np.int64)
        o = layout.o64
        for i in _MOVED:
            delta[o[i]:o[i] + n] = 1
        d32, base = delta.view(np.int32), 2 * layout.n64
        for k, i in enumerate(_I32_INDEX):
            if i in _MOVED:
                d32[base + layout.o32[k]:base + layout.o32[k] + n] = 1
        # request i's row starts a block in the step that follows ``steps`` = t with (p1 + t) % B == 0
        due: dict[int, list[int]] = {}
        for i, t in enumerate(((-p1) % B).tolist()):
            due.setdefault(t, []).append(i)
        crossing = {t: np.array(ix, dtype=np.int64) for t, ix in due.items()}
        crossed = crossing.get(-1 % B)  # this step's rows p1 - 1 that started a block ((p1 - 1) % B == 0)
        host = HostPlans(layout) if cpu and capacity is None else None
        return CarriedPlan(packed, layout, capacity, n, delta, crossing, 0, crossed, host)

    def advance(self, B: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(the next step's packed lists but for the host rows of the rows that start a
        block, its p1 (int64 [n], a view of them), the batch indices of those rows or
        None). The packed lists are a new array; nothing here is changed."""
        old, o, n = self.packed, self.layout.o64, self.n
        new = old + self.delta
        if self.crossed is not None:  # their unmap entry is the last step's h, not the one before + 1
            new[o[_UNMAP] + self.crossed] = old[o[_HOST_H] + self.crossed]
        return new, new[o[_LEN_V]:o[_LEN_V] + n], self.crossing.get(self.steps % B)

    def set_host_rows(self, new: np.ndarray, idx: np.ndarray, h: np.ndarray) -> None:
        """Put ``h`` (int64 [m]) as the host row of the requests ``idx`` (batch indices,
        int64 [m]) into ``new`` (``advance``'s packed lists)."""
        o = self.layout.o64
        new[o[_RS_H] + idx] = h
        new[o[_HOST_H] + idx] = h
        new.view(np.int32)[2 * self.layout.n64 + self.layout.o32[_H32] + idx] = h

    def following(self, new: np.ndarray, crossed: np.ndarray | None) -> CarriedPlan:
        """The chain one step on: ``new`` the packed lists of the step just planned,
        ``crossed`` the batch indices of its rows that started a block (or None)."""
        return CarriedPlan(new, self.layout, self.capacity, self.n, self.delta, self.crossing, self.steps + 1, crossed,
                           self.host)

    def host_rows(self) -> np.ndarray:
        """int64 [n]: each request's host row h in this step (a view of ``packed``)."""
        o = self.layout.o64[_HOST_H]
        return self.packed[o:o + self.n]


__all__ = ["CarriedPlan", "HostPlans"]
