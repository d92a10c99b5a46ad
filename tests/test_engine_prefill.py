"""The engine façade's prefill staging on CPU (helpers: ``test_engine``, whose tiny
cache and byte-checked rows these tests share).

``gather_fp8_prefill`` dequantises the prefill requests' rows into a bf16 workspace,
byte-exact with and without the elastic tier (resident requests staged from their
device pages), checks its arguments and needs the layer's rows written first;
``stage_prefill_rows`` hands the rows out in the stored format (blocks and flat).
"""

from __future__ import annotations

import pytest
import torch

from hisparse.formats import dequantize_fp8_ds_mla_reference

from test_engine import L, _mixed_batch, build, fill, make_group, random_topk, row_table


@pytest.mark.parametrize("pool_rows", [None, 64 + 2 * 64])
def test_gather_fp8_prefill_workspace_exact(pool_rows):
    """With the elastic tier (two pages of 64 rows), request 3's admission demotes 1:
    the prefill requests 2 and 3 are resident and staged from their device pages."""
    g = make_group(device_pool_rows=pool_rows)
    md = _mixed_batch(g)
    c = g.hisparse_cache
    if pool_rows is not None:
        assert [c.residency(rid) for rid in (1, 2, 3)] == ["hot", "resident", "resident"]
    for layer in range(L):
        # the decode part first (it moves hot slots), then the prefill staging
        g.convert_decode_logical_to_physical_topk(layer, random_topk(md, layer), md)
        ws = torch.full((30, 576), float("nan"), dtype=torch.bfloat16)
        starts = torch.tensor([0, 13], dtype=torch.int32)
        ev = g.gather_fp8_prefill(layer, None, ws, None, starts, 2, md, 0)
        assert ev is None  # CPU
        for (rid, n, w0) in ((2, 13, 0), (3, 11, 13)):
            want = dequantize_fp8_ds_mla_reference(row_table(layer, rid)[:n])
            assert torch.equal(ws[w0:w0 + n], want), (layer, rid)
        assert torch.isnan(ws[24:].float()).all()  # nothing written past the staged rows
        # the second prefill request alone, at workspace row 0
        ws2 = torch.zeros(11, 576, dtype=torch.bfloat16)
        g.gather_fp8_prefill(layer, None, ws2, None, torch.tensor([0], dtype=torch.int32), 1, md, 1)
        assert torch.equal(ws2, dequantize_fp8_ds_mla_reference(row_table(layer, 3)[:11]))
    assert g.resolves_per_layer == [1, 1]  # prefill requests are never resolved


def test_gather_fp8_prefill_bad_args():
    g = make_group()
    md = _mixed_batch(g)
    ws = torch.zeros(30, 576, dtype=torch.bfloat16)
    good = torch.tensor([0, 13], dtype=torch.int32)
    with pytest.raises(ValueError, match="prefix sums"):
        g.gather_fp8_prefill(0, None, ws, None, torch.tensor([0, 12], dtype=torch.int32), 2, md, 0)
    with pytest.raises(ValueError, match="outside"):
        g.gather_fp8_prefill(0, None, ws, None, good, 2, md, 1)
    with pytest.raises(ValueError, match="chunk"):
        g.gather_fp8_prefill(0, None, ws[:20], None, good, 2, md, 0)
    with pytest.raises(TypeError):
        g.gather_fp8_prefill(0, None, ws.float(), None, good, 2, md, 0)
    with pytest.raises(TypeError):
        g.gather_fp8_prefill(0, None, ws, None, good.long(), 2, md, 0)
    with pytest.raises(TypeError):
        g.gather_fp8_prefill(0, "kv", ws, None, good, 2, md, 0)


def test_prefill_staging_needs_rows_written():
    g = make_group()
    fill(g, 2, 10)
    md = build([(2, 3, 13)], 0)
    g.prepare_for_batch(md)
    ws = torch.zeros(13, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="write_new_rows"):
        g.gather_fp8_prefill(0, None, ws, None, torch.tensor([0], dtype=torch.int32), 1, md, 0)


@pytest.mark.parametrize("shape", ["blocks", "flat"])
def test_stage_prefill_rows_stored_format(shape):
    g = make_group()
    md = _mixed_batch(g)
    bs = 4 if shape == "blocks" else 1
    kv = torch.zeros(8, 4, 656, dtype=torch.uint8) if shape == "blocks" else torch.zeros(32, 656, dtype=torch.uint8)
    staged, bt, req_ids = g.stage_prefill_rows(1, kv, md)
    assert staged.data_ptr() == kv.data_ptr() and tuple(staged.shape) == (32, 656)
    assert bt.dtype == torch.int32 and bt.shape[0] == 2
    assert req_ids.dtype == torch.int32 and req_ids.tolist() == [0] * 3 + [1] * 6
    for p, (rid, n) in enumerate(((2, 13), (3, 11))):
        pos = torch.arange(n)
        rows = bt[p].long()[pos // bs] * bs + pos % bs
        assert torch.equal(staged[rows], row_table(1, rid)[:n])
    with pytest.raises(ValueError, match="chunk"):
        g.stage_prefill_rows(1, torch.zeros(20, 656, dtype=torch.uint8), md)
    with pytest.raises(TypeError):
        g.stage_prefill_rows(1, torch.zeros(32, 656, dtype=torch.int8), md)
