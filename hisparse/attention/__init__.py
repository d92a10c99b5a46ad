"""Sparse-MLA attention backends behind one interface (``base.SparseMLABackend``).

- ``choose_backend(device=, row_format=, num_heads=, phase=)``: the first backend that
  ``supports`` the combination (``chooser``; ``available_backends`` says why each
  other one can't).
- ``ReferenceBackend`` (float32 torch oracle), ``TritonBackend`` (portable, bf16 and
  fp8_ds_mla; ``TritonMLAConfig`` / ``default_config``: its launch shape;
  ``gluon_ws_problem``: why its warp-specialised kernel can't run here, or None),
  ``FlashMLABackend`` (ops from vllm / sgl_kernel or a library path),
  ``FlashInferBackend`` (``flashinfer_version``: the installed one, or None).
- ``PagedLookup``: a cache's tables through which ``TritonBackend.decode(..., paged=)``
  maps a resident batch's top-k itself (``paged``; ``hisparse.cache.resolve_paged``).
- ``miss``: the miss side of a split decode (``merge_lse``, ``miss_attention_merge``);
  ``miss_attention_merge`` and ``plan_miss_attention`` (its launch shape and scratch,
  planned once) are exported here too.

Kernel level: the launch shapes of the Triton kernels, for the benchmarks that sweep,
compile or check them (``bench_triton_configs``, ``kernel_ptx``, ``racecheck_controls``):

- ``DEFAULT_CONFIGS``: the measured ``TritonMLAConfig`` per (row format, head block)
  that ``default_config`` starts from; ``auto_splits(T, H, K, cfg, device)``: the KV
  splits a launch of ``num_splits=None`` takes.
- ``WS_MAXNREG`` and ``ws_consumer_regs(producer_regs)``: the warp-specialised kernel's
  registers per thread and its consumers' share; ``ws_device_problem(device)``: why a
  device can't run it, or None.
- ``MissConfig``, ``gpu_config(mode, num_heads, num_splits=)``: the miss kernels'
  launch shape and the one a GPU takes; ``MERGE_BLOCK_H``: heads per program of their
  merge and combine kernels.

The names are imported when first used: ``import hisparse.attention`` loads nothing
else, so reaching ``base`` or ``ReferenceBackend`` never imports Triton, and the
optional FlashMLA / FlashInfer libraries are loaded only when a backend's ``supports``
or ``decode`` asks for them.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# exported name -> submodule that defines it
_EXPORTS = {
    "choose_backend": "chooser", "available_backends": "chooser", "backend_names": "chooser",
    "get_backend": "chooser", "describe": "chooser",
    "Phase": "base", "SparseMLABackend": "base",
    "ReferenceBackend": "reference",
    "TritonBackend": "triton_backend", "TritonMLAConfig": "triton_backend", "PagedLookup": "paged",
    "default_config": "triton_backend",
    "gluon_ws_problem": "triton_backend",
    "FlashMLABackend": "flashmla",
    "FlashInferBackend": "flashinfer", "flashinfer_version": "flashinfer",
    "plan_miss_attention": "miss", "miss_attention_merge": "miss",
    # kernel level (module docstring)
    "DEFAULT_CONFIGS": "triton_backend", "auto_splits": "triton_backend", "WS_MAXNREG": "triton_backend",
    "ws_consumer_regs": "triton_backend", "ws_device_problem": "triton_backend",
    "MissConfig": "miss", "gpu_config": "miss", "MERGE_BLOCK_H": "miss",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
