"""The paged lookup's prologue in Gluon, for the warp-specialised decode
(``mla_decode_ws``): ``paged_rows.paged_rows_tl`` and ``paged_row_ptr`` over the
kernel's 4 default warps, before its partitions fork (``kernels.paged_rows`` says what
they compute). Imported with that kernel only (``gluon_support``)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# entries mapped per round of dependent loads (BENCHMARKS.md, "Measured slower and removed":
# a whole split in one round)
PAGED_CHUNK_GL = gl.constexpr(256)


@gluon.jit
def paged_row_ptr_gl(tg, hb, HB, K, phys_ptr, phys_stride, scratch_ptr):
    """``paged_rows.paged_row_ptr`` in Gluon."""
    if hb == 0:
        row = phys_ptr + tg.to(gl.int64) * phys_stride
    else:
        row = scratch_ptr + (tg.to(gl.int64) * (HB - 1) + hb - 1) * K
    return row


@gluon.jit
def paged_rows_gl(tg, hb, sp, lo, hi, topk_ptr, topk_stride, req_ids_ptr, id_to_slot_ptr, max_request_id, R,
                  resident_ptr, seq_lens_ptr, pt_ptr, pt_stride, MP, pool_base, PB, NPG, stats_ptr, row_ptr,
                  STAT_INVALID: gl.constexpr, STAT_RESOLVES: gl.constexpr, STAT_RESIDENT: gl.constexpr,
                  Q: gl.constexpr, CH: gl.constexpr, CHUNK: gl.constexpr):
    """``paged_rows.paged_rows_tl`` in Gluon, over 4 warps."""
    L1: gl.constexpr = gl.BlockedLayout([CHUNK // 128], [32], [4], [0])
    LC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    # the token's group (resolve._token_group): its id, its offset in its run of equal ids
    # (capped at Q), its slot, and whether it is resolved (a live id, offset < Q, the
    # first run of that id)
    my_id = gl.load(req_ids_ptr + tg)
    off = tg * 0
    same = tg >= 0
    for j in gl.static_range(1, Q + 1):
        pj = tg - j
        prev = gl.load(req_ids_ptr + gl.maximum(pj, 0))
        same = same & (pj >= 0) & (prev == my_id)
        off += same.to(gl.int32)
    id_ok = (my_id >= 0) & (my_id < max_request_id)
    r = gl.load(id_to_slot_ptr + gl.where(id_ok, my_id, 0))
    r = gl.where(id_ok, r, -1)
    live = id_ok & (r >= 0) & (r < R) & (off < Q)
    lead = gl.where(live, tg - off, 0)
    dup = tg < 0
    c0 = tg * 0
    while c0 < lead:
        ci = c0 + gl.arange(0, CH, layout=LC)
        cm = ci < lead
        v = gl.load(req_ids_ptr + ci, mask=cm, other=0)
        dup = dup | (gl.sum((cm & (v == my_id)).to(gl.int32), axis=0) > 0)
        c0 += CH
    live = live & (dup == 0)
    rs = gl.where(live, r, 0)
    is_res = gl.load(resident_ptr + rs)
    seq = gl.load(seq_lens_ptr + rs)
    use = live & (is_res != 0)
    seq = gl.where(use, seq, 0)
    pt_row = pt_ptr + rs.to(gl.int64) * pt_stride
    n_good = gl.zeros([CHUNK], gl.int32, layout=L1)
    n_bad = gl.zeros([CHUNK], gl.int32, layout=L1)
    for start in range(lo, hi, CHUNK):
        k = start + gl.arange(0, CHUNK, layout=L1)
        km = k < hi
        pos = gl.load(topk_ptr + tg.to(gl.int64) * topk_stride + k, mask=km, other=-1)
        ok = km & (pos >= 0) & (pos < seq)  # seq is 0 unless the request is used
        # resolve._page_row: the page of each position through the request's page-table row
        safe = gl.where(ok, pos, 0)
        pg = safe // PB
        okp = ok & (pg < MP)
        page = gl.load(pt_row + pg, mask=okp, other=-1)
        good = okp & (page >= 0) & (page < NPG)
        prow = gl.where(good, pool_base + page.to(gl.int64) * PB + (safe % PB), -1)
        gl.store(row_ptr + k, prow.to(gl.int32), mask=km)
        n_good += good.to(gl.int32)
        n_bad += (km & (pos != -1) & (good == 0)).to(gl.int32)
    if hb == 0:
        gl.atomic_add(stats_ptr + STAT_INVALID, gl.sum(n_bad, axis=0).to(gl.int64), sem="relaxed")
        if live:
            gl.atomic_add(stats_ptr + STAT_RESIDENT, gl.sum(n_good, axis=0).to(gl.int64), sem="relaxed")
            if (off == 0) & (sp == 0):
                gl.atomic_add(stats_ptr + STAT_RESOLVES, (off * 0 + 1).to(gl.int64), sem="relaxed")


__all__ = ["PAGED_CHUNK_GL", "paged_row_ptr_gl", "paged_rows_gl"]
