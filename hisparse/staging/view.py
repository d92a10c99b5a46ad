"""The small frozen views staging and conversion read, instead of a cache's internals.

- :class:`BlockTable`: where each request's logical positions live, as rows of a flat
  row store (the cache's host pool, or an engine's own paged cache).
- :class:`LayerView`: one cache layer as staging sees it: its host rows, the block
  table, its hot rows and row -> slot map, the row format, with prefix caching the
  map of block ids to host blocks and, with the elastic tier, the residency flags and
  device page table of its resident requests. A cache hands
  one out (``HiSparseCache.layer_view(layer)``); tests and benchmarks may build their own.

Both are checked once, when built (types, dtypes, shapes, devices, pinning): the
per-call checks of staging and conversion then look only at the per-call tensors.
The tensors are views of their owner's persistent buffers, so a view stays valid for
the owner's lifetime and always shows its current contents.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_int, check_tensor, device_type
from ..config import DEVICE_PAGE_ROWS
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
    blocks:        BlockTable of block ids (request slots x logical blocks); the row key
                   of (r, p) is ``table[r, p // B] * B + p % B``
    row_format:    RowFormat of the stored rows
    hot_rows:      uint8 [>= R * SP, row_bytes] | None, the layer's flat hot view
    row_slot:      int32 [HV] | None, hot slot (0..S) of each row key, -1 = not hot
    slot_pos:      int32 [R, SP] | None, the position each hot slot holds, -1 = empty
                   (``row_slot``'s other direction; staging does not read it)
    slots_per_req: SP = S + 1 hot rows per request slot (when hot_rows is given)
    host_block:    int32 [NV] | None, host block of each block id (prefix caching: ids
                   past the host blocks are aliases of cached ones); the host row of
                   (r, p) is ``host_block[table[r, p // B]] * B + p % B``. None: every
                   block id is its host block (HV = H, the row key is the host row).

    The elastic device tier (``hisparse.cache.device_pool``; ``resident`` and
    ``page_table`` both or neither, and only with ``hot_rows``; ``pool_base`` and
    ``page_rows`` are read only with them):

    resident:      int32 [R] | None, != 0 = the request slot is resident: every position
                   p has a row in the device pages past the hot buffers
    page_table:    int32 [R, MP] | None, pool page of each logical page, -1 = none
                   (its last dimension packed)
    pool_base:     first row of the pages in ``hot_rows`` (>= R * SP)
    page_rows:     PB, rows per page

    A host row whose ``row_slot`` is >= 0 may be read from ``hot_rows`` instead (the
    cache keeps both byte-identical). Position p of a resident request slot r is read
    from ``hot_rows[pool_base + page_table[r, p // PB] * PB + p % PB]``, never from
    the host (its host rows are never in ``row_slot``; the cache keeps the page row and
    the host row byte-identical).
    """

    host_rows: torch.Tensor
    blocks: BlockTable
    row_format: RowFormat
    hot_rows: torch.Tensor | None = None
    row_slot: torch.Tensor | None = None
    slots_per_req: int = 1
    resident: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    pool_base: int = 0
    page_rows: int = DEVICE_PAGE_ROWS
    host_block: torch.Tensor | None = None
    slot_pos: torch.Tensor | None = None

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
        if self.slot_pos is not None and self.hot_rows is None:
            raise ValueError("slot_pos describes the hot slots: it needs hot_rows and row_slot")
        check_int("slots_per_req", self.slots_per_req, 1)
        if self.host_block is not None:
            check_tensor("host_block", self.host_block, dtype=torch.int32, ndim=1, device=dev, contiguous=True)
            if self.blocks.block_stride != self.blocks.block_size:
                raise ValueError(f"a view with host_block takes a block table of block_stride = block_size "
                                 f"({self.blocks.block_size}), got {self.blocks.block_stride}")
        if self.hot_rows is not None:
            check_tensor("hot_rows", self.hot_rows, dtype=torch.uint8, shape=(None, fmt.row_bytes),
                         device=dev, contiguous=True)
            check_tensor("row_slot", self.row_slot, dtype=torch.int32, shape=(self.num_row_keys,), device=dev)
            if self.slot_pos is not None:
                check_tensor("slot_pos", self.slot_pos, dtype=torch.int32,
                             shape=(self.blocks.num_rows, self.slots_per_req), device=dev)
            need = self.blocks.num_rows * self.slots_per_req
            if self.hot_rows.shape[0] < need:
                raise ValueError(f"hot_rows has {self.hot_rows.shape[0]} rows, fewer than R x "
                                 f"slots_per_req = {need}")
        if (self.resident is None) != (self.page_table is None):
            raise ValueError("resident and page_table go together: pass both or neither")
        check_int("pool_base", self.pool_base, 0)
        check_int("page_rows", self.page_rows, 1)
        if self.resident is not None:
            if self.hot_rows is None:
                raise ValueError("resident requests read their rows from pages of hot_rows: pass "
                                 "hot_rows and row_slot with resident and page_table")
            R = self.blocks.num_rows
            check_tensor("resident", self.resident, dtype=torch.int32, shape=(R,), device=dev)
            check_tensor("page_table", self.page_table, dtype=torch.int32, shape=(R, None), device=dev)
            if self.page_table.shape[1] > 1 and self.page_table.stride(1) != 1:
                raise ValueError(f"page_table's last dimension must be packed, got strides "
                                 f"{self.page_table.stride()}")
            need = R * self.slots_per_req
            if not need <= self.pool_base <= self.hot_rows.shape[0]:
                raise ValueError(f"pool_base={self.pool_base} must lie in [R x slots_per_req = {need}, "
                                 f"{self.hot_rows.shape[0]}] (the pages follow the hot buffers in "
                                 "hot_rows)")

    @property
    def device(self) -> torch.device:
        """Where kernels run: the block table's device."""
        return self.blocks.device

    @property
    def num_host_rows(self) -> int:
        return int(self.host_rows.shape[0])

    @property
    def num_row_keys(self) -> int:
        """HV: row keys the block ids name (NV x B with host_block, else H)."""
        if self.host_block is None:
            return self.num_host_rows
        return int(self.host_block.shape[0]) * self.blocks.block_size

    @property
    def has_pool(self) -> bool:
        """Whether the view carries the elastic tier's residency flags and page table."""
        return self.resident is not None


__all__ = ["BlockTable", "LayerView"]
