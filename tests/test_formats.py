"""Row formats: fp8_ds_mla byte layout, scale rule, torch references and Triton kernels.

The Triton kernels run in the interpreter on CPU (conftest sets TRITON_INTERPRET=1) and
must match the torch references byte for byte.
"""

import math
import struct

import pytest
import torch

from hisparse import formats as F
from hisparse._checks import Kernels

triton_ok = pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
TORCH, TRITON = Kernels.TORCH, Kernels.TRITON
# the Triton kernels run on CUDA when there is one, else in the CPU interpreter
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def quant(x: torch.Tensor, use_triton: bool) -> torch.Tensor:
    if not use_triton:
        return F.quantize_fp8_ds_mla(x, kernels=TORCH)
    return F.quantize_fp8_ds_mla(x.to(DEV), kernels=TRITON).cpu()


def dequant(rows: torch.Tensor, use_triton: bool, out_dtype=torch.bfloat16) -> torch.Tensor:
    if not use_triton:
        return F.dequantize_fp8_ds_mla(rows, out_dtype=out_dtype, kernels=TORCH)
    return F.dequantize_fp8_ds_mla(rows.to(DEV), out_dtype=out_dtype, kernels="triton").cpu()


def _f32_bytes(v: float) -> list[int]:
    return list(struct.pack("<f", v))


def _bf16_bytes(v: float) -> list[int]:
    return list(torch.tensor([v], dtype=torch.bfloat16).view(torch.uint8).tolist())


def _e4m3_finite_values() -> torch.Tensor:
    """float32 [253]: every finite e4m3fn value (codes 0x00-0xFE except 0x7F and -0 = 0x80)."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF, 0x80)], dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


# ------------------------------------------------------------- byte layout
@triton_ok
def test_layout_every_byte_offset(use_triton):
    x = torch.zeros(1, 576)
    x[0, 0] = 448.0  # tile 0: amax 448 -> scale 1, code 0x7E at byte 0
    x[0, 127] = -1.0  # tile 0, last element: -1.0 = 0xB8 at byte 127
    x[0, 128] = 896.0  # tile 1: amax 896 -> scale 2; 896/2 = 448 -> 0x7E at byte 128
    x[0, 200] = 3.0  # 3/2 = 1.5 -> 0x3C at byte 200
    x[0, 256] = 0.5  # tile 2: amax 0.5 -> scale 2^-9 (0.5/448 = 2^-9.8 -> ceil 2^-9); 0.5/2^-9 = 256 -> 0x78
    # tile 3 (elements 384..511) all zero -> scale 2^-13, codes 0
    x[0, 512] = 1.0  # RoPE[0]  -> bf16 0x3F80 at bytes 528, 529
    x[0, 575] = -2.0  # RoPE[63] -> bf16 0xC000 at bytes 654, 655
    row = quant(x, use_triton)[0].tolist()
    assert len(row) == 656
    expect = [0] * 656
    expect[0], expect[127], expect[128], expect[200], expect[256] = 0x7E, 0xB8, 0x7E, 0x3C, 0x78
    expect[512:516] = _f32_bytes(1.0)
    expect[516:520] = _f32_bytes(2.0)
    expect[520:524] = _f32_bytes(2.0**-9)
    expect[524:528] = _f32_bytes(2.0**-13)
    expect[528:530] = [0x80, 0x3F]
    expect[654:656] = [0x00, 0xC0]
    assert row == expect


def test_layout_constants():
    assert (F.SCALE_OFFSET, F.ROPE_OFFSET, F.FP8_ROW_BYTES, F.BF16_ROW_BYTES) == (512, 528, 656, 1152)
    assert F.NUM_TILES * F.TILE == F.D_LATENT == 512 and F.D_ROW == 576
    assert F.ROPE_OFFSET + 2 * F.D_ROPE == F.FP8_ROW_BYTES


def test_bf16_bytes_layout_and_roundtrip():
    x = torch.randn(3, 576).bfloat16()
    b = F.bf16_rows_to_bytes(x)
    assert b.dtype == torch.uint8 and b.shape == (3, 1152)
    assert b[1, 2 * 5: 2 * 5 + 2].tolist() == _bf16_bytes(float(x[1, 5]))  # little endian pairs
    assert torch.equal(F.bytes_to_bf16_rows(b), x)
    assert torch.equal(F.bytes_to_bf16_rows(b[:, :].clone()), x)
    assert F.bf16_rows_to_bytes(torch.empty(0, 576, dtype=torch.bfloat16)).shape == (0, 1152)


# --------------------------------------------------------------- scale rule
@pytest.mark.parametrize("amax", [0.0, 1e-30, 1e-4, 0.0447, 448e-4, 0.05, 1.0, 447.9, 448.0,
                                  448.00003, 448 * 1.75, 448 * 2.0, 448 * 2.0000002, 3.0e5,
                                  1.0e30, 448.0 * 2.0**-12, 448.0 * 2.0**-13 * 1.0000001])
def test_pow2_scale_matches_formula(amax):
    a32 = torch.tensor([amax], dtype=torch.float32)
    got = float(F.pow2_scales_reference(a32)[0])
    v = max(float(a32[0]) / 448.0, 1e-4)
    want = 2.0 ** math.ceil(math.log2(v))
    assert got == want
    assert float(a32[0]) / got <= 448.0  # never saturates


def test_scale_floor_is_2_pow_minus_13():
    assert F.MIN_SCALE == 2.0 ** math.ceil(math.log2(1e-4))


@triton_ok
def test_all_zero_tile_gives_zero_codes_and_no_nan(use_triton):
    x = torch.zeros(2, 576, dtype=torch.bfloat16)
    x[1, 300] = 5.0  # only tile 2 of row 1 is non-zero
    rows = quant(x, use_triton)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    assert scales[0].tolist() == [2.0**-13] * 4
    assert scales[1].tolist() == [2.0**-13, 2.0**-13, 2.0**-6, 2.0**-13]
    assert int(rows[0, :512].max()) == 0
    back = dequant(rows, use_triton, torch.float32)
    assert torch.isfinite(back).all()
    assert torch.equal(back, x.float())  # 5.0 / 2^-6 = 320 is exact in e4m3


# ------------------------------------------------------------ round trips
@triton_ok
def test_exact_e4m3_values_round_trip(use_triton):
    vals = _e4m3_finite_values()  # +-448 in both tiles 0 and 1 -> scale 1
    x = torch.zeros(2, 576)
    x[0, :253] = vals
    x[0, 253:256] = 448.0
    x[1, :253] = -vals
    x[1, 253:256] = -448.0
    x[:, 256:512] = x[:, :256] * 4  # tiles 2, 3: scale 4
    rows = quant(x, use_triton)
    back = dequant(rows, use_triton, torch.float32)
    assert torch.equal(back[:, :512], x[:, :512])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_bound(dtype):
    torch.manual_seed(1)
    x = (torch.randn(16, 576) * torch.logspace(-6, 4, 16)[:, None]).to(dtype)
    rows = F.quantize_fp8_ds_mla_reference(x)
    back = F.dequantize_fp8_ds_mla_reference(rows, out_dtype=torch.float32)
    lat = x[:, :512].float().reshape(16, 4, 128)
    scale = rows[:, 512:528].contiguous().view(torch.float32)[:, :, None]
    err = (back[:, :512].reshape(16, 4, 128) - lat).abs()
    # half an e4m3 ulp: relative 2^-4 in the normal range, absolute scale*2^-10 below it
    bound = torch.maximum(lat.abs() * 2.0**-4, scale * 2.0**-10)
    assert (err <= bound).all()
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).float())


# -------------------------------------------------------- Triton == torch
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 7])
def test_triton_quantize_matches_reference(dtype, n):
    torch.manual_seed(n)
    x = (torch.randn(n, 576) * torch.logspace(-9, 5, max(n, 1))[:n, None]).to(dtype)
    if n:
        x[0, 128:256] = 0.0
    got = quant(x, True)
    assert got.shape == (n, 656) and got.dtype == torch.uint8
    assert torch.equal(got, F.quantize_fp8_ds_mla_reference(x))


def test_triton_quantize_ties_and_subnormals_match_reference():
    """Midpoints between neighbouring e4m3 values (round half to even), both signs."""
    vals = _e4m3_finite_values()
    pos = torch.sort(vals[vals > 0]).values
    mids = (pos[:-1] + pos[1:]) / 2  # exact in float32
    mids = torch.cat([mids, mids + 2.0**-20, mids - 2.0**-20, torch.tensor([2.0**-10, 2.0**-11])])
    body = torch.cat([mids, -mids])
    n_rows = math.ceil(body.numel() / 508)
    x = torch.zeros(n_rows * 4, 576)
    flat = torch.zeros(n_rows * 4 * 127)
    flat[: body.numel()] = body
    x[:, :127] = flat.reshape(-1, 127)  # tile 0: 127 test values ...
    x[:, 127] = 448.0  # ... plus 448 -> scale 1, so codes are the rounded values
    x[:, 512] = 1.0 + 2.0**-8  # RoPE: a bf16 tie (fp32 input), rounds to even = 1.0
    x[:, 513] = 1.0 + 3 * 2.0**-8  # rounds up to 1 + 2^-6
    got = quant(x, True)
    ref = F.quantize_fp8_ds_mla_reference(x)
    assert torch.equal(got, ref)
    rope = ref[:, 528:].contiguous().view(torch.bfloat16)
    assert rope[0, 0].item() == 1.0 and rope[0, 1].item() == 1.0 + 2.0**-6


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_triton_dequantize_matches_reference(out_dtype):
    torch.manual_seed(3)
    n = 5
    rows = torch.randint(0, 256, (n, 656), dtype=torch.uint8)
    codes = rows[:, :512]
    codes[(codes & 0x7F) == 0x7F] = 0x11  # no NaN codes (undefined in the interpreter)
    exps = torch.randint(-20, 20, (n, 4)).float()
    rows[:, 512:528] = torch.exp2(exps).view(torch.uint8).reshape(n, 16)
    rope = torch.randn(n, 64).bfloat16()
    rows[:, 528:] = rope.view(torch.uint8).reshape(n, 128)
    got = dequant(rows, True, out_dtype)
    ref = F.dequantize_fp8_ds_mla_reference(rows, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (n, 576)
    assert torch.equal(got, ref)
    assert torch.equal(ref[:, 512:].to(torch.bfloat16), rope)
    # a strided (non-contiguous) view gives the same answer
    big = torch.zeros(n, 672, dtype=torch.uint8)
    big[:, :656] = rows
    assert torch.equal(dequant(big[:, :656], True, out_dtype), ref)
    assert dequant(rows[:0], True).shape == (0, 576)


# -------------------------------------------------------------- bad input
@triton_ok
def test_quantize_rejects_bad_input(use_triton):
    k = TRITON if use_triton else TORCH
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        F.quantize_fp8_ds_mla(torch.zeros(2, 576, dtype=torch.float16), kernels=k)
    with pytest.raises(ValueError, match=r"\[N, 576\]"):
        F.quantize_fp8_ds_mla(torch.zeros(2, 512), kernels=k)
    with pytest.raises(ValueError, match=r"\[N, 576\]"):
        F.quantize_fp8_ds_mla(torch.zeros(576), kernels=k)
    bad = torch.zeros(2, 576)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        F.quantize_fp8_ds_mla(bad, kernels=k)
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        F.quantize_fp8_ds_mla(bad, kernels=k)
    with pytest.raises(TypeError, match="torch.Tensor"):
        F.quantize_fp8_ds_mla([[0.0] * 576], kernels=k)


def test_dequantize_and_views_reject_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        F.dequantize_fp8_ds_mla(torch.zeros(2, 656, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[N, 656\]"):
        F.dequantize_fp8_ds_mla(torch.zeros(2, 655, dtype=torch.uint8))
    with pytest.raises(TypeError, match="out_dtype"):
        F.dequantize_fp8_ds_mla(torch.zeros(2, 656, dtype=torch.uint8), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="kernels must be one of"):
        F.dequantize_fp8_ds_mla(torch.zeros(2, 656, dtype=torch.uint8), kernels="yes")
    with pytest.raises(TypeError, match="use_triton"):  # the old spelling is gone
        F.quantize_fp8_ds_mla(torch.zeros(2, 576), use_triton=True)
    with pytest.raises(TypeError, match="bfloat16"):
        F.bf16_rows_to_bytes(torch.zeros(2, 576))
    with pytest.raises(ValueError, match=r"\[N, 1152\]"):
        F.bytes_to_bf16_rows(torch.zeros(2, 1150, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        F.bytes_to_bf16_rows(torch.zeros(2, 1152, dtype=torch.int16))


@pytest.mark.parametrize("use_triton", [False, True])
def test_values_near_float32_max_dequantise_finite(use_triton):
    """Found by the property test: 3.2965e38 needs scale 2^120, where x / scale rounds to
    the code 256 and 256 * 2^120 overflows. The top scale clamps codes to 240."""
    x = torch.zeros(2, 576)
    x[0, 0] = 3.2964854295465914e38
    x[0, 1] = -3.4e38
    x[1, 130] = 3.0e38  # below 240 * 2^120: rounds as usual
    rows = quant(x, use_triton)
    assert torch.equal(rows, F.quantize_fp8_ds_mla_reference(x))
    back = F.dequantize_fp8_ds_mla_reference(rows, out_dtype=torch.float32)
    assert torch.isfinite(back).all()
    assert (back[:, :512] - x[:, :512]).abs().le(x[:, :512].abs() * 2.0**-4).all()
