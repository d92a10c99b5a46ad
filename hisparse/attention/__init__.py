"""Sparse-MLA attention backends behind one interface (``base.SparseMLABackend``).

- ``choose_backend(device=, row_format=, num_heads=, phase=)``: the first backend that
  ``supports`` the combination (``chooser``; ``available_backends`` says why each
  other one can't).
- ``ReferenceBackend`` (float32 torch oracle), ``TritonBackend`` (portable, bf16 and
  fp8_ds_mla; ``TritonMLAConfig`` / ``default_config``: its launch shape;
  ``gluon_ws_problem``: why its warp-specialised kernel can't run here, or None),
  ``FlashMLABackend`` (ops from vllm / sgl_kernel or a library path),
  ``FlashInferBackend`` (``flashinfer_version``: the installed one, or None).
- ``miss``: the miss side of a split decode (``merge_lse``, ``miss_attention_merge``).

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
    "TritonBackend": "triton_backend", "TritonMLAConfig": "triton_backend",
    "default_config": "triton_backend",
    "gluon_ws_problem": "triton_backend",
    "FlashMLABackend": "flashmla",
    "FlashInferBackend": "flashinfer", "flashinfer_version": "flashinfer",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
