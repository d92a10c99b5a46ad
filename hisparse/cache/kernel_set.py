"""The launches a cache makes, as one named interface with two implementations side by
side: ``TorchKernels`` (the torch references: the CPU path and the tests' oracle) and
``TritonKernels`` (the Triton launchers, which run without re-checking what the cache
owns: its state, buffers, plans and pool). ``cache_kernels`` picks one. The callers
(``Writer``, ``Stager``) check each call's own arguments first.

Tensor arguments, every method (notation in ``hisparse.cache.state``):
  state      ``HotState`` of the cache
  req_ids    int32 [T] request id per query token; topk int32 [T, K] positions
  out        ``ResolveBuffers`` viewed as [T, K] (physical rows, valid counts, staging lists)
  host_rows  uint8 [H, row_bytes] one layer of the pinned host pool
  hot_rows   uint8 [N, row_bytes] one layer of the device rows
  rows       uint8 [n, row_bytes] packed rows of a write plan
"""

from __future__ import annotations

import torch

from .._checks import Kernels, check_int
from .apply_write import (apply_write_layers_reference, apply_write_layers_triton, apply_write_plan_reference,
                          apply_write_plan_triton)
from .host_pool import HostPool
from .resolve_ref import (copy_rows_reference, copy_staged_reference, resolve_lookup_reference, resolve_reference,
                          resolve_resident_reference)
from .resolve_launch import resolve_lookup_triton, resolve_resident_unchecked, resolve_unchecked
from .state import ResolveBuffers
from .transfer import copy_rows_unchecked, copy_staged_unchecked


class PinnedPool:
    """Whether the host pool's rows (uint8 [L, H, row_bytes], CPU), which the Triton
    kernels reach over UVA, are page-locked now: the pool's own flag, which a release
    or close clears (a flag read per launch, capture included); a pool that is not
    pinned is refused with a ValueError before the launch. On the interpreter (dev
    None) there is nothing to check."""

    def __init__(self, pool: HostPool, dev: torch.device | None) -> None:
        self.pool = pool
        self.dev = dev

    def check(self, name: str) -> None:
        if self.dev is not None and not self.pool.pinned:
            raise ValueError(f"{name} (the host pool's rows) is not pinned (a pool made with pin=False, "
                             f"or released / closed); the kernel on {self.dev} can only reach page-locked "
                             "host memory")


class CacheKernels:
    """The launches of one implementation (see the module docstring). A method may be
    replaced on an instance (tests inject failures that way)."""

    kind: Kernels

    def resolve(self, state, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, out: ResolveBuffers, *,
                max_query_len: int, compact: bool, prefetch: bool = False, stamped: bool = False,
                miss_lists: tuple | None = None) -> None:
        """The LRU resolve of ``topk`` (a split resolve's miss phase with ``stamped``,
        listing its misses in ``miss_lists``); fills ``out``."""
        raise NotImplementedError

    def lookup(self, state, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, hit: torch.Tensor,
               undo_hit: torch.Tensor, *, max_query_len: int) -> None:
        """A split resolve's hit phase: stamps the hits, hit int32 [T, K] (-1 elsewhere)."""
        raise NotImplementedError

    def resolve_resident(self, state, layer: int, req_ids: torch.Tensor, topk: torch.Tensor,
                         out: ResolveBuffers, *, max_query_len: int, compact: bool) -> None:
        """The resident path: positions through the device page table, nothing staged."""
        raise NotImplementedError

    def copy_staged(self, host_rows: torch.Tensor, out: ResolveBuffers, hot_rows: torch.Tensor, *, K: int,
                    programs: int | None = None, shape: tuple[int, int] | None = None) -> None:
        """Stage ``out``'s listed misses from host into their hot rows (``programs``: the
        copy's grid, None = its default; ``shape``: (rows per iteration, warps))."""
        raise NotImplementedError

    def apply_write(self, state, hot_l: torch.Tensor, rows: torch.Tensor, plan, layer: int) -> None:
        """A write plan's hot-tier update of one layer (hot_l uint8 [N, row_bytes])."""
        raise NotImplementedError

    def apply_write_pooled(self, state, hot: torch.Tensor, pool_rows: torch.Tensor, plan, layers: range,
                           extra: int) -> None:
        """A pooled plan (hot_tok: host rows) applied to ``layers``, the rows read from
        the host pool (``hisparse.cache.write_pooled``); hot: uint8 [L, N, row_bytes],
        pool_rows: uint8 [L, H, row_bytes]."""
        raise NotImplementedError

    def mirror(self, rows: torch.Tensor, plan, host_l: torch.Tensor) -> None:
        """The host copy of a write plan's rows (host_l uint8 [H, row_bytes])."""
        raise NotImplementedError

    def check_pinned(self, name: str) -> None:
        """ValueError when the host pool these launches read over UVA is not pinned now."""


class TorchKernels(CacheKernels):
    """The torch references (any device; the CPU path)."""

    kind = Kernels.TORCH

    def resolve(self, state, layer, req_ids, topk, out, *, max_query_len, compact, prefetch=False, stamped=False,
                miss_lists=None) -> None:
        resolve_reference(state, layer, req_ids, topk, out, max_query_len=max_query_len, compact=compact,
                          prefetch=prefetch, stamped=stamped, miss_lists=miss_lists)

    def lookup(self, state, layer, req_ids, topk, hit, undo_hit, *, max_query_len) -> None:
        resolve_lookup_reference(state, layer, req_ids, topk, hit, undo_hit, max_query_len=max_query_len)

    def resolve_resident(self, state, layer, req_ids, topk, out, *, max_query_len, compact) -> None:
        resolve_resident_reference(state, layer, req_ids, topk, out, max_query_len=max_query_len, compact=compact)

    def copy_staged(self, host_rows, out, hot_rows, *, K, programs=None, shape=None) -> None:
        copy_staged_reference(host_rows, out.stage_src, hot_rows, out.stage_dst, out.stage_counts, K=K)

    def apply_write(self, state, hot_l, rows, plan, layer) -> None:
        apply_write_plan_reference(state, hot_l, rows, plan, layer)

    def apply_write_pooled(self, state, hot, pool_rows, plan, layers, extra) -> None:
        apply_write_layers_reference(state, hot, pool_rows, plan, layers, extra)

    def mirror(self, rows, plan, host_l) -> None:
        copy_rows_reference(rows, plan.host_tok32, host_l, plan.host_h32)


class TritonKernels(CacheKernels):
    """The Triton launchers (CUDA, or Triton's interpreter on CPU)."""

    kind = Kernels.TRITON

    def __init__(self, device: torch.device, pool: HostPool) -> None:
        self.dev = device if device.type == "cuda" else None
        self.pinned = PinnedPool(pool, self.dev)  # the pool check (tests may set its dev)

    def resolve(self, state, layer, req_ids, topk, out, *, max_query_len, compact, prefetch=False, stamped=False,
                miss_lists=None) -> None:
        resolve_unchecked(state, layer, req_ids, topk, out, max_query_len=max_query_len, compact=compact,
                          prefetch=prefetch, stamped=stamped, miss_lists=miss_lists)

    def lookup(self, state, layer, req_ids, topk, hit, undo_hit, *, max_query_len) -> None:
        resolve_lookup_triton(state, layer, req_ids, topk, hit, undo_hit, max_query_len=max_query_len)

    def resolve_resident(self, state, layer, req_ids, topk, out, *, max_query_len, compact) -> None:
        resolve_resident_unchecked(state, layer, req_ids, topk, out, max_query_len=max_query_len, compact=compact)

    def copy_staged(self, host_rows, out, hot_rows, *, K, programs=None, shape=None) -> None:
        # the pool's pinned flag: checked by every resolve before it launches (HiSparseCache._runtime_checks)
        if programs is not None:  # Stager.stage_programs, settable by its user
            check_int("programs", programs, 1)
        rows, warps = shape if shape is not None else (8, 4)  # (rows per iteration, warps)
        copy_staged_unchecked(host_rows, out.stage_src, hot_rows, out.stage_dst, out.stage_counts, self.dev,
                              K=K, programs=programs, rows_per_program=rows, num_warps=warps)

    def apply_write(self, state, hot_l, rows, plan, layer) -> None:
        apply_write_plan_triton(state, hot_l, rows, plan, layer)

    def apply_write_pooled(self, state, hot, pool_rows, plan, layers, extra) -> None:
        self.pinned.check("the pooled write's source")
        apply_write_layers_triton(state, hot, pool_rows, plan, layers, extra)

    def mirror(self, rows, plan, host_l) -> None:  # packed rows (Writer.check_rows) -> pinned host over UVA
        self.pinned.check("dst")
        copy_rows_unchecked(rows, plan.host_tok32, host_l, plan.host_h32, self.dev)

    def check_pinned(self, name: str) -> None:
        self.pinned.check(name)


def cache_kernels(kernels: Kernels, device: torch.device, pool: HostPool) -> CacheKernels:
    """The implementation a cache picked (``Kernels.TORCH`` or ``Kernels.TRITON``)."""
    return TorchKernels() if kernels is Kernels.TORCH else TritonKernels(device, pool)


__all__ = ["CacheKernels", "PinnedPool", "TorchKernels", "TritonKernels", "cache_kernels"]
