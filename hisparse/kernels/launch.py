"""Launching the cache's Triton kernels with less host time than ``kernel[grid](...)``.

Each ``kernel[grid](*args)`` call goes through Triton's JIT launcher. That launcher
binds and specialises the arguments (native code), then does per-call Python work: it
reads the current device and stream through Triton's driver layer, builds a
compile-cache key from the specialisation and the options, checks the kernel's
globals, and builds launch metadata. :class:`FastLaunch` keeps the binding and the
specialisation, which are what decides which compiled kernel applies, and does the
rest once:
  - the first call of each (device, specialisation, keyword arguments) goes through
    the JIT, which compiles or finds the kernel and launches it;
  - the kernel it returns is kept, and later calls with the same key call its
    compiled launcher directly, on torch's current stream.

A call with an argument whose specialisation differs gets its own entry (an int that
becomes 1, a pointer that loses 16-byte alignment), exactly as the JIT would. Launch
hooks (``triton.knobs.runtime.launch_enter_hook``, e.g. profilers) still run; with none
set (Triton's default, an empty chain), no launch metadata is built. Not
done here, unlike the JIT:
  - re-reading ``TRITON_DEBUG`` and the instrumentation knob after the first call;
  - checking that the kernel's globals kept their values (the cache's kernels read
    none that change).

On CPU (the interpreter) every call goes through the JIT, and so does every call when
``HISPARSE_JIT_LAUNCH=1`` was set before hisparse was imported (to rule this path out,
or to measure against the JIT).
"""

from __future__ import annotations

import os

import torch
from triton import knobs

from .._checks import interpreter_mode

__all__ = ["FastLaunch"]


def _hook(h):
    """A launch hook, or None for none: Triton's default is an empty ``HookChain``."""
    return None if h is None or not getattr(h, "calls", True) else h


class FastLaunch:
    """``FastLaunch(kernel)(grid, *args, **kwargs)`` launches ``kernel[grid](*args,
    **kwargs)`` (see the module docstring). ``kernel``: a ``triton.jit`` function."""

    __slots__ = ("fn", "_compiled", "_jit_only")

    def __init__(self, fn) -> None:
        self.fn = fn
        self._compiled: dict[tuple, object] = {}
        # Triton's JIT keeps, per device, its caches and the binder (the 5th element)
        self._jit_only = (interpreter_mode() or not hasattr(fn, "device_caches")
                          or os.environ.get("HISPARSE_JIT_LAUNCH", "0") not in ("", "0"))

    def __call__(self, grid: tuple, *args, **kwargs) -> None:
        if self._jit_only or not torch.cuda.is_available():
            self.fn[grid](*args, **kwargs)
            return
        dev = torch.cuda.current_device()
        caches = self.fn.device_caches.get(dev)
        if caches is None:  # first launch on this device: the JIT builds its binder
            self._first(dev, None, grid, args, kwargs)
            return
        bound, spec, _ = caches[4](*args, **kwargs)
        key = (dev, tuple(spec), tuple(kwargs.items()))
        k = self._compiled.get(key)
        if k is None:
            self._first(dev, key, grid, args, kwargs)
            return
        stream = torch.cuda.current_stream(dev).cuda_stream
        n = len(grid)
        vals = bound.values()
        enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
        meta = k.launch_metadata(grid, stream, *vals) if enter is not None else None
        k.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, k.function,
              k.packed_metadata, meta, enter, leave, *vals)

    def _first(self, dev: int, key: tuple | None, grid: tuple, args: tuple, kwargs: dict) -> None:
        k = self.fn[grid](*args, **kwargs)
        if key is None:
            caches = self.fn.device_caches.get(dev)
            if caches is None:
                return
            key = (dev, tuple(caches[4](*args, **kwargs)[1]), tuple(kwargs.items()))
        if k is not None:
            self._compiled[key] = k

    def compiled_count(self) -> int:
        """How many (device, specialisation, keywords) entries have a kept kernel."""
        return len(self._compiled)
