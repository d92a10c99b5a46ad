"""The small frozen views staging and conversion read, instead of a cache's internals.

- :class:`BlockTable`: where each request's logical positions live, as rows of a flat
  row store (the cache's host pool, or an engine's own paged cache).
- :class:`LayerView`: one cache layer as staging sees it: its host rows, the block
  table, its hot rows and row -> slot map, and the row format. A cache hands one out
  (``HiSparseCache.layer_view(layer)``); tests and benchmarks may build their own.

Both are checked once, when built (types, dtypes, shapes, devices, pinning): the
per-call checks of staging and conversion then look only at the per-call tensors.
The tensors are views of their owner's persistent buffers, so a view stays valid for
the owner's lifetime and always shows its current contents.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_int, check_tensor, device_type
from ..device import is_pinned_host
from ..formats import RowFormat


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """Logical position -> row of a flat row store, per request row of the table.

    table:        int32 [R, NB] block of each logical block, -1 = none
    block_size:   positions per block (B)
    block_stride: rows between consecutive blocks of the store (>= B; default B)
    seq_lens:     int32 [R] | None, positions >= seq_lens[r] are invalid when given

    Row of (r, p) = ``table[r, p // B] * block_stride + p % B``.
    """

    table: torch.Tensor
    block_size: int
    block_stride: int | None = None
    seq_lens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("block_table", self.table, dtype=torch.int32, ndim=2)
        check_int("block_size", self.block_size, 1)
        if self.block_stride is None:
            object.__setattr__(self, "block_stride", self.block_size)
        check_int("block_stride", self.block_stride, self.block_size)
        if self.seq_lens is not None:
            check_tensor("seq_lens", self.seq_lens, dtype=torch.int32,
                         shape=(self.table.shape[0],), device=self.table.device)

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def num_rows(self) -> int:
        """R: request rows of the table."""
        return int(self.table.shape[0])


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer of a tiered cache, as staging reads it (notation of ``cache.state``).

    host_rows:     uint8 [H, row_bytes] the layer's host rows (pinned CPU, or on the device)
    blocks:        BlockTable over host_rows (request slots x host blocks)
    row_format:    RowFormat of the stored rows
    hot_rows:      uint8 [>= R * SP, row_bytes] | None, the layer's flat hot view
    row_slot:      int32 [H] | None, hot slot (0..S) of each host row, -1 = not hot
    slots_per_req: SP = S + 1 hot rows per request slot (when hot_rows is given)

    A host row whose ``row_slot`` is >= 0 may be read from ``hot_rows`` instead (the
    cache keeps both byte-identical).
    """

    host_rows: torch.Tensor
    blocks: BlockTable
    row_format: RowFormat
    hot_rows: torch.Tensor | None = None
    row_slot: torch.Tensor | None = None
    slots_per_req: int = 1

    def __post_init__(self) -> None:
        fmt = RowFormat.parse(self.row_format)
        object.__setattr__(self, "row_format", fmt)
        check_tensor("host_rows", self.host_rows, dtype=torch.uint8, shape=(None, fmt.row_bytes),
                     contiguous=True)
        dev = self.blocks.device
        if self.host_rows.device != dev and not (device_type(self.host_rows.device) == "cpu"
                                                 and device_type(dev) == "cuda"):
            raise ValueError(f"host_rows is on {self.host_rows.device}, the block table on {dev}: the "
                             "rows must be on the table's device or in pinned host memory")
        if (device_type(self.host_rows.device) == "cpu" and device_type(dev) == "cuda" and self.host_rows.numel()
                and not is_pinned_host(self.host_rows)):
            raise ValueError("host_rows is a CPU tensor that is not pinned: GPU kernels read it over "
                             "UVA, which needs page-locked memory (hisparse.device.PinnedBuffer)")
        if (self.hot_rows is None) != (self.row_slot is None):
            raise ValueError("hot_rows and row_slot go together: pass both or neither")
        check_int("slots_per_req", self.slots_per_req, 1)
        if self.hot_rows is not None:
            check_tensor("hot_rows", self.hot_rows, dtype=torch.uint8, shape=(None, fmt.row_bytes),
                         device=dev, contiguous=True)
            check_tensor("row_slot", self.row_slot, dtype=torch.int32,
                         shape=(self.host_rows.shape[0],), device=dev)
            need = self.blocks.num_rows * self.slots_per_req
            if self.hot_rows.shape[0] < need:
                raise ValueError(f"hot_rows has {self.hot_rows.shape[0]} rows, fewer than R x "
                                 f"slots_per_req = {need}")

    @property
    def device(self) -> torch.device:
        """Where kernels run: the block table's device."""
        return self.blocks.device

    @property
    def num_host_rows(self) -> int:
        return int(self.host_rows.shape[0])


__all__ = ["BlockTable", "LayerView"]
