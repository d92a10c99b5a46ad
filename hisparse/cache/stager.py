"""Streams and events of the cache, and the resolve + miss staging launches.

Streams (``hisparse.device.Streams``; every one None on CPU):
  compute  the caller's current stream: hot-row writes and bookkeeping
  backup   host mirror of newly written rows (device -> pinned host), records ``backup``
  stage    resolve + miss staging (pinned host -> hot rows), after it waits on the
           compute stream and on ``backup``; records the layer's stage event

Ordering rules (each one an event wait, never a host sync):
  - staging waits on ``backup``: no slot is refilled before the row it held is on host;
  - the compute stream waits on the last stage event before it changes state again
    (append / add / free), and on a layer's stage event before attention reads it;
  - an append that overwrites a reserved slot waits on ``backup`` first.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..device import Streams
from .rollback import rollback_resolve
from .state import HotState, ResolveBuffers


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Event:
    """A CUDA event that remembers whether it was recorded during graph capture.

    A wait is skipped when the event was recorded on the other side of a capture
    boundary: a captured stream may not wait on an event recorded outside the capture,
    and an event recorded during capture marks nothing outside the graph. Graph replays
    run on the compute stream, which every stream here already waits on, so the only
    case left to the caller is eager work before a replay: see
    :meth:`CacheStreams.join_backup`. On CPU every call is a no-op.
    """

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event() if cuda else None
        self.recorded = False
        self.in_capture = False

    def record(self, stream, in_capture: bool) -> None:
        if self.event is None:
            return
        self.event.record(stream)
        self.recorded = True
        self.in_capture = in_capture

    def wait_by(self, stream, in_capture: bool) -> None:
        if self.event is None or not self.recorded or self.in_capture != in_capture:
            return
        stream.wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None and self.recorded:
            self.event.synchronize()


class CacheStreams:
    """The cache's streams and the events that order them (see the module docstring)."""

    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.streams = Streams(device)
        self.cuda = self.streams.cuda
        self.backup = _Event(self.cuda)
        self.stage = [_Event(self.cuda) for _ in range(num_layers)]
        self.last_stage: _Event | None = None

    def current(self):
        return self.streams.current()

    def capturing(self) -> bool:
        return capturing(self.device)

    def after_stage(self) -> tuple[object, bool]:
        """The compute stream waits for in-flight resolves; returns (stream, capturing)."""
        cur, cap = self.current(), self.capturing()
        if self.last_stage is not None:
            self.last_stage.wait_by(cur, cap)
        return cur, cap

    def join_backup(self, stream=None) -> None:
        """``stream`` (default current) waits until every host mirror copy is done."""
        if not self.cuda:
            return
        stream = stream if stream is not None else self.current()
        self.backup.wait_by(stream, self.capturing())


class Stager:
    """Resolve + miss staging of one cache on the stage stream.

    resolve_fn(state, layer, req_ids, topk, out, max_query_len=, compact=) updates the
    LRU state and fills ``out``; copy_fn(src, src_idx, dst, dst_idx) copies rows. When
    the copy launch raises after the resolve launch ran, the resolve is rolled back
    (``cache.rollback``) before the error propagates, so the failed call changes nothing.
    """

    def __init__(self, streams: CacheStreams, state: HotState, *, resolve_fn: Callable,
                 copy_fn: Callable, max_query_len: int) -> None:
        self.streams = streams
        self.state = state
        self.resolve_fn = resolve_fn
        self.copy_fn = copy_fn
        self.max_query_len = max_query_len

    def run(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, out: ResolveBuffers, *,
            host_rows: torch.Tensor, hot_rows: torch.Tensor, compact: bool, wait: bool):
        """Resolve ``topk`` of ``layer`` into ``out`` and stage the misses from
        ``host_rows`` (uint8 [H, row_bytes]) into ``hot_rows`` (uint8 [N, row_bytes]).

        Returns the layer's stage event (None on CPU); with ``wait`` the current stream
        already waits on it.
        """
        cs = self.streams
        cur, cap = cs.current(), cs.capturing()
        stage = cs.streams.stage
        if stage is not None:
            stage.wait_stream(cur)
            cs.backup.wait_by(stage, cap)
        ev = cs.stage[layer]
        with cs.streams.on(stage):
            self.resolve_fn(self.state, layer, req_ids, topk, out, max_query_len=self.max_query_len,
                            compact=compact)
            try:
                self.copy_fn(host_rows, out.stage_src, hot_rows, out.stage_dst)
            except BaseException:
                if cap:  # a failed capture is discarded by its owner; nothing ran
                    raise
                if stage is not None:
                    stage.synchronize()
                rollback_resolve(self.state, layer, req_ids, topk, out,
                                 max_query_len=self.max_query_len)
                if stage is not None:
                    stage.synchronize()
                raise
            ev.record(stage, cap)
        cs.last_stage = ev
        if stage is not None and not cap:
            req_ids.record_stream(stage)
            topk.record_stream(stage)
        if wait:
            ev.wait_by(cur, cap)
        return ev.event


__all__ = ["CacheStreams", "Stager", "capturing"]
