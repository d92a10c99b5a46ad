"""The output files of one command: checked together before any work starts, written at its end.

What a path may be follows from how its output is written, the same for every subcommand:

- **written once, front to back** (``--record``, ``--out``): anything a sequential write
  reaches: a regular file (created or truncated), a character device (``/dev/null``, a
  terminal), a FIFO or pipe with a reader (``--out /dev/stdout | jq``). The writers never
  seek (a trace archive goes out as a zip stream).
- **replaced** (``--metrics-file``: a temporary file renamed over it) or **written by
  name into a directory** (``--plot DIR``): a regular file or none
  (:func:`~hisparse_tools.preflight.check_output_file` with ``regular``,
  :func:`~hisparse_tools.preflight.check_output_dir`).

A FIFO is opened when it is checked, without blocking: one with no reader is refused
then (exit 2) instead of being waited on. The handle is kept and the output written
through it (:meth:`Outputs.open`), so the reader does not see end-of-file before the
data, and a reader that left makes the write fail (exit 1) instead of hang.

Two outputs of one command may not be the same file, compared after symlinks,
relative or absolute spellings and hard links; nor may a file be a ``--plot``
directory or one of the plots written into it. One would overwrite the other. A
character device is exempt: what goes to ``/dev/null`` is discarded on purpose. Nor
may an output be a file the command reads (:meth:`Outputs.input`, ``--replay``).
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .preflight import check_output_dir, check_output_file

Identity = tuple  # ("inode", st_dev, st_ino) of an existing file, ("path", resolved) of a new one


def _identity(path: str) -> Identity | None:
    """What ``path`` writes to; None for a character device (shared without loss)."""
    try:
        st = os.stat(path)
    except OSError:  # not there yet (or its directory isn't: the path check says so)
        return ("path", os.path.realpath(path))
    if stat.S_ISCHR(st.st_mode):
        return None
    return ("inode", st.st_dev, st.st_ino)


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
        self._claims: list[tuple[Identity, str, str, str | None]] = []  # identity, flag, path, part
        self._inputs: list[tuple[Identity, str, str]] = []  # identity, flag, path of files read
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
        """Check ``path``, the output of ``flag``, and claim it (None: not given).

        Written front to back unless ``replace`` (renamed over: a regular file only).
        Checking a path this command already claimed for the same flag does nothing."""
        if path is None:
            return None
        path = os.fspath(path)
        ident = _identity(path)
        if ident is not None and any(c[0] == ident and c[1] == flag and c[3] is None for c in self._claims):
            return path
        check_output_file(path, flag=flag, regular=replace)
        self._claim(ident, flag, path)
        if not replace and _is_fifo(path):
            try:
                self._held[os.path.abspath(path)] = open_for_writing(path)
            except OSError as e:
                raise ValueError(f"{flag} {path!r} is a FIFO that cannot be written now ({e.strerror or e}: "
                                 "no reader?); start its reader first, or give a file path") from None
        return path

    def directory(self, path: str | os.PathLike | None, *, flag: str, files: tuple[str, ...]) -> str | None:
        """Check ``path``, a directory ``flag`` writes ``files`` into, and claim it and them."""
        if path is None:
            return None
        path = os.fspath(path)
        check_output_dir(path, flag=flag, files=files)
        self._claim(_identity(path), flag, path, "")
        for name in files:
            self._claim(_identity(os.path.join(path, name)), flag, path, name)
        return path

    def input(self, path: str | os.PathLike | None, *, flag: str) -> None:
        """Note ``path``, a file ``flag`` reads, so that no output of this command may be it
        (None: not given). Call before or after the outputs' checks."""
        if path is None:
            return
        path = os.fspath(path)
        ident = _identity(path)
        if ident is None:
            return
        for other, oflag, opath, _ in self._claims:
            if other == ident:
                raise _reads_its_output(flag, path, oflag, opath)
        self._inputs.append((ident, flag, path))

    def open(self, path: str | os.PathLike) -> BinaryIO:
        """A binary file to write the output at ``path`` through: the FIFO handle kept since
        the check, else :func:`open_for_writing`. The caller closes it."""
        held = self._held.pop(os.path.abspath(os.fspath(path)), None)
        return held if held is not None else open_for_writing(path)

    def _claim(self, ident: Identity | None, flag: str, path: str, part: str | None = None) -> None:
        """``part``: None for a file output; for a directory output, "" (the directory
        itself) or the name of a file written into it."""
        if ident is None:
            return

        def name(f, p, q):
            return f"{f} {p!r}" + ("" if q is None else " (the directory)" if not q else f" (its {q})")

        for other, oflag, opath, opart in self._claims:
            if other == ident:
                raise ValueError(f"{name(flag, path, part)} and {name(oflag, opath, opart)} are the same "
                                 "file; one output would overwrite the other: give each its own path")
        for other, iflag, ipath in self._inputs:
            if other == ident:
                raise _reads_its_output(iflag, ipath, flag, path)
        self._claims.append((ident, flag, path, part))


def _reads_its_output(iflag: str, ipath: str, oflag: str, opath: str) -> ValueError:
    return ValueError(f"{oflag} {opath!r} is the file {iflag} {ipath!r} reads; writing it would replace the "
                      "input: give the output another path")


__all__ = ["Outputs", "open_for_writing"]
