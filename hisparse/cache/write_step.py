"""A forward's append to every layer, planned once: the device side of ``Writer.prepare_step``.

An engine's forward appends the same tokens to every layer, so everything a write
decides on the host (blocks, hot slots, host rows, reserved-slot occupants) is the same
for all layers. ``Writer.prepare_step`` decides it once per forward and hands the
result to the per-layer writes as a :class:`StepPlan`; a per-layer write is then only
its two launches (host mirror, hot-tier update) over the plan's device lists.

Two differences from a plain ``write_plan.WritePlan``:
- The block-table entries of the step's new blocks are written once, when the step is
  prepared (the block table is shared by the layers), so the per-layer lists have
  none.
- With a capacity (``StepCapacity``, a CUDA-graph batch-size bucket) every list is
  padded with -1 to a fixed length and lives in persistent device buffers of that
  bucket: the per-layer launches then have the same shapes and pointers at every step,
  and a graph captured over them replays any later step of the bucket once the step's
  lists were copied in. The kernels skip -1 entries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np
import torch

from .requests import RequestTable
from .write_carry import CarriedPlan
from .write_plan import _NAMES, PlanLayout, WritePlan, pack_lists, single_row_lists, without_host_lists

_BT = ("bt_r", "bt_k", "bt_v")


@dataclasses.dataclass(frozen=True)
class StepCapacity:
    """A bucket: at most ``requests`` requests writing ``tokens`` rows in all."""

    requests: int
    tokens: int

    def caps(self) -> dict[str, int]:
        """Fixed length of every plan list. Per request, the positions below S that it
        writes plus at most one into the reserved slot: hot and row_slot lists hold at
        most tokens + requests entries; one unmap and one length per request; a host
        row per token; block-table entries are not in step plans."""
        hot = self.tokens + self.requests
        caps = dict(hot_dst=hot, hot_tok=hot, sp_idx=hot, sp_pos=hot, sp_r=hot, rs_h=hot, rs_v=hot,
                    unmap=self.requests, host_h=self.tokens, host_tok=self.tokens,
                    len_r=self.requests, len_v=self.requests)
        caps.update({n: 0 for n in _BT})
        return caps

    def layout(self) -> PlanLayout:
        """Where the bucket's padded lists lie in its persistent buffer."""
        return _bucket_layout(self.requests, self.tokens)


@functools.lru_cache(maxsize=64)
def _bucket_layout(requests: int, tokens: int) -> PlanLayout:
    caps = StepCapacity(requests, tokens).caps()
    return PlanLayout.of(tuple(caps[n] for n in _NAMES))


@dataclasses.dataclass(frozen=True)
class StepWork:
    """The requests a step writes, one entry each, in batch order (int64 [n] numpy
    arrays): rid the request id, slot its request slot, inc its incarnation, p0 and p1
    the positions written ``[p0, p1)``, old its reserved occupant before the step."""

    rid: np.ndarray
    slot: np.ndarray
    inc: np.ndarray
    p0: np.ndarray
    p1: np.ndarray
    old: np.ndarray

    def __len__(self) -> int:
        return len(self.rid)

    def tuples(self) -> tuple[tuple[int, int, int, int, int, int], ...]:
        """(rid, slot, incarnation, p0, p1, old) per request, as Python ints."""
        cols = (self.rid, self.slot, self.inc, self.p0, self.p1, self.old)
        return tuple(zip(*(c.tolist() for c in cols)))


NO_WORK = StepWork(*(np.zeros(0, dtype=np.int64) for _ in range(6)))
for _f in dataclasses.fields(NO_WORK):
    getattr(NO_WORK, _f.name).flags.writeable = False  # shared


@dataclasses.dataclass
class StepPlan:
    """The per-layer device lists of one prepared step (``Writer.prepare_step``).

    plan: the lists (no block-table entries); work: the requests written
    (:class:`StepWork`; ``req_work`` the same as tuples); pending: layers whose write
    has not run yet (none when no request writes a row: each layer's write is then a
    no-op); captured: layers whose write was captured in a CUDA graph (it runs when the
    graph is replayed); rows: how many rows a layer's write takes (the bucket's tokens
    when padded, else the batch's total); owner: the writer of the cache that prepared
    it (no other cache takes it); buffers: the bucket's persistent buffers (padded
    steps), which a later step of the bucket takes over. A ``host_written`` step's plan
    has no host lists (no mirror): its writes add ``host_rows`` to the layer's
    device -> host row counter themselves, as a mirrored write's plan would count them.
    """

    plan: WritePlan
    work: StepWork
    pending: set[int]
    rows: int
    generation: int
    owner: object = dataclasses.field(repr=False, compare=False)
    buffers: "PaddedPlan | None" = None
    captured: set[int] = dataclasses.field(default_factory=set)
    plan_recorded: bool = False  # the plan's lists were recorded on the backup stream
    host_written: bool = False  # the rows are in the host pool already: no host mirror (hisparse.pd)
    host_rows: int = 0  # rows a host_written layer write counts in STAT_D2H_ROWS (its plan lists none)
    pooled: WritePlan | None = None  # a host_written step's plan, hot_tok as host rows (hisparse.cache.write_pooled)

    @property
    def req_work(self) -> tuple[tuple[int, int, int, int, int, int], ...]:
        """(request id, request slot, its incarnation, first position, end position,
        reserved occupant before the step) per request written."""
        return self.work.tuples()

    @property
    def stale(self) -> bool:
        """Whether requests were added or freed since this step was prepared (its writes
        are refused then)."""
        return self.generation != self.owner.requests.generation

    def abandon(self, *, captured: bool = False) -> None:
        """Put back every layer of this step whose write did not run (``captured``: and
        those captured in a graph that failed), so that the requests' lengths are what
        they were before it."""
        self.owner.abandon_step(self, captured=captured)

    def before(self, rid: int, slot: int, incarnation: int) -> tuple[int, int] | None:
        """(length, reserved occupant) the request had before this step, when the step
        writes it: the same id, slot and admission (None otherwise)."""
        for i, r, inc, p0, _, old in self.req_work:
            if i == rid and r == slot and inc == incarnation:
                return p0, old
        return None


@dataclasses.dataclass
class PaddedPlan:
    """The persistent device buffers of one capacity: ``buf`` int64 [layout.words] holds
    every list and its int32 copies (``write_plan.PlanLayout``); ``plan`` is the
    WritePlan the kernels read (views of ``buf``); ``owner``: the step whose lists are
    loaded; ``host``: ``buf`` as a numpy array when it is in host memory (a CPU cache),
    else None."""

    buf: torch.Tensor
    layout: PlanLayout
    plan: WritePlan
    owner: object = None
    host: np.ndarray | None = None

    def load(self, lists: np.ndarray) -> None:
        """Copy a step's packed lists (int64 numpy, ``pad_lists``) in, on the current
        stream (in place: a captured graph reads these addresses)."""
        if self.host is not None:
            np.copyto(self.host, lists)
            return
        src = torch.from_numpy(lists)
        self.buf.copy_(src.pin_memory() if self.buf.is_cuda else src, non_blocking=True)


class StepBuffers:
    """Persistent device buffers of padded step plans, one set per capacity."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[StepCapacity, PaddedPlan] = {}

    def get(self, cap: StepCapacity) -> PaddedPlan:
        got = self._bufs.get(cap)
        if got is None:
            layout = cap.layout()
            buf = torch.full((layout.words,), -1, dtype=torch.int64, device=self.device)
            got = PaddedPlan(buf=buf, layout=layout, plan=WritePlan(buf, layout),
                             host=buf.numpy() if buf.device.type == "cpu" else None)
            self._bufs[cap] = got
        return got


_NONE = np.zeros(0, dtype=np.int64)
_NO_BT = NO_BLOCK_ENTRIES = np.zeros((3, 0), dtype=np.int64)  # int64 [3, 0]: no block-table entries
_NONE.flags.writeable = _NO_BT.flags.writeable = False  # shared


@dataclasses.dataclass(frozen=True)
class DecodeCarry:
    """What a decode step leaves for the next step of the same batch: a step of
    ``batch`` (a ``WriteBatch``) whose every request wrote one row at a position >= S
    (that row took the reserved slot), on the hot tier, mirrored to the host.
    ``version``: the request table's ``_version`` once the step was committed; while it
    is the same, every request of the batch holds ``p1`` rows in every layer with
    ``last`` (= p1 - 1) in its reserved slot. int64 [n] each, in batch order: p1, last,
    h (the host row of ``last``), inc (the requests' incarnations), hot_dst (their
    reserved slot's flat hot row, r * (S + 1) + S) and slot (S each). ``follow``: when
    the step was itself planned from a carry, its packed lists, which the next step of
    the same layout derives its own from (``write_carry.CarriedPlan``)."""

    batch: object
    version: int
    p1: np.ndarray
    last: np.ndarray
    h: np.ndarray
    inc: np.ndarray
    hot_dst: np.ndarray
    slot: np.ndarray
    follow: CarriedPlan | None = None

    def lists(self, work: StepWork, t0: np.ndarray, h: np.ndarray, bt: np.ndarray) -> list[np.ndarray]:
        """The host plan (``single_row_lists``: 15 int64 numpy arrays, ``_NAMES`` order)
        of the next step: ``work`` writes row p0 = ``self.p1`` of each request, ``t0``
        (int64 [n]) its row in ``rows``, ``h`` (int64 [n]) its host row, ``bt`` (int64
        [3, n_bt]) the entries of the blocks it opens; every row takes the reserved slot
        from ``last``, whose host row goes (the block ids a live request holds never
        change)."""
        return [bt[0], bt[1], bt[2], self.hot_dst, t0, self.hot_dst, work.p0, work.slot, h, self.slot, self.h, h,
                t0, work.slot, work.p1]


def split_block_entries(lists: list[np.ndarray], *, host: bool = True) -> tuple[np.ndarray, list[np.ndarray]]:
    """(block-table entries int64 [3, n_bt], the lists with the block-table ones
    emptied, and with ``host=False`` the host ones too: a ``host_written`` step) of a
    host plan (15 int64 numpy arrays in ``_NAMES`` order)."""
    bt = np.stack(lists[:3]) if len(lists[0]) else _NO_BT
    rest = [_NONE, _NONE, _NONE] + list(lists[3:])
    return bt, rest if host else without_host_lists(rest)


def open_blocks(blk: np.ndarray, r: np.ndarray, p0: np.ndarray, need: np.ndarray | None,
                new_blocks: dict[int, list[int]], *, num_blocks: np.ndarray, B: int) -> np.ndarray:
    """The block-table entries (int64 [3, n_bt]: slot, logical block, host block) of the
    blocks a step of single rows opens, and in ``blk`` (int32 [n], the host block of each
    row, -1 where it opens one; changed in place) the block each such row lands in.
    r, p0: int64 [n] each request's slot and the position it writes; need: int64 [n]
    the blocks it opens (``new_blocks[slot]``, as the allocator will hand them out;
    None when none opens); num_blocks: int64 [R] each slot's blocks before the step."""
    if not new_blocks:
        return _NO_BT
    entries: list[tuple[int, int, int]] = []
    for i in np.flatnonzero(need).tolist():  # the row opens a new block (and any it skips)
        s = int(r[i])
        have, extra = int(num_blocks[s]), new_blocks[s]
        entries.extend((s, have + j, b) for j, b in enumerate(extra))
        blk[i] = extra[int(p0[i]) // B - have]
    return np.array(entries, dtype=np.int64).T


def single_row_hosts(r: np.ndarray, p0: np.ndarray, p1: np.ndarray, num_blocks: np.ndarray, host_blocks: np.ndarray,
                     B: int, new_blocks_of) -> tuple[dict[int, list[int]], np.ndarray, np.ndarray]:
    """(the blocks the rows open, as ``new_blocks_of(r, p1)`` says the allocator will hand
    them out; their block-table entries, int64 [3, n_bt]; each row's host row, int64 [n])
    of rows ``p0`` (int64 [n]) that request slots ``r`` (int64 [n]) write, one each, and
    hold ``p1`` = p0 + 1 rows after (int64 [n]). num_blocks: int64 [R] each slot's blocks
    and host_blocks: int32 [R, NB] which (-1 = none), before the step. CapacityError
    (from ``new_blocks_of``) before any look-up, when a row opens a block the pool can't
    supply."""
    q = p0 // B
    new_blocks, need = {}, None
    if np.count_nonzero(q >= num_blocks[r]):  # CapacityError before the look-up below:
        new_blocks, need = new_blocks_of(r, p1)  # a row past a full pool's last block
    blk = host_blocks[r, q]  # int32 [n], -1 where the row opens a block
    bt = open_blocks(blk, r, p0, need, new_blocks, num_blocks=num_blocks, B=B)
    return new_blocks, bt, blk * B + p0 % B


def single_row_step_lists(work: StepWork, t0: np.ndarray, need: np.ndarray | None, new_blocks: dict[int, list[int]],
                          *, host_blocks: np.ndarray, num_blocks: np.ndarray, B: int, S: int,
                          res_row: np.ndarray | None) -> list[np.ndarray]:
    """The host plan (``write_plan.single_row_lists``: 15 int64 numpy arrays in
    ``_NAMES`` order) of a step whose every request writes one row.

    t0: int64 [n] each request's row in ``rows``; need: int64 [n] the blocks it opens
    (``new_blocks[slot]``, as the allocator will hand them out; None when it opens
    none); host_blocks: int32 [R, NB] each slot's host blocks (-1 = none) and
    num_blocks: int64 [R] how many, before the step; res_row: int64 [n] each request's
    page row when resident, -1 when hot (``DevicePool.page_rows``), None: every
    request is hot."""
    r, p0, old = work.slot, work.p0, work.old
    # row 0: the position written; row 1: the reserved slot's occupant (held before the step)
    pos = np.empty((2, len(r)), dtype=np.int64)
    pos[0] = p0
    np.maximum(old, 0, out=pos[1])
    hp = host_blocks[r, pos // B]  # int32 [2, n]; row 0 -1 for a block the step opens
    bt = open_blocks(hp[0], r, p0, need, new_blocks, num_blocks=num_blocks, B=B)
    hp = hp * B + pos % B  # int64 host rows (they fit int32)
    if res_row is not None and not np.count_nonzero(res_row >= 0):
        res_row = None
    return single_row_lists(r, p0, t0, old, hp[0], hp[1], bt, S=S, res_row=res_row, p1=work.p1)


def step_rows(requests: RequestTable, step: StepPlan | None, req_ids: Sequence[int],
              slots: tuple[int, ...] | np.ndarray) -> np.ndarray:
    """int64 [n, 2, L]: rows per layer (``[:, 0]``) and reserved occupant per layer
    (``[:, 1]``) of live requests ``req_ids`` in ``slots`` (ints or int64 [n]), counting
    a layer that ``step`` has not written yet as it was before the step (for a request
    the step writes: the same id, slot and admission)."""
    slots = np.asarray(slots, dtype=np.int64)
    rows = requests.rows_of(slots)
    if step is None or not step.pending or not len(step.work):
        return rows
    w = step.work
    at = np.full(requests.max_num_reqs, -1, dtype=np.int64)  # slot -> its entry in the step
    at[w.slot] = np.arange(len(w))
    j = at[slots]
    wrid, winc = w.rid.tolist(), w.inc.tolist()
    sel = [i for i in np.flatnonzero(j >= 0).tolist()
           if wrid[j[i]] == req_ids[i] and winc[j[i]] == requests.born[slots[i]]]
    if sel:
        ix = np.ix_(sel, sorted(step.pending))
        rows[:, 0][ix] = w.p0[j[sel]][:, None]
        rows[:, 1][ix] = w.old[j[sel]][:, None]
    return rows


def step_summary(requests: RequestTable, step: StepPlan | None, req_ids: Sequence[int],
                 slots: tuple[int, ...] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``step_rows`` summed up: (same bool [n]: whether every layer of the request holds
    the same rows and occupant; len0, res0 int64 [n]: those, meaningful where ``same``).
    Array operations over the batch, whatever the number of layers, unless ``step`` has
    layers not written yet (then through ``step_rows``)."""
    if step is not None and step.pending and len(step.work):
        rows = step_rows(requests, step, req_ids, slots)
        return (rows == rows[:, :, :1]).all(axis=(1, 2)), rows[:, 0, 0], rows[:, 1, 0]
    return requests.summary(slots)


def pad_lists(lists: list[np.ndarray], cap: StepCapacity) -> np.ndarray:
    """The lists (15 int64 numpy arrays in ``_NAMES`` order, the block-table ones empty)
    each padded with -1 to its capacity, in the bucket's layout
    (``StepCapacity.layout``): int64 [layout.words] numpy. ValueError when a list is
    longer than its capacity."""
    layout = cap.layout()
    for name, x, c in zip(_NAMES, lists, layout.caps):
        if len(x) > c:
            raise ValueError(f"the step writes {len(x)} {name} entries, more than its bucket holds ({c}); "
                             f"bucket {cap}")
    return pack_lists(lists, layout)


__all__ = ["NO_BLOCK_ENTRIES", "DecodeCarry", "StepCapacity", "StepPlan", "StepWork", "NO_WORK", "PaddedPlan", "StepBuffers", "split_block_entries",
           "open_blocks", "pad_lists", "single_row_hosts", "single_row_step_lists", "step_rows", "step_summary"]
