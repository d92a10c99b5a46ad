"""Row formats: bf16 (1152 bytes) and fp8_ds_mla (656 bytes), references and launchers.

``bf16`` row: 576 bf16 values, 512 latent (NoPE) then 64 RoPE -> 1152 bytes.

``fp8_ds_mla`` row (656 bytes, little endian):
  ======  =========  ===================================================
  bytes   what       notes
  ======  =========  ===================================================
  0-511   512 e4m3   latent element j is in tile j // 128
  512-527 4 float32  scale i covers latent elements 128i .. 128i+127
  528-655 64 bf16    RoPE values, not quantized
  ======  =========  ===================================================

Dequantize: ``x = float(e4m3) * scale[tile]``. Quantize: ``scale =
2^ceil(log2(max(amax / 448, 1e-4)))`` per tile (a power of two, so the SM90 FlashMLA
kernel, which rounds scales to bf16, reads the same value; 1e-4 floors it at 2^-13,
so an all-zero tile gives scale 2^-13 and zero codes, never inf/NaN), then
``e4m3 = round_nearest_even(x / scale)`` (|x / scale| <= 448 by construction). One
exception keeps dequantisation finite: at the largest scale a float32 tile can need,
2^120, a value within 6% of the float32 maximum would round to the code 256 and
256 * 2^120 = 2^128 overflows, so there ``x / scale`` is first clamped to +-240 (the
largest e4m3 below 256; relative error under 2^-4).

Every function has a torch reference (``*_reference``: the CPU path and the test
oracle). ``kernels=`` (a ``hisparse._checks.Kernels`` or its value "auto" / "torch" /
"triton") picks the implementation: "auto" runs the Triton kernel on CUDA and the
reference on CPU; "triton" on a CPU tensor needs ``TRITON_INTERPRET=1``. The Triton
kernels match the references byte for byte.
"""

from __future__ import annotations

import enum

import torch

from ._checks import Kernels, check_tensor
from .device import on_device

D_LATENT = 512  # e4m3-quantized latent (NoPE) values per row
D_ROPE = 64  # bf16 RoPE values per row
D_ROW = D_LATENT + D_ROPE  # 576 values per row
TILE = 128  # latent values per scale
NUM_TILES = D_LATENT // TILE  # 4
SCALE_OFFSET = 512  # byte offset of the 4 float32 scales
ROPE_OFFSET = 528  # byte offset of the 64 bf16 RoPE values
FP8_ROW_BYTES = 656
BF16_ROW_BYTES = 2 * D_ROW  # 1152
FP8_MAX = 448.0  # largest finite e4m3fn value
TOP_SCALE = 2.0**120  # largest scale a finite float32 tile needs (448 * 2^120 > float32 max)
TOP_SCALE_CODE_MAX = 240.0  # largest e4m3 c with c * 2^120 finite
MIN_SCALE = 2.0**-13  # = 2^ceil(log2(1e-4))


class RowFormat(enum.Enum):
    """Byte format of one MLA latent row (one token, one layer)."""

    BF16 = "bf16"  # 576 bf16 values: 512 latent (NoPE) then 64 RoPE -> 1152 bytes
    FP8_DS_MLA = "fp8_ds_mla"  # 512 e4m3 + 4 fp32 scales + 64 bf16 RoPE -> 656 bytes

    @property
    def row_bytes(self) -> int:
        return BF16_ROW_BYTES if self is RowFormat.BF16 else FP8_ROW_BYTES

    @classmethod
    def parse(cls, value: object) -> "RowFormat":
        """The member itself, or the member whose value ``value`` is (ValueError otherwise)."""
        if isinstance(value, RowFormat):
            return value
        for f in cls:
            if f.value == value:
                return f
        raise ValueError(
            f"unknown row format {value!r}; expected one of {[f.value for f in cls]}"
        )


# ------------------------------------------------------------------ checks
def _check_values(x: object, *, validate: bool) -> torch.Tensor:
    check_tensor("x", x)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32 [N, {D_ROW}], got dtype {x.dtype}")
    if x.dim() != 2 or x.shape[1] != D_ROW:
        raise ValueError(f"x must be [N, {D_ROW}], got shape {tuple(x.shape)}")
    if validate and x.numel() > 0 and not bool(torch.isfinite(x).all()):
        raise ValueError("x must be finite (found inf or NaN); fp8_ds_mla cannot encode it")
    return x


def _check_rows(rows: object) -> torch.Tensor:
    check_tensor("rows", rows)
    if rows.dtype != torch.uint8:
        raise TypeError(f"rows must be uint8 [N, {FP8_ROW_BYTES}], got dtype {rows.dtype}")
    if rows.dim() != 2 or rows.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"rows must be [N, {FP8_ROW_BYTES}], got shape {tuple(rows.shape)}")
    return rows


def _check_out_dtype(out_dtype: object) -> torch.dtype:
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype!r}")
    return out_dtype


def _want_triton(device: torch.device, kernels: Kernels | str) -> bool:
    return Kernels.parse(kernels).pick(device) is Kernels.TRITON


# -------------------------------------------------------------- references
def pow2_scales_reference(amax: torch.Tensor) -> torch.Tensor:
    """float32 [...] per-tile amax (>= 0, finite) -> float32 power-of-two scales.

    Exact bit arithmetic (no log2 rounding): 448 = 1.75 * 2^8, so for amax = 1.f *
    2^E the scale is 2^(E - 8 + (1.f > 1.75)), floored at 2^-13.
    """
    bits = amax.float().contiguous().view(torch.int32)
    e = bits >> 23
    k = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    k = torch.clamp(k, min=114)
    return (k << 23).view(torch.float32)


def quantize_fp8_ds_mla_reference(x: torch.Tensor) -> torch.Tensor:
    """bf16/float32 [N, 576] -> uint8 [N, 656] fp8_ds_mla rows (torch oracle)."""
    x = _check_values(x, validate=True)
    N = x.shape[0]
    out = torch.empty((N, FP8_ROW_BYTES), dtype=torch.uint8, device=x.device)
    lat = x[:, :D_LATENT].float().reshape(N, NUM_TILES, TILE)
    scale = pow2_scales_reference(lat.abs().amax(dim=2) if N else lat.new_zeros((0, NUM_TILES)))
    inv = 1.0 / scale  # exact: powers of two
    lim = torch.where(scale == TOP_SCALE, TOP_SCALE_CODE_MAX, FP8_MAX)[:, :, None]
    y = torch.minimum(torch.maximum(lat * inv[:, :, None], -lim), lim)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, :D_LATENT] = codes.reshape(N, D_LATENT)
    out[:, SCALE_OFFSET:ROPE_OFFSET] = scale.contiguous().view(torch.uint8).reshape(N, 16)
    rope = x[:, D_LATENT:].to(torch.bfloat16).contiguous()
    out[:, ROPE_OFFSET:] = rope.view(torch.uint8).reshape(N, 2 * D_ROPE)
    return out


def dequantize_fp8_ds_mla_reference(rows: torch.Tensor, *,
                                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 [N, 656] -> ``out_dtype`` (bf16 or float32) [N, 576] (torch oracle).

    Both output dtypes are exact (e4m3 * power of two fits bf16).
    """
    rows = _check_rows(rows)
    out_dtype = _check_out_dtype(out_dtype)
    N = rows.shape[0]
    rows = rows.contiguous()
    codes = rows[:, :D_LATENT].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)  # [N, 4]
    lat = (codes.reshape(N, NUM_TILES, TILE) * scale[:, :, None]).reshape(N, D_LATENT)
    rope = rows[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([lat, rope], dim=1).to(out_dtype)


# -------------------------------------------------------------- public API
def quantize_fp8_ds_mla(x: torch.Tensor, *, kernels: Kernels | str = Kernels.AUTO,
                        validate: bool = True) -> torch.Tensor:
    """bf16/float32 [N, 576] -> uint8 [N, 656] fp8_ds_mla rows.

    ``kernels``: see the module docstring. ``validate`` checks that x is finite (a host
    sync); with ``validate=False`` non-finite input gives unspecified (but in-bounds)
    bytes.
    """
    x = _check_values(x, validate=validate)
    if not _want_triton(x.device, kernels):
        return quantize_fp8_ds_mla_reference(x)
    # imported here, not at the top: Triton is a Linux-only dependency, and the formats
    # (imported by ``import hisparse``) work without it through the torch references
    from .kernels.quant import quantize_fp8_ds_mla_kernel

    N = x.shape[0]
    out = torch.empty((N, FP8_ROW_BYTES), dtype=torch.uint8, device=x.device)
    if N == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    with on_device(x.device if x.device.type == "cuda" else None):
        quantize_fp8_ds_mla_kernel[(N,)](x, out, x.stride(0), out.stride(0),
                                          X_IS_BF16=x.dtype == torch.bfloat16, num_warps=4)
    return out


def dequantize_fp8_ds_mla(rows: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                          kernels: Kernels | str = Kernels.AUTO) -> torch.Tensor:
    """uint8 [N, 656] fp8_ds_mla rows -> ``out_dtype`` [N, 576] (bf16 default, or float32).

    ``kernels``: see the module docstring."""
    rows = _check_rows(rows)
    out_dtype = _check_out_dtype(out_dtype)
    if not _want_triton(rows.device, kernels):
        return dequantize_fp8_ds_mla_reference(rows, out_dtype=out_dtype)
    from .kernels.quant import dequantize_fp8_ds_mla_kernel  # Linux-only Triton: see above

    N = rows.shape[0]
    out = torch.empty((N, D_ROW), dtype=out_dtype, device=rows.device)
    if N == 0:
        return out
    if rows.stride(1) != 1 or rows.stride(0) % 4 != 0 or rows.data_ptr() % 4 != 0:
        rows = rows.contiguous()  # the kernel reads the float32 scales with 4-byte loads
    with on_device(rows.device if rows.device.type == "cuda" else None):
        dequantize_fp8_ds_mla_kernel[(N,)](rows, out, rows.stride(0), out.stride(0), num_warps=4)
    return out


def bf16_rows_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """bf16 [N, 576] -> uint8 [N, 1152] (the same bytes; a view when x is contiguous).

    A pure reinterpretation needs no kernel: the reference is the implementation.
    """
    check_tensor("x", x)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16 [N, {D_ROW}], got dtype {x.dtype}")
    if x.dim() != 2 or x.shape[1] != D_ROW:
        raise ValueError(f"x must be [N, {D_ROW}], got shape {tuple(x.shape)}")
    return x.contiguous().view(torch.uint8)


def bytes_to_bf16_rows(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 1152] -> bf16 [N, 576] (the same bytes; a view when b is contiguous)."""
    check_tensor("b", b)
    if b.dtype != torch.uint8:
        raise TypeError(f"b must be uint8 [N, {BF16_ROW_BYTES}], got dtype {b.dtype}")
    if b.dim() != 2 or b.shape[1] != BF16_ROW_BYTES:
        raise ValueError(f"b must be [N, {BF16_ROW_BYTES}], got shape {tuple(b.shape)}")
    if b.stride(1) != 1 or b.storage_offset() % 2 != 0 or (b.shape[0] > 1 and b.stride(0) % 2):
        b = b.contiguous()
    return b.view(torch.bfloat16)


# aliases named as in docs/DESIGN.md ("each has a torch reference (*_reference)")
bf16_rows_to_bytes_reference = bf16_rows_to_bytes
bytes_to_bf16_rows_reference = bytes_to_bf16_rows

__all__ = [
    "RowFormat", "D_LATENT", "D_ROPE", "D_ROW", "TILE", "NUM_TILES", "SCALE_OFFSET", "ROPE_OFFSET",
    "FP8_ROW_BYTES", "BF16_ROW_BYTES", "FP8_MAX", "MIN_SCALE", "pow2_scales_reference",
    "quantize_fp8_ds_mla_reference", "dequantize_fp8_ds_mla_reference", "quantize_fp8_ds_mla",
    "dequantize_fp8_ds_mla", "bf16_rows_to_bytes", "bytes_to_bf16_rows",
    "bf16_rows_to_bytes_reference", "bytes_to_bf16_rows_reference",
]
