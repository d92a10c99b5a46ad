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


# With HISPARSE_CAPTURE_LOADS=FILE (tests/run_gpu.sh sets it), each Triton kernel module
# loaded while a CUDA graph is being captured appends "test id<TAB>kernel" to FILE: a
# kernel first compiled and loaded inside a capture, which the capture's warm-up did not
# run. A record only; it fails nothing.
_current_test = ["(collection)"]


def _record_capture_load(module, function, name, metadata_group, hash, *rest):  # noqa: A002 -- Triton's hook arguments
    try:
        if torch.cuda.is_current_stream_capturing():
            with open(os.environ["HISPARSE_CAPTURE_LOADS"], "a") as f:
                f.write(f"{_current_test[0]}\t{name}\n")
    except Exception:  # noqa: BLE001 -- a diagnostic must never break a launch
        pass


if _HAS_CUDA and os.environ.get("HISPARSE_CAPTURE_LOADS"):
    try:
        from triton import knobs as _knobs

        _knobs.runtime.kernel_load_start_hook.add(_record_capture_load)
    except Exception:  # noqa: BLE001 -- a Triton without the hook: nothing recorded
        pass


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current_test[0] = item.nodeid
