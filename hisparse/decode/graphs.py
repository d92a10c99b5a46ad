"""CUDA graphs of whole decode layers, replayed from eager code: ``DecodeLayer(..., graphs=True)``.

An engine that runs attention outside its own CUDA graphs (piecewise graphs, mixed
batches) calls a ``DecodeLayer`` once per layer, and each call issues the resolve's
launches, the attention's and, for a split layer, the stage stream's fork and join from
Python: hundreds of microseconds of host time at B = 64. With ``graphs=True`` each
(layer, T, K, H, scale, residency, staging grid, backend object and its config, mode:
an auto layer's serial and split get a graph each) gets a graph of the whole call:

- its first call runs eagerly over the static input buffers (compiling and loading the
  kernels for the pointers the capture will have, making the miss plans);
- the second captures the same call (serial or split, the resident path when every
  live request is resident) on a side stream, over static input buffers of the shape
  (``input_buffers``: req_ids int32 [T], topk int32 [T, K], q bf16 [T, H, 576]), and
  replays it on the current stream;
- every later call makes the eager call's checks that read no device memory (the
  layer, shapes, dtypes, devices, the scale, the backend's support, the host pool's
  pinning) before anything is copied or launched, copies its inputs into the static
  buffers (a tensor that is the buffer is read in place), waits on the cache's events
  last recorded eagerly, replays, and does the eager call's host-side bookkeeping
  (``cache.graphs.ResolveCall.run``). Inputs whose addresses recur -- among the last
  ``RECENT_INPUTS`` distinct address sets a key's replays copied, as a caching
  allocator's steady state gives -- get a graph of their own that reads them where
  they are (at most ``IN_PLACE_GRAPHS`` per key), when they have the static buffers'
  strides and 16-byte aligned addresses (so the kernels' specialisation is the same).

Outputs: the graph's own out bf16 [T, H, 512] and lse float32 [T, H], which every
replay of that graph writes: enqueue their reads before the next call of the same layer
and shape, or clone them. At most ``max_graphs`` graphs are kept (the least recently
replayed is dropped first); ``memory_bytes`` counts what each capture reserved (its
memory pool: the outputs and the launches' scratch) and the static buffers. A capture's
own bookkeeping (the layer's epoch) is undone: the replay's run does the call's.

The eager path runs instead while the current stream is being captured (an engine
capturing its own forward records the eager launches). The backend must not read the
device to check its inputs (``TritonBackend(validate=False)``,
``FlashMLABackend(check_ranges=False)``); a capture that fails says so.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from ..attention.base import check_decode_call
from ..cache.graphs import Captured, CudaGraphBackend, ResolveCall, choose_graph, note_copied
from .overlap import Overlap

if TYPE_CHECKING:
    from .layer import DecodeLayer

__all__ = ["DecodeGraphs", "IN_PLACE_GRAPHS", "MAX_GRAPHS", "RECENT_INPUTS"]

MAX_GRAPHS = 256  # graphs a DecodeLayer keeps (per layer and shape); the least recently replayed goes first
IN_PLACE_GRAPHS = 2  # graphs per key that read an engine's tensors where they are
RECENT_INPUTS = 4  # address sets per key remembered from the copies


class _Graph:
    __slots__ = ("captured", "out", "lse", "key", "reserved")

    def __init__(self, captured: Captured, out: torch.Tensor, lse: torch.Tensor, key: tuple, reserved: int) -> None:
        self.captured, self.out, self.lse, self.key = captured, out, lse, key
        self.reserved = reserved  # device bytes the caching allocator reserved during the capture (its pool)


def _addr(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.stride()


def _copy_in(statics: tuple, inputs: tuple) -> None:
    """Each input into its static buffer (on the current stream), but a buffer given itself."""
    for s, x in zip(statics, inputs):
        if x is not s:
            s.copy_(x)


class DecodeGraphs:
    """The graphs of a ``DecodeLayer``'s calls over ``cache`` (see the module docstring),
    shared by the layers ``with_backend`` makes (a graph's key holds its backend object).
    ``backend``: the capture / replay backend (``CudaGraphBackend`` of the cache's device
    by default)."""

    def __init__(self, cache, *, max_graphs: int = MAX_GRAPHS, backend=None) -> None:
        self.cache = cache
        self.max_graphs = max_graphs
        self.backend = backend if backend is not None else CudaGraphBackend(cache.device)
        self.graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self.warm: set[tuple] = set()
        self._static: dict[tuple, tuple] = {}  # (T, K, H) -> (req_ids, topk, q) static buffers
        self._static_addr: dict[tuple, tuple] = {}  # (T, K, H) -> their addresses
        self._recent: dict[tuple, list] = {}  # key -> address sets its replays copied, newest last
        self._in_place: dict[tuple, int] = {}  # key -> its graphs reading an engine's tensors
        self.counts = {"eager": 0, "captures": 0, "replays": 0, "copies": 0, "in_place_graphs": 0, "dropped": 0}

    def input_buffers(self, T: int, K: int, H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static inputs of a shape: req_ids int32 [T], topk int32 [T, K], q bf16 [T,
        H, 576]. A call given these very tensors copies nothing."""
        shape = (T, K, H)
        got = self._static.get(shape)
        if got is None:
            dev = self.cache.device
            got = (torch.empty((T,), dtype=torch.int32, device=dev), torch.empty((T, K), dtype=torch.int32, device=dev),
                   torch.empty((T, H, 576), dtype=torch.bfloat16, device=dev))
            self._static[shape] = got
            self._static_addr[shape] = tuple(map(_addr, got))
        return got

    def memory_bytes(self) -> int:
        """Device bytes of the kept graphs -- what the caching allocator reserved while each
        was captured (its memory pool: outputs and the launches' scratch, such as split
        partials), at least its outputs -- and of the static input buffers."""
        kept = sum(max(g.reserved, g.out.nbytes + g.lse.nbytes) for g in self.graphs.values())
        return kept + sum(t.nbytes for ts in self._static.values() for t in ts)

    def is_input_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) one of the static input buffers."""
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for ts in self._static.values() for b in ts)

    def one_off_work(self) -> int:
        """Calls so far that ran eagerly or captured a graph (not a steady replay)."""
        return self.counts["eager"] + self.counts["captures"]

    def report(self) -> dict:
        return {"graphs": len(self.graphs), "memory_bytes": self.memory_bytes(), **self.counts}

    def __call__(self, dl: "DecodeLayer", layer: int, req_ids: torch.Tensor, topk: torch.Tensor, q: torch.Tensor,
                 sm_scale: float, mode: Overlap) -> tuple[torch.Tensor, torch.Tensor]:
        """``dl(layer, req_ids, topk, q, sm_scale=sm_scale)`` (``dl`` over this cache) in
        ``mode`` (serial or split: an auto layer's choice)."""
        c = dl.cache
        view = c.layer_view(layer)
        check_decode_call(dl.backend, q, sm_scale, device=view.hot_rows.device, row_format=view.row_format,
                          supported=dl._supported)
        T, K, req_ids = c._check_resolve_args(layer, req_ids, topk, False)  # ResolveCall.run: the runtime checks
        H = q.shape[1]
        if q.shape[0] != T:
            raise ValueError(f"topk has {T} rows but q has T={q.shape[0]} tokens")
        resident = c.graphs.all_resident()
        be = dl.backend
        key = (layer, T, K, H, float(sm_scale), resident, c.stage_programs, be, getattr(be, "config", None), mode)
        statics = self.input_buffers(T, K, H)
        inputs = (req_ids, topk, q)
        if key not in self.graphs and key not in self.warm:
            # eagerly, over the static buffers: the kernels compile (and load) for the pointers
            # the capture will have, which may not load while a stream is capturing
            c._runtime_checks(layer)  # before the copy
            _copy_in(statics, inputs)
            out = dl._eager(layer, *statics, sm_scale, mode)
            if len(self.warm) >= 4 * self.max_graphs:  # keys hold backend objects: forget them at once
                self.warm.clear()
            self.warm.add(key)
            self.counts["eager"] += 1
            return out
        gkey, g, src, copy, addrs = self._source(key, inputs, statics)
        call = ResolveCall(c, layer, src[0], T, K, resident)

        def replay() -> None:  # after the checks and the waits on eager work
            nonlocal g
            if g is None:
                g = self._capture(dl, key, gkey, layer, src, float(sm_scale), resident, mode)
            if copy:
                _copy_in(statics, inputs)
                self.counts["copies"] += 1
            self.backend.replay(g.captured.graph)
            g.captured.replayed()
            self.counts["replays"] += 1

        call.run(replay=replay)
        self.graphs.move_to_end(gkey)
        if addrs is not None:
            note_copied(self._recent, key, addrs, RECENT_INPUTS)
        return g.out, g.lse

    def _source(self, key: tuple, inputs: tuple, statics: tuple):
        """(the key of the graph to replay, that graph or None when not captured yet, the
        tensors it reads, whether the inputs are copied into the static buffers first,
        the inputs' addresses to note once the call ran, or None). Changes nothing."""
        addrs = tuple(map(_addr, inputs))
        gkey, g, where = choose_graph(key, addrs, self._static_addr[key[1:4]], self.graphs, self._recent,
                                      self._in_place, IN_PLACE_GRAPHS)
        if where == "copy":
            return gkey, g, statics, True, addrs
        return gkey, g, (inputs if where == "own" else statics), False, None

    def _capture(self, dl: "DecodeLayer", key: tuple, gkey: tuple, layer: int, src: tuple, sm_scale: float,
                 resident: bool, mode: Overlap) -> _Graph:
        c = dl.cache
        outs: list = []

        def body() -> None:
            if resident:
                with c.graphs.resident_capture():
                    outs.append(dl._eager(layer, *src, sm_scale, mode))
            else:
                outs.append(dl._eager(layer, *src, sm_scale, mode))

        epochs = list(c.requests.epochs)
        before = torch.cuda.memory_reserved(c.device) if c.cuda else 0
        try:
            captured = c.graphs.capture(lambda: self.backend.capture(body))
        except Exception as e:
            c.requests.epochs[:] = epochs  # nothing ran: no result of the layer is stale
            raise RuntimeError(f"DecodeLayer(graphs=True) could not capture layer {layer} (T={key[1]}, K={key[2]}, "
                               f"H={key[3]}): {e}. The backend must not read the device to check its inputs "
                               "(TritonBackend(validate=False), FlashMLABackend(check_ranges=False)); or pass "
                               "graphs=False") from e
        c.requests.epochs[:] = epochs  # the capture's resolve ran nothing; the replay's run moves them
        if len(self.graphs) >= self.max_graphs:
            old_key, _ = self.graphs.popitem(last=False)
            if len(old_key) > len(key):  # an engine tensors' graph of its base key
                self._in_place[old_key[:len(key)]] -= 1
            self.counts["dropped"] += 1
        reserved = max(0, torch.cuda.memory_reserved(c.device) - before) if c.cuda else 0
        g = self.graphs[gkey] = _Graph(captured, outs[0][0], outs[0][1], gkey, reserved)
        self.counts["captures"] += 1
        if len(gkey) != len(key):
            self._in_place[key] = self._in_place.get(key, 0) + 1
            self.counts["in_place_graphs"] += 1
        return g
