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


if os.environ.get("TRITON_INTERPRET") == "1":
    import hisparse  # noqa: F401,E402  (applies hisparse.interpreter_fixes)

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before -m selects: a gpu_long / gpu_alone case is a gpu case
def pytest_collection_modifyitems(config, items):
    for item in items:
        if ("gpu_long" in item.keywords or "gpu_alone" in item.keywords) and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.gpu)
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
