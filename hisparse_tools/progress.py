"""A tiny progress bar on stderr: ``rich`` when importable, else a plain text bar.

Never a hard dependency on rich; disabled (silent) when ``enabled=False``. The plain
bar redraws in place on a terminal and prints at most ~10 lines otherwise, so logs
of CI runs stay short.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "stress") as p: ... p.update(1, note="hit 0.93")``."""

    def __init__(self, total: int, desc: str = "", *, enabled: bool = True, stream=None) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._rich = None
        self._task = None
        self._t0 = time.perf_counter()
        self._last_line = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> "Progress":
        if not self.enabled:
            return self
        try:  # rich is optional (the [tools] extra): imported only when a bar is shown
            import rich.progress as rp
            from rich.console import Console
        except ImportError:
            rp = None
        if rp is not None and self._tty:
            self._rich = rp.Progress(*rp.Progress.get_default_columns(), rp.TextColumn("{task.fields[note]}"),
                                     console=Console(file=self.stream), transient=False)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.desc, total=self.total, note="")
        return self

    def update(self, n: int = 1, *, note: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=n, note=note)
            return
        frac = self.done / self.total if self.total else 1.0
        if self._tty:
            width = 30
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            self.stream.write(f"\r{self.desc} [{bar}] {self.done}/{self.total} {note}   ")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._last_line:
                self._last_line = decile
                el = time.perf_counter() - self._t0
                self.stream.write(f"{self.desc}: {self.done}/{self.total} ({el:.1f} s) {note}\n")
                self.stream.flush()

    def status(self, note: str) -> None:
        """Say what is being worked on now, without advancing (a long first item then
        shows something). Off a terminal only the first item's status is printed."""
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, note=note)
        elif self._tty:
            self.stream.write(f"\r{self.desc} {self.done}/{self.total} {note}\x1b[K")  # clears the bar's tail
            self.stream.flush()
        elif self.done == 0:
            self.stream.write(f"{self.desc}: 0/{self.total} {note}\n")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.__exit__(*exc)
        elif self._tty:
            self.stream.write("\n")
            self.stream.flush()
