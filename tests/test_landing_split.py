"""Landing split resolves (``resolve_split(..., land=True)`` + ``finish_split``), on CPU.

The hit phase also lists each token's misses; the stage stream copies those host rows
into the cache's landing rows before the miss phase has chosen their slots; the miss
phase and the copy of the landed rows into their slots come with ``finish_split``.
After it the cache must be bit-identical to a serial ``resolve`` of the same inputs,
the landing rows must hold each token's miss rows in the order of its miss lists, and
until it every other launching call is refused. A failure at any launch, or an
``abort_split``, leaves the cache as it was. Random traces with multi-token groups,
repeated positions, padding, invalid entries and a second run of one request; torch
reference and Triton kernels (interpreter).
"""

from __future__ import annotations

import random

import pytest
import torch

from invariants import check_cache
from test_split_resolve import KERNELS, STATE, fill, hot_before, make, random_step

I32 = torch.int32
LENS = {1: 40, 3: 9, 6: 27}


def _state(c) -> dict:
    return {n: getattr(c.state, n).clone() for n in STATE} | {"hot": c.hot.clone()}


def _same_state(a, want: dict) -> None:
    for n, v in want.items():
        got = a.hot if n == "hot" else getattr(a.state, n)
        assert torch.equal(got, v), n


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_landing_split_equals_serial(kernels, seed):
    rng = random.Random(seed)
    a, b = make(kernels), make(kernels)
    truth = fill(a, LENS)
    fill(b, LENS)
    for step in range(6):
        layer = step % 2
        ids, topk = random_step(rng, LENS, 2, 5)
        was_hot = hot_before(a, layer, ids, topk)
        res = a.resolve_split(layer, ids, topk, validate=False, land=True)
        assert res.pending
        # the miss phase has not run: no mapping changed yet, the misses already landed
        rows, idx, counts = res.landed()
        for t in range(topk.shape[0]):
            m = int(counts[t])
            rid = int(ids[t])
            if m:
                pos = topk[t][(res.hit_physical[t] < 0)].long()
                pos = pos[(pos >= 0) & (pos < a.layer_len(layer, rid))]
                assert torch.equal(rows[idx[t, :m].long()], truth[(rid, layer)][pos]), (step, t)
        a.finish_split(res)
        assert not res.pending
        want = b.resolve(layer, ids, topk, validate=False)
        for name in STATE:
            assert torch.equal(getattr(a.state, name), getattr(b.state, name)), (step, name)
        assert torch.equal(a.hot, b.hot), step
        assert torch.equal(res.physical, want.physical) and torch.equal(res.valid_counts, want.valid_counts)
        assert torch.equal(res.hit_physical >= 0, was_hot)
        # the hit phase's lists are the miss phase's: same count, host rows, order
        assert torch.equal(counts, res.miss_counts), step
        land = a._landing.view(*topk.shape)
        for t in range(topk.shape[0]):
            m = int(counts[t])
            assert land.src[t * 5:t * 5 + m].tolist() == res.miss_host[t, :m].tolist(), (step, t)
            assert torch.equal(rows[idx[t, :m].long()], a.hot_rows(layer)[res.miss_physical[t, :m].long()])
        check_cache(a)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_pending_split_refuses_every_other_launching_call(kernels):
    a, twin = make(kernels), make(kernels)
    fill(a, LENS)
    fill(twin, LENS)
    ids, topk = random_step(random.Random(3), LENS, 2, 5)
    res = a.resolve_split(1, ids, topk, validate=False, land=True)
    held = _state(a)
    row = torch.zeros((1, a.cfg.row_bytes), dtype=torch.uint8)
    calls = [lambda: a.resolve(0, ids, topk, validate=False),
             lambda: a.resolve_split(0, ids, topk, validate=False),
             lambda: a.resolve_split(0, ids, topk, validate=False, land=True),
             lambda: a.prefetch(0, ids, topk),
             lambda: a.append_rows(0, 1, row),
             lambda: a.add_request(9),
             lambda: a.free_request(3)]
    for call in calls:
        with pytest.raises(ValueError, match="pending"):
            call()
        _same_state(a, held)
    with pytest.raises(ValueError, match="pending result"):
        a.finish_split(object())  # not a split result
    a.finish_split(res)
    with pytest.raises(ValueError, match="pending result"):
        a.finish_split(res)  # only once
    twin.resolve(1, ids, topk, validate=False)
    _same_state(a, _state(twin))
    a.resolve(0, ids, topk, validate=False)  # settled: calls go through again


@pytest.mark.parametrize("kernels", KERNELS)
def test_abort_split_leaves_the_cache_as_it_was(kernels):
    a = make(kernels)
    fill(a, LENS)
    rng = random.Random(4)
    for _ in range(3):
        ids, topk = random_step(rng, LENS, 2, 5)
        a.resolve(1, ids, topk, validate=False)
    ids, topk = random_step(rng, LENS, 2, 5)
    before = _state(a)
    res = a.resolve_split(1, ids, topk, validate=False, land=True)
    a.abort_split(res)
    _same_state(a, before)
    with pytest.raises(ValueError, match="pending result"):
        a.finish_split(res)
    a.resolve(1, ids, topk, validate=False)
    check_cache(a)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("site", ["lookup_fn", "land copy", "resolve_fn", "slot copy"])
def test_a_landing_split_that_fails_changes_nothing(kernels, site):
    a, twin = make(kernels), make(kernels)
    fill(a, LENS)
    fill(twin, LENS)
    for c in (a, twin):
        r2 = random.Random(9)
        for _ in range(3):
            ids, topk = random_step(r2, LENS, 2, 5)
            c.resolve(1, ids, topk, validate=False)
    ids, topk = random_step(random.Random(5), LENS, 2, 5)
    before = _state(a)
    name = {"land copy": "staged_fn", "slot copy": "staged_fn"}.get(site, site)
    good = getattr(a.stager, name)
    seen = []

    def boom(*args, **kw):
        seen.append(1)
        if site != "slot copy" or len(seen) == 2:  # the slot copy is the second staged copy
            raise RuntimeError("injected")
        return good(*args, **kw)
    setattr(a.stager, name, boom)
    with pytest.raises(RuntimeError, match="injected"):
        res = a.resolve_split(1, ids, topk, validate=False, land=True)
        a.finish_split(res)
    setattr(a.stager, name, good)
    _same_state(a, before)
    assert a._pending is None
    x = a.resolve_split(1, ids, topk, validate=False, land=True)
    a.finish_split(x)
    y = twin.resolve(1, ids, topk, validate=False)
    assert torch.equal(x.physical, y.physical)
    _same_state(a, _state(twin))


@pytest.mark.parametrize("kernels", KERNELS)
def test_landed_rows_are_refused_once_reused(kernels):
    a = make(kernels)
    fill(a, LENS)
    ids, topk = random_step(random.Random(6), LENS, 2, 5)
    first = a.resolve_split(0, ids, topk, validate=False, land=True)
    a.finish_split(first)
    first.landed()
    second = a.resolve_split(1, ids, topk, validate=False, land=True)
    a.finish_split(second)
    with pytest.raises(ValueError, match="reused"):
        first.landed()
    second.landed()
    plain = a.resolve_split(1, ids, topk, validate=False)
    with pytest.raises(ValueError, match="did not land"):
        plain.landed()
    with pytest.raises(ValueError, match="stage_with"):
        a.resolve_split(0, ids, topk, land=True, stage_with=lambda *x: None)
