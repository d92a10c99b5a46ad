"""Exit codes of the ``hisparse`` command, and the one place that maps errors to them.

  0  ok
  1  the run itself failed (stress: a verification mismatch; mini-engine: outputs differ)
  2  bad arguments or input (``ValueError`` / ``TypeError``)
  3  a capacity limit (``CapacityError``, ``MemoryError``, CUDA out of memory)
  4  a missing dependency (:class:`MissingDependency`: a package, CUDA, the Triton
     interpreter)
  130 interrupted (Ctrl-C)
  141 the reader of standard output went away (``hisparse stress | head``): quietly, as
      a process killed by SIGPIPE

Every error is one line on stderr, ``hisparse CMD: KIND: message``, never a traceback.
An exception outside this list is a bug in hisparse and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import stat
import sys
from typing import Callable, Iterator, Mapping, NoReturn

import torch

from hisparse.errors import CapacityError

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_CAPACITY, EXIT_MISSING = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


class MissingDependency(RuntimeError):
    """Something an option needs is not on this machine: an optional package, a CUDA
    GPU, or Triton's CPU interpreter. The message says what to install or set."""


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose usage errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class OutputError(OSError):
    """An output the up-front checks admitted could not be written; the message names
    the option and the path (exit 1, ``I/O error``)."""


@contextlib.contextmanager
def writing(flag: str, path: str | os.PathLike) -> Iterator[None]:
    """Around the write of an output: an ``OSError`` (a full disk, an I/O error) becomes
    an :class:`OutputError` naming ``flag`` and ``path`` besides the system's reason."""
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        raise OutputError(f"{flag} {os.fspath(path)!r} could not be written: {e.strerror or e}") from e


def one_line(message: object) -> str:
    """The message with its lines joined by '; ' (multi-line errors stay readable)."""
    parts = [p.strip() for p in str(message).splitlines() if p.strip()]
    return "; ".join(parts) if parts else type(message).__name__


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, kind) of an error the CLI reports in one line, or None for a bug."""
    if isinstance(exc, (CapacityError, MemoryError, torch.cuda.OutOfMemoryError)):
        return EXIT_CAPACITY, "capacity"
    if isinstance(exc, MissingDependency):
        return EXIT_MISSING, "missing dependency"
    if isinstance(exc, (ValueError, TypeError)):
        return EXIT_INPUT, "error"
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, OSError):  # an output the checks admitted could not be written (disk full, ...)
        return EXIT_FAILED, "I/O error"
    return None


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{option dest: its flag} of a command's parser, for the visible spelling of each
    option (a hidden, deprecated alias shares its dest but is not named)."""
    names: dict[str, str] = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.help != argparse.SUPPRESS and action.dest not in names:
            names[action.dest] = longs[0]
    return names


def name_flags(text: str, flags: Mapping[str, str]) -> str:
    """``text`` (an error from the options or the config a command built) with the field
    names of its options written as the user typed them: ``device_buffer_size=3`` and
    ``num_layers must`` become ``--buffer 3`` and ``--layers must``. A plain word
    (``context``, ``steps``) is replaced only as the subject that opens the message.
    Quoted text (a path the user gave, ``'/data/top_k.npz'``) is left as it is."""
    parts = re.split(r"""('[^']*'|"[^"]*")""", text)  # odd indices: quoted
    for dest, flag in flags.items():
        for i in range(0, len(parts), 2):
            if "_" in dest:
                part = re.sub(rf"(?<![\w/.-]){re.escape(dest)}=", f"{flag} ", parts[i])
                parts[i] = re.sub(rf"(?<![\w/.-]){re.escape(dest)}(?![\w/]|\.\w)", flag, part)
        if "_" not in dest and parts[0].startswith(f"{dest} must "):
            parts[0] = flag + parts[0][len(dest):]
    return "".join(parts)


def _reader_gone() -> bool:
    """Whether the reader of standard output or standard error (a pipe) has left."""
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            if any(ev & select.POLLERR for _, ev in poll.poll(0)):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _quiet_stdout() -> None:
    """Point standard output at /dev/null: nothing left for the interpreter's flush at exit."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def run_command(command: str, fn: Callable[[], int], *, stream=None,
                flags: Mapping[str, str] | None = None) -> int:
    """Run ``fn`` (a subcommand body returning its exit status), turning the errors of
    :func:`classify` into one line on ``stream`` (stderr) and their exit code. ``flags``
    ({option dest: flag}, :func:`flag_names`) names the command's options in the
    message of a bad-input or capacity error as the user typed them."""
    try:
        rc = int(fn())
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's flush at exit
        return rc
    except BrokenPipeError as e:
        if not _reader_gone():  # another pipe than the command's own output: an I/O error
            print(f"hisparse {command}: I/O error: {one_line(e)}", file=stream if stream is not None else sys.stderr)
            return EXIT_FAILED
        _quiet_stdout()
        return EXIT_PIPE
    except (Exception, KeyboardInterrupt) as e:
        got = classify(e)
        if got is None:
            raise  # a bug in hisparse: keep the traceback
        code, kind = got
        text = one_line(e) if not isinstance(e, KeyboardInterrupt) else "stopped by the user"
        if flags and code in (EXIT_INPUT, EXIT_CAPACITY):
            text = name_flags(text, flags)
        if isinstance(e, MemoryError) and not str(e):
            text = "out of host memory (MemoryError)"
        print(f"hisparse {command}: {kind}: {text}", file=stream if stream is not None else sys.stderr)
        return code


__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_INPUT", "EXIT_CAPACITY", "EXIT_MISSING",
           "EXIT_INTERRUPTED", "EXIT_PIPE", "MissingDependency", "OutputError", "writing", "OneLineParser", "one_line",
           "classify", "flag_names", "name_flags", "run_command"]
