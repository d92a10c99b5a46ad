"""The offline optimum (Belady) and the LRU model of the cache's slot rules.

Hand-made traces with the expected hits written out; Belady == an exhaustive search
over every eviction choice on tiny traces; Belady >= LRU always; and ``lru_stream``
equals the real cache's per-resolve hit/miss counts (so both simulators model the
cache's fits / reserved-slot rules).
"""

import itertools

import numpy as np
import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse_tools.belady import OptimalTracker, belady_stream, hit_rate, lru_stream


def R(*pos):
    return ("resolve", np.array(pos, dtype=np.int64))


def A(n):
    return ("append", n)


def test_hand_trace_S2():
    # S = 2: append 4 -> slots hold 0, 1; position 3 is in the reserved slot; 2 is host-only
    ev = [A(4), R(2), R(0), R(1), R(0), R(2, 3)]
    bh, bm = belady_stream(ev, 2)
    # Belady: R(2) evicts 1 (next use later than 0) -> {0,2}; R(0) hit; R(1) evicts 2
    # (used at R5, later than 0 at R4) -> {0,1}; R(0) hit; R(2,3): 3 reserved hit, 2 miss
    assert bh.tolist() == [0, 1, 0, 1, 1]
    assert bm.tolist() == [1, 0, 1, 0, 1]
    lh, lm = lru_stream(ev, 2)
    # LRU: both stamped 0 at append, tie -> smaller position 0 evicted -> {1,2}; R(0) miss
    # evicts 1 -> {0,2}; R(1) miss evicts 2 (older) -> {0,1}; R(0) hit; R(2,3) as above
    assert lh.tolist() == [0, 0, 0, 1, 1]
    assert lm.tolist() == [1, 1, 1, 0, 1]


def test_fits_phase_never_misses():
    ev = [A(3), R(0, 1, 2), A(4), R(3, 0), A(5), R(1, 4)]
    for fn in (belady_stream, lru_stream):
        h, m = fn(ev, 5)
        assert m.tolist() == [0, 0, 0]
        assert h.tolist() == [3, 2, 2]


def test_reserved_slot_hit_then_displaced():
    # S = 1: append 3 -> slot 0 holds 0, reserved holds 2
    ev = [A(3), R(2), A(4), R(2), R(3)]
    for fn in (belady_stream, lru_stream):
        h, m = fn(ev, 1)
        # 2 hits in reserved; after append 4 it is host-only: miss; 3 is now reserved: hit
        assert h.tolist() == [1, 0, 1]
        assert m.tolist() == [0, 1, 0]


def test_empty_and_padding():
    h, m = belady_stream([A(5), R(), R(-1, -1)], 2)
    assert h.tolist() == [0, 0] and m.tolist() == [0, 0]
    assert hit_rate(h, m) == 1.0


def test_bad_input():
    with pytest.raises(ValueError, match="positive"):
        belady_stream([A(1)], 0)
    with pytest.raises(ValueError, match="event kind"):
        belady_stream([("write", 1)], 2)
    with pytest.raises(ValueError, match="length"):
        belady_stream([A(2), R(5)], 2)
    with pytest.raises(ValueError, match="too small"):
        lru_stream([A(10), R(5, 6, 7)], 2)


def _brute_force_hits(events, S):
    """Max total hits over every legal eviction choice (exponential; tiny traces only)."""
    best = [-1]

    def go(i, cache, reserved, length, hits):
        if i == len(events):
            best[0] = max(best[0], hits)
            return
        kind, x = events[i]
        if kind == "append":
            c = set(cache) | {p for p in range(length, min(x, S))}
            go(i + 1, frozenset(c), x - 1 if x - 1 >= S else reserved, x, hits)
            return
        u = set(np.unique(x).tolist())
        hit = {p for p in u if p in cache or p == reserved}
        miss = u - hit
        free = S - len(cache)
        need = max(0, len(miss) - free)
        evictable = sorted(cache - u)
        for victims in itertools.combinations(evictable, need):
            go(i + 1, frozenset((cache - set(victims)) | miss), reserved, length, hits + len(hit))

    go(0, frozenset(), -1, 0, 0)
    return best[0]


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 4))
    n = int(rng.integers(S + 1, S + 5))
    ev = [A(n)]
    for _ in range(7):
        if rng.random() < 0.25:
            n += 1
            ev.append(A(n))
        k = int(rng.integers(1, S + 1))
        ev.append(R(*rng.choice(n, size=k, replace=False)))
    h, _ = belady_stream(ev, S)
    assert int(h.sum()) == _brute_force_hits(ev, S)
    lh, _ = lru_stream(ev, S)
    assert int(h.sum()) >= int(lh.sum())


def test_belady_beats_lru_on_a_scan():
    # cyclic scan over S + 1 rows: LRU misses every time, the optimum does not
    S = 4
    ev = [A(20)] + [R(p) for _ in range(5) for p in range(10, 15)]
    lh, lm = lru_stream(ev, S)
    bh, bm = belady_stream(ev, S)
    assert int(lh.sum()) == 0
    assert int(bh.sum()) > 10
    assert int(bh.sum() + bm.sum()) == int(lh.sum() + lm.sum())


@pytest.mark.parametrize("seed", range(3))
def test_lru_model_matches_the_cache(seed):
    """Per resolve, lru_stream's hits/misses equal the real cache's counters."""
    rng = np.random.default_rng(100 + seed)
    S, K, L = 6, 3, 2
    cfg = HiSparseConfig(num_layers=L, host_pool_tokens=256, row_bytes=16, top_k=K,
                         device_buffer_size=S, max_num_reqs=3, host_block_size=4,
                         max_request_id=8, device="cpu")
    cache = HiSparseCache(cfg, kernels="torch")
    streams = {}
    lens = {}
    inst = 0
    ids_live = {}
    got = {}
    for step in range(25):
        # churn: sometimes free a request; keep 1..3 live
        for rid in list(ids_live):
            if rng.random() < 0.1:
                cache.free_request(rid)
                del ids_live[rid]
        while len(ids_live) < 2 or (len(ids_live) < 3 and rng.random() < 0.3):
            rid = min(set(range(8)) - set(ids_live))
            cache.add_request(rid)
            ids_live[rid] = inst
            lens[inst] = 0
            inst += 1
        ids = sorted(ids_live)
        topk = torch.full((len(ids), K), -1, dtype=torch.int32)
        for t, rid in enumerate(ids):
            i = ids_live[rid]
            n_new = int(rng.integers(1, 4))
            for layer in range(L):
                cache.write(layer, rid, torch.zeros((n_new, 16), dtype=torch.uint8))
                streams.setdefault((layer, i), []).append(A(lens[i] + n_new))
            lens[i] += n_new
            k = int(rng.integers(0, min(K, lens[i]) + 1))
            if k:
                topk[t, :k] = torch.from_numpy(
                    rng.choice(lens[i], size=k, replace=False).astype(np.int32))
        for layer in range(L):
            before = cache.stats()["layers"][layer]
            cache.resolve(layer, torch.tensor(ids, dtype=torch.int32), topk)
            after = cache.stats()["layers"][layer]
            for t, rid in enumerate(ids):
                streams[(layer, ids_live[rid])].append(R(*topk[t].tolist()))
            got.setdefault(layer, []).append((after["hits"] - before["hits"],
                                              after["misses"] - before["misses"]))
    # per layer and step totals of the model == the cache's counters
    for layer in range(L):
        want_h = sum(int(lru_stream(ev, S)[0].sum()) for (l2, _), ev in streams.items() if l2 == layer)
        want_m = sum(int(lru_stream(ev, S)[1].sum()) for (l2, _), ev in streams.items() if l2 == layer)
        assert want_h == sum(h for h, _ in got[layer])
        assert want_m == sum(m for _, m in got[layer])
        # and the optimum is never worse
        opt_h = sum(int(belady_stream(ev, S)[0].sum()) for (l2, _), ev in streams.items() if l2 == layer)
        assert opt_h >= want_h


def test_tracker_aggregates_per_layer_and_step():
    tr = OptimalTracker(num_layers=2, buffer_size=2)
    tr.append(0, 7, 4)
    tr.resolve(0, 7, 0, np.array([2, -1]))
    tr.resolve(0, 7, 1, np.array([0, 2, 2]))
    tr.append(1, 9, 1)
    tr.resolve(1, 9, 1, np.array([0]))
    out = tr.compute(2)
    assert out["hits"].tolist() == [[0, 2], [0, 1]]
    assert out["misses"].tolist() == [[1, 0], [0, 0]]
