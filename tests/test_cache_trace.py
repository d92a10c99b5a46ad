"""Tiny hand-traced HiSparseCache scenarios: 4 LRU slots (+ reserved slot 4), expected
slot / stamp / physical state written out step by step.

Rows are recognisable: row of (layer l, position p) is 16 bytes all equal to
``1 + p + 50 * l``, so hot bytes say which position a slot holds.
"""

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.cache import HiSparseCache

from invariants import assert_same, check_cache, snapshot


@pytest.fixture(params=["torch", "triton"])
def make(request):
    """Factory of tiny caches; every trace runs through the torch reference and through
    the Triton kernels (interpreter on CPU)."""

    def build(**kw):
        base = dict(num_layers=1, host_pool_tokens=16, row_bytes=16, top_k=2,
                    device_buffer_size=4, max_num_reqs=2, max_query_len=1, host_block_size=2,
                    max_request_id=8, device="cpu")
        base.update(kw)
        c = HiSparseCache(HiSparseConfig(**base), kernels=request.param)
        assert c.kernels == request.param
        return c

    return build


def rows(start, n, layer=0):
    v = torch.arange(start, start + n, dtype=torch.int32) + 1 + 50 * layer
    return v[:, None].expand(n, 16).to(torch.uint8).contiguous()


def step(cache, ids, topk, layer=0, **kw):
    res = cache.resolve(layer, torch.tensor(ids, dtype=torch.int32),
                        torch.tensor(topk, dtype=torch.int32), **kw)
    return res.physical.tolist(), res.valid_counts.tolist(), res


def slots(cache, r=0, layer=0):
    return (cache.state.slot_pos[layer, r].tolist(), cache.state.slot_stamp[layer, r].tolist())


def holds(cache, phys_row, pos, layer=0):
    """Hot row ``phys_row`` holds the bytes of position ``pos``."""
    return bool((cache.hot[layer, phys_row] == 1 + pos + 50 * layer).all())


def test_fits_phase_maps_position_to_slot_and_never_misses(make):
    c = make()
    assert c.add_request(3) == 0 and c.request(3).slot == 0  # no token ids: 0 cached tokens
    assert c.write(0, 3, rows(0, 3))[0] == 0
    assert slots(c) == ([0, 1, 2, -1, -1], [0, 0, 0, -1, -1])
    assert c.state.row_slot[0, :4].tolist() == [0, 1, 2, -1]
    assert c.state.seq_lens.tolist() == [[3, 0]]
    phys, vc, res = step(c, [3], [[2, 0]])
    assert (phys, vc) == ([[2, 0]], [2])
    assert (res.stage_src == -1).all() and res.event is None
    assert slots(c) == ([0, 1, 2, -1, -1], [1, 0, 1, -1, -1])
    phys, vc, _ = step(c, [3], [[1, -1]])
    assert (phys, vc) == ([[1, -1]], [1])
    assert slots(c) == ([0, 1, 2, -1, -1], [1, 2, 1, -1, -1])
    assert c.write(0, 3, rows(3, 1))[0] == 3  # still fits: slot 3, stamp = step 2
    assert slots(c) == ([0, 1, 2, 3, -1], [1, 2, 1, 2, -1])
    s = c.stats()["total"]
    assert (s["hits"], s["misses"], s["resolves"]) == (3, 0, 2)
    check_cache(c)


def test_lru_walk_with_reserved_slot(make):
    c = make()
    c.add_request(5)
    assert c.write(0, 5, rows(0, 6))[0] == 0
    # positions 0..3 -> slots 0..3, 4 host only, 5 (the newest) -> reserved slot 4
    assert slots(c) == ([0, 1, 2, 3, 5], [0, 0, 0, 0, 0])
    assert c.state.row_slot[0, :6].tolist() == [0, 1, 2, 3, -1, 4]
    # step 1: 5 hits the reserved slot; 4 misses -> oldest (stamp 0), smallest pos 0 -> slot 0
    phys, vc, res = step(c, [5], [[4, 5]])
    assert (phys, vc) == ([[0, 4]], [2])
    assert res.stage_src.tolist() == [4, -1] and res.stage_dst.tolist() == [0, -1]
    assert slots(c) == ([4, 1, 2, 3, 5], [1, 0, 0, 0, 1])
    assert holds(c, 0, 4) and holds(c, 4, 5)
    # step 2: 1 hits slot 1; 0 misses -> stamp 0 victims {2, 3}, smallest position 2 -> slot 2
    phys, vc, _ = step(c, [5], [[0, 1]])
    assert phys == [[2, 1]]
    assert slots(c) == ([4, 1, 0, 3, 5], [1, 2, 2, 0, 1])
    assert holds(c, 2, 0)
    # step 3: 3 hits; 2 misses -> oldest stamp is slot 0 (pos 4, stamp 1)
    phys, vc, _ = step(c, [5], [[3, 2]])
    assert phys == [[3, 0]]
    assert slots(c) == ([2, 1, 0, 3, 5], [3, 2, 2, 3, 1])
    # decode append of position 6: takes the reserved slot, position 5 becomes host-only
    assert c.write(0, 5, rows(6, 1))[0] == 6
    assert slots(c) == ([2, 1, 0, 3, 6], [3, 2, 2, 3, 3])
    assert c.state.row_slot[0, 5].item() == -1 and c.state.row_slot[0, 6].item() == 4
    # step 4: 6 hits; 5 misses -> all LRU slots evictable, keys (2,0)<(2,1)<(3,2)<(3,3) -> slot 2
    phys, vc, _ = step(c, [5], [[5, 6]])
    assert phys == [[2, 4]]
    assert slots(c) == ([2, 1, 5, 3, 6], [3, 2, 4, 3, 4])
    assert holds(c, 2, 5) and holds(c, 4, 6)
    s = c.stats()
    assert (s["total"]["hits"], s["total"]["misses"]) == (4, 4)
    assert s["total"]["bytes_h2d"] == 4 * 16 and s["total"]["bytes_d2h"] == 7 * 16
    assert s["total"]["hit_rate"] == 0.5 and s["layers"][0]["resolves"] == 4
    assert s["live_requests"] == 1 and s["kernels"] == c.kernels
    assert s["host_pool"] == dict(blocks_used=4, blocks_total=8, block_size=2, bytes=16 * 16,
                                  bytes_used=4 * 2 * 16, pinned=False)
    check_cache(c)


def test_multi_token_group_resolves_the_union_once(make):
    c = make(max_query_len=2)
    c.add_request(1)
    c.write(0, 1, rows(0, 8))
    assert slots(c) == ([0, 1, 2, 3, 7], [0, 0, 0, 0, 0])
    # union {0, 4, 5}: 0 hits, misses 4, 5 take slots 1, 2 (stamp 0, positions 1 < 2 < 3)
    phys, vc, res = step(c, [1, 1], [[4, 5], [5, 0]])
    assert (phys, vc) == ([[1, 2], [2, 0]], [2, 2])
    assert res.stage_src.tolist() == [4, 5, -1, -1]
    assert res.stage_dst.tolist() == [1, 2, -1, -1]
    assert slots(c) == ([0, 4, 5, 3, 7], [1, 1, 1, 0, 0])
    assert c.state.step[0, 0].item() == 1  # one step for the group, not two
    # duplicates count in valid_counts but miss once; 6 -> the only stamp-0 slot (3)
    phys, vc, _ = step(c, [1, 1], [[6, 6], [6, -1]])
    assert (phys, vc) == ([[3, 3], [3, -1]], [2, 1])
    s = c.stats()["total"]
    assert (s["hits"], s["misses"], s["resolves"]) == (1, 3, 2)
    check_cache(c)


def test_two_requests_offsets_compact_and_reuse_after_free(make):
    c = make()
    c.add_request(7), c.add_request(2)
    assert (c.request(7).slot, c.request(2).slot) == (0, 1)
    c.write(0, 7, rows(0, 2))
    c.write(0, 2, rows(0, 3))
    assert c.pool.allocator.blocks(0) == [0] and c.pool.allocator.blocks(1) == [1, 2]
    phys, vc, _ = step(c, [7, 2], [[1, -1], [-1, 2]])
    assert (phys, vc) == ([[1, -1], [-1, 5 + 2]], [1, 1])  # request slot 1 rows start at 5
    phys, vc, _ = step(c, [7, 2], [[-1, 0], [-1, -1]], compact=True)
    assert (phys, vc) == ([[0, -1], [-1, -1]], [1, 0])
    c.free_request(7)
    assert c.live_requests() == [2] and c.pool.allocator.num_used == 2
    assert slots(c, r=0) == ([-1] * 5, [-1] * 5)
    assert c.state.row_slot[0, :2].tolist() == [-1, -1]  # block 0 unmapped
    assert c.state.id_to_slot[7].item() == -1 and c.state.step[0, 0].item() == 0
    # the id and the request slot come back clean; block 0 is reused first
    c.add_request(7)
    assert c.request(7).slot == 0 and c.request(7).seq_len == 0
    c.write(0, 7, rows(10, 1))
    assert c.pool.allocator.blocks(0) == [0]
    assert slots(c, r=0) == ([0, -1, -1, -1, -1], [0, -1, -1, -1, -1])
    phys, vc, _ = step(c, [7], [[0, 0]])
    assert phys == [[0, 0]] and holds(c, 0, 10)
    check_cache(c)


def test_capacity_errors_change_nothing(make):
    c = make()  # 8 blocks of 2 tokens
    c.add_request(0)
    c.add_request(1)
    c.write(0, 0, rows(0, 12))[0]  # 6 blocks
    before = snapshot(c)
    with pytest.raises(CapacityError, match="host pool (exhausted|full)"):
        c.write(0, 1, rows(0, 6))[0]  # needs 3, 2 free
    assert_same(before, snapshot(c))
    assert c.request(1).lengths[0] == 0
    with pytest.raises(CapacityError, match="request slots"):
        c.add_request(2)
    assert_same(before, snapshot(c))
    assert c.write(0, 1, rows(0, 4))[0] == 0  # exactly the 2 free blocks
    assert c.stats()["host_pool"]["blocks_used"] == 8
    check_cache(c)


def test_layers_append_independently_and_resolve_uses_the_layer_length(make):
    c = make(num_layers=2)
    c.add_request(4)
    assert c.write(0, 4, rows(0, 3))[0] == 0
    assert c.write(1, 4, rows(0, 1, layer=1))[0] == 0
    assert c.request(4).seq_len == 1 and c.request(4).lengths[0] == 3 and c.request(4).lengths[1] == 1
    assert c.state.seq_lens[:, 0].tolist() == [3, 1]
    assert c.pool.allocator.blocks(0) == [0, 1]  # blocks shared by both layers
    # layer 0 holds 3 rows: position 2 resolves there even though layer 1 lacks it
    phys, vc, _ = step(c, [4], [[2, 0]])
    assert (phys, vc) == ([[2, 0]], [2]) and holds(c, 2, 2)
    with pytest.raises(ValueError, match="seq_len=1"):
        step(c, [4], [[2, 0]], layer=1)
    before = c.state.step.tolist()
    phys, vc, _ = step(c, [4], [[2, 0]], layer=1, validate=False)  # unchecked: 2 -> -1, counted
    assert (phys, vc) == ([[-1, 0]], [1])
    assert c.stats()["layers"][1]["invalid"] == 1 and c.stats()["layers"][0]["invalid"] == 0
    assert c.state.step.tolist() == [[before[0][0], 0], [before[1][0] + 1, 0]]
    assert c.write(1, 4, rows(1, 2, layer=1))[0] == 1
    assert c.request(4).seq_len == 3
    phys, _, _ = step(c, [4], [[2, 1]], layer=1)
    assert phys == [[2, 1]] and holds(c, 2, 2, layer=1) and holds(c, 2, 2, layer=0)
    assert torch.equal(c.read_host_rows(1, 4, [2, 0]), torch.cat([rows(2, 1, 1), rows(0, 1, 1)]))
    check_cache(c)


def test_empty_inputs_are_no_ops(make):
    c = make()
    c.add_request(0)
    assert c.write(0, 0, torch.empty((0, 16), dtype=torch.uint8))[0] == 0
    assert c.pool.allocator.num_used == 0
    res = c.resolve(0, torch.empty(0, dtype=torch.int64), torch.empty((0, 2), dtype=torch.int32))
    assert res.physical.shape == (0, 2)
    res = c.resolve(0, torch.tensor([0]), torch.tensor([[-1, -1]], dtype=torch.int32), wait=False)
    assert res.physical.tolist() == [[-1, -1]] and res.valid_counts.tolist() == [0]
    res.wait()  # CPU: no event, no-op
    assert c.read_host_rows(0, 0, []).shape == (0, 16)
    check_cache(c)
