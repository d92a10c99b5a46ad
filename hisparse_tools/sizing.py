"""GPU bytes of a hisparse cache plus its decode attention I/O (``hisparse autotune``'s
budget arithmetic, which the mini engine's memory check uses too). See
:mod:`hisparse_tools.autotune` for the breakdown."""

from __future__ import annotations

from hisparse.config import HiSparseConfig
from hisparse.formats import D_LATENT, D_ROW


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


__all__ = ["gpu_bytes"]
