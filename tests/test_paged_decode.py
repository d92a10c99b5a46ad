"""The resident resolve folded into the decode (``kernels.paged_rows``,
``TritonBackend.decode(..., paged=)``, ``cache.paged_resolve.resolve_paged``, ``DecodeLayer``'s
resident path), on CPU under Triton's interpreter.

Against the resident resolve kernel followed by the same attention over its physical
rows, on caches built alike, over randomized batches (query groups, padding,
out-of-range entries, ids not live, repeated runs, offsets past max_query_len), with
several head blocks (the scratch rows) and KV splits (the split ranges and the
per-run counter): outputs bitwise equal, the same physical rows written, the same
counters; no other state touched. Then the refusals, and ``DecodeLayer`` choosing the
fused path (and not for a backend without one). The warp-specialised kernel's prologue
runs on the GPU only: ``tests/test_paged_decode_gpu.py``.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from hisparse.attention.paged import PagedLookup
from hisparse.attention.reference import ReferenceBackend
from hisparse.attention.triton_backend import TritonBackend, TritonMLAConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.paged_resolve import resolve_paged
from hisparse.decode import DecodeLayer
from hisparse.formats import RowFormat
from invariants import check_cache
from test_resolve_resident import _batch, _fp8_rows, pooled

I32 = torch.int32
SM = 576 ** -0.5
STATE = ("slot_pos", "slot_stamp", "row_slot", "step", "seq_lens", "page_table", "resident", "stats")


def _cache(seed: int, kernels: str = "triton") -> HiSparseCache:
    rng = random.Random(seed)
    c = HiSparseCache(pooled(pages=12, row_bytes=656), kernels=kernels)
    for i, rid in enumerate((3, 7, 0, 9)):
        c.add_request(rid)
        for layer in range(2):  # lengths differ per layer; across page boundaries
            n = rng.choice([1, 5, 63, 64, 65, 130]) + layer
            c.write(layer, rid, _fp8_rows(n, 100 * i + layer + 1000 * seed))
    assert c.graphs.resident_resolve()
    return c


def _backend(H: int) -> TritonBackend:
    # 16-head blocks (3 of them at H = 40: head blocks 1 and 2 map into the scratch rows)
    # and 2 KV splits of 16-entry blocks
    cfg = TritonMLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2)
    return TritonBackend(config=cfg, validate=False, allow_interpreter=True)


@pytest.mark.parametrize("seed,H", [(0, 40), (1, 16), (2, 40)])
def test_paged_decode_equals_resolve_then_decode(seed, H):
    rng = random.Random(seed)
    a, b = _cache(seed), _cache(seed)
    be = _backend(H)
    Q, K = a.cfg.max_query_len, a.cfg.top_k
    for it in range(3):
        layer = it % 2
        ids, topk = _batch(rng, a, layer, Q, K)
        while ids.numel() > a.cfg.max_tokens:  # what the resolve's checks refuse
            ids, topk = _batch(rng, a, layer, Q, K)
        T = ids.numel()
        q = (torch.randn((T, H, 576), generator=torch.Generator().manual_seed(it)) * 0.5).to(torch.bfloat16)
        res = a.resolve(layer, ids, topk, validate=False)
        want = be.decode(q, a.hot_rows(layer), res.physical, sm_scale=SM, row_format=RowFormat.FP8_DS_MLA)
        before = copy.deepcopy(b.state)
        got = resolve_paged(b, layer, ids, topk, lambda p: be.decode(
            q, b.hot_rows(layer), topk, sm_scale=SM, row_format=RowFormat.FP8_DS_MLA, paged=p), validate=False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, it)
        assert torch.equal(b._out(layer, T, K).physical, res.physical)  # what a demotion reads
        assert torch.equal(b.state.stats, a.state.stats)
        for name in STATE[:-1]:
            assert torch.equal(getattr(b.state, name), getattr(before, name)), name
        assert b.requests.epochs == a.requests.epochs
    check_cache(b)


def _fixed_call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request ids (a group of two tokens), a top-k with padding and a position past
    request 3's rows, and a 40-head query: int32 [4], int32 [4, 8], bf16 [4, 40, 576]."""
    ids = torch.tensor([3, 3, 7, 9], dtype=I32)
    tk = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [64, 3, -1, 2, 1, 0, 5, 4], [1, 0, -1, -1, 3, 2, 4, 5],
                       [5, 4, 3, 2, 1, 0, -1, 7]], dtype=I32)
    q = (torch.randn((4, 40, 576), generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.bfloat16)
    return ids, tk, q


def test_decode_layer_maps_the_resident_topk_in_the_attention(monkeypatch):
    import hisparse.decode.layer as L
    a, b = _cache(5), _cache(5)
    be = _backend(40)
    calls = []
    real = L.resolve_paged
    monkeypatch.setattr(L, "resolve_paged", lambda *x, **k: calls.append(1) or real(*x, **k))
    fused = DecodeLayer(b, be, overlap="serial")
    plain = DecodeLayer(a, be, overlap="serial", fuse_lookup=False)
    ids, tk, q = _fixed_call()
    for layer in range(2):
        o1, l1 = fused(layer, ids, tk, q, sm_scale=SM)
        o0, l0 = plain(layer, ids, tk, q, sm_scale=SM)
        assert torch.equal(o1, o0) and torch.equal(l1, l0)
    assert calls == [1, 1]
    assert torch.equal(a.state.stats, b.state.stats)
    # a backend without a paged lookup takes the resolve, then the attention
    ref = DecodeLayer(b, ReferenceBackend(), overlap="serial")
    ref(0, ids, tk, q, sm_scale=SM)
    assert calls == [1, 1]


def test_paged_refusals():
    """Bad paged lookups are refused before any launch (unchecked backend included)."""
    c = _cache(6)
    be = _backend(16)
    ids = torch.tensor([3], dtype=I32)
    tk = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=I32)
    q = torch.zeros((1, 16, 576), dtype=torch.bfloat16)
    got = []
    resolve_paged(c, 0, ids, tk, lambda p: got.append(p), validate=False)
    (p,) = got
    assert isinstance(p, PagedLookup) and p.physical.shape[1] >= 8
    with pytest.raises(ValueError, match="no valid_counts"):
        be.decode(q, c.hot_rows(0), tk, valid_counts=torch.ones(1, dtype=I32), sm_scale=SM,
                  row_format="fp8_ds_mla", paged=p)
    with pytest.raises(TypeError, match="PagedLookup"):
        TritonBackend(validate=True, allow_interpreter=True).decode(q, c.hot_rows(0), tk, sm_scale=SM,
                                                                    row_format="fp8_ds_mla", paged=(1, 2))
    with pytest.raises(ValueError, match="req_ids"):
        be.decode(q, c.hot_rows(0), tk, sm_scale=SM, row_format="fp8_ds_mla",
                  paged=p._replace(req_ids=torch.zeros(2, dtype=I32)))
    be.decode(q, c.hot_rows(0), tk, sm_scale=SM, row_format="fp8_ds_mla", paged=p)  # planned: later calls skip checks
    with pytest.raises(ValueError, match="page_rows"):  # ... but not those of another signature
        be.decode(q, c.hot_rows(0), tk, sm_scale=SM, row_format="fp8_ds_mla", paged=p._replace(page_rows=0))
    for bad, match in ((dict(seq_lens=torch.zeros(8, dtype=I32)[::2]), "contiguous"),
                       (dict(resident=torch.zeros(3, dtype=I32)), "R=4"),
                       (dict(scan_chunk=48), "power of two"),
                       (dict(stats=torch.zeros(3, dtype=torch.int64)), "stat_"),
                       (dict(stats=p.stats.to(torch.int32)), "torch.int64"),
                       (dict(req_ids="ids"), "must be a tensor")):
        with pytest.raises((ValueError, TypeError), match=match):
            be.decode(q, c.hot_rows(0), tk, sm_scale=SM, row_format="fp8_ds_mla", paged=p._replace(**bad))
    wide = TritonBackend(config=TritonMLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, wide=True),
                         allow_interpreter=True)
    assert wide.paged_problem(1, 16, 8, device="cpu", row_format="fp8_ds_mla") is not None
    with pytest.raises(ValueError, match="not wide"):
        wide.decode(q, c.hot_rows(0), tk, sm_scale=SM, row_format="fp8_ds_mla", paged=p)
    assert be.paged_problem(1, 16, 8, device="cpu", row_format="fp8_ds_mla") is None
    one = TritonBackend(config=TritonMLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=1),
                        allow_interpreter=True)  # 2048 entries a program: the resolve's own kernel is faster
    assert "2048 entries a program" in one.paged_problem(64, 16, 2048, device="cpu", row_format="fp8_ds_mla")
    # off the resident path: refused before anything
    c2 = HiSparseCache(_nopool(), kernels="torch")
    with pytest.raises(ValueError, match="every live request resident"):
        resolve_paged(c2, 0, ids, tk, lambda p: None)


def _nopool():
    from hisparse import HiSparseConfig
    return HiSparseConfig(num_layers=2, host_pool_tokens=1024, row_bytes=656, top_k=8, device_buffer_size=24,
                          max_num_reqs=4, max_query_len=3, host_block_size=4, max_request_id=12, device="cpu")


_SM90_PAGED = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hisparse.kernels.gluon_support import gluon_ws_problem
from hisparse.kernels.mla_decode import sparse_mla_decode_kernel
from ptx_checks import resource_usage
from compile_args import paged_args

BASE = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "vc_ptr": "*i32", "out_ptr": "*bf16",
        "lse_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "N": "i32", "K": "i32", "H": "i32",
        "q_stride_t": "i32", "q_stride_h": "i32", "kv_stride": "i32", "idx_stride": "i32",
        "rows_per_split": "i32", "qk_scale_log2": "fp32"}
PAGED, PCONST = paged_args()  # compile_args


def compile_one(fn, consts, src_cls, options):
    sig = dict(BASE)
    sig.update({k: "constexpr" for k in consts})
    sig.update(PAGED)
    consts = {**consts, **PCONST}
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in ("q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr", "part_out_ptr", "part_lse_ptr")}
    k = triton.compile(src_cls(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm["ptx"]
    return {"atom": ptx.count("atom.") + ptx.count("red."), "usage": resource_usage(k.asm["cubin"])[-200:]}


out = {"tl": compile_one(sparse_mla_decode_kernel, dict(HAS_VC=False, IS_FP8=True, NUM_SPLITS=2, BLOCK_H=64,
                                                        BLOCK_N=32, ISOLATE_QK=False, PREFETCH=0),
                         ASTSource, dict(num_warps=8, num_stages=1))}
if gluon_ws_problem() is None:
    from triton.experimental.gluon._runtime import GluonASTSource
    from hisparse.attention.triton_backend import WS_MAXNREG, ws_consumer_regs
    from hisparse.kernels.mla_decode_ws import sparse_mla_decode_ws_kernel
    out["ws"] = compile_one(sparse_mla_decode_ws_kernel, dict(HAS_VC=False, NUM_SPLITS=1, BLOCK_N=32, STAGES=2,
                                                              RAW=2, PRODUCER_REGS=72,
                                                              CONSUMER_REGS=ws_consumer_regs(72)),
                            GluonASTSource, dict(num_warps=4, maxnreg=WS_MAXNREG))
print(json.dumps(out))
'''


def test_paged_kernels_compile_for_sm90():
    """The paged variants of the tl and warp-specialised kernels compile for sm90 (ptxas
    from the Triton wheel, no GPU), their counters' atomics in the code."""
    from attention_common import run_sm90_compile
    from hisparse.kernels.gluon_support import gluon_ws_problem
    got = run_sm90_compile(_SM90_PAGED, timeout=600)
    assert got["tl"]["atom"] >= 3, got
    if gluon_ws_problem() is None:
        assert got["ws"]["atom"] >= 3, got


def test_a_refused_paged_decode_changes_nothing():
    """``attend`` refused (e.g. by the backend's own checks): no epoch moved, no
    counter, the layer's last selection not re-registered."""
    c = _cache(8)
    ids = torch.tensor([3], dtype=I32)
    tk = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=I32)
    epochs = list(c.requests.epochs)
    stats = c.state.stats.clone()
    last = [(t.data_ptr(), t.numel()) if t is not None else None for t in c.writer.last_selection]

    def refuse(paged):
        raise ValueError("refused")
    with pytest.raises(ValueError, match="refused"):
        resolve_paged(c, 1, ids, tk, refuse, validate=False)
    assert c.requests.epochs == epochs and torch.equal(c.state.stats, stats)
    assert [(t.data_ptr(), t.numel()) if t is not None else None for t in c.writer.last_selection] == last
    resolve_paged(c, 1, ids, tk, lambda paged: None, validate=False)  # accepted: the epoch and selection move
    assert c.requests.epochs != epochs
    assert [(t.data_ptr(), t.numel()) if t is not None else None for t in c.writer.last_selection] != last


def test_begin_defers_the_resident_lookup_into_finish(monkeypatch):
    """A split layer's ``begin`` on the resident path, with a backend that maps the top-k
    itself: it checks and launches nothing (no counter; the layer's epoch moves, as a
    resolve's would); ``finish`` maps and attends, bitwise as the resolve kernel followed
    by the attention. A write to the layer, or a later begin, in between makes the launch
    stale (refused, as before), and so does its own finish; a request joining hot in
    between, or a finishing layer whose backend maps no top-k, sends ``finish`` through
    the full resolve, with the same result. A checked layer refuses a bad top-k at
    ``begin`` and finishes a good one."""
    from hisparse.decode.layer import DeferredLookup
    a, b = _cache(5), _cache(5)
    be = _backend(40)
    fused = DecodeLayer(b, be, overlap="split")
    plain = DecodeLayer(a, be, overlap="split", fuse_lookup=False)
    ids, tk, q = _fixed_call()
    for layer in range(2):
        stats, epochs = b.state.stats.clone(), list(b.requests.epochs)
        launch = fused.begin(layer, ids, tk, num_heads=40)
        assert isinstance(launch.result, DeferredLookup)
        epochs[layer] += 1  # results held from before are stale, as after a resolve
        assert torch.equal(b.state.stats, stats) and b.requests.epochs == epochs
        o1, l1 = fused.finish(launch, q, sm_scale=SM)
        p = plain.begin(layer, ids, tk, num_heads=40)
        assert not isinstance(p.result, DeferredLookup)
        o0, l0 = plain.finish(p, q, sm_scale=SM)
        assert torch.equal(o1, o0) and torch.equal(l1, l0)
        assert torch.equal(b.state.stats, a.state.stats)
        assert torch.equal(b._out(layer, 4, 8).physical, a._out(layer, 4, 8).physical)
    check_cache(b)
    launch = fused.begin(0, ids, tk, num_heads=40)
    b.write(0, 9, _fp8_rows(1, 77))
    with pytest.raises(ValueError, match="appended to, resolved or freed since begin"):
        fused.finish(launch, q, sm_scale=SM)
    a.write(0, 9, _fp8_rows(1, 77))
    launch = fused.begin(1, ids, tk, num_heads=40)
    monkeypatch.setattr(type(b.graphs), "resident_resolve", lambda self: False)  # as if a request joined hot
    o1, l1 = fused.finish(launch, q, sm_scale=SM)
    monkeypatch.undo()
    o0, l0 = plain.finish(plain.begin(1, ids, tk, num_heads=40), q, sm_scale=SM)
    assert torch.equal(o1, o0) and torch.equal(l1, l0) and torch.equal(b.state.stats, a.state.stats)
    checked = DecodeLayer(b, TritonBackend(config=be.config, allow_interpreter=True), overlap="split", validate=True)
    stats, epochs = b.state.stats.clone(), list(b.requests.epochs)
    with pytest.raises(ValueError):
        checked.begin(0, ids, torch.full_like(tk, 10_000), num_heads=40)
    assert torch.equal(b.state.stats, stats) and b.requests.epochs == epochs
    good = checked.begin(0, ids, tk, num_heads=40)
    assert isinstance(good.result, DeferredLookup)
    o1, l1 = checked.finish(good, q, sm_scale=SM)
    o0, l0 = plain.finish(plain.begin(0, ids, tk, num_heads=40), q, sm_scale=SM)
    assert torch.equal(o1, o0) and torch.equal(l1, l0)
    with pytest.raises(ValueError, match="since begin"):  # its own finish resolved the layer
        checked.finish(good, q, sm_scale=SM)
    # a later begin of the layer makes an earlier launch stale, as a resolve does
    first = fused.begin(1, ids, tk, num_heads=40)
    second = fused.begin(1, ids, tk, num_heads=40)
    with pytest.raises(ValueError, match="since begin"):
        fused.finish(first, q, sm_scale=SM)
    fused.finish(second, q, sm_scale=SM)
    # finished by a layer whose backend maps no top-k: the full resolve, then its attention
    ref = DecodeLayer(b, ReferenceBackend(), overlap="split")
    o2, l2 = ref.finish(fused.begin(1, ids, tk, num_heads=40), q, sm_scale=SM)
    o3, l3 = DecodeLayer(a, ReferenceBackend(), overlap="split").finish(
        plain.begin(1, ids, tk, num_heads=40), q, sm_scale=SM)
    assert torch.equal(o2, o3) and torch.equal(l2, l3)
    check_cache(b)
