"""Device helpers: pinned host memory that is really pinned, and streams/events
that degrade to no-ops on CPU.

Pinned memory: torch's caching host allocator (``pin_memory=True``) rounds every
allocation up to the next power of two (a 33 GiB pool would take 64 GiB). We
allocate ordinary page-aligned memory with ``torch.empty`` (large allocations are
mmap-backed, so exactly the asked bytes are committed) and register it with
``cudaHostRegister``; the registration is undone when the owning object dies.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def resolve_device(device: str) -> torch.device:
    """Parse a config device string; 'cuda' means the current CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} asked for CUDA but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); use device='cpu' on a machine without a GPU"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}; expected 'cpu' or 'cuda[:N]'")
    return dev


class PinnedBuffer:
    """A host tensor of exactly ``nbytes`` bytes, page-locked when CUDA is present.

    ``tensor``: uint8 [nbytes], CPU. ``pinned`` says whether cudaHostRegister
    succeeded (always False on a machine without CUDA, where plain memory stands in).
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"PinnedBuffer needs nbytes > 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8)
        want = torch.cuda.is_available() if pin is None else pin
        self.pinned = False
        if want:
            if not torch.cuda.is_available():
                raise ValueError("pin=True needs CUDA, which is not available here")
            cudart = torch.cuda.cudart()
            # flags 0 = cudaHostRegisterDefault; portable/mapped come with UVA anyway
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {self.nbytes} bytes failed with error {int(err)}; "
                    "the machine may limit locked memory (ulimit -l) or lack free RAM"
                )
            self.pinned = True
            ptr = self.tensor.data_ptr()
            _REGISTERED[ptr] = self.nbytes
            self._finalizer = weakref.finalize(self, _unregister, ptr)

    def release(self) -> None:
        """Unregister now (the tensor must not be used by the GPU afterwards)."""
        if self.pinned:
            self._finalizer()
            self.pinned = False


# start pointer -> bytes of every live PinnedBuffer registration
_REGISTERED: dict[int, int] = {}


def is_pinned_host(t: torch.Tensor) -> bool:
    """Whether the CPU tensor ``t`` lies in page-locked memory the GPU can reach.

    Checks the ranges this process registered (PinnedBuffer) first, then asks the
    driver (``Tensor.is_pinned``). The first check matters under tools that wrap the
    CUDA runtime (compute-sanitizer answers the pointer query differently).
    """
    if t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    for base, n in _REGISTERED.items():
        if base <= start and end <= base + n:
            return True
    return bool(t.is_pinned())


def _unregister(ptr: int) -> None:
    _REGISTERED.pop(ptr, None)
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except RuntimeError:  # interpreter shutdown with the CUDA context gone
        pass


class Streams:
    """The cache's streams. On CPU every stream is None and every call a no-op.

    - ``stage``: resolve + miss staging (host -> hot buffer)
    - ``backup``: mirroring newly written rows device -> host pool
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stage = torch.cuda.Stream(device=device)
            self.backup = torch.cuda.Stream(device=device)
        else:
            self.stage = None
            self.backup = None

    def current(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def new_event(self):
        return torch.cuda.Event() if self.cuda else None

    @contextlib.contextmanager
    def on(self, stream) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield


def wait_event(stream, event) -> None:
    """``stream`` waits on ``event``; no-op for CPU (None)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


__all__ = ["PinnedBuffer", "Streams", "is_cuda", "is_pinned_host", "resolve_device", "wait_event"]
