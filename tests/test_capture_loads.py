"""The GPU suite's record of Triton kernels first loaded inside a CUDA graph capture
(tests/conftest.py, written where tests/run_gpu.sh points HISPARSE_CAPTURE_LOADS)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

import conftest

ROOT = Path(__file__).resolve().parent.parent


def test_a_load_inside_a_capture_is_recorded_with_its_test(tmp_path, monkeypatch):
    out = tmp_path / "loads.txt"
    monkeypatch.setenv("HISPARSE_CAPTURE_LOADS", str(out))
    monkeypatch.setattr(conftest, "_current_test", ["tests/test_x.py::test_y"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    conftest._record_capture_load(None, None, "eager_kernel", {}, "h0")
    assert not out.exists()  # a load outside a capture is not recorded
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    conftest._record_capture_load(None, None, "resolve_kernel", {}, "h1")
    conftest._record_capture_load(None, None, "copy_staged_kernel", {}, "h2", "a later argument")
    assert out.read_text() == "tests/test_x.py::test_y\tresolve_kernel\ntests/test_x.py::test_y\tcopy_staged_kernel\n"


def test_the_recorder_never_raises(monkeypatch):
    monkeypatch.delenv("HISPARSE_CAPTURE_LOADS", raising=False)  # no file named: a KeyError, swallowed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    conftest._record_capture_load(None, None, "k", {}, "h")


def test_run_gpu_script_names_the_record_and_parses():
    text = (ROOT / "tests" / "run_gpu.sh").read_text()
    assert 'export HISPARSE_CAPTURE_LOADS="$res/capture-loads-$mode.txt"' in text
    assert subprocess.run(["bash", "-n", str(ROOT / "tests" / "run_gpu.sh")]).returncode == 0
