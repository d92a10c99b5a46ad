"""Checks the tools run before any work starts: device, kernels, output paths, memory.

A run that would fail late (a missing GPU, an unwritable ``--record`` path, a pool
larger than the machine's memory) fails here instead, in one line, before anything
is allocated or computed:

- :func:`parse_device`: ``cpu`` / ``cuda`` / ``cuda:N``; CUDA asked for on a machine
  without it is a :class:`MissingDependency`, an unknown device a ``ValueError``.
- :func:`require_kernels`: ``--kernels triton`` on a CPU device needs Triton's CPU
  interpreter (``TRITON_INTERPRET=1`` in the environment before Python starts; it
  cannot be switched on later in the process): without it, a :class:`MissingDependency`
  saying so.
- :func:`check_output_file` / :func:`check_output_dir`: the path can be written
  (probed with a temporary file that is removed again; an existing file is opened
  for appending and left unchanged). A command checks its outputs through
  :class:`hisparse_tools.outputs.Outputs`, which adds what concerns them together
  (distinct paths, a FIFO's reader).
- :func:`path_arg`: the argparse type of every path flag; an empty string (``--out ""``,
  which the tools would otherwise read as "not given") is an error, exit 2.
- :func:`check_memory`: the bytes a run will allocate, part by part, against
  ``MemAvailable`` of ``/proc/meminfo`` (host) and ``torch.cuda.mem_get_info`` (GPU);
  too much is a :class:`~hisparse.CapacityError` naming the bytes asked for. Where
  the figure can't be read (not Linux) the host check is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import stat
import tempfile
from typing import Mapping

import torch

from hisparse.config import Kernels
from hisparse.device import interpreter_mode
from hisparse.errors import CapacityError
from .exit_codes import MissingDependency
from .units import fmt_bytes

_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


def parse_device(text: str | None, *, flag: str = "--device", available: bool = True) -> torch.device:
    """The device a tool runs on: None = cuda when available, else cpu.

    ``available``: CUDA must be usable here (False: only the spelling is checked, for
    reports such as ``hisparse env`` that describe a device without running on it).
    """
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(text, str) or not _DEVICE_RE.fullmatch(text):
        raise ValueError(f"{flag} {text!r}: expected cpu, cuda or cuda:N")
    dev = torch.device(text)
    if dev.type == "cuda" and available:
        if not torch.cuda.is_available():
            raise MissingDependency(
                f"{flag} {text} needs a CUDA GPU and a CUDA build of torch; none here "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False): "
                f"use {flag} cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{flag} {text}: this machine has {n} CUDA device(s) "
                             f"(cuda:0 .. cuda:{n - 1})")
    return dev


def require_kernels(kernels: Kernels | str, device: torch.device, *, flag: str = "--kernels") -> Kernels:
    """The kernels choice, checked for this device before anything runs."""
    k = Kernels.parse(kernels, flag)
    if k is Kernels.TORCH or (k is Kernels.AUTO and device.type != "cuda"):
        return k
    if importlib.util.find_spec("triton") is None:
        raise MissingDependency(f"{flag} {k.value} needs Triton, which is not installed "
                                f"(`pip install triton`); or use {flag} torch")
    if device.type != "cuda" and not interpreter_mode():
        raise MissingDependency(
            f"{flag} triton on a CPU device needs Triton's CPU interpreter, which is off: "
            "set TRITON_INTERPRET=1 in the environment before starting (e.g. "
            f"`TRITON_INTERPRET=1 hisparse ...`; slow, meant for tests), or use {flag} "
            "torch / auto (the torch reference) on a machine without a GPU")
    return k


# ----------------------------------------------------------------- output paths
def _probe_dir(directory: str, flag: str, path: str) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot write in {directory!r} "
                         f"({e.strerror or e})") from None


def path_arg(value: str) -> str:
    """argparse ``type=`` of a path flag: refuses an empty or blank path."""
    if not value.strip():
        raise argparse.ArgumentTypeError("empty path; give a file or directory name, or leave the flag out")
    return value


def check_output_file(path: str | os.PathLike, *, flag: str, regular: bool = False) -> str:
    """``path`` (a file to be written at the end of a run) can be written; returns it.

    A socket there is refused; a device such as /dev/null and a FIFO this user may
    write are accepted. A FIFO is not opened here: whether it has a reader is checked by
    :meth:`hisparse_tools.outputs.Outputs.file`, which keeps the handle it opens. With
    ``regular`` (a file replaced atomically, next to a symlink's target) only a regular
    file or none is."""
    p = os.path.abspath(os.fspath(path))
    if os.path.isdir(p):
        raise ValueError(f"{flag} {str(path)!r} is a directory; give a file path")
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {str(path)!r}: directory {parent!r} does not exist")
    if regular:  # replaced atomically: the file is made next to a symlink's target
        p = os.path.realpath(p)
        parent = os.path.dirname(p)
        if not os.path.isdir(parent):
            raise ValueError(f"{flag} {str(path)!r}: directory {parent!r} (of its target) does not exist")
    if os.path.exists(p) and not os.path.isfile(p):
        mode = os.stat(p).st_mode
        if regular or stat.S_ISSOCK(mode):
            raise ValueError(f"{flag} {str(path)!r} exists and is not a regular file; give a file path")
        if stat.S_ISFIFO(mode):  # not opened here: closing it again would end its reader's input
            if not os.access(p, os.W_OK):
                raise ValueError(f"{flag} {str(path)!r} is a FIFO this user cannot write; give a file path")
            return os.fspath(path)
    if regular:  # the rename needs the directory writable, not the file
        _probe_dir(parent, flag, str(path))
        return os.fspath(path)
    if os.path.exists(p):
        try:
            with open(p, "ab"):
                pass
        except OSError as e:
            raise ValueError(f"{flag} {str(path)!r} cannot be written ({e.strerror or e})") from None
    else:
        _probe_dir(parent, flag, str(path))
    return os.fspath(path)


def check_output_dir(path: str | os.PathLike, *, flag: str, files: tuple[str, ...] = ()) -> str:
    """``path`` is a directory that exists and can be written, or can be created; each of
    ``files`` that already exists in it is a regular file that can be written."""
    p = os.path.abspath(os.fspath(path))
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{flag} {str(path)!r} exists and is not a directory")
    for name in files:
        f = os.path.join(p, name)
        if os.path.exists(f) and not os.path.isfile(f):
            raise ValueError(f"{flag} {str(path)!r}: {name} exists there and is not a regular file")
        if os.path.isfile(f) and not os.access(f, os.W_OK):
            raise ValueError(f"{flag} {str(path)!r}: {name} exists there and cannot be written")
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{flag} {str(path)!r}: {probe!r} is not a directory")
    _probe_dir(probe, flag, str(path))
    return os.fspath(path)


# ----------------------------------------------------------------- memory
def host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where it can't be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (``torch.cuda.mem_get_info``); None on CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def _parts(parts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v)


def check_memory(*, host: Mapping[str, int], device: Mapping[str, int], on: torch.device,
                 what: str, hint: str) -> None:
    """Refuse a run whose allocations can't fit: ``host`` / ``device`` name each part
    and its bytes (on a CPU device, pass everything as ``host``)."""
    need = sum(host.values())
    avail = host_available_bytes()
    if avail is not None and need > avail:
        raise CapacityError(
            f"{what} needs {need} bytes ({fmt_bytes(need)}) of host memory ({_parts(host)}) "
            f"but {avail} bytes ({fmt_bytes(avail)}) are available (MemAvailable); {hint}")
    dneed = sum(device.values())
    free = device_free_bytes(on)
    if free is not None and dneed > free:
        raise CapacityError(
            f"{what} needs {dneed} bytes ({fmt_bytes(dneed)}) on {on} ({_parts(device)}) "
            f"but {free} bytes ({fmt_bytes(free)}) are free there; {hint}")


__all__ = ["parse_device", "require_kernels", "check_output_file", "check_output_dir",
           "host_available_bytes", "device_free_bytes", "check_memory"]
