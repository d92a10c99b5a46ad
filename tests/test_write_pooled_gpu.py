"""The pooled write on a CUDA cache (``hisparse.cache.write_pooled``; the CPU tests are
tests/test_write_pooled.py): the same state as per-layer ``write_step`` of the same
step, and a pool past 2^31 int32 words, where the kernel's layer and row offsets must
be 64-bit (a request in the pool's last blocks, read from the last layer)."""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse.cache.write_pooled import write_pooled
from invariants import assert_same, snapshot

pytestmark = pytest.mark.gpu


def _put_rows(c: HiSparseCache, rid: int, rows: list[torch.Tensor]) -> None:
    """The request's rows into its host blocks, as a transfer puts them."""
    r = c.request(rid).slot
    n = rows[0].shape[0]
    for layer, x in enumerate(rows):
        for p0, p1, h in c.pool.segments(r, 0, n):
            c.pool.rows[layer][h:h + p1 - p0] = x[p0:p1]


@pytest.mark.parametrize("pool_rows", [None, 8 * 17 + 64 * 4])
def test_pooled_write_equals_per_layer_writes_on_cuda(pool_rows):
    kw = {"device_pool_rows": pool_rows} if pool_rows else {}
    cfg = HiSparseConfig(num_layers=5, host_pool_tokens=1024, row_bytes=656, top_k=8, device_buffer_size=16,
                         max_num_reqs=8, max_query_len=1, host_block_size=16, device="cuda", **kw)
    g = torch.Generator().manual_seed(3)
    rows = {rid: [torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for _ in range(5)]
            for rid, n in ((1, 40), (2, 70), (3, 5))}
    caches = []
    for _ in range(2):
        c = HiSparseCache(cfg)
        for rid in rows:
            c.add_request(rid)
            c.writer.allocate_for(c.request(rid).slot, rows[rid][0].shape[0])
            _put_rows(c, rid, rows[rid])
        caches.append((c, c.prepare_step(c.plan_write(list(rows), [x[0].shape[0] for x in rows.values()]),
                                         host_written=True)))
    (want, s0), (c, s1) = caches
    for layer in range(5):
        want.write_step(layer, s0, torch.cat([rows[rid][layer] for rid in rows]).cuda())
    write_pooled(c.writer, s1)
    torch.cuda.synchronize()
    assert_same(snapshot(want), snapshot(c))


def test_pooled_write_past_two_to_the_31_words():
    """A 4-layer pool of 1152-byte rows holding 1.9M rows a layer: the last layer starts
    past 2^31 int32 words (8.6 GB pinned)."""
    L, W, B = 4, 1152, 64
    H = (2 ** 31 // (L * W // 4) // B + 8) * B  # rows per layer: L x H x W / 4 words > 2^31
    cfg = HiSparseConfig(num_layers=L, host_pool_tokens=H, row_bytes=W, top_k=8, device_buffer_size=16,
                         max_num_reqs=2, max_query_len=1, host_block_size=B, device="cuda")
    c = HiSparseCache(cfg)
    assert (L - 1) * c.pool.rows.stride(0) // 4 + H * W // 4 > 2 ** 31
    c.add_request(0)
    c.writer.allocate_for(c.request(0).slot, H - 4 * B)  # the request under test gets the last blocks
    c.add_request(1)
    n = 3 * B + 5
    g = torch.Generator().manual_seed(9)
    new = [torch.randint(0, 256, (n, W), dtype=torch.uint8, generator=g) for _ in range(L)]
    c.writer.allocate_for(c.request(1).slot, n)
    _put_rows(c, 1, new)
    step = c.prepare_step(c.plan_write([1], [n]), host_written=True)
    write_pooled(c.writer, step)
    torch.cuda.synchronize()
    S, r = cfg.device_buffer_size, c.request(1).slot
    for layer in (0, L - 1):
        hot = c.hot[layer].cpu()
        base = r * (S + 1)
        assert torch.equal(hot[base:base + S], new[layer][:S])  # positions < S in slots 0 .. S - 1
        assert torch.equal(hot[base + S], new[layer][n - 1])  # the newest in the reserved slot
    assert c.request(1).lengths == (n,) * L
