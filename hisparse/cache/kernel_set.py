"""The launch functions a cache calls, for the kernel implementation it picked
(``Kernels.TORCH``: the torch references; ``Kernels.TRITON``: the Triton launchers,
which run without re-checking what the cache owns: its state, buffers, plans and pool),
and the check that the host pool the Triton kernels read over UVA is page-locked.
"""

from __future__ import annotations

import torch

from .._checks import Kernels, check_int
from .apply_write import apply_write_plan_reference, apply_write_plan_triton
from .host_pool import HostPool
from .resolve_ref import (copy_rows_reference, copy_staged_reference, resolve_lookup_reference, resolve_reference,
                          resolve_resident_reference)
from .resolve_triton import _launch_resolve, _launch_resolve_resident, resolve_lookup_triton
from .state import ResolveBuffers
from .transfer import _launch_copy_rows, _launch_copy_staged


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


def kernel_set(kernels: Kernels, device: torch.device, pool: HostPool) -> dict:
    """The launch functions of a picked implementation (resolve_fn, lookup_fn,
    resident_fn, copy_fn, apply_fn, mirror_fn, pinned_check). The callers check the
    call's own arguments."""
    if kernels is Kernels.TORCH:
        def mirror(rows, plan, host_l):
            copy_rows_reference(rows, plan.host_tok32, host_l, plan.host_h32)

        def stage_ref(host_rows, out: ResolveBuffers, hot_rows, *, K: int, programs=None, shape=None) -> None:
            copy_staged_reference(host_rows, out.stage_src, hot_rows, out.stage_dst, out.stage_counts, K=K)
        return dict(resolve_fn=resolve_reference, lookup_fn=resolve_lookup_reference,
                    resident_fn=resolve_resident_reference, copy_fn=stage_ref,
                    apply_fn=apply_write_plan_reference, mirror_fn=mirror, pinned_check=lambda name: None)

    dev = device if device.type == "cuda" else None
    pinned = PinnedPool(pool, dev)

    def mirror(rows, plan, host_l):  # packed rows (Writer.check_rows) -> pinned host over UVA
        pinned.check("dst")
        _launch_copy_rows(rows, plan.host_tok32, host_l, plan.host_h32, dev)

    def stage(host_rows, out: ResolveBuffers, hot_rows, *, K: int, programs=None, shape=None) -> None:
        # the pool's pinned flag: checked by every resolve before it launches (_check_resolve)
        if programs is not None:  # Stager.stage_programs, settable by its user
            check_int("programs", programs, 1)
        rows, warps = shape if shape is not None else (8, 4)  # (rows per iteration, warps)
        _launch_copy_staged(host_rows, out.stage_src, hot_rows, out.stage_dst, out.stage_counts, dev,
                            K=K, programs=programs, rows_per_program=rows, num_warps=warps)

    return dict(resolve_fn=_launch_resolve, lookup_fn=resolve_lookup_triton, resident_fn=_launch_resolve_resident,
                copy_fn=stage, apply_fn=apply_write_plan_triton, mirror_fn=mirror, pinned_check=pinned.check)


__all__ = ["PinnedPool", "kernel_set"]
