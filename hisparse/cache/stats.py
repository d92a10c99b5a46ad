"""``HiSparseCache.stats()``: the device counters per layer and in total, host pool use.

Counters (``state.STAT_*``, int64 per layer on the device, updated by the kernels):
hits and misses (unique rows per resolve of a (layer, request)), invalid top-k entries
treated as padding, resolves, rows staged by prefetches (``prefetch_rows``), rows
written to the host pool. Bytes are rows x row_bytes (h2d: misses + prefetched rows).
"""

from __future__ import annotations

from typing import Any

from .host_pool import HostPool
from .state import STAT_D2H_ROWS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_PREFETCH, STAT_RESOLVES, HotState


def hit_rate(hits: int, misses: int) -> float:
    """hits / (hits + misses); 0.0 before any lookup."""
    n = hits + misses
    return hits / n if n else 0.0


def cache_stats(state: HotState, pool: HostPool, *, row_bytes: int, num_layers: int,
                live_requests: int, kernels: str) -> dict[str, Any]:
    """The stats dict (reads the device counters: the caller synchronised)."""
    raw = state.stats.cpu().tolist()
    layers = []
    tot = dict(hits=0, misses=0, invalid=0, resolves=0, prefetch_rows=0, bytes_h2d=0, bytes_d2h=0)
    for row in raw:
        d = dict(hits=row[STAT_HITS], misses=row[STAT_MISSES], invalid=row[STAT_INVALID],
                 resolves=row[STAT_RESOLVES], prefetch_rows=row[STAT_PREFETCH],
                 bytes_h2d=(row[STAT_MISSES] + row[STAT_PREFETCH]) * row_bytes,
                 bytes_d2h=row[STAT_D2H_ROWS] * row_bytes)
        for k in tot:
            tot[k] += d[k]
        d["hit_rate"] = hit_rate(d["hits"], d["misses"])
        layers.append(d)
    tot["hit_rate"] = hit_rate(tot["hits"], tot["misses"])  # type: ignore[assignment]
    alloc = pool.allocator
    return {
        "layers": layers,
        "total": tot,
        "host_pool": {
            "blocks_used": alloc.num_used,
            "blocks_total": alloc.num_blocks,
            "block_size": pool.B,
            "bytes": pool.nbytes,
            "bytes_used": alloc.num_used * pool.B * row_bytes * num_layers,
            "pinned": pool.pinned,
        },
        "live_requests": live_requests,
        "kernels": kernels,
    }


__all__ = ["cache_stats", "hit_rate"]
