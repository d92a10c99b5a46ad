"""The elastic device tier's spill policy on CPU (helpers: ``elastic_common``).

Small scenarios whose demotions are predicted exactly (most pages first, ties lowest
request slot; a request outgrowing the pool goes hot itself; a request that frees no
page stays), checked against the sim (``tests/lru_sim.py``); the seeded hot buffer
(short contexts, uneven layer lengths) and the LRU after it; no promotion back.
"""

from __future__ import annotations

import torch

from hisparse.cache.cache import HiSparseCache
from hisparse.cache.device_pool import seed_positions

from elastic_common import cfg, fill, resolve, rows, tier
from invariants import check_cache, check_result
from lru_sim import LRUSim


# ------------------------------------------------------------------ spill policy
def test_spill_policy_most_pages_first_ties_lowest_slot_and_seeding():
    c = HiSparseCache(cfg(pages=4), kernels="torch")
    sim = LRUSim.for_cache(c)
    truth = {}
    for rid, n in ((5, 70), (6, 100), (7, 10)):  # 5 and 6 take the 4 pages; 7 will need a fifth
        sim.add(rid, c.add_request(rid))
        if rid == 7:
            break
        truth[rid] = fill(c, rid, n)
        sim.write(range(2), [(rid, n)])
    assert [c.residency(r) for r in (5, 6, 7)] == ["resident"] * 3
    assert c.dpool.pages(0) == [0, 1] and c.dpool.pages(1) == [2, 3]
    assert tier(c) == dict(resident_requests=3, hot_requests=0, pool_rows_used=3 * 5 + 4 * 64,
                           pool_rows_total=64 + 4 * 64, spills=0, promotions=0, seeded_rows=0)
    # request 7 needs one page, none is free: 5 and 6 hold two each; the tie goes to
    # the lowest request slot (5, slot 0)
    truth[7] = fill(c, 7, 10)
    sim.write(range(2), [(7, 10)])
    assert [c.residency(r) for r in (5, 6, 7)] == ["hot", "resident", "resident"]
    assert c.dpool.pages(2) == [0] and sorted(c.dpool._free) == [1]
    assert tier(c) == dict(resident_requests=2, hot_requests=1, pool_rows_used=3 * 5 + 3 * 64,
                           pool_rows_total=320, spills=1, promotions=0, seeded_rows=2 * 5)
    check_cache(c, sim)
    # the seeded buffer: positions 65..68 in slots 0..3, the newest (69) in the reserved slot
    pos, slots, res = seed_positions(70, 4)
    assert (pos, slots, res) == ([65, 66, 67, 68, 69], [0, 1, 2, 3, 4], 69)
    for layer in range(2):
        assert c.state.slot_pos[layer, 0].tolist() == pos
        assert c.state.slot_stamp[layer, 0].tolist() == [0] * 5
        assert c.requests.reserved(0, layer) == 69
        for p, s in zip(pos, slots):
            assert torch.equal(c.hot[layer, s], truth[5][layer][p])  # slot r * SP + s, r = 0
    # a resolve of the demoted request: hits on seeded rows, misses staged into the LRU
    # victims (no empty slot: the oldest stamps first, ties by position)
    res, ids, tk = resolve(c, 0, [(5, [66, 3]), (5, [69, 10])])
    sim.resolve(0, ids.tolist(), tk.tolist())
    check_result(c, 0, ids.tolist(), tk.tolist(), res, sim)
    st = c.stats()["layers"][0]
    assert (st["hits"], st["misses"]) == (2, 2)
    # misses 3 and 10 take the two oldest (stamp 0) victims by position: 65 then 67
    assert c.state.slot_pos[0, 0].tolist() == [3, 66, 10, 68, 69]
    src = res.stage_src[:4].tolist()
    blocks = c.pool.allocator.blocks(0)
    assert src[:2] == [blocks[0] * 4 + 3, blocks[2] * 4 + 2] and res.stage_dst[:2].tolist() == [0, 2]
    check_cache(c, sim)
    # no promotion back: freeing the resident 6 frees its pages, 5 stays hot; the next
    # request admitted is resident and takes the lowest free pages
    c.free_request(6)
    sim.free(6)
    truth[4] = fill(c, 4, 130)
    sim.add(4, 1)
    sim.write(range(2), [(4, 130)])  # slot 1 again; pages 1, 2, 3
    assert c.residency(5) == "hot" and c.residency(4) == "resident" and c.dpool.pages(1) == [1, 2, 3]
    assert tier(c)["promotions"] == 0 and tier(c)["spills"] == 1
    check_cache(c, sim)


def test_one_write_demotes_several_requests_in_policy_order():
    """A write needing 4 pages with 2 free: the two one-page holders go, the lowest slot
    first; a request holding no page and not written stays resident."""
    c = HiSparseCache(cfg(pages=4, max_num_reqs=4), kernels="torch")
    sim = LRUSim.for_cache(c)
    for rid in (1, 2, 3, 0):
        sim.add(rid, c.add_request(rid))  # slots 0, 1, 2, 3
    for rid in (2, 1):  # one page each: 2 gets page 0, 1 gets page 1
        fill(c, rid, 40)
        sim.write(range(2), [(rid, 40)])
    assert c.dpool.pages(1) == [0] and c.dpool.pages(0) == [1]
    fill(c, 3, 200)  # 4 pages: 1 (slot 0) then 2 (slot 1) are demoted, 0 (no page) stays
    sim.write(range(2), [(3, 200)])
    assert sim.demoted == [1, 2]
    assert [c.residency(r) for r in (0, 1, 2, 3)] == ["resident", "hot", "hot", "resident"]
    assert c.dpool.pages(2) == [0, 1, 2, 3]
    assert tier(c) == dict(resident_requests=2, hot_requests=2, pool_rows_used=4 * 5 + 4 * 64,
                           pool_rows_total=c.cfg.hot_rows_per_layer + 4 * 64, spills=2, promotions=0,
                           seeded_rows=2 * 2 * 5)
    check_cache(c, sim)


def test_a_write_that_outgrows_the_pool_demotes_its_own_request():
    """max_pages_per_request = 2 (the pool): a request needing a third page goes hot
    itself, before any other resident request is considered."""
    c = HiSparseCache(cfg(pages=2), kernels="torch")
    sim = LRUSim.for_cache(c)
    for rid in (1, 2):
        sim.add(rid, c.add_request(rid))
    fill(c, 1, 128)
    sim.write(range(2), [(1, 128)])
    assert c.dpool.pages(0) == [0, 1] and c.cfg.max_pages_per_request == 2
    fill(c, 2, 3)
    sim.write(range(2), [(2, 3)])  # needs a page: 1 (the only holder) is demoted
    assert c.residency(1) == "hot" and c.dpool.pages(1) == [0]
    fill(c, 2, 130)  # 133 rows: 3 pages > 2: request 2 goes hot itself
    sim.write(range(2), [(2, 130)])
    assert c.residency(2) == "hot" and tier(c)["spills"] == 2 and sorted(c.dpool._free) == [0, 1]
    check_cache(c, sim)


def test_demotion_of_a_short_context_keeps_every_row_at_its_position():
    c = HiSparseCache(cfg(pages=1), kernels="torch")
    sim = LRUSim.for_cache(c)
    for rid in (1, 2):
        sim.add(rid, c.add_request(rid))
    t1 = fill(c, 1, 3)
    sim.write(range(2), [(1, 3)])
    fill(c, 2, 64)  # needs the only page: request 1 (3 rows, one page) is demoted
    sim.write(range(2), [(2, 64)])
    assert c.residency(1) == "hot" and c.residency(2) == "resident"
    assert seed_positions(3, 4) == ([0, 1, 2], [0, 1, 2], -1)
    for layer in range(2):
        assert c.state.slot_pos[layer, 0].tolist() == [0, 1, 2, -1, -1]
        assert c.requests.reserved(0, layer) == -1
    # the next rows of 1 go to slot = position, then the reserved slot
    new = rows(3, 99)
    for layer in range(2):
        c.write(layer, 1, new)
    sim.write([0], [(1, 3)])
    sim.write([1], [(1, 3)])
    assert c.state.slot_pos[0, 0].tolist() == [0, 1, 2, 3, 5]
    res, ids, tk = resolve(c, 1, [(1, [0, 5]), (1, [4, 2])])
    sim.resolve(1, ids.tolist(), tk.tolist())
    check_result(c, 1, ids.tolist(), tk.tolist(), res, sim)
    assert torch.equal(c.hot[1][res.physical[0, 0].long()], t1[1][0])
    check_cache(c, sim)
    assert tier(c)["seeded_rows"] == 2 * 3


def test_demotion_with_uneven_layer_lengths_seeds_each_layer_from_its_own():
    """Per-layer appends leave layer 0 ahead; a demotion then seeds each layer from its
    own length (and the layer's reserved occupant), and the other layer's write that
    follows is a hot write."""
    c = HiSparseCache(cfg(pages=2), kernels="torch")
    sim = LRUSim.for_cache(c)
    for rid in (1, 2):
        sim.add(rid, c.add_request(rid))
    fill(c, 1, 64)
    sim.write(range(2), [(1, 64)])
    b = c.plan_write([1], [5])
    c.write(0, b, rows(5, 3))  # layer 0: 69 rows (a second page), layer 1: 64
    sim.write([0], [(1, 5)])
    assert c.dpool.pages(0) == [0, 1]
    fill(c, 2, 65)  # two pages: 1 is demoted
    sim.write(range(2), [(2, 65)])
    assert c.residency(1) == "hot"
    assert c.state.slot_pos[0, 0].tolist() == [64, 65, 66, 67, 68]
    assert c.state.slot_pos[1, 0].tolist() == [59, 60, 61, 62, 63]
    assert [c.requests.reserved(0, l) for l in range(2)] == [68, 63]
    c.write(1, b, rows(5, 3))  # the same batch, layer 1: now a hot write
    sim.write([1], [(1, 5)])
    check_cache(c, sim)
    assert c.state.slot_pos[1, 0].tolist() == [59, 60, 61, 62, 68]


def test_a_demotion_never_demotes_a_request_that_frees_no_page():
    """Regression: a write of two new requests needing 2 + 2 pages of a pool of 3, with a
    third resident request that holds no page (admitted, nothing written yet): demoting
    it frees nothing and it needs nothing, so only one of the written requests goes hot
    (the policy demotes toward fitting the write, most pages first, ties lowest slot)."""
    c = HiSparseCache(cfg(pages=3), kernels="torch")
    for rid in (3, 4, 5):
        c.add_request(rid)  # slots 0, 1, 2, all resident, no pages
    b = c.plan_write([4, 5], [128, 128])
    c.write(0, b, rows(256, 1))
    assert [c.residency(r) for r in (3, 4, 5)] == ["resident", "hot", "resident"]
    assert tier(c)["spills"] == 1 and c.dpool.pages(2) == [0, 1]
    c.write(1, b, rows(256, 1))
    check_cache(c)
