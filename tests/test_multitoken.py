"""Multi-token decode (q query tokens per request: speculative / MTP) and mixed batches.

* q in {1, 2, 4}: all q rows' top-k of a request are resolved as ONE union in one step
  (one LRU step, unique misses staged once, the same position gets the same physical
  row in every query row), first directly through ``resolve_reference``, then through
  ``HiSparseCache``.
* A buffer of exactly q x top_k slots holds a step whose q x top_k positions are all
  distinct; a smaller one is a config error.
* Mixed batch: decode requests first (resolved into hot rows), then prefill requests
  (staged into a workspace from the same cache, converted to workspace rows); after
  the prefill the new rows are appended through the cache's write path.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import CapacityError, HiSparseCache, HiSparseConfig
from hisparse.staging import plan_prefill_chunks
from hisparse.cache.resolve_ref import resolve_reference
from hisparse.cache.state import STAT_HITS, STAT_MISSES, STAT_RESOLVES, ResolveBuffers
from hisparse.formats import dequantize_fp8_ds_mla_reference, quantize_fp8_ds_mla_reference
from staging_helpers import convert, convert_ref, stage, stage_chunk, stage_ref  # noqa: F401

K = 4  # top-k


def row_bytes_for(layer: int, req: int, positions) -> torch.Tensor:
    """Deterministic valid fp8_ds_mla rows of (layer, request, positions): uint8 [n, 656]."""
    pos = torch.as_tensor(list(positions), dtype=torch.float32)
    x = torch.sin(pos[:, None] * 0.37 + torch.arange(576) * 0.011 + layer * 1.3 + req * 0.7) * (1 + pos[:, None])
    return quantize_fp8_ds_mla_reference(x)


def make_cache(q: int, *, kernels: str = "torch", L: int = 2) -> HiSparseCache:
    cfg = HiSparseConfig(num_layers=L, host_pool_tokens=512, row_bytes=656, top_k=K,
                         device_buffer_size=q * K, max_num_reqs=6, max_query_len=q,
                         host_block_size=4, max_request_id=64, device="cpu")
    return HiSparseCache(cfg, kernels=kernels, pin=False)


def fill(cache: HiSparseCache, req: int, n: int) -> None:
    cache.add_request(req)
    for layer in range(cache.cfg.num_layers):
        cache.write(layer, req, row_bytes_for(layer, req, range(n)))
@pytest.mark.parametrize("q", [1, 2, 4])
def test_config_requires_q_times_topk(q):
    HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=K, max_query_len=q, device_buffer_size=q * K,
                   device="cpu")
    with pytest.raises(CapacityError, match=rf"max_query_len x top_k = {q} x {K} = {q * K}"):
        HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=K, max_query_len=q,
                       device_buffer_size=q * K - 1, device="cpu")


@pytest.mark.parametrize("q", [1, 2, 4])
def test_union_resolved_in_one_step_reference(q):
    """Direct ``resolve_reference``: one step per request, misses = |union|."""
    cache = make_cache(q)
    fill(cache, 7, 40)  # longer than S = q*K: positions >= S live on host only
    fill(cache, 9, 40)
    st = cache.state
    # each query row of a request: K positions, overlapping with the previous row by 2
    rows = []
    base = {7: 20, 9: 5}
    for req in (7, 9):
        for j in range(q):
            rows.append([base[req] + 2 * j + k for k in range(K)])
    topk = torch.tensor(rows, dtype=torch.int32)
    ids = torch.tensor([7] * q + [9] * q, dtype=torch.int32)
    out = ResolveBuffers.allocate(2 * q, K, torch.device("cpu"))
    layer = 1
    before = st.stats[layer].clone()
    steps_before = st.step[layer].clone()
    hot_before = {r: set() for r in (0, 1)}
    for r in (0, 1):
        for s in range(cache.cfg.slots_per_req):
            p = int(st.slot_pos[layer, r, s])
            if p >= 0:
                hot_before[r].add(p)
    resolve_reference(st, layer, ids, topk, out, max_query_len=q)
    # one LRU step per request, not per query token
    assert (st.step[layer] - steps_before).tolist()[:2] == [1, 1]
    assert int(st.stats[layer, STAT_RESOLVES] - before[STAT_RESOLVES]) == 2
    unions = {r: set(sum(rows[r * q:(r + 1) * q], [])) for r in (0, 1)}
    want_miss = sum(len(unions[r] - hot_before[r]) for r in (0, 1))
    want_hit = sum(len(unions[r] & hot_before[r]) for r in (0, 1))
    assert int(st.stats[layer, STAT_MISSES] - before[STAT_MISSES]) == want_miss
    assert int(st.stats[layer, STAT_HITS] - before[STAT_HITS]) == want_hit
    # every staged miss once: the staging list of a request holds each missed row once
    for r in (0, 1):
        src = out.stage_src[r * q * K:(r + 1) * q * K]
        src = src[src >= 0].tolist()
        assert len(src) == len(set(src)) == len(unions[r] - hot_before[r])
    # same position -> same physical row, in every query row of the request
    phys = out.physical[:2 * q]
    for r in (0, 1):
        seen = {}
        for t in range(r * q, (r + 1) * q):
            for k in range(K):
                p = rows[t][k]
                v = int(phys[t, k])
                assert seen.setdefault(p, v) == v
                assert r * cache.cfg.slots_per_req <= v < (r + 1) * cache.cfg.slots_per_req
        assert len(set(seen.values())) == len(seen)  # distinct positions -> distinct slots


def check_hot_bytes(cache: HiSparseCache, layer: int, ids: list[int], topk: torch.Tensor, phys: torch.Tensor):
    hot = cache.hot_rows(layer)
    for t, req in enumerate(ids):
        for k in range(topk.shape[1]):
            p = int(topk[t, k])
            if p < 0:
                assert int(phys[t, k]) == -1
                continue
            assert torch.equal(hot[int(phys[t, k])], cache.read_host_rows(layer, req, [p])[0])


@pytest.mark.parametrize("q", [1, 2, 4])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cache_multitoken_all_distinct_fits_exactly(q, kernels):
    """S = q x top_k, every step references q x top_k distinct positions beyond the
    fits phase: all of them are resident after the step (nothing referenced this step
    is evicted) and bytes match the host rows; then a repeated step is all hits."""
    cache = make_cache(q, kernels=kernels, L=1)
    n = 3 * q * K + 5
    fill(cache, 3, n)
    fill(cache, 11, n)
    g = torch.Generator().manual_seed(q)
    for step in range(3):
        ids, rows = [], []
        for req in (3, 11):
            perm = torch.randperm(n, generator=g)[: q * K].view(q, K)
            rows.append(perm)
            ids += [req] * q
        topk = torch.cat(rows).to(torch.int32)
        before = cache.stats()["layers"][0]
        res = cache.resolve(0, torch.tensor(ids, dtype=torch.int32), topk)
        check_hot_bytes(cache, 0, ids, topk, res.physical)
        assert res.valid_counts.tolist() == [K] * (2 * q)
        for r in range(2):
            assert len(set(res.physical[r * q:(r + 1) * q].flatten().tolist())) == q * K
        after = cache.stats()["layers"][0]
        assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == 2 * q * K
        # the same step again: every position is resident now
        res = cache.resolve(0, torch.tensor(ids, dtype=torch.int32), topk)
        again = cache.stats()["layers"][0]
        assert again["misses"] == after["misses"] and again["hits"] == after["hits"] + 2 * q * K
        check_hot_bytes(cache, 0, ids, topk, res.physical)


@pytest.mark.parametrize("q", [2, 4])
def test_cache_duplicates_across_query_rows_staged_once(q):
    cache = make_cache(q, L=1)
    fill(cache, 5, 50)
    topk = torch.tensor([[40, 41, 42, -1]] * q, dtype=torch.int32)  # every row: the same 3 misses
    before = cache.stats()["layers"][0]
    res = cache.resolve(0, torch.full((q,), 5, dtype=torch.int32), topk, compact=True)
    after = cache.stats()["layers"][0]
    assert after["misses"] - before["misses"] == 3 and after["hits"] == before["hits"]
    assert res.valid_counts.tolist() == [3] * q
    assert all(row == res.physical[0].tolist() for row in res.physical.tolist())
    check_hot_bytes(cache, 0, [5] * q, topk, res.physical)


@pytest.mark.parametrize("q", [1, 2, 4])
def test_mixed_batch_decode_then_prefill(q):
    """Decode requests first (q tokens each, resolved into hot rows), then prefill
    requests (staged from the same cache into a bf16 workspace, converted in one call
    together with the decode tokens' global host rows); then the prefill's new rows
    are appended through the cache's write path and restaging includes them."""
    cache = make_cache(q, L=2)
    dec_reqs, pre_reqs = [1, 2], [20, 21, 22]
    for req in dec_reqs:
        fill(cache, req, 30)
    ctx = {20: 13, 21: 0, 22: 21}
    for req in pre_reqs:
        fill(cache, req, ctx[req])
    ql = {20: 3, 21: 2, 22: 1}
    layer = 1
    g = torch.Generator().manual_seed(10 + q)
    # decode part: q tokens per decode request, resolved through the cache
    dec_topk = torch.stack([torch.randperm(30, generator=g)[:K] for _ in range(q * len(dec_reqs))]).to(torch.int32)
    dec_ids = [req for req in dec_reqs for _ in range(q)]
    res = cache.resolve(layer, torch.tensor(dec_ids, dtype=torch.int32), dec_topk)
    check_hot_bytes(cache, layer, dec_ids, dec_topk, res.physical)
    T_dec = len(dec_ids)
    # prefill part: stage every prefill request's context from host/hot rows
    slots = torch.tensor([cache.request(r).slot for r in pre_reqs], dtype=torch.int32)
    W = 40
    chunks = plan_prefill_chunks([ctx[r] for r in pre_reqs], [ql[r] for r in pre_reqs], W,
                                 reserve_query_rows=True, token_offset=T_dec, req_slots=slots)
    assert len(chunks) == 1
    chunk = chunks[0]
    ws = torch.zeros(W, 576, dtype=torch.bfloat16)
    st = cache.state
    for impl in ("torch", "triton"):
        ws.zero_()
        stage_chunk(chunk, workspace=ws, host_pool=cache.pool.rows[layer], block_table=st.block_table,
                            block_size=cache.pool.B, row_format="fp8_ds_mla", hot_rows=cache.hot_rows(layer),
                            row_slot=st.row_slot[layer], slots_per_req=cache.cfg.slots_per_req, impl=impl)
        for i, req in enumerate(pre_reqs):
            w0 = int(chunk.workspace_starts[i])
            if ctx[req]:
                want = dequantize_fp8_ds_mla_reference(cache.read_host_rows(layer, req, range(ctx[req])))
                assert torch.equal(ws[w0:w0 + ctx[req]].view(torch.int16), want.view(torch.int16)), impl
    # one conversion call over the whole batch: decode tokens -> host rows, prefill -> workspace
    pre_topk = []
    for req in pre_reqs:
        for _ in range(ql[req]):
            row = torch.full((K,), -1, dtype=torch.int32)
            m = min(K, ctx[req])
            row[:m] = torch.randperm(max(ctx[req], 1), generator=g)[:m].to(torch.int32)
            pre_topk.append(row)
    topk = torch.cat([dec_topk, torch.stack(pre_topk)])
    req_slot_per_token = torch.tensor([cache.request(r).slot for r in dec_ids] + [0] * len(pre_topk),
                                      dtype=torch.int32)
    pre_id = torch.cat([torch.full((T_dec,), -1, dtype=torch.int32), chunk.prefill_request_id])
    conv = convert(topk, req_slot_per_token, st.block_table, block_size=cache.pool.B,
                                    seq_lens=st.seq_lens[layer], prefill_request_id=pre_id,
                                    workspace_starts=chunk.workspace_starts, workspace_lens=chunk.seq_lens,
                                    return_valid_counts=True, impl="triton")
    pool = cache.pool.rows[layer]
    for t in range(T_dec):
        want = cache.read_host_rows(layer, dec_ids[t], dec_topk[t].tolist())
        assert torch.equal(pool[conv.physical[t].long()], want)
    for j, t in enumerate(range(T_dec, topk.shape[0])):
        req = pre_reqs[int(chunk.prefill_request_id[j])]
        for k in range(K):
            p = int(topk[t, k])
            if p < 0:
                assert int(conv.physical[t, k]) == -1
                continue
            want = dequantize_fp8_ds_mla_reference(cache.read_host_rows(layer, req, [p]))[0]
            assert torch.equal(ws[int(conv.physical[t, k])].view(torch.int16), want.view(torch.int16))
    # after the prefill: the new rows go through the write path; a restage sees them
    for req in pre_reqs:
        for lay in range(cache.cfg.num_layers):
            new = row_bytes_for(lay, req, range(ctx[req], ctx[req] + ql[req]))
            assert cache.write(lay, req, new)[0] == ctx[req]
    lens = torch.tensor([ctx[r] + ql[r] for r in pre_reqs], dtype=torch.int32)
    starts = torch.tensor([0, 16, 18], dtype=torch.int32)
    ws2 = torch.zeros(W, 576, dtype=torch.bfloat16)
    stage(host_pool=cache.pool.rows[layer], block_table=st.block_table, req_slots=slots, seq_lens=lens,
                  workspace_starts=starts, workspace=ws2, block_size=cache.pool.B, row_format="fp8_ds_mla",
                  hot_rows=cache.hot_rows(layer), row_slot=st.row_slot[layer], slots_per_req=cache.cfg.slots_per_req,
                  impl="triton")
    for i, req in enumerate(pre_reqs):
        n, w0 = int(lens[i]), int(starts[i])
        want = dequantize_fp8_ds_mla_reference(row_bytes_for(layer, req, range(n)))
        assert torch.equal(ws2[w0:w0 + n].view(torch.int16), want.view(torch.int16))
