"""The output files of one command: checked together before any work starts, written at its end.

What a path may be follows from how its output is written, the same for every subcommand:

- **written once, front to back** (``--record``, ``--out``): anything a sequential write
  reaches: a regular file (created or truncated), a character device (``/dev/null``, a
  terminal), a FIFO or pipe with a reader (``--out /dev/stdout | jq``). The writers never
  seek (a trace archive goes out as a zip stream).
- **replaced** (``--metrics-file``: a temporary file renamed over it) or **written by
  name into a directory** (``--plot DIR``): a regular file or none
  (:func:`~hisparse.tools.preflight.check_output_file` with ``regular``,
  :func:`~hisparse.tools.preflight.check_output_dir`).

A FIFO is opened when it is checked, without blocking: one with no reader is refused
then (exit 2) instead of being waited on. The handle is kept and the output written
through it (:meth:`Outputs.open`), so the reader does not see end-of-file before the
data, and a reader that left makes the write fail (exit 1) instead of hang.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .preflight import check_output_dir, check_output_file


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def open_for_writing(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened to be written front to back (created, or truncated), never waiting:
    a FIFO without a reader is an ``OSError`` (ENXIO) where a plain ``open`` would block
    until a reader came. Once open, writes wait for a slow reader as usual."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o666)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "wb")


class Outputs:
    """The outputs of one command. Use as a context manager: leaving it closes the FIFO
    handles that were checked but not written (their readers then see end-of-file)."""

    def __init__(self) -> None:
        self._checked: set[tuple[str, str]] = set()  # (flag, absolute path)
        self._held: dict[str, BinaryIO] = {}  # absolute path of a FIFO -> its write end

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        held, self._held = self._held, {}
        for fh in held.values():
            fh.close()

    def file(self, path: str | os.PathLike | None, *, flag: str, replace: bool = False) -> str | None:
        """Check ``path``, the output of ``flag`` (None: not given).

        Written front to back unless ``replace`` (renamed over: a regular file only).
        Checking a path this command already checked for the same flag does nothing."""
        if path is None:
            return None
        path = os.fspath(path)
        if (flag, os.path.abspath(path)) in self._checked:
            return path
        check_output_file(path, flag=flag, regular=replace)
        self._checked.add((flag, os.path.abspath(path)))
        if not replace and _is_fifo(path):
            try:
                self._held[os.path.abspath(path)] = open_for_writing(path)
            except OSError as e:
                raise ValueError(f"{flag} {path!r} is a FIFO that cannot be written now ({e.strerror or e}: "
                                 "no reader?); start its reader first, or give a file path") from None
        return path

    def directory(self, path: str | os.PathLike | None, *, flag: str, files: tuple[str, ...]) -> str | None:
        """Check ``path``, a directory ``flag`` writes ``files`` into."""
        if path is None:
            return None
        path = os.fspath(path)
        check_output_dir(path, flag=flag, files=files)
        return path

    def open(self, path: str | os.PathLike) -> BinaryIO:
        """A binary file to write the output at ``path`` through: the FIFO handle kept since
        the check, else :func:`open_for_writing`. The caller closes it."""
        held = self._held.pop(os.path.abspath(os.fspath(path)), None)
        return held if held is not None else open_for_writing(path)


__all__ = ["Outputs", "open_for_writing"]
