"""The pooled write of a ``host_written`` step (``hisparse.cache.write_pooled``).

Two caches go through the same history and put the requests' new rows into their host
blocks (as a P/D transfer puts them); one prepares a ``host_written`` step and writes
it with ``write_step`` layer by layer, the rows given, the other writes it through
``write_pooled``. Every piece of state must match (pool bytes, device rows, slot maps,
stamps, lengths, reserved occupants, counters, block tables, the elastic tier's pages);
without the elastic tier, also the state that per-request ``write`` calls leave (with
it, a batched step may place pages otherwise). The steps hold several
requests, blocks with holes between them, requests past S + 1 rows, resident requests
(the elastic tier) and layers written beforehand with ``write_step`` (so the pooled
write covers two runs of layers). Refusals change nothing; a launch that fails leaves
its layers pending and a retry completes the step.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse.cache.write_pooled import write_pooled
from invariants import assert_same, check_cache, snapshot

L, S, B, W = 4, 16, 16, 656


def cfg_of(pool_rows: int = 0) -> HiSparseConfig:
    return HiSparseConfig(num_layers=L, host_pool_tokens=40 * B, row_bytes=W, top_k=8, device_buffer_size=S,
                          max_num_reqs=4, max_query_len=1, host_block_size=B, device="cpu",
                          **({"device_pool_rows": pool_rows} if pool_rows else {}))


def rows_of(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n, W), dtype=torch.uint8, generator=g) for _ in range(L)]


def history(cfg: HiSparseConfig, kernels: str) -> HiSparseCache:
    """Requests 1 (20 rows), 2 (freed: a hole of 2 blocks) and 3 (5 rows)."""
    c = HiSparseCache(cfg, kernels=kernels)
    for rid, n in ((1, 20), (2, 30), (3, 5)):
        c.add_request(rid)
        for layer, r in enumerate(rows_of(rid, n)):
            c.write(layer, rid, r)
    c.free_request(2)
    c.add_request(4)
    return c


# (request, rows already held, new rows): 3 goes past S + 1 and crosses blocks, 4 is new
# and spans the hole, 1 grows by one row
STEP = ((3, 5, 40), (4, 0, 37), (1, 20, 1))


def appended(cfg: HiSparseConfig, kernels: str) -> HiSparseCache:
    c = history(cfg, kernels)
    for layer in range(L):
        for rid, have, n in STEP:
            c.write(layer, rid, rows_of(100 * rid + have, n)[layer])
    return c


def host_written_step(cfg: HiSparseConfig, kernels: str):
    """(cache, step): STEP's rows put in the requests' host blocks, the step prepared."""
    c = history(cfg, kernels)
    for rid, have, n in STEP:
        r = c.request(rid).slot
        c.writer.allocate_for(r, have + n)
        new = rows_of(100 * rid + have, n)
        for layer in range(L):
            for p0, p1, h in c.pool.segments(r, have, have + n):
                c.pool.rows[layer][h:h + p1 - p0] = new[layer][p0 - have:p1 - have]
    step = c.prepare_step(c.plan_write([x[0] for x in STEP], [x[2] for x in STEP]), host_written=True)
    return c, step


def stacked_rows(layer: int) -> torch.Tensor:
    return torch.cat([rows_of(100 * rid + have, n)[layer] for rid, have, n in STEP])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("pool_rows", [0, 4 * 17 + 64 * 2])
@pytest.mark.parametrize("first", [(), (1,), (0, 3)])
def test_pooled_write_equals_per_request_writes(kernels, pool_rows, first):
    """``first``: layers written with ``write_step`` (their rows given) before the
    pooled write takes the rest."""
    cfg = cfg_of(pool_rows)
    want, given = host_written_step(cfg, kernels)
    for layer in range(L):
        want.write_step(layer, given, stacked_rows(layer))
    if not pool_rows:
        assert_same(snapshot(appended(cfg, kernels)), snapshot(want))
    c, step = host_written_step(cfg, kernels)
    if pool_rows:
        assert {c.residency(r) for r in (1, 3, 4)} == {"resident", "hot"}  # both kinds in the step
    for layer in first:
        c.write_step(layer, step, stacked_rows(layer))
    write_pooled(c.writer, step)
    assert not step.pending
    assert_same(snapshot(want), snapshot(c))
    check_cache(c)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_pooled_write_refusals_change_nothing(kernels):
    cfg = cfg_of()
    c = history(cfg, kernels)
    before = snapshot(c)
    with pytest.raises(ValueError, match="holds too few blocks"):  # rows in the pool need their blocks
        c.prepare_step(c.plan_write([4], [5]), host_written=True)
    assert_same(before, snapshot(c))
    plain = c.prepare_step(c.plan_write([1], [1]))
    with pytest.raises(ValueError, match="host_written=True"):
        write_pooled(c.writer, plain)
    plain.abandon()
    assert_same(before, snapshot(c))
    c, step = host_written_step(cfg, kernels)
    write_pooled(c.writer, step)
    done = snapshot(c)
    with pytest.raises(ValueError, match="already written"):
        write_pooled(c.writer, step)
    assert_same(done, snapshot(c))
    c, step = host_written_step(cfg, kernels)
    c.add_request(7)
    mid = snapshot(c)
    with pytest.raises(ValueError, match="out of date"):
        write_pooled(c.writer, step)
    assert_same(mid, snapshot(c))


def test_a_failed_launch_leaves_its_layers_pending():
    cfg = cfg_of()
    want = appended(cfg, "torch")
    c, step = host_written_step(cfg, "torch")
    c.write_step(2, step, stacked_rows(2))  # two runs: layers 0-1 and 3
    real = c.kernel_set.apply_write_pooled
    calls = []

    def flaky(state, hot, pool_rows, plan, layers, extra):
        calls.append(layers)
        if len(calls) == 2:
            raise RuntimeError("injected launch failure")
        real(state, hot, pool_rows, plan, layers, extra)

    c.kernel_set.apply_write_pooled = flaky
    with pytest.raises(RuntimeError, match="injected"):
        write_pooled(c.writer, step)
    assert calls == [range(0, 2), range(3, 4)] and step.pending == {3}
    write_pooled(c.writer, step)  # the retry writes what is left
    assert not step.pending and calls[-1] == range(3, 4)
    assert_same(snapshot(want), snapshot(c))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_pooled_apply_refuses_bad_layer_ranges(kernels):
    """Before any launch: a range past the layers, of another step, or negative."""
    c, step = host_written_step(cfg_of(), kernels)
    before = snapshot(c)
    for bad in (range(0, L + 1), range(0, L, 2), range(-1, 2)):
        with pytest.raises(ValueError, match="range of step 1"):
            c.kernel_set.apply_write_pooled(c.state, c.hot, c.pool.rows, step.pooled, bad, step.host_rows)
    assert_same(before, snapshot(c))


def test_the_reference_gathers_a_few_layers_at_a_time(monkeypatch):
    """The torch reference's pooled gather is bounded (POOLED_CHUNK_BYTES): with a bound
    of one layer's rows and a half, the layers go in chunks, the state the same."""
    import hisparse.cache.apply_write as aw
    cfg = cfg_of()
    want, given = host_written_step(cfg, "torch")
    write_pooled(want.writer, given)
    c, step = host_written_step(cfg, "torch")
    n_hot = int((step.pooled.hot_dst >= 0).sum())
    monkeypatch.setattr(aw, "POOLED_CHUNK_BYTES", n_hot * W * 3 // 2)
    write_pooled(c.writer, step)
    assert_same(snapshot(want), snapshot(c))
