"""A device-to-device copy on the current CUDA stream, issued through the CUDA driver.

``torch.Tensor.copy_`` between two contiguous CUDA tensors ends in one
``cudaMemcpyAsync``, after the dispatcher, TensorIterator and their checks: 6-9 us of
host time on the H200 test machine. :class:`DriverCopy` issues the same copy with
``cuMemcpyDtoDAsync`` through ctypes, a microsecond or two. The per-layer graphs
(``hisparse.engine.layer_graphs``) copy each call's input into a static buffer with it.

Only the plain case goes through the driver: the same shape and dtype (checked by the
caller), the source contiguous, on the destination's device and not overlapping it.
Anything else is an ordinary ``copy_`` (which handles strides and devices). A driver
error raises RuntimeError naming the CUresult.
"""

from __future__ import annotations

import ctypes

import torch


class DriverCopy:
    """``copy(dst, src)``: dst.copy_(src) on the current stream of dst's device (dst a
    contiguous CUDA tensor of src's shape and dtype)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemcpyDtoDAsync_v2
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._memcpy = fn
        self._stream = torch._C._cuda_getCurrentRawStream  # device index -> cudaStream_t (int)

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        d, s = dst.data_ptr(), src.data_ptr()
        n = dst.numel() * dst.element_size()
        if src.get_device() != self.index or not src.is_contiguous() or (s < d + n and d < s + n):
            dst.copy_(src)
            return
        rc = self._memcpy(d, s, n, self._stream(self.index))
        if rc:
            raise RuntimeError(f"cuMemcpyDtoDAsync failed with CUresult {rc} copying {n} bytes into a "
                               "per-layer graph's input buffer")


__all__ = ["DriverCopy"]
