"""CPU tests of the optional backends (FlashMLA, FlashInfer), the chooser and `env`.

The real libraries can't run here, so:
- ``supports()`` reasons are checked for the states a user can be in (no GPU, wrong
  row format, library missing / broken / with an unknown schema, wrong SM);
- the FlashMLA wrapper's plumbing (head padding and grouping, top-k padding, block
  view, lse fix-up, schedule caching, index sanitising) runs against a fake op
  registered with ``torch.library`` under the real schema, whose body enforces the
  real op's preconditions and computes with the reference;
- the FlashInfer wrapper's plumbing (compaction to page lists, dropped empty tokens,
  log2 -> natural lse) runs against a fake ``BatchMLAPagedAttentionWrapper``.
The GPU tests (tests/test_backends_gpu.py) run the real kernels.
"""

from __future__ import annotations

import json
import math
from importlib.util import find_spec

import pytest
import torch

from hisparse import interpreter_fixes
from hisparse._checks import interpreter_mode
from hisparse.attention import chooser, flashinfer as fi_mod, flashmla as fm_mod
from hisparse.attention.base import DecodeInputs, Phase, validate_decode_inputs
from hisparse.attention.flashinfer import FlashInferBackend
from hisparse.attention.flashmla import FlashMLABackend
from hisparse.attention.reference import ReferenceBackend, sparse_mla_reference
from hisparse.config import RowFormat
from hisparse.formats import quantize_fp8_ds_mla_reference
from hisparse.kernels.gluon_support import gluon_ws_problem
from hisparse_tools import env as env_mod

FP8, BF16 = RowFormat.FP8_DS_MLA, RowFormat.BF16
CPU = torch.device("cpu")


def _problem(T, H, K, N, *, fmt=FP8, seed=0, pad_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    x = torch.randn(N, 576, generator=g)
    rows = quantize_fp8_ds_mla_reference(x) if fmt is FP8 else x.to(torch.bfloat16)
    idx = torch.randint(0, max(N, 1), (T, K), generator=g, dtype=torch.int32)
    idx[torch.rand(T, K, generator=g) < pad_frac] = -1
    return q, rows, idx


# ------------------------------------------------------------------ chooser
def test_chooser_picks_reference_on_cpu():
    for fmt in (FP8, BF16):
        for phase in (Phase.DECODE, "prefill"):
            be = chooser.choose_backend(device="cpu", row_format=fmt, num_heads=16, phase=phase)
            assert be.name == "reference"
    # an explicit preference for a backend that can't run here falls back
    be = chooser.choose_backend(device=CPU, row_format="fp8_ds_mla", num_heads=1,
                                phase="decode", prefer=["flashmla", "flashinfer"])
    assert be.name == "reference"
    assert chooser.choose_backend(device="cpu", row_format=BF16, num_heads=3, phase="decode",
                                  prefer="reference") is chooser.get_backend("reference")


def test_chooser_triton_on_cpu_only_under_interpreter():
    interp = interpreter_mode()  # conftest sets TRITON_INTERPRET=1 when there is no GPU
    want = "triton" if interp else "reference"
    be = chooser.choose_backend(device="cpu", row_format=FP8, num_heads=4, phase="decode",
                                prefer="triton")
    assert be.name == want
    # prefill reads the bf16 workspace whatever the cache format: fp8 caches still get triton
    be = chooser.choose_backend(device="cpu", row_format=FP8, num_heads=4, phase="prefill",
                                prefer="triton")
    assert be.name == want


def test_chooser_bad_arguments():
    with pytest.raises(ValueError, match="valid names"):
        chooser.choose_backend(device="cpu", row_format=FP8, num_heads=1, phase="decode",
                               prefer="nope")
    with pytest.raises(ValueError, match="valid names"):
        chooser.get_backend("flash")
    with pytest.raises(ValueError, match="unknown phase"):
        chooser.choose_backend(device="cpu", row_format=FP8, num_heads=1, phase="verify")
    with pytest.raises(ValueError, match="unknown row format"):
        chooser.choose_backend(device="cpu", row_format="fp4", num_heads=1, phase="decode")
    with pytest.raises(TypeError):
        chooser.choose_backend(device="cpu", row_format=FP8, num_heads=2.0, phase="decode")
    with pytest.raises(ValueError):
        chooser.choose_backend(device="cpu", row_format=FP8, num_heads=0, phase="decode")


def test_chooser_error_lists_every_reason(monkeypatch):
    monkeypatch.setattr(chooser, "_ORDER_CPU", ("flashmla", "flashinfer"))
    with pytest.raises(ValueError) as ei:
        chooser.choose_backend(device="cpu", row_format=BF16, num_heads=8, phase="decode")
    msg = str(ei.value)
    assert "no attention backend supports decode with bf16 rows, 8 heads on cpu" in msg
    assert "flashmla: FlashMLA sparse decode reads fp8_ds_mla rows only" in msg
    assert "flashinfer: FlashInfer needs a CUDA device, got cpu" in msg
    assert "valid names" in msg and "not tried on cpu" in msg


def test_available_backends_cpu():
    got = dict(chooser.available_backends("cpu"))
    assert set(got) == set(chooser.backend_names())
    assert got["reference"] is None
    assert "CUDA device" in got["flashmla"] and "CUDA device" in got["flashinfer"]
    one = dict(chooser.available_backends("cpu", row_format="bf16", phase="decode"))
    assert "fp8_ds_mla rows only" in one["flashmla"]
    assert one["reference"] is None


def test_unloadable_backend_reports_why(monkeypatch):
    monkeypatch.setitem(chooser._REGISTRY, "triton", ("hisparse.no_such_module", "X"))
    monkeypatch.setattr(chooser, "_INSTANCES", {})
    be = chooser.get_backend("triton")
    r = be.supports(device=CPU, row_format=FP8, num_heads=1, phase=Phase.DECODE)
    assert "cannot load hisparse.no_such_module.X" in r
    q, rows, idx = _problem(1, 1, 2, 4)
    with pytest.raises(ValueError, match="unavailable"):
        be.decode(q, rows, idx, sm_scale=0.1, row_format=FP8)


# ------------------------------------------------------------------ FlashMLA reasons
def test_flashmla_reasons_without_gpu():
    be = FlashMLABackend()
    assert "needs a CUDA device, got cpu" in be.supports(
        device=CPU, row_format=FP8, num_heads=128, phase=Phase.DECODE)
    assert "fp8_ds_mla rows only" in be.supports(
        device=CPU, row_format=BF16, num_heads=128, phase=Phase.DECODE)
    assert "needs a CUDA device" in be.supports(
        device=CPU, row_format=BF16, num_heads=128, phase=Phase.PREFILL)
    assert "num_heads" in be.supports(device=CPU, row_format=FP8, num_heads=0, phase=Phase.DECODE)
    # asking it to run anyway: a clear ValueError before anything launches
    q, rows, idx = _problem(2, 4, 3, 8)
    with pytest.raises(ValueError, match="FlashMLA backend cannot run this decode"):
        be.decode(q, rows, idx, sm_scale=0.1, row_format=FP8)
    ops, reason = fm_mod.load_flashmla_ops("/nonexistent/_flashmla_C.abi3.so")
    assert ops is None
    if torch.cuda.is_available():
        assert "does not exist" in reason
    else:
        assert "torch.cuda.is_available() is False" in reason


def test_flashmla_load_reasons(tmp_path):
    # (the CUDA guard in load_flashmla_ops is bypassed: _load is what a GPU box runs)
    ops, reason = fm_mod._load(str(tmp_path / "missing.so"))
    assert ops is None and "does not exist" in reason
    bad = tmp_path / "broken.so"
    bad.write_bytes(b"not an ELF file")
    ops, reason = fm_mod._load(str(bad))
    assert ops is None and "loading FlashMLA library" in reason and "failed" in reason
    if find_spec("vllm") is None and find_spec("sgl_kernel") is None:
        ops, reason = fm_mod._load(None)
        assert ops is None
        assert "FlashMLA ops not found" in reason and "vllm._flashmla_C" in reason
        assert "sgl_kernel.flashmla_ops" in reason and "--flashmla-lib" in reason


def test_flashmla_reasons_on_unsupported_sm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    r = FlashMLABackend().supports(device=torch.device("cuda", 0), row_format=FP8,
                                   num_heads=128, phase=Phase.DECODE)
    assert "SM90" in r and "SM80" in r


# ------------------------------------------------------------------ fake FlashMLA op
_NS = "hisparse_test_fake_flashmla"
_CALLS: list[dict] = []
_LIB = None

# the real schemas (strings of vllm 0.30's _flashmla_C.abi3.so) minus alias annotations
_DECODE_SCHEMA = (
    "sparse_decode_fwd(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, "
    "Tensor? attn_sink, Tensor? tile_scheduler_metadata, Tensor? num_splits, "
    "Tensor? extra_kv, Tensor? extra_indices, Tensor? extra_topk_length, int d_v, "
    "float sm_scale, Tensor? out_) -> (Tensor, Tensor, Tensor, Tensor)")
_PREFILL_SCHEMA = (
    "sparse_prefill_fwd(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
    "Tensor? attn_sink, Tensor? topk_length, Tensor? out_) -> Tensor[]")


def _fake_decode(q, kv, indices, topk_length, attn_sink, tsm, num_splits, extra_kv,
                 extra_indices, extra_topk_length, d_v, sm_scale, out_):
    # the real op's preconditions (those we know of), enforced
    if q.dim() != 4 or q.shape[2] not in (64, 128) or q.shape[3] != 576:
        raise RuntimeError(f"Unsupported q shape {tuple(q.shape)}")
    if kv.dim() != 4 or kv.dtype != torch.uint8 or kv.shape[2:] != (1, 656) or kv.stride(1) != 656:
        raise RuntimeError("bad kv")
    b, s_q = q.shape[0], q.shape[1]
    if indices.shape[:2] != (b, s_q) or indices.shape[2] % 64 != 0 or d_v != 512:
        raise RuntimeError("bad indices / d_v")
    n = kv.shape[0] * kv.shape[1]
    if bool(((indices < -1) | (indices >= n)).any()):
        raise RuntimeError("illegal memory access (index out of range)")
    if topk_length is not None:  # as the real SM90 kernel: no dynamic top-k length
        raise RuntimeError("V3.2 does not support dynamic topk length")
    _CALLS.append({"op": "decode", "h_q": q.shape[2], "topk": indices.shape[2],
                   "had_meta": tsm is not None, "block": kv.shape[1]})
    flat = kv.reshape(n, 656)
    inp = DecodeInputs(q[:, 0], flat, indices[:, 0], topk_length, float(sm_scale), FP8)
    out, lse = sparse_mla_reference(inp)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    meta = tsm if tsm is not None else torch.zeros(3, 8, dtype=torch.int32)
    splits = num_splits if num_splits is not None else torch.zeros(b + 1, dtype=torch.int32)
    return out.view(b, 1, q.shape[2], 512), lse.view(b, 1, q.shape[2]), meta.clone(), splits.clone()


def _fake_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out_):
    if q.dim() != 3 or q.shape[1] not in (64, 128) or kv.dim() != 3 or kv.dtype != torch.bfloat16:
        raise RuntimeError("bad q / kv")
    _CALLS.append({"op": "prefill", "h_q": q.shape[1], "topk": indices.shape[2]})
    inp = DecodeInputs(q, kv[:, 0], indices[:, 0], topk_length, float(sm_scale), BF16)
    out, lse = sparse_mla_reference(inp)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return [out, lse.clone(), lse]


@pytest.fixture
def fake_flashmla(monkeypatch):
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(_NS, "DEF")
        _LIB.define(_DECODE_SCHEMA)
        _LIB.define(_PREFILL_SCHEMA)
        _LIB.impl("sparse_decode_fwd", _fake_decode, "CPU")
        _LIB.impl("sparse_prefill_fwd", _fake_prefill, "CPU")
    ops, reason = fm_mod._ops_from_namespace(_NS, "fake")
    assert reason is None, reason
    assert ops.decode_fill == ("out_",) and ops.prefill_fill == ("out_",)
    monkeypatch.setattr(fm_mod, "_sm_reason", lambda device: None)
    monkeypatch.setattr(FlashMLABackend, "ops", lambda self: (ops, None))
    _CALLS.clear()
    return ops


def test_flashmla_unknown_schema_is_a_reason():
    ns = "hisparse_test_odd_flashmla"
    lib = torch.library.Library(ns, "DEF")
    lib.define("sparse_decode_fwd(Tensor q, Tensor k_cache, Tensor indices, int d_v) -> Tensor")
    ops, reason = fm_mod._ops_from_namespace(ns, "odd build")
    assert ops is None and "schema this wrapper does not know" in reason and "k_cache" in reason
    ops, reason = fm_mod._ops_from_namespace("hisparse_test_empty_ns", "empty")
    assert ops is None and "sparse_decode_fwd is missing" in reason


@pytest.mark.parametrize("T,H,K,N", [(3, 1, 5, 64), (2, 16, 70, 192), (2, 64, 64, 64),
                                     (1, 100, 3, 128), (2, 130, 9, 64)])
def test_flashmla_wrapper_matches_reference(fake_flashmla, T, H, K, N):
    q, rows, idx = _problem(T, H, K, N, seed=T * 1000 + H)
    idx[0, :] = -1  # a token with no valid row
    vc_cases = [None, torch.tensor([K] + [max(0, K - 2)] * (T - 1), dtype=torch.int32)]
    be = FlashMLABackend()
    for vc in vc_cases:
        out, lse = be.decode(q, rows, idx, valid_counts=vc, sm_scale=0.07, row_format=FP8)
        ref_out, ref_lse = ReferenceBackend().decode(q, rows, idx, valid_counts=vc,
                                                     sm_scale=0.07, row_format=FP8)
        assert out.shape == (T, H, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (T, H) and lse.dtype == torch.float32
        assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
        torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    decode_calls = [c for c in _CALLS if c["op"] == "decode"]
    groups = math.ceil(H / 128)
    assert len(decode_calls) == groups * len(vc_cases)
    assert all(c["h_q"] in (64, 128) and c["topk"] % 64 == 0 for c in decode_calls)
    assert all(c["block"] == 64 for c in decode_calls)  # 64-row pages, always


def test_flashmla_schedule_cached_only_without_valid_counts(fake_flashmla):
    q, rows, idx = _problem(2, 8, 64, 128)
    be = FlashMLABackend()
    for _ in range(3):
        be.decode(q, rows, idx, sm_scale=0.1, row_format=FP8)
    assert [c["had_meta"] for c in _CALLS] == [False, True, True]
    _CALLS.clear()
    vc = torch.tensor([10, 0], dtype=torch.int32)
    for _ in range(2):
        out, lse = be.decode(q, rows, idx, valid_counts=vc, sm_scale=0.1, row_format=FP8)
    # counts become -1 masks (the kernel takes no topk_length), so the schedule is reused
    assert [c["had_meta"] for c in _CALLS] == [True, True]
    ref_out, ref_lse = ReferenceBackend().decode(q, rows, idx, valid_counts=vc, sm_scale=0.1,
                                                 row_format=FP8)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(ref_lse[1]).all()


def test_flashmla_prefill_matches_reference(fake_flashmla):
    q, ws, idx = _problem(3, 20, 11, 17, fmt=BF16)
    idx[1] = -1
    out, lse = FlashMLABackend().prefill(q, ws, idx, sm_scale=0.05)
    ref_out, ref_lse = ReferenceBackend().prefill(q, ws, idx, sm_scale=0.05)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    assert torch.isneginf(lse[1]).all() and [c["h_q"] for c in _CALLS] == [64]


def test_flashmla_bad_input_raises_before_launch(fake_flashmla):
    q, rows, idx = _problem(2, 4, 8, 64, pad_frac=0.0)
    be = FlashMLABackend()
    bad = idx.clone()
    bad[1, 3] = 64  # == N: out of range
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 64\)"):
        be.decode(q, rows, bad, sm_scale=0.1, row_format=FP8)
    with pytest.raises(TypeError):
        be.decode(q, rows, idx.long(), sm_scale=0.1, row_format=FP8)
    with pytest.raises(ValueError, match="fp8_ds_mla rows only"):
        be.decode(q, torch.zeros(64, 576, dtype=torch.bfloat16), idx, sm_scale=0.1,
                  row_format=BF16)
    with pytest.raises(ValueError, match="multiple of 64 rows; got N = 65"):
        be.decode(q, torch.cat([rows, rows[:1]]), idx, sm_scale=0.1, row_format=FP8)
    wide = torch.zeros(64, 700, dtype=torch.uint8)
    wide[:, :656] = rows
    with pytest.raises(ValueError, match="densely packed"):
        be.decode(q, wide[:, :656], idx, sm_scale=0.1, row_format=FP8)
    assert _CALLS == []
    # unchecked path: out-of-range entries become padding on the device, no exception
    out, lse = FlashMLABackend(check_ranges=False).decode(q, rows, bad, sm_scale=0.1,
                                                          row_format=FP8)
    inp = validate_decode_inputs(q, rows, bad, sm_scale=0.1, row_format=FP8, check_ranges=False)
    ref_out, ref_lse = sparse_mla_reference(inp)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)


def test_flashmla_empty_sizes(fake_flashmla):
    be = FlashMLABackend()
    for T, K, N in [(0, 4, 64), (2, 0, 64), (2, 3, 0)]:
        q, rows, idx = _problem(T, 5, K, N, pad_frac=1.0 if N == 0 else 0.0)
        if N == 0:
            rows = rows[:0]
        out, lse = be.decode(q, rows, idx, sm_scale=0.1, row_format=FP8)
        assert out.shape == (T, 5, 512) and lse.shape == (T, 5)
        assert (out == 0).all() and torch.isneginf(lse).all()
    assert _CALLS == []


# ------------------------------------------------------------------ FlashInfer
def test_flashinfer_reasons(monkeypatch):
    be = FlashInferBackend()
    assert "needs a CUDA device, got cpu" in be.supports(
        device=CPU, row_format=BF16, num_heads=128, phase=Phase.DECODE)
    if not torch.cuda.is_available():
        assert "not available" in be.supports(device=torch.device("cuda", 0), row_format=BF16,
                                              num_heads=128, phase=Phase.DECODE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fi_mod, "_IMPORT", {})
    monkeypatch.setattr(fi_mod, "_find_spec", lambda name: None)  # as if not installed
    dev = torch.device("cuda", 0)
    r = be.supports(device=dev, row_format=FP8, num_heads=128, phase=Phase.DECODE)
    assert "SM100+" in r and "SM90" in r
    r = be.supports(device=dev, row_format=BF16, num_heads=128, phase=Phase.DECODE)
    assert "flashinfer is not installed" in r
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "does not wire up" in be.supports(device=dev, row_format=FP8, num_heads=16,
                                              phase=Phase.DECODE)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "SM80+" in be.supports(device=dev, row_format=BF16, num_heads=16, phase=Phase.PREFILL)
    with pytest.raises(ValueError):
        FlashInferBackend(backend="cutlass")


class _FakeMLAWrapper:
    """page_size = 1 semantics of BatchMLAPagedAttentionWrapper, computed in float32."""

    def __init__(self):
        self.plans = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        assert (head_dim_ckv, head_dim_kpe, page_size, causal) == (512, 64, 1, False)
        assert torch.equal(kv_indptr[1:] - kv_indptr[:-1], kv_len_arr)
        assert bool((kv_len_arr > 0).all()) and bool((kv_indices >= 0).all())
        self.plans.append(dict(kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(),
                               sm_scale=sm_scale, num_heads=num_heads))

    def run(self, q_nope, q_pe, ckv, kpe, out, lse, return_lse):
        p = self.plans[-1]
        rows = torch.cat([ckv[:, 0], kpe[:, 0]], dim=1).float()  # [N, 576]
        q = torch.cat([q_nope, q_pe], dim=2).float()
        ind = p["kv_indptr"].tolist()
        for b in range(q.shape[0]):
            r = rows[p["kv_indices"][ind[b]:ind[b + 1]].long()]
            s = q[b] @ r.T * p["sm_scale"]
            lse[b] = torch.logsumexp(s, dim=1) / math.log(2.0)  # base 2, as FlashInfer
            out[b] = (torch.softmax(s, dim=1) @ r[:, :512]).to(out.dtype)
        return out, lse


@pytest.mark.parametrize("T,H,K,N", [(4, 3, 6, 9), (3, 16, 40, 50), (1, 1, 1, 1)])
def test_flashinfer_wrapper_matches_reference(monkeypatch, T, H, K, N):
    be = FlashInferBackend()
    fake = _FakeMLAWrapper()
    monkeypatch.setattr(be, "supports", lambda **kw: None)
    monkeypatch.setattr(be, "_wrapper", lambda device: fake)
    q, rows, idx = _problem(T, H, K, N, fmt=BF16, seed=7 + T)
    if T > 1:
        idx[1] = -1  # empty token: left out of the batch
        idx[0, :2] = idx[0, 2] if K > 2 else idx[0, 0]  # duplicates count per entry
    vc = torch.tensor([K] + [max(1, K // 2)] * (T - 1), dtype=torch.int32)
    for v in (None, vc):
        out, lse = be.decode(q, rows.view(torch.uint8), idx, valid_counts=v, sm_scale=0.09,
                             row_format="bf16")
        ref_out, ref_lse = ReferenceBackend().decode(q, rows, idx, valid_counts=v,
                                                     sm_scale=0.09, row_format=BF16)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
        if T > 1:
            assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
            assert fake.plans[-1]["kv_indptr"].numel() == T  # T - 1 tokens planned
    # prefill is the same computation over the workspace
    out, lse = be.prefill(q, rows, idx, sm_scale=0.09)
    ref_out, ref_lse = ReferenceBackend().prefill(q, rows, idx, sm_scale=0.09)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_flashinfer_all_padding_and_stale_plan(monkeypatch):
    be = FlashInferBackend()
    fake = _FakeMLAWrapper()
    monkeypatch.setattr(be, "supports", lambda **kw: None)
    monkeypatch.setattr(be, "_wrapper", lambda device: fake)
    q, rows, idx = _problem(2, 4, 5, 6, fmt=BF16)
    out, lse = be.decode(q, rows, torch.full_like(idx, -1), sm_scale=0.1, row_format=BF16)
    assert (out == 0).all() and torch.isneginf(lse).all() and fake.plans == []
    p1 = be.plan(q, rows, idx, sm_scale=0.1)
    be.plan(q, rows, idx, sm_scale=0.2)
    with pytest.raises(RuntimeError, match="stale"):
        be.run(p1)
    with pytest.raises(ValueError, match="indices must lie"):
        be.plan(q, rows, idx + 100, sm_scale=0.1)


# ------------------------------------------------------------------ env
def test_collect_env_fields(monkeypatch):
    monkeypatch.setenv(env_mod.FLASHMLA_LIB_ENV, "/nonexistent/_flashmla_C.abi3.so")
    d = env_mod.collect_env(device="cpu")
    for key in ("python", "platform", "torch", "triton", "cupy", "numpy", "flashinfer",
                "cuda_available", "torch_cuda", "driver", "nvcc", "gpus", "device", "pinned",
                "flashmla_lib", "backends", "triton_decode", "triton_interpret",
                "interpreter_fixes"):
        assert key in d, key
    cuda = torch.cuda.is_available()
    assert d["torch"] == torch.__version__ and d["cuda_available"] is cuda
    assert (d["gpus"] == []) is (not cuda) and d["device"] == "cpu"
    assert d["flashmla_lib"] == "/nonexistent/_flashmla_C.abi3.so"
    assert d["pinned"]["ok"] is True and d["pinned"]["is_pinned"] is cuda
    names = [b["name"] for b in d["backends"]]
    assert names == chooser.backend_names()
    ref = d["backends"][names.index("reference")]
    assert ref["decode_fp8_ds_mla"] is None and ref["decode_bf16"] is None
    assert ref["prefill"] is None
    fm = d["backends"][names.index("flashmla")]
    assert "CUDA device" in fm["decode_fp8_ds_mla"] and "fp8_ds_mla rows only" in fm["decode_bf16"]
    json.dumps(d)  # JSON-able
    text = env_mod.format_env(d)
    assert "backend" in text and "decode fp8" in text and "why not:" in text
    assert "flashmla (" in text and "pinned memory: ok" in text
    # the Triton decode kernel chosen here, and why not the warp-specialised one
    td = d["triton_decode"]
    assert td["kernel"] == "wide" and "CUDA SM 9.x" in td["ws_off_reason"]
    assert td["gluon_ws"] == gluon_ws_problem()
    assert "triton decode, fp8_ds_mla, 128 heads: tl fused-tile kernel" in text
    assert "Gluon (warp-specialised kernel): " in text
    assert d["triton_interpret"] == interpreter_mode()
    assert d["interpreter_fixes"] == interpreter_fixes.applied()
    assert env_mod.collect_env(read_env_var=False)["flashmla_lib"] is None
