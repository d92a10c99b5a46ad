"""Padded (graph-bucket) forwards of the engine façade equal unpadded ones, on CPU.

``prepare_for_batch(md, pad_to=N)`` pads a decode batch to a bucket: the per-layer calls
take the bucket's tokens and launch from persistent buffers. Over a trace with joins,
leaves, contexts crossing the LRU slots and block edges, the padded group must leave the
same cache (every state tensor, hot rows, host rows) and return the same physical
indices as an unpadded one, with padding tokens resolving to -1. The CUDA-graph replay
of the same trace is tests/test_graph_step_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from graph_trace import (Runner, TraceShape, Truth, assert_same_state, cache_state,
                         decode_md, join, make_group, plan_trace, run_pair)
from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.write_step import StepCapacity
from hisparse.engine import SparseMLAMetadata


@pytest.mark.parametrize("kernels,query_len,seed", [("torch", 1, 0), ("triton", 1, 1), ("torch", 2, 2),
                                                     ("triton", 2, 3)])
def test_padded_forwards_equal_unpadded(kernels, query_len, seed):
    shape = TraceShape(query_len=query_len)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=10 if kernels == "triton" else 22, seed=seed)
    a = Runner(shape, "eager", "cpu", kernels, truth)
    b = Runner(shape, "padded", "cpu", kernels, truth)
    run_pair(trace, a, b)
    a.check_rows()
    b.check_rows()
    assert len(b.seen) >= 2, "the trace should use more than one bucket"
    assert b.group.stats()["total"]["misses"] > 0


# the elastic tier: hot buffers (6 x 17 rows, 128 with padding) + 2 pages of 64 rows, for
# up to 6 requests of up to 64 rows: some stay resident, the others are demoted
POOL_ROWS = 128 + 2 * 64


@pytest.mark.parametrize("kernels,seed", [("torch", 7), ("triton", 8)])
def test_padded_forwards_equal_unpadded_with_a_pool(kernels, seed):
    shape = TraceShape(pool_rows=POOL_ROWS)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=10 if kernels == "triton" else 30, seed=seed)
    a = Runner(shape, "eager", "cpu", kernels, truth)
    b = Runner(shape, "padded", "cpu", kernels, truth)
    run_pair(trace, a, b)
    a.check_rows()
    b.check_rows()
    tot = b.group.stats()["total"]
    assert tot["resident_rows"] > 0 and tot["spills"] > 0, tot
    assert tot == a.group.stats()["total"]




def _small_group():
    """(shape, truth, a torch-kernel group on CPU, an empty lengths map) of a default
    TraceShape."""
    shape = TraceShape()
    truth = Truth(shape)
    return shape, truth, make_group(shape, "cpu", "torch"), {}


def test_pad_to_checks_and_replay_contract():
    shape, truth, g, lens = _small_group()
    join(g, 1, 5, truth, lens)
    join(g, 2, 20, truth, lens)
    md = decode_md([1, 2], lens)
    for bad, match in ((1, "smaller"), (7, "pad_to"), (0, "pad_to")):
        with pytest.raises(ValueError, match=match):
            g.prepare_for_batch(md, pad_to=bad)
    with pytest.raises(ValueError, match="needs pad_to"):
        g.prepare_for_batch(md, replay=True)
    mixed = SparseMLAMetadata.build(request_ids=[1, 2], query_lens=[1, 3], seq_lens=[6, 23], num_decodes=1)
    with pytest.raises(ValueError, match="decode-only"):
        g.prepare_for_batch(mixed, pad_to=4)
    assert [g.request_length(r, 0) for r in (1, 2)] == [5, 20]  # nothing changed
    g.prepare_for_batch(md, pad_to=4)
    rows = torch.cat([truth.rows(0, 1)[5:6], truth.rows(0, 2)[20:21]])
    with pytest.raises(ValueError, match="T=4"):
        g.write_new_rows(0, rows, md)  # the bucket's 4 tokens, not the batch's 2
    g.write_new_rows(0, torch.cat([rows, rows]), md)
    with pytest.raises(ValueError, match="num_decode_tokens=4"):
        g.convert_decode_logical_to_physical_topk(0, torch.zeros((2, 8), dtype=torch.int32), md)


def test_abandoned_layers_are_put_back():
    """A forward whose write_new_rows ran for no layer leaves its layers as they were
    (its block stays with the request and serves the next forward); one that wrote some
    layers leaves those (as an eager forward cut short would)."""
    shape, truth, g, lens = _small_group()
    n = 16
    join(g, 1, n, truth, lens)  # the next row opens a new block (blocks of 4)
    c = g.hisparse_cache
    used = c.pool.allocator.num_used
    md = decode_md([1], lens)
    g.prepare_for_batch(md, pad_to=2)
    assert c.pool.allocator.num_used == used + 1  # the step's block
    assert g.request_length(1, 0) == n  # not written yet
    g.prepare_for_batch(md, pad_to=2)  # the same forward again: the last one was abandoned
    assert c.pool.allocator.num_used == used + 1  # its block serves this one
    for layer in range(2):
        g.write_new_rows(layer, torch.cat([truth.rows(layer, 1)[n:n + 1]] * 2), md)
    assert [g.request_length(1, i) for i in range(2)] == [n + 1, n + 1]
    for layer in range(2):
        assert torch.equal(c.read_host_rows(layer, 1, list(range(n + 1))), truth.rows(layer, 1)[:n + 1])
    tk = torch.full((2, 8), -1, dtype=torch.int32)
    tk[0, :3] = torch.tensor([n, 0, n - 1])
    phys = g.convert_decode_logical_to_physical_topk(0, tk, md)
    hot = c.hot_rows(0)[phys[0, :3].long()]
    assert torch.equal(hot, truth.rows(0, 1)[[n, 0, n - 1]])
    # a forward that writes layer 0 only: the next one sees differing lengths
    lens[1] = n + 1
    md3 = decode_md([1], lens)
    g.prepare_for_batch(md3)
    g.write_new_rows(0, truth.rows(0, 1)[n + 1:n + 2], md3)
    with pytest.raises(ValueError, match=rf"holds \[{n + 2}, {n + 1}\]"):
        g.prepare_for_batch(decode_md([1], {1: n + 2}))


def test_replayed_forward_refuses_eager_calls():
    shape, truth, g, lens = _small_group()
    join(g, 1, 5, truth, lens)
    md = decode_md([1], lens)
    g.prepare_for_batch(md, pad_to=2, replay=True)  # (no graph here: only the bookkeeping)
    assert [g.request_length(1, i) for i in range(2)] == [6, 6]
    with pytest.raises(ValueError, match="graph replay"):
        g.write_new_rows(0, torch.zeros((2, 656), dtype=torch.uint8), md)
    with pytest.raises(ValueError, match="graph replay"):
        g.convert_decode_logical_to_physical_topk(0, torch.full((2, 8), -1, dtype=torch.int32), md)
    assert g.resolves_per_layer == [1, 1]


def test_abandoned_forward_is_put_back_after_requests_change():
    """Requests freed between an unwritten forward and the next one: the live request's
    layers are still put back; a failing prepare (pool full) changes nothing, the
    abandoned forward included."""
    shape, truth, g, lens = _small_group()
    c = g.hisparse_cache
    join(g, 1, 16, truth, lens)
    join(g, 2, 7, truth, lens)
    g.prepare_for_batch(decode_md([1, 2], lens), pad_to=2)  # written by no layer
    g.free_request(2)  # the generation moves on
    assert [g.request_length(1, i) for i in range(2)] == [16, 16]
    before = cache_state(g)
    used = c.pool.allocator.num_used
    # a batch that can't get its blocks: the pool holds 6 * 64 rows
    g.add_request(3)
    n3 = c.pool.allocator.num_free * shape.block + 1
    big = SparseMLAMetadata.build(request_ids=[3], query_lens=[n3], seq_lens=[n3], num_decodes=0)
    with pytest.raises(CapacityError):
        g.prepare_for_batch(big)
    assert list(c.request(1).lengths) == [17, 17]  # still the abandoned forward's
    assert [g.request_length(1, i) for i in range(2)] == [16, 16]
    assert c.pool.allocator.num_used == used
    md = decode_md([1], {1: 16})
    g.prepare_for_batch(md)  # puts the abandoned forward back, then plans this one
    assert list(c.request(1).lengths) == [17, 17]
    for layer in range(2):
        g.write_new_rows(layer, truth.rows(layer, 1)[16:17], md)
        assert torch.equal(c.read_host_rows(layer, 1, list(range(17))), truth.rows(layer, 1)[:17])
    after = cache_state(g)
    assert torch.equal(after["seq_lens"][:, c.request(1).slot], torch.tensor([17, 17], dtype=torch.int32))
    assert not torch.equal(before["hot"], after["hot"])


def test_a_request_admitted_again_is_not_the_abandoned_forwards():
    """Free and re-admit a request under the same id (it gets the same slot) after a
    forward that wrote nothing: the put-back must not hand the new request the old one's
    lengths."""
    shape, truth, g, lens = _small_group()
    c = g.hisparse_cache
    join(g, 1, 10, truth, lens)
    g.prepare_for_batch(decode_md([1], lens), pad_to=2)  # written by no layer
    slot = c.request(1).slot
    g.free_request(1)
    g.add_request(1)
    assert c.request(1).slot == slot
    assert [g.request_length(1, i) for i in range(2)] == [0, 0]
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[4], seq_lens=[4], num_decodes=0)
    g.prepare_for_batch(md)  # the new request's prefill is accepted
    for layer in range(2):
        g.write_new_rows(layer, truth.rows(layer, 1)[:4], md)
    assert list(c.request(1).lengths) == [4, 4]
    assert c.state.seq_lens[:, slot].tolist() == [4, 4]


def test_a_layers_write_makes_its_held_results_stale():
    shape, truth, g, lens = _small_group()
    c = g.hisparse_cache
    join(g, 1, 20, truth, lens)
    batch = c.plan_write([1], [1])
    step = c.prepare_step(batch)
    res = c.resolve(1, torch.tensor([1], dtype=torch.int32), torch.tensor([[0, 5, -1, -1, -1, -1, -1, -1]],
                                                                           dtype=torch.int32))
    assert not res.stale
    c.write_step(1, step, truth.rows(1, 1)[20:21])
    assert res.stale


def test_abandon_forward_and_bucket_buffers_taken_over():
    shape, truth, g, lens = _small_group()
    c = g.hisparse_cache
    join(g, 1, 10, truth, lens)
    md = decode_md([1], lens)
    g.prepare_for_batch(md, pad_to=2)
    g.write_new_rows(0, torch.cat([truth.rows(0, 1)[10:11]] * 2), md)
    g.abandon_forward()  # (a capture that raised): every layer not run is put back
    assert list(c.request(1).lengths) == [11, 10]  # layer 0 ran eagerly
    with pytest.raises(ValueError, match="prepare_for_batch"):
        g.write_new_rows(1, torch.cat([truth.rows(1, 1)[10:11]] * 2), md)
    # two padded steps of one bucket share its buffers: the older step can't write any more
    join(g, 2, 6, truth, lens)
    first = c.prepare_step(c.plan_write([2], [1]), capacity=StepCapacity(requests=2, tokens=2))
    second = c.prepare_step(c.plan_write([2], [1]), capacity=StepCapacity(requests=2, tokens=2),
                            replaces=first)
    with pytest.raises(ValueError, match="later step"):
        c.write_step(0, first, torch.zeros((2, 656), dtype=torch.uint8))
    c.write_step(0, second, torch.cat([truth.rows(0, 2)[6:7]] * 2))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_checked_group_takes_padded_forwards_and_refuses_selections_of_padding(kernels):
    """A checked group (validate=True) accepts a bucket's padding tokens (request id
    -1, every entry -1) and returns what an unchecked group does; a padding token that
    selects a position is refused before anything changes."""
    shape = TraceShape()
    truth = Truth(shape)
    groups = [make_group(shape, "cpu", kernels, validate=v) for v in (True, False)]
    lens: dict = {}
    for g in groups:
        join(g, 1, 9, truth, dict(lens))
        join(g, 2, 14, truth, dict(lens))
    lens = {1: 9, 2: 14}
    md = decode_md([1, 2], lens)
    tk = torch.full((4, 8), -1, dtype=torch.int32)
    tk[0, :3] = torch.tensor([9, 0, 4])
    tk[1, :4] = torch.tensor([14, 13, 2, 2])
    rows = torch.cat([truth.rows(0, 1)[9:10], truth.rows(0, 2)[14:15]] * 2)
    out = []
    for g in groups:
        g.prepare_for_batch(md, pad_to=4)
        for layer in range(shape.layers):
            g.write_new_rows(layer, rows if layer == 0 else torch.cat(
                [truth.rows(layer, 1)[9:10], truth.rows(layer, 2)[14:15]] * 2), md)
        out.append(g.convert_decode_logical_to_physical_topk(0, tk, md))
    assert torch.equal(out[0], out[1])
    assert bool((out[0][2:] == -1).all())
    checked = groups[0]
    before = cache_state(checked)
    for pos in (0, -5):  # a padding token selecting position 0, or holding an entry below -1
        bad = tk.clone()
        bad[3, 0] = pos
        with pytest.raises(ValueError, match=r"req_ids\[3\] = -1 marks a padding token"):
            checked.convert_decode_logical_to_physical_topk(1, bad, md)
    assert_same_state(before, cache_state(checked))


def test_checked_resolve_padding_tokens_do_not_split_a_request():
    """A padding token between two tokens of one request does not make them one run:
    the request's tokens must still be contiguous."""
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=256, row_bytes=656, top_k=4, device_buffer_size=8,
                         max_num_reqs=2, max_query_len=2, host_block_size=16, device="cpu")
    c = HiSparseCache(cfg, kernels="torch")
    c.add_request(0)
    c.write(0, 0, torch.zeros((3, 656), dtype=torch.uint8))
    tk = torch.tensor([[0, -1, -1, -1], [-1, -1, -1, -1], [1, -1, -1, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="not contiguous"):
        c.resolve(0, torch.tensor([0, -1, 0], dtype=torch.int32), tk)
    res = c.resolve(0, torch.tensor([0, 0, -1], dtype=torch.int32), tk[[0, 2, 1]])
    assert bool((res.physical[2] == -1).all()) and int(res.physical[0, 0]) >= 0


def test_a_step_refuses_requests_whose_layers_differ_and_changes_nothing():
    """Writer.prepare_step (below the façade's own check): a request whose layers hold
    different row counts is refused before any block, length or table entry changes;
    once every layer holds the same rows, the same step is planned for all of them."""
    cfg = HiSparseConfig(num_layers=3, host_pool_tokens=256, row_bytes=656, top_k=8,
                         device_buffer_size=16, max_num_reqs=2, host_block_size=4, device="cpu")
    c = HiSparseCache(cfg, kernels="torch")
    c.add_request(5)
    c.add_request(6)
    rows = torch.randint(0, 255, (7, 656), dtype=torch.uint8)
    for layer in range(3):
        c.write(layer, 6, rows[:3])
    for layer in (0, 2):  # layer 1 of request 5 is one row short
        c.write(layer, 5, rows)
    c.write(1, 5, rows[:6])
    r5, r6 = c.request(5).slot, c.request(6).slot
    before = (list(c.requests.lengths(r5)), list(c.requests.lengths(r6)), c.pool.allocator.num_used,
              c.state.block_table.clone(), list(c.requests.epochs))
    with pytest.raises(ValueError, match=r"request 5 holds \[7, 6, 7\] rows per layer"):
        c.prepare_step(c.plan_write([6, 5], [1, 1]))
    after = (list(c.requests.lengths(r5)), list(c.requests.lengths(r6)), c.pool.allocator.num_used,
             c.state.block_table, list(c.requests.epochs))
    assert before[:3] == after[:3] and torch.equal(before[3], after[3]) and before[4] == after[4]
    c.write(1, 5, rows[6:7])
    c.prepare_step(c.plan_write([6, 5], [1, 1]))
    assert c.requests.lengths(r5) == [8, 8, 8] and c.requests.lengths(r6) == [4, 4, 4]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_host_written_steps_mirror_nothing_and_count_their_rows(kernels):
    """A ``host_written`` step (the rows are in the host pool already: hisparse.pd) plans
    no host mirror, leaves the pool's rows as they are and counts its rows in the D2H
    counter, leaving the state a write of the same rows leaves. A padded one is
    refused (a bucket's graph replays other steps), changing nothing. The rows handed to the writes hold poison
    where the write needs none (positions S .. C - 2 of a hot request)."""
    from invariants import assert_same, snapshot
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=256, row_bytes=656, top_k=8, device_buffer_size=16,
                         max_num_reqs=2, max_query_len=1, host_block_size=16, device="cpu")
    C, S = 40, 16
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 256, (C, 656), dtype=torch.uint8, generator=g) for _ in range(2)]
    ref = HiSparseCache(cfg, kernels=kernels)
    ref.add_request(1)
    for layer in range(2):
        ref.write(layer, 1, rows[layer])
    want = snapshot(ref)
    c = HiSparseCache(cfg, kernels=kernels)
    c.add_request(1)
    c.writer.allocate_for(c.request(1).slot, C)
    for layer in range(2):
        for p0, p1, h in c.pool.segments(c.request(1).slot, 0, C):
            c.pool.rows[layer][h:h + p1 - p0] = rows[layer][p0:p1]
    before = snapshot(c)
    with pytest.raises(ValueError, match="host_written steps can't be padded"):
        c.prepare_step(c.plan_write([1], [C]), capacity=StepCapacity(requests=1, tokens=C), host_written=True)
    assert_same(before, snapshot(c))  # refused before anything changed
    step = c.prepare_step(c.plan_write([1], [C]), host_written=True)
    assert int((step.plan.host_h >= 0).sum()) == 0 and step.host_rows == C  # no host row listed; C counted
    for layer in range(2):
        given = rows[layer].clone()
        given[S:C - 1] = 0xA5
        c.write_step(layer, step, given)
    got = snapshot(c)
    same = {k: torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k] for k, v in want.items()}
    assert all(same.values()), [k for k, ok in same.items() if not ok]
