"""``Overlap``: how a decode layer orders miss staging and attention (serial or split;
:mod:`hisparse.decode.layer` describes each; auto runs whichever it measured faster,
:mod:`hisparse.decode.auto`). Its own module so that naming a
mode (a config, a command-line choice) loads no kernel and no cache."""

from __future__ import annotations

import enum

from .._checks import parse_enum


class Overlap(enum.Enum):
    """How a decode layer orders miss staging and attention (the modes: hisparse.decode.layer)."""

    SERIAL = "serial"
    SPLIT = "split"
    AUTO = "auto"  # serial or split per (layer, T), whichever measured faster (decode.auto)

    @classmethod
    def parse(cls, value: "Overlap | str") -> "Overlap":
        return parse_enum(cls, value, "overlap")


__all__ = ["Overlap"]
