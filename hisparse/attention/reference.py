"""Float32 torch sparse-MLA attention: the oracle every other backend is tested against.

Per chunk of query tokens: gather the selected rows, dequantize them (fp8_ds_mla) to
float32, score ``sm_scale * q . k`` over all 576 dims, mask padding / entries past
``valid_counts``, softmax, and sum the first 512 dims of the rows. Semantics are spelled
out in ``hisparse.attention.base``. Runs on any device; memory is bounded by chunking
over T (about ``chunk_bytes`` of gathered float32 rows per chunk).
"""

from __future__ import annotations

import torch

from ..formats import RowFormat
from ..formats import dequantize_fp8_ds_mla_reference
from .base import (D_QK, D_V, DecodeInputs, Phase, SparseMLABackend, heads_reason,
                   validate_decode_inputs, validate_prefill_inputs)


def sparse_mla_reference(inp: DecodeInputs, *, chunk_bytes: int = 1 << 28,
                         out_dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over validated inputs. Returns out ``out_dtype`` [T, H, 512], lse float32 [T, H].

    Out-of-range indices (possible only when validation skipped the range check) are
    treated as padding, like the kernels do.
    """
    q, kv, idx = inp.q, inp.kv_rows, inp.indices
    T, H, _ = q.shape
    K = idx.shape[1]
    N = kv.shape[0]
    dev = q.device
    out = torch.zeros((T, H, D_V), dtype=torch.float32, device=dev)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=dev)
    if T == 0 or K == 0:
        return out.to(out_dtype), lse
    valid = (idx >= 0) & (idx < N)
    if inp.valid_counts is not None:
        k_pos = torch.arange(K, device=dev)
        valid &= k_pos[None, :] < inp.valid_counts.to(torch.int64)[:, None]
    safe = torch.where(valid, idx.to(torch.int64), torch.zeros((), dtype=torch.int64, device=dev))
    chunk = max(1, int(chunk_bytes // max(1, K * D_QK * 4)))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        flat = safe[t0:t1].reshape(-1)
        if N == 0:  # every entry is padding; keep the gather well defined
            rows = torch.zeros((flat.numel(), D_QK), dtype=torch.float32, device=dev)
        elif inp.row_format is RowFormat.FP8_DS_MLA:
            rows = dequantize_fp8_ds_mla_reference(kv.index_select(0, flat),
                                                   out_dtype=torch.float32)
        else:
            rows = kv.index_select(0, flat).float()
        rows = rows.reshape(t1 - t0, K, D_QK)
        s = torch.einsum("thd,tkd->thk", q[t0:t1].float(), rows) * inp.sm_scale
        s = s.masked_fill(~valid[t0:t1, None, :], float("-inf"))
        m = s.amax(dim=2, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)  # 0 where masked
        denom = p.sum(dim=2, keepdim=True)
        has = denom > 0
        o = torch.einsum("thk,tkd->thd", p, rows[:, :, :D_V])
        out[t0:t1] = torch.where(has, o / torch.where(has, denom, torch.ones_like(denom)),
                                 torch.zeros_like(o))
        lse[t0:t1] = torch.where(has[..., 0], (m + torch.log(denom))[..., 0],
                                 torch.full_like(denom[..., 0], float("-inf")))
    return out.to(out_dtype), lse


class ReferenceBackend(SparseMLABackend):
    """Float32 torch oracle; supports every device, format, head count and phase (slow)."""

    name = "reference"

    def supports(self, *, device: torch.device, row_format: RowFormat, num_heads: int,
                 phase: Phase) -> str | None:
        RowFormat.parse(row_format)
        reason = heads_reason(num_heads)
        if reason is not None:
            return reason
        return None

    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format):
        inp = validate_decode_inputs(q, kv_rows, indices, valid_counts=valid_counts,
                                     sm_scale=sm_scale, row_format=row_format)
        return sparse_mla_reference(inp)

    def prefill(self, q, workspace, indices, *, valid_counts=None, sm_scale):
        inp = validate_prefill_inputs(q, workspace, indices, valid_counts=valid_counts,
                                      sm_scale=sm_scale)
        return sparse_mla_reference(inp.as_decode())


__all__ = ["ReferenceBackend", "sparse_mla_reference"]
