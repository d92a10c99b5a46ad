"""Split resolves (hit phase, then miss phase + staging) and prefetches, on CPU.

A split resolve must leave the cache bit-identical to a serial ``resolve`` of the same
inputs (slot maps, stamps, steps, counters, hot rows), return as hits exactly the
entries that were hot before the call, and list every other valid entry as a miss of
its token, with the hot row it lands in and its host row. Checked on random traces
with multi-token groups, repeated positions, padding, invalid entries and a second
run of one request, with the torch reference and the Triton kernels (interpreter).
A prefetch stages a predicted selection; the next resolve finds it hot.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from invariants import check_cache

I32 = torch.int32
KERNELS = ["torch", "triton"]
STATE = ("slot_pos", "slot_stamp", "row_slot", "step", "stats", "seq_lens", "block_table")


def make(kernels: str, q: int = 2) -> HiSparseCache:
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=512, row_bytes=32, top_k=5, device_buffer_size=12,
                         max_num_reqs=4, max_query_len=q, host_block_size=8, max_request_id=10, device="cpu")
    return HiSparseCache(cfg, kernels=kernels)


def fill(c: HiSparseCache, lens: dict[int, int]) -> dict:
    truth = {}
    for rid, n in lens.items():
        c.add_request(rid)
        for layer in range(c.cfg.num_layers):
            g = torch.Generator().manual_seed(31 * rid + layer)
            truth[(rid, layer)] = torch.randint(0, 256, (n, c.cfg.row_bytes), dtype=torch.uint8, generator=g)
            c.write(layer, rid, truth[(rid, layer)])
    return truth


def random_step(rng: random.Random, lens: dict[int, int], q: int, K: int):
    """req_ids [T], topk [T, K]: groups of q tokens (one request twice, unchecked),
    repeated positions, padding and a few out-of-range entries."""
    ids, rows = [], []
    reqs = list(lens)
    rng.shuffle(reqs)
    for rid in reqs:
        for _ in range(rng.choice([1, q])):
            n = lens[rid]
            row = [rng.randrange(n) for _ in range(K)]
            if rng.random() < 0.3:
                row[rng.randrange(K)] = row[0]  # repeated position
            if rng.random() < 0.3:
                row[-1] = -1
            if rng.random() < 0.1:
                row[1] = n + 3  # invalid: counted, treated as padding
            ids.append(rid)
            rows.append(row)
    if rng.random() < 0.3:  # a second run of the first request (not resolved, counted invalid)
        ids.append(ids[0])
        rows.append([0] * K)
    return torch.tensor(ids, dtype=I32), torch.tensor(rows, dtype=I32)


def hot_before(c: HiSparseCache, layer: int, ids: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """bool [T, K]: entries whose row is hot before the call (first run of a live id)."""
    T, K = topk.shape
    out = torch.zeros((T, K), dtype=torch.bool)
    seen: set[int] = set()
    prev = None
    run = 0
    for t in range(T):
        rid = int(ids[t])
        run = run + 1 if rid == prev else 1
        first = rid != prev and rid not in seen
        if rid != prev:
            ok_run = first
        seen.add(rid)
        prev = rid
        if not ok_run or run > c.cfg.max_query_len:
            continue
        r = c.request(rid).slot
        n = c.request(rid).lengths[layer]
        for k in range(K):
            p = int(topk[t, k])
            if 0 <= p < n:
                h = int(c.pool.host_rows(r, torch.tensor([p]))[0])
                out[t, k] = int(c.state.row_slot[layer, h]) >= 0
    return out


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_equals_serial(kernels, seed):
    rng = random.Random(seed)
    lens = {1: 40, 3: 9, 6: 27}
    a, b = make(kernels), make(kernels)
    truth = fill(a, lens)
    fill(b, lens)
    for step in range(6):
        layer = step % 2
        ids, topk = random_step(rng, lens, 2, 5)
        was_hot = hot_before(a, layer, ids, topk)
        res = a.resolve(layer, ids, topk, validate=False, split=True)
        want = b.resolve(layer, ids, topk, validate=False)
        for name in STATE:
            assert torch.equal(getattr(a.state, name), getattr(b.state, name)), (step, name)
        assert torch.equal(res.physical, want.physical) and torch.equal(res.valid_counts, want.valid_counts)
        assert torch.equal(a.hot, b.hot)
        # hits: exactly the entries hot before, at their (unchanged) rows
        hit = res.hit_physical
        assert torch.equal(hit >= 0, was_hot), step
        assert torch.equal(hit[was_hot], want.physical[was_hot])
        # misses: every other valid entry, compacted per token, with its host row
        valid_miss = (want.physical >= 0) & ~was_hot
        for t in range(topk.shape[0]):
            m = int(res.miss_counts[t])
            assert m == int(valid_miss[t].sum()), (step, t)
            assert res.miss_physical[t, :m].tolist() == want.physical[t][valid_miss[t]].tolist()
            rid = int(ids[t])
            if m:
                pos = topk[t][valid_miss[t]].long()
                hosts = a.pool.host_rows(a.request(rid).slot, pos)
                assert res.miss_host[t, :m].tolist() == hosts.tolist()
                assert torch.equal(a.hot_rows(layer)[res.miss_physical[t, :m].long()], truth[(rid, layer)][pos])
        check_cache(a)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("site", ["lookup", "resolve", "copy_staged"])
def test_split_failure_changes_nothing(kernels, site):
    a, twin = make(kernels), make(kernels)
    lens = {1: 40, 3: 9, 6: 27}
    fill(a, lens)
    fill(twin, lens)
    rng = random.Random(5)
    for c in (a, twin):
        r2 = random.Random(9)
        for _ in range(3):
            ids, topk = random_step(r2, lens, 2, 5)
            c.resolve(1, ids, topk, validate=False)
    ids, topk = random_step(rng, lens, 2, 5)
    before = {n: getattr(a.state, n).clone() for n in STATE}
    hot = a.hot.clone()
    good = getattr(a.kernel_set, site)

    def boom(*_a, **_k):
        raise RuntimeError("injected")
    setattr(a.kernel_set, site, boom)
    with pytest.raises(RuntimeError, match="injected"):
        a.resolve(1, ids, topk, validate=False, split=True)
    setattr(a.kernel_set, site, good)
    for n in STATE:
        assert torch.equal(getattr(a.state, n), before[n]), n
    assert torch.equal(a.hot, hot)
    x, y = a.resolve(1, ids, topk, validate=False, split=True), twin.resolve(1, ids, topk, validate=False)
    assert torch.equal(x.physical, y.physical)
    for n in STATE:
        assert torch.equal(getattr(a.state, n), getattr(twin.state, n)), n


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefetch_makes_the_next_resolve_hit(kernels):
    c = make(kernels, q=1)
    truth = fill(c, {1: 60, 3: 50})
    ids = torch.tensor([1, 3], dtype=I32)
    pred = torch.tensor([[50, 51, 52, 70, -1], [40, 41, 42, 43, 44]], dtype=I32)  # 70: not there yet
    before = c.stats()["layers"][1]
    c.prefetch(1, ids, pred)
    mid = c.stats()["layers"][1]
    assert mid["prefetch_rows"] - before["prefetch_rows"] == 8
    assert mid["invalid"] == before["invalid"] and mid["misses"] == before["misses"]
    assert mid["resolves"] == before["resolves"]
    topk = torch.tensor([[50, 51, 52, 53, 5], [40, 41, 42, 43, 44]], dtype=I32)
    res = c.resolve(1, ids, topk)
    after = c.stats()["layers"][1]
    assert after["misses"] - mid["misses"] == 1  # only 53 was not predicted (5 is still hot: the prefetch evicted positions 0-2)
    for t, rid in enumerate((1, 3)):
        assert torch.equal(c.hot_rows(1)[res.physical[t].long()], truth[(rid, 1)][topk[t].long()])
    assert after["bytes_h2d"] - before["bytes_h2d"] == 9 * c.cfg.row_bytes
    check_cache(c)
