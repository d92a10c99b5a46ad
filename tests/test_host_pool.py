"""HostPool / BlockAllocator: exact sizes, allocation order, capacity, address mapping."""

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.host_pool import BlockAllocator, HostPool


def cfg(**kw):
    base = dict(num_layers=3, host_pool_tokens=20, row_bytes=32, top_k=2,
                max_num_reqs=4, host_block_size=4, max_request_id=16, device="cpu")
    base.update(kw)
    return HiSparseConfig(**base)


def test_allocator_hands_out_lowest_first_and_tracks_owners():
    a = BlockAllocator(5)
    assert a.allocate("x", 2) == [0, 1]
    assert a.allocate("y", 1) == [2]
    assert a.allocate("x", 1) == [3]
    assert a.blocks("x") == [0, 1, 3] and a.blocks("y") == [2]
    assert (a.num_used, a.num_free) == (4, 1)
    assert a.allocate("z", 0) == [] and a.blocks("z") == []
    assert a.free("x") == [0, 1, 3]
    assert a.blocks("x") == [] and a.num_free == 4
    assert a.allocate("w", 3) == [0, 1, 3]  # freed blocks reused lowest first
    assert a.free("nobody") == []


def test_allocator_capacity_error_changes_nothing():
    a = BlockAllocator(3)
    a.allocate("x", 2)
    with pytest.raises(CapacityError, match="2 more blocks needed, 1 of 3 free"):
        a.allocate("y", 2)
    assert a.blocks("y") == [] and "y" not in a.owners()
    assert a.num_free == 1 and a.blocks("x") == [0, 1]
    assert a.allocate("y", 1) == [2]
    with pytest.raises(CapacityError):
        a.allocate("x", 1)
    assert a.blocks("x") == [0, 1]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_allocator_rejects_bad_counts(bad):
    a = BlockAllocator(3)
    with pytest.raises(ValueError):
        a.allocate("x", bad)
    assert a.num_free == 3
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_pool_shape_and_exact_size():
    c = cfg()  # 20 tokens / 4 = 5 blocks -> H = 20
    p = HostPool(c)
    assert p.rows.shape == (3, 20, 32) and p.rows.dtype == torch.uint8
    assert p.nbytes == c.host_pool_bytes == 3 * 20 * 32
    assert p.rows.untyped_storage().nbytes() == c.host_pool_bytes
    assert p.allocator.num_blocks == 5 and p.pinned is False  # no CUDA here
    c2 = cfg(host_pool_tokens=23)  # rounds down to whole blocks
    assert HostPool(c2).rows.shape == (3, 20, 32)


def test_pool_segments_merge_consecutive_blocks():
    p = HostPool(cfg())
    p.allocator.allocate("a", 2)  # blocks 0, 1
    p.allocator.allocate("b", 1)  # block 2
    p.allocator.allocate("a", 2)  # blocks 3, 4
    assert p.blocks_needed("a", 16) == 0 and p.blocks_needed("a", 17) == 1
    assert p.blocks_needed("new", 1) == 1 and p.blocks_needed("new", 0) == 0
    # a: logical blocks [0, 1, 3, 4] -> rows 0..7 then 12..19
    assert p.segments("a", 0, 16) == [(0, 8, 0), (8, 16, 12)]
    assert p.segments("a", 3, 10) == [(3, 8, 3), (8, 10, 12)]
    assert p.segments("a", 5, 5) == []
    assert p.segments("b", 1, 3) == [(1, 3, 9)]
    rows = p.host_rows("a", torch.tensor([0, 7, 8, 15]))
    assert rows.tolist() == [0, 7, 12, 19]
    with pytest.raises(ValueError):
        p.segments("a", 10, 17)
    with pytest.raises(ValueError):
        p.host_rows("b", torch.tensor([4]))
    with pytest.raises(ValueError):
        p.host_rows("b", torch.tensor([-1]))


def test_pool_rows_are_one_buffer():
    p = HostPool(cfg())
    p.rows[1, 5] = 7
    flat = p.buffer.tensor
    assert int(flat[(1 * 20 + 5) * 32]) == 7
    assert p.rows.data_ptr() == flat.data_ptr()


def test_pin_true_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the gpu test file checks pinning")
    with pytest.raises(ValueError, match="needs CUDA"):
        HostPool(cfg(), pin=True)


def test_claim_takes_given_free_blocks_or_nothing():
    a = BlockAllocator(6)
    a.allocate("x", 2)  # blocks 0, 1
    with pytest.raises(ValueError, match=r"\[1\] not free"):
        a.claim("q", [3, 1])
    with pytest.raises(ValueError, match="duplicates"):
        a.claim("q", [3, 3])
    assert a.num_free == 4 and a.owners() == ["x"]
    a.claim("q", [4, 2])
    assert a.blocks("q") == [4, 2] and a.num_free == 2
    assert a.allocate("y", 2) == [3, 5]  # still lowest first
    a.free("q")
    assert a.allocate("z", 2) == [2, 4]


def test_free_listeners_hear_each_free_after_it():
    from hisparse import HiSparseCache
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=64, row_bytes=656, top_k=4, device_buffer_size=8,
                         max_num_reqs=2, max_query_len=1, host_block_size=16, device="cpu")
    c = HiSparseCache(cfg)
    heard = []
    c.free_listeners.append(lambda rid, r, blocks: heard.append((rid, r, list(blocks), c.requests.is_live(rid),
                                                                 c.pool.allocator.num_free)))
    c.add_request(5)
    c.writer.allocate_for(c.request(5).slot, 20)
    c.free_request(5)
    assert heard == [(5, 0, [0, 1], False, 4)]


def _segments_by_row(blocks, B, p0, p1):
    """The definition: one run per maximal range of positions whose host rows count up by one."""
    out = []
    for p in range(p0, p1):
        row = blocks[p // B] * B + p % B
        if out and out[-1][1] == p and out[-1][2] + (p - out[-1][0]) == row:
            out[-1] = (out[-1][0], p + 1, out[-1][2])
        else:
            out.append((p, p + 1, row))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_block_segments_over_few_and_many_blocks_match_the_definition(seed):
    """Few blocks take the loop, more than 8 the numpy path: both give the runs the
    per-position definition gives, for block lists with runs, holes and reversals,
    given as a list or an int64 array, over spans starting and ending mid-block."""
    import numpy as np
    from hisparse.cache.host_pool import block_segments
    g = np.random.default_rng(seed)
    B = int(g.choice([1, 4, 16]))
    n = int(g.integers(1, 40))
    pieces = []
    while sum(map(len, pieces)) < n:  # runs of consecutive ids at random places
        start, k = int(g.integers(0, 200)), int(g.integers(1, 6))
        pieces.append(list(range(start, start + k)) if g.random() < 0.8 else list(range(start + k, start, -1)))
    blocks = [b for piece in pieces for b in piece][:n]
    for _ in range(20):
        p0 = int(g.integers(0, n * B))
        p1 = int(g.integers(p0, n * B + 1))
        want = _segments_by_row(blocks, B, p0, p1)
        assert block_segments(blocks, B, p0, p1) == want
        got = block_segments(np.array(blocks, dtype=np.int64), B, p0, p1)
        assert got == want and all(type(x) is int for run in got for x in run)
    for p0, p1 in ((0, n * B + 1), (-1, 3), (n * B - 1, n * B + 10 * B)):  # past the blocks given
        with pytest.raises(ValueError, match="exceed"):
            block_segments(blocks, B, p0, p1)
