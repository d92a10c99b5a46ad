"""Streams and events of the cache, and the resolve + miss staging launches.

Streams (``hisparse.device.Streams``; every one None on CPU):
  compute  the caller's current stream: hot-row writes and bookkeeping
  backup   host mirror of newly written rows (device -> pinned host), records ``backup``
  stage    resolve + miss staging (pinned host -> hot rows), after it waits on the
           compute stream and on ``backup``; records the layer's stage event

Ordering rules (each one an event wait, never a host sync):
  - staging waits on ``backup``: no slot is refilled before the row it held is on host;
  - an append to layer l waits on the layer's ``resolved`` event (its last resolve's
    state updates; the copy into victim slots may still run: an append never writes a
    victim slot); add / free_request wait on every layer's stage event;
  - attention (and the next resolve of the layer) waits on the layer's stage event;
  - an append that overwrites a reserved slot waits on ``backup`` first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .._checks import check_int
from ..device import Streams, capturing
from .rollback import rollback_resolve
from .state import STAT_PREFETCH, HotState, ResolveBuffers

if TYPE_CHECKING:
    from .kernel_set import CacheKernels


class _Event:
    """A CUDA event that remembers whether it was recorded during graph capture.

    A wait is skipped when the event was recorded on the other side of a capture
    boundary: a captured stream may not wait on an event recorded outside the capture,
    and an event recorded during capture marks nothing outside the graph (nor in another
    capture: ``CacheStreams.capturing`` forgets such events when a new capture starts). Graph replays
    run on the compute stream, which every stream here already waits on, so the only
    case left to the caller is eager work before a replay: see
    :meth:`CacheStreams.join_backup`. On CPU every call is a no-op.
    """

    def __init__(self, cuda: bool, eager_records: list[int] | None = None) -> None:
        self.event = torch.cuda.Event() if cuda else None
        self.recorded = False
        self.in_capture = False
        self.records = 0  # how many times it was recorded (``CacheGraphs.capture``)
        self._eager_records = eager_records  # a counter shared by a group of events, or None

    def record(self, stream, in_capture: bool) -> None:
        if self.event is None:
            return
        self.event.record(stream)
        self.recorded = True
        self.in_capture = in_capture
        self.records += 1
        if self._eager_records is not None and not in_capture:
            self._eager_records[0] += 1

    def wait_by(self, stream, in_capture: bool) -> None:
        if self.event is None or not self.recorded or self.in_capture != in_capture:
            return
        stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Host wait for the recorded work. An event recorded during capture marks a
        graph node (it can't be waited on from the host): the device is synchronized
        instead, which covers every replay enqueued so far."""
        if self.event is None or not self.recorded:
            return
        if self.in_capture:
            torch.cuda.synchronize()
        else:
            self.event.synchronize()


class CacheStreams:
    """The cache's streams and the events that order them (see the module docstring)."""

    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.streams = Streams(device)
        self.cuda = self.streams.cuda
        self.backup = _Event(self.cuda)
        # eager records of any stage event: work on the stage stream a graph replay's own
        # fork of it would not be ordered after (``hisparse.engine.layer_graphs``)
        self.stage_eager_records = [0]
        self.stage = [_Event(self.cuda, self.stage_eager_records) for _ in range(num_layers)]  # staging done
        self.resolved = [_Event(self.cuda) for _ in range(num_layers)]  # its state updates done
        self._was_capturing = False
        # ``follow``'s event: recorded and waited on back to back, so one serves every call
        # (a wait binds to the record before it; ``Stream.wait_stream`` makes a new event each time)
        self._fork = torch.cuda.Event() if self.cuda else None

    def follow(self, stream, cur) -> None:
        """``stream`` waits for the work enqueued on ``cur`` so far (CUDA streams)."""
        self._fork.record(cur)
        stream.wait_event(self._fork)

    def events(self) -> list[_Event]:
        """Every event of the cache: the host mirror's, then each layer's stage and
        resolved events."""
        return [self.backup, *self.stage, *self.resolved]

    @property
    def stage_stream(self):
        """The stream staging runs on (None on CPU)."""
        return self.streams.stage

    def current(self):
        return self.streams.current()

    def flags(self) -> list[tuple[bool, bool, int]]:
        """(recorded, in_capture, records) of every event (``CacheGraphs.capture`` puts
        them back around a capture whose graph replays later)."""
        return [(ev.recorded, ev.in_capture, ev.records) for ev in self.events()]

    def note_replay(self) -> None:
        """A graph captured over this cache's calls is about to be replayed: the events'
        latest work is the replay's, which a host wait can only cover by a device sync
        (``_Event.synchronize``) and which every stream here is ordered after already."""
        for ev in self.events():
            if ev.event is not None:
                ev.recorded, ev.in_capture = True, True

    def capturing(self) -> bool:
        """Whether the current stream is being captured. The first capturing call after
        eager ones starts a new capture: events recorded in an earlier capture belong to
        another graph (a wait on them would be invalid in this one) and are forgotten;
        the replays they stand for run on the compute stream, which every stream here
        waits on."""
        cap = capturing(self.device)
        if cap and not self._was_capturing:
            for ev in self.events():
                if ev.in_capture:
                    ev.recorded = False
        self._was_capturing = cap
        return cap

    def before_write(self, layer: int) -> tuple[object, bool]:
        """The compute stream waits for the layer's in-flight resolve state updates;
        returns (stream, capturing)."""
        cur = self.current()
        self.wait_resolved(layer, cur)
        return cur, self.capturing()

    def wait_resolved(self, layer: int, stream=None) -> None:
        """``stream`` (default current) waits until the last resolve of ``layer`` updated
        the LRU state and chose its slots (a split resolve's miss phase), but not for its
        staging; inside a capture, for the one captured."""
        cap = self.capturing()
        self.resolved[layer].wait_by(stream if stream is not None else self.current(), cap)

    def wait_staging(self, layer: int, stream=None) -> None:
        """``stream`` (default current) waits until the last staging of ``layer`` (a
        ``resolve(..., wait=False)``) landed; inside a capture, for the one captured."""
        cap = self.capturing()
        self.stage[layer].wait_by(stream if stream is not None else self.current(), cap)

    def join_staging(self) -> None:
        """The current stream waits for every layer's in-flight resolve and staging
        (before buffers those read are rewritten; add / free_request do)."""
        cur, cap = self.current(), self.capturing()
        for ev in self.stage:
            ev.wait_by(cur, cap)

    def join_backup(self, stream=None) -> None:
        """``stream`` (default current) waits until every host mirror copy is done; needed
        before replaying a captured resolve after eager appends, or before staging reads
        rows appended in the same step from host."""
        if not self.cuda:
            return
        stream = stream if stream is not None else self.current()
        self.backup.wait_by(stream, self.capturing())


@dataclasses.dataclass(frozen=True)
class CopyShape:
    """Launch shape of the staging copy (``transfer.copy_staged``): ``programs`` in its
    persistent grid, ``rows`` moved by a program per iteration, ``warps`` per program.
    The scattered rows' reads are bound by how many are in flight, so few programs of
    many rows move them as fast as a quarter of the SMs does, and leave the SMs to work
    running beside the copy (a split layer's hit attention)."""

    programs: int
    rows: int
    warps: int

    def __post_init__(self) -> None:
        check_int("programs", self.programs, 1)
        for name in ("rows", "warps"):
            v = check_int(name, getattr(self, name), 1)
            if v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")


class Stager:
    """Resolve + miss staging of one cache on the stage stream.

    kernel_set (``hisparse.cache.kernel_set``): ``resolve`` updates the LRU state and fills
    ``out``; ``copy_staged`` stages its misses; ``lookup`` is a split resolve's hit phase,
    ``resolve_resident`` the resident path. ``stage_programs``: the staging kernel's grid
    (None = a quarter of the SMs, so that it runs beside the attention). When
    the copy launch raises after the resolve launch ran, the resolve is rolled back
    (``cache.rollback``) before the error propagates, so the failed call changes nothing.
    """

    def __init__(self, streams: CacheStreams, state: HotState, kernel_set: CacheKernels, *,
                 max_query_len: int) -> None:
        self.streams = streams
        self.state = state
        self.kernel_set = kernel_set
        self.max_query_len = max_query_len
        self._stage_programs: int | None = None

    @property
    def stage_programs(self) -> int | None:
        """The staging kernel's grid (None = a quarter of the SMs)."""
        return self._stage_programs

    @stage_programs.setter
    def stage_programs(self, programs: int | None) -> None:
        if programs is not None:  # checked here, not part-way through a resolve
            check_int("stage_programs", programs, 1)
        self._stage_programs = programs

    def _undo(self, layer: int, req_ids, topk, out: ResolveBuffers, *, miss_phase_ran: bool,
              streams: tuple, rows: tuple) -> None:
        """A later launch of the call failed: wait for what ran, then roll it back
        (``rows``: the layer's (hot rows, host rows), to restore victims' bytes)."""
        for st in streams:
            if st is not None:
                st.synchronize()
        rollback_resolve(self.state, layer, req_ids, topk, out, max_query_len=self.max_query_len,
                         miss_phase_ran=miss_phase_ran, hot_rows=rows[0], host_rows=rows[1])
        for st in streams:
            if st is not None:
                st.synchronize()

    def run(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, out: ResolveBuffers, *,
            host_rows: torch.Tensor, hot_rows: torch.Tensor, compact: bool, wait: bool):
        """Resolve ``topk`` of ``layer`` into ``out`` and stage the misses from
        ``host_rows`` (uint8 [H, row_bytes]) into ``hot_rows`` (uint8 [N, row_bytes]).

        Returns the layer's stage event (None on CPU); with ``wait`` the current stream
        already waits on it.
        """
        return self._resolve_and_stage(layer, req_ids, topk, out, host_rows=host_rows, hot_rows=hot_rows,
                                       wait=wait, compact=compact, prefetch=False)

    def _resolve_and_stage(self, layer: int, req_ids, topk, out: ResolveBuffers, *, host_rows, hot_rows,
                           wait: bool, compact: bool, prefetch: bool):
        """One resolve launch and its staging copy on the stage stream (both undone when
        the copy launch fails); records the layer's events."""
        cs = self.streams
        cur, cap = cs.current(), cs.capturing()
        stage = cs.streams.stage
        if stage is not None:
            cs.follow(stage, cur)
            cs.backup.wait_by(stage, cap)
        ev = cs.stage[layer]
        with cs.streams.on(stage):
            self.kernel_set.resolve(self.state, layer, req_ids, topk, out, max_query_len=self.max_query_len,
                            compact=compact, prefetch=prefetch)
            cs.resolved[layer].record(stage, cap)
            try:
                self.kernel_set.copy_staged(host_rows, out, hot_rows, K=topk.shape[1], programs=self.stage_programs)
            except BaseException:
                if not cap:  # a failed capture is discarded by its owner; nothing ran
                    if prefetch:
                        self._undo_prefetch(layer, req_ids, topk, out, stage, (hot_rows, host_rows))
                    else:
                        self._undo(layer, req_ids, topk, out, miss_phase_ran=True, streams=(stage,),
                                   rows=(hot_rows, host_rows))
                raise
            ev.record(stage, cap)
        if stage is not None and not cap:
            req_ids.record_stream(stage)
            topk.record_stream(stage)
        if wait:
            ev.wait_by(cur, cap)
        return ev.event

    def run_resident(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, out: ResolveBuffers, *,
                     compact: bool, wait: bool = True):
        """The resolve of a batch whose live requests are all resident, one launch of
        ``kernel_set.resolve_resident`` on the current stream after the layer's earlier staging work
        (which wrote the same buffers): nothing to stage. One launch that changes only
        counters: nothing to undo when it raises. Under capture the current stream then
        joins the host mirror's stream: a captured write forked it, and a capture must
        join every stream it forks. The join comes after the launch, so the mirror's
        copy to host runs beside the resolve instead of before it (nothing here reads
        the host rows; eagerly nothing waits for the mirror). Returns None with
        ``wait`` (the current stream is ordered after the launch already); without it
        the layer's stage event, recorded after the launch, for a reader on another
        stream (``ResolveResult.wait``, ``wait_staging``)."""
        cs = self.streams
        cur, cap = cs.current(), cs.capturing()
        cs.stage[layer].wait_by(cur, cap)
        self.kernel_set.resolve_resident(self.state, layer, req_ids, topk, out, max_query_len=self.max_query_len, compact=compact)
        if cap:
            cs.backup.wait_by(cur, cap)
        if wait:
            return None
        ev = cs.stage[layer]
        ev.record(cur, cap)
        return ev.event

    def run_paged(self, layer: int, launch):
        """``run_resident`` with the resolve folded into another launch: ``launch()``
        enqueues a kernel that maps the top-k itself (``kernels.paged_rows``) on the
        current stream, ordered as the resident resolve would be (after the layer's
        earlier staging work; under capture the current stream then joins the host
        mirror's). Returns what ``launch`` returns."""
        cs = self.streams
        cur, cap = cs.current(), cs.capturing()
        cs.stage[layer].wait_by(cur, cap)
        got = launch()
        if cap:
            cs.backup.wait_by(cur, cap)
        return got

    def run_split(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, out: ResolveBuffers,
                  hit: torch.Tensor, miss_lists: tuple, *, host_rows: torch.Tensor,
                  hot_rows: torch.Tensor, compact: bool, copy_shape: CopyShape | None = None):
        """A split resolve: the hit phase on the current (compute) stream, then on the
        stage stream the miss phase and the staging copy. ``copy_shape``: the copy
        kernel's launch shape (None: its default; ``stage_programs``, when set,
        overrides the programs). Returns the layer's stage event (None on CPU). Any launch
        that raises is undone before the error propagates."""
        if copy_shape is not None and not isinstance(copy_shape, CopyShape):
            raise TypeError(f"copy_shape must be a CopyShape or None, got {type(copy_shape).__name__}")
        cs = self.streams
        cur, cap = cs.current(), cs.capturing()
        cs.stage[layer].wait_by(cur, cap)  # earlier work of this layer (a prefetch) first
        self.kernel_set.lookup(self.state, layer, req_ids, topk, hit, out.undo_hit,
                       max_query_len=self.max_query_len)
        stage = cs.streams.stage
        if stage is not None:
            cs.follow(stage, cur)
            cs.backup.wait_by(stage, cap)
        ev = cs.stage[layer]
        miss_ran = False
        with cs.streams.on(stage):
            try:
                self.kernel_set.resolve(self.state, layer, req_ids, topk, out, max_query_len=self.max_query_len,
                                compact=compact, stamped=True, miss_lists=miss_lists)
                miss_ran = True
                cs.resolved[layer].record(stage, cap)
                programs = self.stage_programs
                if programs is None and copy_shape is not None:
                    programs = copy_shape.programs
                shape = None if copy_shape is None else (copy_shape.rows, copy_shape.warps)
                self.kernel_set.copy_staged(host_rows, out, hot_rows, K=topk.shape[1], programs=programs, shape=shape)
            except BaseException:
                if not cap:
                    self._undo(layer, req_ids, topk, out, miss_phase_ran=miss_ran, streams=(cur, stage),
                               rows=(hot_rows, host_rows))
                raise
            ev.record(stage, cap)
        if stage is not None and not cap:
            req_ids.record_stream(stage)
            topk.record_stream(stage)
        return ev.event

    def run_prefetch(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, out: ResolveBuffers, *,
                     host_rows: torch.Tensor, hot_rows: torch.Tensor):
        """Stage ``topk`` (a predicted selection) into ``layer``'s hot rows on the stage
        stream, as a resolve that counts only the rows it stages (STAT_PREFETCH).
        Returns the layer's stage event; the layer's next resolve waits on it."""
        return self._resolve_and_stage(layer, req_ids, topk, out, host_rows=host_rows, hot_rows=hot_rows,
                                       wait=False, compact=False, prefetch=True)

    def _undo_prefetch(self, layer: int, req_ids, topk, out: ResolveBuffers, stage, rows: tuple) -> None:
        if stage is not None:
            stage.synchronize()
        st = self.state.stats[layer].clone()
        rollback_resolve(self.state, layer, req_ids, topk, out, max_query_len=self.max_query_len,
                         hot_rows=rows[0], host_rows=rows[1])
        self.state.stats[layer] = st  # a prefetch counted only its staged rows
        self.state.stats[layer, STAT_PREFETCH] -= int((out.stage_dst[:topk.numel()] >= 0).sum())


__all__ = ["CacheStreams", "CopyShape", "Stager"]
