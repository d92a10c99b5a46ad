"""A P/D commit leaves the cache exactly as per-request ``write`` of the same rows would.

Two caches go through the same history (requests appended, some freed: the new
request's blocks then have holes between them); then one appends request 9's rows layer
by layer, the other reserves it through a ``PDReceiver``, gets the rows into the
reservation's pool runs (as a transfer writes them) and commits. Every piece of state
must match: the pool's bytes, the device rows (hot slots or resident pages), the slot
maps, stamps, lengths, reserved occupants, counters, block tables and allocator, the
elastic tier's pages. The commit's write reads the rows from the pool itself
(``hisparse.cache.write_pooled``), every layer in one launch.

Sizes (S = 16 hot slots, 16-row blocks): C <= S + 1 (every row hot), C = S + 2 (the
first row that is not), C not a multiple of the block, C spanning holes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hisparse import HiSparseCache
from hisparse.pd import PDReceiver
from invariants import check_cache, snapshot
from pd_helpers import make_rows, nixl_or_skip, small_cfg

pytestmark = pytest.mark.usefixtures("nixl")

_N = itertools.count()
RID = 9
SIZES = (1, 10, 17, 18, 40, 70)  # S = 16, B = 16


@pytest.fixture(scope="module")
def nixl():
    nixl_or_skip()


def history(cfg, kernels: str, layout: str) -> tuple[HiSparseCache, dict]:
    """A cache after ``layout``'s history: "fresh" (nothing), "hole" (requests of 20,
    20, 37 rows, the second freed: a 2-block hole), "holes" (five 1-block requests, the
    2nd and 4th freed: 1-block holes); and its live requests' rows ((id, layer) -> rows)."""
    cache = HiSparseCache(cfg, kernels=kernels)
    plan = {"fresh": ((), ()), "hole": (((1, 20), (2, 20), (3, 37)), (2,)),
            "holes": (tuple((i, 16) for i in range(1, 6)), (2, 4))}[layout]
    truth = {}
    for rid, n in plan[0]:
        cache.add_request(rid)
        for layer, rows in enumerate(make_rows(100 + rid, n, cfg.row_bytes, cfg.num_layers)):
            cache.write(layer, rid, rows.to(cache.device))
            truth[rid, layer] = rows
    for rid in plan[1]:
        cache.free_request(rid)
    return cache, {k: v for k, v in truth.items() if k[0] not in plan[1]}


def committed_and_appended(cfg, C: int, *, kernels: str = "torch", layout: str = "fresh"):
    """(cache whose request RID was committed by a receiver, cache whose RID was
    appended with per-request writes, every live request's rows ((id, layer) -> rows), the
    reservation's runs)."""
    rows = make_rows(RID, C, cfg.row_bytes, cfg.num_layers)
    ref, truth = history(cfg, kernels, layout)
    ref.add_request(RID)
    for layer in range(cfg.num_layers):
        ref.write(layer, RID, rows[layer].to(ref.device))
    cache, _ = history(cfg, kernels, layout)
    rx = PDReceiver(cache, name=f"test-commit-decode-{next(_N)}")
    d = rx.reserve(RID, C)
    for layer in range(cfg.num_layers):  # what the transfer writes: each run's rows, nothing else
        for p0, p1, h in d.runs:
            cache.pool.rows[layer][h:h + p1 - p0] = rows[layer][p0:p1]
    rx.commit(RID, d.generation)
    rx.close()
    truth.update({(RID, layer): r for layer, r in enumerate(rows)})
    return cache, ref, truth, d.runs


def assert_same_cache(got: HiSparseCache, want: HiSparseCache) -> None:
    a, b = snapshot(got), snapshot(want)
    assert a.keys() == b.keys()
    diff = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert not diff, f"the committed cache differs from the appended one in {diff}"


def check_commit(cache, ref, truth, C: int) -> None:
    assert_same_cache(cache, ref)
    L = cache.cfg.num_layers
    assert cache.request(RID).lengths == (C,) * L
    for layer in range(L):
        assert torch.equal(cache.read_host_rows(layer, RID, list(range(C))), truth[RID, layer])
    check_cache(cache, truth=truth)


@pytest.mark.parametrize("layout", ["fresh", "hole", "holes"])
@pytest.mark.parametrize("C", SIZES)
def test_hot_commit_equals_per_request_writes(C, layout):
    cfg = small_cfg(max_num_reqs=8)
    cache, ref, truth, runs = committed_and_appended(cfg, C, layout=layout)
    assert cache.residency(RID) == "hot"
    if layout == "holes" and C > 16:
        assert len(runs) > 1  # the blocks are not one run of the pool
    check_commit(cache, ref, truth, C)


@pytest.mark.parametrize("layout", ["fresh", "holes"])
@pytest.mark.parametrize("C", (1, 17, 18, 40, 70))
def test_resident_commit_equals_per_request_writes(C, layout):
    cfg = small_cfg(max_num_reqs=8, device_pool_rows=8 * 17 + 64 * 4)
    cache, ref, truth, _ = committed_and_appended(cfg, C, layout=layout)
    assert cache.residency(RID) == ref.residency(RID) == "resident"
    check_commit(cache, ref, truth, C)


@pytest.mark.parametrize(("C", "layout", "resident"), [(18, "holes", False), (40, "hole", False),
                                                        (70, "holes", True), (10, "fresh", False)])
def test_commit_with_the_triton_kernels(C, layout, resident):
    """The Triton apply of every layer in one launch (the interpreter here)."""
    cfg = small_cfg(max_num_reqs=8, **({"device_pool_rows": 8 * 17 + 64 * 4} if resident else {}))
    cache, ref, truth, _ = committed_and_appended(cfg, C, kernels="triton", layout=layout)
    check_commit(cache, ref, truth, C)


@pytest.mark.gpu
@pytest.mark.parametrize(("C", "layout", "resident"), [(1, "fresh", False), (17, "hole", False),
                                                        (18, "holes", False), (70, "holes", False),
                                                        (40, "fresh", True), (70, "holes", True)])
def test_commit_equals_per_request_writes_on_cuda(C, layout, resident):
    """On a CUDA cache the commit's one launch reads the pinned pool over UVA."""
    cfg = small_cfg(max_num_reqs=8, device="cuda", **({"device_pool_rows": 8 * 17 + 64 * 4} if resident else {}))
    cache, ref, truth, _ = committed_and_appended(cfg, C, kernels="auto", layout=layout)
    assert cache.kernels == "triton" and cache.pool.pinned
    check_commit(cache, ref, truth, C)
