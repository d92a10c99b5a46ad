"""Decode attention over a hisparse cache with the miss staging hidden behind it.

- ``layer``: ``DecodeLayer`` (one layer's resolve + attention in an ``Overlap`` mode:
  serial, split, or auto) and its prefetch of a predicted selection.
- ``overlap``: ``Overlap``, the modes.
- ``auto``: ``ModeChooser``, the auto mode's timings and choice per (layer, T).

The names are imported when first used (as in ``hisparse.attention``): naming a mode
(``from hisparse.decode import Overlap``) loads neither the cache nor a kernel.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# exported name -> submodule that defines it
_EXPORTS = {"DecodeLayer": "layer", "Overlap": "overlap", "ModeChooser": "auto"}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
