"""Sparse-MLA attention on CPU: the float32 reference (against a naive loop and hand cases)
and the Triton backend in the interpreter (against the reference), plus input validation.

Tolerance of Triton vs the float32 reference: |out - ref| <= 3e-2 + 1e-2 * |ref| and
|lse - ref| <= 1e-3 (rows ~ N(0, 1)). The kernel rounds p to bf16 for the p . v product
and writes bf16 output (the interpreter truncates instead of rounding, so CPU errors are
up to twice the GPU's); scores are float32 sums of exact bf16 products in both.
That these kernels compile for sm90 without spills is test_attention_compile.py's check.
"""

import dataclasses
import math

import pytest
import torch

from hisparse.attention import triton_backend as TB
from hisparse.attention import triton_plan as TP
from hisparse.attention.base import Phase, validate_decode_inputs
from hisparse.attention.reference import ReferenceBackend, sparse_mla_reference
from hisparse.attention.triton_backend import TritonBackend, TritonMLAConfig, default_config
from hisparse.formats import (RowFormat, dequantize_fp8_ds_mla_reference,
                              quantize_fp8_ds_mla_reference)
from hisparse.kernels import gluon_support as GS

# Triton runs on CUDA when there is one, else in the CPU interpreter (conftest)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 1.0 / math.sqrt(576)
ATOL, RTOL, LSE_TOL = 3e-2, 1e-2, 1e-3
REF = ReferenceBackend()
TRI = TritonBackend(allow_interpreter=True)


def _rows(n: int, fmt: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_rows in ``fmt``, the same rows as float32 [n, 576])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g).bfloat16()
    if fmt == "bf16":
        return x.to(DEV), x.float().to(DEV)
    rows = quantize_fp8_ds_mla_reference(x)
    return rows.to(DEV), dequantize_fp8_ds_mla_reference(rows, out_dtype=torch.float32).to(DEV)


def _q(T: int, H: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, H, 576, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEV)


def _indices(T: int, K: int, N: int, seed: int = 2, pad: float = 0.25) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    idx[torch.rand(T, K, generator=g) < pad] = -1
    if T > 1:
        idx[1] = -1  # token 1: no valid entry at all
    return idx.to(DEV)


def _close(out, lse, ref_out, ref_lse):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= LSE_TOL if fin.any() else True
    err = (out.float() - ref_out.float()).abs()
    assert (err <= ATOL + RTOL * ref_out.float().abs()).all(), f"max err {err.max().item()}"


def _naive(q, rows32, idx, vc, scale):
    """Per (t, h) python loop over the valid entries (oracle of the oracle)."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, device=q.device)
    lse = torch.full((T, H), float("-inf"), device=q.device)
    for t in range(T):
        ks = [int(i) for k, i in enumerate(idx[t]) if i >= 0 and (vc is None or k < int(vc[t]))]
        if not ks:
            continue
        k = rows32[ks]  # [n, 576]
        for h in range(H):
            s = (k.double() @ q[t, h].double()) * scale
            lse[t, h] = torch.logsumexp(s, 0).float()
            out[t, h] = (torch.softmax(s, 0)[:, None] * k[:, :512].double()).sum(0).float()
    return out, lse


# ------------------------------------------------------------ the reference
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_reference_matches_naive_loop(fmt):
    kv, rows32 = _rows(9, fmt)
    q, idx = _q(3, 2), _indices(3, 6, 9)
    vc = torch.tensor([6, 6, 2], dtype=torch.int32, device=DEV)
    for v in (None, vc):
        inp = validate_decode_inputs(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        out, lse = sparse_mla_reference(inp, out_dtype=torch.float32)
        n_out, n_lse = _naive(q, rows32, idx, v, SCALE)
        assert torch.allclose(out, n_out, atol=1e-5, rtol=1e-5)
        assert torch.allclose(lse, n_lse, atol=1e-5) and torch.equal(lse.isinf(), n_lse.isinf())


def test_reference_hand_case_duplicates_and_padding():
    """Rows a, b with q . a = q . b: entries [a, a, b, -1] weigh a 2/3 and b 1/3."""
    kv = torch.zeros(2, 576, dtype=torch.bfloat16, device=DEV)
    kv[0, 0], kv[0, 512] = 3.0, 1.0  # row a: latent [3, 0, ...], rope [1, ...]
    kv[1, 1], kv[1, 512] = 6.0, 1.0  # row b: latent [0, 6, ...], same score as a
    q = torch.zeros(1, 1, 576, dtype=torch.bfloat16, device=DEV)
    q[0, 0, 512] = 2.0  # score = 2 * 1 * scale for both rows
    idx = torch.tensor([[0, 0, 1, -1]], dtype=torch.int32, device=DEV)
    for be in (REF, TRI):
        out, lse = be.decode(q, kv, idx, sm_scale=0.5, row_format="bf16")
        assert out[0, 0, 0].item() == pytest.approx(2.0, abs=1e-2)
        assert out[0, 0, 1].item() == pytest.approx(2.0, abs=1e-2)
        assert out[0, 0, 2:].abs().max().item() == 0.0
        assert lse[0, 0].item() == pytest.approx(1.0 + math.log(3.0), abs=1e-4)


# --------------------------------------------------- Triton vs reference sweep
@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("K", [1, 7, 64])
@pytest.mark.parametrize("H", [1, 16, 128])
def test_triton_decode_matches_reference(H, K, fmt):
    N, T = 40, 3
    kv, _ = _rows(N, fmt, seed=H + K)
    q, idx = _q(T, H, seed=K), _indices(T, K, N, seed=H)
    # valid counts: full, 0 (token 1 is all padding anyway) and partial
    vc = torch.tensor([K, 0, max(1, K // 2)], dtype=torch.int32, device=DEV)
    for v in (None, vc):
        out, lse = TRI.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        ref_out, ref_lse = REF.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        _close(out, lse, ref_out, ref_lse)
        assert torch.isinf(lse[1]).all() and out[1].abs().max().item() == 0.0
    if K > 1:  # valid_counts = 0 everywhere: nothing attended
        zero = torch.zeros(T, dtype=torch.int32, device=DEV)
        out, lse = TRI.decode(q, kv, idx, valid_counts=zero, sm_scale=SCALE, row_format=fmt)
        assert out.abs().max().item() == 0.0 and torch.isneginf(lse).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("splits,block_n", [(2, 16), (3, 16), (5, 16), (64, 16), (2, 32)])
def test_triton_split_kv_combine(fmt, splits, block_n):
    N, T, H, K = 50, 3, 5, 70  # odd sizes: masked heads, partial last split
    kv, _ = _rows(N, fmt, seed=7)
    q, idx = _q(T, H, seed=8), _indices(T, K, N, seed=9)
    vc = torch.tensor([K, 3, 20], dtype=torch.int32, device=DEV)  # token 1: valid entries land in split 0 only
    be = TritonBackend(allow_interpreter=True,
                       config=TritonMLAConfig(block_h=16, block_n=block_n, num_warps=4,
                                              num_splits=splits))
    for v in (None, vc):
        out, lse = be.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        _close(out, lse, *REF.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt))


def test_wave_tail_plan():
    """Tokens past the last full wave of SMs get their own split launch only when that
    wave would be at most half full; enough splits to fill the SMs, >= 2 blocks each."""
    plan = TB.wave_tail_plan
    assert plan(68, 2, 2048, 32, 132) == (2, 32)  # 136 programs: 4 past one wave
    assert plan(67, 2, 2048, 32, 132) == (1, 32)
    assert plan(64, 2, 2048, 32, 132) == (0, 1)  # fits one wave
    assert plan(66, 2, 2048, 32, 132) == (0, 1)  # exactly one wave
    assert plan(132, 2, 2048, 32, 132) == (0, 1)  # exactly two
    assert plan(99, 2, 2048, 32, 132) == (33, 2)  # 66 past the wave: half full
    assert plan(100, 2, 2048, 32, 132) == (0, 1)  # 68 past it: more than half
    assert plan(133, 1, 2048, 32, 132) == (1, 32)  # capped at MAX_AUTO_SPLITS
    assert plan(133, 1, 2048, 32, 132)[1] == TB.MAX_AUTO_SPLITS
    assert plan(68, 2, 128, 32, 132) == (2, 2)  # each split keeps 2 blocks of rows
    assert plan(68, 2, 64, 32, 132) == (0, 1)  # too few rows to split
    assert plan(5, 2, 2048, 32, 4) == (1, 2)  # 10 programs on 4 SMs: 2 past two waves


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_wave_tail_launch_matches_one_launch(fmt, monkeypatch):
    """With a tail (forced here: the plan applies on CUDA only) the last tokens run as a
    split launch into the same outputs; results match the reference, valid counts and
    empty tokens included, and the head tokens equal the single launch's bit for bit."""
    N, T, H, K = 50, 5, 5, 70
    kv, _ = _rows(N, fmt, seed=17)
    q, idx = _q(T, H, seed=18), _indices(T, K, N, seed=19)
    vc = torch.tensor([K, 3, 20, 0, 41], dtype=torch.int32, device=DEV)
    cfg = TritonMLAConfig(block_h=16, block_n=16, num_warps=4, num_splits=1)
    be = TritonBackend(allow_interpreter=True, config=cfg)
    one = [be.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt) for v in (None, vc)]
    calls, launches = [], []
    monkeypatch.setattr(TB, "_tail_plan", lambda T_, H_, K_, cfg_, s_, dev_, sms_: calls.append(T_) or (2, 3))
    real_run = TP._Launch.run
    monkeypatch.setattr(TP._Launch, "run", lambda self, *a:
                        launches.append((self.lo, self.hi, self.splits)) or real_run(self, *a))
    for v, (o1, l1) in zip((None, vc), one):
        out, lse = be.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        _close(out, lse, *REF.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt))
        assert torch.equal(out[:3], o1[:3]) and torch.equal(lse[:3], l1[:3])
    assert calls == [T, T] and launches == [(0, 3, 1), (3, 5, 3)] * 2
    # where the plan applies: CUDA, the ws kernel, one split, wave_tail
    cuda = torch.device("cuda")
    monkeypatch.undo()  # the real _tail_plan and _launch
    monkeypatch.setattr(TB, "sm_count", lambda device: 132)
    ws = TritonMLAConfig(**TB.WS_DEFAULT)
    assert TB._tail_plan(68, 128, 2048, ws, 1, cuda, None) == (2, 32)
    assert TB._tail_plan(68, 128, 2048, ws, 1, torch.device("cpu"), None) == (0, 1)
    assert TB._tail_plan(68, 128, 2048, ws, 2, cuda, None) == (0, 1)
    assert TB._tail_plan(68, 128, 2048, dataclasses.replace(ws, wave_tail=False), 1, cuda, None) == (0, 1)
    assert TB._tail_plan(68, 128, 2048, TB.DEFAULT_CONFIGS[(RowFormat.FP8_DS_MLA, 64)], 1, cuda, None) == (0, 1)
    # an SM budget (a split layer's hit attention beside its staging copy): 66 tokens
    # fill 132 SMs in one wave, but on 124 their last 4 tokens run split
    assert TB._tail_plan(66, 128, 2048, ws, 1, cuda, None) == (0, 1)
    assert TB._tail_plan(66, 128, 2048, ws, 1, cuda, 124) == (4, 15)
    assert TB.auto_splits(8, 128, 2048, ws, cuda) == 8 and TB.auto_splits(8, 128, 2048, ws, cuda, sms=64) == 4
    for bad in (0, 133):
        with pytest.raises(ValueError, match="sms"):
            TB.check_sms(bad, cuda)
    with pytest.raises(TypeError, match="wave_tail must be a bool"):
        TritonMLAConfig(wave_tail=1)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("splits,isolate_qk", [(1, False), (3, False), (1, True), (3, True)])
def test_triton_tiled_kernel_matches_reference(fmt, splits, isolate_qk):
    """The tiled body, with and without isolate_qk (each q . k^T dot in its own one-trip
    loop), direct and split-KV, gives the reference result."""
    N, T, H, K = 40, 3, 18, 45  # 18 heads: two head blocks of 16, the second masked
    kv, _ = _rows(N, fmt, seed=11)
    q, idx = _q(T, H, seed=12), _indices(T, K, N, seed=13)
    vc = torch.tensor([K, 0, 7], dtype=torch.int32, device=DEV)
    be = TritonBackend(allow_interpreter=True,
                       config=TritonMLAConfig(block_h=16, block_n=16, num_warps=4,
                                              num_splits=splits, isolate_qk=isolate_qk))
    for v in (None, vc):
        out, lse = be.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        _close(out, lse, *REF.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt))
        if v is not None:
            assert out[1].abs().max().item() == 0.0 and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_wide_kernel_matches_reference(fmt, splits):
    """The fused-tile body (``wide``: one [block_n, 512] latent tile, three dots per
    iteration) gives the reference result, with -1 padding, a masked second head block,
    valid counts 0 and partial, and split-KV."""
    N, T, H, K = 40, 3, 18, 45
    kv, _ = _rows(N, fmt, seed=21)
    q, idx = _q(T, H, seed=22), _indices(T, K, N, seed=23)
    vc = torch.tensor([K, 0, 7], dtype=torch.int32, device=DEV)
    be = TritonBackend(allow_interpreter=True,
                       config=TritonMLAConfig(block_h=16, block_n=16, num_warps=4,
                                              num_splits=splits, wide=True, prefetch=1))
    for v in (None, vc):
        out, lse = be.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        _close(out, lse, *REF.decode(q, kv, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt))
        if v is not None:
            assert out[1].abs().max().item() == 0.0 and torch.isneginf(lse[1]).all()


def _scale_free_close(out, lse, ref_out, ref_lse, rel=1e-2):
    """|out - ref| <= rel * max|ref| per (token, head), whatever the magnitudes."""
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert ((lse[fin] - ref_lse[fin]).abs() <= 1e-3 * ref_lse[fin].abs().clamp_min(1.0)).all()
    err = (out.float() - ref_out.float()).abs().amax(-1)
    bound = rel * ref_out.float().abs().amax(-1)
    assert (err <= bound + 1e-30).all(), f"worst err / max|ref| {(err / bound.clamp_min(1e-30)).max()}"


@pytest.mark.parametrize("wide", [False, True])
def test_triton_fp8_scale_extremes(wide):
    """fp8 rows whose tile scales span 2^-40 .. 2^30 (and all-zero rows and tiles), q
    heads from 1e-30 to 3e4 and a zero head: each (token, head) matches the reference to
    1% of its own largest output value, in the tiled and the fused-tile body."""
    N, T, H, K = 48, 3, 20, 40
    g = torch.Generator().manual_seed(31)
    x = torch.randn(N, 576, generator=g)
    x *= torch.exp2(torch.randint(-40, 31, (N, 1), generator=g).float())
    x[5] = 0.0
    x[7, 128:256] = 0.0
    rows = quantize_fp8_ds_mla_reference(x.bfloat16()).to(DEV)
    q = torch.randn(T, H, 576, generator=g)
    q[:, 0] *= 3e4
    q[:, 1] *= 1e-30
    q[:, 2] = 0.0
    q[0, 3:8] *= 1e-3
    q = q.bfloat16().to(DEV)
    idx = _indices(T, K, N, seed=32)
    be = TritonBackend(allow_interpreter=True,
                       config=TritonMLAConfig(block_h=16, block_n=16, num_warps=4,
                                              num_splits=2, wide=wide))
    out, lse = be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    _scale_free_close(out, lse, *REF.decode(q, rows, idx, sm_scale=SCALE,
                                            row_format="fp8_ds_mla"))


def test_triton_bf16_rows_as_bytes_and_strided_q():
    kv, _ = _rows(20, "bf16")
    q = _q(2, 8)[:, ::2]  # [2, 4, 576], head stride 2 * 576
    idx = _indices(2, 9, 20, pad=0.0)
    a = TRI.decode(q, kv, idx, sm_scale=SCALE, row_format="bf16")
    b = TRI.decode(q, kv.view(torch.uint8), idx, sm_scale=SCALE, row_format=RowFormat.BF16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    _close(*a, *REF.decode(q.contiguous(), kv, idx, sm_scale=SCALE, row_format="bf16"))


def test_triton_prefill_matches_reference():
    ws, _ = _rows(33, "bf16", seed=4)
    q, idx = _q(5, 16, seed=5), _indices(5, 40, 33, seed=6)
    vc = torch.tensor([40, 0, 1, 39, 17], dtype=torch.int32, device=DEV)
    for v in (None, vc):
        out, lse = TRI.prefill(q, ws, idx, valid_counts=v, sm_scale=SCALE)
        _close(out, lse, *REF.prefill(q, ws, idx, valid_counts=v, sm_scale=SCALE))


@pytest.mark.parametrize("be", [REF, TRI], ids=["reference", "triton"])
def test_empty_sizes(be):
    kv, _ = _rows(4, "fp8_ds_mla")
    out, lse = be.decode(_q(0, 3), kv, torch.zeros(0, 5, dtype=torch.int32, device=DEV), sm_scale=SCALE,
                         row_format="fp8_ds_mla")
    assert out.shape == (0, 3, 512) and lse.shape == (0, 3)
    out, lse = be.decode(_q(2, 3), kv, torch.zeros(2, 0, dtype=torch.int32, device=DEV), sm_scale=SCALE,
                         row_format="fp8_ds_mla")
    assert out.shape == (2, 3, 512) and out.abs().max().item() == 0.0 and torch.isneginf(lse).all()
    empty = torch.zeros(0, 656, dtype=torch.uint8, device=DEV)  # N = 0: only padding is possible
    out, lse = be.decode(_q(2, 3), empty, torch.full((2, 4), -1, dtype=torch.int32, device=DEV),
                         sm_scale=SCALE, row_format="fp8_ds_mla")
    assert out.abs().max().item() == 0.0 and torch.isneginf(lse).all()


def test_unchecked_out_of_range_entries_are_padding():
    kv, _ = _rows(10, "fp8_ds_mla")
    q = _q(2, 16)
    idx = torch.tensor([[3, 10, 4, 1 << 30], [-5, 2, -(1 << 30), 9]], dtype=torch.int32, device=DEV)
    clean = torch.where((idx >= 0) & (idx < 10), idx, torch.full_like(idx, -1))
    fast = TritonBackend(allow_interpreter=True, validate=False)
    out, lse = fast.decode(q, kv, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    _close(out, lse, *REF.decode(q, kv, clean, sm_scale=SCALE, row_format="fp8_ds_mla"))
    with pytest.raises(ValueError, match=r"\[-1, 10\)"):
        TRI.decode(q, kv, idx, sm_scale=SCALE, row_format="fp8_ds_mla")


# ----------------------------------------------------------- validation
def _bad_calls():
    kv8, _ = _rows(6, "fp8_ds_mla")
    kv16, _ = _rows(6, "bf16")
    q, idx = _q(2, 4), _indices(2, 3, 6)
    ok = dict(sm_scale=SCALE, row_format="fp8_ds_mla")
    i64 = idx.long()
    return [
        (TypeError, "q must be bfloat16", (q.float(), kv8, idx), ok),
        (ValueError, r"q must be \[T, H >= 1, 576\]", (q[..., :512], kv8, idx), ok),
        (ValueError, r"q must be \[T, H >= 1, 576\]", (q[:, :0], kv8, idx), ok),
        (TypeError, "indices must be int32", (q, kv8, i64), ok),
        (ValueError, r"indices must be \[T=2, K\]", (q, kv8, idx[:1]), ok),
        (TypeError, "fp8_ds_mla kv_rows must be uint8", (q, kv16, idx), ok),
        (ValueError, r"\[N, 656\]", (q, kv8[:, :655], idx), ok),
        (ValueError, "4-byte aligned", (q, torch.zeros(6, 658, dtype=torch.uint8, device=DEV)[:, 1:657], idx), ok),
        (ValueError, r"bf16 kv_rows as bytes must be uint8 \[N, 1152\]", (q, kv8, idx),
         dict(ok, row_format="bf16")),
        (TypeError, "bf16 kv_rows must be bfloat16", (q, kv16.float(), idx),
         dict(ok, row_format="bf16")),
        (ValueError, r"\[N, 576\]", (q, kv16[:, :512], idx), dict(ok, row_format="bf16")),
        (ValueError, "unknown row format", (q, kv8, idx), dict(ok, row_format="fp8")),
        (ValueError, r"indices must lie in \[-1, 6\)", (q, kv8, idx + 6), ok),
        (ValueError, r"indices must lie in \[-1, 6\)", (q, kv8, idx - 3), ok),
        (TypeError, "valid_counts must be int32", (q, kv8, idx),
         dict(ok, valid_counts=torch.ones(2, dtype=torch.int64, device=DEV))),
        (ValueError, r"valid_counts must be \[T=2\]", (q, kv8, idx),
         dict(ok, valid_counts=torch.ones(3, dtype=torch.int32, device=DEV))),
        (ValueError, r"valid_counts must lie in \[0, K=3\]", (q, kv8, idx),
         dict(ok, valid_counts=torch.tensor([4, 0], dtype=torch.int32, device=DEV))),
        (ValueError, r"valid_counts must lie in \[0, K=3\]", (q, kv8, idx),
         dict(ok, valid_counts=torch.tensor([-1, 0], dtype=torch.int32, device=DEV))),
        (ValueError, "sm_scale must be finite and > 0", (q, kv8, idx), dict(ok, sm_scale=0.0)),
        (ValueError, "sm_scale must be finite and > 0", (q, kv8, idx), dict(ok, sm_scale=math.nan)),
        (TypeError, "sm_scale must be a float", (q, kv8, idx), dict(ok, sm_scale="0.1")),
        (ValueError, "kv_rows is on .*, q on meta", (q.to("meta"), kv8, idx), ok),
        (TypeError, "kv_rows must be a torch.Tensor", (q, kv8.cpu().numpy(), idx), ok),
    ]


@pytest.mark.parametrize("be", [REF, TRI], ids=["reference", "triton"])
@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_decode_rejects_bad_input(be, case):
    exc, msg, args, kwargs = _bad_calls()[case]
    with pytest.raises(exc, match=msg):
        be.decode(*args, **kwargs)


@pytest.mark.parametrize("be", [REF, TRI], ids=["reference", "triton"])
def test_prefill_rejects_bad_input(be):
    ws, _ = _rows(6, "bf16")
    q, idx = _q(2, 4), _indices(2, 3, 6)
    with pytest.raises(TypeError, match="workspace must be bfloat16"):
        be.prefill(q, ws.float(), idx, sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"workspace must be \[W, 576\]"):
        be.prefill(q, ws[:, :100], idx, sm_scale=SCALE)
    with pytest.raises(ValueError, match=r"\[-1, 6\)"):
        be.prefill(q, ws, idx + 6, sm_scale=SCALE)


def test_supports_reasons():
    cpu = torch.device("cpu")
    assert REF.supports(device=cpu, row_format=RowFormat.FP8_DS_MLA, num_heads=3,
                        phase=Phase.DECODE) is None
    assert TRI.supports(device=DEV, row_format=RowFormat.FP8_DS_MLA, num_heads=128,
                        phase=Phase.DECODE) is None
    reason = TritonBackend().supports(device=cpu, row_format=RowFormat.BF16, num_heads=16,
                                      phase=Phase.DECODE)
    assert isinstance(reason, str) and "CUDA" in reason
    reason = TRI.supports(device=cpu, row_format=RowFormat.FP8_DS_MLA, num_heads=16,
                          phase=Phase.PREFILL)
    assert isinstance(reason, str) and "bf16" in reason
    assert "num_heads" in TRI.supports(device=cpu, row_format=RowFormat.BF16, num_heads=0,
                                       phase=Phase.DECODE)


def test_config_validation_and_default():
    with pytest.raises(ValueError, match="power of two"):
        TritonMLAConfig(block_n=24)
    with pytest.raises(ValueError, match=">= 16"):
        TritonMLAConfig(block_h=8)
    with pytest.raises(TypeError, match="block_h must be an int"):
        TritonMLAConfig(block_h=True)
    with pytest.raises(ValueError, match="num_splits"):
        TritonMLAConfig(num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        TritonMLAConfig(num_splits=65)
    with pytest.raises(TypeError, match="isolate_qk must be a bool"):
        TritonMLAConfig(isolate_qk=1)
    for bad, exc in ((True, TypeError), (1.0, TypeError), (-1, ValueError), (4, ValueError)):
        with pytest.raises(exc, match="prefetch"):
            TritonMLAConfig(prefetch=bad)
    with pytest.raises(TypeError, match="wide must be a bool"):
        TritonMLAConfig(wide=1)
    with pytest.raises(TypeError, match="TritonMLAConfig"):
        TritonBackend(config={"block_h": 16})
    for removed in ("dv_parts", "f16_mma", "reg_pipe", "mma_rowsum", "prefetch_l1", "ws_split_qk"):
        with pytest.raises(TypeError, match=removed):
            TritonMLAConfig(**{removed: True})
    cfg = default_config(64, 128, 2048, torch.device("cpu"), "fp8_ds_mla")
    assert cfg.block_h == 64 and cfg.num_splits == 1 and cfg.wide and not cfg.ws
    assert default_config(1, 1, 8, torch.device("cpu")).block_h == 16
    with pytest.raises(ValueError, match="H must be >= 1"):
        default_config(1, 0, 8, torch.device("cpu"))


def test_default_config_records_why_ws_is_off(monkeypatch):
    """default_config says in ws_off_reason why it did not pick the warp-specialised
    kernel (device, Triton's Gluon, row alignment, format, head block, allow_ws), and
    picks it when nothing stands in the way; the reason is not part of the launch shape."""
    cpu = torch.device("cpu")
    cfg = default_config(64, 128, 2048, cpu, "fp8_ds_mla")
    assert not cfg.ws and "CUDA SM 9.x" in cfg.ws_off_reason
    assert "fp8_ds_mla rows only" in default_config(64, 128, 2048, cpu, "bf16").ws_off_reason
    assert "16-head blocks" in default_config(64, 16, 2048, cpu, "fp8_ds_mla").ws_off_reason
    assert "allow_ws=False" in default_config(64, 128, 2048, cpu, allow_ws=False).ws_off_reason
    # as on an SM 9.x GPU whose Triton lacks what the Gluon kernel needs
    monkeypatch.setattr(TB, "ws_device_problem", lambda device: None)
    monkeypatch.setattr(TB, "gluon_ws_problem", lambda: "Triton 9.9: Gluon lacks X")
    cfg = default_config(64, 128, 2048, cpu, "fp8_ds_mla")
    assert not cfg.ws and cfg.wide and cfg.ws_off_reason.endswith("Triton 9.9: Gluon lacks X")
    be = TritonBackend(config=TritonMLAConfig(block_h=64, block_n=32, num_warps=4, ws=True),
                       allow_interpreter=True)
    reason = be.supports(device=cpu, row_format=RowFormat.FP8_DS_MLA, num_heads=128,
                         phase=Phase.DECODE)
    assert "ws=True" in reason and "Gluon lacks X" in reason
    # ... and one that has it: ws, unless the rows are not 16-byte aligned
    monkeypatch.setattr(TB, "gluon_ws_problem", lambda: None)
    cfg = default_config(64, 128, 2048, cpu, "fp8_ds_mla")
    assert cfg.ws and cfg.ws_off_reason is None and cfg.block_n == TB.WS_DEFAULT["block_n"]
    rows = torch.zeros(65, 656, dtype=torch.uint8)
    assert default_config(64, 128, 2048, cpu, kv_rows=rows[:64]).ws
    cfg = default_config(64, 128, 2048, cpu, kv_rows=rows.view(-1)[4:4 + 64 * 656].view(64, 656))
    assert not cfg.ws and "16-byte aligned" in cfg.ws_off_reason
    assert cfg == dataclasses.replace(cfg, ws_off_reason=None)  # not part of the shape


def test_isolated_tiled_dots_off_where_ptxas_crashes_on_them(monkeypatch):
    """Under Triton 3.7 / 3.8 (ptxas crashes on their code for the tiled body's isolated
    dots at 64-head blocks) default_config turns isolate_qk off for CUDA and says why; an
    explicit such config is refused before launch; other releases and the interpreter
    keep it."""
    cuda = torch.device("cuda")
    bf16_64 = TB.DEFAULT_CONFIGS[(RowFormat.BF16, 64)]
    assert bf16_64.isolate_qk and not bf16_64.wide
    monkeypatch.setattr(TB, "_TRITON_MINOR", (3, 9))
    assert TB.isolate_problem(bf16_64, cuda) is None
    monkeypatch.setattr(TB, "_TRITON_MINOR", (3, 8))
    assert "ptxas crashes" in TB.isolate_problem(bf16_64, cuda)
    assert TB.isolate_problem(bf16_64, torch.device("cpu")) is None  # no ptxas there
    assert TB.isolate_problem(TB.DEFAULT_CONFIGS[(RowFormat.FP8_DS_MLA, 64)], cuda) is None
    assert TB.isolate_problem(TritonMLAConfig(block_h=32, isolate_qk=True), cuda) is None
    monkeypatch.setattr(TB, "sm_count", lambda device: 132)  # default_config for a GPU, here
    cfg = default_config(64, 128, 2048, cuda, "bf16")
    assert not cfg.isolate_qk and "ptxas crashes" in cfg.isolate_off_reason
    assert cfg == dataclasses.replace(bf16_64, isolate_qk=False, num_splits=cfg.num_splits)
    # an explicit config that can't compile is refused before any launch
    monkeypatch.setattr(TB, "isolate_problem", lambda cfg, device: "ptxas crashes (as on 3.8)")
    be = TritonBackend(config=bf16_64, allow_interpreter=True)
    with pytest.raises(ValueError, match=r"isolate_qk=True\) cannot run here: ptxas crashes"):
        be.decode(_q(1, 64), _rows(8, "bf16")[0], _indices(1, 4, 8), sm_scale=SCALE,
                  row_format="bf16")


def test_gluon_guard_names_what_is_missing(monkeypatch):
    """gluon_ws_problem() names a missing module attribute and a changed signature."""
    real = GS.gluon_ws_problem()  # this Triton (None where the ws kernel can be built)
    assert real is None or real.startswith("Triton ")
    try:
        GS.gluon_ws_problem.cache_clear()
        monkeypatch.setattr(GS, "_NAMES", {**GS._NAMES, GS._GL: GS._NAMES[GS._GL] + ("no_such_op",)})
        assert "Gluon lacks triton.experimental.gluon.language.no_such_op" in GS.gluon_ws_problem()
        GS.gluon_ws_problem.cache_clear()
        monkeypatch.setattr(GS, "_NAMES", {"triton.experimental.no_such_module": ("jit",)})
        assert "has no triton.experimental.no_such_module" in GS.gluon_ws_problem()
        GS.gluon_ws_problem.cache_clear()
        monkeypatch.setattr(GS, "_NAMES", {})
        monkeypatch.setattr(GS, "_PARAMS", ((GS._GL, "warp_specialize", ("default_partition",)),))
        assert "kernel passes ['default_partition']" in GS.gluon_ws_problem()
    finally:
        monkeypatch.undo()
        GS.gluon_ws_problem.cache_clear()
    assert GS.gluon_ws_problem() == real
