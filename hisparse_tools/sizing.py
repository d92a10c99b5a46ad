"""GPU bytes of a hisparse cache plus its decode attention I/O (``hisparse autotune``'s
budget arithmetic, which the mini engine's memory check uses too). See
:mod:`hisparse_tools.autotune` for the breakdown."""

from __future__ import annotations

from hisparse.config import HiSparseConfig, ceil_div, check_int
from hisparse.formats import D_LATENT, D_ROW

# the rows one layer's hot buffers are rounded up to a multiple of (HiSparseConfig.hot_rows_per_layer:
# FlashMLA reads the view as pages of 64 rows), read off a config of one request with a two-slot buffer
HOT_ALIGN = HiSparseConfig(num_layers=1, host_pool_tokens=1, top_k=1, device_buffer_size=1, max_num_reqs=1,
                           host_block_size=1, device="cpu").hot_rows_per_layer


def hot_buffer_rows(requests: int, slots_per_req: int) -> int:
    """Rows per layer of ``requests`` hot buffers of ``slots_per_req`` (S + 1) rows each,
    rounded up as ``HiSparseConfig.hot_rows_per_layer`` rounds them: where an elastic
    device pool's pages start."""
    return ceil_div(requests * slots_per_req, HOT_ALIGN) * HOT_ALIGN


def gpu_bytes(cfg: HiSparseConfig, *, num_heads: int, reserve_frac: float = 0.0) -> dict[str, int]:
    """GPU bytes of a cache with this config plus decode attention I/O (see module doc)."""
    T = cfg.max_tokens
    cache = cfg.device_bytes()
    parts = {
        "hot_rows": cache["hot_rows"],
        "slot_state": cache["state"],
        "resolve_buffers": cache["resolve_buffers"],
        "attention_io": T * num_heads * (D_ROW * 2 + D_LATENT * 2 + 4),
    }
    raw = sum(parts.values())
    parts["reserve"] = int(raw * reserve_frac)
    parts["total"] = raw + parts["reserve"]
    return parts


__all__ = ["check_prefix_options", "gpu_bytes", "hot_buffer_rows", "HOT_ALIGN"]


def check_prefix_options(shared_prefix: int | None, prefix_groups: int | None, block_size: int) -> bool:
    """The shared-prefix options of ``stress`` and ``plan`` (``--shared-prefix P
    --prefix-groups G``): G >= 1 and only with P, P >= one host block (only whole blocks
    are shared). Returns whether P is given (ValueError otherwise)."""
    P, G = shared_prefix, prefix_groups
    if G is not None:
        check_int("prefix_groups", G, lo=1)
        if P is None:
            raise ValueError("prefix_groups needs shared_prefix: it says how many groups share a prefix")
    if P is None:
        return False
    check_int("shared_prefix", P, lo=1)
    if P < block_size:
        raise ValueError(f"shared_prefix={P} is shorter than one host block (block_size={block_size}): "
                         "only whole blocks are shared, so nothing would be; give a shared_prefix of at "
                         f"least {block_size} or a smaller block_size")
    return True
