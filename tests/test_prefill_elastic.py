"""Prefill staging over a cache with the elastic device tier (``device_pool_rows``):
a resident request's rows are read from its device pages, a hot request's from its
hot slots and the host pool; both byte-exact against the rows appended (dequantised
by ``hisparse.formats.dequantize_fp8_ds_mla_reference`` for a bf16 workspace), the
torch reference and the Triton kernels (interpreter) alike."""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse.formats import dequantize_fp8_ds_mla_reference
from hisparse.staging import BlockTable, LayerView, StageRequests, stage_prefill
from test_prefill import IMPLS, ROW_BYTES, make_cache_like, oracle, random_rows

I32 = torch.int32
L = 2
LENS = {1: 70, 2: 30, 3: 10}  # appended in this order: 2 overflows the pool and demotes 1


def elastic_cache(kernels: str, fmt: str = "fp8_ds_mla", seed: int = 0):
    """3 request slots, S = 16 (17 hot rows each: 64 rows of hot buffers) and 2 pages of
    64 rows. Request 1 (70 rows) takes both pages; request 2 (30 rows) needs one, so 1
    is demoted to a hot buffer seeded with its newest 17 rows; request 3 (10 rows) takes
    the page 1 freed. Returns the cache and the rows appended, {(req id, layer): rows}."""
    cfg = HiSparseConfig(num_layers=L, host_pool_tokens=256, row_bytes=ROW_BYTES[fmt], top_k=8,
                         device_buffer_size=16, max_num_reqs=3, host_block_size=16, device="cpu",
                         max_request_id=16, device_pool_rows=64 + 2 * 64)
    c = HiSparseCache(cfg, kernels=kernels)
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for rid, n in LENS.items():
        c.add_request(rid)
        for layer in range(L):
            rows[rid, layer] = random_rows(g, n, fmt)
            c.write(layer, rid, rows[rid, layer])
    assert [c.residency(rid) for rid in LENS] == ["hot", "resident", "resident"]
    r1 = c.request(1).slot
    assert int((c.state.row_slot[0] >= 0).sum()) == 17  # the demotion's seeded hot rows
    assert int(c.state.resident[r1]) == 0 and bool((c.state.page_table[r1] < 0).all())
    return c, rows


def want_rows(rows: torch.Tensor, fmt: str, ws_dtype) -> torch.Tensor:
    if ws_dtype == torch.uint8:
        return rows
    return dequantize_fp8_ds_mla_reference(rows) if fmt == "fp8_ds_mla" else rows.view(torch.bfloat16)


def requests(c: HiSparseCache, order=(3, 1, 2), gap: int = 2) -> tuple[StageRequests, dict[int, int], int]:
    """Every request of ``order`` in full, ``gap`` untouched rows after each; returns the
    requests, each id's first workspace row and W."""
    starts, acc = {}, 0
    for rid in order:
        starts[rid] = acc
        acc += LENS[rid] + gap
    reqs = StageRequests(req_slots=torch.tensor([c.request(rid).slot for rid in order], dtype=I32),
                         seq_lens=torch.tensor([LENS[rid] for rid in order], dtype=I32),
                         starts=torch.tensor([starts[rid] for rid in order], dtype=I32),
                         max_rows=max(LENS.values()))
    return reqs, starts, acc


def workspace(W: int, fmt: str, ws_dtype, fill=7) -> torch.Tensor:
    shape = (W, 576) if ws_dtype == torch.bfloat16 else (W, ROW_BYTES[fmt])
    return torch.full(shape, fill, dtype=ws_dtype)


def host_row_ids(c: HiSparseCache, rid: int, positions) -> torch.Tensor:
    return c.pool.host_rows(c.request(rid).slot, torch.as_tensor(list(positions), dtype=torch.int64))


def page_row_ids(c: HiSparseCache, rid: int, positions) -> torch.Tensor:
    r = c.request(rid).slot
    return torch.tensor([c.dpool.page_row(r, p) for p in positions], dtype=torch.int64)


# ------------------------------------------------------------------ views
def test_layer_view_carries_the_pool_only_with_one():
    c, _ = elastic_cache("torch")
    v = c.layer_view(1)
    assert v.has_pool and v.resident is c.state.resident and v.page_table is c.state.page_table
    assert v.pool_base == c.cfg.hot_rows_per_layer == 64 and v.page_rows == 64
    assert v.hot_rows.shape[0] == c.cfg.device_rows_per_layer == 192
    no_pool = HiSparseCache(HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=8, max_num_reqs=2,
                                           host_block_size=16, device="cpu", max_request_id=8), kernels="torch")
    v0 = no_pool.layer_view(0)
    assert not v0.has_pool and v0.resident is None and v0.page_table is None
    # slot_pos: the state's own memory (row_slot's other direction), pool or not
    for cache, layer in ((c, 1), (no_pool, 0)):
        sp = cache.layer_view(layer).slot_pos
        assert sp.data_ptr() == cache.state.slot_pos[layer].data_ptr() and torch.equal(sp, cache.state.slot_pos[layer])


def _view_kwargs():
    R, SP = 2, 3
    return dict(host_rows=torch.zeros(32, 656, dtype=torch.uint8),
                blocks=BlockTable(torch.zeros(R, 2, dtype=I32), 16), row_format="fp8_ds_mla",
                hot_rows=torch.zeros(6 + 2 * 4, 656, dtype=torch.uint8), row_slot=torch.full((32,), -1, dtype=I32),
                slots_per_req=SP, resident=torch.zeros(R, dtype=I32), page_table=torch.full((R, 3), -1, dtype=I32),
                pool_base=6, page_rows=4)


@pytest.mark.parametrize("change, exc, msg", [
    (dict(page_table=None), ValueError, "resident and page_table go together"),
    (dict(resident=None), ValueError, "resident and page_table go together"),
    (dict(hot_rows=None, row_slot=None), ValueError, "resident requests read their rows from pages of hot_rows"),
    (dict(resident=torch.zeros(2, dtype=torch.int64)), TypeError, "resident must have dtype int32"),
    (dict(resident=torch.zeros(3, dtype=I32)), ValueError, r"resident must have shape \[2\]"),
    (dict(page_table=torch.zeros(3, 3, dtype=I32)), ValueError, r"page_table must have shape \[2, \*\]"),
    (dict(page_table=torch.zeros(3, 2, dtype=I32).t()), ValueError, "page_table's last dimension must be packed"),
    (dict(pool_base=5), ValueError, r"pool_base=5 must lie in \[R x slots_per_req = 6, 14\]"),
    (dict(pool_base=15), ValueError, "pool_base=15 must lie in"),
    (dict(pool_base=-1), ValueError, "pool_base must be >= 0"),
    (dict(page_rows=0), ValueError, "page_rows must be >= 1"),
    (dict(pool_base=6.0), TypeError, "pool_base must be an int"),
    (dict(slot_pos=torch.full((2, 4), -1, dtype=I32)), ValueError, r"slot_pos must have shape \[2, 3\]"),
    (dict(slot_pos=torch.full((2, 3), -1, dtype=torch.int64)), TypeError, "slot_pos must have dtype int32"),
    (dict(hot_rows=None, row_slot=None, resident=None, page_table=None, slot_pos=torch.full((2, 3), -1, dtype=I32)),
     ValueError, "slot_pos describes the hot slots"),
])
def test_layer_view_checks_the_pool(change, exc, msg):
    kw = _view_kwargs()
    LayerView(**kw)  # the base is valid
    kw.update(change)
    with pytest.raises(exc, match=msg):
        LayerView(**kw)


# ------------------------------------------------------------------ staging
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("cache_kernels", IMPLS)
def test_stage_resident_and_hot_byte_exact(fmt, ws_dtype, cache_kernels):
    """Every request's rows, each from where the cache keeps it (pages, hot slots, host
    pool), equal the rows appended and the host rows; torch and Triton alike."""
    c, rows = elastic_cache(cache_kernels, fmt, seed=len(fmt) + (ws_dtype == torch.uint8))
    reqs, starts, W = requests(c)
    for layer in range(L):
        got = {}
        for impl in IMPLS:
            ws = workspace(W, fmt, ws_dtype)
            assert stage_prefill(c.layer_view(layer), reqs, ws, kernels=impl) is None
            got[impl] = ws
        assert torch.equal(got["torch"].view(torch.uint8), got["triton"].view(torch.uint8)), layer
        ws = got["triton"]
        for rid, n in LENS.items():
            host = c.read_host_rows(layer, rid, list(range(n)))
            assert torch.equal(host, rows[rid, layer])
            w0 = starts[rid]
            want = want_rows(host, fmt, ws_dtype)
            assert torch.equal(ws[w0:w0 + n].view(torch.uint8), want.view(torch.uint8)), (layer, rid)
            gap = ws[w0 + n:w0 + n + 2].view(torch.uint8)
            assert torch.equal(gap, workspace(2, fmt, ws_dtype).view(torch.uint8)), (layer, rid)


@pytest.mark.parametrize("impl", IMPLS)
def test_resident_rows_are_read_from_device_pages(impl):
    """Zero the host rows of every request: a resident request still stages its own
    bytes (read from its pages), the hot request only in its hot slots. Then overwrite
    a resident request's page rows: staging returns the new page bytes."""
    c, rows = elastic_cache("torch")
    reqs, starts, W = requests(c)
    layer = 1
    host = c.pool.rows[layer]
    hot_pos = set(c.state.slot_pos[layer, c.request(1).slot].tolist()) - {-1}
    assert len(hot_pos) == 17  # the demotion's seeded rows (the newest, with no resolve before it)
    for rid, n in LENS.items():
        host[host_row_ids(c, rid, range(n))] = 0
    ws = workspace(W, "fp8_ds_mla", torch.uint8)
    stage_prefill(c.layer_view(layer), reqs, ws, kernels=impl)
    for rid in (2, 3):  # resident: untouched by the host pool's zeros
        assert torch.equal(ws[starts[rid]:starts[rid] + LENS[rid]], rows[rid, layer]), rid
    w1 = ws[starts[1]:starts[1] + 70]
    hot = torch.tensor(sorted(hot_pos))
    cold = torch.tensor(sorted(set(range(70)) - hot_pos))
    assert torch.equal(w1[hot], rows[1, layer][hot])  # hot slots
    assert bool((w1[cold] == 0).all())  # host rows, read over "PCIe"

    g = torch.Generator().manual_seed(99)
    new = random_rows(g, LENS[2], "fp8_ds_mla")
    c.hot[layer][page_row_ids(c, 2, range(LENS[2]))] = new
    ws = workspace(W, "fp8_ds_mla", torch.bfloat16)
    stage_prefill(c.layer_view(layer), reqs, ws, kernels=impl)
    w2 = ws[starts[2]:starts[2] + LENS[2]]
    assert torch.equal(w2.view(torch.int16), dequantize_fp8_ds_mla_reference(new).view(torch.int16))


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_and_chunked_resident_staging(impl):
    """A prefix of each request (chunked prefill stages [0, seq_len) of what is written
    so far), one request per call, the requests in another order and at odd starts."""
    c, rows = elastic_cache("torch", "bf16", seed=4)
    view = c.layer_view(0)
    for rid, n in ((2, 1), (1, 54), (3, 9), (2, 29)):
        reqs = StageRequests(req_slots=torch.tensor([c.request(rid).slot], dtype=I32),
                             seq_lens=torch.tensor([n], dtype=I32), starts=torch.tensor([3], dtype=I32))
        ws = workspace(n + 5, "bf16", torch.bfloat16, fill=1.5)
        stage_prefill(view, reqs, ws, kernels=impl)
        assert torch.equal(ws[3:3 + n], rows[rid, 0][:n].view(torch.bfloat16)), (rid, n)
        assert bool((ws[:3] == 1.5).all()) and bool((ws[3 + n:] == 1.5).all())


@pytest.mark.parametrize("change, msg", [
    (lambda st, r: st.page_table[r].fill_(-1), r"no device page for logical page 0 \(page_table\[1, 0\] = -1\)"),
    (lambda st, r: st.page_table[r, 0].fill_(2), r"page_table\[1, 0\] = 2 points past the device view of 192 rows"),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_checked_mode_validates_pages_and_unchecked_skips(change, msg, impl):
    c, rows = elastic_cache("torch")
    r = c.request(2).slot
    assert r == 1
    change(c.state, r)
    reqs, starts, W = requests(c)
    ws = workspace(W, "fp8_ds_mla", torch.uint8)
    with pytest.raises(ValueError, match=msg):
        stage_prefill(c.layer_view(0), reqs, ws, kernels=impl)
    assert bool((ws == 7).all())
    # unchecked: the unlocatable rows are skipped (never read out of bounds), the rest staged
    stage_prefill(c.layer_view(0), reqs, ws, kernels=impl, validate=False)
    assert bool((ws[starts[2]:starts[2] + LENS[2]] == 7).all())
    for rid in (1, 3):
        assert torch.equal(ws[starts[rid]:starts[rid] + LENS[rid]], rows[rid, 0]), rid


@pytest.mark.parametrize("impl", IMPLS)
def test_resident_seq_len_past_the_page_table(impl):
    """A resident request staged beyond its page table's pages (MP x PB = 128 rows,
    fewer than the block table's 256): checked mode names it; unchecked stages the
    mapped pages and skips the rest (its second page is unmapped too)."""
    c, rows = elastic_cache("torch")
    r = c.request(3).slot
    reqs = StageRequests(req_slots=torch.tensor([r], dtype=I32), seq_lens=torch.tensor([130], dtype=I32),
                         starts=torch.tensor([0], dtype=I32), max_rows=130)
    ws = workspace(130, "fp8_ds_mla", torch.uint8)
    with pytest.raises(ValueError, match=r"resident slot 2\) has seq_len = 130, more than its page table's 2 pages"):
        stage_prefill(c.layer_view(0), reqs, ws, kernels=impl)
    stage_prefill(c.layer_view(0), reqs, ws, kernels=impl, validate=False)
    assert torch.equal(ws[:10], rows[3, 0])
    page = c.hot[0][page_row_ids(c, 3, range(64))]  # its whole first page, as the device holds it
    assert torch.equal(ws[:64], page) and bool((ws[64:] == 7).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_multi_page_resident_request(impl):
    """Request 1 alone: 70 rows resident in both pages (page 0, then page 1)."""
    c, rows = elastic_cache("torch")  # for its config
    c2 = HiSparseCache(c.cfg, kernels="torch")
    c2.add_request(1)
    c2.write(0, 1, rows[1, 0])
    assert c2.residency(1) == "resident" and c2.dpool.pages(c2.request(1).slot) == [0, 1]
    host = c2.pool.rows[0]
    host[host_row_ids(c2, 1, range(70))] = 0  # read from the pages, not from here
    reqs = StageRequests(req_slots=torch.tensor([c2.request(1).slot], dtype=I32),
                         seq_lens=torch.tensor([70], dtype=I32), starts=torch.tensor([1], dtype=I32))
    ws = workspace(72, "fp8_ds_mla", torch.bfloat16)
    stage_prefill(c2.layer_view(0), reqs, ws, kernels=impl, rows_per_program=16)
    want = dequantize_fp8_ds_mla_reference(rows[1, 0])
    assert torch.equal(ws[1:71].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows_per_program", [1, 4, 8])
@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("impl", IMPLS)
def test_raw_view_pages_out_of_order(rows_per_program, ws_dtype, impl):
    """A view built by hand: pages of PB = 4 rows in scrambled order, resident and hot
    requests mixed, the device rows deliberately unlike the host rows (so every row
    shows where it was read from)."""
    g = torch.Generator().manual_seed(rows_per_program)
    B, R, NB, PB = 4, 4, 4, 4
    host, bt, hot, row_slot, SP = make_cache_like(g, B=B, R=R, NB=NB, fmt="fp8_ds_mla", hot_frac=0.4)
    MP, pages = 4, 10
    base = R * SP + 3
    dev_rows = torch.cat([hot, random_rows(g, 3 + pages * PB, "fp8_ds_mla")])
    resident = torch.tensor([0, 1, 0, 1], dtype=I32)
    pt = torch.full((R, MP), -1, dtype=I32)
    pt[1] = torch.tensor([7, 2, 9, 0], dtype=I32)
    pt[3, :3] = torch.tensor([5, 1, 8], dtype=I32)
    row_slot[bt[[1, 3]].long().flatten()[:, None] * B + torch.arange(B)] = -1  # residents: none hot
    view = LayerView(host_rows=host, blocks=BlockTable(bt, B), row_format="fp8_ds_mla", hot_rows=dev_rows,
                     row_slot=row_slot, slots_per_req=SP, resident=resident, page_table=pt, pool_base=base,
                     page_rows=PB)
    slots = torch.tensor([3, 0, 1, 2], dtype=I32)
    lens = torch.tensor([11, 16, 16, 5], dtype=I32)
    starts = torch.tensor([0, 12, 28, 45], dtype=I32)
    W = 51
    ws = workspace(W, "fp8_ds_mla", ws_dtype)
    stage_prefill(view, StageRequests(slots, lens, starts, max_rows=16), ws, kernels=impl,
                  rows_per_program=rows_per_program)
    want = oracle(host, bt, slots, lens, starts, W, B, "fp8_ds_mla", ws_dtype=ws_dtype, fill=7, hot=dev_rows,
                  row_slot=row_slot, SP=SP)
    for i in range(4):  # the oracle reads host / hot rows: replace the resident requests' rows
        r, n, w0 = int(slots[i]), int(lens[i]), int(starts[i])
        if int(resident[r]):
            p = torch.arange(n)
            src = dev_rows[base + pt[r].long()[p // PB] * PB + p % PB]
            want[w0:w0 + n] = want_rows(src, "fp8_ds_mla", ws_dtype)
    assert torch.equal(ws.view(torch.uint8), want.view(torch.uint8))
