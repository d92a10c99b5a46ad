"""What the cache's unchecked launchers rely on: the state's per-layer views alias its
tensors and can't be swapped, the public launchers still check a state they did not
build, and the host pool's pinned flag is asked before every launch that reads it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace as NS

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.cache.kernel_set import PinnedPool
from hisparse.cache.resolve_launch import resolve_triton
from hisparse.cache.state import STAT_HITS, HotState, ResolveBuffers

CPU = torch.device("cpu")


def test_layer_views_alias_the_state_and_state_is_frozen():
    """The launchers read memoised per-layer views: they must be the state's own memory,
    and the fields can't be swapped under them."""
    cfg = HiSparseConfig(num_layers=2, row_bytes=64, top_k=4, device_buffer_size=8, max_num_reqs=3,
                         host_pool_tokens=64, host_block_size=8, device="cpu", max_request_id=16)
    st_ = HotState.allocate(cfg, CPU)
    v = st_.layer(1)
    assert st_.layer(1) is v
    v.seq_lens[2] = 7
    v.slot_stamp[0, 3] = 5
    v.stats[STAT_HITS] = 9
    assert int(st_.seq_lens[1, 2]) == 7 and int(st_.slot_stamp[1, 0, 3]) == 5
    assert int(st_.stats[1, STAT_HITS]) == 9 and int(st_.seq_lens[0].sum()) == 0
    with pytest.raises(AttributeError):
        st_.seq_lens = torch.zeros_like(st_.seq_lens)  # type: ignore[misc]


def test_public_resolve_triton_still_checks_a_state_it_did_not_build():
    cfg = HiSparseConfig(num_layers=1, row_bytes=64, top_k=4, device_buffer_size=8, max_num_reqs=2,
                         host_pool_tokens=64, host_block_size=8, device="cpu", max_request_id=16)
    good = HotState.allocate(cfg, CPU)
    bad = dataclasses.replace(good, slot_stamp=good.slot_stamp.to(torch.int32))
    out = ResolveBuffers.allocate(1, 4, CPU)
    with pytest.raises(ValueError, match="state.slot_stamp"):
        resolve_triton(bad, 0, torch.tensor([0], dtype=torch.int32), torch.full((1, 4), -1, dtype=torch.int32),
                       out, max_query_len=1)


def test_pinned_pool_check_reads_the_pools_flag_every_time():
    pool = NS(pinned=True)
    chk = PinnedPool(pool, torch.device("cuda", 0))
    chk.check("src")
    pool.pinned = False  # released or closed after the cache was built
    with pytest.raises(ValueError, match="not pinned"):
        chk.check("src")
    PinnedPool(pool, None).check("src")  # the interpreter reaches host memory directly
