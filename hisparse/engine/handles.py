"""The handles ``HiSparseIndexGroup.register_layer`` gives an engine: per layer, its sizes
and the flat row view its attention backend reads (``cache(i)``)."""

from __future__ import annotations

import dataclasses

import torch

from ..config import HiSparseConfig
from ..formats import RowFormat

KV_DTYPES = {"fp8_ds_mla": RowFormat.FP8_DS_MLA, "bf16": RowFormat.BF16, "auto": RowFormat.BF16,
              "bfloat16": RowFormat.BF16}


@dataclasses.dataclass(frozen=True)
class HotView:
    """What an attention backend needs to know about one layer's hot buffer.

    attention_cache: uint8 [device_rows_per_layer, row_bytes], the flat row view
    physical indices point into (``physical_kv_cache``): R * (S + 1) hot rows (rounded
    up to 64), then the elastic pool's pages when the config has ``device_pool_rows``.
    block_size = S + 1: viewed as blocks, block r is request slot r and a hot
    request's ``physical = r * block_size + slot`` (a resident request's rows lie in
    the pages past the hot buffers).
    """

    attention_cache: torch.Tensor
    block_size: int
    num_rows: int
    row_bytes: int


@dataclasses.dataclass(frozen=True)
class LayerRuntime:
    """``cache(i).runtime``: sizes and the hot view of layer ``layer``."""

    layer: int
    max_num_reqs: int
    top_k: int
    max_query_len: int
    row_format: RowFormat
    hot: HotView


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """The handle ``cache(i)`` returns for one registered layer."""

    layer_index: int
    head_size: int
    kv_cache_dtype: str
    runtime: LayerRuntime


def row_format_of(config: HiSparseConfig) -> RowFormat:
    if config.row_bytes == RowFormat.FP8_DS_MLA.row_bytes:
        return RowFormat.FP8_DS_MLA
    if config.row_bytes == RowFormat.BF16.row_bytes:
        return RowFormat.BF16
    raise ValueError(f"an engine index group needs attention rows: row_bytes must be 656 "
                     f"(fp8_ds_mla) or 1152 (bf16), got {config.row_bytes}")


__all__ = ["HotView", "LayerCache", "LayerRuntime", "KV_DTYPES", "row_format_of"]
