"""The shared argument checks of ``hisparse._checks``: the device and dtype rules every
public call relies on (the per-layer calls take their fast paths through them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hisparse._checks import check_tensor, device_type, same_device


@pytest.mark.parametrize("spec, kind", [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda"), ("meta", "meta")])
def test_device_type_is_the_devices_type(spec, kind):
    d = torch.device(spec)
    assert device_type(d) == kind
    assert device_type(torch.device(spec)) == kind  # an equal device object: the memoised entry


def _on(spec: str) -> SimpleNamespace:
    """A stand-in tensor for ``same_device`` (it reads ``.device`` only): CUDA tensors
    can't be made on a CPU machine."""
    return SimpleNamespace(device=torch.device(spec))


@pytest.mark.parametrize("tensor_on, device, same", [
    ("cpu", "cpu", True),
    ("cpu", "cuda", False),
    ("cpu", "cuda:0", False),
    ("cuda:0", "cpu", False),
    ("cuda:1", "cuda", True),  # a CUDA device without index matches any index
    ("cuda:1", "cuda:1", True),
    ("cuda:1", "cuda:0", False),
    ("meta", "cpu", False),
])
def test_same_device(tensor_on, device, same):
    assert same_device(_on(tensor_on), torch.device(device)) is same


def test_same_device_with_real_tensors():
    assert same_device(torch.zeros(2), torch.device("cpu"))
    assert not same_device(torch.zeros(2, device="meta"), torch.device("cpu"))


def test_check_tensor_dtypes():
    t = torch.zeros((2, 3), dtype=torch.int32)
    assert check_tensor("t", t, dtype=torch.int32, ndim=2, device=torch.device("cpu")) is t
    assert check_tensor("t", t, dtype=(torch.int64, torch.int32)) is t
    with pytest.raises(TypeError, match="t must have dtype int64 or uint8, got int32"):
        check_tensor("t", t, dtype=[torch.int64, torch.uint8])
    with pytest.raises(TypeError, match="t must have dtype uint8, got int32"):
        check_tensor("t", t, dtype=torch.uint8)
    with pytest.raises(ValueError, match="t is on cpu, expected meta"):
        check_tensor("t", t, device=torch.device("meta"))
    with pytest.raises(ValueError, match="must be 3-D"):
        check_tensor("t", t, ndim=3)
