"""What ``hisparse stress --prefetch`` measures of each prefetch (CPU-side counting).

After layer l's resolve the stress run prefetches layer l's top-k into layer l + 1
(``HiSparseCache.prefetch``). Of the rows it staged (its lists, which the call returns),
the useful ones are those layer l + 1 then selects; the ones it cost are rows layer
l + 1 selects that were hot before the prefetch and that it evicted. One decode token per
request. Whether a row is hot is read at its row key (``HostPool.row_keys``: block id x B +
offset, what ``row_slot`` is indexed by, distinct per request even where requests share a
host block); a staged row is matched by host row (``stage_src`` holds host rows; a request
maps each host block once, so within one request the match is one to one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def selected_rows(cache, req_ids: list[int], topk: torch.Tensor) -> list[torch.Tensor]:
    """Per request (one token each), the row keys of its valid selected positions:
    int64 CPU tensors (``HostPool.row_keys``)."""
    tk = topk.cpu().long()
    return [cache.pool.row_keys(cache.request(rid).slot, tk[t][tk[t] >= 0]) for t, rid in enumerate(req_ids)]


def selected_host_rows(cache, req_ids: list[int], topk: torch.Tensor) -> list[torch.Tensor]:
    """Per request (one token each), the host rows of its valid selected positions (a
    cached block mapped under an alias id: the cached block's rows): int64 CPU tensors
    (``HostPool.host_rows``)."""
    tk = topk.cpu().long()
    return [cache.pool.host_rows(cache.request(rid).slot, tk[t][tk[t] >= 0]) for t, rid in enumerate(req_ids)]


def selected_hot(cache, layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
    """Whether each of ``rows`` (:func:`selected_rows`) is hot in ``layer`` now: bool
    [entries], request by request (read through the layer's ``layer_view``: the cache's
    rows are of a row format, as the stress run's are)."""
    row_slot = cache.layer_view(layer).row_slot.cpu()
    return torch.cat([row_slot[r] >= 0 for r in rows]) if rows else torch.zeros(0, dtype=torch.bool)


def prefetch_useful(out, K: int, rows: list[torch.Tensor]) -> tuple[int, int]:
    """(rows a prefetch of K columns staged, how many of them the next layer selects): the
    staged host rows of each request (``out.stage_src[t*K : t*K + stage_counts[t]]``, one
    token per request) against the host rows of its next-layer selection (``rows``,
    :func:`selected_host_rows`)."""
    counts = out.stage_counts[:len(rows)].cpu()
    src = out.stage_src[:len(rows) * K].cpu().long()
    staged = useful = 0
    for t, sel in enumerate(rows):
        m = int(counts[t])
        if m:
            staged += m
            useful += int(torch.isin(src[t * K:t * K + m], sel).sum())
    return staged, useful


def prefetch_report(pf: dict, misses: np.ndarray, row_bytes: int) -> dict[str, Any]:
    """A run's prefetches: precision (useful / staged), recall (useful / (useful + misses
    left), in the layers prefetched into), misses_added (rows the next layer selects that
    were hot before the prefetch and were evicted by it), net_rows_saved (useful -
    misses_added) and wasted bytes ((staged - useful) x row bytes); ``misses`` int64
    [L, steps] are the resolves' misses after them."""
    st, us, ev = int(pf["staged"].sum()), int(pf["useful"].sum()), int(pf["evicted"].sum())
    left = int(misses[1:].sum())
    return {"rows_staged": st, "useful_rows": us, "misses_left": left, "misses_added": ev,
            "net_rows_saved": us - ev,
            "precision": us / st if st else None, "recall": us / (us + left) if us + left else None,
            "wasted_bytes": (st - us) * row_bytes, "bytes": st * row_bytes, "time_s": float(pf["s"].sum()),
            "per_layer": [{"layer": i, "rows_staged": int(a), "useful_rows": int(b), "misses_added": int(c)}
                          for i, (a, b, c) in enumerate(zip(pf["staged"], pf["useful"], pf["evicted"])) if i]}


__all__ = ["selected_rows", "selected_hot", "prefetch_useful", "prefetch_report"]
