"""The engine façade: the calls an inference engine's sparse-MLA backend makes.

- ``group``: ``HiSparseIndexGroup`` (per-model: registration, request lifecycle, per
  forward ``prepare_for_batch``, per layer ``write_new_rows`` / decode conversion /
  prefill staging) and the handles it returns (``LayerCache``, ``LayerRuntime``,
  ``HotView``).
- ``metadata``: ``SparseMLAMetadata``, one forward's batch description, and
  ``device_ints``, the one non-blocking copy that puts a step's int lists on the device.
- ``forward``: ``Forward``, what ``prepare_for_batch`` returns: one forward's sizes,
  step and what its per-layer calls have done.
- ``layer_graphs``: ``RECENT_INPUTS``, how many of a per-layer call's latest distinct
  input addresses count as recurring (``layer_graphs=True``) and may get a graph that
  reads them in place.
"""

from ..errors import CapacityError
from .forward import Forward
from .group import HiSparseIndexGroup
from .handles import HotView, LayerCache, LayerRuntime
from .layer_graphs import RECENT_INPUTS
from .metadata import SparseMLAMetadata, device_ints
from .pd_calls import PDConnector

__all__ = ["HiSparseIndexGroup", "SparseMLAMetadata", "device_ints", "Forward", "LayerCache", "LayerRuntime",
           "HotView", "CapacityError", "PDConnector", "RECENT_INPUTS"]
