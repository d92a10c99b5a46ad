"""The elastic device tier (``HiSparseConfig(device_pool_rows=...)``) on CPU.

Config sizes; randomized traces with a pool that overflows, through every write path
(per-layer appends, token appends, batched multi-row writes, eager and padded steps)
and every resolve path (resolve, split resolve, prefetch), checked after every op
against ``tests/invariants.py`` and its sim (``tests/lru_sim.py``, which models
residency, the spill policy and the seeding) with the torch reference and the Triton
kernels (interpreter), and the two side by side (identical state, bytes and stats);
resident counters; the mini engine end to end with a pool. The spill policy is in
test_elastic_tier_spill.py, failed calls and rollbacks in test_elastic_tier_failures.py.
"""

from __future__ import annotations

import random

import pytest

from hisparse.cache.cache import HiSparseCache
from hisparse.cache.state import STAT_RESIDENT
from hisparse.cache.write_step import StepCapacity

from elastic_common import KERNELS, PB, _compare, cfg, fill, resolve, rows, tier
from invariants import check_cache
from trace_runner import TraceRunner, tier_trace


# ------------------------------------------------------------------------- config
def test_no_pool_keeps_todays_shapes_and_every_request_hot():
    c = HiSparseCache(cfg(pages=None), kernels="torch")
    k = c.cfg
    assert k.device_pool_rows is None and k.pool_pages == 0 and k.max_pages_per_request == 0
    assert k.device_rows_per_layer == k.hot_rows_per_layer == 64
    assert c.hot.shape == (2, k.hot_rows_per_layer, 16)
    assert c.state.page_table.shape == (3, 1) and not c.dpool.enabled
    fill(c, 1, 70)
    assert c.residency(1) == "hot" and int(c.state.resident[0]) == 0
    assert tier(c) == dict(resident_requests=0, hot_requests=1, pool_rows_used=5, pool_rows_total=64,
                           spills=0, promotions=0, seeded_rows=0)
    check_cache(c)


@pytest.mark.parametrize("pool_rows", [1, 14])
def test_a_pool_smaller_than_the_hot_buffers_is_refused(pool_rows):
    # hot buffers: max_num_reqs x (S + 1) = 3 x 5 = 15 rows
    with pytest.raises(ValueError, match=rf"device_pool_rows={pool_rows} is smaller than the hot buffers it "
                       r"includes: max_num_reqs x \(device_buffer_size \+ 1\) = 3 x 5 = 15; give at least 15"):
        cfg(pages=None, device_pool_rows=pool_rows)


@pytest.mark.parametrize("bad,err", [(0, ValueError), (-3, ValueError), (100.0, TypeError), (True, TypeError),
                                     ("128", TypeError)])
def test_a_pool_size_that_is_not_a_positive_int_is_refused(bad, err):
    with pytest.raises(err, match="device_pool_rows must be"):
        cfg(pages=None, device_pool_rows=bad)


@pytest.mark.parametrize("pool_rows,pages,dev_rows,max_pages", [
    (15, 0, 64, 0),  # exactly the hot buffers (rounded up to 64 rows): no page
    (64, 0, 64, 0),
    (127, 0, 64, 0),  # a partial page is not a page
    (128, 1, 128, 1),
    (64 + 5 * 64 + 63, 5, 384, 5),
    (64 + 20 * 64, 20, 64 + 20 * 64, 8),  # a request holds at most its host capacity (512 rows)
])
def test_pool_sizes(pool_rows, pages, dev_rows, max_pages):
    k = cfg(pages=None, device_pool_rows=pool_rows)
    assert (k.pool_pages, k.device_rows_per_layer, k.max_pages_per_request) == (pages, dev_rows, max_pages)
    assert k.hot_buffer_bytes == 2 * dev_rows * 16
    c = HiSparseCache(k, kernels="torch")
    assert c.hot.shape == (2, dev_rows, 16) and c.dpool.num_pages == pages
    assert c.state.page_table.shape == (3, max(1, max_pages)) and c.state.pool_base == 64
    c.add_request(5)
    assert c.residency(5) == ("resident" if pages else "hot")
    assert tier(c)["pool_rows_total"] == dev_rows


# ------------------------------------------------------------------ random traces
TRACE_CONFIGS = {
    # 3 pages for 3 requests of up to ~130 rows: the pool overflows often
    "p3": dict(pages=3),
    # one page, 1-token blocks: most writes demote; max_pages = 1 (a request past 64 rows goes hot)
    "p1_B1": dict(pages=1, host_block_size=1, host_pool_tokens=320),
    # q = 1, K = 4, S = 8, a bigger host pool
    "p4_K4": dict(pages=4, top_k=4, device_buffer_size=8, max_query_len=1, host_pool_tokens=640),
}


@pytest.mark.parametrize("name", sorted(TRACE_CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_tier_trace_torch(name, seed):
    c = HiSparseCache(cfg(**TRACE_CONFIGS[name]), kernels="torch")
    runner = TraceRunner(c, seed=seed)
    tier_trace(runner, random.Random(1000 + seed), 400)
    t = c.stats()["total"]
    assert t["spills"] > 0 and t["seeded_rows"] > 0 and t["resident_rows"] > 0, t
    assert t["misses"] > 0 and t["promotions"] == 0, t


@pytest.mark.parametrize("name,pages", [("p3", 2), ("p1_B1", 1)])
def test_random_tier_trace_triton(name, pages):
    c = HiSparseCache(cfg(**(TRACE_CONFIGS[name] | {"pages": pages})), kernels="triton")
    runner = TraceRunner(c, seed=5)
    tier_trace(runner, random.Random(5), 160)
    t = c.stats()["total"]
    assert t["spills"] > 0 and t["resident_rows"] > 0 and t["misses"] > 0, t


def test_torch_and_triton_side_by_side_identical():
    """The same trace on a torch and a Triton cache: identical state tensors, device
    rows (hot buffers and pages) and stats after every op."""
    caches = [HiSparseCache(cfg(pages=2), kernels=k) for k in KERNELS]
    runners = [TraceRunner(c, seed=11) for c in caches]
    rng = random.Random(11)
    for i in range(140):
        state = rng.getstate()
        for r in runners:  # each runner draws the same op (and, with equal sims, the same data)
            rng.setstate(state)
            tier_trace(r, rng, 1)
        _compare(*caches, f"op {i}")
    assert caches[0].stats()["total"]["spills"] > 0


def test_padded_steps_with_resident_requests():
    """Steps padded to a bucket (the CUDA-graph path's persistent lists, -1 padding) write
    resident and hot requests alike, demotions included."""
    for kernels in KERNELS:
        c = HiSparseCache(cfg(pages=2), kernels=kernels)
        runner = TraceRunner(c, seed=3)
        sim = runner.sim
        for rid in (0, 1, 2):
            sim.add(rid, c.add_request(rid))
        cap = StepCapacity(requests=3, tokens=3 * 40)
        for i, counts in enumerate([[40, 1, 3], [30, 1, 1], [1, 40, 1], [1, 1, 1], [0, 25, 30]]):
            step = c.prepare_step(c.plan_write([0, 1, 2], counts), capacity=cap)
            new = rows(cap.tokens, 7 * i)
            for layer in range(2):
                c.write_step(layer, step, new)
            runner._record(range(2), [0, 1, 2], counts, new)
            sim.write(range(2), list(zip([0, 1, 2], counts)))
            check_cache(c, sim, runner.truth)
        assert c.stats()["total"]["spills"] >= 1


# ------------------------------------------------------------------ resident counters
def test_resident_counters_count_entries_not_unique_rows():
    c = HiSparseCache(cfg(pages=3), kernels="torch")
    fill(c, 1, 10)
    res, ids, tk = resolve(c, 0, [(1, [3, 3]), (1, [3, 9])], validate=False)
    assert int(c.state.stats[0, STAT_RESIDENT]) == 4 and res.valid_counts.tolist() == [2, 2]
    assert int(c.state.step[0, 0]) == 0  # a resident resolve does not step
    out = c.prefetch(0, ids, tk)  # a prefetch of a resident request stages and counts nothing
    assert out.stage_counts[:2].tolist() == [0, 0]
    t = c.stats()["total"]
    assert (t["resident_rows"], t["resolves"], t["prefetch_rows"], t["hit_rate"]) == (4, 1, 0, 1.0)


@pytest.mark.parametrize("pages", [1, 3])
def test_mini_engine_with_a_pool_matches_the_resident_reference(pages, monkeypatch):
    """The engine façade end to end (chunked prefill steps, decode steps, resolves) on a
    cache with an elastic tier that spills: outputs bit-identical to the resident KV."""
    import dataclasses

    from hisparse_tools import mini_engine as me
    from hisparse_tools.mini_engine import config as mc

    plain = mc.MiniEngineConfig.cache_config

    def with_pool(self):
        k = plain(self)
        return dataclasses.replace(k, device_pool_rows=k.hot_rows_per_layer + pages * PB)

    monkeypatch.setattr(mc.MiniEngineConfig, "cache_config", with_pool)
    seen = {}
    stats = HiSparseCache.stats

    def keep(self):
        out = stats(self)
        seen.update(out["total"])
        return out

    monkeypatch.setattr(HiSparseCache, "stats", keep)
    res = me.run(me.MiniEngineConfig())
    c = res["compare"]
    assert c["within_tolerance"] and c["bitwise_equal"] and c["argmax_mismatches"] == 0, c
    assert seen["spills"] > 0 and seen["resident_rows"] > 0 and seen["seeded_rows"] > 0, seen
