"""FastLaunch on the H200: the compiled launcher gives what the JIT gives, a changed
specialisation gets its own kernel, and launches are captured in a graph."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hisparse.kernels.launch import FastLaunch

pytestmark = pytest.mark.gpu


@triton.jit
def _axpy(x, y, n, a, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y + i, tl.load(x + i, mask=m) * a + tl.load(y + i, mask=m), mask=m)


def _run(fl, x, y, n, a):
    fl((triton.cdiv(n, 128),), x, y, n, a, BLOCK=128)


def test_results_match_torch_across_specialisations():
    dev = torch.device("cuda")
    fl = FastLaunch(_axpy)
    base = torch.arange(4097, dtype=torch.float32, device=dev)
    for x, n, a in ((base, 4096, 3), (base, 4096, 5), (base[1:], 4096, 3), (base, 1, 3), (base, 4000, 1),
                    (base, 16, 2), (base[1:], 4096, 7)):
        y = torch.ones(4096, device=dev)
        want = y.clone()
        want[:n] += x[:n] * a
        _run(fl, x, y, n, a)
        torch.cuda.synchronize()
        assert torch.equal(y, want), (x.data_ptr() % 16, n, a)
    # aligned / misaligned x, n = 1, a = 1, n % 16 == 0 or not: more than one kernel,
    # and a call repeated with other values of one specialisation adds none
    count = fl.compiled_count()
    assert count >= 3
    _run(fl, base, torch.ones(4096, device=dev), 4096, 9)
    assert fl.compiled_count() == count


def test_capture_and_replay():
    dev = torch.device("cuda")
    fl = FastLaunch(_axpy)
    x = torch.randn(1000, device=dev)
    y = torch.zeros(1000, device=dev)
    _run(fl, x, y, 1000, 2)  # compiles, through the JIT
    _run(fl, x, y, 1000, 2)  # through the compiled launcher
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _run(fl, x, y, 1000, 2)
    y.zero_()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, 4 * x)
