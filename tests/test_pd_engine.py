"""The engine façade's P/D calls: a connector reserves, a prefill sender writes, the
scheduler's ``get_finished`` commits, and the request decodes through the group."""

from __future__ import annotations

import time

import pytest
import torch

from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.pd import PDDescriptor, PDSender
from pd_helpers import make_rows, nixl_or_skip, small_cfg


@pytest.fixture(scope="module", autouse=True)
def nixl():
    nixl_or_skip()


def finished(conn, timeout_s: float = 10.0) -> tuple[list[int], dict[int, str]]:
    """``get_finished`` until something is ready or failed, for up to ``timeout_s``."""
    ready, failed = [], {}
    end = time.monotonic() + timeout_s
    while not (ready or failed) and time.monotonic() < end:
        r, f = conn.get_finished()
        ready += r
        failed.update(f)
        time.sleep(0.002)
    return ready, failed


def group_of(cfg):
    group = HiSparseIndexGroup(cfg)
    for _ in range(cfg.num_layers):
        group.register_layer(kv_cache_dtype="fp8_ds_mla")
    return group


def test_group_free_request_of_a_reserved_request_closes_the_reservation():
    """The scheduler frees a reserved request through the group: the reservation closes
    (a send of its descriptor is refused), its blocks are quarantined, get_finished
    reports it failed."""
    from hisparse.pd import StaleDescriptorError
    cfg = small_cfg(max_request_id=64)
    group = group_of(cfg)
    conn = group.pd_connector(timeout_s=30)
    params = conn.request_remote_prefill(4, 40)
    group.free_request(4)
    assert conn.pending() == [] and not group.has_request(4)
    tx = PDSender(row_format="fp8_ds_mla", block_size=cfg.host_block_size)
    with pytest.raises(StaleDescriptorError):
        tx.send(PDDescriptor.from_bytes(params), make_rows(4, 40))
    ready, failed = conn.get_finished()
    assert ready == [] and "freed while reserved" in failed[4]
    assert len(group.pd_receiver().quarantined()) == 1
    tx.close()
    group.pd_receiver().close()


def test_connector_starts_the_agent_and_names_are_unique():
    cfg = small_cfg(max_request_id=64)
    a, b = group_of(cfg), group_of(cfg)
    a.pd_connector()
    assert a._pd is not None  # the pool is registered when the connector is made
    assert a.pd_receiver().name != b.pd_receiver().name
    a.pd_receiver().close()
    b.pd_receiver().close()


def test_connector_reserve_send_get_finished_then_decode():
    cfg = small_cfg(max_request_id=64)
    group = group_of(cfg)
    conn = group.pd_connector(timeout_s=30)
    params = conn.request_remote_prefill(3, 24)
    assert conn.pending() == [3] and group.request_length(3, 0) == 0
    tx = PDSender(row_format="fp8_ds_mla", block_size=cfg.host_block_size)
    rows = make_rows(3, 24)
    tx.send(PDDescriptor.from_bytes(params), rows)
    ready, failed = finished(conn)
    assert ready == [3] and failed == {} and conn.pending() == []
    # a decode forward of the committed request: write its new row, resolve, read the rows
    md = SparseMLAMetadata.build(request_ids=[3], query_lens=[1], seq_lens=[25], num_decodes=1, device="cpu")
    group.prepare_for_batch(md)
    new = make_rows(99, 1)
    topk = torch.tensor([[0, 7, 23, 24, -1, -1, -1, -1]], dtype=torch.int32)
    for i in range(cfg.num_layers):
        group.write_new_rows(i, new[i], md)
        phys = group.convert_decode_logical_to_physical_topk(i, topk, md)
        got = group.physical_kv_cache(i)[phys[0, :4].long()]
        want = torch.cat([rows[i][[0, 7, 23]], new[i]])
        assert torch.equal(got, want)
    # a reservation the scheduler dropped is aborted (once)
    conn.request_remote_prefill(4, 8)
    assert conn.request_finished(4) is True and conn.request_finished(4) is False
    group.free_request(3)
    assert not group.has_request(3) and not group.has_request(4)
    tx.close()
    group.pd_receiver().close()


def test_pd_calls_refused_mid_forward():
    cfg = small_cfg(max_request_id=64)
    group = HiSparseIndexGroup(cfg)
    for _ in range(cfg.num_layers):
        group.register_layer()
    group.add_request(1)
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[4], seq_lens=[4], num_decodes=0, device="cpu")
    group.prepare_for_batch(md)
    group.write_new_rows(0, make_rows(0, 4)[0], md)
    with pytest.raises(ValueError, match="pd_reserve part-way through a forward"):
        group.pd_reserve(2, 8)
    assert not group.has_request(2)
