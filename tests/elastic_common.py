"""Helpers shared by the elastic device tier tests (test_elastic_tier*.py): a small
config with ``pages`` pool pages (``cfg``), seeded rows and writes (``rows``,
``fill``), a resolve of (request, positions) lists (``resolve``), the tier's stats
(``tier``), the full state a failed call must leave as it was (``full_state``,
``same_state``) and the comparison of two caches run side by side (``_compare``).
"""

from __future__ import annotations

import torch

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache

from invariants import snapshot

I32 = torch.int32
KERNELS = ["torch", "triton"]
PB = 64  # rows per pool page


def cfg(pages: int | None = 3, **kw) -> HiSparseConfig:
    """2 layers, S = 4, 3 request slots (hot buffers: 15 rows, 64 with the padding),
    ``pages`` pool pages of 64 rows (None: no pool)."""
    base = dict(num_layers=2, host_pool_tokens=512, row_bytes=16, top_k=2, device_buffer_size=4,
                max_num_reqs=3, max_query_len=2, host_block_size=4, max_request_id=8, device="cpu")
    base.update(kw)
    if pages is not None:
        probe = HiSparseConfig(**base)
        base["device_pool_rows"] = probe.hot_rows_per_layer + pages * PB
    return HiSparseConfig(**base)


def rows(n: int, seed: int, width: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


def fill(c: HiSparseCache, rid: int, n: int, seed: int | None = None) -> dict:
    """Admit ``rid`` (if needed) and append ``n`` rows to every layer; returns the rows."""
    if not c.requests.is_live(rid):
        c.add_request(rid)
    out = {}
    for layer in range(c.cfg.num_layers):
        out[layer] = rows(n, (seed if seed is not None else 10 * rid) + layer)
        c.write(layer, rid, out[layer])
    return out


def resolve(c: HiSparseCache, layer: int, rid_pos: list[tuple[int, list[int]]], **kw):
    ids = torch.tensor([rid for rid, _ in rid_pos], dtype=I32)
    K = c.cfg.top_k
    tk = torch.tensor([p + [-1] * (K - len(p)) for _, p in rid_pos], dtype=I32)
    return c.resolve(layer, ids, tk, **kw), ids, tk


def tier(c: HiSparseCache) -> dict:
    t = c.stats()["total"]
    return {k: t[k] for k in ("resident_requests", "hot_requests", "pool_rows_used", "pool_rows_total",
                              "spills", "promotions", "seeded_rows")}


def full_state(c: HiSparseCache) -> dict:
    """Everything a failed call must leave as it was (invariants.snapshot + the rest)."""
    snap = snapshot(c)
    snap["epochs"] = list(c.requests.epochs)
    snap["host_live"] = {(rid, l): c.read_host_rows(l, rid, list(range(c.request(rid).lengths[l])))
                         for rid in c.live_requests() for l in range(c.cfg.num_layers)}
    snap["stats"] = c.stats()
    del snap["pool"]  # rows past a length are not state (a mirror may have written them)
    return snap


def same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "host_live":
            assert a[k].keys() == b[k].keys()
            for kk in a[k]:
                assert torch.equal(a[k][kk], b[k][kk]), (k, kk)
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _compare(a: HiSparseCache, b: HiSparseCache, what: str) -> None:
    for name in ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot", "step",
                 "stats", "resident", "page_table"):
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), (what, name)
    assert torch.equal(a.hot, b.hot), what
    assert a.stats() | {"kernels": ""} == b.stats() | {"kernels": ""}, what
