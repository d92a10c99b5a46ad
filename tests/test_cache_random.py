"""Randomized HiSparseCache traces against the independent exact-LRU simulation.

Requests join and leave mid-trace; appends hit the host-pool limit; resolves mix
padding, duplicates, multi-token groups, compaction and (unchecked) invalid entries.
After every op ``tests/invariants.py`` checks the structural invariants, the exact slot
contents / stamps / counters against the simulation, host bytes against what was
appended, and every physical index of the result.
"""

import random

import pytest

pytest.importorskip("hypothesis")  # the [test] extra: without it this module is skipped

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hisparse import HiSparseConfig  # noqa: E402
from hisparse.cache.cache import HiSparseCache  # noqa: E402

from trace_runner import TraceRunner, long_trace  # noqa: E402

CONFIGS = {
    # two layers, multi-token decode, 2-token blocks
    "L2_S4_q2": dict(num_layers=2, host_pool_tokens=48, row_bytes=16, top_k=2, device_buffer_size=4,
                     max_num_reqs=3, max_query_len=2, host_block_size=2, max_request_id=6),
    # odd S, one-token blocks (block list non-contiguous after frees)
    "L1_S5_B1": dict(num_layers=1, host_pool_tokens=24, row_bytes=16, top_k=2, device_buffer_size=5,
                     max_num_reqs=2, max_query_len=2, host_block_size=1, max_request_id=5),
    # wider rows, K=4, 4-token blocks
    "L2_S8_K4": dict(num_layers=2, host_pool_tokens=64, row_bytes=32, top_k=4, device_buffer_size=8,
                     max_num_reqs=2, max_query_len=1, host_block_size=4, max_request_id=7),
    # one block of 16 tokens, S = 16
    "L1_S16_B16": dict(num_layers=1, host_pool_tokens=64, row_bytes=16, top_k=8, device_buffer_size=16,
                       max_num_reqs=2, max_query_len=2, host_block_size=16, max_request_id=4),
}

OP = st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("append"), st.integers(0, 7), st.integers(0, 3),
              st.sampled_from([0, 1, 1, 1, 2, 3, 7, 17]), st.booleans()),
    st.tuples(st.just("append_tokens"), st.integers(0, 15), st.integers(0, 3)),
    st.tuples(st.just("resolve"), st.integers(0, 3), st.integers(0, 15),
              st.sampled_from([0.0, 0.2, 0.6]), st.booleans(), st.booleans()),
)


def make(name, kernels="torch"):
    return HiSparseCache(HiSparseConfig(device="cpu", **CONFIGS[name]), kernels=kernels)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OP, min_size=1, max_size=30), seed=st.integers(0, 2**16))
def test_random_trace_matches_lru_sim(name, ops, seed):
    runner = TraceRunner(make(name), seed=seed)
    runner.run([("add",), ("append", 0, 0, 5, True)] + ops)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_long_seeded_trace_exercises_eviction_and_capacity(name):
    """A longer trace must really evict, stage and hit the pool limit (not only hits)."""
    runner = TraceRunner(make(name), seed=7)
    long_trace(runner, random.Random(1234), 250)
    tot = runner.cache.stats()["total"]
    assert tot["misses"] > 10 and tot["hits"] > 10 and tot["invalid"] > 0, tot
    assert runner.capacity_errors > 0


@pytest.mark.parametrize("name", ["L2_S4_q2", "L1_S5_B1"])
def test_random_trace_through_triton_kernels(name):
    """The same checks with kernels='triton' (TRITON_INTERPRET=1 on CPU)."""
    cache = make(name, kernels="triton")
    assert cache.kernels == "triton"
    runner = TraceRunner(cache, seed=3)
    long_trace(runner, random.Random(99), 60)
    assert cache.stats()["total"]["misses"] > 0
