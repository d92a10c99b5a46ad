"""Decode attention that reads a step's missed rows from the pinned host pool itself.

Notation: T query tokens, H heads, K entries per token, N hot rows, NH host rows (of
one layer), W = row bytes (656 for fp8_ds_mla).

``SparseMLABackend.decode_host_misses(q, kv_rows, indices, host_rows, miss_rows, ...)``
computes exactly ``decode(q, kv_rows, indices, ...)`` as if every missed row had been
staged first: for an entry with ``miss_rows[t, k] = h >= 0`` the row attended is host
row ``h``, and by the time the results are ready (stream order) that row's bytes are
also in hot row ``indices[t, k]``, as a staging copy would have left them. Entries with
``miss_rows[t, k] = -1`` read the hot row as ``decode`` does. So the resolve (with its
``miss_rows`` output) followed by this call leaves the cache as resolve + staging copy
+ ``decode`` would, with the misses crossing PCIe inside the attention instead of in a
copy that the attention waits for (``hisparse.decode`` mode ``inline``).

Contract on the inputs (the resolve's outputs satisfy it): the hot rows that misses are
written into are read by no entry of the same call as a hot row (a miss's slot is a
victim that no entry of the step hits), and entries that name the same hot row as a
miss name the same host row. An entry whose ``miss_rows`` value is outside [-1, NH) is
an error in checked mode and reads its hot row unchecked (never out of bounds).

``stage_host_misses_reference`` is the copy half of the reference; a backend whose
kernels cannot read host memory answers ``host_misses_problem`` with its reason.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_tensor, device_type
from ..device import is_pinned_host
from .base import DecodeInputs


@dataclasses.dataclass(frozen=True)
class HostMisses:
    """Validated host-miss inputs of a decode.

    host_rows: uint8 [NH, W] one layer's rows of the host pool (pinned when the decode
               runs on CUDA; last-dim stride 1)
    miss_rows: int32 [T, K] host row of each missed entry, -1 = read the hot row; the
               same row stride as the decode's indices
    """

    host_rows: torch.Tensor
    miss_rows: torch.Tensor


def validate_host_misses(inp: DecodeInputs, host_rows: object, miss_rows: object, *,
                         check_ranges: bool = True) -> HostMisses:
    """Check ``host_rows`` / ``miss_rows`` against validated decode inputs (raises
    ``TypeError`` / ``ValueError`` before any launch; ``check_ranges`` reads the
    entries, a host sync)."""
    host = check_tensor("host_rows", host_rows)
    mr = check_tensor("miss_rows", miss_rows)
    kv, idx = inp.kv_rows, inp.indices
    W = kv.shape[1] * kv.element_size()
    if host.dtype != torch.uint8 or host.dim() != 2 or host.shape[1] != W:
        raise ValueError(f"host_rows must be uint8 [NH, {W}] (rows of the same format as kv_rows), "
                         f"got {host.dtype} {tuple(host.shape)}")
    if host.shape[0] > 0 and host.stride(1) != 1:
        raise ValueError("host_rows must have a contiguous last dimension (stride(1) == 1)")
    if device_type(host.device) != "cpu":
        raise ValueError(f"host_rows must be host memory (the host pool), got a tensor on {host.device}")
    if device_type(idx.device) == "cuda" and not is_pinned_host(host):
        raise ValueError("host_rows must be pinned (page-locked) host memory: the CUDA kernel reads it "
                         "over UVA")
    if mr.dtype != torch.int32:
        raise TypeError(f"miss_rows must be int32 [T, K], got dtype {mr.dtype}")
    if tuple(mr.shape) != tuple(idx.shape):
        raise ValueError(f"miss_rows must have the shape of indices {tuple(idx.shape)}, got {tuple(mr.shape)}")
    if mr.device != idx.device:
        raise ValueError(f"miss_rows is on {mr.device}, indices on {idx.device}")
    if mr.numel() > 0 and (mr.stride(1) != 1 or mr.stride(0) != idx.stride(0)):
        raise ValueError(f"miss_rows must have the strides of indices {idx.stride()}, got {mr.stride()}")
    if check_ranges and mr.numel() > 0:
        lo, hi = int(mr.min()), int(mr.max())
        if lo < -1 or hi >= host.shape[0]:
            raise ValueError(f"miss_rows must lie in [-1, {host.shape[0]}) (host_rows has "
                             f"{host.shape[0]} rows; -1 = a hot row), got values in [{lo}, {hi}]")
    return HostMisses(host, mr)


def stage_host_misses_reference(kv_rows: torch.Tensor, indices: torch.Tensor, hm: HostMisses) -> int:
    """kv_rows[indices[t, k]] = host_rows[miss_rows[t, k]] for every entry whose index is in
    [0, N) and whose host row is in [0, NH). kv_rows: uint8 [N, W] (or a view of the
    same bytes); returns the number of entries copied (duplicates included)."""
    raw = kv_rows if kv_rows.dtype == torch.uint8 else kv_rows.view(torch.uint8)
    idx = indices.reshape(-1).long()
    h = hm.miss_rows.reshape(-1).long()
    sel = (idx >= 0) & (idx < raw.shape[0]) & (h >= 0) & (h < hm.host_rows.shape[0])
    d, s = idx[sel], h[sel]
    if d.numel():
        raw[d] = hm.host_rows[s.cpu()].to(raw.device)
    return int(d.numel())


__all__ = ["HostMisses", "validate_host_misses", "stage_host_misses_reference"]
