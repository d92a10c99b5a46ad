"""GPU: Triton sparse-MLA (decode bf16 / fp8_ds_mla, prefill) and the fp8 quant kernels
against the torch references, at production shapes (K = 2048, H = 16 / 128, T up to 256).

Tolerance (rows and q ~ N(0, 1), sm_scale = 1/sqrt(576)): |out - ref| <= 2e-2 + 1e-2 *
|ref| elementwise and |lse - ref| <= 1e-3, where ref is the float32 torch reference.
Sources of difference: p is rounded to bf16 for the p . v tensor-core product and out
is written as bf16; scores are float32 sums of exact bf16 products in both.
"""

import math

import pytest
import torch
from attention_common import (REF, SCALE, check, check_extreme_scales, check_graph_capture,
                              make_problem)

from hisparse.attention.triton_backend import TritonBackend, TritonMLAConfig
from hisparse.formats import (dequantize_fp8_ds_mla, dequantize_fp8_ds_mla_reference,
                              quantize_fp8_ds_mla, quantize_fp8_ds_mla_reference)

pytestmark = pytest.mark.gpu

TRI = TritonBackend()
_problem, _check = make_problem, check

# (block_h, block_n, num_warps, num_stages): launch shapes of the tl kernels other than
# the defaults, each checked against the reference (the sweep benchmark,
# benchmarks/bench_triton_configs.py, times the same kind of shapes)
SHAPES = (
    (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 2), (64, 16, 8, 3),
    (64, 32, 16, 2), (64, 16, 4, 2), (64, 32, 4, 2), (32, 32, 8, 2), (32, 16, 4, 2),
    (16, 64, 8, 2), (16, 16, 4, 2), (16, 32, 4, 2),
)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_decode_default_config_matches_reference(T, H, fmt):
    q, rows, idx, vc = _problem(T, H, 2048, fmt, seed=T + H)
    for v in (None, vc):
        out, lse = TRI.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        ref = REF.decode(q, rows, idx, valid_counts=v, sm_scale=SCALE, row_format=fmt)
        _check(out, lse, *ref, what=f"T={T} H={H} {fmt} vc={v is not None}")
        if v is not None and T > 1:
            assert out[1].abs().max().item() == 0.0 and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("fmt", ["fp8_ds_mla"])  # bf16 differs only in the row loads
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}n{}w{}s{}".format(*s))
def test_launch_shapes_match_reference(shape, fmt):
    bh, bn, nw, ns = shape
    H = 128 if bh == 64 else 16
    q, rows, idx, vc = _problem(8, H, 2048, fmt, seed=bh + bn)
    ref = REF.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format=fmt)
    # one compile per shape (compiles dominate the time): alternate direct / split-KV paths
    splits = 1 if SHAPES.index(shape) % 2 == 0 else 3
    be = TritonBackend(config=TritonMLAConfig(block_h=bh, block_n=bn, num_warps=nw,
                                              num_stages=ns, num_splits=splits))
    out, lse = be.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format=fmt)
    _check(out, lse, *ref, what=f"{shape} splits={splits} {fmt}")


@pytest.mark.parametrize("wide", [True, False])
def test_fp8_tl_kernels_at_extreme_scales(wide):
    """The fp8 fused-tile (the tl default at block_h 64) and tiled kernels at the
    magnitudes of ``attention_common.check_extreme_scales``."""
    check_extreme_scales(TritonBackend(config=TritonMLAConfig(
        block_h=64, block_n=64, num_warps=8, num_stages=2, isolate_qk=True, prefetch=1,
        wide=wide)))


def test_odd_heads_and_small_k():
    for H, K in ((1, 1), (3, 7), (100, 100), (128, 2049)):
        q, rows, idx, vc = _problem(5, H, K, "fp8_ds_mla", N=4096, seed=H)
        out, lse = TRI.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla")
        _check(out, lse, *REF.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE,
                                     row_format="fp8_ds_mla"), what=f"H={H} K={K}")


def test_prefill_matches_reference():
    q, ws, idx, vc = _problem(256, 128, 2048, "bf16", N=4096, seed=11)
    for v in (None, vc):
        out, lse = TRI.prefill(q, ws, idx, valid_counts=v, sm_scale=SCALE)
        _check(out, lse, *REF.prefill(q, ws, idx, valid_counts=v, sm_scale=SCALE), what="prefill")


def test_unchecked_out_of_range_is_masked():
    q, rows, idx, _ = _problem(16, 128, 256, "fp8_ds_mla", N=1024, seed=3)
    bad = idx.clone()
    bad[:, ::7] = 1 << 30
    bad[:, 3::11] = -(1 << 20)
    clean = torch.where((bad >= 0) & (bad < 1024), bad, torch.full_like(bad, -1))
    out, lse = TritonBackend(validate=False).decode(q, rows, bad, sm_scale=SCALE,
                                                    row_format="fp8_ds_mla")
    _check(out, lse, *REF.decode(q, rows, clean, sm_scale=SCALE, row_format="fp8_ds_mla"),
           what="unchecked")


def test_decode_cuda_graph_capture_and_replay():
    check_graph_capture(TritonBackend(validate=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_kernels_match_reference(dtype):
    g = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(4096, 576, device="cuda", generator=g)
         * torch.logspace(-9, 5, 4096, device="cuda")[:, None]).to(dtype)
    x[7] = 0
    x[8, 128:256] = 0
    got = quantize_fp8_ds_mla(x)
    ref = quantize_fp8_ds_mla_reference(x)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)
    for od in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize_fp8_ds_mla(got, out_dtype=od),
                           dequantize_fp8_ds_mla_reference(got, out_dtype=od))


def test_quant_ties_match_reference():
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF, 0x80)], dtype=torch.uint8)
    pos = torch.sort(codes.view(torch.float8_e4m3fn).float().abs().unique()).values
    mids = (pos[:-1] + pos[1:]) / 2
    body = torch.cat([mids, -mids, mids + 2.0**-20, mids - 2.0**-20])
    n = math.ceil(body.numel() / 127)
    x = torch.zeros(n, 576)
    flat = torch.zeros(n * 127)
    flat[: body.numel()] = body
    x[:, :127] = flat.reshape(n, 127)
    x[:, 127] = 448.0
    x[:, 512] = 1.0 + 2.0**-8  # bf16 RoPE tie
    x = x.cuda()
    assert torch.equal(quantize_fp8_ds_mla(x), quantize_fp8_ds_mla_reference(x))
