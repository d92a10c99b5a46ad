"""Launcher of the row-copy kernel: ``dst[dst_idx[i]] = src[src_idx[i]]``.

Used for miss staging (pinned host pool -> hot rows, read by the GPU over UVA; a
resolve's staging lists name host rows, ``copy_staged``) and works for any pair of CUDA tensors and pinned host tensors (device -> host,
device -> device). The kernel is ``hisparse.kernels.copy_rows``.

Which path runs:
  - src or dst on CUDA: the Triton kernel on that device's current stream. A CPU
    side must be pinned (page-locked and mapped; ``PinnedBuffer`` and
    ``pin_memory()`` both are); the index lists must be on the CUDA device.
  - both on CPU: the Triton interpreter (TRITON_INTERPRET=1); without it a
    ValueError (``copy_rows_reference`` is the torch path, chosen by the caller).

The launcher checks dtypes, shapes, devices, row alignment (16 bytes) and pinning
from metadata only: no device value is read, nothing is allocated, so a call can be
captured in a CUDA graph. Index values are checked by the kernel: an entry whose
source or destination index is -1 or out of range is skipped.
"""

from __future__ import annotations

import functools

import torch
import triton

from .._checks import check_int, check_tensor, device_type, interpreter_mode, sm_count
from ..device import is_pinned_host, on_device
from ..kernels.fast_launch import fast
from ..kernels.copy_rows import copy_rows_kernel, copy_staged_kernel

# Defaults of the launch shape; the staging benchmark sweeps them on the H200.
DEFAULT_ROWS_PER_PROGRAM = 4
DEFAULT_NUM_WARPS = 4
DEFAULT_PROGRAMS_PER_SM = 8


def _check_rows(name: str, x: object) -> None:
    x = check_tensor(name, x, dtype=torch.uint8, ndim=2)
    W = x.shape[1]
    if W % 16 != 0 or W == 0:
        raise ValueError(f"{name} rows are {W} bytes; copy_rows needs a positive multiple of 16")
    if x.shape[0] > 1 and x.stride(0) != W or x.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (strides ({W}, 1)), got {x.stride()}")
    if x.numel() and x.data_ptr() % 16 != 0:
        raise ValueError(f"{name} data pointer {x.data_ptr():#x} is not 16-byte aligned")


def _check_idx(name: str, x: object) -> None:
    x = check_tensor(name, x, dtype=torch.int32, ndim=1)
    if x.numel() > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got strides {x.stride()}")


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
              *, rows_per_program: int | None = None, num_warps: int | None = None,
              programs_per_sm: int | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for every i whose two indices are valid.

    src: uint8 [Ns, W]; dst: uint8 [Nd, W] (W a multiple of 16, rows contiguous,
    16-byte aligned); src_idx/dst_idx: int32 [N], -1 (or out of range) = skip.
    The keyword arguments tune the launch (defaults: ``DEFAULT_*``).
    """
    _check_rows("src", src)
    _check_rows("dst", dst)
    _check_idx("src_idx", src_idx)
    _check_idx("dst_idx", dst_idx)
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"row widths differ: src {src.shape[1]} bytes, dst {dst.shape[1]} bytes")
    if src_idx.shape[0] != dst_idx.shape[0]:
        raise ValueError(f"index lists differ in length: src_idx {src_idx.shape[0]}, "
                         f"dst_idx {dst_idx.shape[0]}")
    rows = DEFAULT_ROWS_PER_PROGRAM if rows_per_program is None else rows_per_program
    warps = DEFAULT_NUM_WARPS if num_warps is None else num_warps
    per_sm = DEFAULT_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    for name, v in (("rows_per_program", rows), ("num_warps", warps)):
        if check_int(name, v, 1) & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 1, got {v!r}")
    check_int("programs_per_sm", per_sm, 1)

    cuda_devs = {t.device for t in (src, dst) if device_type(t.device) == "cuda"}
    if len(cuda_devs) > 1:
        raise ValueError(f"src and dst are on different CUDA devices: {sorted(map(str, cuda_devs))}")
    if cuda_devs:
        dev = next(iter(cuda_devs))
        # is_pinned() asks the driver about the pointer; skipped while a graph is being
        # captured (the eager warm-up call before capture has checked the same buffers)
        capturing = torch.cuda.is_current_stream_capturing()
        for name, t in (("src", src), ("dst", dst)):
            if device_type(t.device) == "cpu" and t.numel() and not capturing and not is_pinned_host(t):
                raise ValueError(f"{name} is a CPU tensor that is not pinned; the kernel on {dev} "
                                 "can only reach page-locked host memory (use PinnedBuffer)")
        for name, t in (("src_idx", src_idx), ("dst_idx", dst_idx)):
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device}; it must be on {dev}, where the kernel runs")
    else:
        dev = None
        for name, t in (("src_idx", src_idx), ("dst_idx", dst_idx)):
            if device_type(t.device) != "cpu":
                raise ValueError(f"{name} is on {t.device} but src and dst are on the CPU")

    N = src_idx.shape[0]
    if N == 0 or src.shape[0] == 0 or dst.shape[0] == 0:
        return
    if dev is None and not interpreter_mode():
        raise ValueError("copy_rows on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1); "
                         "use hisparse.cache.resolve_ref.copy_rows_reference on CPU")

    copy_rows_unchecked(src, src_idx, dst, dst_idx, dev, rows=rows, num_warps=warps, programs_per_sm=per_sm)


@functools.lru_cache(maxsize=None)
def row_words(row_bytes: int) -> tuple[int, int]:
    """(int32 words per row, the next power of two) of a row width."""
    ww = row_bytes // 4
    return ww, triton.next_power_of_2(ww)


def copy_rows_unchecked(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
                      dev: torch.device | None, *, rows: int = DEFAULT_ROWS_PER_PROGRAM,
                      num_warps: int = DEFAULT_NUM_WARPS, programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM) -> None:
    """``copy_rows`` without its checks, for callers that made them already (or own
    every argument: the cache's host mirror). ``dev``: the CUDA device the kernel runs
    on, None in the interpreter. Empty lists or tables launch nothing."""
    N = src_idx.shape[0]
    if N == 0 or src.shape[0] == 0 or dst.shape[0] == 0:
        return
    WW, WB = row_words(src.shape[1])
    chunks = -(-N // rows)
    if dev is None:
        grid = min(chunks, 3)  # interpreter: a few programs, still exercising the loop
    else:
        grid = min(chunks, programs_per_sm * sm_count(dev))
    with on_device(dev):
        fast(copy_rows_kernel)[(grid,)](
            src.view(torch.int32), src_idx, src.shape[0],
            dst.view(torch.int32), dst_idx, dst.shape[0], N, grid, chunks,
            WW=WW, WB=WB, ROWS=rows, num_warps=num_warps,
        )


def copy_staged(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
                counts: torch.Tensor, *, K: int, programs: int | None = None, rows_per_program: int = 8,
                num_warps: int = 4) -> None:
    """A resolve's staging: for each group t, ``dst[dst_idx[t*K + j]] = src[src_idx[t*K + j]]``
    for j < counts[t] (at most (T - t) * K; an entry with a -1 or out-of-range index is
    skipped). ``src_idx`` holds host rows (a resolve's ``stage_src``).

    src: uint8 [Ns, W] (pinned host, or device); dst: uint8 [Nd, W]; src_idx / dst_idx:
    int32 [T * K]; counts: int32 [T]. ``programs``: size of the persistent grid (default
    a quarter of the SMs: the staging runs beside attention, which needs the rest).
    No device value is read on the host; graph capturable.
    """
    _check_rows("src", src)
    _check_rows("dst", dst)
    _check_idx("src_idx", src_idx)
    _check_idx("dst_idx", dst_idx)
    _check_idx("counts", counts)
    T = counts.shape[0]
    check_int("K", K, 0)
    if src_idx.shape[0] < T * K or dst_idx.shape[0] < T * K:
        raise ValueError(f"index lists hold {src_idx.shape[0]} / {dst_idx.shape[0]} entries, need T*K = {T * K}")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"row widths differ: src {src.shape[1]} bytes, dst {dst.shape[1]} bytes")
    for name, v in (("rows_per_program", rows_per_program), ("num_warps", num_warps)):
        if check_int(name, v, 1) & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 1, got {v!r}")
    dev = next((t.device for t in (src, dst) if device_type(t.device) == "cuda"), None)
    if dev is None and not interpreter_mode():
        raise ValueError("copy_staged on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if dev is not None:
        capturing = torch.cuda.is_current_stream_capturing()
        for name, t in (("src", src), ("dst", dst)):
            if device_type(t.device) == "cpu" and t.numel() and not capturing and not is_pinned_host(t):
                raise ValueError(f"{name} is a CPU tensor that is not pinned; the kernel on {dev} "
                                 "can only reach page-locked host memory (use PinnedBuffer)")
    if programs is not None:
        check_int("programs", programs, 1)
    copy_staged_unchecked(src, src_idx, dst, dst_idx, counts, dev, K=K, programs=programs,
                        rows_per_program=rows_per_program, num_warps=num_warps)


_COUNT_BLOCK = 128  # groups whose counts copy_staged_kernel reads as one vector


def copy_staged_unchecked(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
                        counts: torch.Tensor, dev: torch.device | None, *, K: int, programs: int | None = None,
                        rows_per_program: int = 8, num_warps: int = 4) -> None:
    """``copy_staged`` without its checks (see ``copy_rows_unchecked``)."""
    T = counts.shape[0]
    if T == 0 or K == 0 or src.shape[0] == 0 or dst.shape[0] == 0:
        return
    if programs is None:
        programs = max(1, sm_count(dev) // 4) if dev is not None else 2
    WW, WB = row_words(src.shape[1])
    with on_device(dev):
        fast(copy_staged_kernel)[(programs,)](
            src.view(torch.int32), src_idx, src.shape[0], dst.view(torch.int32), dst_idx, dst.shape[0],
            counts, T, K, programs, WW=WW, WB=WB, ROWS=rows_per_program, TB=_COUNT_BLOCK,
            num_warps=num_warps)


__all__ = ["copy_rows", "copy_rows_unchecked", "copy_staged", "DEFAULT_ROWS_PER_PROGRAM", "DEFAULT_NUM_WARPS",
           "DEFAULT_PROGRAMS_PER_SM"]
