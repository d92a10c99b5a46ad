"""Two fixes to the Triton 3.6 CPU interpreter (``TRITON_INTERPRET=1``), applied when
hisparse is imported in interpreter mode; GPU runs are untouched.

1. Runtime loop bounds: the interpreter holds scalars as 1-element arrays and converts
   loop bounds with ``int(array)``, which NumPy >= 2.4 rejects ("only 0-dimensional
   arrays can be converted to Python scalars"). ``__index__`` is re-registered to take
   the element.
2. ``tl.dot`` on bfloat16 operands: the interpreter stores bf16 as raw uint16 bits and
   multiplies those integers; bf16 operands are widened to float32 (exact) first, as
   the GPU does.

Without them the kernels' CPU runs (tests, ``--device cpu`` benchmark smoke runs) fail
or compute garbage.
"""

from __future__ import annotations


def apply() -> None:
    """Patch the interpreter once (idempotent; a no-op without Triton)."""
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


__all__ = ["apply"]
