"""Decode attention over a hisparse cache with the miss staging hidden behind it.

- ``layer``: ``DecodeLayer`` (one layer's resolve + attention in an ``Overlap`` mode:
  serial, split or fused) and its prefetch of a predicted selection.
"""

from .layer import DecodeLayer, Overlap

__all__ = ["DecodeLayer", "Overlap"]
