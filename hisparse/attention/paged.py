"""``PagedLookup``: the tables through which a decode maps top-k positions to device rows
itself (``TritonBackend.decode(..., paged=)``, ``kernels.paged_rows``).

A cache whose live requests are all resident (the elastic tier) builds one per layer
call (``hisparse.cache.resolve_paged``); the backend then takes the layer's logical top-k
(int32 [T, K] positions, -1 = padding) as its ``indices`` and maps them in the
attention's prologue instead of a resolve kernel in front of it, writing the same
physical rows and counters the resident resolve writes (``kernels.paged_rows``). The
tensors are views of the cache's state; the attention reads and writes them on the
current stream.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedLookup(NamedTuple):
    """The cache tables of one layer call (module docstring). R request slots, MP pages a
    request, T the call's tokens."""

    req_ids: torch.Tensor  # int32 [T], request id per query token
    id_to_slot: torch.Tensor  # int32 [max_request_id], request slot of a live id, -1 = none
    resident: torch.Tensor  # int32 [R], 1 = a resident request slot
    seq_lens: torch.Tensor  # int32 [R] of the layer
    page_table: torch.Tensor  # int32 [R, MP], pool page per logical page, -1 = none
    pool_base: int  # first row of the pool's pages in the layer's device rows
    page_rows: int  # rows per page
    num_pages: int  # pages of the pool
    stats: torch.Tensor  # int64 [n] counters of the layer (written: stat_* below)
    physical: torch.Tensor  # int32 [>= T, >= K] the resolve's physical rows (written), last dim stride 1
    max_query_len: int
    scan_chunk: int  # request ids a token's group scan reads per step
    stat_invalid: int
    stat_resolves: int
    stat_resident: int

    def tensors(self) -> tuple:
        """The tables' tensors (what a decode reads or writes besides its own inputs)."""
        return (self.req_ids, self.id_to_slot, self.resident, self.seq_lens, self.page_table, self.stats, self.physical)

    def signature(self) -> tuple:
        """What a plan of a paged decode depends on: everything ``check_paged`` checked
        (the tensors' shapes, strides, dtypes and devices, the ints), so that a call with
        an equal signature passes the same checks."""
        return (tuple((t.shape, t.stride(), t.dtype, t.device) for t in self.tensors()), self.pool_base, self.page_rows,
                self.num_pages, self.max_query_len, self.scan_chunk, self.stat_invalid, self.stat_resolves,
                self.stat_resident)


_INT32 = ("req_ids", "id_to_slot", "resident", "seq_lens", "page_table", "physical")


def check_paged(paged: object, T: int, K: int, device: torch.device) -> PagedLookup:
    """``paged`` checked against a decode of T tokens and K entries on ``device``
    (TypeError / ValueError naming the field); its contents are the cache's."""
    if not isinstance(paged, PagedLookup):
        raise TypeError(f"paged must be a PagedLookup, got {type(paged).__name__}")
    for name in _INT32 + ("stats",):
        t = getattr(paged, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"paged.{name} must be a tensor, got {type(t).__name__}")
        want = torch.int64 if name == "stats" else torch.int32
        if t.dtype != want or t.device != device:
            raise ValueError(f"paged.{name} must be {want} on {device}, got {t.dtype} on {t.device}")
    for name in ("req_ids", "id_to_slot", "resident", "seq_lens", "stats"):
        t = getattr(paged, name)
        if t.dim() != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise ValueError(f"paged.{name} must be 1-d and contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    if paged.req_ids.shape[0] != T:
        raise ValueError(f"paged.req_ids must be [T={T}], got {tuple(paged.req_ids.shape)}")
    pt = paged.page_table
    if pt.dim() != 2 or pt.stride(1) != 1:
        raise ValueError("paged.page_table must be [R, MP] with unit last-dim stride")
    R = pt.shape[0]
    if paged.resident.shape[0] != R or paged.seq_lens.shape[0] != R:
        raise ValueError(f"paged.resident and paged.seq_lens must have the page table's R={R} slots, got "
                         f"{paged.resident.shape[0]} and {paged.seq_lens.shape[0]}")
    ph = paged.physical
    if ph.dim() != 2 or ph.shape[0] < T or ph.shape[1] < K or ph.stride(1) != 1:
        raise ValueError(f"paged.physical must be [>= {T}, >= {K}] with unit last-dim stride, got "
                         f"{tuple(ph.shape)} strides {ph.stride()}")
    for name in ("pool_base", "page_rows", "num_pages", "max_query_len", "scan_chunk", "stat_invalid",
                 "stat_resolves", "stat_resident"):
        v = getattr(paged, name)
        if type(v) is not int or v < 0:
            raise ValueError(f"paged.{name} must be an int >= 0, got {v!r}")
    if paged.page_rows < 1 or paged.max_query_len < 1:
        raise ValueError("paged.page_rows and max_query_len must be >= 1")
    if paged.scan_chunk < 1 or paged.scan_chunk & (paged.scan_chunk - 1):
        raise ValueError(f"paged.scan_chunk must be a power of two, got {paged.scan_chunk}")
    need = max(paged.stat_invalid, paged.stat_resolves, paged.stat_resident) + 1
    if paged.stats.shape[0] < need:
        raise ValueError(f"paged.stats has {paged.stats.shape[0]} counters; the stat_* indices need {need}")
    return paged


__all__ = ["PagedLookup", "check_paged"]
