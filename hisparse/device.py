"""Device helpers: pinned host memory that is really pinned, and streams/events
that degrade to no-ops on CPU.

Pinned memory: torch's caching host allocator (``pin_memory=True``) rounds every
allocation up to the next power of two (a 33 GiB pool would take 64 GiB). We map
exactly the asked bytes (an anonymous page-aligned mapping) and register them with
``cudaHostRegister``; the registration is undone when the last tensor viewing the
mapping is gone.

A registration may only be undone outside CUDA graph capture: ``cudaHostUnregister``
while the current stream is being captured invalidates the capture (and garbage
collection can free a pool at any moment, captures included: ``torch.cuda.graph`` does
not collect before capturing). Such a release is deferred, the memory still mapped
and registered, until a later pin or unpin on the main thread, the next
``prepare_for_batch``, or :func:`release_deferred_pins`, outside a capture. A release in a
thread other than the main one is deferred too: a capture in global mode (torch's
default) is invalidated by such a call from any thread, and only the calling thread's
capture can be seen. So run a forward's captures on the thread that prepares its
forwards (``prepare_for_batch`` releases on that thread).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import warnings
import weakref

import numpy as np
import torch

from ._checks import device_type, interpreter_mode  # interpreter_mode re-exported: whether Triton runs under its CPU interpreter
from .errors import CapacityError


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where the file does not exist)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_bytes(nbytes: int, what: str,
                     hint: str = "use a smaller host pool (fewer tokens, layers or requests)") -> None:
    """CapacityError when ``nbytes`` of host memory are more than the machine has free;
    ``hint`` says what would need less."""
    free = available_host_bytes()
    if free is not None and nbytes > free:
        raise CapacityError(f"{what} needs {nbytes / 2**30:.2f} GiB ({nbytes} bytes) of host memory but "
                            f"only {free / 2**30:.2f} GiB are available; {hint}")


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

    The memory is an anonymous mapping (page-aligned; only the pages of ``nbytes`` are
    committed) that ``tensor``'s storage keeps alive, and the registration lives as long
    as the mapping: a tensor (or view) that outlives this object stays valid and pinned.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"PinnedBuffer needs nbytes > 0, got {nbytes}")
        self.nbytes = int(nbytes)
        want = torch.cuda.is_available() if pin is None else pin
        if want and not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA, which is not available here")
        check_host_bytes(self.nbytes, "the pinned host buffer")
        try:
            mapping = mmap.mmap(-1, self.nbytes)
        except (OSError, OverflowError) as e:
            raise CapacityError(f"could not map {self.nbytes} bytes of host memory for the pinned "
                                f"buffer ({e}); use a smaller host pool") from e
        # the tensor's storage holds ``owner``, which holds the mapping: when the last view
        # is gone ``owner`` dies, and the finalizer (which holds the mapping too) undoes the
        # registration, or keeps the mapping alive until a capture has ended
        owner = np.frombuffer(mapping, dtype=np.uint8)
        self.tensor = torch.from_numpy(owner)
        self.pinned = False
        self._finalizer = None
        if want:
            ptr = self.tensor.data_ptr()
            pin_host_range(ptr, self.nbytes)
            self.pinned = True
            self._finalizer = weakref.finalize(owner, unpin_host_range, ptr, mapping)

    def release(self) -> None:
        """Unregister now, or at the next safe point under a capture or off the main
        thread (module docstring); the tensor must not be used by the GPU afterwards."""
        if self.pinned and self._finalizer is not None:
            self._finalizer()
            self.pinned = False


# start pointer -> bytes of every live registration made through pin_host_range
_REGISTERED: dict[int, int] = {}
# start pointer -> what keeps the memory mapped, for each release waiting for a capture's end
_DEFERRED: dict[int, object] = {}


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a graph."""
    try:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 -- interpreter shutdown with the CUDA context gone
        return False


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def pin_host_range(ptr: int, nbytes: int) -> None:
    """cudaHostRegister ``nbytes`` at ``ptr`` and remember the range (see is_pinned_host)."""
    if _main_thread():
        release_deferred_pins()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # 0 = cudaHostRegisterDefault
    if int(err) != 0:
        raise CapacityError(
            f"cudaHostRegister of {nbytes} bytes failed with error {int(err)}; "
            "the machine may limit locked memory (ulimit -l) or lack free RAM"
        )
    _REGISTERED[ptr] = nbytes


def unpin_host_range(ptr: int, keepalive: object = None) -> None:
    """Undo :func:`pin_host_range` (no-op if already undone). Under a graph capture, or
    outside the main thread, the release is deferred (see the module's docstring) and
    ``keepalive``, which keeps the memory mapped, is held until then."""
    if ptr not in _REGISTERED or ptr in _DEFERRED:
        return
    if _capturing() or not _main_thread():
        _DEFERRED[ptr] = keepalive
        return
    _unregister(ptr)
    release_deferred_pins()


def release_deferred_pins() -> int:
    """Undo the registrations whose release was deferred (module docstring), on the
    calling thread; nothing while its stream is being captured. Returns how many were
    undone. Re-entrant: a release that garbage collection starts inside it (another
    pool freed) or another thread's call takes its own entries."""
    if not _DEFERRED or _capturing():
        return 0
    done = 0
    while True:
        try:
            ptr, keep = _DEFERRED.popitem()
        except KeyError:  # empty (here, or emptied by a call nested in this one)
            return done
        _unregister(ptr)
        del keep  # the mapping may go now
        done += 1


def _unregister(ptr: int) -> None:
    nbytes = _REGISTERED.pop(ptr, None)
    if nbytes is None:
        return
    try:
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except RuntimeError:  # interpreter shutdown with the CUDA context gone
        return
    if err != 0:
        warnings.warn(f"cudaHostUnregister of {nbytes} pinned bytes at {ptr:#x} failed with error {err}",
                      RuntimeWarning, stacklevel=2)


def is_pinned_host(t: torch.Tensor) -> bool:
    """Whether the CPU tensor ``t`` lies in page-locked memory the GPU can reach.

    Checks the ranges registered through :func:`pin_host_range` first, then asks the
    driver (``Tensor.is_pinned``, which looks at the storage's base pointer only, and
    which tools wrapping the CUDA runtime, like compute-sanitizer, answer differently).
    """
    if t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    for base, n in _REGISTERED.items():
        if base <= start and end <= base + n:
            return True
    return bool(t.is_pinned())


class Streams:
    """The cache's streams. On CPU every stream is None and every call a no-op.

    - ``stage``: resolve + miss staging (host -> hot buffer)
    - ``backup``: mirroring newly written rows device -> host pool
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            # staging runs beside attention: its kernels' blocks go first when SMs free up
            self.stage = torch.cuda.Stream(device=device, priority=-1)
            self.backup = torch.cuda.Stream(device=device)
        else:
            self.stage = None
            self.backup = None

    def current(self):
        return torch.cuda.current_stream(self.device.index) if self.cuda else None

    def new_event(self):
        return torch.cuda.Event() if self.cuda else None

    def on(self, stream):
        """A context in which ``stream`` is the current stream (nothing on CPU)."""
        if stream is None:
            return _NO_CONTEXT
        if stream.device_index == torch.cuda.current_device():
            return _OnStream(stream)
        return torch.cuda.stream(stream)  # also switches the current device, and back


_NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every caller


class _OnStream:
    """``torch.cuda.stream(stream)`` for a stream of the current device, without its
    per-use device lookups: makes ``stream`` current and restores the previous one."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.prev = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)


def on_device(device: torch.device | None):
    """A context in which ``device`` (a CUDA device with an index, or None for CPU) is
    the current device: nothing to do when it already is (the common case; a launch
    then needs no device switch)."""
    if device is None or device.index == torch.cuda.current_device():
        return _NO_CONTEXT
    return torch.cuda.device(device)


def device_ints(values: list[int] | np.ndarray, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``dtype`` [len(values)] on ``device``. On CUDA through pinned memory with one
    non-blocking copy on the current stream: the host does not wait for the stream's
    earlier work (a copy from pageable memory would), so a step can be prepared while the
    last one runs; the values are there for work that stream runs after the copy.
    ``values``: a list of ints, or a 1-d numpy array of that dtype (taken as it is)."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
        if host.dtype is not dtype or values.ndim != 1:
            raise ValueError(f"device_ints: a numpy array must be 1-d of {dtype}, got {host.dtype} "
                             f"{tuple(host.shape)}")
    else:
        host = torch.tensor(values, dtype=dtype)
    kind = (device if isinstance(device, torch.device) else torch.device(device)).type
    if kind == "cpu":
        return host
    if kind != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def wait_event(stream, event) -> None:
    """``stream`` waits on ``event``; no-op for CPU (None)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of ``device``'s type is being captured into a graph
    (False on CPU)."""
    return device_type(device) == "cuda" and torch.cuda.is_current_stream_capturing()


__all__ = ["PinnedBuffer", "Streams", "available_host_bytes", "capturing", "check_host_bytes", "device_ints", "interpreter_mode",
           "is_cuda", "is_pinned_host", "on_device", "pin_host_range", "release_deferred_pins", "resolve_device",
           "unpin_host_range", "wait_event"]
