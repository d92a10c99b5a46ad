"""GPU (SM 9.x): the warp-specialised Gluon decode kernel (``TritonMLAConfig(ws=True)``,
``hisparse/kernels/mla_decode_ws.py``) against the float32 torch reference.

Same tolerance as test_attention_gpu.py: |out - ref| <= 2e-2 + 1e-2 |ref| elementwise,
|lse - ref| <= 1e-3. Shapes: K = 2048 (and awkward K), H = 128 / 100 / 16 (heads past H
are masked in the 64-head block), T = 1 (split KV + combine) to 256, ~10% -1 padding,
valid counts 0 / K / random, every ring shape the config accepts.
"""

import dataclasses

import pytest
import torch
from attention_common import REF, SCALE, check, check_extreme_scales, check_graph_capture, make_problem

from hisparse._checks import sm_count
from hisparse.attention import triton_plan as TP
from hisparse.attention.triton_backend import _rows_per_split
from hisparse.attention.triton_backend import (TritonBackend, TritonMLAConfig, default_config,
                                               wave_tail_plan)
from hisparse.kernels.gluon_support import gluon_ws_problem

pytestmark = pytest.mark.gpu

WS = TritonMLAConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, ws=True)


def _skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernel is Hopper-only (SM 9.x)")


def _problem(T, H, K, *, N=8192, pad=0.1, seed=0):
    return make_problem(T, H, K, "fp8_ds_mla", N=N, pad=pad, seed=seed)


_check = check


@pytest.mark.parametrize("H", [128, 100, 16])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_ws_matches_reference(T, H):
    _skip_unless_sm90()
    q, rows, idx, vc = _problem(T, H, 2048, seed=T + H)
    be = TritonBackend(config=dataclasses.replace(WS, ws_raw=2))
    for v in (None, vc):
        out, lse = be.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format="fp8_ds_mla")
        ref = REF.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format="fp8_ds_mla")
        _check(out, lse, *ref, what=f"T={T} H={H} vc={v is not None}")
        if v is not None and T > 1:
            assert out[1].abs().max().item() == 0.0 and torch.isneginf(lse[1]).all()


_RINGS = [(32, 2, 3, 56), (32, 2, 2, 40), (16, 4, 4, 56), (16, 3, 6, 72), (16, 2, 8, 88),
          (32, 1, 3, 56), (32, 2, 2, 72), (32, 2, 2, 56), (16, 4, 4, 72), (32, 1, 2, 40)]


# each ring shape is a kernel compile of its own: the default suite keeps two, the rest are gpu_long
@pytest.mark.parametrize("bn,stages,raw,preg", [
    r if r in _RINGS[:2] else pytest.param(*r, marks=pytest.mark.gpu_long) for r in _RINGS])
@pytest.mark.parametrize("splits", [1, 3])
def test_ws_ring_shapes(bn, stages, raw, preg, splits):
    """Every ring shape: the slot / phase arithmetic wraps differently for each; K = 1000
    (not a multiple of block_n) with short valid counts."""
    _skip_unless_sm90()
    q, rows, idx, vc = _problem(8, 128, 1000, seed=bn + stages + raw + preg)
    cfg = dataclasses.replace(WS, block_n=bn, num_stages=stages, ws_raw=raw,
                              ws_producer_regs=preg, num_splits=splits)
    out, lse = TritonBackend(config=cfg).decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE,
                                                row_format="fp8_ds_mla")
    _check(out, lse, *REF.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE,
                                 row_format="fp8_ds_mla"), what=f"{cfg}")


def test_ws_small_k_and_all_padding():
    _skip_unless_sm90()
    for K in (1, 7, 33, 2049):
        q, rows, idx, vc = _problem(5, 128, K, N=4096, seed=K)
        out, lse = TritonBackend(config=WS).decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE,
                                                   row_format="fp8_ds_mla")
        _check(out, lse, *REF.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE,
                                     row_format="fp8_ds_mla"), what=f"K={K}")
    q, rows, idx, _ = _problem(4, 128, 256, N=4096, seed=9)
    idx[2] = -1  # a token with no valid entry: out 0, lse -inf
    out, lse = TritonBackend(config=WS).decode(q, rows, idx, sm_scale=SCALE,
                                               row_format="fp8_ds_mla")
    torch.cuda.synchronize()
    assert out[2].abs().max().item() == 0.0 and torch.isneginf(lse[2]).all()
    _check(out, lse, *REF.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla"))


def test_ws_extreme_scales():
    _skip_unless_sm90()
    check_extreme_scales(TritonBackend(config=WS))


def test_ws_unchecked_out_of_range_is_masked():
    _skip_unless_sm90()
    q, rows, idx, _ = _problem(16, 128, 256, N=1024, seed=3)
    bad = idx.clone()
    bad[:, ::7] = 1 << 30
    bad[:, 3::11] = -(1 << 20)
    clean = torch.where((bad >= 0) & (bad < 1024), bad, torch.full_like(bad, -1))
    out, lse = TritonBackend(config=WS, validate=False).decode(q, rows, bad, sm_scale=SCALE,
                                                               row_format="fp8_ds_mla")
    _check(out, lse, *REF.decode(q, rows, clean, sm_scale=SCALE, row_format="fp8_ds_mla"))


def test_ws_graph_capture_and_replay():
    _skip_unless_sm90()
    check_graph_capture(TritonBackend(config=WS, validate=False))


@pytest.mark.parametrize("H", [128, 100])
@pytest.mark.parametrize("extra", [1, 2, 10])
def test_ws_wave_tail_matches_one_launch_and_reference(H, extra, monkeypatch):
    """Tokens just past one wave of SMs (``extra`` tokens of 2 head blocks over it) run as
    a split second launch: every token matches the reference, the tokens of the first
    launch equal the one-launch run's bit for bit, and a graph of it replays."""
    _skip_unless_sm90()
    sms = sm_count(torch.device("cuda"))
    T = sms // 2 + extra
    tail, splits = wave_tail_plan(T, 2, 2048, WS.block_n, sms)
    assert tail >= 1 and splits >= 2, (T, tail, splits)
    q, rows, idx, vc = _problem(T, H, 2048, seed=T + H)
    tailed = TritonBackend(config=WS)
    one = TritonBackend(config=dataclasses.replace(WS, wave_tail=False))
    launches = []
    real_run = TP._Launch.run
    monkeypatch.setattr(TP._Launch, "run", lambda self, *a:
                        launches.append((self.lo, self.hi, self.splits)) or real_run(self, *a))
    tailed.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    one.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    # the launch's splits: the plan's, after dropping splits that would get no rows
    assert launches == [(0, T - tail, 1), (T - tail, T, _rows_per_split(2048, splits, WS.block_n)[1]), (0, T, 1)]
    for v in (None, vc):
        out, lse = tailed.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format="fp8_ds_mla")
        ref = REF.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format="fp8_ds_mla")
        _check(out, lse, *ref, what=f"T={T} H={H} tail={tail}x{splits} vc={v is not None}")
        o1, l1 = one.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format="fp8_ds_mla")
        assert torch.equal(out[:T - tail], o1[:T - tail]) and torch.equal(lse[:T - tail], l1[:T - tail])
    if H == 128 and extra == 2:
        check_graph_capture(TritonBackend(config=WS, validate=False), T=T)


def test_ws_rejects_misaligned_rows_and_bf16():
    _skip_unless_sm90()
    q, rows, idx, _ = _problem(2, 128, 64, N=1024, seed=1)
    be = TritonBackend(config=WS)
    flat = torch.empty(rows.numel() + 8, dtype=torch.uint8, device="cuda")
    shifted = flat[8:].view(rows.shape)  # 8-byte aligned only
    shifted.copy_(rows)
    with pytest.raises(ValueError, match="16-byte aligned"):
        be.decode(q, shifted, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    with pytest.raises(ValueError, match="fp8_ds_mla rows only"):
        be.decode(q, torch.randn(1024, 576, device="cuda").bfloat16(), idx, sm_scale=SCALE,
                  row_format="bf16")


def test_ws_is_the_default_on_sm90():
    """With this Triton's Gluon able to build the kernel, the default fp8 config at
    64-head blocks is the warp-specialised one (else ws_off_reason says why not)."""
    _skip_unless_sm90()
    cfg = default_config(64, 128, 2048, torch.device("cuda"), "fp8_ds_mla")
    problem = gluon_ws_problem()
    assert cfg.ws == (problem is None), cfg
    if problem is not None:
        assert problem in cfg.ws_off_reason


def test_ws_sm_budget_plans_the_wave_tail_for_fewer_sms(monkeypatch):
    """sms = the device's less the SMs a staging copy keeps: a batch that fills every SM
    in one wave runs its last tokens as a split tail instead, and still matches the
    reference and a graph replay."""
    _skip_unless_sm90()
    sms = sm_count(torch.device("cuda"))
    T = sms // 2  # 2 head blocks a token: exactly one wave
    q, rows, idx, _ = _problem(T, 128, 2048, seed=9)
    be = TritonBackend(config=WS)
    launches = []
    real_run = TP._Launch.run
    monkeypatch.setattr(TP._Launch, "run", lambda self, *a:
                        launches.append((self.lo, self.hi, self.splits)) or real_run(self, *a))
    o_all, l_all = be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    o_b, l_b = be.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla", sms=sms - 8)
    tail, splits = wave_tail_plan(T, 2, 2048, WS.block_n, sms - 8)
    assert tail >= 1 and launches == [(0, T, 1), (0, T - tail, 1), (T - tail, T, _rows_per_split(2048, splits, WS.block_n)[1])]
    ref = REF.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    _check(o_b, l_b, *ref, what=f"T={T} sms={sms - 8}")
    assert torch.equal(o_b[:T - tail], o_all[:T - tail])
