"""The resident resolve folded into the decode on the GPU: the warp-specialised kernel's
Gluon prologue (``kernels.paged_rows.paged_rows_gl``) and the ``tl`` kernel's, against
the resident resolve kernel followed by the same attention, on caches built alike:
bitwise equal outputs, the same physical rows and counters, over randomized batches,
one wave of SMs and past it (the tail launch's token offset), eagerly, inside a capture
(``DecodeLayer(graphs=True)``) and through ``DecodeLayer``."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.attention.triton_backend import TritonBackend, TritonMLAConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.paged_resolve import resolve_paged
from hisparse.decode import DecodeLayer
from hisparse.formats import RowFormat

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs CUDA", allow_module_level=True)

from test_resolve_resident import _batch, _fp8_rows, pooled  # noqa: E402

I32 = torch.int32
SM = 576 ** -0.5
DEV = torch.device("cuda")


def _cache(seed: int, reqs: int, top_k: int = 64) -> HiSparseCache:
    rng = random.Random(seed)
    cfg = pooled(pages=4 * reqs + 8, row_bytes=656, top_k=top_k, device_buffer_size=3 * top_k, max_num_reqs=reqs,
                 max_request_id=2 * reqs + 4, host_pool_tokens=512 * reqs, device="cuda")
    c = HiSparseCache(cfg, kernels="triton")
    for i in range(reqs):
        c.add_request(i)
        for layer in range(2):
            n = rng.choice([65, 130, 200]) + layer
            c.write(layer, i, _fp8_rows(n, 100 * i + layer + 1000 * seed).to(DEV))
    assert c.graphs.resident_resolve()
    return c


@pytest.mark.parametrize("config", ["default", "tl"])
@pytest.mark.parametrize("seed,reqs", [(0, 3), (1, 40)])
def test_paged_decode_equals_resolve_then_decode(config, seed, reqs):
    rng = random.Random(seed)
    a, b = _cache(seed, reqs), _cache(seed, reqs)
    cfg = None if config == "default" else TritonMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=1,
                                                           isolate_qk=True)
    be = TritonBackend(config=cfg, validate=False)
    Q, K = a.cfg.max_query_len, a.cfg.top_k
    for it in range(4):
        layer = it % 2
        ids, topk = _batch(rng, a, layer, Q, K)
        while ids.numel() > a.cfg.max_tokens:
            ids, topk = _batch(rng, a, layer, Q, K)
        ids, topk = ids.to(DEV), topk.to(DEV)
        T = ids.numel()
        q = (torch.randn((T, 128, 576), generator=torch.Generator().manual_seed(it)) * 0.5).to(DEV, torch.bfloat16)
        res = a.resolve(layer, ids, topk, validate=False)
        want = be.decode(q, a.hot_rows(layer), res.physical, sm_scale=SM, row_format=RowFormat.FP8_DS_MLA)
        got = resolve_paged(b, layer, ids, topk, lambda p: be.decode(
            q, b.hot_rows(layer), topk, sm_scale=SM, row_format=RowFormat.FP8_DS_MLA, paged=p), validate=False)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (config, seed, it, T)
        assert torch.equal(b._out(layer, T, K).physical, res.physical)
        assert torch.equal(b.state.stats, a.state.stats)


def _step_inputs(rng: random.Random, B: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k of 256 positions in [-1, 64] per request and a 128-head query: int32 [B, 256],
    bf16 [B, 128, 576] on the GPU."""
    tk = torch.tensor([[rng.randrange(-1, 65) for _ in range(256)] for _ in range(B)], dtype=I32, device=DEV)
    q = (torch.randn((B, 128, 576), generator=torch.Generator().manual_seed(seed)) * 0.5).to(DEV, torch.bfloat16)
    return tk, q


@pytest.mark.parametrize("B", [1, 70])  # one program per head block; past one wave of SMs (a tail launch)
def test_decode_layer_fused_equals_two_launches_eager_and_graphed(B):
    a, b, g = _cache(7, B, top_k=256), _cache(7, B, top_k=256), _cache(7, B, top_k=256)
    be = TritonBackend(validate=False)
    plain = DecodeLayer(a, be, overlap="serial", fuse_lookup=False)
    fused = DecodeLayer(b, be, overlap="serial")
    graphed = DecodeLayer(g, be, overlap="serial", graphs=True)
    rng = random.Random(B)
    ids = torch.arange(B, dtype=I32, device=DEV)
    for step in range(5):
        layer = step % 2
        tk, q = _step_inputs(rng, B, step)
        o0, l0 = plain(layer, ids, tk, q, sm_scale=SM)
        o1, l1 = fused(layer, ids, tk, q, sm_scale=SM)
        o2, l2 = graphed(layer, ids, tk, q, sm_scale=SM)
        torch.cuda.synchronize()
        assert torch.equal(o0, o1) and torch.equal(l0, l1), (B, step)
        assert torch.equal(o0, o2) and torch.equal(l0, l2), (B, step)
    assert torch.equal(a.state.stats, b.state.stats) and torch.equal(a.state.stats, g.state.stats)
    assert graphed.graphs.report()["replays"] > 0


@pytest.mark.parametrize("B", [1, 70])
def test_split_begin_finish_defers_the_lookup_eager_and_captured(B):
    """A split layer's begin / finish on the resident path: begin launches nothing, finish
    maps and attends; bitwise the resolve kernel followed by the attention, eagerly and
    in a captured graph replayed (as the mini engine captures whole steps)."""
    from hisparse.decode.layer import DeferredLookup
    a, b = _cache(9, B, top_k=256), _cache(9, B, top_k=256)
    be = TritonBackend(validate=False)
    plain = DecodeLayer(a, be, overlap="split", fuse_lookup=False)
    fused = DecodeLayer(b, be, overlap="split")
    rng = random.Random(B)
    ids = torch.arange(B, dtype=I32, device=DEV)
    for step in range(4):
        layer = step % 2
        tk, q = _step_inputs(rng, B, step)
        launch = fused.begin(layer, ids, tk, num_heads=128)
        assert isinstance(launch.result, DeferredLookup)
        o1, l1 = fused.finish(launch, q, sm_scale=SM)
        o0, l0 = plain.finish(plain.begin(layer, ids, tk, num_heads=128), q, sm_scale=SM)
        torch.cuda.synchronize()
        assert torch.equal(o0, o1) and torch.equal(l0, l1), (B, step)
    assert torch.equal(a.state.stats, b.state.stats)
    tk, q = _step_inputs(rng, B, 9)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), b.graphs.resident_capture():
        with torch.cuda.graph(graph, stream=stream):
            o1, l1 = fused.finish(fused.begin(0, ids, tk, num_heads=128), q, sm_scale=SM)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    o0, l0 = plain.finish(plain.begin(0, ids, tk, num_heads=128), q, sm_scale=SM)
    torch.cuda.synchronize()
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
