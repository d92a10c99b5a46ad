"""GPU tests of index conversion and prefill staging at production shapes (H200).

Conversion: T = 256 decode tokens x K = 2048 and T = 4096 mixed decode + prefill
tokens, block sizes 1 / 16 / 64, stride > block size, compaction; CUDA-graph replay of
the unchecked path equals eager. Staging: a pinned host pool (hisparse.device.
PinnedBuffer, read over UVA by the kernel) of 256K rows, hot rows on the GPU, requests
of 0 / 1 / odd / 64K+ rows, both formats, bf16 and stored-format workspaces, on a
side stream with the returned event; byte-exact against the torch reference. With the
elastic tier: a cache whose resident requests are staged from their device pages and
whose demoted request from its hot buffer and the host pool, byte-exact against the
host rows.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse.staging import StageRequests, plan_prefill_chunks, stage_prefill
from hisparse.device import PinnedBuffer
from hisparse.formats import dequantize_fp8_ds_mla_reference
from staging_helpers import convert, convert_ref, stage, stage_chunk, stage_ref  # noqa: F401

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
ROW_BYTES = {"fp8_ds_mla": 656, "bf16": 1152}


def _random_rows_gpu(g, n: int, fmt: str) -> torch.Tensor:
    """uint8 [n, row_bytes] on the GPU; fp8 rows with arbitrary scales, no NaN codes."""
    if fmt == "bf16":
        return (torch.randn(n, 576, generator=g, device=DEV) * 4).to(torch.bfloat16).view(torch.uint8)
    codes = torch.randint(0, 256, (n, 512), generator=g, device=DEV, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    scales = torch.rand(n, 4, generator=g, device=DEV) * 5 + 0.01
    rope = torch.randn(n, 64, generator=g, device=DEV).to(torch.bfloat16)
    return torch.cat([codes, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)


# ------------------------------------------------------------------ conversion
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("stride_extra", [0, 7])
@pytest.mark.parametrize("compact", [False, True])
def test_convert_decode_production(B, stride_extra, compact):
    g = torch.Generator(device=DEV).manual_seed(B + stride_extra)
    T, K, R = 256, 2048, 64
    NB = (131072 + B - 1) // B
    bt = torch.randint(0, 1 << 20, (R, NB), generator=g, device=DEV, dtype=torch.int32)
    bt[:, -3:] = -1
    topk = torch.randint(0, NB * B, (T, K), generator=g, device=DEV, dtype=torch.int32)
    topk[torch.rand(T, K, generator=g, device=DEV) < 0.25] = -1
    req = torch.randint(0, R, (T,), generator=g, device=DEV, dtype=torch.int32)
    want = convert_ref(topk, req, bt, block_size=B, block_stride=B + stride_extra, compact=compact)
    got = convert(topk, req, bt, block_size=B, block_stride=B + stride_extra, compact=compact,
                                   return_valid_counts=True, validate=False, impl="triton")
    torch.cuda.synchronize()
    assert torch.equal(got.physical, want.physical)
    assert torch.equal(got.valid_counts, want.valid_counts)


@pytest.mark.parametrize("compact", [False, True])
def test_convert_mixed_workspace_production(compact):
    g = torch.Generator(device=DEV).manual_seed(3)
    T_dec, T_pre, K, R, B = 128, 4096, 2048, 32, 64
    NB = 2048
    bt = torch.randperm(R * NB, generator=g, device=DEV).view(R, NB).to(torch.int32)
    topk = torch.randint(0, NB * B, (T_dec + T_pre, K), generator=g, device=DEV, dtype=torch.int32)
    topk[torch.rand(T_dec + T_pre, K, generator=g, device=DEV) < 0.1] = -1
    req = torch.randint(0, R, (T_dec + T_pre,), generator=g, device=DEV, dtype=torch.int32)
    P = 8
    lens = torch.full((P,), 16384, dtype=torch.int32, device=DEV)
    starts = torch.arange(P, dtype=torch.int32, device=DEV) * 16384
    pre = torch.cat([torch.full((T_dec,), -1, dtype=torch.int32, device=DEV),
                     torch.arange(T_pre, device=DEV, dtype=torch.int32) * P // T_pre])
    topk[T_dec:] = torch.where(topk[T_dec:] >= 0, topk[T_dec:] % 20000, topk[T_dec:])  # some >= 16384: invalid
    kw = dict(block_size=B, prefill_request_id=pre, workspace_starts=starts, workspace_lens=lens, compact=compact)
    want = convert_ref(topk, req, bt, **kw)
    got = convert(topk, req, bt, return_valid_counts=True, validate=False, impl="triton", **kw)
    torch.cuda.synchronize()
    assert torch.equal(got.physical, want.physical)
    assert torch.equal(got.valid_counts, want.valid_counts)


def test_convert_cuda_graph_replay_equals_eager():
    g = torch.Generator(device=DEV).manual_seed(5)
    T, K, R, NB, B = 64, 2048, 16, 256, 64
    bt = torch.randperm(R * NB, generator=g, device=DEV).view(R, NB).to(torch.int32)
    topk = torch.randint(-1, NB * B, (T, K), generator=g, device=DEV, dtype=torch.int32)
    req = torch.randint(0, R, (T,), generator=g, device=DEV, dtype=torch.int32)
    out = torch.empty((T, K), dtype=torch.int32, device=DEV)
    cnt = torch.empty((T,), dtype=torch.int32, device=DEV)
    kw = dict(block_size=B, compact=True, out=out, valid_counts_out=cnt, validate=False, impl="triton")
    convert(topk, req, bt, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        convert(topk, req, bt, **kw)
    for step in range(3):
        topk.copy_(torch.randint(-1, NB * B, (T, K), generator=g, device=DEV, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = convert_ref(topk, req, bt, block_size=B, compact=True)
        assert torch.equal(out, want.physical) and torch.equal(cnt, want.valid_counts), step


# ------------------------------------------------------------------ staging
def _pool(fmt: str, H: int, g) -> tuple[PinnedBuffer, torch.Tensor]:
    rb = ROW_BYTES[fmt]
    buf = PinnedBuffer(H * rb)
    pool = buf.tensor.view(H, rb)
    chunk = 1 << 16
    for a in range(0, H, chunk):
        b = min(H, a + chunk)
        pool[a:b].copy_(_random_rows_gpu(g, b - a, fmt).cpu())
    assert pool.is_pinned()
    return buf, pool


def _oracle(kw, fmt, ws_dtype, W):
    """Reference staging on the GPU; fp8 rows dequantised by the formats reference."""
    shape = (W, 576) if ws_dtype == torch.bfloat16 else (W, ROW_BYTES[fmt])
    ref = torch.full(shape, 3, dtype=ws_dtype, device=DEV)
    stage(workspace=ref, impl="torch", **kw)
    return ref


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("with_hot", [False, True])
def test_stage_production_byte_exact(fmt, ws_dtype, with_hot):
    g = torch.Generator(device=DEV).manual_seed(len(fmt) + with_hot)
    B, R, SP = 64, 8, 4097
    H = 1 << 18
    NB = H // B // R
    buf, pool = _pool(fmt, H, g)
    bt = torch.randperm(H // B, generator=g, device=DEV)[: R * NB].view(R, NB).to(torch.int32)
    slots = torch.tensor([3, 0, 5, 1, 7, 2], dtype=torch.int32, device=DEV)
    lens_l = [0, 1, 4097, 32768, 20001, 7]
    lens = torch.tensor(lens_l, dtype=torch.int32, device=DEV)
    starts_l, acc = [], 0
    for n in lens_l:
        starts_l.append(acc)
        acc += n + 5  # gaps between requests stay untouched
    starts = torch.tensor(starts_l, dtype=torch.int32, device=DEV)
    W = acc
    kw = dict(host_pool=pool, block_table=bt, req_slots=slots, seq_lens=lens, workspace_starts=starts,
              block_size=B, row_format=fmt)
    if with_hot:
        hot = _random_rows_gpu(g, R * SP, fmt)  # differs from host: proves which source is read
        row_slot = torch.full((H,), -1, dtype=torch.int32, device=DEV)
        for r in range(R):
            pos = torch.randperm(NB * B, generator=g, device=DEV)[:SP]
            h = bt[r, pos // B].long() * B + pos % B
            row_slot[h] = torch.arange(SP, dtype=torch.int32, device=DEV)
        kw.update(hot_rows=hot, row_slot=row_slot, slots_per_req=SP)
    shape = (W, 576) if ws_dtype == torch.bfloat16 else (W, ROW_BYTES[fmt])
    ws = torch.full(shape, 3, dtype=ws_dtype, device=DEV)
    side = torch.cuda.Stream()
    ev = stage(workspace=ws, impl="triton", stream=side, validate=True, **kw)
    assert isinstance(ev, torch.cuda.Event)
    torch.cuda.current_stream().wait_event(ev)
    want = _oracle(kw, fmt, ws_dtype, W)
    torch.cuda.synchronize()
    assert torch.equal(ws.view(torch.uint8), want.view(torch.uint8))
    if fmt == "fp8_ds_mla" and ws_dtype == torch.bfloat16 and not with_hot:
        # independent spot check against the formats reference on CPU
        p = torch.arange(lens_l[3])
        h = bt[1].cpu().long()[p // B] * B + p % B
        deq = dequantize_fp8_ds_mla_reference(pool[h])
        w0 = starts_l[3]
        assert torch.equal(ws[w0:w0 + lens_l[3]].cpu().view(torch.int16), deq.view(torch.int16))
    del buf


def test_stage_chunks_and_graph_replay():
    """Chunked plan staged chunk by chunk; the unchecked call replayed from a CUDA graph."""
    g = torch.Generator(device=DEV).manual_seed(9)
    B, H = 64, 1 << 16
    buf, pool = _pool("fp8_ds_mla", H, g)
    R, NB = 4, H // B // 4
    bt = torch.randperm(H // B, generator=g, device=DEV).view(R, NB).to(torch.int32)
    slots = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)
    ctx = [9000, 7000, 16000, 1]
    W = 16384
    chunks = plan_prefill_chunks(ctx, [1, 1, 1, 1], W, req_slots=slots)
    assert [c.requests for c in chunks] == [slice(0, 2), slice(2, 4)]
    for c in chunks:
        ws = torch.zeros(W, 576, dtype=torch.bfloat16, device=DEV)
        kw = dict(host_pool=pool, block_table=bt, block_size=B, row_format="fp8_ds_mla")
        ev = stage_chunk(c, workspace=ws, impl="triton", **kw)
        ev.synchronize()
        want = torch.zeros_like(ws)
        stage_chunk(c, workspace=want, impl="torch", **kw)
        torch.cuda.synchronize()
        assert torch.equal(ws.view(torch.int16), want.view(torch.int16))
    c = chunks[0]
    ws = torch.zeros(W, 576, dtype=torch.bfloat16, device=DEV)
    kw = dict(host_pool=pool, block_table=bt, req_slots=c.req_slots, seq_lens=c.seq_lens,
              workspace_starts=c.workspace_starts, block_size=B, row_format="fp8_ds_mla", max_rows=c.max_rows,
              validate=False, impl="triton")
    stage(workspace=ws, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage(workspace=ws, **kw)
    pool[:].copy_(_random_rows_gpu(g, H, "fp8_ds_mla").cpu())  # new contents, same addresses
    ws.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros_like(ws)
    stage(workspace=want, **{**kw, "impl": "torch"})
    torch.cuda.synchronize()
    assert torch.equal(ws.view(torch.int16), want.view(torch.int16))
    del buf


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
def test_stage_elastic_resident_byte_exact(fmt):
    """A cache with the elastic tier at the default top-k (S = 4096) and a pool of 413
    pages: request 1 (20000 rows) takes 313 pages, request 2 (9000 rows) needs 141 of the
    100 left, so 1 is demoted (its newest 4097 rows seeded into its hot buffer); 3 (5000
    rows) and 4 (1 row) stay resident. Staged on a side stream, checked and unchecked,
    into both workspaces: byte-exact against the host rows and equal to the torch
    reference. Then the host rows of every request are zeroed: the resident requests
    still stage their own rows (read from their device pages)."""
    lens = {1: 20000, 2: 9000, 3: 5000, 4: 1}
    base = dict(num_layers=1, host_pool_tokens=640 * 64, row_bytes=ROW_BYTES[fmt], max_num_reqs=4,
                host_block_size=64, device="cuda", max_request_id=16)
    hot_rows = HiSparseConfig(**base).hot_rows_per_layer
    c = HiSparseCache(HiSparseConfig(**base, device_pool_rows=hot_rows + 413 * 64))
    g = torch.Generator(device=DEV).manual_seed(17 + len(fmt))
    rows = {}
    for rid, n in lens.items():
        c.add_request(rid)
        rows[rid] = _random_rows_gpu(g, n, fmt)
        c.write(0, rid, rows[rid])
    assert [c.residency(rid) for rid in lens] == ["hot", "resident", "resident", "resident"]
    assert int((c.state.row_slot[0] >= 0).sum()) == 4097
    order = [3, 1, 4, 2]
    starts, acc = {}, 0
    for rid in order:
        starts[rid] = acc
        acc += lens[rid] + 5  # gaps between requests stay untouched
    W = acc
    i32 = dict(dtype=torch.int32, device=DEV)
    reqs = StageRequests(req_slots=torch.tensor([c.request(rid).slot for rid in order], **i32),
                         seq_lens=torch.tensor([lens[rid] for rid in order], **i32),
                         starts=torch.tensor([starts[rid] for rid in order], **i32), max_rows=max(lens.values()))
    c.streams.join_backup()
    torch.cuda.synchronize()
    host = {rid: c.read_host_rows(0, rid, list(range(n))) for rid, n in lens.items()}
    for rid in lens:
        assert torch.equal(host[rid], rows[rid].cpu()), rid
    view = c.layer_view(0)
    assert view.has_pool
    side = torch.cuda.Stream()
    for ws_dtype in (torch.bfloat16, torch.uint8):
        shape = (W, 576) if ws_dtype == torch.bfloat16 else (W, ROW_BYTES[fmt])
        outs = []
        for kw in (dict(kernels="triton", validate=True, stream=side), dict(kernels="triton", validate=False),
                   dict(kernels="torch")):
            ws = torch.full(shape, 3, dtype=ws_dtype, device=DEV)
            ev = stage_prefill(view, reqs, ws, **kw)
            torch.cuda.current_stream().wait_event(ev)
            outs.append(ws)
        torch.cuda.synchronize()
        for o in outs[1:]:
            assert torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8)), ws_dtype
        got = outs[0].cpu()
        for rid, n in lens.items():
            want = host[rid]
            if ws_dtype == torch.bfloat16:
                want = dequantize_fp8_ds_mla_reference(want) if fmt == "fp8_ds_mla" else want.view(torch.bfloat16)
            w0 = starts[rid]
            assert torch.equal(got[w0:w0 + n].view(torch.uint8), want.view(torch.uint8)), (ws_dtype, rid)
            assert bool((got[w0 + n:w0 + n + 5] == 3).all())
    # the resident requests' rows come from their device pages, not from the host pool
    for rid, n in lens.items():
        c.pool.rows[0][c.pool.host_rows(c.request(rid).slot, torch.arange(n))] = 0
    ws = torch.full((W, ROW_BYTES[fmt]), 3, dtype=torch.uint8, device=DEV)
    stage_prefill(view, reqs, ws, kernels="triton", validate=False)
    torch.cuda.synchronize()
    got = ws.cpu()
    for rid in (2, 3, 4):
        assert torch.equal(got[starts[rid]:starts[rid] + lens[rid]], host[rid]), rid
    w1 = got[starts[1]:starts[1] + lens[1]]
    hot = c.state.slot_pos[0, c.request(1).slot].cpu()
    hot = hot[hot >= 0].long()
    assert hot.numel() == 4097
    cold = torch.ones(lens[1], dtype=torch.bool)
    cold[hot] = False
    assert torch.equal(w1[hot], host[1][hot])  # the demoted request's hot buffer
    assert bool((w1[cold] == 0).all())  # and its host rows


def test_stage_rejects_pageable_host_pool():
    pool = torch.zeros(64, 656, dtype=torch.uint8)  # pageable
    ws = torch.zeros(8, 576, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="not pinned"):
        stage(host_pool=pool, block_table=torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                      req_slots=torch.zeros(1, dtype=torch.int32, device=DEV),
                      seq_lens=torch.ones(1, dtype=torch.int32, device=DEV),
                      workspace_starts=torch.zeros(1, dtype=torch.int32, device=DEV), workspace=ws,
                      block_size=64, row_format="fp8_ds_mla")
    assert bool((ws == 0).all())
