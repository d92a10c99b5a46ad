"""The tiered cache: a pinned host pool plus per-(layer, request) GPU hot buffers.

- ``HiSparseCache(cfg, kernels=, pin=, host_pool=)``: the coordinator (``cache``); also
  ``hisparse.HiSparseCache``.
- What its calls take and hand back: ``ResolveResult`` (``resolve``) and ``SplitResult``
  (``resolve(..., split=True)``), ``RequestInfo`` (``request``), ``PoolUsage``
  (``pool_usage``) (``results``); ``ResolveBuffers`` (``prefetch``; ``state``);
  ``WriteBatch`` (``plan_write``; ``write``); ``StepPlan`` (``prepare_step``) and
  ``StepCapacity`` (its ``capacity=``: fixed-shape lists) (``write_step``); ``LayerView``
  (``layer_view``: what ``hisparse.staging`` reads of a layer; defined there).
- ``CacheGraphs`` (``cache.graphs``): CUDA graphs as a mode of the calls -- plan a call
  once (``ResolveCall``, ``WriteCall``), launch it eagerly or inside a capture, run it
  with a replay (``graphs``).
- ``HostPool``: the pinned host pool a cache owns, or one built elsewhere and passed as
  ``host_pool=`` (``host_pool``; ``distributed.setup_shared_pool`` builds a node-shared one).
- ``expand_runs``: (start, n, step) runs expanded into one int64 index tensor, as the
  write plans build their lists (``write_plan``).

The names are imported when first used: ``import hisparse.cache`` loads none of its
modules and no Triton (``HiSparseCache`` and ``LayerView`` load it, through the kernels).
"""

from __future__ import annotations

from .._lazy import lazy_exports

# exported name -> module that defines it (relative to this package)
_EXPORTS = {
    "HiSparseCache": ".cache",
    "ResolveResult": ".results", "SplitResult": ".results", "RequestInfo": ".results", "PoolUsage": ".results",
    "CacheGraphs": ".graphs", "ResolveCall": ".graphs", "WriteCall": ".graphs",
    "ResolveBuffers": ".state",
    "WriteBatch": ".write_batch",
    "StepPlan": ".write_step", "StepCapacity": ".write_step",
    "HostPool": ".host_pool",
    "expand_runs": ".write_plan",
    "LayerView": "..staging.view",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
