"""The tools' option dataclasses: field checks from tables, choices held as enums.

A choice field (row format, kernels, overlap, ...) holds an enum member. It is given as
the member or as its string value (the CLI's spelling), parsed once when the options
are built (:func:`parse_choices`), and every later reader compares members. Results
print the values: :func:`plain_dict` is a dataclass as JSON takes it, each member its
string value, so a result or record reads as it would with the strings themselves.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Mapping

from hisparse.config import check_bool, check_int

IntRange = tuple["int | None", "int | None"]  # lo, hi of check_int (None: that side open)


def parse_choices(obj: Any, parsers: Mapping[str, Callable[[Any], enum.Enum]]) -> None:
    """Set each named field of the frozen dataclass ``obj`` to its parsed member
    (``parsers``: field -> parse function, which raises ValueError for a spelling it
    does not know)."""
    for name, parse in parsers.items():
        object.__setattr__(obj, name, parse(getattr(obj, name)))


def check_fields(obj: Any, *, ints: Mapping[str, IntRange] = {}, optional_ints: Mapping[str, IntRange] = {},
                 bools: tuple[str, ...] = (), finite: tuple[str, ...] = ()) -> None:
    """Per-field checks of ``obj`` in table order: ``ints`` (check_int's range),
    ``optional_ints`` (the same, None allowed), ``bools`` (check_bool) and ``finite``
    (a finite int or float, bool rejected: TypeError)."""
    for name, (lo, hi) in ints.items():
        check_int(name, getattr(obj, name), lo, hi)
    for name, (lo, hi) in optional_ints.items():
        if getattr(obj, name) is not None:
            check_int(name, getattr(obj, name), lo, hi)
    for name in bools:
        check_bool(name, getattr(obj, name))
    for name in finite:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TypeError(f"{name} must be a finite number, got {v!r}")


def _plain(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in items}


def plain_dict(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict(obj)`` with every enum member as its value (JSON's form)."""
    return dataclasses.asdict(obj, dict_factory=_plain)


def choice_values(cls: type[enum.Enum]) -> list[str]:
    """The spellings of an enum's members (a CLI's ``choices``)."""
    return [m.value for m in cls]


__all__ = ["parse_choices", "check_fields", "plain_dict", "choice_values"]
