"""Test setup: Triton runs in interpreter mode when there is no GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, so it is set here
(the earliest hook pytest gives) and only when CUDA is absent.
"""

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter() -> None:
    """Two fixes to the Triton 3.6 interpreter (CPU tests only; GPU runs are untouched).

    1. Runtime loop bounds: the interpreter holds scalars as 1-element arrays and
       converts loop bounds with ``int(array)``, which NumPy >= 2.4 rejects ("only
       0-dimensional arrays can be converted to Python scalars"). Re-register
       ``__index__`` to take the element.
    2. tl.dot on bfloat16 operands: see below.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_hisparse_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._hisparse_fixed = True
    interpreter._patch_lang_tensor = patched

    # The interpreter stores bf16 as raw uint16 bits and its tl.dot multiplies those
    # integers; widen bf16 operands to float32 (exact) first, as the GPU does.
    import numpy as np
    import triton.language as tl

    orig_dot = interpreter.InterpreterBuilder.create_dot

    def _widen(h):
        if h.dtype == tl.bfloat16:
            bits = h.data.astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter()

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        ngpu = torch.cuda.device_count()
        skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {ngpu}")
        for item in items:
            if "multigpu" in item.keywords and ngpu < 2:
                item.add_marker(skip_multi)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)
