"""Byte and token counts as people write them, for every tool: ``fmt_bytes`` prints a
size ('1.50 KiB'); ``parse_bytes`` / ``parse_tokens`` read '80GiB', '1.5TB', '128K';
``parse_rows`` reads '1M' rows; ``parse_count`` (an int >= 0), ``token_arg`` and
``rows_arg`` are argparse types."""

from __future__ import annotations

import argparse
import re

_MEM_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
              "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
              "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_COUNT_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def _parse(text: str | int, units: dict[str, int], what: str) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in units:
            raise ValueError(f"cannot parse {what} {text!r}; examples: "
                             + ", ".join(["80GiB", "141G", "1.5TB", "4096"] if units is _MEM_UNITS
                                         else ["131072", "128K", "1M"]))
        value = int(round(float(m.group(1)) * units[m.group(2).lower()]))
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def parse_bytes(text: str | int) -> int:
    """'80GiB' / '80G' (binary) / '80GB' (decimal) / '1024' -> bytes."""
    return _parse(text, _MEM_UNITS, "memory size")


def parse_count(text: str) -> int:
    """An int >= 0 (an argparse type)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {n}")
    return n


def parse_tokens(text: str | int) -> int:
    """'131072' / '128K' / '1M' (binary multiples) -> tokens."""
    return _parse(text, _COUNT_UNITS, "token count")


def token_arg(text: str) -> int:
    """:func:`parse_tokens` as an argparse ``type=``."""
    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_rows(text: str | int) -> int:
    """A row count: '1048576' / '1M' / '64K' (binary multiples) -> rows."""
    return _parse(text, _COUNT_UNITS, "row count")


def rows_arg(text: str) -> int:
    """:func:`parse_rows` as an argparse ``type=``."""
    try:
        return parse_rows(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fmt_bytes(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


__all__ = ["fmt_bytes", "parse_bytes", "parse_count", "parse_rows", "parse_tokens", "rows_arg", "token_arg"]
