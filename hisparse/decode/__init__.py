"""Decode attention over a hisparse cache with the miss staging hidden behind it.

- ``layer``: ``DecodeLayer`` (one layer's resolve + attention in an ``Overlap`` mode:
  serial or split) and its prefetch of a predicted selection.
- ``overlap``: ``Overlap``, the modes.

The names are imported when first used (as in ``hisparse.attention``): naming a mode
(``from hisparse.decode import Overlap``) loads neither the cache nor a kernel.
"""

from __future__ import annotations

import importlib

# exported name -> submodule that defines it
_EXPORTS = {"DecodeLayer": "layer", "Overlap": "overlap"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
