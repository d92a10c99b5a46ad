"""What a resolve hands back: views of the layer's reused buffers plus the staging event.

A result is valid until the next append, resolve or free_request touching its layer:
the next append refills the reserved newest-token slot and the next resolve overwrites
the buffers. ``stale`` says whether that has happened.
"""

from __future__ import annotations

import torch

from .state import ResolveBuffers


class ResolveResult:
    """Output of :meth:`HiSparseCache.resolve` (views of the layer's reused buffers).

    physical:     int32 [T, K]  rows of ``hot_rows(layer)``, -1 = padding
    valid_counts: int32 [T]     non-padding entries per query token
    stage_src:    int32 [T * K] host rows staged this step (-1 = none), for inspection
    stage_dst:    int32 [T * K] flat hot rows they went to
    event:        CUDA event recorded after staging (None on CPU)

    Valid until the next append, resolve or free_request touching that layer: the next
    append refills the reserved newest-token slot and the next resolve overwrites these
    buffers. ``stale`` says whether that has happened.
    """

    __slots__ = ("physical", "valid_counts", "stage_src", "stage_dst", "event", "_epochs", "_layer",
                 "_epoch")

    def __init__(self, out: ResolveBuffers, event, epochs: list[int], layer: int) -> None:
        self.physical = out.physical
        self.valid_counts = out.valid_counts
        self.stage_src = out.stage_src
        self.stage_dst = out.stage_dst
        self.event = event
        self._epochs, self._layer, self._epoch = epochs, layer, epochs[layer]

    @property
    def stale(self) -> bool:
        """True once an append, resolve or free of the layer may have changed what
        these indices point at."""
        return self._epochs[self._layer] != self._epoch

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream) wait until staging is done."""
        if self.event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.physical.device)
        stream.wait_event(self.event)


class Landing:
    """A cache's landing rows: where a landing split resolve copies its misses from the
    host pool right after the hit phase, before the miss phase chose their slots
    (``HiSparseCache.resolve_split(..., land=True)``). One set per cache, shared by its
    layers: valid from one landing split resolve to the next (``generation``).

    rows:   uint8 [max_tokens * top_k, row_bytes] (device): entry t * K + j = token t's miss j
    index:  int32 [max_tokens * top_k] = arange: the landing row of each entry
    src:    int32 [max_tokens * top_k] host row of each entry (the hit phase writes it)
    counts: int32 [max_tokens] misses per token
    event:  the stage stream's record after the copy into ``rows``
    """

    __slots__ = ("rows", "index", "src", "counts", "event", "generation")

    def __init__(self, rows: torch.Tensor, event) -> None:
        n = rows.shape[0]
        dev = rows.device
        self.rows = rows
        self.index = torch.arange(n, dtype=torch.int32, device=dev)
        self.src = torch.empty(n, dtype=torch.int32, device=dev)
        self.counts = torch.empty(max(1, n), dtype=torch.int32, device=dev)
        self.event = event
        self.generation = 0

    def view(self, T: int, K: int) -> "Landing":
        """The same buffers cut to a [T, K] call (shares ``event`` and ``generation``
        with the whole: a view is made per call, the whole is the cache's)."""
        v = object.__new__(Landing)
        v.rows, v.index, v.src, v.counts = self.rows, self.index[:T * K], self.src[:T * K], self.counts[:T]
        v.event, v.generation = self.event, self.generation
        return v


class SplitResult(ResolveResult):
    """Output of :meth:`HiSparseCache.resolve_split`: a resolve whose hits can be
    attended before its misses landed.

    hit_physical:  int32 [T, K]  rows of ``hot_rows(layer)`` already hot when the call
                   returned (-1 for misses, padding, invalid): attend them right away
    miss_physical: int32 [T, K]  each token's miss entries, compacted (entries j <
                   miss_counts[t]): the hot rows they are staged into
    miss_host:     int32 [T, K]  the host rows of those entries (same order)
    miss_counts:   int32 [T]
    physical, valid_counts, stage_src, stage_dst, event: as ResolveResult (the union of
    hits and misses; ``event`` marks the staging done, on the stage stream)
    """

    __slots__ = ("hit_physical", "miss_physical", "miss_host", "miss_counts", "_land", "_whole", "pending")

    def __init__(self, out: ResolveBuffers, hit: torch.Tensor, miss_lists: tuple, event,
                 epochs: list[int], layer: int, *, land: Landing | None = None,
                 whole: Landing | None = None) -> None:
        super().__init__(out, event, epochs, layer)
        self.hit_physical = hit
        self.miss_physical, self.miss_host, self.miss_counts = miss_lists
        self._land, self._whole = land, whole
        # a landing split whose miss phase waits for HiSparseCache.finish_split
        self.pending = land is not None

    def landed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A landing split's misses as (rows uint8 [N, row_bytes], index int32 [T, K],
        counts int32 [T]): token t's miss j is row ``index[t, j]`` for j < counts[t], in
        the order of ``miss_physical``. Read them on a stream that waited on
        :meth:`wait_landed`; ValueError once a later landing split resolve reused them."""
        if self._land is None:
            raise ValueError("this split resolve did not land its misses (resolve_split(..., land=True))")
        if self._whole.generation != self._land.generation:
            raise ValueError("the landing rows were reused by a later landing split resolve; "
                             "attend a split's misses before the next one")
        T, K = self.hit_physical.shape
        return self._land.rows, self._land.index.view(T, K), self._land.counts

    def wait_landed(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream) wait until the misses are in
        the landing rows (their slots may still be filling: :meth:`wait` for that)."""
        if self._land is None:
            raise ValueError("this split resolve did not land its misses (resolve_split(..., land=True))")
        ev = self._land.event.event
        if ev is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.hit_physical.device)
        stream.wait_event(ev)


__all__ = ["Landing", "ResolveResult", "SplitResult"]
