"""What a resolve hands back: views of the layer's reused buffers plus the staging event.

A result is valid until the next append, resolve or free_request touching its layer:
the next append refills the reserved newest-token slot and the next resolve overwrites
the buffers. ``stale`` says whether that has happened.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .state import ResolveBuffers


class RequestInfo(NamedTuple):
    """A live request as :meth:`HiSparseCache.request` sees it: its request slot and
    the rows appended to each layer."""

    slot: int
    lengths: tuple[int, ...]

    @property
    def seq_len(self) -> int:
        """Positions appended to every layer (the min of the layer lengths)."""
        return min(self.lengths)


class PoolUsage(NamedTuple):
    """The elastic tier's occupancy (:meth:`HiSparseCache.pool_usage`)."""

    resident_requests: int
    hot_requests: int
    pages_free: int
    pages_total: int


class ResolveResult:
    """Output of :meth:`HiSparseCache.resolve` (views of the layer's reused buffers).

    physical:     int32 [T, K]  rows of ``hot_rows(layer)``, -1 = padding
    valid_counts: int32 [T]     non-padding entries per query token
    stage_src:    int32 [T * K] host rows staged this step (-1 = none, or a miss whose
                  alias id maps no host block: nothing copied; a prefix-cache alias's rows
                  are read from its cached host block), for inspection
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
    def layer(self) -> int:
        """The layer this resolve was for."""
        return self._layer

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


class SplitResult(ResolveResult):
    """Output of ``HiSparseCache.resolve(..., split=True)``: a resolve whose hits can be
    attended before its misses landed.

    hit_physical:  int32 [T, K]  rows of ``hot_rows(layer)`` already hot when the call
                   returned (-1 for misses, padding, invalid): attend them right away
    miss_physical: int32 [T, K]  each token's miss entries, compacted (entries j <
                   miss_counts[t]): the hot rows they are staged into
    miss_host:     int32 [T, K]  the row keys of those entries (same order; ``state``;
                   not host rows where prefix-cache alias ids exist)
    miss_counts:   int32 [T]
    physical, valid_counts, stage_src, stage_dst, event: as ResolveResult (the union of
    hits and misses; ``event`` marks the staging done, on the stage stream)
    """

    __slots__ = ("hit_physical", "miss_physical", "miss_host", "miss_counts")

    def __init__(self, out: ResolveBuffers, hit: torch.Tensor, miss_lists: tuple, event,
                 epochs: list[int], layer: int) -> None:
        super().__init__(out, event, epochs, layer)
        self.hit_physical = hit
        self.miss_physical, self.miss_host, self.miss_counts = miss_lists


__all__ = ["ResolveResult", "SplitResult"]
