"""Per-layer CUDA graphs of padded forwards (``layer_graphs=True``) on the GPU.

Over a trace with joins, leaves and several buckets, a group whose padded per-layer calls
replay per-layer graphs must equal an eager unpadded group after every forward: physical
indices, every cache state tensor, hot rows byte for byte, and every host-pool row
against the truth (rows written by a replayed write graph reach the pinned pool), also
with the inputs written into ``layer_input_buffers`` or into the engine's own buffers
(read in place by graphs of their own). Then the same with eager work mixed
in: a prefetch of the next layer and ``wait=False`` conversions between replays (their
events order the replays, and the replays them).
"""

from __future__ import annotations

import pytest
import torch

from graph_trace import Runner, TraceShape, Truth, plan_trace, run_mixed, run_pair

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("query_len,seed,inputs", [(1, 0, "new"), (2, 1, "new"), (2, 2, "in_place"),
                                                   (1, 3, "own"), (2, 4, "own")])
def test_layer_graph_forwards_equal_eager(query_len, seed, inputs):
    """inputs: new tensors every forward (from the caching allocator, whose addresses
    repeat: some get graphs of their own that read a later tensor at the same address),
    the group's ``layer_input_buffers``, or the runner's own buffers (steady addresses)."""
    shape = TraceShape(query_len=query_len)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=60, seed=seed)
    a = Runner(shape, "eager", "cuda", "triton", truth)
    b = Runner(shape, "padded", "cuda", "triton", truth, layer_graphs="cuda", in_place=inputs == "in_place",
               own_buffers=inputs == "own")
    run_pair(trace, a, b, check_rows=True)
    a.check_rows()
    counts = b.group.layer_graphs()
    assert counts["replays"] >= 40 and counts["captures"] >= 4, counts
    assert b.group.stats()["total"]["misses"] > 0
    if inputs != "in_place":  # the allocator's addresses recur too: a later tensor read by address
        assert counts["in_place_graphs"] > 0, counts



def test_layer_graphs_with_a_pool_replay_both_resolve_paths():
    """The elastic tier, a pool that overflows: conversion graphs of the resident path
    (captured while every live request is resident) and of the full path, each replayed
    only while its path applies; every forward equals the eager group."""
    shape = TraceShape(pool_rows=128 + 2 * 64)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=60, seed=21)
    a = Runner(shape, "eager", "cuda", "triton", truth)
    b = Runner(shape, "padded", "cuda", "triton", truth, layer_graphs="cuda")
    run_pair(trace, a, b, check_rows=True)
    a.check_rows()
    keys = [k for k in b.group._layer_graphs.graphs if k[0] == "convert"]
    assert {k[6] for k in keys} == {True, False}, keys
    tot = b.group.stats()["total"]
    assert tot["resident_rows"] > 0 and tot["spills"] > 0 and tot == a.group.stats()["total"], tot


@pytest.mark.parametrize("stall", [0, 2_000_000])
def test_layer_graphs_mixed_with_eager_prefetch_and_non_waiting_calls(stall):
    """With ``stall`` the stage stream idles about a millisecond before each eager
    prefetch and non-waiting conversion: a replay that did not wait for that staging
    would run before it and leave another cache, every time."""
    run_mixed("cuda", "triton", "cuda", steps=50, stall=stall)
