"""Per-layer CUDA graphs of a group's padded decode calls, for engines that run eagerly.

An engine that does not capture its decode forward still calls ``write_new_rows`` and
``convert_decode_logical_to_physical_topk`` once per layer, and each call is a few Triton
launches and event operations issued from Python. With ``HiSparseIndexGroup(...,
layer_graphs=True)``, those calls of a padded forward (``prepare_for_batch(md,
pad_to=N)``) replay one small graph per (call, layer, bucket) instead:

- the call's input (rows, or the top-k) is copied into a static buffer of the bucket on
  the current stream; the graph reads it there. A tensor of the engine's own whose
  address (and strides) recurs -- is among the last ``RECENT_INPUTS`` distinct
  addresses that replayed calls of that (call, layer, bucket) copied: an engine's
  persistent buffers, or a caching allocator's steady state -- gets a graph of its own
  that reads it where it is, once the static buffer's graph exists, if it has the
  static buffer's strides and a 16-byte aligned address: at most ``IN_PLACE_GRAPHS``
  such graphs per (call, layer, bucket), never freed; copies past them. A graph reads
  whatever is at the addresses it was captured with, so a later tensor at the same
  address, strides, shape and dtype is read correctly;
- the first call of a (call, layer, bucket) runs eagerly over the static buffer, which
  compiles the kernels for those pointers; the second captures the same launches on a
  side stream and replays the graph; later calls replay it;
- a conversion's graph is of the full resolve, or of the resident one when every live
  request is resident (``CacheGraphs.resident_resolve``): the key of the graph a call
  replays includes which, so a batch replays the resident graph only while no live
  request is hot;
- a graph joins every stream it forks (the host mirror's, the staging's) before it ends,
  so work after a replay on the current stream, or on a stream that follows it, is
  ordered after all of the graph's work;
- each call is planned through the cache's graph mode (``HiSparseCache.graphs``,
  ``hisparse.cache.graphs``): ``plan_write`` / ``plan_resolve`` make the checks before
  anything is copied (a call that fails a check launches nothing and changes nothing);
  a graph captures the planned call's ``launch``; every later call runs it with the
  graph's replay, between the checks whose outcome can change since it was planned (the
  step's, the host pool's pinning) and the eager call's bookkeeping. A resolve's plan is
  kept with its graph (the same static req_ids and top-k shape); a write's is made per
  forward (its step).

Events: the cache orders its streams with events (``hisparse.cache.stager``). Before a
replay the current stream waits on each event the eager call would wait on whose last
record was eager (one recorded by a replay is ordered already), and on the stage stream
when eager staging ran since the last replay (the graph forks a stream of its own): the
planned call's ``run`` does. A capture (``CacheGraphs.capture``) changes no event's
state, and after a replay the events the graph recorded count as recorded by a replay,
as ``graphs.note_replay`` does for a whole captured forward.

The eager path runs instead for conversions with ``wait=False``, ``decode_attention``,
``prefetch``, unpadded forwards, and every call made while the current stream is being
captured (an engine capturing its own forward).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..cache.cache import HiSparseCache
from ..cache.graphs import Captured, CudaGraphBackend, ResolveCall, WriteCall, choose_graph, note_copied
from ..device import capturing
from ..cache.write_step import StepPlan

__all__ = ["CudaGraphBackend", "IN_PLACE_GRAPHS", "LayerGraphs", "RECENT_INPUTS"]

# graphs per (call, layer, bucket) that read an engine's tensor where it is (see above);
# a bound on captures and graph memory when an engine's addresses drift
IN_PLACE_GRAPHS = 2
# an address gets such a graph when it is among the RECENT_INPUTS distinct addresses the
# key's replayed calls copied last (a caching allocator may hand a layer's tensor two
# addresses in turn)
RECENT_INPUTS = 4


def _same(t: torch.Tensor, static: torch.Tensor) -> bool:
    """Whether ``t`` (of ``static``'s shape and dtype, checked by the caller) is the static
    buffer itself, or a view of it with its layout: then nothing needs copying."""
    return t is static or (t.data_ptr() == static.data_ptr() and t.stride() == static.stride())


class LayerGraphs:
    """The per-layer graphs of one group's cache (see the module docstring).

    backend: ``CudaGraphBackend`` on CUDA; anything with ``capture(fn) -> graph`` and
    ``replay(graph)`` (the CPU tests use stand-ins that record the cache's launch
    functions, or its kernel launchers alone, and call them again: ``tests/graph_trace``).
    """

    def __init__(self, cache: HiSparseCache, backend) -> None:
        self.cache = cache
        self.backend = backend
        self.graphs: dict[tuple, Captured] = {}
        self.warm: set[tuple] = set()
        self._rows: dict[int, torch.Tensor] = {}  # tokens -> uint8 [tokens, row_bytes]
        self._topk: dict[tuple[int, int], torch.Tensor] = {}  # (tokens, K) -> int32 [tokens, K]
        self._calls: dict[tuple, ResolveCall] = {}  # a convert graph's key -> its planned resolve
        self._recent_inputs: dict[tuple, list] = {}  # key -> (data_ptr, strides) it copied last
        self._in_place: dict[tuple, int] = {}  # key -> graphs of it reading an engine's tensor
        # id(static buffer) -> its (data_ptr, strides); the buffers live as long as this object
        self._static_addr: dict[int, tuple] = {}
        # copies: replayed calls that copied their input into the static buffer;
        # in_place_graphs: graphs captured to read an engine's tensor where it is
        self.counts = {"eager": 0, "captures": 0, "replays": 0, "copies": 0, "in_place_graphs": 0}
        self.replays_by_call = {"write": 0, "convert": 0}

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
            self._static_addr[id(static)] = (static.data_ptr(), static.stride())
        return static

    def topk_buffer(self, tokens: int, k: int) -> torch.Tensor:
        """The static top-k buffer of a bucket: int32 [tokens, k]. A conversion given
        this very tensor reads it in place (no copy)."""
        static = self._topk.get((tokens, k))
        if static is None:
            static = torch.empty((tokens, k), dtype=torch.int32, device=self.cache.device)
            self._topk[(tokens, k)] = static
            self._static_addr[id(static)] = (static.data_ptr(), static.stride())
        return static

    # ------------------------------------------------------------------ the calls
    def write(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """``cache.write_step(layer, step, rows)`` (rows uint8 [step.rows, row_bytes],
        checked by the caller) through the layer's write graph of the bucket."""
        cache = self.cache
        static = self.rows_buffer(step.rows)
        key = ("write", layer, id(step.buffers))
        got = self.graphs.get(key)
        if got is None and key not in self.warm:
            call = cache.graphs.plan_write(layer, step)  # before the copy: a refused call launches nothing
            if not _same(rows, static):
                static.copy_(rows)
            call.run(static)
            cache.streams.join_backup()  # the host mirror read ``static``: the next copy into it waits
            self.warm.add(key)
            self.counts["eager"] += 1
            return
        call = WriteCall(cache, layer, step)  # its run checks the step before replay() copies anything
        gkey, g, src, copy, addr = self._source(key, rows, static)

        def replay() -> None:  # after the checks and the waits: eager mirrors read ``static`` too
            nonlocal g
            if g is None:
                g = self._graph(key, gkey, lambda: call.launch(src))
            if copy:
                static.copy_(rows)
            self._replay(g, "write")
            self._note_input(key, addr, copy)

        call.run(replay=replay)

    def convert(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor):
        """``cache.resolve(layer, req_ids, topk, validate=False, wait=True)`` (topk int32
        [T, K], checked by the caller; req_ids the forward's persistent decode ids) through
        the layer's resolve graph; returns its ``ResolveResult``."""
        cache = self.cache
        T, K = topk.shape
        static = self.topk_buffer(T, K)
        # the staging copy's launch shape is part of the graph: a new one captures again;
        # so is the resolve's path: a batch of resident requests alone replays a graph of
        # the resident resolve, any other batch one of the full resolve
        resident = cache.graphs.all_resident()
        key = ("convert", layer, req_ids.data_ptr(), T, K, cache.stage_programs, resident)
        call = self._calls.get(key) if key in self.graphs else None
        if call is None:  # the warm-up and the capture's call: every check, before the copy
            call = cache.graphs.plan_resolve(layer, req_ids, topk)
            if key not in self.warm:
                if not _same(topk, static):
                    static.copy_(topk)
                res = call.run(static)
                self.warm.add(key)
                self.counts["eager"] += 1
                return res
            self._calls[key] = call  # later replays of the key: the checks that can change only
        gkey, g, src, copy, addr = self._source(key, topk, static)

        def replay() -> None:  # after the waits: eager staging may read ``static``
            nonlocal g
            if g is None:
                g = self._graph(key, gkey, lambda: call.launch(src))
            if copy:
                static.copy_(topk)
            self._replay(g, "convert")
            self._note_input(key, addr, copy)

        return call.run(replay=replay)

    def _source(self, key: tuple, t: torch.Tensor, static: torch.Tensor
                ) -> tuple[tuple, Captured | None, torch.Tensor, bool, tuple | None]:
        """(the key of the graph to replay, that graph or None when it is not captured
        yet, the tensor it reads, whether the caller copies ``t`` into ``static`` first,
        ``t``'s addresses ((data_ptr, strides),) to note once the call ran, or None) for a call of
        ``key`` given ``t`` (of ``static``'s shape and dtype, checked by the caller):
        ``static``'s graph under ``key``, read in place when ``t`` is the static buffer,
        else after a copy, unless ``t`` gets a graph of its own (the module docstring).
        Changes nothing."""
        if t is static:
            return key, self.graphs.get(key), static, False, None
        addrs = ((t.data_ptr(), t.stride()),)  # read once: the static buffer's test, and the graph's key
        gkey, g, where = choose_graph(key, addrs, (self._static_addr[id(static)],), self.graphs,
                                      self._recent_inputs, self._in_place, IN_PLACE_GRAPHS)
        if where == "copy":
            return gkey, g, static, True, addrs
        return gkey, g, (t if where == "own" else static), False, None

    def _note_input(self, key: tuple, addr: tuple | None, copied: bool) -> None:
        """After a replayed call of ``key``: count a copy, and note the address of an
        input that was copied among the key's recent ones (newest last)."""
        if copied:
            self.counts["copies"] += 1
        if addr is not None:
            note_copied(self._recent_inputs, key, addr, RECENT_INPUTS)

    def _graph(self, key: tuple, gkey: tuple, fn: Callable[[], None]) -> Captured:
        """The graph under ``gkey`` (the static buffer's ``key``, or ``key`` plus an
        engine tensor's address: a graph reading it in place), captured over ``fn`` if
        it is not yet."""
        got = self.graphs.get(gkey)
        if got is None:
            got = self._capture(gkey, fn)
            if len(gkey) != len(key):  # an engine tensor's graph
                self._in_place[key] = self._in_place.get(key, 0) + 1
                self.counts["in_place_graphs"] += 1
        return got

    def _capture(self, key: tuple, fn: Callable[[], None]) -> Captured:
        got = self.graphs[key] = self.cache.graphs.capture(lambda: self.backend.capture(fn))
        self.counts["captures"] += 1
        return got

    def _replay(self, g: Captured, call: str) -> None:
        self.backend.replay(g.graph)
        g.replayed()
        self.counts["replays"] += 1
        self.replays_by_call[call] += 1

    def is_input_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) one of the static input buffers."""
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in (*self._rows.values(), *self._topk.values()))

    def refuse_input_buffer(self, topk: torch.Tensor, call: str) -> None:
        """The eager calls that read their top-k on the side stream after they return
        refuse the top-k input buffer (``layer_input_buffers``), which the engine
        overwrites for the next layer while that read may still be running."""
        if self.is_input_buffer(topk):
            raise ValueError(f"{call} reads its top-k on the staging stream after it returns, and "
                             "layer_input_buffers()' top-k is overwritten for the next layer meanwhile: "
                             "pass a tensor of your own (e.g. a copy)")

    def report(self) -> dict:
        return {"graphs": len(self.graphs), **self.counts,
                **{f"{call}_replays": n for call, n in self.replays_by_call.items()}}
