"""``HiSparseCache.write`` of a planned batch: the batched write path equals per-request
per-request ``write`` exactly (state tensors, hot rows, host rows, blocks, host mirrors),
including plan reuse across layers and across add/free; CapacityError and bad input
change nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.graphs import WriteCall
from hisparse.cache.host_pool import HostPool
from hisparse.cache.write_plan import _NAMES, Resident, _runs_plan, _single_row_plan, expand_runs
from hisparse.cache.write_step import StepCapacity

from invariants import check_cache, snapshot

ROW_BYTES = 16


def make_cfg(**kw) -> HiSparseConfig:
    base = dict(num_layers=3, host_pool_tokens=96, row_bytes=ROW_BYTES, top_k=2, device_buffer_size=5,
                max_num_reqs=4, max_query_len=2, host_block_size=3, max_request_id=10, device="cpu")
    base.update(kw)
    return HiSparseConfig(**base)


def full_state(c: HiSparseCache) -> dict:
    """Everything the write path changes, host mirrors included (CPU copies)."""
    snap = snapshot(c)
    snap["reserved"] = {rid: [c.requests.reserved(c.request(rid).slot, l) for l in range(c.cfg.num_layers)]
                        for rid in c.live_requests()}
    snap["pool_live"] = {
        rid: [c.read_host_rows(l, rid, list(range(c.request(rid).lengths[l]))) for l in range(c.cfg.num_layers)]
        for rid in c.live_requests()}
    return snap


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "pool":  # rows of free blocks are stale memory: compared via pool_live
            continue
        if k == "pool_live":
            for rid in a[k]:
                for x, y in zip(a[k][rid], b[k][rid]):
                    assert torch.equal(x, y), (k, rid)
            continue
        eq = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert eq, k


def test_expand_runs():
    assert expand_runs([]).tolist() == []
    assert expand_runs([(5, 3, 1), (2, 2, 0), (10, 1, 7), (0, 0, 1)]).tolist() == [5, 6, 7, 2, 2, 10]


@pytest.mark.parametrize("seed", range(6))
def test_single_row_plan_equals_runs_plan(seed):
    """The decode-step fast path builds the same index lists, in the same order, from the
    same new blocks as the general runs-based plan (and takes none): random single-row work
    across the fits phase, the reserved slot (with and without a previous occupant),
    block boundaries and a skipped block."""
    rng = random.Random(seed)
    cfg = make_cfg(host_pool_tokens=3 * 40, max_num_reqs=6)
    S, B = cfg.device_buffer_size, cfg.host_block_size
    pools = [HostPool(cfg, pin=False), HostPool(cfg, pin=False)]
    work, t0 = [], 0
    for r in rng.sample(range(6), 5):
        p0 = rng.choice([0, 1, S - 1, S, S + 1, B * 2, B * 3 - 1, rng.randrange(0, 20)])
        have = rng.choice([-(-p0 // B), -(-(p0 + 1) // B)])  # sometimes the row opens a block
        if rng.random() < 0.2:
            have = max(0, p0 // B - 1)  # skip a block: both paths allocate the gap
        for pool in pools:
            pool.allocator.allocate(r, have)
        old = rng.choice([-1, max(0, p0 - 1)]) if p0 >= S else -1
        old = old if old < len(pools[0].allocator.owned(r)) * B else -1
        work.append((r, p0, p0 + 1, t0, old))
        t0 += 1
    pool = pools[0]
    need = [(r, pool.blocks_needed(r, p1)) for r, _, p1, _, _ in work]
    upcoming = pool.allocator.peek(sum(n for _, n in need))
    new_blocks, o = {}, 0
    for r, n in need:
        if n:
            new_blocks[r] = upcoming[o:o + n]
            o += n
    owned = {r: list(pool.allocator.owned(r)) for r, *_ in work}
    kw = dict(owned=owned, new_blocks=new_blocks, B=B, S=S)
    (fa, sa), (fb, sb) = _single_row_plan(work, **kw), _runs_plan(work, **kw)
    assert sa == sb, dict(zip(_NAMES, zip(sa, sb)))
    assert fa.dtype == fb.dtype == torch.int64 and torch.equal(fa, fb), (fa.tolist(), fb.tolist())
    # the same with some requests resident (the elastic tier: page rows, no slot state)
    pages = {r: rng.sample(range(1000), p1 // 64 + 1) for r, _, p1, _, _ in work if rng.random() < 0.5}
    kw["resident"] = Resident(pages, base=4096, PB=64)
    (fa, sa), (fb, sb) = _single_row_plan(work, **kw), _runs_plan(work, **kw)
    assert sa == sb, dict(zip(_NAMES, zip(sa, sb)))
    assert torch.equal(fa, fb), (fa.tolist(), fb.tolist())
    assert pool.allocator.peek(len(upcoming)) == upcoming  # planning took nothing


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batch_equals_per_request_appends(kernels, seed):
    """Random batches (counts 0..4, contexts crossing S and block edges) applied to every
    layer in turn (plan reused), with requests freed and admitted in between."""
    rng = random.Random(seed)
    cfg = make_cfg()
    a = HiSparseCache(cfg, kernels=kernels)
    b = HiSparseCache(cfg, kernels="torch")
    live: list[int] = []
    next_id = 0
    for step in range(8):
        if len(live) < cfg.max_num_reqs and (not live or rng.random() < 0.4):
            for c in (a, b):
                c.add_request(next_id)
            live.append(next_id)
            next_id += 1
        if len(live) > 1 and rng.random() < 0.2:
            rid = live.pop(rng.randrange(len(live)))
            for c in (a, b):
                c.free_request(rid)
        ids = rng.sample(live, rng.randint(1, len(live)))
        counts = [rng.choice([0, 1, 1, 2, 4]) for _ in ids]
        for layer in range(cfg.num_layers):
            rows = torch.randint(0, 256, (sum(counts), ROW_BYTES), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(1000 * step + layer))
            try:
                firsts = a.write(layer, a.plan_write(ids, counts), rows)
            except CapacityError:
                before = full_state(b)
                with pytest.raises(CapacityError):
                    b.write(layer, b.plan_write(ids, counts), rows)
                same(before, full_state(b))
                break
            want, t0 = [], 0
            for rid, n in zip(ids, counts):
                want.append(b.write(layer, rid, rows[t0:t0 + n])[0])
                t0 += n
            assert firsts == want
            same(full_state(a), full_state(b))
        check_cache(a)


def test_token_rows_wrapper_and_plan_reuse():
    cfg = make_cfg()
    c = HiSparseCache(cfg, kernels="torch")
    for rid in (3, 7):
        c.add_request(rid)
    c.write(0, c.plan_write([3, 7], [6, 3]), torch.zeros((9, ROW_BYTES), dtype=torch.uint8))
    plan0 = c.writer._plan[1]
    c.write(1, c.plan_write([3, 7], [6, 3]), torch.ones((9, ROW_BYTES), dtype=torch.uint8))
    assert c.writer._plan[1] is plan0  # same positions in the next layer: plan reused
    c.write(2, c.plan_write([3, 7], [6, 3]), torch.ones((9, ROW_BYTES), dtype=torch.uint8))
    assert c.write(0, c.plan_write([7, 3], [1, 1]), torch.full((2, ROW_BYTES), 5, dtype=torch.uint8)) == [3, 6]
    assert c.request(7).lengths[0] == 4 and c.request(3).lengths[0] == 7 and c.request(3).lengths[1] == 6
    assert c.state.seq_lens[:, c.request(3).slot].tolist() == [7, 6, 6]
    assert c.write(0, c.plan_write([], []), torch.zeros((0, ROW_BYTES), dtype=torch.uint8)) == []
    assert c.write(1, c.plan_write([3], [0]), torch.zeros((0, ROW_BYTES), dtype=torch.uint8)) == [6]
    check_cache(c)


def test_capacity_error_changes_nothing():
    cfg = make_cfg(host_pool_tokens=12)  # 4 blocks of 3
    c = HiSparseCache(cfg, kernels="torch")
    c.add_request(1)
    c.add_request(2)
    c.write(0, c.plan_write([1], [5]), torch.zeros((5, ROW_BYTES), dtype=torch.uint8))  # 2 blocks
    before = full_state(c)
    with pytest.raises(CapacityError, match="host pool full"):
        c.write(0, c.plan_write([1, 2], [2, 6]), torch.zeros((8, ROW_BYTES), dtype=torch.uint8))
    same(before, full_state(c))
    assert c.write(0, c.plan_write([1, 2], [1, 6]), torch.zeros((7, ROW_BYTES), dtype=torch.uint8)) == [5, 0]


U8 = torch.uint8


@pytest.mark.parametrize("args,exc,match", [
    (([1, 1], torch.zeros((2, ROW_BYTES), dtype=U8), [1, 1]), ValueError, "distinct"),
    (([1, 2], torch.zeros((2, ROW_BYTES), dtype=U8), [2]), ValueError, "2 request ids but 1 counts"),
    (([1, 2], torch.zeros((2, ROW_BYTES), dtype=U8), [3, -1]), ValueError, "counts entry must be >= 0"),
    (([1, 2], torch.zeros((2, ROW_BYTES), dtype=U8), [1.0, 1]), TypeError, "counts entry must be an int"),
    (([1, 2], torch.zeros((3, ROW_BYTES), dtype=U8), [1, 1]), ValueError, "counts sum to 2"),
    (([1, 4], torch.zeros((2, ROW_BYTES), dtype=U8), [1, 1]), ValueError, "not live"),
    (([1, 99], torch.zeros((2, ROW_BYTES), dtype=U8), [1, 1]), ValueError, "out of range"),
    (([1], torch.zeros((1, ROW_BYTES + 1), dtype=U8), [1]), ValueError, "row_bytes"),
    (([1], torch.zeros((1, ROW_BYTES), dtype=torch.int8), [1]), TypeError, "dtype"),
    (([1], [[0] * ROW_BYTES], [1]), TypeError, "torch.Tensor"),
])
def test_bad_input_changes_nothing(args, exc, match):
    c = HiSparseCache(make_cfg(), kernels="torch")
    for rid in (1, 2):
        c.add_request(rid)
    c.write(0, 1, torch.ones((2, ROW_BYTES), dtype=U8))
    before = full_state(c)
    with pytest.raises(exc, match=match):
        ids, rows, counts = args
        c.write(0, c.plan_write(ids, counts), rows)
    with pytest.raises(ValueError, match="layer"):
        c.write(3, c.plan_write([1], [1]), torch.zeros((1, ROW_BYTES), dtype=U8))
    same(before, full_state(c))


def test_write_batch_serves_every_layer_until_requests_change():
    """A batch checked once by plan_write serves write() of every layer; add/free_request
    makes it out of date (refused, nothing changed), rows are checked on every write."""
    c = HiSparseCache(make_cfg(), kernels="torch")
    for rid in (1, 2):
        c.add_request(rid)
    batch = c.plan_write([1, 2], [1, 2])
    rows = torch.zeros((3, ROW_BYTES), dtype=U8)
    assert c.write(0, batch, rows) == [0, 0]
    assert c.write(1, batch, rows) == [0, 0]
    with pytest.raises(ValueError, match="counts sum to 3"):  # rows still checked
        c.write(2, batch, torch.zeros((4, ROW_BYTES), dtype=U8))
    c.free_request(2)
    before = full_state(c)
    with pytest.raises(ValueError, match="out of date"):
        c.write(2, batch, rows)
    same(before, full_state(c))
    with pytest.raises(ValueError, match="not live"):
        c.plan_write([1, 2], [1, 2])
    assert c.write(2, c.plan_write((1,), (1,)), torch.zeros((1, ROW_BYTES), dtype=U8)) == [0]


def _twin_caches(kernels: str) -> tuple[HiSparseCache, HiSparseCache]:
    """Two caches of one config with one admission each (so their request tables'
    generations agree): request 1 in x and request 2 in y, both in request slot 0 with
    4 rows in every layer."""
    x, y = (HiSparseCache(make_cfg(), kernels=kernels) for _ in range(2))
    for c, rid in ((x, 1), (y, 2)):
        c.add_request(rid)
        batch = c.plan_write([rid], [4])
        for layer in range(c.cfg.num_layers):
            c.write(layer, batch, torch.full((4, ROW_BYTES), 10 * rid + layer, dtype=U8))
    return x, y


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_write_handles_of_another_cache_are_refused(kernels):
    """A WriteBatch (plan_write) and a StepPlan (prepare_step) are bound to the cache that
    made them: every call of another cache that takes one refuses it (ValueError) before
    anything changes in either cache, though the generations coincide; the cache that
    made them still takes them."""
    x, y = _twin_caches(kernels)
    batch = x.plan_write([1], [1])
    step = x.prepare_step(batch)
    rows = torch.full((1, ROW_BYTES), 99, dtype=U8)
    launched = []
    calls = {"write": lambda: y.write(0, batch, rows), "prepare_step": lambda: y.prepare_step(batch),
             "write_step": lambda: y.write_step(0, step, rows),
             "graphs.plan_write": lambda: y.graphs.plan_write(0, step),
             "WriteCall.run": lambda: WriteCall(y, 0, step).run(replay=lambda: launched.append(0)),
             "request": lambda: y.request(2, step),
             "replaces": lambda: y.prepare_step(y.plan_write([2], [1]), replaces=step)}
    before = full_state(x), full_state(y)
    for name, call in calls.items():
        with pytest.raises(ValueError, match="another cache"):
            call()
        same(before[0], full_state(x))
        same(before[1], full_state(y))
    assert not launched
    check_cache(y)
    x.write_step(0, step, rows)
    assert x.read_host_rows(0, 1, [4]).tolist() == rows.tolist()
    assert x.write(0, x.plan_write([1], [1]), rows) == [5]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_step_of_zero_rows_is_a_no_op_on_every_write_path(kernels, padded):
    """A batch whose counts are all 0: write() of each layer and, for its prepared step,
    graphs.plan_write / write_step (and a planned call's run with a replay, for a padded
    step) accept it, any
    number of times, launch nothing and change nothing, as write() of the batch does."""
    c = HiSparseCache(make_cfg(), kernels=kernels)
    for rid in (1, 2):
        c.add_request(rid)
    c.write(0, c.plan_write([1, 2], [3, 1]), torch.ones((4, ROW_BYTES), dtype=U8))
    for layer in (1, 2):
        c.write(layer, c.plan_write([1, 2], [3, 1]), torch.ones((4, ROW_BYTES), dtype=U8))
    batch = c.plan_write([1, 2], [0, 0])
    before = full_state(c)
    step = c.prepare_step(batch, capacity=StepCapacity(requests=2, tokens=2) if padded else None)
    none = torch.zeros((step.rows, ROW_BYTES), dtype=U8)
    launched = []
    for _ in range(2):
        for layer in range(c.cfg.num_layers):
            assert c.write(layer, batch, none[:0]) == [3, 1]
            call = c.graphs.plan_write(layer, step)
            c.write_step(layer, step, none)
            if padded:
                call.run(replay=lambda: launched.append(layer))
            assert c.request(1, step).lengths == (3, 3, 3)
    assert not launched
    same(before, full_state(c))
    check_cache(c)
    with pytest.raises(ValueError, match="but rows has"):  # rows are still checked
        c.write_step(0, step, torch.zeros((step.rows + 1, ROW_BYTES), dtype=U8))
