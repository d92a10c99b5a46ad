"""The tiered cache: a pinned host pool plus per-(layer, request) GPU hot buffers.

- ``HiSparseCache(cfg, kernels=, pin=, host_pool=)``: the coordinator (``cache``); also
  ``hisparse.HiSparseCache``.
- What its calls take and hand back: ``ResolveResult`` (``resolve``) and ``SplitResult``
  (``resolve(..., split=True)``; ``CopyShape``: its ``copy_shape=``, the staging copy's
  launch shape), ``RequestInfo`` (``request``), ``PoolUsage`` (``pool_usage``)
  (``results``); ``ResolveBuffers`` (``prefetch``; ``state``);
  ``WriteBatch`` (``plan_write``; ``write``); ``StepPlan`` (``prepare_step``) and
  ``StepCapacity`` (its ``capacity=``: fixed-shape lists) (``write_step``); ``LayerView``
  (``layer_view``: what ``hisparse.staging`` reads of a layer; defined there).
- ``CacheGraphs`` (``cache.graphs``): CUDA graphs as a mode of the calls -- plan a call
  once (``ResolveCall``, ``WriteCall``), launch it eagerly or inside a capture, run it
  with a replay (``graphs``).
- ``resolve_paged(cache, layer, req_ids, topk, attend)``: the resident path of a resolve
  folded into an attention that maps the top-k itself (``paged_resolve``;
  ``DecodeLayer`` calls it where its backend can).
- ``HostPool``: the pinned host pool a cache owns, or one built elsewhere and passed as
  ``host_pool=`` (``host_pool``; ``distributed.setup_shared_pool`` builds a node-shared one).
- ``expand_runs``: (start, n, step) runs expanded into one int64 index tensor, as the
  write plans build their lists (``write_plan``).

Kernel level: for the benchmarks and tools that drive a launcher or a part of the cache
on their own (an engine never needs them):

- ``HotState``: the hot tier's device bookkeeping, which the resolve launchers update
  (slot maps, LRU stamps, block table, counters; notation and LRU rules: ``state``);
  ``STAT_HITS``, ``STAT_MISSES``, ``STAT_INVALID``, ``STAT_RESOLVES``, ``STAT_PREFETCH``:
  indices into its per-layer ``stats``.
- ``resolve_triton(state, layer, req_ids, topk, out, max_query_len=)``: the checked
  Triton resolve of a ``HotState`` into ``ResolveBuffers``; ``resolve_launch_sizes``,
  ``RESOLVE_SCAN_CHUNK``, ``RESOLVE_SMALL_SORT``: the launch shape and constants it
  compiles the kernel with; ``set_resolve_kernel``: launch an instrumented copy of the
  kernel instead (``resolve_launch``).
- ``resolve_reference``, ``copy_rows_reference``: the torch references of the resolve
  and of the row copy, the launchers' oracle (``resolve_ref``).
- ``copy_rows(src, src_idx, dst, dst_idx)``: the row-copy kernel between pinned host and
  device rows, checked; ``copy_rows_unchecked``: the same launch without the checks;
  ``copy_staged``: a resolve's staging lists copied as the cache stages them;
  ``DEFAULT_ROWS_PER_PROGRAM``, ``DEFAULT_NUM_WARPS``, ``DEFAULT_PROGRAMS_PER_SM``:
  copy_rows' default launch shape (``transfer``).
- ``PrefixCache``, ``BlockAllocator``, ``block_names``, ``HASHES``: prefix caching's
  host side alone -- a cache's prefix index over a block allocator, the chained names
  of token blocks and the hashes that name them (``prefix``, ``host_pool``,
  ``prefix_index``).

The names are imported when first used: ``import hisparse.cache`` loads none of its
modules and no Triton (``HiSparseCache``, ``LayerView`` and the launchers load it,
through the kernels).
"""

from __future__ import annotations

from .._lazy import lazy_exports

# exported name -> module that defines it (relative to this package)
_EXPORTS = {
    "HiSparseCache": ".cache",
    "CopyShape": ".stager",
    "ResolveResult": ".results", "SplitResult": ".results", "RequestInfo": ".results", "PoolUsage": ".results",
    "CacheGraphs": ".graphs", "ResolveCall": ".graphs", "WriteCall": ".graphs",
    "resolve_paged": ".paged_resolve",
    "ResolveBuffers": ".state",
    "WriteBatch": ".write_batch",
    "StepPlan": ".write_step", "StepCapacity": ".write_step",
    "HostPool": ".host_pool",
    "expand_runs": ".write_plan",
    "LayerView": "..staging.view",
    # kernel level (module docstring)
    "HotState": ".state", "STAT_HITS": ".state", "STAT_MISSES": ".state", "STAT_INVALID": ".state",
    "STAT_RESOLVES": ".state", "STAT_PREFETCH": ".state",
    "resolve_triton": ".resolve_launch", "resolve_launch_sizes": ".resolve_launch",
    "RESOLVE_SCAN_CHUNK": ".resolve_launch", "RESOLVE_SMALL_SORT": ".resolve_launch",
    "set_resolve_kernel": ".resolve_launch",
    "resolve_reference": ".resolve_ref", "copy_rows_reference": ".resolve_ref",
    "copy_rows": ".transfer", "copy_rows_unchecked": ".transfer", "copy_staged": ".transfer",
    "DEFAULT_ROWS_PER_PROGRAM": ".transfer", "DEFAULT_NUM_WARPS": ".transfer", "DEFAULT_PROGRAMS_PER_SM": ".transfer",
    "PrefixCache": ".prefix", "BlockAllocator": ".host_pool", "block_names": ".prefix_index", "HASHES": ".prefix_index",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
