"""CUDA graphs as a mode of the cache's calls: ``HiSparseCache.graphs``.

An engine that captures the cache's per-layer calls into graphs of its own (as
``hisparse.engine.layer_graphs`` does) plans each call once and then runs it, the same
call whether its launches are enqueued eagerly or replayed from a graph:

  call = cache.graphs.plan_resolve(layer, req_ids, topk)   # checked once, buffers fixed
  captured = cache.graphs.capture(lambda: backend.capture(lambda: call.launch(topk)))
  result = call.run(replay=lambda: backend.replay(captured.graph))   # every later step

``plan_resolve`` / ``plan_write`` make the checks an unchecked call makes before it
launches (a refused call launches nothing). ``launch`` enqueues the call's launches
alone, with no bookkeeping: what a capture records. ``run`` is the call: the checks
whose outcome can change since it was planned (the host pool's pinning, a write step's
freshness), then its launches -- its own, or ``replay()`` -- then the host-side
bookkeeping the eager call does (LRU epochs, the write's pending layers, the host pool's
commit). Before ``replay()`` the current stream waits on the cache's events last
recorded eagerly, which a graph's own work is not ordered after.

``capture`` captures with every event's state kept as it was: a CUDA event recorded
during capture can no longer be waited on outside it, so the capture records stand-ins
(kept alive with the graph) and the real events keep their last eager record; the
returned ``Captured`` marks, at each ``replayed()``, the events the graph records as
recorded by a replay.

``note_replay`` is the same bookkeeping for an engine that captures a whole forward
over the eager calls and replays it. ``resident_capture`` makes resolves captured inside
take the resident path (one launch, no staging), correct only while every live request
is resident (``all_resident``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .results import ResolveResult
from ..device import capturing
from .validate import check_layer

if TYPE_CHECKING:
    from .cache import HiSparseCache
    from .write_step import StepPlan

__all__ = ["CacheGraphs", "Captured", "CudaGraphBackend", "ResolveCall", "WriteCall", "choose_graph", "note_copied"]


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
            # thread_local: another thread's CUDA calls (an engine's allocations, syncs) stay
            # legal while a layer is captured mid-serving; the captured calls make none
            g.capture_begin(capture_error_mode="thread_local")
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


class Captured:
    """A graph captured by :meth:`CacheGraphs.capture`: ``graph`` (what the capture
    function returned), the cache's events it records and the stand-in CUDA events it was
    captured with (kept alive with it)."""

    __slots__ = ("graph", "events", "lent")

    def __init__(self, graph: object, events: list, lent: list) -> None:
        self.graph, self.events, self.lent = graph, events, lent

    def replayed(self) -> None:
        """Call after each replay of ``graph``: the events it records are the replay's."""
        for ev in self.events:
            ev.recorded, ev.in_capture = True, True


class ResolveCall:
    """``resolve(layer, req_ids, topk, validate=False, wait=True)`` planned once for a
    fixed req_ids int32 [T] and a top-k int32 [T, K] of fixed shape (its contents may
    change between runs): see the module docstring. ``resident``: the call takes the
    resident path (planned while every live request was resident; ``run`` refuses it
    once one is hot)."""

    __slots__ = ("_cache", "layer", "req_ids", "T", "K", "resident")

    def __init__(self, cache: "HiSparseCache", layer: int, req_ids: torch.Tensor, T: int, K: int,
                 resident: bool) -> None:
        self._cache = cache
        self.layer, self.req_ids, self.T, self.K, self.resident = layer, req_ids, T, K, resident

    def launch(self, topk: torch.Tensor) -> None:
        """The call's launches alone (topk int32 [T, K], the planned shape), e.g. inside a
        capture; no bookkeeping."""
        self._launch(topk)

    def _launch(self, topk: torch.Tensor):
        c = self._cache
        out = c._out(self.layer, self.T, self.K)
        if self.resident:
            with c.graphs.resident_capture():
                return c.stager.run_resident(self.layer, self.req_ids, topk, out, compact=False)
        return c.stager.run(self.layer, self.req_ids, topk, out, host_rows=c._host_l[self.layer],
                            hot_rows=c._hot_l[self.layer], compact=False, wait=True)

    def run(self, topk: torch.Tensor | None = None, *, replay: Callable[[], None] | None = None) -> ResolveResult:
        """The call: its launches over ``topk`` (int32 [T, K]), or ``replay()`` (which
        enqueues a graph captured over :meth:`launch` on the current stream), then the
        eager call's bookkeeping. The result's ``event`` is None with ``replay`` (the
        stage event of an eager full resolve otherwise): the
        staging is part of the graph (which joins the streams it forks), so another stream
        waits on the current one instead."""
        if (topk is None) == (replay is None):
            raise ValueError("ResolveCall.run takes the top-k to launch over, or replay=, not both")
        c, layer = self._cache, self.layer
        if self.resident and not c.graphs.all_resident():
            raise ValueError("this resolve was planned for a batch of resident requests, and a live "
                             "request is hot now: plan it again")
        c._runtime_checks(layer)
        out = c._out(layer, self.T, self.K)
        if replay is None:
            if tuple(topk.shape) != (self.T, self.K):
                raise ValueError(f"topk has shape {tuple(topk.shape)}, the call was planned for {(self.T, self.K)}")
            event = self._launch(topk)
        else:
            g = c.graphs
            g._before_replay(layer, resolve=True)
            replay()
            g._stage_seen = c.streams.stage_eager_records[0]
            event = None
        c.requests.touch(layer)
        return ResolveResult(out, event, c.requests.epochs, layer)


class WriteCall:
    """``write_step(layer, step, rows)`` of a padded step planned once: see the module
    docstring."""

    __slots__ = ("_cache", "layer", "step")

    def __init__(self, cache: "HiSparseCache", layer: int, step: "StepPlan") -> None:
        self._cache, self.layer, self.step = cache, layer, step

    def launch(self, rows: torch.Tensor) -> None:
        """The write's launches alone (rows uint8 [step.rows, row_bytes], packed), e.g.
        inside a capture; the current stream then waits for the host mirror, so that a
        graph captured over this call joins every stream it used."""
        self._cache.writer.enqueue_step(self.layer, self.step, rows)

    def run(self, rows: torch.Tensor | None = None, *, replay: Callable[[], None] | None = None) -> None:
        """The write: ``write_step(layer, step, rows)``, or ``replay()`` (a graph captured
        over :meth:`launch`) between the same checks and the same bookkeeping. A
        ``replay`` that raises leaves the layer pending. A step of zero rows calls nothing."""
        if (rows is None) == (replay is None):
            raise ValueError("WriteCall.run takes the rows to write, or replay=, not both")
        c = self._cache
        if replay is None:
            c.write_step(self.layer, self.step, rows)
            return
        if c.pool.is_writer:
            c.kernel_set.check_pinned("the host pool")  # the mirror writes it over UVA

        def launch() -> None:  # after run_step's checks of the step
            c.graphs._before_replay(self.layer, resolve=False)
            replay()

        c.writer.run_step(self.layer, self.step, launch)


class CacheGraphs:
    """Graph capture and replay of one cache's calls (``HiSparseCache.graphs``; see the
    module docstring)."""

    def __init__(self, cache: "HiSparseCache") -> None:
        self._cache = cache
        self._resident_capture = False  # inside resident_capture()
        self._stage_seen = cache.streams.stage_eager_records[0]

    # ---- planning -------------------------------------------------------------
    def plan_resolve(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> ResolveCall:
        """Check an unchecked resolve's arguments (req_ids int32 [T], topk int32 [T, K])
        once; the call takes the resident path when every live request is resident now."""
        c = self._cache
        T, K, req_ids = c._check_resolve(layer, req_ids, topk, False)
        return ResolveCall(c, layer, req_ids, T, K, self.all_resident())

    def plan_write(self, layer: int, step: "StepPlan") -> WriteCall:
        """Check that ``layer`` of the prepared ``step`` can be written now (ValueError:
        a stale step, its bucket taken over by a later step, the layer written already)."""
        c = self._cache
        check_layer(c.cfg, layer)
        c.writer.check_step(layer, step)
        return WriteCall(c, layer, step)

    # ---- residency --------------------------------------------------------------
    def all_resident(self) -> bool:
        """Whether every live request is resident (the elastic tier with a pool; no live
        request at all counts too): then no resolve can miss."""
        c = self._cache
        return c.dpool.enabled and c.dpool.num_resident == len(c.requests)

    def resident_resolve(self) -> bool:
        """Whether a resolve called now takes the resident path: one launch on the
        current stream, a page-table lookup per entry, no LRU state, no staging copy, no
        stage-stream fork, no event (``kernels.resolve_resident``). It does when every
        live request is resident (``all_resident``), eagerly or, while a stream is being
        captured, inside :meth:`resident_capture` only. Its outputs equal the full
        resolve's (physical rows, valid counts, empty staging lists, counters)."""
        return self.all_resident() and (self._resident_capture or not capturing(self._cache.device))

    @contextlib.contextmanager
    def resident_capture(self) -> Iterator[None]:
        """Resolves captured inside take the resident path (``resident_resolve``); outside
        it a capture takes the full path, which replays correctly whatever the
        residency. A graph captured inside is correct only while ``all_resident()``
        holds: keep one graph of each kind per shape and replay the resident one only
        then (``engine.layer_graphs`` does). Refused (ValueError) when some live request
        is hot now."""
        c = self._cache
        if not self.all_resident():
            hot = len(c.requests) - c.dpool.num_resident
            raise ValueError(f"resident_capture: {hot} live request(s) are hot"
                             + ("" if c.dpool.enabled else " (no device pool: cfg.device_pool_rows is None)")
                             + "; a resident resolve would give them no rows")
        prev, self._resident_capture = self._resident_capture, True
        try:
            yield
        finally:
            self._resident_capture = prev

    # ---- capture and replay -------------------------------------------------------
    def capture(self, capture_fn: Callable[[], object]) -> Captured:
        """Run ``capture_fn()`` (a backend's capture of planned calls' ``launch``) with every
        event's state kept as it was; returns the graph it made with the events it records."""
        cs = self._cache.streams
        before = cs.flags()
        real = [ev.event for ev in cs.events()]
        if cs.cuda:  # stand-ins: the real events stay waitable outside the graph
            for ev in cs.events():
                ev.event = torch.cuda.Event()
        try:
            for ev in cs.events():  # recorded by a capture or replay: can't be waited on inside
                if ev.in_capture:
                    ev.recorded = False
            graph = capture_fn()
            events = [ev for ev, (_, _, n) in zip(cs.events(), before) if ev.records != n]
        finally:
            for ev, (rec, cap, n) in zip(cs.events(), before):  # a capture's records run at replays
                ev.recorded, ev.in_capture, ev.records = rec, cap, n
            lent = [ev.event for ev in cs.events()]
            for ev, e in zip(cs.events(), real):
                ev.event = e
            cs.capturing()  # not capturing any more: an engine's own capture later starts afresh
        return Captured(graph, events, lent)

    def note_replay(self, tokens: int | None = None) -> None:
        """Call before replaying a graph captured over this cache's eager calls (host waits
        then cover the replay). ``tokens``: the replay resolves every layer for that many
        query tokens (a whole forward's graph, as a bucket was captured): each layer's last
        selection (what a demotion seeds first) is then that [tokens, K] view, K as its
        capture had it."""
        c = self._cache
        c.streams.note_replay()
        if tokens is not None:
            for layer, shapes in c._shapes.items():
                K = shapes.get(tokens)
                if K is not None:
                    c.writer.last_selection[layer] = c._bufs[layer].view(tokens, K).physical.view(-1)

    def _before_replay(self, layer: int, *, resolve: bool) -> None:
        """The current stream waits on what a replayed call's graph is not ordered after:
        the layer's resolve state updates and the host mirror when last recorded eagerly
        (eager mirrors read a write graph's static rows too) and, for a resolve, eager
        staging in flight (the graph forks a stage stream of its own)."""
        cs = self._cache.streams
        stage = cs.streams.stage
        if resolve and cs.stage_eager_records[0] != self._stage_seen and stage is not None:
            cs.current().wait_stream(stage)
        cur = None
        for ev in (cs.resolved[layer], cs.backup):
            if ev.event is not None and ev.recorded and not ev.in_capture:
                if cur is None:
                    cur = cs.current()
                ev.wait_by(cur, False)


def choose_graph(key: tuple, addrs: tuple, fixed: tuple, graphs, recent: dict, in_place: dict,
                 limit: int) -> tuple[tuple, object, str]:
    """Which graph a replayed call of ``key`` replays, for inputs at ``addrs`` ((data_ptr,
    strides) of each) when its static buffers are at ``fixed``: (the graph's key, the
    graph or None when it is not captured yet, where it reads its inputs) -- "static"
    (the inputs are the static buffers), "own" (a graph under ``key + (addrs,)`` reads
    them where they are: one captured before, or a new one when ``addrs`` is among the
    key's ``recent`` copies, the static buffers' graph exists (it compiled the kernels),
    fewer than ``limit`` such graphs exist (``in_place``) and each input has its static
    buffer's strides and a 16-byte aligned address: the same specialisation, so that
    capture compiles nothing), else "copy" (into the static buffers first). Changes
    nothing."""
    if addrs == fixed:
        return key, graphs.get(key), "static"
    own = key + (addrs,)
    got = graphs.get(own)
    if got is not None:
        return own, got, "own"
    if (addrs in recent.get(key, ()) and key in graphs and in_place.get(key, 0) < limit
            and all(a[1] == f[1] and a[0] % 16 == 0 for a, f in zip(addrs, fixed))):
        return own, None, "own"
    return key, graphs.get(key), "copy"


def note_copied(recent: dict, key: tuple, addrs: tuple, keep: int) -> None:
    """Note ``addrs`` among the last ``keep`` distinct input addresses the replays of
    ``key`` copied (newest last)."""
    seen = recent.setdefault(key, [])
    if addrs in seen:
        seen.remove(addrs)
    seen.append(addrs)
    del seen[:-keep]
