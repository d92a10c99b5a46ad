"""``HiSparseCache.stats()``: the device counters per layer and in total, host pool use.

Counters (``state.STAT_*``, int64 per layer on the device, updated by the kernels):
hits and misses (unique rows per resolve of a (layer, request)), entries resolved to
resident rows (``resident_rows``, the elastic tier), invalid top-k entries treated as
padding, resolves, rows staged by prefetches (``prefetch_rows``), rows written to the
host pool. Bytes are rows x row_bytes (h2d: misses + prefetched rows). ``hit_rate`` is
(hits + resident_rows) / (hits + resident_rows + misses); ``resident_rows`` counts
entries, not unique rows, so with query length > 1 it leans high.

The elastic tier's figures are in ``total`` too: ``resident_requests``,
``hot_requests``, ``pool_rows_used`` / ``pool_rows_total`` (device rows per layer: a
hot buffer per live request plus the taken pages), ``spills``, ``promotions``,
``seeded_rows`` (rows a demotion copied into hot buffers, all layers),
``pool_pages_shared`` (pages several resident requests reference: shared prefixes)
and ``prefix_resident_joins`` (requests admitted resident on another's prefix pages).
"""

from __future__ import annotations

from typing import Any

from .device_pool import DevicePool
from .host_pool import HostPool
from .state import (STAT_D2H_ROWS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_PREFETCH, STAT_RESIDENT,
                    STAT_RESOLVES, HotState)


def hit_rate(hits: int, misses: int, resident: int = 0) -> float:
    """(hits + resident) / (hits + resident + misses); 0.0 before any lookup."""
    n = hits + resident + misses
    return (hits + resident) / n if n else 0.0


def cache_stats(state: HotState, pool: HostPool, *, row_bytes: int, num_layers: int,
                live_requests: int, kernels: str, device_pool: DevicePool | None = None,
                slots_per_req: int = 0, prefix=None) -> dict[str, Any]:
    """The stats dict (reads the device counters: the caller synchronised)."""
    raw = state.stats.cpu().tolist()
    layers = []
    tot: dict[str, int | float] = dict(hits=0, misses=0, resident_rows=0, invalid=0, resolves=0, prefetch_rows=0, bytes_h2d=0,
               bytes_d2h=0)
    for row in raw:
        d = dict(hits=row[STAT_HITS], misses=row[STAT_MISSES], resident_rows=row[STAT_RESIDENT],
                 invalid=row[STAT_INVALID], resolves=row[STAT_RESOLVES], prefetch_rows=row[STAT_PREFETCH],
                 bytes_h2d=(row[STAT_MISSES] + row[STAT_PREFETCH]) * row_bytes,
                 bytes_d2h=row[STAT_D2H_ROWS] * row_bytes)
        for k in tot:
            tot[k] += d[k]
        d["hit_rate"] = hit_rate(d["hits"], d["misses"], d["resident_rows"])
        layers.append(d)
    tot["hit_rate"] = hit_rate(tot["hits"], tot["misses"], tot["resident_rows"])
    dp = device_pool
    nres = len(dp.resident_slots()) if dp is not None else 0
    tot.update(resident_requests=nres, hot_requests=live_requests - nres,
               pool_rows_used=dp.rows_used(live_requests, slots_per_req) if dp is not None else 0,
               pool_rows_total=dp.rows_per_layer if dp is not None else 0,
               spills=dp.spills if dp is not None else 0, promotions=dp.promotions if dp is not None else 0,
               seeded_rows=dp.seeded_rows if dp is not None else 0,
               pool_pages_shared=dp.num_shared if dp is not None else 0,
               prefix_resident_joins=dp.shared_joins if dp is not None else 0)
    tot.update(prefix.stats() if prefix is not None else
               dict(prefix_query_tokens=0, prefix_hit_tokens=0, cached_blocks=0, shared_blocks=0, prefix_evictions=0))
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
