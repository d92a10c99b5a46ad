"""Stateless staging and index conversion over small frozen views of a cache layer.

- ``view``: ``LayerView`` (one cache layer: host rows, block table, hot rows, row ->
  slot map, row format) and ``BlockTable``.
- ``convert``: logical top-k -> physical rows through a block table, or workspace
  offsets for prefill tokens (``WorkspaceMap``).
- ``prefill``: chunk planning and gathering context rows into a bf16 (or
  stored-format) workspace.

Nothing here owns state: a cache hands out its ``layer_view(layer)``; engines with a
paged cache of their own build a ``BlockTable`` over it.
"""

from .convert import ConvertResult, WorkspaceMap, convert_reference, convert_topk_to_physical
from .prefill import (PrefillChunk, StageRequests, plan_prefill_chunks, stage_prefill,
                      stage_prefill_reference)
from .view import BlockTable, LayerView

__all__ = ["BlockTable", "LayerView", "ConvertResult", "WorkspaceMap", "convert_reference",
           "convert_topk_to_physical", "PrefillChunk", "StageRequests", "plan_prefill_chunks",
           "stage_prefill", "stage_prefill_reference"]
