"""The kernel bodies (``@triton.jit``, ``@gluon.jit``). Their launchers live with their
callers (``hisparse.cache``, ``hisparse.staging``, ``hisparse.attention``,
``hisparse.formats``); an engine never needs a name of this package.

Kernel level, for the tools that compile or build on a kernel themselves:

- ``resolve_kernel``: the LRU resolve, one program per query token (``resolve``;
  ``benchmarks.resolve_registers`` compiles it for a GPU target offline).
- ``cta_barrier``: the CTA-wide barrier of the warp-specialised decode kernel, under
  its name in the installed Triton (``mla_decode_ws``; ``benchmarks.racecheck_controls``
  builds its controls on it).
- ``fast_launch_problem``, ``set_direct_launch``, ``direct_launch_counts``: whether
  compiled kernels launch directly (``fast_launch``; ``hisparse env`` reports it), the
  switch a benchmark compares the two paths with, and the launches each path took.

The names are imported when first used: ``import hisparse.kernels`` loads no kernel and
no Triton.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# exported name -> submodule that defines it
_EXPORTS = {"resolve_kernel": "resolve", "cta_barrier": "mla_decode_ws", "fast_launch_problem": "fast_launch",
            "set_direct_launch": "fast_launch", "direct_launch_counts": "fast_launch"}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
