"""FlashInfer backend: sparse MLA over bf16 rows through FlashInfer's paged MLA kernel.

FlashInfer (0.6.x) has no sparse-MLA kernel that runs on SM90: its sparse trtllm-gen
MLA path needs SM100+, and that path is not wired up here (``supports`` says so for
fp8_ds_mla rows). What does run on SM80/SM90 is ``BatchMLAPagedAttentionWrapper``.
With ``page_size = 1`` a "page" is one row, so a sparse selection is just a page list:

  token t (a batch entry with query length 1) -> its valid rows, compacted
  (``indices[t, k] >= 0`` and ``k < valid_counts[t]``), as ``kv_indices``;
  ``kv_indptr`` = prefix sums of the per-token counts.

``plan()`` reads the indptr arrays on the host, so every call syncs; there is no
unchecked path and index ranges are always validated. Tokens with no valid row are
left out of the batch and get out = 0, lse = -inf. The kernel's LSE is base 2; we
return natural log (``lse * ln 2``). Duplicated indices are attended once per entry,
as the interface says. The first call JIT-compiles the kernel (about 25 s on an H200).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

import torch

from ..formats import D_LATENT, D_ROPE, RowFormat
from .base import (
    D_V,
    DecodeInputs,
    Phase,
    SparseMLABackend,
    empty_result,
    heads_reason,
    validate_decode_inputs,
    validate_prefill_inputs,
)

_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace
_D_CKV = D_LATENT  # FlashInfer's names: compressed KV (the latent) and the RoPE part
_D_KPE = D_ROPE
_LN2 = math.log(2.0)

_IMPORT: dict[str, Any] = {}  # "reason": str | None, "version": str
_find_spec = importlib.util.find_spec  # (a module attribute so tests can simulate absence)


def flashinfer_import_reason() -> str | None:
    """None if ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` imports, else why not (cached)."""
    if "reason" not in _IMPORT:
        if _find_spec("flashinfer") is None:
            _IMPORT["reason"] = ("flashinfer is not installed (pip install flashinfer-python; "
                                 "offline: pip install --no-index --no-deps --target DIR "
                                 ".gpu-deps/flashinfer/*.whl and add DIR to PYTHONPATH)")
        else:
            try:  # flashinfer is an optional dependency (the [flashinfer] extra): imported here only
                import flashinfer  # noqa: F401
                from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401

                _IMPORT["reason"] = None
                _IMPORT["version"] = getattr(flashinfer, "__version__", "unknown")
            except Exception as e:  # a broken install: report it, don't crash supports()
                _IMPORT["reason"] = f"importing flashinfer.mla failed: {type(e).__name__}: {e}"
    return _IMPORT["reason"]


def flashinfer_version() -> str | None:
    """The installed flashinfer's version, None when it can't be imported."""
    if flashinfer_import_reason() is not None:
        return None
    return str(_IMPORT.get("version"))


@dataclasses.dataclass
class FlashInferPlan:
    """A planned decode: run it with :meth:`FlashInferBackend.run`.

    rows:   bf16 [N, 576] the row view attended
    q:      bf16 [B, H, 576] the queries of tokens with >= 1 valid row (B <= T)
    select: int64 [B] which tokens those are, or None when B == T
    """

    T: int
    H: int
    rows: torch.Tensor
    q: torch.Tensor
    select: torch.Tensor | None
    generation: int


class FlashInferBackend(SparseMLABackend):
    """Sparse MLA on bf16 rows via FlashInfer's ``BatchMLAPagedAttentionWrapper``.

    ``backend``: FlashInfer's kernel choice ("auto" = fa3 on SM90, fa2 elsewhere).
    One wrapper (and a 128 MiB workspace) per device, created on first use; the
    wrapper holds the last plan, so one object must not be used from two threads.
    """

    name = "flashinfer"

    def __init__(self, *, backend: str = "auto") -> None:
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backend must be 'auto', 'fa2' or 'fa3', got {backend!r}")
        self.backend = backend
        self._wrappers: dict[torch.device, object] = {}
        self._generation = 0

    # ---------------------------------------------------------------- capability
    def supports(self, *, device: torch.device, row_format: RowFormat, num_heads: int,
                 phase: Phase) -> str | None:
        device = torch.device(device)
        fmt = RowFormat.parse(row_format)
        reason = heads_reason(num_heads)
        if reason is not None:
            return reason
        if device.type != "cuda":
            return f"FlashInfer needs a CUDA device, got {device}"
        if not torch.cuda.is_available():
            return "FlashInfer needs CUDA, which is not available here"
        major, minor = torch.cuda.get_device_capability(device)
        if phase is Phase.DECODE and fmt is RowFormat.FP8_DS_MLA:
            if major >= 10:
                return ("FlashInfer's sparse MLA on fp8_ds_mla rows is its trtllm-gen path, "
                        "which hisparse does not wire up; use flashmla or triton")
            return ("FlashInfer reads fp8_ds_mla rows only through its sparse trtllm-gen MLA "
                    f"path, which needs SM100+ (this GPU is SM{major}{minor}); its SM80/SM90 "
                    "paged MLA kernel reads bf16 rows only")
        if major < 8:
            return f"FlashInfer's MLA kernels need SM80+, this GPU is SM{major}{minor}"
        if self.backend == "fa3" and major != 9:
            return f"FlashInfer backend 'fa3' needs SM90, this GPU is SM{major}{minor}"
        return flashinfer_import_reason()

    def _require(self, device: torch.device, fmt: RowFormat, H: int, phase: Phase) -> None:
        reason = self.supports(device=device, row_format=fmt, num_heads=H, phase=phase)
        if reason is not None:
            raise ValueError(f"FlashInfer backend cannot run this {phase.value}: {reason}")

    def _wrapper(self, device: torch.device):
        w = self._wrappers.get(device)
        if w is None:
            # optional dependency: flashinfer_import_reason() (asked by supports) imported it
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            w = BatchMLAPagedAttentionWrapper(ws, backend=self.backend)
            self._wrappers[device] = w
        return w

    # ---------------------------------------------------------------- plan / run
    def plan(self, q, kv_rows, indices, *, valid_counts=None, sm_scale,
             row_format=RowFormat.BF16) -> FlashInferPlan | None:
        """Validate and plan a decode (host sync). None means no token has a valid row."""
        inp = validate_decode_inputs(q, kv_rows, indices, valid_counts=valid_counts,
                                     sm_scale=sm_scale, row_format=row_format, check_ranges=True)
        self._require(inp.q.device, inp.row_format, inp.num_heads, Phase.DECODE)
        return self._plan(inp)

    def _plan(self, inp: DecodeInputs) -> FlashInferPlan | None:
        # q bf16 [T, H, 576]; rows bf16 [N, 576]; idx int32 [T, K], -1 = padding
        q, rows, idx = inp.q, inp.kv_rows, inp.indices
        T, H, K = q.shape[0], q.shape[1], idx.shape[1]
        if T == 0 or K == 0 or rows.shape[0] == 0:
            return None
        mask = idx >= 0  # bool [T, K]
        if inp.valid_counts is not None:
            ar = torch.arange(K, device=idx.device, dtype=torch.int32)
            mask &= ar.unsqueeze(0) < inp.valid_counts.unsqueeze(1)
        counts = mask.sum(dim=1, dtype=torch.int32)  # int32 [T]
        keep = counts > 0
        B = int(keep.sum())  # host sync (plan() needs host data anyway)
        if B == 0:
            return None
        select = None
        if B < T:
            select = torch.nonzero(keep).squeeze(1)  # int64 [B]
            q = q.index_select(0, select)
            counts = counts.index_select(0, select)
            mask = mask.index_select(0, select)
            idx = idx.index_select(0, select)
        kv_indices = idx[mask].to(torch.int32)  # int32 [sum counts], grouped by token
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=idx.device)
        kv_indptr[1:] = torch.cumsum(counts, dim=0)
        qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=idx.device)
        w = self._wrapper(q.device)
        w.plan(qo_indptr, kv_indptr, kv_indices, counts, H, _D_CKV, _D_KPE, 1, False,
               inp.sm_scale, torch.bfloat16, torch.bfloat16)
        self._generation += 1
        return FlashInferPlan(T, H, rows, q, select, self._generation)

    def run(self, plan: FlashInferPlan | None, *, T: int = 0, H: int = 1,
            device: torch.device | str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
        """Run a plan from :meth:`plan` (the most recent one). ``plan=None`` (nothing
        valid) returns zeros / -inf of shape [T, H, 512] / [T, H] on ``device``."""
        if plan is None:
            return empty_result(T, H, torch.device(device))
        if plan.generation != self._generation:
            raise RuntimeError(
                f"FlashInfer plan {plan.generation} is stale: the wrapper was re-planned "
                f"(now {self._generation}); plan again before run")
        q, rows = plan.q, plan.rows
        B = q.shape[0]
        w = self._wrapper(q.device)
        out = torch.empty((B, plan.H, D_V), dtype=torch.bfloat16, device=q.device)
        lse2 = torch.empty((B, plan.H), dtype=torch.float32, device=q.device)
        w.run(q[:, :, :_D_CKV], q[:, :, _D_CKV:], rows[:, :_D_CKV].unsqueeze(1),
              rows[:, _D_CKV:].unsqueeze(1), out=out, lse=lse2, return_lse=True)
        lse = lse2 * _LN2  # base 2 -> natural log
        if plan.select is None:
            return out, lse
        full_out, full_lse = empty_result(plan.T, plan.H, q.device)
        full_out.index_copy_(0, plan.select, out)
        full_lse.index_copy_(0, plan.select, lse)
        return full_out, full_lse

    # ---------------------------------------------------------------- interface
    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format):
        inp = validate_decode_inputs(q, kv_rows, indices, valid_counts=valid_counts,
                                     sm_scale=sm_scale, row_format=row_format, check_ranges=True)
        self._require(inp.q.device, inp.row_format, inp.num_heads, Phase.DECODE)
        return self.run(self._plan(inp), T=inp.num_tokens, H=inp.num_heads, device=inp.q.device)

    def prefill(self, q, workspace, indices, *, valid_counts=None, sm_scale):
        inp = validate_prefill_inputs(q, workspace, indices, valid_counts=valid_counts,
                                      sm_scale=sm_scale, check_ranges=True).as_decode()
        self._require(inp.q.device, RowFormat.BF16, inp.num_heads, Phase.PREFILL)
        return self.run(self._plan(inp), T=inp.num_tokens, H=inp.num_heads, device=inp.q.device)


__all__ = ["FlashInferBackend", "FlashInferPlan", "flashinfer_import_reason", "flashinfer_version"]
