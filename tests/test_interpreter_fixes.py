"""CPU: the Triton interpreter fixes (``hisparse.interpreter_fixes``) leave no defect their
probes look for, whichever Triton is installed, and a tiny kernel that needs each of
them computes the right thing."""

import pytest
import torch
import triton
import triton.language as tl

from hisparse import interpreter_fixes as IF
from hisparse._checks import interpreter_mode

pytestmark = pytest.mark.skipif(not interpreter_mode(),
                                reason="the fixes apply in interpreter mode only (no GPU here)")


def test_no_probe_reports_a_defect_after_apply():
    IF.apply()
    applied = IF.applied()
    assert set(applied) <= {name for name, _, _ in IF._FIXES}
    for name, needed, _ in IF._FIXES:
        assert not needed(), f"{name}: still broken on Triton {triton.__version__} ({applied})"


@triton.jit
def _mask_dot_loop_kernel(x_ptr, flag_ptr, out_ptr, n, steps):
    # a mask from a scalar comparison broadcast into a block (fix 3), a runtime loop
    # bound (fix 1) and a bf16 dot (fix 2)
    r = tl.arange(0, 16)
    flag = tl.load(flag_ptr)
    ok = (r < n) & (flag >= 0)
    x = tl.load(x_ptr + r[:, None] * 16 + r[None, :])  # bf16 [16, 16]
    acc = tl.zeros([16, 16], dtype=tl.float32)
    for _ in range(0, steps):
        acc = tl.dot(x, x, acc)
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], acc, mask=ok[:, None])


def test_kernel_needing_every_fix():
    x = torch.randn(16, 16).bfloat16()
    out = torch.zeros(16, 16)
    _mask_dot_loop_kernel[(1,)](x, torch.ones(1, dtype=torch.int32), out, 11, 3)
    want = 3 * (x.float() @ x.float())
    assert torch.allclose(out[:11], want[:11], rtol=1e-5, atol=1e-4)
    assert (out[11:] == 0).all()
