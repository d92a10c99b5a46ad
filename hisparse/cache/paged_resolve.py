"""``resolve_paged``: the resident path of ``HiSparseCache.resolve`` folded into an attention
that maps the top-k itself (``kernels.paged_rows``; ``decode.layer`` calls it where its
backend can)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention.paged import PagedLookup
from .resolve_launch import RESOLVE_SCAN_CHUNK
from .state import STAT_INVALID, STAT_RESIDENT, STAT_RESOLVES

if TYPE_CHECKING:
    from .cache import HiSparseCache


def resolve_paged(cache: "HiSparseCache", layer: int, req_ids: torch.Tensor, topk: torch.Tensor, attend, *,
                  validate: bool = True):
    """The resident path of ``cache.resolve`` folded into an attention: ``attend(paged)``
    enqueues a decode that maps ``topk`` (int32 [T, K] positions) through ``paged``
    (an ``attention.paged.PagedLookup`` of this layer's tables and this call's
    resolve buffers) itself, e.g. ``TritonBackend.decode(q, rows, topk, ...,
    paged=paged)``, in place of the resident resolve's kernel: the same checks before
    it, the same stream order and bookkeeping around it, the same physical rows and
    counters written. Only on the resident path (``graphs.resident_resolve``).
    Returns what ``attend`` returns."""
    if not cache.graphs.resident_resolve():
        raise ValueError("resolve_paged maps positions through the resident requests' page tables: it "
                         "needs every live request resident (graphs.resident_resolve())")
    T, K, req_ids = cache._check_resolve(layer, req_ids, topk, validate)
    st = cache.state
    ls = st.layer(layer)
    phys = cache._bufs[layer].view(T, K).physical  # registered by _out once attend launched
    paged = PagedLookup(req_ids, st.id_to_slot, st.resident, ls.seq_lens, st.page_table, st.pool_base, st.PB,
                        st.pool_pages, ls.stats, phys, cache.stager.max_query_len, RESOLVE_SCAN_CHUNK,
                        STAT_INVALID, STAT_RESOLVES, STAT_RESIDENT)
    got = cache.stager.run_paged(layer, lambda: attend(paged))
    cache._out(layer, T, K)  # the layer's last selection (what a demotion seeds first)
    cache.requests.touch(layer)
    return got


__all__ = ["resolve_paged"]
