"""The engine façade's P/D calls: a connector reserves, a prefill sender writes, the
scheduler's ``get_finished`` commits, and the request decodes through the group."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.pd import PDDescriptor, PDSender
from pd_helpers import make_rows, nixl_or_skip, small_cfg


@pytest.fixture(scope="module", autouse=True)
def nixl():
    nixl_or_skip()


def test_connector_reserve_send_get_finished_then_decode():
    cfg = small_cfg(max_request_id=64)
    group = HiSparseIndexGroup(cfg)
    for _ in range(cfg.num_layers):
        group.register_layer(kv_cache_dtype="fp8_ds_mla")
    conn = group.pd_connector(timeout_s=30)
    params = conn.request_remote_prefill(3, 24)
    assert conn.pending() == [3] and group.request_length(3, 0) == 0
    tx = PDSender(row_format="fp8_ds_mla", block_size=cfg.host_block_size, name="engine-prefill")
    rows = make_rows(3, 24)
    tx.send(PDDescriptor.from_bytes(params), rows)
    ready, failed = [], {}
    for _ in range(2000):
        r, f = conn.get_finished()
        ready += r
        failed.update(f)
        if ready or failed:
            break
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
