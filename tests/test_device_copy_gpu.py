"""``hisparse.device_copy.DriverCopy`` on the GPU: the driver copy equals ``copy_``, runs
on the current stream (ordered after the work before it there), and the cases it does
not take (strided, overlapping) go through ``copy_``."""

from __future__ import annotations

import pytest
import torch

from hisparse.device_copy import DriverCopy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape,dtype", [((64, 656), torch.uint8), ((67, 2048), torch.int32), ((1, 3), torch.int32)])
def test_driver_copy_equals_copy(shape, dtype):
    dev = torch.device("cuda")
    copy = DriverCopy(dev)
    src = torch.randint(-100, 100, shape, device=dev).to(dtype)
    dst = torch.zeros(shape, dtype=dtype, device=dev)
    copy(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


def test_driver_copy_runs_on_the_current_stream():
    """The source is filled on a side stream that first sleeps ~10 ms; the copy issued on
    that stream must see the filled values (on another stream it would copy zeros)."""
    dev = torch.device("cuda")
    copy = DriverCopy(dev)
    src = torch.zeros((256, 2048), dtype=torch.int32, device=dev)
    dst = torch.full_like(src, -7)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
        src.fill_(5)
        copy(dst, src)
    torch.cuda.synchronize()
    assert torch.all(dst == 5)


def test_strided_and_overlapping_sources_go_through_copy(monkeypatch):
    dev = torch.device("cuda")
    copy = DriverCopy(dev)
    driver = []
    real = copy._memcpy
    copy._memcpy = lambda *a: driver.append(a) or real(*a)
    base = torch.arange(64 * 2048, dtype=torch.int32, device=dev).view(2048, 64)
    src = base.t()  # [64, 2048], not contiguous
    dst = torch.zeros((64, 2048), dtype=torch.int32, device=dev)
    copy(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst, src) and not driver
    plain = []
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other, *a, **k: plain.append(1))
    buf = torch.arange(200, dtype=torch.int32, device=dev)
    copy(buf[:100], buf[50:150])  # overlapping: not the driver's
    assert plain == [1] and not driver
    copy(buf[:100], buf[100:])  # adjacent, not overlapping: the driver's
    assert plain == [1] and len(driver) == 1
