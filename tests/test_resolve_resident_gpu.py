"""The resident resolve path on the GPU: the kernel against the full resolve's torch
reference at production sizes (K = 2048, query groups, awkward lengths), and a
``DecodeLayer`` captured in a CUDA graph inside ``resident_capture`` replaying the
eager layer's output bit for bit."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.attention.triton_backend import TritonBackend
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.resolve_ref import resolve_reference
from hisparse.cache.state import ResolveBuffers
from hisparse.decode import DecodeLayer
from hisparse.formats import quantize_fp8_ds_mla

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

I32 = torch.int32


def _cache(B: int, lens: list[int], q: int) -> HiSparseCache:
    K, S = 2048, 2048 * q
    probe = HiSparseConfig(num_layers=1, host_pool_tokens=sum(-(-n // 64) * 64 for n in lens), row_bytes=656,
                           top_k=K, device_buffer_size=S, max_num_reqs=B, max_query_len=q, host_block_size=64,
                           max_request_id=2 * B, device="cuda")
    pages = sum(-(-n // 64) for n in lens)
    cfg = HiSparseConfig(**{**probe.to_dict(), "device_pool_rows": probe.hot_rows_per_layer + pages * 64})
    c = HiSparseCache(cfg, kernels="triton")
    g = torch.Generator().manual_seed(5)
    for b, n in enumerate(lens):
        c.add_request(2 * b)
        x = (torch.randn((n, 576), generator=g) * 0.5).to(device="cuda", dtype=torch.bfloat16)
        c.write(0, 2 * b, quantize_fp8_ds_mla(x))
    torch.cuda.synchronize()
    assert c.graphs.all_resident()
    return c


@pytest.mark.parametrize("q,compact", [(1, False), (2, True)])
def test_resident_kernel_matches_the_full_reference(q, compact):
    rng = random.Random(q)
    lens = [2048, 2049, 3000, 4095, 4096, 4097, 6001, 2500]
    c = _cache(len(lens), lens, q)
    ids, rows = [], []
    for b, n in enumerate(lens):
        for _ in range(q):
            ids.append(2 * b)
            pos = rng.sample(range(n), 2048)
            for k in rng.sample(range(2048), 100):
                pos[k] = -1
            for k in rng.sample(range(2048), 10):
                pos[k] = n + k  # out of range
            rows.append(pos)
    ids += [1, 2]  # an id that is not live, a repeated run
    rows += [list(range(2048)), list(range(2048))]
    req = torch.tensor(ids, dtype=I32, device="cuda")
    tk = torch.tensor(rows, dtype=I32, device="cuda")
    T, K = tk.shape
    st = c.state
    cpu_state = dataclasses.replace(st, **{f.name: getattr(st, f.name).cpu() for f in dataclasses.fields(st)
                                           if isinstance(getattr(st, f.name), torch.Tensor)})
    want = ResolveBuffers.allocate(T, K, torch.device("cpu"))
    resolve_reference(cpu_state, 0, req.cpu(), tk.cpu(), want, max_query_len=q, compact=compact)
    got = ResolveBuffers.allocate(T, K, torch.device("cuda"))
    c.kernel_set.resolve_resident(c.state, 0, req, tk, got, max_query_len=q, compact=compact)
    torch.cuda.synchronize()
    assert torch.equal(got.physical.cpu(), want.physical)
    assert torch.equal(got.valid_counts.cpu(), want.valid_counts)
    assert torch.equal(got.stage_counts.cpu(), want.stage_counts)
    assert torch.equal(got.stage_src.cpu(), want.stage_src) and torch.equal(got.stage_dst.cpu(), want.stage_dst)
    assert torch.equal(c.state.stats.cpu(), cpu_state.stats)


def test_a_layer_captured_on_the_resident_path_replays_the_eager_output():
    lens = [4096, 5000, 2048, 7000]
    c = _cache(len(lens), lens, 1)
    be = TritonBackend(validate=False)
    req = torch.tensor([0, 2, 4, 6], dtype=I32, device="cuda")
    g = torch.Generator().manual_seed(3)
    tk = torch.stack([torch.randperm(n, generator=g)[:2048] for n in lens]).to(device="cuda", dtype=I32)
    q = (torch.randn((4, 128, 576), generator=g) * 0.5).to(device="cuda", dtype=torch.bfloat16)
    sm = 576 ** -0.5
    for mode in ("serial", "split"):
        layer = DecodeLayer(c, be, overlap=mode)
        eager = layer(0, req, tk, q, sm_scale=sm)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with c.graphs.resident_capture(), torch.cuda.stream(s):
            with torch.cuda.graph(graph, stream=s):
                out = layer(0, req, tk, q, sm_scale=sm)
        stats0 = c.stats()["total"]["resident_rows"]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1]), mode
        assert c.stats()["total"]["resident_rows"] - stats0 == 4 * 2048
