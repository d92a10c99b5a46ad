"""The resident resolve folded into the sparse-MLA decode: each attention program maps its
own entries' logical positions to device rows before it attends.

When every live request is resident (the elastic tier), a resolve is a page-table lookup
(``resolve_resident.resolve_resident_kernel``); run as its own kernel it is a graph node
of a few microseconds in front of the attention, which at small batches is most of what
the elastic tier costs over attention alone (BENCHMARKS.md, "The elastic tier (H100)").
With ``paged`` lookups the decode kernels take the top-k's logical positions and the
cache's tables instead of physical indices: program (t, hb, sp), in its prologue, maps
the entries [lo, hi) of its split through the page table exactly as the resident
resolve does (token groups, liveness, residency, lengths, the page's range), writes the
rows to an index row it alone owns, orders those stores before its partitions read them
(a CTA barrier), and attends over that row as over the physical indices of a resolve.

Rows: head block 0 writes the resolve's own ``physical`` buffer (int32 [T, K], which a
demotion reads as the layer's last selection); head block hb > 0 writes row
t (HB - 1) + hb - 1 of a scratch int32 [T (HB - 1), K]. Counters: head block 0 adds
STAT_RESIDENT and STAT_INVALID of its entries, split 0 of it STAT_RESOLVES once per
resolved run, so the sums over programs are the resident resolve's. The resolve's other
outputs (valid counts, the empty staging lists) are not written: the layer reads neither.

``paged_rows_tl`` is the ``tl`` kernels' prologue (it reuses the resolve's own
``_token_group`` and ``_page_row``); ``paged_rows_gl.paged_rows_gl`` the same in Gluon
for the warp-specialised kernel (imported with it only: Gluon's API moves between
releases, ``gluon_support``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from .resolve import _page_row, _token_group

PAGED_CHUNK = tl.constexpr(256)  # entries the tl prologue maps per iteration


@triton.jit
def paged_row_ptr(tg, hb, HB, K, phys_ptr, phys_stride, scratch_ptr):
    """The index row program (tg, hb) writes and attends over (module docstring)."""
    if hb == 0:
        row = phys_ptr + tg.to(tl.int64) * phys_stride
    else:
        row = scratch_ptr + (tg.to(tl.int64) * (HB - 1) + hb - 1) * K
    return row


@triton.jit
def paged_rows_tl(tg, hb, sp, lo, hi, topk_ptr, topk_stride, req_ids_ptr, id_to_slot_ptr, max_request_id, R,
                  resident_ptr, seq_lens_ptr, pt_ptr, pt_stride, MP, pool_base, PB, NPG, stats_ptr, row_ptr,
                  STAT_INVALID: tl.constexpr, STAT_RESOLVES: tl.constexpr, STAT_RESIDENT: tl.constexpr,
                  Q: tl.constexpr, CH: tl.constexpr, CHUNK: tl.constexpr):
    """Map entries [lo, hi) of token tg's top-k row (int32 positions, -1 = padding) to
    device rows (int32, -1 = none) at row_ptr + k; count them (module docstring)."""
    my_id, off, r, live = _token_group(tg, req_ids_ptr, id_to_slot_ptr, max_request_id, R, Q, CH)
    is_res = tl.load(resident_ptr + r, mask=live, other=0)
    seq = tl.load(seq_lens_ptr + r, mask=live, other=0)
    use = live & (is_res != 0)
    pt_row = pt_ptr + tl.where(live, r, 0).to(tl.int64) * pt_stride
    n_good = tl.zeros([CHUNK], tl.int32)
    n_bad = tl.zeros([CHUNK], tl.int32)
    for start in range(lo, hi, CHUNK):
        k = start + tl.arange(0, CHUNK)
        km = k < hi
        pos = tl.load(topk_ptr + tg.to(tl.int64) * topk_stride + k, mask=km, other=-1)
        ok = km & use & (pos >= 0) & (pos < seq)
        prow, good = _page_row(pos, ok, pt_row, MP, PB, pool_base, NPG)
        tl.store(row_ptr + k, prow.to(tl.int32), mask=km)
        n_good += good.to(tl.int32)
        n_bad += (km & (pos != -1) & (good == 0)).to(tl.int32)
    if hb == 0:  # counters: relaxed (no fence waits for this program's stores)
        tl.atomic_add(stats_ptr + STAT_INVALID, tl.sum(n_bad, axis=0).to(tl.int64), sem="relaxed")
        if live:
            tl.atomic_add(stats_ptr + STAT_RESIDENT, tl.sum(n_good, axis=0).to(tl.int64), sem="relaxed")
            if (off == 0) & (sp == 0):
                tl.atomic_add(stats_ptr + STAT_RESOLVES, tl.full([], 1, tl.int64), sem="relaxed")


__all__ = ["PAGED_CHUNK", "paged_row_ptr", "paged_rows_tl"]
