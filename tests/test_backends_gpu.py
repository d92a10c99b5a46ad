"""GPU tests of the FlashMLA and FlashInfer backends against the float32 reference.

Each test skips with the backend's own ``supports()`` reason when its library can't
be loaded here. Where the libraries come from on the H200:
- FlashMLA: ``$HISPARSE_FLASHMLA_LIB``, else ``.gpu-deps/vllm/_flashmla_C.abi3.so`` in
  the repo root when present, else an installed vllm / sgl_kernel;
- FlashInfer: importable ``flashinfer`` (e.g. wheels from .gpu-deps/flashinfer installed
  with ``pip install --no-index --no-deps --target /tmp/site`` + ``PYTHONPATH=/tmp/site``).

What they prove: FlashMLA reads rows quantised by *our* ``formats.quantize_fp8_ds_mla``
(so our fp8_ds_mla bytes are FlashMLA's layout) and returns natural-log LSE; FlashInfer's
page_size=1 MLA path matches the reference with its base-2 LSE converted; each one's
output for a token with no valid index goes through the LSE merges of a split decode
as the contract says (out = 0, lse = -inf, never NaN).

Tolerances (bf16 output of a softmax-weighted mean of N(0, 1) rows; the kernels round
P to bf16 before the PV product): out |err| <= 2e-2 + 2e-2 |ref|; lse |err| <= 5e-3.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from attention_common import check_empty_rows_through_merge

from hisparse.attention import chooser
from hisparse.attention.base import Phase
from hisparse.attention.flashinfer import FlashInferBackend
from hisparse.attention.flashmla import FlashMLABackend
from hisparse.attention.reference import ReferenceBackend
from hisparse.config import RowFormat
from hisparse.formats import quantize_fp8_ds_mla
from hisparse_tools.env import collect_env, format_env

pytestmark = pytest.mark.gpu

FP8, BF16 = RowFormat.FP8_DS_MLA, RowFormat.BF16
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
LSE_ATOL = 5e-3
SM_SCALE = 1.0 / math.sqrt(576)


def _flashmla_lib() -> str | None:
    env = os.environ.get("HISPARSE_FLASHMLA_LIB")
    if env:
        return env
    default = Path(__file__).resolve().parents[1] / ".gpu-deps" / "vllm" / "_flashmla_C.abi3.so"
    return str(default) if default.is_file() else None


@pytest.fixture(scope="module")
def dev():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def flashmla():
    return FlashMLABackend(library_path=_flashmla_lib())


@pytest.fixture(scope="module")
def flashinfer():
    return FlashInferBackend()


def _skip_unless(be, dev, fmt, H, phase):
    reason = be.supports(device=dev, row_format=fmt, num_heads=H, phase=phase)
    if reason is not None:
        pytest.skip(f"{be.name}: {reason}")


def _problem(T, H, K, N, dev, *, seed, pad_frac=0.1):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g, device=dev).to(torch.bfloat16)
    x = torch.randn(N, 576, generator=g, device=dev)
    idx = torch.randint(0, N, (T, K), generator=g, device=dev, dtype=torch.int32)
    idx[torch.rand(T, K, generator=g, device=dev) < pad_frac] = -1
    if T > 2:
        idx[2] = -1  # a token with no valid row
    vc = torch.randint(0, K + 1, (T,), generator=g, device=dev, dtype=torch.int32)
    vc[0] = K
    if T > 1:
        vc[1] = 0  # a token whose valid count is 0
    return q, x, idx, vc


def _compare(out, lse, ref_out, ref_lse, what):
    lonely = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), lonely), f"{what}: -inf lse pattern differs"
    assert bool((out[lonely] == 0).all()), f"{what}: lonely tokens must give out = 0"
    fin = ~lonely
    err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    err2 = (lse[fin] - ref_lse[fin] / math.log(2.0)).abs().max().item() if fin.any() else 0.0
    oerr = (out.float() - ref_out.float()).abs().max().item()
    print(f"{what}: max |lse err| {err:.2e} (vs a log2 lse: {err2:.2e}), "
          f"max |out err| {oerr:.2e}")
    assert err <= LSE_ATOL, f"{what}: lse error {err} (error if read as log2: {err2})"
    torch.testing.assert_close(out.float(), ref_out.float(), **OUT_TOL)


# ------------------------------------------------------------------ FlashMLA
@pytest.mark.parametrize("T,H,K,N", [(1, 128, 2048, 8192), (7, 16, 2048, 8192 + 64),
                                     (64, 128, 2048, 64 * 4096), (5, 64, 100, 3008),
                                     (3, 200, 512, 4096)])
def test_flashmla_decode_on_our_fp8_rows(flashmla, dev, T, H, K, N):
    _skip_unless(flashmla, dev, FP8, H, Phase.DECODE)
    q, x, idx, vc = _problem(T, H, K, N, dev, seed=T * 7 + H)
    # rows inside a larger buffer (like one layer of the hot rows): nonzero storage offset
    hot = torch.zeros(2, N, 656, dtype=torch.uint8, device=dev)
    hot[1] = quantize_fp8_ds_mla(x)
    rows = hot[1]
    ref = ReferenceBackend()
    for v in (None, vc):
        out, lse = flashmla.decode(q, rows, idx, valid_counts=v, sm_scale=SM_SCALE,
                                   row_format=FP8)
        torch.cuda.synchronize()
        ref_out, ref_lse = ref.decode(q, rows, idx, valid_counts=v, sm_scale=SM_SCALE,
                                      row_format=FP8)
        assert out.shape == (T, H, 512) and lse.shape == (T, H)
        _compare(out, lse, ref_out, ref_lse,
                 f"flashmla decode T={T} H={H} K={K} vc={v is not None}")


def test_flashmla_rejects_rows_not_in_64_row_pages(flashmla, dev):
    _skip_unless(flashmla, dev, FP8, 128, Phase.DECODE)
    q, x, idx, _ = _problem(2, 128, 64, 8192 + 37, dev, seed=3)
    with pytest.raises(ValueError, match="multiple of 64"):
        flashmla.decode(q, quantize_fp8_ds_mla(x), idx, sm_scale=SM_SCALE, row_format=FP8)


@pytest.mark.parametrize("T,H,K,W", [(32, 128, 2048, 5000), (9, 16, 100, 777)])
def test_flashmla_prefill(flashmla, dev, T, H, K, W):
    _skip_unless(flashmla, dev, BF16, H, Phase.PREFILL)
    q, x, idx, vc = _problem(T, H, K, W, dev, seed=W)
    ws = x.to(torch.bfloat16)
    for v in (None, vc):
        out, lse = flashmla.prefill(q, ws, idx, valid_counts=v, sm_scale=SM_SCALE)
        ref_out, ref_lse = ReferenceBackend().prefill(q, ws, idx, valid_counts=v,
                                                      sm_scale=SM_SCALE)
        _compare(out, lse, ref_out, ref_lse, f"flashmla prefill T={T} H={H} K={K}")


# ------------------------------------------------------------------ FlashInfer
@pytest.mark.parametrize("T,H,K,N", [(16, 128, 2048, 16 * 4096), (5, 16, 300, 1000)])
def test_flashinfer_decode_bf16(flashinfer, dev, T, H, K, N):
    _skip_unless(flashinfer, dev, BF16, H, Phase.DECODE)
    q, x, idx, vc = _problem(T, H, K, N, dev, seed=N)
    rows = x.to(torch.bfloat16)
    for v in (None, vc):
        out, lse = flashinfer.decode(q, rows, idx, valid_counts=v, sm_scale=SM_SCALE,
                                     row_format=BF16)
        ref_out, ref_lse = ReferenceBackend().decode(q, rows, idx, valid_counts=v,
                                                     sm_scale=SM_SCALE, row_format=BF16)
        _compare(out, lse, ref_out, ref_lse, f"flashinfer decode T={T} H={H} K={K}")
    # the uint8 [N, 1152] view of the same rows gives the same answer
    out2, lse2 = flashinfer.decode(q, rows.view(torch.uint8), idx, sm_scale=SM_SCALE,
                                   row_format=BF16)
    out1, lse1 = flashinfer.decode(q, rows, idx, sm_scale=SM_SCALE, row_format=BF16)
    torch.testing.assert_close(out1, out2, atol=1e-3, rtol=0)  # same inputs, same plan shape
    torch.testing.assert_close(lse1, lse2, atol=1e-5, rtol=0)


def test_flashinfer_prefill(flashinfer, dev):
    _skip_unless(flashinfer, dev, BF16, 128, Phase.PREFILL)
    q, x, idx, vc = _problem(8, 128, 512, 3000, dev, seed=5)
    ws = x.to(torch.bfloat16)
    out, lse = flashinfer.prefill(q, ws, idx, valid_counts=vc, sm_scale=SM_SCALE)
    ref_out, ref_lse = ReferenceBackend().prefill(q, ws, idx, valid_counts=vc, sm_scale=SM_SCALE)
    _compare(out, lse, ref_out, ref_lse, "flashinfer prefill")


def test_flashinfer_declines_fp8_on_sm90(flashinfer, dev):
    major, _ = torch.cuda.get_device_capability(dev)
    r = flashinfer.supports(device=dev, row_format=FP8, num_heads=128, phase=Phase.DECODE)
    assert r is not None  # never faked: fp8_ds_mla needs the trtllm-gen path
    if major == 9:
        assert "SM100+" in r


# ------------------------------------------------------------------ empty rows into a merge
@pytest.mark.parametrize("name,fmt", [("flashmla", "fp8_ds_mla"), ("flashinfer", "bf16")])
@pytest.mark.parametrize("path", ["split", "merge"])
@pytest.mark.parametrize("nan_in_empty", [False, True])
def test_empty_rows_through_the_merge(request, dev, name, fmt, path, nan_in_empty):
    """The backend as the hit attention of a split decode: its out = 0, lse = -inf for a
    token with no valid index (FlashMLA's +inf lse turned into -inf, FlashInfer's empty
    tokens left out of its batch), merged with the misses by the Triton miss kernels,
    equals the float32 reference over both lists with no NaN, also where the empty
    side's out holds NaN; out = 0, lse = -inf where both sides are empty
    (``attention_common.check_empty_rows_through_merge``)."""
    be = request.getfixturevalue(name)
    _skip_unless(be, dev, fmt, 128, Phase.DECODE)
    check_empty_rows_through_merge(be, fmt=fmt, device=dev, H=128, path=path,
                                   nan_in_empty=nan_in_empty)


# ------------------------------------------------------------------ chooser / env
def test_chooser_on_gpu(dev):
    lib = _flashmla_lib()
    for fmt in (FP8, BF16):
        for phase in (Phase.DECODE, Phase.PREFILL):
            be = chooser.choose_backend(device=dev, row_format=fmt, num_heads=128, phase=phase,
                                        flashmla_lib=lib)
            asked = BF16 if phase is Phase.PREFILL else fmt  # prefill reads the bf16 workspace
            assert be.supports(device=dev, row_format=asked, num_heads=128, phase=phase) is None
            print(f"chooser: {phase.value} {fmt.value} -> {be.name}")
    avail = dict(chooser.available_backends(dev, flashmla_lib=lib))
    print(chooser.describe(avail.items()))
    assert avail["reference"] is None


def test_env_on_gpu():
    d = collect_env(flashmla_lib=_flashmla_lib())
    print(format_env(d))
    assert d["cuda_available"] and d["gpus"] and d["gpus"][0]["memory_gib"] > 1
    assert d["pinned"]["ok"] and d["pinned"]["is_pinned"] and d["pinned"]["registered"]
    td = d["triton_decode"]
    if torch.cuda.get_device_capability()[0] == 9:  # the H200: ws unless Gluon lacks something
        assert (td["kernel"] == "ws") == (td["gluon_ws"] is None), td
