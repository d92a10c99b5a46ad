"""Contract tests of the engine façade (``hisparse.engine``) and its batch metadata, on CPU.

Tiny cache: 2 layers, top_k 4, 8 LRU slots (+1 reserved) per request, host blocks of 4.
Rows are real fp8_ds_mla rows (quantised random values) derived from (layer, req, pos),
so any physical index can be checked byte-exact against the row that belongs there.
The prefill staging tests (``gather_fp8_prefill``, ``stage_prefill_rows``) are in
test_engine_prefill.py, which shares these helpers (as the GPU tests do).
"""

from __future__ import annotations

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.formats import quantize_fp8_ds_mla_reference

L, K, S, B, R = 2, 4, 8, 4, 3
MAXLEN = 40


DEVICE = "cpu"  # test_engine_gpu.py runs these helpers with "cuda"


def make_cfg(**kw) -> HiSparseConfig:
    base = dict(num_layers=L, row_bytes=656, top_k=K, device_buffer_size=S, max_num_reqs=R,
                host_block_size=B, host_pool_tokens=R * 48, max_request_id=16, device=DEVICE)
    base.update(kw)
    return HiSparseConfig(**base)


def make_group(**kw) -> HiSparseIndexGroup:
    opts = {k: kw.pop(k) for k in ("validate",) if k in kw}
    g = HiSparseIndexGroup(make_cfg(**kw), **opts)
    for _ in range(g.config.num_layers):
        g.register_layer(kv_cache_dtype="fp8_ds_mla" if g.config.row_bytes == 656 else "bf16")
    return g


_ROWS: dict[tuple[int, int], torch.Tensor] = {}


def row_table(layer: int, rid: int) -> torch.Tensor:
    """uint8 [MAXLEN, 656]: the row of every position of (layer, request)."""
    key = (layer, rid)
    if key not in _ROWS:
        g = torch.Generator().manual_seed(1000 * layer + rid)
        _ROWS[key] = quantize_fp8_ds_mla_reference(torch.randn(MAXLEN, 576, generator=g))
    return _ROWS[key]


def batch_rows(layer: int, md: SparseMLAMetadata) -> torch.Tensor:
    parts = []
    for row, rid in enumerate(md.request_ids_cpu):
        p0 = md.context_start(row)
        parts.append(row_table(layer, rid)[p0:md.seq_lens_cpu[row]])
    out = torch.cat(parts) if parts else torch.empty(0, 656, dtype=torch.uint8)
    return out.to(md.device)


def build(reqs: list[tuple[int, int, int]], num_decodes: int) -> SparseMLAMetadata:
    """reqs: (request id, query_len, seq_len after this forward)."""
    return SparseMLAMetadata.build(request_ids=[r for r, _, _ in reqs], query_lens=[q for _, q, _ in reqs],
                                   seq_lens=[s for _, _, s in reqs], num_decodes=num_decodes,
                                   device=DEVICE)


def forward_writes(group: HiSparseIndexGroup, md: SparseMLAMetadata) -> None:
    group.prepare_for_batch(md)
    for layer in range(group.config.num_layers):
        group.write_new_rows(layer, batch_rows(layer, md), md)


def fill(group: HiSparseIndexGroup, rid: int, n: int) -> None:
    """Admit ``rid`` and write n prompt rows (a write-only prefill forward)."""
    group.add_request(rid)
    forward_writes(group, build([(rid, n, n)], 0))


def random_topk(md: SparseMLAMetadata, seed: int) -> torch.Tensor:
    """Distinct positions < seq_len per decode token (own position included), -1 padded."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((md.num_decode_tokens, K), -1, dtype=torch.int32)
    t = 0
    for row in range(md.num_decodes):
        for j in range(md.query_len(row)):
            visible = md.context_start(row) + j + 1
            k = min(K, visible)
            out[t, :k] = torch.randperm(visible, generator=g)[:k].to(torch.int32)
            if visible > 1 and k == K:
                out[t, 0] = visible - 1  # the token's own position
            t += 1
    return out.to(md.device)


def check_physical(group, md, topk, phys, counts, layer):
    """Every physical index holds the bytes of (request, layer, position); -1 <-> -1."""
    hot = group.physical_kv_cache(layer).cpu()
    topk, phys, counts = topk.cpu(), phys.cpu(), counts.cpu()
    t = 0
    for row in range(md.num_decodes):
        rid = md.request_ids_cpu[row]
        for _ in range(md.query_len(row)):
            for k in range(topk.shape[1]):
                p = int(topk[t, k])
                if p < 0:
                    assert int(phys[t, k]) == -1
                    continue
                got = hot[int(phys[t, k])]
                assert torch.equal(got, row_table(layer, rid)[p]), (t, k, p)
            assert int(counts[t]) == int((topk[t] >= 0).sum())
            t += 1


# ------------------------------------------------------------------ set-up
def test_register_and_handles():
    g = HiSparseIndexGroup(make_cfg())
    assert g.register_layer() == 0
    assert g.register_layer(kv_cache_dtype="fp8_ds_mla", head_size=576) == 1
    with pytest.raises(ValueError, match="already"):
        g.register_layer()
    c = g.cache(1)
    assert c.runtime.max_num_reqs == R
    assert c.runtime.hot.block_size == S + 1
    hot = g.physical_kv_cache(1)
    assert hot is c.runtime.hot.attention_cache
    assert hot.dtype == torch.uint8 and tuple(hot.shape) == (64, 656)  # R x (S + 1) = 27, padded to 64
    assert hot.data_ptr() == g.hisparse_cache.hot_rows(1).data_ptr()
    with pytest.raises(ValueError, match="not registered"):
        g.cache(2)
    with pytest.raises(TypeError):
        g.physical_kv_cache("0")


@pytest.mark.parametrize("kw, exc", [
    (dict(head_size=512), ValueError),
    (dict(kv_cache_dtype="bf16"), ValueError),
    (dict(kv_cache_dtype="int8"), ValueError),
])
def test_register_bad(kw, exc):
    g = HiSparseIndexGroup(make_cfg())
    with pytest.raises(exc):
        g.register_layer(**kw)
    assert g.num_layers == 0


def test_rejects_non_attention_rows():
    with pytest.raises(ValueError, match="656"):
        HiSparseIndexGroup(make_cfg(row_bytes=32))


def test_forward_needs_all_layers_registered():
    g = HiSparseIndexGroup(make_cfg())
    g.register_layer()
    g.add_request(1)
    with pytest.raises(ValueError, match="register every layer"):
        g.prepare_for_batch(build([(1, 1, 1)], 0))


# ------------------------------------------------------------------ metadata
def test_metadata_build_fields():
    md = build([(5, 1, 10), (6, 1, 3), (7, 4, 4)], 2)
    assert md.num_reqs == 3 and md.num_tokens == 6
    assert md.num_decodes == 2 and md.num_decode_tokens == 2 and md.num_prefills == 1
    assert md.num_prefill_tokens == 4 and md.decode_max_query_len == 1
    assert md.req_id_per_token.tolist() == [0, 1, 2, 2, 2, 2]
    assert md.query_start_loc.tolist() == [0, 1, 2, 6]
    assert md.context_start(0) == 9 and md.context_start(2) == 0
    for t in (md.req_id_per_token, md.request_ids, md.seq_lens, md.query_start_loc):
        assert t.dtype == torch.int32


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(request_ids=[1, 2], query_lens=[1, 2], seq_lens=[5, 5], num_decodes=2), ValueError, "decode"),
    (dict(request_ids=[1, 1], query_lens=[1, 1], seq_lens=[5, 5], num_decodes=2), ValueError, "distinct"),
    (dict(request_ids=[1], query_lens=[3], seq_lens=[2], num_decodes=0), ValueError, "exceeds"),
    (dict(request_ids=[1], query_lens=[1, 1], seq_lens=[2], num_decodes=0), ValueError, "one entry"),
    (dict(request_ids=[1], query_lens=[1], seq_lens=[2], num_decodes=2), ValueError, "num_decodes"),
    (dict(request_ids=[1.0], query_lens=[1], seq_lens=[2], num_decodes=0), TypeError, "int"),
])
def test_metadata_bad(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        SparseMLAMetadata.build(**kw)


def test_prepare_rejects_bad_batches_without_state_change():
    g = make_group()
    fill(g, 1, 12)
    with pytest.raises(TypeError):
        g.prepare_for_batch({"num_decodes": 1})
    with pytest.raises(ValueError, match="not live"):
        g.prepare_for_batch(build([(2, 1, 5)], 1))
    with pytest.raises(ValueError, match="context"):
        g.prepare_for_batch(build([(1, 1, 14)], 1))  # holds 12, not 13
    md = build([(1, 1, 13)], 1)
    with pytest.raises(ValueError, match="prepare_for_batch"):
        g.write_new_rows(0, batch_rows(0, md), md)  # not prepared
    assert [g.request_length(1, i) for i in range(L)] == [12, 12]
    g.prepare_for_batch(md)
    with pytest.raises(ValueError, match="T=1"):
        g.write_new_rows(0, batch_rows(0, md)[:0], md)
    with pytest.raises(TypeError):
        g.write_new_rows(0, batch_rows(0, md).to(torch.int16), md)
    topk = torch.zeros((1, K), dtype=torch.int32)
    with pytest.raises(ValueError, match="write_new_rows must run before"):
        g.convert_decode_logical_to_physical_topk(0, topk, md)
    g.write_new_rows(0, batch_rows(0, md), md)
    with pytest.raises(ValueError, match="already written"):
        g.write_new_rows(0, batch_rows(0, md), md)
    assert [g.request_length(1, i) for i in range(L)] == [13, 12]
    with pytest.raises(ValueError, match="write_new_rows must run before"):
        g.convert_decode_logical_to_physical_topk(1, topk, md)  # layer 1 not written yet


def test_decode_query_len_above_config():
    g = make_group()
    fill(g, 1, 10)
    with pytest.raises(ValueError, match="max_query_len"):
        g.prepare_for_batch(build([(1, 2, 12)], 1))


# ------------------------------------------------------------------ decode
def test_decode_steps_byte_exact():
    """Several decode steps of 3 requests (one fits the buffer, two exceed it)."""
    g = make_group()
    lens = {1: 5, 2: 20, 3: 31}
    for rid, n in lens.items():
        fill(g, rid, n)
    for step in range(6):
        md = build([(rid, 1, lens[rid] + 1) for rid in lens], 3)
        g.prepare_for_batch(md)
        for layer in range(L):  # as an engine runs: write layer l's rows, then attend layer l
            g.write_new_rows(layer, batch_rows(layer, md), md)
            topk = random_topk(md, seed=10 * step + layer)
            phys, counts = g.convert_decode_logical_to_physical_topk(layer, topk, md, return_valid_counts=True)
            assert phys.dtype == torch.int32 and tuple(phys.shape) == (3, K)
            assert counts.dtype == torch.int32 and tuple(counts.shape) == (3,)
            check_physical(g, md, topk, phys, counts, layer)
        for rid in lens:
            lens[rid] += 1
    st = g.stats()["total"]
    assert st["misses"] > 0 and st["hits"] > 0 and st["invalid"] == 0


def test_each_layer_resolved_once_per_forward():
    g = make_group()
    fill(g, 1, 20)
    md = build([(1, 1, 21)], 1)
    forward_writes(g, md)
    topk = random_topk(md, 0)
    before = g.stats()["total"]["resolves"]
    a = g.convert_decode_logical_to_physical_topk(0, topk, md)
    b = g.convert_decode_logical_to_physical_topk(0, topk, md)  # the same answer, no second resolve
    assert a is b
    assert g.stats()["total"]["resolves"] == before + 1
    assert g.resolves_per_layer == [1, 0]
    with pytest.raises(ValueError, match="already converted"):
        g.convert_decode_logical_to_physical_topk(0, topk.clone(), md)
    g.convert_decode_logical_to_physical_topk(1, topk, md)
    assert g.resolves_per_layer == [1, 1]
    # next forward: converted again
    md2 = build([(1, 1, 22)], 1)
    forward_writes(g, md2)
    g.convert_decode_logical_to_physical_topk(0, random_topk(md2, 1), md2)
    assert g.resolves_per_layer == [2, 1]


def test_deferred_staging_wait():
    """convert(wait=False) leaves the misses staging on the side stream until
    wait_for_staging (or a waiting second conversion); the rows are then exact. The next
    forward refuses to start while a layer was never waited for, and changes nothing."""
    g = make_group()
    lens = {1: 5, 2: 20, 3: 31}
    for rid, n in lens.items():
        fill(g, rid, n)

    def step_md():
        return build([(rid, 1, lens[rid] + 1) for rid in lens], 3)

    for step in range(3):
        md = step_md()
        g.prepare_for_batch(md)
        for layer in range(L):
            g.write_new_rows(layer, batch_rows(layer, md), md)
            topk = random_topk(md, seed=10 * step + layer)
            phys, counts = g.convert_decode_logical_to_physical_topk(layer, topk, md, return_valid_counts=True,
                                                                     wait=False)
            if layer == 0:
                g.wait_for_staging(layer)
                g.wait_for_staging(layer)  # again: nothing left to wait for
            else:
                assert g.convert_decode_logical_to_physical_topk(layer, topk, md) is phys  # waits
            check_physical(g, md, topk, phys, counts, layer)
        for rid in lens:
            lens[rid] += 1
    assert g.stats()["total"]["misses"] > 0
    md = step_md()
    forward_writes(g, md)
    with pytest.raises(TypeError, match="wait must be a bool"):
        g.convert_decode_logical_to_physical_topk(1, random_topk(md, 5), md, wait=1)
    with pytest.raises(ValueError, match="layer 1 was not converted in this forward"):
        g.wait_for_staging(1)
    g.convert_decode_logical_to_physical_topk(1, random_topk(md, 5), md, wait=False)
    for rid in lens:
        lens[rid] += 1
    md2 = step_md()
    before = _state_snapshot(g)
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] of the last forward .* wait_for_staging\(\)"):
        g.prepare_for_batch(md2)
    after = _state_snapshot(g)
    assert before.keys() == after.keys()
    for k in before:
        assert (before[k] == after[k]) if isinstance(before[k], dict) else torch.equal(before[k], after[k]), k
    g.wait_for_staging(1)
    forward_writes(g, md2)  # starts now
    with pytest.raises(ValueError, match="layer 0 was not converted in this forward"):
        g.wait_for_staging(0)
    # a wait across a capture boundary is refused (a stream can't wait on the other side)
    g.convert_decode_logical_to_physical_topk(0, random_topk(md2, 6), md2, wait=False)
    g._capturing = lambda: True
    with pytest.raises(ValueError, match="converted outside a CUDA graph capture and is waited for inside"):
        g.wait_for_staging(0)
    del g._capturing
    g.wait_for_staging(0)


def test_decode_needs_rows_written_first_and_checks_args():
    g = make_group()
    fill(g, 1, 20)
    md = build([(1, 1, 21)], 1)
    g.prepare_for_batch(md)
    topk = random_topk(md, 0)
    with pytest.raises(ValueError, match="write_new_rows"):
        g.convert_decode_logical_to_physical_topk(0, topk, md)
    g.write_new_rows(0, batch_rows(0, md), md)
    with pytest.raises(TypeError):
        g.convert_decode_logical_to_physical_topk(0, topk.long(), md)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        g.convert_decode_logical_to_physical_topk(0, topk[:0], md)
    with pytest.raises(ValueError, match="top_k"):
        g.convert_decode_logical_to_physical_topk(0, torch.zeros(1, K + 1, dtype=torch.int32), md)
    with pytest.raises(ValueError, match="disagree"):
        g.convert_decode_logical_to_physical_topk(0, topk, md, num_decodes=2)
    with pytest.raises(ValueError, match="seq_len"):  # checked resolve: position beyond the request
        g.convert_decode_logical_to_physical_topk(0, torch.tensor([[25, -1, -1, -1]], dtype=torch.int32), md)
    assert g.resolves_per_layer == [0, 0]
    phys = g.convert_decode_logical_to_physical_topk(0, topk, md, num_decodes=1, decode_query_len=1)
    check_physical(g, md, topk, phys, (topk >= 0).sum(1), 0)


def test_padding_and_empty_decode():
    g = make_group()
    fill(g, 1, 20)
    md = build([(1, 1, 21)], 1)
    forward_writes(g, md)
    topk = torch.full((1, K), -1, dtype=torch.int32)
    phys, counts = g.convert_decode_logical_to_physical_topk(0, topk, md, return_valid_counts=True)
    assert phys.tolist() == [[-1] * K] and counts.tolist() == [0]
    # a prefill-only batch has no decode tokens: an empty [0, K] answer
    g.add_request(2)
    md2 = build([(2, 4, 4)], 0)
    forward_writes(g, md2)
    phys, counts = g.convert_decode_logical_to_physical_topk(0, torch.empty(0, K, dtype=torch.int32), md2,
                                                             return_valid_counts=True)
    assert tuple(phys.shape) == (0, K) and tuple(counts.shape) == (0,)
    assert g.resolves_per_layer == [1, 0]


def test_multi_token_decode_within_buffer_and_beyond():
    g = make_group(max_query_len=2, device_buffer_size=8)
    fill(g, 1, 4)
    md = build([(1, 2, 6)], 1)  # positions 4, 5 new; fits the 8 slots
    forward_writes(g, md)
    topk = random_topk(md, 3)
    phys, counts = g.convert_decode_logical_to_physical_topk(0, topk, md, return_valid_counts=True)
    check_physical(g, md, topk, phys, counts, 0)
    # beyond the buffer: new position 12 is neither in slot 12 (S = 8) nor the newest (13, in the
    # reserved slot); lengths are per layer, so layer 0 resolves it (staged from its host row)
    # although layer 1 has not written this forward's rows yet
    fill(g, 2, 12)
    md = build([(2, 2, 14)], 1)
    g.prepare_for_batch(md)
    g.write_new_rows(0, batch_rows(0, md), md)  # layer 1 not yet: the engine attends layer 0 first
    misses = g.stats()["layers"][0]["misses"]
    topk = torch.tensor([[12, 0, -1, -1], [13, 12, 1, -1]], dtype=torch.int32, device=DEVICE)
    phys, counts = g.convert_decode_logical_to_physical_topk(0, topk, md, return_valid_counts=True)
    check_physical(g, md, topk, phys, counts, 0)
    assert g.stats()["layers"][0]["misses"] == misses + 1  # position 12 (0, 1 are hot)
    # position 14 does not exist yet in any layer: refused (checked)
    g.write_new_rows(1, batch_rows(1, md), md)
    with pytest.raises(ValueError, match="seq_len=14"):
        g.convert_decode_logical_to_physical_topk(
            1, torch.tensor([[14, -1, -1, -1], [13, -1, -1, -1]], dtype=torch.int32,
                            device=DEVICE), md)


# ------------------------------------------------------------------ batched write path
def _state_snapshot(g: HiSparseIndexGroup) -> dict:
    c = g.hisparse_cache
    st = c.state
    snap = {n: getattr(st, n).clone() for n in ("id_to_slot", "seq_lens", "block_table", "slot_pos",
                                                 "slot_stamp", "row_slot", "step", "stats")}
    snap["hot"] = c.hot.clone()
    snap["blocks"] = {rid: list(c.pool.allocator.owned(c.request(rid).slot)) for rid in c.live_requests()}
    # host rows of live requests (the rest of the pool is uninitialised memory)
    for rid in c.live_requests():
        n = c.request(rid).lengths[0]
        snap[f"pool{rid}"] = torch.stack([c.read_host_rows(layer, rid, torch.arange(n)) for layer in range(L)])
    return snap


class _PerRequestWrites:
    """A group whose write_new_rows appends request by request through the cache's
    per-request ``write``: the reference the batched write path must equal."""

    def __init__(self, g: HiSparseIndexGroup) -> None:
        self.g = g

    def __getattr__(self, name):
        return getattr(self.g, name)

    def prepare_for_batch(self, md):
        self.g.prepare_for_batch(md)
        self.g._step.abandon()  # the appends below write the rows

    def write_new_rows(self, layer, rows, md):
        qsl = md.query_start_loc_cpu
        for row, rid in enumerate(md.request_ids_cpu):
            if qsl[row + 1] > qsl[row]:
                self.g.hisparse_cache.write(layer, rid, rows[qsl[row]:qsl[row + 1]])
        self.g._fwd.written.add(layer)


def test_batched_writes_equal_per_request_appends():
    groups = [make_group(), _PerRequestWrites(make_group())]
    for g in groups:
        fill(g, 1, 6)
        fill(g, 2, 9)
        lens = {1: 6, 2: 9}
        g.add_request(3)
        lens[3] = 0
        for step in range(5):  # mixed batches: 2 decodes + a chunked prefill of request 3
            reqs = [(1, 1, lens[1] + 1), (2, 1, lens[2] + 1), (3, 5, lens[3] + 5)]
            md = build(reqs, 2)
            forward_writes(g, md)
            for layer in range(L):
                g.convert_decode_logical_to_physical_topk(layer, random_topk(md, step * 7 + layer), md)
            for rid, q, s in reqs:
                lens[rid] = s
        g.free_request(2)
        fill(g, 4, 11)
    a, b = (_state_snapshot(g) for g in groups)
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_batched_write_capacity_error_changes_nothing():
    g = make_group(host_pool_tokens=16)  # 4 blocks of 4
    fill(g, 1, 12)  # 3 blocks
    g.add_request(2)
    before = _state_snapshot(g)
    md = build([(2, 8, 8)], 0)  # needs 2 more blocks, 1 free
    with pytest.raises(CapacityError):
        g.prepare_for_batch(md)  # the forward's blocks are allocated here
    after = _state_snapshot(g)
    for k in before:
        if isinstance(before[k], torch.Tensor):
            assert torch.equal(before[k], after[k]), k
        else:
            assert before[k] == after[k], k
    assert g.request_length(2, 0) == 0


# ------------------------------------------------------------------ prefill
def _mixed_batch(g):
    """Request 1 decodes; requests 2 and 3 prefill a chunk after some context."""
    fill(g, 1, 20)
    fill(g, 2, 10)
    fill(g, 3, 5)
    md = build([(1, 1, 21), (2, 3, 13), (3, 6, 11)], 1)
    forward_writes(g, md)
    return md


def test_free_request_and_reuse():
    g = make_group()
    fill(g, 1, 30)
    g.free_request(1)
    assert not g.has_request(1)
    with pytest.raises(ValueError):
        g.free_request(1)
    fill(g, 1, 3)
    md = build([(1, 1, 4)], 1)
    forward_writes(g, md)
    topk = random_topk(md, 0)
    phys, counts = g.convert_decode_logical_to_physical_topk(0, topk, md, return_valid_counts=True)
    check_physical(g, md, topk, phys, counts, 0)


def test_bf16_rows():
    g = HiSparseIndexGroup(make_cfg(row_bytes=1152))
    for _ in range(L):
        g.register_layer(kv_cache_dtype="bf16")
    g.add_request(1)
    x = torch.randn(12, 576).to(torch.bfloat16)
    md = build([(1, 12, 12)], 0)
    g.prepare_for_batch(md)
    for layer in range(L):
        g.write_new_rows(layer, x, md)  # bf16 [T, 576] accepted for bf16 rows
    md = build([(1, 1, 13)], 1)
    g.prepare_for_batch(md)
    y = torch.randn(1, 576).to(torch.bfloat16)
    for layer in range(L):
        g.write_new_rows(layer, y, md)
    topk = torch.tensor([[12, 0, 5, -1]], dtype=torch.int32)
    phys = g.convert_decode_logical_to_physical_topk(0, topk, md)
    hot = g.physical_kv_cache(0).view(torch.bfloat16)
    want = torch.cat([x, y])
    for k in range(3):
        assert torch.equal(hot[int(phys[0, k])], want[int(topk[0, k])])


def test_has_request_takes_any_int_like_id():
    """An engine's ids often come from numpy arrays: ``has_request`` answers for them as
    for Python ints, and says False (it does not raise) for ids that are not live."""
    import numpy as np
    g = make_group()
    g.add_request(3)
    assert g.has_request(3) and g.has_request(np.int64(3)) and g.has_request(np.int32(3))
    assert not g.has_request(4) and not g.has_request(np.int64(4)) and not g.has_request(-1)
