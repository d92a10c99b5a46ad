"""Without NIXL: hisparse and hisparse.pd import, and a P/D call says which extra to install."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = """
import sys
for name in ("nixl", "nixl_cu12", "nixl_cu13"):
    sys.modules[name] = None  # import fails as if not installed
import hisparse.pd
from hisparse import HiSparseCache, HiSparseConfig
from hisparse.engine import HiSparseIndexGroup
assert hisparse.pd.nixl_available() is not None
cfg = HiSparseConfig(num_layers=1, host_pool_tokens=64, row_bytes=656, top_k=4, device_buffer_size=8,
                     max_num_reqs=2, max_query_len=1, host_block_size=16, device="cpu")
group = HiSparseIndexGroup(cfg)
try:
    group.pd_reserve(1, 8)
except hisparse.pd.NixlUnavailable as e:
    assert "hisparse[pd]" in str(e), e
    assert not group.has_request(1)
    print("OK")
"""


def test_pd_without_nixl_names_the_extra():
    p = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


def test_nixl_or_skip_fails_under_hisparse_require_nixl(monkeypatch):
    """A NIXL that can't run skips the P/D tests, except under HISPARSE_REQUIRE_NIXL=1
    (the CI), where it fails them."""
    import pytest

    import pd_helpers
    monkeypatch.setattr(pd_helpers, "_PROBE", ["NIXL agent 'probe' could not start: injected"])
    monkeypatch.delenv("HISPARSE_REQUIRE_NIXL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="injected"):
        pd_helpers.nixl_or_skip()
    monkeypatch.setenv("HISPARSE_REQUIRE_NIXL", "1")
    with pytest.raises(pytest.fail.Exception, match="HISPARSE_REQUIRE_NIXL=1 .*injected"):
        pd_helpers.nixl_or_skip()


def test_the_wheel_of_torchs_cuda_major_is_tried_first(monkeypatch):
    """A nixl-cu12 wheel imports under a CUDA 13 torch but its UCX cannot register GPU
    memory: the wheel of torch's major goes first, and a mismatch names the one to install."""
    import types

    import torch

    from hisparse.pd import nixl_api
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert nixl_api.module_order() == ("nixl_cu13", "nixl_cu12", "nixl")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert nixl_api.module_order() == ("nixl_cu12", "nixl_cu13", "nixl")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert nixl_api.module_order() == nixl_api.MODULES
    assert nixl_api.cuda_mismatch() is None
    monkeypatch.setattr(nixl_api, "_loaded", types.ModuleType("nixl_cu12"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    hint = nixl_api.cuda_mismatch()
    assert "nixl_cu12" in hint and "install nixl-cu13" in hint and "13.0" in hint
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert nixl_api.cuda_mismatch() is None
    monkeypatch.setattr(torch.version, "cuda", "11.8")  # no nixl wheel for CUDA 11: nothing to name
    assert nixl_api.cuda_mismatch() is None
    monkeypatch.setattr(nixl_api, "_loaded", types.ModuleType("nixl"))  # a source build: no claim
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert nixl_api.cuda_mismatch() is None
