"""Checks shared by every public call, and the few facts about the runtime read once.

- Argument checks: ``check_int`` (``plain_ints``: a whole sequence that needs none),
  ``check_bool``, ``check_tensor``, ``same_device``
  (``device_type``: a device's type, memoised).
  Caller mistakes raise ``TypeError`` (wrong kind of thing) or ``ValueError`` (right
  kind, wrong value), naming what was expected and what came. They look at Python
  values and tensor metadata only: no host sync, no allocation.
- ``interpreter_mode()``: whether Triton runs kernels in its CPU interpreter
  (``TRITON_INTERPRET=1``). Triton decides this when a kernel module is imported, so
  it is read once, here, and nowhere else.
- ``sm_count(device)``: streaming multiprocessors of a CUDA device (cached).
- ``Kernels``: the one spelling of "torch reference or Triton kernel" (``kernels=``
  in every public signature) and the rule that picks one for a device.
"""

from __future__ import annotations

import enum
import functools
import os
from typing import Iterable

import torch


# ----------------------------------------------------------------- scalars
def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, *,
              error: type[Exception] | None = None) -> int:
    """``value`` must be a Python int (bool rejected) with ``lo <= value < hi``.

    ``lo``/``hi`` of None leave that side open. A non-int raises TypeError, an int out
    of range ValueError; ``error`` names one type for both (an API whose contract says
    ValueError for any bad value). Returns ``value``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise (error or TypeError)(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    bad = error or ValueError
    if hi is not None and lo is not None and not lo <= value < hi:
        raise bad(f"{name}={value} is out of range [{lo}, {hi})")
    if lo is not None and value < lo:
        raise bad(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value >= hi:
        raise bad(f"{name} must be < {hi}, got {value}")
    return value


def plain_ints(values: tuple | list, lo: int, hi: int | None) -> bool:
    """Whether every value is a plain int (not a bool or another subclass) in
    ``[lo, hi)`` (``hi`` None: no upper bound): what ``check_int`` accepts, told for a
    whole sequence at once (a False says only that one of them needs checking)."""
    if values and set(map(type, values)) != {int}:
        return False
    return not values or (min(values) >= lo and (hi is None or max(values) < hi))


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a bool (0/1 ints rejected: a flag passed positionally by mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_ints(name: str, values: object, lo: int | None = None, hi: int | None = None, *,
               error: type[Exception] | None = None) -> list[int]:
    """A list/tuple/range of ints, each checked by :func:`check_int`; returns a list."""
    if not isinstance(values, (list, tuple, range)):
        raise (error or TypeError)(f"{name} must be a list of ints, got {type(values).__name__}")
    return [check_int(f"{name}[{i}]", v, lo, hi, error=error) for i, v in enumerate(values)]


# ----------------------------------------------------------------- tensors
_DEVICE_TYPES: dict[torch.device, str] = {}


def device_type(device: torch.device) -> str:
    """``device.type``, memoised per device: torch builds that string anew on each access
    (about 0.6 us), longer than the rest of a tensor check takes."""
    got = _DEVICE_TYPES.get(device)
    if got is None:
        got = _DEVICE_TYPES[device] = device.type
    return got


def same_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (a CUDA device without index matches any index)."""
    td = t.device
    if td == device:
        return True
    kind = device_type(device)
    if device_type(td) != kind:
        return False
    return kind != "cuda" or device.index is None or td.index == device.index


def check_tensor(name: str, t: object, *, dtype: torch.dtype | Iterable[torch.dtype] | None = None,
                 ndim: int | None = None, shape: tuple[int | None, ...] | None = None,
                 device: torch.device | None = None, contiguous: bool = False) -> torch.Tensor:
    """Type, dtype, rank, shape (None = any size in that dimension), device and layout
    of a tensor argument, from metadata only. Returns ``t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype is not dtype:  # dtypes are singletons
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for want_n, got_n in zip(shape, t.shape):
            if want_n is not None and want_n != got_n:
                want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(f"{name} must have shape {want_s}, got {list(t.shape)}")
    if device is not None and not same_device(t, device):
        raise ValueError(f"{name} is on {t.device}, expected {device}; move it there first")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t


def rows_layout_problem(rows: torch.Tensor, row_bytes: int) -> str | None:
    """Why ``rows`` (uint8 [n, row_bytes]) can't be read as packed 32-bit words by a
    kernel, or None when it can: rows contiguous (strides (row_bytes, 1)) and the data
    pointer 16-byte aligned (row_bytes is a multiple of 16, so every row is)."""
    n = rows.shape[0]
    if rows.stride(1) != 1 or (n > 1 and rows.stride(0) != row_bytes):
        return f"strides {rows.stride()} (packed rows have ({row_bytes}, 1))"
    if n and rows.data_ptr() % 16:
        return (f"data pointer {rows.data_ptr():#x} (storage offset {rows.storage_offset()}) "
                "is not 16-byte aligned")
    return None


def pack_rows(rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``rows`` (uint8 [n, row_bytes]) as a packed, 16-byte aligned tensor (a copy
    only when it is not one already, ``rows_layout_problem``)."""
    if rows_layout_problem(rows, row_bytes) is None:
        return rows
    packed = torch.empty((rows.shape[0], row_bytes), dtype=torch.uint8, device=rows.device)
    packed.copy_(rows)
    return packed


# ----------------------------------------------------------------- runtime facts
@functools.lru_cache(maxsize=1)
def interpreter_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Read once: Triton fixes the mode of a kernel when its module is imported.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | int) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device)."""
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    return _sm_count(index)


def parse_enum(cls, value: object, name: str):
    """A member of the enum ``cls`` from the member itself or its value (a string), or a
    ValueError listing the valid values."""
    if isinstance(value, cls):
        return value
    for member in cls:
        if member.value == value:
            return member
    raise ValueError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}")


class Kernels(enum.Enum):
    """Which implementation runs a cache or format kernel (``kernels=`` everywhere).

    AUTO: Triton on CUDA, the torch reference on CPU. TORCH: the torch reference
    (the CPU path and the test oracle). TRITON: the Triton kernels; on a CPU device
    they need the interpreter (``TRITON_INTERPRET=1`` before hisparse is imported).
    """

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"

    @classmethod
    def parse(cls, value: "Kernels | str", name: str = "kernels") -> "Kernels":
        return parse_enum(cls, value, name)

    def pick(self, device: torch.device) -> "Kernels":
        """TORCH or TRITON for ``device``; a Triton choice that can't run raises here,
        before anything is allocated or launched (never a silent fallback)."""
        if self is Kernels.TORCH or (self is Kernels.AUTO and device.type != "cuda"):
            return Kernels.TORCH
        if device.type != "cuda" and not interpreter_mode():
            raise ValueError(
                "kernels='triton' on a CPU device needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 before starting Python (slow; for tests), or use "
                "kernels='torch' / 'auto' (the torch reference) on a machine without a GPU")
        return Kernels.TRITON


__all__ = ["check_int", "check_bool", "check_ints", "check_tensor", "device_type", "same_device",
           "rows_layout_problem", "pack_rows", "interpreter_mode", "sm_count", "parse_enum", "Kernels"]
