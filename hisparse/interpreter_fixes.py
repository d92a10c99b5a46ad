"""Fixes to Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied when hisparse is
imported in interpreter mode. Each fix is applied only when a probe of the installed
Triton shows the defect (the probes run the interpreter's own builder on tiny NumPy
arrays; no kernel is launched); GPU runs are untouched.

1. Runtime loop bounds (Triton 3.6 with NumPy >= 2.4): the interpreter holds scalars as
   1-element arrays and converts loop bounds with ``int(array)``, which NumPy >= 2.4
   rejects ("only 0-dimensional arrays can be converted to Python scalars").
   ``__index__`` is re-registered to take the element. Later releases squeeze first.
2. ``tl.dot`` on bfloat16 operands (every release up to 3.9 at least): the interpreter
   stores bf16 as raw uint16 bits and multiplies those integers; bf16 operands are
   widened to float32 (exact) first, as the GPU does.
3. Comparison results (Triton 3.9): the builder labels the result of ``a < b`` with the
   operands' dtype instead of int1, so a scalar comparison broadcast to a block (e.g.
   ``offs_ok & (r >= 0)``) becomes int32 data; since the interpreter's native load and
   store accept only bool masks, such a mask fails with "mask has unsupported dtype".
   Comparisons are relabelled int1, which is what the compiled kernel has.

Without them the kernels' CPU runs (tests, ``--device cpu`` benchmark smoke runs) fail
or compute garbage. ``applied()`` lists the fixes in force (``hisparse env`` shows it).
"""

from __future__ import annotations

import numpy as np

try:
    import triton.language as tl
    from triton.runtime import interpreter
except ImportError:  # Triton is a Linux-only dependency: without it there is nothing to fix
    tl = interpreter = None

_APPLIED: list[str] = []
_DONE = False


def _index_needs_fix() -> bool:
    """Whether the interpreter's ``tensor.__index__`` fails on its 1-element scalars."""

    class _Probe:
        pass

    scope = interpreter._LangPatchScope()
    try:
        interpreter._patch_lang_tensor(_Probe, scope)
        probe = _Probe()
        probe.handle = interpreter.TensorHandle(np.array([3], dtype=np.int32), tl.int32)
        return range(probe.__index__()) != range(3)
    except TypeError:
        return True
    finally:
        scope.restore()


def _bf16_dot_needs_fix() -> bool:
    """Whether ``create_dot`` multiplies bf16 bit patterns instead of values (1.0 x 1.0)."""
    one = interpreter.TensorHandle(np.array([[0x3F80]], dtype=np.uint16), tl.bfloat16)
    acc = interpreter.TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
    res = interpreter.InterpreterBuilder().create_dot(one, one, acc, None, 0)
    return float(res.data[0, 0]) != 1.0


def _compare_needs_fix() -> bool:
    """Whether comparisons come out labelled non-int1 *and* native stores reject
    non-bool masks (Triton 3.6's store takes int32 masks, so it needs no relabelling)."""
    h = interpreter.TensorHandle(np.array([1], dtype=np.int32), tl.int32)
    if interpreter.InterpreterBuilder().create_icmpSLT(h, h).dtype == tl.int1:
        return False
    buf = np.zeros(1, dtype=np.int32)
    ptrs = np.array([buf.ctypes.data], dtype=np.uint64)
    try:
        interpreter._interpreter.store(ptrs, np.ones(1, dtype=np.int32),
                                       np.ones(1, dtype=np.int32))
    except ValueError:
        return True
    return False


def _fix_index() -> None:
    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _fix_bf16_dot() -> None:
    orig_dot = interpreter.InterpreterBuilder.create_dot

    def _widen(h):
        if h.dtype == tl.bfloat16:
            bits = h.data.astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _fix_compares() -> None:
    builder = interpreter.InterpreterBuilder

    def relabel(orig):
        def create_cmp(self, lhs, rhs):
            res = orig(self, lhs, rhs)
            return interpreter.TensorHandle(res.data.astype(np.bool_, copy=False), tl.int1)

        return create_cmp

    for name in dir(builder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(builder, name, relabel(getattr(builder, name)))


_FIXES = (
    ("loop-bound __index__", _index_needs_fix, _fix_index),
    ("bf16 tl.dot", _bf16_dot_needs_fix, _fix_bf16_dot),
    ("int1 comparison results", _compare_needs_fix, _fix_compares),
)


def apply() -> None:
    """Probe the installed interpreter and patch what it needs (once; idempotent).

    A no-op without Triton. Call it before any kernel runs in interpreter mode.
    """
    global _DONE
    if _DONE:
        return
    _DONE = True
    if interpreter is None:
        return
    for name, needed, fix in _FIXES:
        if needed():
            fix()
            _APPLIED.append(name)


def applied() -> list[str]:
    """Names of the fixes ``apply()`` put in force (empty before it ran)."""
    return list(_APPLIED)


__all__ = ["apply", "applied"]
