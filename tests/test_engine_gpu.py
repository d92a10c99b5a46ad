"""The engine façade and the mini engine on CUDA (H200).

The CPU contract tests of ``test_engine.py`` are rerun with every tensor on the GPU
(pinned host pool, Triton resolve / copy / staging kernels, side streams and events);
the prefill tests check the returned event is a CUDA event that orders the staging
before the reader. The mini engine runs resident vs hisparse at a small and a medium
size (K = 2048, 4096 hot slots, ~6K contexts) and must match token by token.
"""

from __future__ import annotations

import pytest
import torch

import test_engine as te
from hisparse.formats import dequantize_fp8_ds_mla_reference
from hisparse_tools import mini_engine as me

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    monkeypatch.setattr(te, "DEVICE", "cuda")
    yield
    torch.cuda.synchronize()


def test_decode_steps_byte_exact_cuda():
    te.test_decode_steps_byte_exact()


def test_deferred_staging_wait_cuda():
    te.test_deferred_staging_wait()


def test_deferred_wait_is_what_orders_the_rows_cuda(monkeypatch):
    """With the stage stream held up before its miss copy, the hot rows read on the
    compute stream right after convert(wait=False) are not the staged ones yet; after
    wait_for_staging they are, byte for byte: the wait is what orders them."""
    g = te.make_group()
    lens = {1: 5, 2: 20, 3: 31}
    for rid, n in lens.items():
        te.fill(g, rid, n)
    ks = g.hisparse_cache.kernel_set
    real_copy = ks.copy_staged

    def held_copy(*args, **kw):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the stage stream before the copy
        return real_copy(*args, **kw)

    monkeypatch.setattr(ks, "copy_staged", held_copy)
    md = te.build([(rid, 1, lens[rid] + 1) for rid in lens], 3)
    te.forward_writes(g, md)
    misses = g.stats()["total"]["misses"]
    topk = te.random_topk(md, seed=3)
    phys, counts = g.convert_decode_logical_to_physical_topk(0, topk, md, return_valid_counts=True, wait=False)
    early = g.physical_kv_cache(0).clone()  # on the compute stream, not ordered after the copy
    g.wait_for_staging(0)
    te.check_physical(g, md, topk, phys, counts, 0)
    assert g.stats()["total"]["misses"] > misses
    assert not torch.equal(early, g.physical_kv_cache(0))  # the staged rows landed after it


def test_each_layer_resolved_once_cuda():
    te.test_each_layer_resolved_once_per_forward()


def test_batched_writes_equal_per_request_cuda():
    te.test_batched_writes_equal_per_request_appends()


def test_capacity_error_changes_nothing_cuda():
    te.test_batched_write_capacity_error_changes_nothing()


def test_multi_token_decode_cuda():
    te.test_multi_token_decode_within_buffer_and_beyond()


@pytest.mark.parametrize("pool_rows", [None, 64 + 2 * 64])
@pytest.mark.parametrize("validate", [True, False])
def test_gather_fp8_prefill_event_cuda(validate, pool_rows):
    """``pool_rows``: the prefill requests 2 and 3 resident (staged from device pages)."""
    g = te.make_group(validate=validate, device_pool_rows=pool_rows)
    md = te._mixed_batch(g)
    assert g.hisparse_cache.pool.pinned
    if pool_rows is not None:
        assert [g.hisparse_cache.residency(rid) for rid in (1, 2, 3)] == ["hot", "resident", "resident"]
    for layer in range(te.L):
        g.convert_decode_logical_to_physical_topk(layer, te.random_topk(md, layer), md)
        ws = torch.full((30, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
        starts = torch.tensor([0, 13], dtype=torch.int32, device="cuda")
        ev = g.gather_fp8_prefill(layer, None, ws, None, starts, 2, md, 0)
        assert isinstance(ev, torch.cuda.Event)
        torch.cuda.current_stream().wait_event(ev)  # what the engine does before attention
        got = ws.clone()  # on the compute stream, ordered after the staging by the event
        for rid, n, w0 in ((2, 13, 0), (3, 11, 13)):
            want = dequantize_fp8_ds_mla_reference(te.row_table(layer, rid)[:n])
            assert torch.equal(got[w0:w0 + n].cpu(), want), (layer, rid)
        assert torch.isnan(got[24:].float()).all()


def test_stage_prefill_rows_cuda():
    g = te.make_group()
    md = te._mixed_batch(g)
    kv = torch.zeros(8, 4, 656, dtype=torch.uint8, device="cuda")
    staged, bt, req_ids = g.stage_prefill_rows(1, kv, md)
    assert staged.is_cuda and bt.is_cuda and req_ids.is_cuda
    staged, bt = staged.cpu(), bt.cpu()
    for p, (rid, n) in enumerate(((2, 13), (3, 11))):
        pos = torch.arange(n)
        rows = bt[p].long()[pos // 4] * 4 + pos % 4
        assert torch.equal(staged[rows], te.row_table(1, rid)[:n])


@pytest.mark.parametrize("validate", [True, False])
def test_mini_engine_small_cuda(validate):
    cfg = me.MiniEngineConfig(device="cuda", backend="triton", validate=validate)
    res = me.run(cfg)
    c = res["compare"]
    print(me.format_report(res))
    assert c["within_tolerance"], c
    assert res["hisparse"]["cache"]["misses"] > 0


def test_mini_engine_medium_cuda():
    """K = 2048, 4096 hot slots, contexts ~6K: misses every step; outputs must match."""
    cfg = me.MiniEngineConfig(device="cuda", backend="triton", num_layers=4, num_heads=16, hidden=128,
                              indexer_dim=32, vocab=512, top_k=2048, num_requests=8, min_prompt=5632,
                              max_prompt=6144, synthetic_context=5376, min_decode=4, max_decode=6,
                              arrival_every=1, chunk=256, max_batch_tokens=2048, host_block_size=64,
                              validate=False, locality=0.9)
    res = me.run(cfg)
    print(me.format_report(res))
    c = res["compare"]
    assert c["within_tolerance"], c
    assert c["argmax_mismatches"] == 0, c
    cache = res["hisparse"]["cache"]
    assert cache["misses"] > 0 and cache["invalid"] == 0, cache
