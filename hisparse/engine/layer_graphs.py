"""Per-layer CUDA graphs of a group's padded decode calls, for engines that run eagerly.

An engine that does not capture its decode forward still calls ``write_new_rows`` and
``convert_decode_logical_to_physical_topk`` once per layer, and each call is a few Triton
launches and event operations issued from Python. With ``HiSparseIndexGroup(...,
layer_graphs=True)``, those calls of a padded forward (``prepare_for_batch(md,
pad_to=N)``) replay one small graph per (call, layer, bucket) instead:

- the call's input (rows, or the top-k) is copied into a static buffer of the bucket on
  the current stream; the graph reads it there;
- the first call of a (call, layer, bucket) runs eagerly over the static buffer, which
  compiles the kernels for those pointers; the second captures the same launches on a
  side stream and replays the graph; later calls replay it;
- a graph joins every stream it forks (the host mirror's, the staging's) before it ends,
  so work after a replay on the current stream, or on a stream that follows it, is
  ordered after all of the graph's work;
- the checks and the host-side bookkeeping are the eager call's, run around the replay
  (``Writer.write_step_by``, ``HiSparseCache.resolve_by``): a call that fails a check
  launches nothing and changes nothing.

Events: the cache orders its streams with events (``hisparse.cache.stager``). Before a
replay the current stream waits on each event the eager call would wait on whose last
record was eager (one recorded by a replay is ordered already), and on the stage stream
when eager staging ran since the last replay (the graph forks a stream of its own). After
a replay, the events the graph recorded count as recorded by a replay, as
``note_replay`` does for a whole captured forward. A capture changes no event's state: it
records stand-in CUDA events (``CacheStreams.lend_events``), since an event recorded during
capture can no longer be waited on outside it.

The eager path runs instead for conversions with ``wait=False``, ``decode_attention``,
``prefetch``, unpadded forwards, and every call made while the current stream is being
captured (an engine capturing its own forward).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..cache.cache import HiSparseCache
from ..cache.stager import capturing
from ..cache.write_step import StepPlan

__all__ = ["CudaGraphBackend", "LayerGraphs"]


class CudaGraphBackend:
    """Captures a function's launches into a ``torch.cuda.CUDAGraph`` on a side stream
    (each graph its own memory pool: the captured calls allocate nothing) and replays it
    on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            g.capture_begin()
            try:
                fn()
            except BaseException:
                try:
                    g.capture_end()  # ends the (invalidated) capture; the graph is dropped
                except Exception:  # noqa: BLE001 -- the first error is the one to report
                    pass
                raise
            g.capture_end()
        return g

    def replay(self, g: torch.cuda.CUDAGraph) -> None:
        g.replay()


class _Graph:
    """A captured call: the backend's graph and the cache events it records."""

    __slots__ = ("graph", "events", "lent")

    def __init__(self, graph: object, events: list, lent: list) -> None:
        self.graph = graph
        self.events = events  # the cache's ``_Event``s the graph records (flags set on replay)
        self.lent = lent  # the stand-in CUDA events it was captured with, kept alive with it


class LayerGraphs:
    """The per-layer graphs of one group's cache (see the module docstring).

    backend: ``CudaGraphBackend`` on CUDA; anything with ``capture(fn) -> graph`` and
    ``replay(graph)`` (the CPU tests use a stand-in that records the cache's launch
    functions and calls them again).
    """

    def __init__(self, cache: HiSparseCache, backend) -> None:
        self.cache = cache
        self.backend = backend
        self.graphs: dict[tuple, _Graph] = {}
        self.warm: set[tuple] = set()
        self._rows: dict[int, torch.Tensor] = {}  # tokens -> uint8 [tokens, row_bytes]
        self._topk: dict[tuple[int, int], torch.Tensor] = {}  # (tokens, K) -> int32 [tokens, K]
        self._stage_seen = cache.streams.stage_eager_records[0]
        self.counts = {"eager": 0, "captures": 0, "replays": 0}

    def applies(self, step: StepPlan) -> bool:
        """Whether this forward's calls replay graphs: a padded step, outside a capture."""
        return step.buffers is not None and not capturing(self.cache.device)

    # ------------------------------------------------------------------ the inputs
    def rows_buffer(self, tokens: int) -> torch.Tensor:
        """The static rows buffer of a bucket: uint8 [tokens, row_bytes]. A write given
        this very tensor reads it in place (no copy)."""
        static = self._rows.get(tokens)
        if static is None:
            static = torch.empty((tokens, self.cache.cfg.row_bytes), dtype=torch.uint8, device=self.cache.device)
            self._rows[tokens] = static
        return static

    def topk_buffer(self, tokens: int, k: int) -> torch.Tensor:
        """The static top-k buffer of a bucket: int32 [tokens, k]. A conversion given
        this very tensor reads it in place (no copy)."""
        static = self._topk.get((tokens, k))
        if static is None:
            static = torch.empty((tokens, k), dtype=torch.int32, device=self.cache.device)
            self._topk[(tokens, k)] = static
        return static

    # ------------------------------------------------------------------ the calls
    def write(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """``cache.write_step(layer, step, rows)`` (rows uint8 [step.rows, row_bytes],
        checked by the caller) through the layer's write graph of the bucket."""
        cache = self.cache
        static = self._rows.get(step.rows)
        if static is None:
            static = self.rows_buffer(step.rows)
        key = ("write", layer, id(step.buffers))
        got = self.graphs.get(key)
        if got is None and key not in self.warm:
            cache.check_write_step(layer, step)  # before the copy: a refused call launches nothing
            if rows is not static:
                static.copy_(rows)
            cache.write_step(layer, step, static)
            cache.join_backup()  # the host mirror read ``static``: the next copy into it waits
            self.warm.add(key)
            self.counts["eager"] += 1
            return

        def launch() -> None:
            g = got if got is not None else self._capture(
                key, lambda: cache.launch_write_step(layer, step, static))
            if rows is not static:
                static.copy_(rows)
            cs = cache.streams
            self._wait_eager((cs.resolved[layer], cs.backup))
            self._replay(g)

        cache.write_step_by(layer, step, launch)

    def convert(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor):
        """``cache.resolve(layer, req_ids, topk, validate=False, wait=True)`` (topk int32
        [T, K], checked by the caller; req_ids the forward's persistent decode ids) through
        the layer's resolve graph; returns its ``ResolveResult``."""
        cache = self.cache
        T, K = topk.shape
        static = self._topk.get((T, K))
        if static is None:
            static = self.topk_buffer(T, K)
        key = ("convert", layer, req_ids.data_ptr(), T, K)
        got = self.graphs.get(key)
        if got is None and key not in self.warm:
            cache.check_resolve(layer, req_ids, topk)  # before the copy
            if topk is not static:
                static.copy_(topk)
            res = cache.resolve(layer, req_ids, static, validate=False, wait=True)
            self.warm.add(key)
            self.counts["eager"] += 1
            return res

        def launch() -> None:
            g = got if got is not None else self._capture(
                key, lambda: cache.launch_resolve(layer, req_ids, static))
            if topk is not static:
                static.copy_(topk)
            cs = cache.streams
            if cs.stage_eager_records[0] != self._stage_seen and cs.streams.stage is not None:
                # eager staging in flight: the graph's own fork of the stage stream is not after it
                cs.current().wait_stream(cs.streams.stage)
            self._wait_eager((cs.resolved[layer], cs.backup))
            self._replay(g)

        if got is None:  # the capture's call: every check again
            res = cache.resolve_by(layer, req_ids, static, launch)
        else:  # this key's arguments passed those checks when it was warmed up
            res = cache.resolve_replay(layer, T, K, launch)
        self._stage_seen = cache.streams.stage_eager_records[0]
        return res

    def _wait_eager(self, events) -> None:
        """The current stream waits on those of ``events`` last recorded eagerly (one a
        replay recorded is ordered already); the stream is looked up only when one is."""
        eager = [ev for ev in events if ev.event is not None and ev.recorded and not ev.in_capture]
        if eager:
            cur = self.cache.streams.current()
            for ev in eager:
                ev.wait_by(cur, False)

    # ------------------------------------------------------------------ capture / replay
    def _capture(self, key: tuple, fn: Callable[[], None]) -> _Graph:
        cs = self.cache.streams
        before = cs.flags()
        real = cs.lend_events()  # the capture records stand-ins: the real events stay waitable
        try:
            cs.forget_captured()  # events a replay recorded can't be waited on inside a capture
            graph = self.backend.capture(fn)
            events = cs.recorded_since(before)
        finally:
            cs.restore_flags(before)  # what a capture records runs only when it is replayed
            lent = cs.return_events(real)
        got = self.graphs[key] = _Graph(graph, events, lent)
        self.counts["captures"] += 1
        return got

    def _replay(self, g: _Graph) -> None:
        self.backend.replay(g.graph)
        for ev in g.events:
            ev.recorded, ev.in_capture = True, True
        self.counts["replays"] += 1

    def report(self) -> dict:
        return {"graphs": len(self.graphs), **self.counts}

