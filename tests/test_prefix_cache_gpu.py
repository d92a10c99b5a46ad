"""Prefix caching on CUDA with the Triton kernels: the randomized churn trace of
``tests/test_prefix_cache.py`` (``prefix_trace.PrefixTrace``) at larger shapes
(top-k 64 and 512, fp8_ds_mla-sized rows, prompts longer than the hot buffer, a host
pool small enough to evict), byte-exact: every resolved physical row, every hot row
and every host row of a live request against the rows the model says belong there,
plus the block ids / aliases / references / evictions against the plain model. Needs
a CUDA GPU (skipped without one).
"""

from __future__ import annotations

import time

import pytest

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache

from prefix_trace import PrefixTrace

pytestmark = pytest.mark.gpu

SHAPES = {
    # top-k 64, S = 128, blocks of 16: prompts of 1..8 blocks plus a suffix exceed S
    "K64_B16": (dict(num_layers=2, row_bytes=656, top_k=64, device_buffer_size=128, host_block_size=16,
                     max_num_reqs=6, host_pool_tokens=16 * 32, max_request_id=32),
                dict(group_len=(1, 8), suffix=(0, 40), vocab=2000)),
    # top-k 512, S = 1024, blocks of 64: shared prefixes up to 20 blocks (1280 tokens)
    "K512_B64": (dict(num_layers=2, row_bytes=656, top_k=512, device_buffer_size=1024, host_block_size=64,
                      max_num_reqs=4, host_pool_tokens=64 * 44, max_request_id=32),
                 dict(group_len=(2, 20), suffix=(0, 150), vocab=30000)),
}


def run(shape: str, seed: int, n_ops: int, *, device: str = "cuda", kernels: str = "auto",
        aliases=None, full_every: int = 1, pool_pages: int | None = None) -> PrefixTrace:
    cfg_kw, trace_kw = SHAPES[shape]
    rows = None
    if pool_pages is not None:  # the elastic tier: the hot buffers plus pool_pages pages of 64 rows
        R, SP = cfg_kw["max_num_reqs"], cfg_kw["device_buffer_size"] + 1
        rows = -(-R * SP // 64) * 64 + pool_pages * 64
    cache = HiSparseCache(HiSparseConfig(device=device, prefix_caching=True, prefix_alias_blocks=aliases,
                                         device_pool_rows=rows, **cfg_kw), kernels=kernels)
    if device == "cuda" and kernels == "auto":
        assert cache.kernels == "triton", cache.kernels
    t = PrefixTrace(cache, seed, full_every=full_every, **trace_kw)
    t0 = time.perf_counter()
    t.check()
    t.run(n_ops)
    counts = dict(t.counts)
    t.finish()
    print(f"{shape} seed {seed} aliases={aliases}: {n_ops} ops in {time.perf_counter() - t0:.1f} s, "
          f"evictions {t.model.evictions}, {counts}")
    t.counts.update(evictions=t.model.evictions)
    return t


@pytest.mark.parametrize("aliases", [None, 0], ids=["aliases", "no_aliases"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_churn_trace_byte_exact_on_cuda(shape, aliases):
    hits = aliased = evicted = 0
    for seed in range(2):
        # the larger shape checks every row and the whole LRU state every 4th op (the
        # cheaper checks every op): the full check of its 4 x 1025 slots dominates otherwise
        t = run(shape, seed, 300, aliases=aliases, full_every=4 if shape == "K512_B64" else 1)
        hits += t.counts["hit_tokens"]
        aliased += t.counts.get("alias_maps", 0)
        evicted += t.counts["evictions"]
        assert t.counts["resolve"] > 50, dict(t.counts)
    assert hits > 0 and evicted > 0, (hits, evicted)
    assert aliases == 0 or aliased > 0, aliased


def test_churn_trace_shares_prefix_pages_on_cuda():
    """The elastic tier with shared prefix pages (``share_prefix_pages``): prompts of up to
    20 blocks of 64 rows share whole device pages with their group's resident request; a
    pool of 24 pages spills holders and sharers. Every resident request's page rows and
    every resolved row byte-exact, the pages and their references against the sim."""
    joins = shares = spills = 0
    for seed in range(2):
        t = run("K512_B64", seed, 300, pool_pages=24, full_every=4)
        joins += t.counts.get("resident_joins", 0)
        shares += t.counts.get("page_shares", 0)
        spills += t.sim.spills
    assert shares > 0 and spills > 0, (joins, shares, spills)
