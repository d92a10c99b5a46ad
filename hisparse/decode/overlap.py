"""``Overlap``: how a decode layer orders miss staging and attention (serial or split;
:mod:`hisparse.decode.layer` describes each). Its own module so that naming a
mode (a config, a command-line choice) loads no kernel and no cache."""

from __future__ import annotations

import enum

from .._checks import parse_enum


class Overlap(enum.Enum):
    """How a decode layer orders miss staging and attention (the modes: hisparse.decode.layer)."""

    SERIAL = "serial"
    SPLIT = "split"

    @classmethod
    def parse(cls, value: "Overlap | str") -> "Overlap":
        return parse_enum(cls, value, "overlap")


__all__ = ["Overlap"]
