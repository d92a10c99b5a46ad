"""Prefix caching on CPU: eviction and capacity (helpers: ``prefix_common``).

LRU eviction of unreferenced blocks only (a request's tail first), admission counting
evictable blocks as free, a batched write that evicts getting the blocks it planned
(torch and Triton kernels), ``reset_prefix_cache`` dropping unreferenced blocks only,
refused calls that change nothing, and a write that evicts dropping the blocks from
the index before its launches.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import CapacityError

from invariants import assert_same
from prefix_common import B, Req, make, toks
from prefix_trace import prefix_snapshot


def test_eviction_is_lru_and_only_of_unreferenced_blocks():
    c = make(host_pool_tokens=10 * B, max_num_reqs=4)  # 10 blocks
    ix, alloc = c.prefix.index, c.pool.allocator
    reqs = []
    for i in range(3):  # three 2-block prompts, freed in order 2, 0, 1
        r = Req(c, i, toks(2 * B + 1, start=1000 * (i + 1)))
        r.write()
        reqs.append(r)
    blocks = {i: alloc.blocks(c.request(i).slot)[:2] for i in range(3)}
    for i in (2, 0, 1):
        c.free_request(i)
    assert ix.cached == 6 and ix.evictable == 6
    # least recently released first; a request's own blocks tail first (a head evicted
    # first would leave the rest of its chain unreachable)
    rev = {i: blocks[i][::-1] for i in blocks}
    assert ix.peek_evict(6) == rev[2] + rev[0] + rev[1]
    # request 0's prompt again: its blocks are referenced (not evictable) and move out of the LRU
    again = Req(c, 3, toks(2 * B + 1, start=1000))
    assert again.cached == 2 * B and ix.evictable == 4
    # a fresh request needs 7 blocks: the 4 free, then evicts the 3 least recently released
    # unreferenced ones
    n = Req(c, 4, toks(6 * B + 1, start=5))
    assert len(alloc._free) == 4
    free_before = sorted(alloc._free)
    n.write()
    got = alloc.blocks(c.request(4).slot)
    assert got == free_before + rev[2] + rev[1][:1]
    assert ix.evictions == 3 and ix.cached == 3
    assert all(ix.holds(b) for b in blocks[0]) and ix.holds(blocks[1][0])
    assert c.stats()["total"]["prefix_evictions"] == 3
    # request 2's prompt is gone; request 1 keeps its first block (the tail went first)
    assert Req(c, 5, toks(2 * B + 1, start=3000)).cached == 0
    c.free_request(5)
    assert Req(c, 6, toks(2 * B + 1, start=2000)).cached == B
    c.free_request(6)
    again.write()
    again.resolve(0, [0, 1, 7, 8])
    assert all(ix.refs(b) == 1 for b in blocks[0])


def test_admission_counts_evictable_blocks_as_free():
    c = make(host_pool_tokens=6 * B, max_num_reqs=3)  # 6 blocks
    alloc, ix = c.pool.allocator, c.prefix.index
    a = Req(c, 0, toks(4 * B + 1))
    a.write()  # 5 blocks
    c.free_request(0)  # 4 cached (evictable) + 1 free -> 2 free
    assert (alloc.num_used, alloc.num_free, ix.evictable) == (4, 6, 4)
    assert c.stats()["host_pool"]["blocks_used"] == 4
    b = Req(c, 1, toks(3 * B, start=9))
    b.write()  # 3 blocks: 2 free + 1 evicted
    assert ix.evictions == 1 and alloc.num_free == 3
    # 4 more blocks than exist free + evictable: refused, nothing changed
    d = Req(c, 2, toks(4 * B, start=50))
    before = prefix_snapshot(c)
    with pytest.raises(CapacityError):
        c.write(0, 2, d.rows.get(0, 0, 4 * B))
    with pytest.raises(CapacityError):
        c.prepare_step(c.plan_write([1, 2], [1, 3 * B + 1]))
    with pytest.raises(CapacityError):
        c.writer.allocate_for(c.request(2).slot, 4 * B)
    assert_same(before, prefix_snapshot(c))
    # exactly free + evictable: succeeds, evicting every cached block
    d.write(end=3 * B)
    assert ix.evictions == 4 and alloc.num_free == 0 and ix.evictable == 0
    assert ix.cached == 3 and [ix.refs(h) for h in alloc.blocks(c.request(1).slot)] == [1, 1, 1]  # b's, published by d's lookup
    d.resolve(0, [0, 5, 11])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_batched_write_that_evicts_gets_the_blocks_it_planned(kernels):
    """A batch whose requests together need evictions: the write plans with ``peek`` of
    the whole batch and allocates request by request; both must agree (a regression:
    the first request used to be handed a free block while the plan had given it an
    evicted one of lower id)."""
    c = make(kernels, host_pool_tokens=4 * B, num_layers=1)  # 4 blocks
    alloc = c.pool.allocator
    a = Req(c, 0, toks(B + 1))
    a.write()  # blocks 0 (published at free), 1
    o = Req(c, 1, toks(B, start=70), given=False)
    o.write()  # block 2
    c.free_request(0)
    assert sorted(alloc._free) == [1, 3] and c.prefix.index.peek_evict(1) == [0]
    n = Req(c, 2, toks(2 * B, start=90), given=False)
    o.rows.extend([5])
    rows = torch.cat([o.rows.get(0, B, B + 1), n.rows.get(0, 0, 2 * B)])
    assert alloc.peek(3) == [1, 3, 0]
    assert c.write(0, c.plan_write([1, 2], [1, 2 * B]), rows) == [B, 0]
    assert alloc.blocks(c.request(1).slot) == [2, 1] and alloc.blocks(c.request(2).slot) == [3, 0]
    assert c.prefix.index.evictions == 1
    o.resolve(0, [0, B])
    n.resolve(0, [0, 3, 4, 7])
    # the same through a prepared step (an engine's forward)
    c2 = make(kernels, host_pool_tokens=4 * B, num_layers=1)
    a = Req(c2, 0, toks(B + 1))
    a.write()
    o = Req(c2, 1, toks(B, start=70), given=False)
    o.write()
    c2.free_request(0)
    n = Req(c2, 2, toks(2 * B, start=90), given=False)
    o.rows.extend([5])
    step = c2.prepare_step(c2.plan_write([1, 2], [1, 2 * B]))
    c2.write_step(0, step, torch.cat([o.rows.get(0, B, B + 1), n.rows.get(0, 0, 2 * B)]))
    assert c2.pool.allocator.blocks(c2.request(1).slot) == [2, 1] and c2.pool.allocator.blocks(c2.request(2).slot) == [3, 0]
    n.resolve(0, [0, 7])


def test_reset_prefix_cache_drops_unreferenced_blocks_only():
    c = make()
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    b = Req(c, 1, toks(3 * B + 1, start=500))
    b.write()
    c.free_request(0)
    used = c.pool.allocator.num_used
    assert c.prefix.index.evictable == 2
    assert c.reset_prefix_cache() == 2
    assert c.pool.allocator.num_used == used - 2 and c.prefix.index.cached == 0
    assert c.prefix.index.evictions == 0  # a reset is not an eviction
    assert Req(c, 2, toks(2 * B + 1)).cached == 0
    # request 1's blocks, published by this lookup, are referenced: a reset keeps them
    assert Req(c, 3, toks(3 * B + 1, start=500)).cached == 3 * B
    assert c.reset_prefix_cache() == 0
    for rid in (1, 2, 3):
        c.free_request(rid)
    assert c.reset_prefix_cache() == 3
    assert c.pool.allocator.num_used == 0 and (c.state.row_slot == -1).all()


def test_failed_add_request_changes_nothing():
    c = make(max_num_reqs=2)
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    before = prefix_snapshot(c)
    for bad in ([1, -1], [2**32], [[1, 2]], [0.5], "abc"):
        with pytest.raises(ValueError):
            c.add_request(1, bad)
    with pytest.raises(TypeError):
        c.add_request(1, [1, 2], salt="str")
    with pytest.raises(ValueError, match="already live"):
        c.add_request(0, toks(2 * B + 1))
    assert_same(before, prefix_snapshot(c))
    Req(c, 1, [3])
    before = prefix_snapshot(c)
    with pytest.raises(CapacityError, match="request slots"):
        c.add_request(2, toks(2 * B + 1))  # would publish and hit: refused first
    assert_same(before, prefix_snapshot(c))
    assert c.prefix.index.cached == 0


# ---------------------------------------------------------------- found by review
def test_a_write_that_evicts_drops_the_blocks_before_its_launches():
    """Cached blocks a write takes leave the index before the write launches, so a launch
    that fails part way (after the host mirror overwrote their rows) leaves none of them
    findable; the blocks are free for the next allocation."""
    c = make(host_pool_tokens=3 * B, max_num_reqs=3)  # 3 host blocks
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    c.free_request(0)
    assert c.prefix.index.cached == 2
    n = Req(c, 1, toks(3 * B, start=900))  # needs all 3: the free one, then evicts 2

    def boom(*args, **kw):
        raise RuntimeError("apply launch failed (injected)")

    real, c.kernel_set.apply_write = c.kernel_set.apply_write, boom
    with pytest.raises(RuntimeError, match="injected"):
        c.write(0, 1, n.rows.get(0, 0, 3 * B))
    c.kernel_set.apply_write = real
    assert c.prefix.index.cached == 0 and c.pool.allocator.num_free == 3
    assert c.request(1).lengths[0] == 0
    n.write()
    n.resolve(0, [0, B, 2 * B + 1])
    c.free_request(1)
    assert Req(c, 2, toks(2 * B + 1)).cached == 0  # request 0's blocks are gone
