"""A demotion seeds the hot buffer with the rows the layer's last resolve selected (then
the newest), device to device, in every layer; the next resolve of the same selection
then hits every row."""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig


def _cfg(**kw):
    # 2 requests, S = 16, top_k = 4: hot buffers 2 x 17 rows (64 padded) + 2 pages
    base = dict(num_layers=2, host_pool_tokens=512, row_bytes=32, top_k=4, device_buffer_size=16,
                max_num_reqs=2, host_block_size=16, device="cpu", device_pool_rows=64 + 2 * 64)
    base.update(kw)
    return HiSparseConfig(**base)


def _rows(n, seed):
    return torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_demotion_seeds_the_last_selection_then_the_newest(kernels):
    c = HiSparseCache(_cfg(), kernels=kernels)
    c.add_request(5)
    c.add_request(6)
    data = {layer: _rows(100, layer) for layer in range(2)}
    for layer in range(2):
        c.write(layer, 5, data[layer])[0]  # 2 pages: the whole pool
    assert c.residency(5) == "resident"
    sel = {0: [3, 40, 41, 77], 1: [0, 9, 60, 90]}
    ids = torch.tensor([5], dtype=torch.int32)
    for layer in range(2):
        c.resolve(layer, ids, torch.tensor([sel[layer]], dtype=torch.int32))
    # request 6's first rows need a page: request 5 (the one holding pages) is demoted
    for layer in range(2):
        c.write(layer, 6, _rows(3, 10 + layer))
    assert (c.residency(5), c.residency(6)) == ("hot", "resident")
    tot = c.stats()["total"]
    assert tot["spills"] == 1 and tot["seeded_rows"] == 2 * 17
    st, S = c.state, 16
    for layer in range(2):
        kept = set(st.slot_pos[layer, 0, :S].tolist())
        newest = [p for p in range(98, -1, -1) if p not in sel[layer]][:S - 4]
        assert kept == set(sel[layer]) | set(newest), layer
        assert int(st.slot_pos[layer, 0, S]) == 99  # the newest row: the reserved slot
        for s in range(S + 1):  # every seeded slot holds its row's bytes
            p = int(st.slot_pos[layer, 0, s])
            assert torch.equal(c.hot[layer, s], data[layer][p]), (layer, s, p)
        # the same selection again: every row hits
        before = c.stats()["layers"][layer]
        res = c.resolve(layer, ids, torch.tensor([sel[layer]], dtype=torch.int32))
        after = c.stats()["layers"][layer]
        assert after["misses"] == before["misses"] and after["hits"] == before["hits"] + 4
        for k, p in enumerate(sel[layer]):
            assert torch.equal(c.hot_rows(layer)[int(res.physical[0, k])], data[layer][p])


def test_demotion_of_a_short_context_keeps_every_row_in_place():
    c = HiSparseCache(_cfg(), kernels="torch")
    c.add_request(1)
    c.add_request(2)
    for layer in range(2):
        c.write(layer, 1, _rows(12, layer))[0]  # 1 page, fits its hot buffer (12 <= S)
        c.write(layer, 2, _rows(64, 5 + layer))[0]  # 1 page
    c.write(0, 2, _rows(1, 9))[0]  # a third page is needed: request 2 holds as many, slot 0 goes
    assert (c.residency(1), c.residency(2)) == ("hot", "resident")
    for layer in range(2):
        assert c.state.slot_pos[layer, 0, :12].tolist() == list(range(12))
        assert int(c.state.slot_pos[layer, 0, 12:].max()) == -1
        assert c.requests.reserved(0, layer) == -1


def test_a_replayed_forward_names_its_own_rows_as_the_last_selection():
    """A whole forward's graph replay resolves [bucket tokens, K] of every layer, fewer
    rows than a bigger bucket's replay left in the buffers: ``note_replay(tokens=)`` makes
    that view the last selection (stale rows past it, from the bigger bucket, are not
    seeded; eager and replayed forwards then seed alike)."""
    c = HiSparseCache(_cfg(max_num_reqs=4, device_pool_rows=128 + 2 * 64), kernels="torch")
    for rid in range(4):
        c.add_request(rid)
        for layer in range(2):
            c.write(layer, rid, _rows(20, rid))
    topk = torch.tensor([[0, 1, 2, 3]] * 4, dtype=torch.int32)
    for T in (4, 2):  # a bucket of 4 then one of 2 (what a capture of each resolves)
        for layer in range(2):
            c.resolve(layer, torch.arange(T, dtype=torch.int32), topk[:T])
    assert [t.numel() for t in c.writer.last_selection] == [2 * 4, 2 * 4]
    c.graphs.note_replay(tokens=4)  # the next forward replays the bucket of 4
    assert [t.numel() for t in c.writer.last_selection] == [4 * 4, 4 * 4]
    c.graphs.note_replay(tokens=3)  # no resolve of 3 tokens was captured: nothing to name
    assert [t.numel() for t in c.writer.last_selection] == [4 * 4, 4 * 4]
    c.graphs.note_replay()
    assert [t.numel() for t in c.writer.last_selection] == [4 * 4, 4 * 4]


@pytest.mark.parametrize("path", ["write", "prepare_step"])
def test_a_demotion_that_fails_part_way_changes_nothing(monkeypatch, path):
    """The second of two demotions raises (e.g. out of memory in its seeding): the pool,
    page table, residency, slot state, reserved occupants, lengths and counters are as
    they were before the call."""
    import sys

    from invariants import check_cache, snapshot

    dp_mod = sys.modules["hisparse.cache.device_pool"]
    c = HiSparseCache(_cfg(max_num_reqs=3, device_pool_rows=64 + 3 * 64), kernels="torch")
    for rid in (1, 2, 3):
        c.add_request(rid)
    for rid in (1, 2):
        for layer in range(2):
            c.write(layer, rid, _rows(40, rid))[0]  # one page each, past S = 16
    before = snapshot(c)
    real, calls = dp_mod._seed, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: out of memory")
        return real(*a, **k)

    monkeypatch.setattr(dp_mod, "_seed", failing)
    with pytest.raises(RuntimeError, match="injected"):
        if path == "write":
            c.write(0, c.plan_write([3], [150]), _rows(150, 9))  # 3 pages: both others go
        else:
            c.prepare_step(c.plan_write([3], [150]))
    after = snapshot(c)
    for k in before:
        if k != "hot":  # seeded bytes stay behind in slots nothing maps
            assert str(before[k]) == str(after[k]) if not hasattr(before[k], "shape") else \
                bool((before[k] == after[k]).all()), k
    assert [c.residency(r) for r in (1, 2, 3)] == ["resident"] * 3
    check_cache(c)
