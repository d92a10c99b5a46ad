"""Triton bodies of the fp8_ds_mla row quantizer / dequantizer (launchers: ``hisparse.formats``).

Row layout (656 bytes; pinned by ``tests/test_formats.py``):
  bytes   0..511  512 e4m3 values (the latent / NoPE part), element j in tile j // 128
  bytes 512..527  4 float32 scales (little endian), scale i covers elements 128i..128i+127
  bytes 528..655  64 bf16 RoPE values, not quantized

Conversions are done with integer bit arithmetic rather than Triton's float casts:
the Triton interpreter (CPU tests) truncates fp32 -> bf16 and mis-rounds fp32 -> e4m3,
so the casts would give different bytes on CPU and GPU. The bit arithmetic is exact
round-to-nearest-even on both and matches torch byte for byte.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2_scale_exponent(amax):
    """Biased fp32 exponent k of the tile scale 2^(k-127) = 2^ceil(log2(max(amax/448, 1e-4))).

    amax: float32 tensor, finite, >= 0. 448 = 1.75 * 2^8, so for amax = 1.f * 2^(e-127)
    the exact ceil is e - 127 - 8 + (1.f > 1.75); the 1e-4 floor is 2^-13 (biased 114).
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = bits >> 23
    m = bits & 0x7FFFFF
    k = e - 8 + (m > 0x600000).to(tl.int32)
    return tl.maximum(k, 114)


@triton.jit
def f32_to_e4m3_bits(y):
    """Round float32 ``y`` (finite, |y| <= 448) to e4m3fn, nearest-even; return the uint8 code."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    eb = a >> 23
    # normal e4m3 range (|y| >= 2^-6): round the fp32 mantissa to 3 bits (carry may bump e)
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = tl.minimum((((r >> 23) - 120) << 3) | ((r >> 20) & 7), 0x7E)
    # subnormal e4m3 (|y| < 2^-6): code = round_half_even(|y| * 2^9), from the integer mantissa
    mant = tl.where(eb > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    s = tl.minimum(141 - tl.maximum(eb, 1), 30)  # right shift taking mant * 2^(E-23) to units of 2^-9
    q = mant >> s
    rem = mant & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(eb >= 121, normal, q)  # 121 = biased fp32 exponent of 2^-6
    return (code | sign).to(tl.uint8)


@triton.jit
def f32_to_bf16_bits(x):
    """Round float32 ``x`` (finite) to bf16, nearest-even; return the int16 bit pattern."""
    bits = x.to(tl.int32, bitcast=True)
    r = bits + 0x7FFF + ((bits >> 16) & 1)
    return (r >> 16).to(tl.int16)


@triton.jit
def quantize_fp8_ds_mla_kernel(
    x_ptr,  # bf16 or float32 [N, 576], last-dim stride 1
    out_ptr,  # uint8 [N, 656] (row stride out_stride, 4-byte aligned rows)
    x_stride,  # elements between rows of x
    out_stride,  # bytes between rows of out
    X_IS_BF16: tl.constexpr,
):
    """One program per row: 4 tile scales, 512 e4m3 codes, 64 bf16 RoPE values."""
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, 4)
    cols = tl.arange(0, 128)
    offs = tiles[:, None] * 128 + cols[None, :]  # [4, 128] element index 0..511
    x = tl.load(x_ptr + row * x_stride + offs).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [4]
    k = pow2_scale_exponent(amax)
    scale = (k << 23).to(tl.float32, bitcast=True)
    inv = ((254 - k) << 23).to(tl.float32, bitcast=True)  # exact 1 / scale
    # at scale 2^120 (k = 247) codes >= 256 would dequantise to inf: clamp to 240
    lim = tl.where(k == 247, 240.0, 448.0)[:, None]
    codes = f32_to_e4m3_bits(tl.minimum(tl.maximum(x * inv[:, None], -lim), lim))
    orow = out_ptr + row * out_stride
    tl.store(orow + offs, codes)
    tl.store((orow + 512).to(tl.pointer_type(tl.float32)) + tiles, scale)
    r = tl.arange(0, 64)
    rope_dst = (orow + 528).to(tl.pointer_type(tl.int16)) + r
    if X_IS_BF16:
        rope = tl.load((x_ptr + row * x_stride + 512 + r).to(tl.pointer_type(tl.int16)))
        tl.store(rope_dst, rope)
    else:
        rope = tl.load(x_ptr + row * x_stride + 512 + r)
        tl.store(rope_dst, f32_to_bf16_bits(rope))


@triton.jit
def dequantize_fp8_ds_mla_kernel(
    rows_ptr,  # uint8 [N, 656] (row stride rows_stride, 4-byte aligned rows)
    out_ptr,  # bf16 or float32 [N, 576], last-dim stride 1
    rows_stride,  # bytes between rows
    out_stride,  # elements between rows of out
):
    """One program per row: x = float(e4m3) * scale[tile]; RoPE copied (both exact)."""
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, 4)
    offs = tiles[:, None] * 128 + tl.arange(0, 128)[None, :]
    src = rows_ptr + row * rows_stride
    codes = tl.load(src + offs).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = tl.load((src + 512).to(tl.pointer_type(tl.float32)) + tiles)
    dst = out_ptr + row * out_stride
    tl.store(dst + offs, (codes * scale[:, None]).to(out_ptr.dtype.element_ty))
    r = tl.arange(0, 64)
    rope = tl.load((src + 528).to(tl.pointer_type(tl.bfloat16)) + r)
    tl.store(dst + 512 + r, rope.to(out_ptr.dtype.element_ty))
