"""The elastic device tier on CPU: failed calls change nothing (helpers: ``elastic_common``).

All-or-nothing of failed calls with resident requests: writes refused by their checks
or a full host pool, a failing write launch that undoes its demotion and grants, a
write that would demote a request whose step is not written yet, a step replacing a
pending one, checked resolves with bad input; rollbacks of resolves with resident and
hot groups whose staging (or miss phase) fails, equal to an untouched twin when retried.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from hisparse import CapacityError
from hisparse.cache.cache import HiSparseCache

from elastic_common import I32, KERNELS, _compare, cfg, fill, full_state, resolve, rows, same_state
from invariants import check_cache


# ------------------------------------------------------------------ all or nothing
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_write_refused_by_its_checks_leaves_the_pool_as_it_was(kernels):
    c = HiSparseCache(cfg(pages=1, host_pool_tokens=160), kernels=kernels)
    fill(c, 1, 64)
    c.add_request(2)
    before = full_state(c)
    b = c.plan_write([2], [3])  # would demote request 1 and give 2 the page
    for bad in (rows(3, 1)[:, :8], rows(4, 1), rows(3, 1).to(torch.int32)):
        with pytest.raises((ValueError, TypeError)):
            c.write(0, b, bad)
        same_state(before, full_state(c))
    for call in (lambda: c.write(0, 2, rows(100, 1))[0],  # 25 blocks, 24 free
                 lambda: c.prepare_step(c.plan_write([2, 1], [1, 96])),
                 lambda: c.write(1, c.plan_write([2, 1], [3, 96]), rows(99, 1))):
        with pytest.raises(CapacityError, match="host pool full"):
            call()
        same_state(before, full_state(c))
    assert c.residency(1) == "resident"
    c.write(0, b, rows(3, 1))  # and the write itself then demotes as predicted
    assert c.residency(1) == "hot" and c.residency(2) == "resident"


class Boom(RuntimeError):
    pass


def _raise(*_a, **_k):
    raise Boom("injected launch failure")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("site", ["kernel_set.mirror", "kernel_set.apply_write"])
@pytest.mark.parametrize("path", ["write", "token_rows"])
def test_a_failing_write_launch_undoes_its_demotion_and_grants(kernels, site, path):
    """Regression: a write whose pool changes (a demotion, a grant) were made before its
    launch raised must leave everything as it was, like any failed write; retried, it
    does what it does on an untouched twin."""
    def make():
        c = HiSparseCache(cfg(pages=2), kernels=kernels)
        fill(c, 1, 70)  # both pages
        c.add_request(2)
        c.add_request(3)
        return c
    c, twin = make(), make()
    assert c.dpool.pages(0) == [0, 1] and c.dpool.pages(1) == c.dpool.pages(2) == []
    # 2 and 3 need a page each: 1 (both pages; in the token batch, written too) is demoted
    new = rows(3, 9)

    def call(x):
        if path == "write":
            return x.write(0, x.plan_write([2, 3], [2, 1]), new[:3])
        return x.write(0, x.plan_write([3, 2, 1], [1, 1, 1]), new)

    before = full_state(c)
    part, attr = site.split(".")
    obj = getattr(c, part)
    good = getattr(obj, attr)
    setattr(obj, attr, _raise)
    with pytest.raises(Boom):
        call(c)
    setattr(obj, attr, good)
    now = full_state(c)
    SP = c.cfg.slots_per_req
    for snap in (before, now):  # request 1's (slot 0) hot rows: unmapped again, their bytes not state
        snap["hot"][:, :SP] = 0
    same_state(before, now)
    check_cache(c)
    assert call(c) == call(twin)
    assert c.residency(1) == "hot" and c.dpool.spills == 1
    _compare(c, twin, "retried")
    assert c.dpool._pages == twin.dpool._pages and c.dpool._free == twin.dpool._free
    assert (c.dpool.spills, c.dpool.seeded_rows) == (twin.dpool.spills, twin.dpool.seeded_rows)
    check_cache(c)


def test_a_write_never_demotes_a_request_whose_step_is_not_written_yet():
    """Regression: a step prepared for a resident request commits every layer's length
    before its per-layer writes run. A write that demoted the request in between would
    seed the hot buffer of the layers not written yet from page rows not written yet,
    and the step's remaining writes would land in pages given to another request. Such a
    write is refused (nothing changed); once the step is written (or abandoned) it runs."""
    c = HiSparseCache(cfg(pages=2), kernels="torch")
    t1 = fill(c, 1, 64)
    c.add_request(2)
    s1 = c.prepare_step(c.plan_write([1], [1]))  # resident 1: a second page
    a1 = rows(1, 5)
    c.write_step(0, s1, a1)
    before = full_state(c)
    with pytest.raises(ValueError, match="not written yet"):
        c.prepare_step(c.plan_write([2], [100]))  # would demote 1 (two pages)
    same_state(before, full_state(c))
    with pytest.raises(ValueError, match="not written yet"):
        c.write(0, 2, rows(100, 6))
    same_state(before, full_state(c))
    c.write_step(1, s1, a1)
    s2 = c.prepare_step(c.plan_write([2], [100]))
    b = rows(100, 6)
    for layer in range(2):
        c.write_step(layer, s2, b)
    assert c.residency(1) == "hot" and c.residency(2) == "resident"
    check_cache(c)
    res, _, _ = resolve(c, 1, [(1, [64, 63]), (2, [64, 99])])
    got = c.hot[1][res.physical.long()]
    assert torch.equal(got[0, 0], a1[0]) and torch.equal(got[0, 1], t1[1][63])
    assert torch.equal(got[1], b[[64, 99]])


def test_a_step_replacing_a_pending_step_may_demote_its_requests():
    """The engine's way: the next step replaces the last one, whose unwritten layers are
    put back first; the demotion then seeds from the rows as before that step."""
    c = HiSparseCache(cfg(pages=2), kernels="torch")
    fill(c, 1, 64)
    c.add_request(2)
    s1 = c.prepare_step(c.plan_write([1], [1]))  # a second page for 1, nothing written
    assert c.dpool.pages(0) == [0, 1]
    s2 = c.prepare_step(c.plan_write([2], [100]), replaces=s1)
    assert c.residency(1) == "hot" and c.request(1).lengths == (64, 64)
    assert [c.requests.reserved(0, l) for l in range(2)] == [63, 63]
    b = rows(100, 6)
    for layer in range(2):
        c.write_step(layer, s2, b)
    s3 = c.prepare_step(c.plan_write([1], [1]))  # (the block s1 took stays with 1: fill it)
    for layer in range(2):
        c.write_step(layer, s3, rows(1, 7))
    check_cache(c)


@pytest.mark.parametrize("kernels", KERNELS)
def test_checked_resolve_with_bad_input_changes_nothing(kernels):
    c = HiSparseCache(cfg(pages=1), kernels=kernels)
    fill(c, 1, 30)  # the page
    fill(c, 2, 40)  # needs the page: 1 is demoted
    fill(c, 3, 70)  # needs 2 pages of a pool of 1: goes hot itself
    assert [c.residency(r) for r in (1, 2, 3)] == ["hot", "resident", "hot"]
    before = full_state(c)
    K = c.cfg.top_k
    bad = [
        (torch.tensor([1, 3], dtype=I32), torch.tensor([[0, 30], [1, 2]], dtype=I32)),  # 30 >= len
        (torch.tensor([1, 6], dtype=I32), torch.tensor([[0, 1], [1, 2]], dtype=I32)),  # 6 not live
        (torch.tensor([1, 1, 1], dtype=I32), torch.tensor([[0, 1]] * 3, dtype=I32)),  # 3 > max_query_len
        (torch.tensor([1], dtype=I32), torch.tensor([[0, -2]], dtype=I32)),
        (torch.tensor([1, 2, 1], dtype=I32), torch.tensor([[0, 1]] * 3, dtype=I32)),  # a second run of 1
        (torch.tensor([1], dtype=I32), torch.tensor([[0] * (K + 1)], dtype=I32)),  # K > top_k
    ]
    for ids, tk in bad:
        for fn in (c.resolve, functools.partial(c.resolve, split=True)):
            with pytest.raises((ValueError, TypeError)):
                fn(0, ids, tk)
            same_state(before, full_state(c))


# ------------------------------------------------------------------------ rollback
def warm(kernels: str) -> HiSparseCache:
    """Two resident requests (one page, three pages) and a hot one with LRU history."""
    c = HiSparseCache(cfg(pages=3), kernels=kernels)
    fill(c, 4, 200)  # 4 pages > the pool's 3: hot
    fill(c, 1, 30)
    fill(c, 2, 100)
    rng = random.Random(4)
    for layer in range(2):
        ids = torch.tensor([1, 2, 4], dtype=I32)
        tk = torch.tensor([rng.sample(range(30), 2), rng.sample(range(100), 2), rng.sample(range(200), 2)],
                          dtype=I32)
        c.resolve(layer, ids, tk)
    return c


def test_warm_cache_has_both_kinds():
    c = warm("torch")
    kinds = {rid: c.residency(rid) for rid in (1, 2, 4)}
    assert kinds == {1: "resident", 2: "resident", 4: "hot"}, kinds
    assert c.dpool.pages(1) == [0] and c.dpool.pages(2) == [1, 2]
    assert c.stats()["total"]["resident_rows"] > 0 and c.stats()["total"]["misses"] > 0
    check_cache(c)


def _after(f):
    def run(*a, **k):
        f(*a, **k)
        raise Boom("failure reported after the launch ran")
    return run


ROLLBACK_CASES = [(k, call, when) for k in KERNELS
                  for call in ("resolve", "resolve_compact", "prefetch", "resolve_split", "split_hit_phase")
                  for when in ("before", "after")
                  # a miss phase that ran and then raised is not a case the stager undoes (nor
                  # is a plain resolve launch that raised after it ran, with or without the tier)
                  if not (call == "split_hit_phase" and when == "after")
                  # the interpreter is slow: the Triton kernels on the cases that differ most
                  and (k == "torch" or (call, when) in (("resolve", "after"), ("prefetch", "after"),
                                                       ("resolve_split", "after"),
                                                       ("split_hit_phase", "before")))]


@pytest.mark.parametrize("kernels,call,when", ROLLBACK_CASES)
def test_rollback_with_resident_groups(kernels, call, when):
    """A resolve with resident and hot groups (multi-token, duplicates, padding, an
    invalid entry, a second run) whose staging (or, for a split, miss phase) fails is
    rolled back exactly: every counter (resident entries included), stamp, slot, step
    and byte as before; retried, the same as an untouched twin."""
    c, twin = warm(kernels), warm(kernels)
    ids = torch.tensor([1, 1, 2, 4, 4, 1], dtype=I32)
    tk = torch.tensor([[29, 3], [3, -1], [99, 64], [199, 0], [7, 200], [0, 1]], dtype=I32)
    before = full_state(c)
    if call == "split_hit_phase":  # the miss phase itself raises: only the hit phase ran
        good = c.kernel_set.resolve
        c.kernel_set.resolve = _raise if when == "before" else _after(good)
    else:
        good = c.kernel_set.copy_staged
        c.kernel_set.copy_staged = _raise if when == "before" else _after(good)
    with pytest.raises(Boom):
        if call in ("resolve_split", "split_hit_phase"):
            c.resolve(1, ids, tk, validate=False, split=True)
        elif call == "prefetch":
            c.prefetch(1, ids, tk)
        else:
            c.resolve(1, ids, tk, validate=False, compact=call == "resolve_compact")
    if call == "split_hit_phase":
        c.kernel_set.resolve = good
    else:
        c.kernel_set.copy_staged = good
    same_state(before, full_state(c))
    check_cache(c)
    a, b = c.resolve(1, ids, tk, validate=False), twin.resolve(1, ids, tk, validate=False)
    assert torch.equal(a.physical, b.physical) and torch.equal(a.valid_counts, b.valid_counts)
    _compare(c, twin, "after the retry")
    assert c.stats()["layers"][1]["resident_rows"] > 0
