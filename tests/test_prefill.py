"""Prefill chunk planning and staging (Triton interpreter and torch path) against an
independent oracle: gather the host rows by the block-table formula and dequantise
with ``hisparse.formats.dequantize_fp8_ds_mla_reference``."""

from __future__ import annotations

import pytest
import torch

from hisparse import CapacityError
from hisparse.staging import plan_prefill_chunks
from hisparse.formats import dequantize_fp8_ds_mla_reference
from staging_helpers import convert, convert_ref, stage, stage_chunk, stage_ref  # noqa: F401

IMPLS = ["torch", "triton"]
ROW_BYTES = {"fp8_ds_mla": 656, "bf16": 1152}


def random_rows(g, n: int, fmt: str) -> torch.Tensor:
    """uint8 [n, row_bytes] rows with arbitrary (not power-of-two) scales so that the
    bf16 rounding of the dequantised values is exercised; no NaN/inf codes."""
    if fmt == "bf16":
        return (torch.randn(n, 576, generator=g) * 4).to(torch.bfloat16).view(torch.uint8).reshape(n, 1152)
    codes = torch.randint(0, 256, (n, 512), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # e4m3fn NaN codes -> 1.5
    scales = (torch.rand(n, 4, generator=g) * 5 + 0.01).to(torch.float32)
    scales[:, 3] = torch.where(torch.arange(n) % 3 == 0, torch.tensor(1e-30), scales[:, 3])  # tiny products
    rope = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    return torch.cat([codes, scales.view(torch.uint8).reshape(n, 16), rope.view(torch.uint8).reshape(n, 128)], dim=1)


def oracle(host, bt, slots, lens, starts, W, B, fmt, *, ws_dtype, hot=None, row_slot=None, SP=None,
           fill=0):
    rb = ROW_BYTES[fmt]
    shape = (W, 576) if ws_dtype == torch.bfloat16 else (W, rb)
    out = torch.full(shape, fill, dtype=ws_dtype)
    for i in range(len(slots)):
        r, n, w0 = int(slots[i]), int(lens[i]), int(starts[i])
        for p in range(n):
            h = int(bt[r, p // B]) * B + p % B
            src = host[h]
            if row_slot is not None and int(row_slot[h]) >= 0:
                src = hot[r * SP + int(row_slot[h])]
            if ws_dtype == torch.uint8:
                out[w0 + p] = src
            elif fmt == "fp8_ds_mla":
                out[w0 + p] = dequantize_fp8_ds_mla_reference(src[None])[0]
            else:
                out[w0 + p] = src.view(torch.bfloat16)
    return out


def make_cache_like(g, *, B, R, NB, fmt, SP=5, hot_frac=0.3):
    H = (R * NB + 2) * B
    host = random_rows(g, H, fmt)
    bt = torch.randperm(H // B, generator=g)[: R * NB].view(R, NB).to(torch.int32)
    hot = random_rows(g, R * SP, fmt)  # deliberately NOT equal to host: proves which source is read
    row_slot = torch.full((H,), -1, dtype=torch.int32)
    for r in range(R):
        for p in range(NB * B):
            if torch.rand((), generator=g) < hot_frac:
                row_slot[int(bt[r, p // B]) * B + p % B] = int(torch.randint(0, SP, (), generator=g))
    return host, bt, hot, row_slot, SP


# ------------------------------------------------------------------ planning
def test_plan_exactly_w_and_w_plus_one():
    chunks = plan_prefill_chunks([16], [3], 16)
    assert len(chunks) == 1 and chunks[0].total_rows == 16 and chunks[0].max_rows == 16
    assert chunks[0].workspace_starts.tolist() == [0]
    with pytest.raises(CapacityError, match=r"needs 17 workspace rows .*W=16"):
        plan_prefill_chunks([5, 17], [1, 1], 16)
    with pytest.raises(CapacityError, match=r"request 0 needs 17 workspace rows \(16 context rows \+ 1 query"):
        plan_prefill_chunks([16], [1], 16, reserve_query_rows=True)
    # W exactly filled by two requests, the third starts a new chunk
    chunks = plan_prefill_chunks([10, 6, 1], [1, 2, 3], 16)
    assert [c.requests for c in chunks] == [slice(0, 2), slice(2, 3)]
    assert [c.total_rows for c in chunks] == [16, 1]


def test_plan_many_small_requests():
    ctx = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 0, 8, 9, 7]
    ql = [1, 2, 0, 1, 3, 1, 1, 2, 1, 1, 4, 2, 1, 1, 1]
    W = 12
    chunks = plan_prefill_chunks(ctx, ql, W, token_offset=5)
    # coverage: requests and tokens in order, no gaps
    assert chunks[0].requests.start == 0 and chunks[-1].requests.stop == len(ctx)
    assert chunks[0].token_slice.start == 5 and chunks[-1].token_slice.stop == 5 + sum(ql)
    for a, b in zip(chunks, chunks[1:]):
        assert a.requests.stop == b.requests.start and a.token_slice.stop == b.token_slice.start
        # greedy: the next request would not have fitted
        assert a.total_rows + ctx[b.requests.start] > W
    for c in chunks:
        lens = ctx[c.requests]
        assert c.total_rows == sum(lens) <= W
        assert c.seq_lens.tolist() == lens and c.workspace_lens.tolist() == lens
        starts = [sum(lens[:i]) for i in range(len(lens))]
        assert c.workspace_starts.tolist() == starts  # rebased to the chunk
        assert c.max_rows == max(lens)
        qs = ql[c.requests]
        assert c.prefill_request_id.tolist() == [i for i, q in enumerate(qs) for _ in range(q)]
        assert c.token_slice.stop - c.token_slice.start == sum(qs)


def test_plan_reserve_query_rows_and_slices():
    slots = torch.tensor([4, 2, 7], dtype=torch.int32)
    bt = torch.arange(9, dtype=torch.int32).view(3, 3)
    chunks = plan_prefill_chunks([4, 3, 5], [2, 1, 3], 10, reserve_query_rows=True, req_slots=slots,
                                 block_table=bt)
    assert [c.requests for c in chunks] == [slice(0, 2), slice(2, 3)]
    c0 = chunks[0]
    assert c0.workspace_lens.tolist() == [6, 4] and c0.seq_lens.tolist() == [4, 3]
    assert c0.workspace_starts.tolist() == [0, 6] and c0.total_rows == 10
    assert c0.req_slots.tolist() == [4, 2] and torch.equal(c0.block_table, bt[:2])
    assert chunks[1].req_slots.tolist() == [7] and chunks[1].workspace_lens.tolist() == [8]


def test_plan_empty_and_zero_length():
    assert plan_prefill_chunks([], [], 4) == []
    chunks = plan_prefill_chunks([0, 0], [1, 1], 4)
    assert len(chunks) == 1 and chunks[0].total_rows == 0 and chunks[0].max_rows == 0


@pytest.mark.parametrize("args, kw, exc, msg", [
    (([1, 2], [1], 4), {}, ValueError, "context_lens has 2 entries, query_lens 1"),
    (([1, -2], [1, 1], 4), {}, ValueError, r"context_lens\[1\] must be >= 0, got -2"),
    (([1], [1], 0), {}, ValueError, "workspace_rows must be >= 1"),
    (([1], [1], 4.0), {}, TypeError, "workspace_rows must be an int"),
    (([1.5], [1], 4), {}, TypeError, r"context_lens\[0\] must be an int"),
    (([1], [1], 4), dict(token_offset=-1), ValueError, "token_offset"),
    (([1], [1], 4), dict(req_slots=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "req_slots must have 1 rows"),
    (([1], [1], 4), dict(req_slots=torch.tensor([1])), TypeError, "req_slots must be an int32 tensor"),
])
def test_plan_bad_input(args, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        plan_prefill_chunks(*args, **kw)


# ------------------------------------------------------------------ staging
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("impl", IMPLS)
def test_stage_byte_exact(fmt, ws_dtype, B, impl):
    g = torch.Generator().manual_seed(B * 7 + len(fmt) + (ws_dtype == torch.uint8))
    R, NB = 3, max(1, 24 // B)
    host, bt, hot, row_slot, SP = make_cache_like(g, B=B, R=R, NB=NB, fmt=fmt)
    cap = NB * B
    slots = torch.tensor([2, 0, 1, 0], dtype=torch.int32)
    lens = torch.tensor([cap, 0, 1, cap - 3], dtype=torch.int32)  # full, empty, one row, odd
    starts = torch.tensor([0, cap, cap, cap + 1 + 2], dtype=torch.int32)  # a gap of 2 rows
    W = cap + 3 + cap - 3 + 1
    for hot_args in (dict(), dict(hot_rows=hot, row_slot=row_slot, slots_per_req=SP)):
        shape = (W, 576) if ws_dtype == torch.bfloat16 else (W, ROW_BYTES[fmt])
        ws = torch.full(shape, 7, dtype=ws_dtype)
        ev = stage(host_pool=host, block_table=bt, req_slots=slots, seq_lens=lens,
                           workspace_starts=starts, workspace=ws, block_size=B, row_format=fmt,
                           impl=impl, **hot_args)
        assert ev is None  # CPU
        want = oracle(host, bt, slots, lens, starts, W, B, fmt, ws_dtype=ws_dtype, fill=7,
                      hot=hot_args.get("hot_rows"), row_slot=hot_args.get("row_slot"), SP=SP)
        assert torch.equal(ws.view(torch.uint8), want.view(torch.uint8)), hot_args.keys()


def test_hot_rows_are_preferred():
    """A hot host row is read from its hot slot (the oracle above relies on this too)."""
    g = torch.Generator().manual_seed(1)
    host = random_rows(g, 8, "fp8_ds_mla")
    hot = random_rows(g, 4, "fp8_ds_mla")
    bt = torch.tensor([[1, 0]], dtype=torch.int32)  # B = 4: positions 0..3 -> rows 4..7
    row_slot = torch.full((8,), -1, dtype=torch.int32)
    row_slot[5] = 2  # position 1 is hot in slot 2
    for impl in IMPLS:
        ws = torch.zeros(3, 656, dtype=torch.uint8)
        stage(host_pool=host, block_table=bt, req_slots=torch.tensor([0], dtype=torch.int32),
                      seq_lens=torch.tensor([3], dtype=torch.int32),
                      workspace_starts=torch.tensor([0], dtype=torch.int32), workspace=ws, block_size=4,
                      row_format="fp8_ds_mla", hot_rows=hot, row_slot=row_slot, slots_per_req=4, impl=impl)
        assert torch.equal(ws[0], host[4]) and torch.equal(ws[1], hot[2]) and torch.equal(ws[2], host[6])


def test_rounding_to_bf16_is_nearest_even():
    """Scale 1 + 2^-8 makes the product of code 1.0 land exactly half-way between two
    bf16 values: round-to-nearest-even must give 1.0 (truncation would also give 1.0),
    1 + 3*2^-8 must round up to 1 + 2^-6 (truncation gives 1 + 2^-7)."""
    row = torch.zeros(1, 656, dtype=torch.uint8)
    row[0, :512] = 0x38  # e4m3 1.0
    scales = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1.0, -2.0], dtype=torch.float32)
    row[0, 512:528] = scales.view(torch.uint8)
    want = dequantize_fp8_ds_mla_reference(row)[0]
    assert float(want[128]) == 1 + 2**-6 and float(want[0]) == 1.0
    for impl in IMPLS:
        ws = torch.zeros(1, 576, dtype=torch.bfloat16)
        stage(host_pool=row, block_table=torch.zeros(1, 1, dtype=torch.int32),
                      req_slots=torch.zeros(1, dtype=torch.int32), seq_lens=torch.ones(1, dtype=torch.int32),
                      workspace_starts=torch.zeros(1, dtype=torch.int32), workspace=ws, block_size=1,
                      row_format="fp8_ds_mla", impl=impl)
        assert torch.equal(ws[0].view(torch.int16), want.view(torch.int16)), impl


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_dequant_kernel_byte_exact_with_hot_rows_and_special_codes(rows_per_program):
    """The fp8 -> bf16 staging body (whole rows as words, codes taken apart with shifts)
    gives the reference bytes, from host and hot rows, for -0.0, the largest e4m3 values,
    subnormal codes, negative and tiny scales (NaN codes are outside the format: quantize
    never writes them)."""
    g = torch.Generator().manual_seed(23)
    host, bt, hot, row_slot, SP = make_cache_like(g, B=4, R=3, NB=3, fmt="fp8_ds_mla", hot_frac=0.4)
    special = torch.tensor([0x80, 0x00, 0x7E, 0xFE, 0x01, 0x81, 0x07, 0x87], dtype=torch.uint8)
    host[:, :8] = special  # -0, 0, 448, -448, smallest and largest subnormals
    hot[:, 200:208] = special
    host[1::2, 512:516] = torch.tensor([-0.75], dtype=torch.float32).view(torch.uint8)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    lens = torch.tensor([12, 5, 9], dtype=torch.int32)
    starts = torch.tensor([0, 12, 17], dtype=torch.int32)
    ws = torch.zeros(26, 576, dtype=torch.bfloat16)
    stage(host_pool=host, block_table=bt, req_slots=slots, seq_lens=lens, workspace_starts=starts,
                  workspace=ws, block_size=4, row_format="fp8_ds_mla", impl="triton", max_rows=12,
                  rows_per_program=rows_per_program, validate=False, hot_rows=hot, row_slot=row_slot,
                  slots_per_req=SP)
    want = oracle(host, bt, slots, lens, starts, 26, 4, "fp8_ds_mla", ws_dtype=torch.bfloat16, hot=hot,
                  row_slot=row_slot, SP=SP)
    assert torch.equal(ws.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("rows_per_program", [1, 2, 16])
def test_rows_per_program_variants(rows_per_program):
    g = torch.Generator().manual_seed(5)
    host, bt, hot, row_slot, SP = make_cache_like(g, B=4, R=2, NB=3, fmt="fp8_ds_mla")
    slots = torch.tensor([1, 0], dtype=torch.int32)
    lens = torch.tensor([11, 5], dtype=torch.int32)
    starts = torch.tensor([5, 0], dtype=torch.int32)
    ws = torch.zeros(16, 576, dtype=torch.bfloat16)
    stage(host_pool=host, block_table=bt, req_slots=slots, seq_lens=lens, workspace_starts=starts,
                  workspace=ws, block_size=4, row_format="fp8_ds_mla", impl="triton", max_rows=11,
                  rows_per_program=rows_per_program, validate=False)
    want = oracle(host, bt, slots, lens, starts, 16, 4, "fp8_ds_mla", ws_dtype=torch.bfloat16)
    assert torch.equal(ws.view(torch.int16), want.view(torch.int16))


def test_unchecked_skips_unlocatable_rows():
    """validate=False: rows that cannot be located are skipped, the rest staged, no OOB."""
    g = torch.Generator().manual_seed(9)
    host = random_rows(g, 8, "bf16")
    bt = torch.tensor([[1, -1], [0, 5]], dtype=torch.int32)  # B = 4; block 5 is past H = 8
    slots = torch.tensor([0, 1, 9], dtype=torch.int32)  # slot 9 out of range
    lens = torch.tensor([6, 8, 3], dtype=torch.int32)
    starts = torch.tensor([0, 6, 14], dtype=torch.int32)
    ws = torch.full((16, 576), 3.0, dtype=torch.bfloat16)  # request 1 ends beyond W: rows 14, 15 kept
    stage(host_pool=host, block_table=bt, req_slots=slots, seq_lens=lens, workspace_starts=starts,
                  workspace=ws, block_size=4, row_format="bf16", impl="triton", validate=False, max_rows=8)
    hb = host.view(torch.bfloat16)
    assert torch.equal(ws[0:4], hb[4:8])  # request 0 block 0
    assert bool((ws[4:6] == 3).all())  # request 0 block 1 unallocated: skipped
    assert torch.equal(ws[6:10], hb[0:4])  # request 1 block 0
    assert bool((ws[10:16] == 3).all())  # block 5 past the pool; request 2 slot invalid


def _stage_kwargs():
    g = torch.Generator().manual_seed(2)
    host = random_rows(g, 16, "fp8_ds_mla")
    return dict(host_pool=host, block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                req_slots=torch.tensor([1, 0], dtype=torch.int32), seq_lens=torch.tensor([5, 3], dtype=torch.int32),
                workspace_starts=torch.tensor([0, 5], dtype=torch.int32),
                workspace=torch.full((8, 576), 9.0, dtype=torch.bfloat16), block_size=4, row_format="fp8_ds_mla")


@pytest.mark.parametrize("change, exc, msg", [
    (dict(host_pool=lambda k: k["host_pool"][:, :512]), ValueError, r"host_rows must have shape \[\*, 656\]"),
    (dict(host_pool=lambda k: k["host_pool"].float()), TypeError, "host_rows must have dtype uint8"),
    (dict(row_format=lambda k: "fp4"), ValueError, "unknown row format"),
    (dict(block_table=lambda k: k["block_table"].long()), TypeError, "block_table must have dtype int32"),
    (dict(seq_lens=lambda k: k["seq_lens"][:1]), ValueError, r"seq_lens must have shape \[2\]"),
    (dict(workspace=lambda k: torch.zeros(8, 512, dtype=torch.bfloat16)), ValueError, "bf16 workspace must be"),
    (dict(workspace=lambda k: torch.zeros(8, 576, dtype=torch.float32)), TypeError, "workspace must be bfloat16"),
    (dict(workspace=lambda k: torch.zeros(8, 1152, dtype=torch.uint8)), ValueError, "stored-format workspace"),
    (dict(block_size=lambda k: 0), ValueError, "block_size must be >= 1"),
    (dict(impl=lambda k: "numba"), ValueError, "kernels must be one of"),
    (dict(rows_per_program=lambda k: 3), ValueError, "power of two"),
    (dict(hot_rows=lambda k: torch.zeros(4, 656, dtype=torch.uint8)), ValueError, "go together"),
    (dict(req_slots=lambda k: torch.tensor([2, 0], dtype=torch.int32)), ValueError, r"req_slots\[0\] = 2"),
    (dict(seq_lens=lambda k: torch.tensor([9, 3], dtype=torch.int32)), ValueError, "exceeds the block table"),
    (dict(seq_lens=lambda k: torch.tensor([-1, 3], dtype=torch.int32)), ValueError, "must be >= 0"),
    (dict(workspace_starts=lambda k: torch.tensor([0, 6], dtype=torch.int32)), ValueError,
     r"workspace rows \[6, 9\) are outside"),
    (dict(workspace_starts=lambda k: torch.tensor([0, 4], dtype=torch.int32)), ValueError, "overlap"),
    (dict(block_table=lambda k: torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)), ValueError,
     "no block for logical block 1"),
    (dict(block_table=lambda k: torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)), ValueError,
     "points past the host pool"),
    (dict(max_rows=lambda k: 4), ValueError, "max_rows=4 is smaller"),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_stage_bad_input_raises_before_launch(change, exc, msg, impl):
    kw = _stage_kwargs()
    kw["impl"] = impl
    for key, f in change.items():
        kw[key] = f(kw)
    ws = kw["workspace"]
    before = ws.clone()
    with pytest.raises(exc, match=msg):
        stage(**kw)
    assert torch.equal(ws.view(torch.uint8), before.view(torch.uint8))


def test_bad_input_base_is_valid():
    kw = _stage_kwargs()
    stage(**kw)
    want = oracle(kw["host_pool"], kw["block_table"], kw["req_slots"], kw["seq_lens"], kw["workspace_starts"],
                  8, 4, "fp8_ds_mla", ws_dtype=torch.bfloat16)
    assert torch.equal(kw["workspace"].view(torch.int16), want.view(torch.int16))


def test_bad_row_slot_values_and_stream_on_cpu():
    kw = _stage_kwargs()
    with pytest.raises(ValueError, match="row_slot holds values outside"):
        stage(**kw, hot_rows=torch.zeros(8, 656, dtype=torch.uint8),
                      row_slot=torch.full((16,), 4, dtype=torch.int32), slots_per_req=4)
    with pytest.raises(ValueError, match="stream is only meaningful"):
        stage(**kw, stream=object())


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("impl", IMPLS)
def test_chunks_stage_and_convert_end_to_end(impl):
    """plan -> stage each chunk -> convert top-k to workspace rows -> the rows the
    workspace serves are the dequantised host rows of the selected positions."""
    g = torch.Generator().manual_seed(11)
    B, R, NB = 4, 5, 6
    host, bt, hot, row_slot, SP = make_cache_like(g, B=B, R=R, NB=NB, fmt="fp8_ds_mla", hot_frac=0.0)
    ctx = [9, 24, 3, 0, 17]
    ql = [2, 1, 3, 1, 2]
    slots = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    T_dec, K, W = 3, 6, 26
    chunks = plan_prefill_chunks(ctx, ql, W, token_offset=T_dec, req_slots=slots)
    assert len(chunks) >= 2
    T = T_dec + sum(ql)
    topk = torch.full((T, K), -1, dtype=torch.int32)
    for i, n in enumerate(ctx):
        t0 = T_dec + sum(ql[:i])
        for t in range(t0, t0 + ql[i]):
            if n:
                topk[t, : min(K, n)] = torch.randperm(n, generator=g)[:K].to(torch.int32)
    deq = dequantize_fp8_ds_mla_reference(host)
    seen = 0
    for c in chunks:
        ws = torch.zeros(W, 576, dtype=torch.bfloat16)
        stage_chunk(c, workspace=ws, host_pool=host, block_table=bt, block_size=B,
                            row_format="fp8_ds_mla", impl=impl)
        sub = topk[c.token_slice]
        res = convert(
            sub, torch.zeros(sub.shape[0], dtype=torch.int32), bt, block_size=B,
            prefill_request_id=c.prefill_request_id, workspace_starts=c.workspace_starts,
            workspace_lens=c.seq_lens, return_valid_counts=True, impl=impl)
        for j in range(sub.shape[0]):
            i = c.requests.start + int(c.prefill_request_id[j])
            r = int(slots[i])
            for k in range(K):
                p = int(sub[j, k])
                if p < 0:
                    assert int(res.physical[j, k]) == -1
                    continue
                h = int(bt[r, p // B]) * B + p % B
                assert torch.equal(ws[int(res.physical[j, k])].view(torch.int16), deq[h].view(torch.int16))
                seen += 1
    assert seen == sum(min(K, n) * q for n, q in zip(ctx, ql))


def test_reference_is_exported_and_equal():
    kw = _stage_kwargs()
    ws = kw.pop("workspace")
    stage_ref(workspace=ws, **kw)
    want = oracle(kw["host_pool"], kw["block_table"], kw["req_slots"], kw["seq_lens"], kw["workspace_starts"],
                  8, 4, "fp8_ds_mla", ws_dtype=torch.bfloat16)
    assert torch.equal(ws.view(torch.int16), want.view(torch.int16))


def test_negative_zero_and_negative_scales_exact():
    """Scales of -0.0 and negative values are bit-exact too (the kernel selects each
    tile's scale from the row's four by integer arithmetic)."""
    row = torch.zeros(2, 656, dtype=torch.uint8)
    row[:, :512] = torch.arange(512, dtype=torch.int64).remainder(120).to(torch.uint8)
    row[0, 512:528] = torch.tensor([-0.0, -3.0, 0.0, 2.5], dtype=torch.float32).view(torch.uint8)
    row[1, 512:528] = torch.tensor([1e-38, -1e30, 7.0, -0.0], dtype=torch.float32).view(torch.uint8)
    want = dequantize_fp8_ds_mla_reference(row)
    for impl in IMPLS:
        ws = torch.zeros(2, 576, dtype=torch.bfloat16)
        stage(host_pool=row, block_table=torch.zeros(1, 1, dtype=torch.int32),
                      req_slots=torch.zeros(1, dtype=torch.int32), seq_lens=torch.tensor([2], dtype=torch.int32),
                      workspace_starts=torch.zeros(1, dtype=torch.int32), workspace=ws, block_size=2,
                      row_format="fp8_ds_mla", impl=impl)
        assert torch.equal(ws.view(torch.int16), want.view(torch.int16)), impl
