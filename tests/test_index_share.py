"""IndexCache-style index sharing in the mini engine, and the prefetch it makes exact (CPU).

With ``index_share=n`` only layers l % n == 0 (Full) run an indexer; the layers after
one reuse its top-k (Shared). With ``prefetch`` hisparse stages a Shared layer's rows
from that top-k while the layer before it computes, so its own resolve finds them hot.
Tiny shapes (4-5 layers, hidden 64, top-k 8, 16 hot rows).
"""

from __future__ import annotations

import pytest
import torch

from hisparse_tools import mini_engine as me
from hisparse_tools.mini_engine.kv import KVStore


def _cfg(**kw):
    base = dict(num_layers=4, index_share=2, num_requests=3, arrival_every=1, min_prompt=20, max_prompt=30,
                min_decode=4, max_decode=7)
    return me.MiniEngineConfig(**{**base, **kw})


def test_full_layers_and_indexer_keys():
    cfg = _cfg(num_layers=5)
    assert [cfg.full_layer(i) for i in range(5)] == [True, False, True, False, True]
    assert cfg.index_layers == 3
    ix = me.Indexer(cfg, cfg.slots, torch.device("cpu"))
    assert ix.keys.shape[0] == 3
    with pytest.raises(ValueError, match="Shared layer"):
        ix.write(1, torch.zeros(1, cfg.indexer_dim), torch.zeros(1, dtype=torch.int64))
    host, _ = me.memory_needed(cfg)
    one, _ = me.memory_needed(_cfg(num_layers=5, index_share=1))
    assert host["indexer keys"] * 5 == one["indexer keys"] * 3
    m = me.Model(cfg, torch.device("cpu"))
    x = torch.randn(2, cfg.hidden)
    assert m.pre(1, x, True)[2:] == (None, None) and m.pre(2, x, True)[2].shape == (2, cfg.indexer_dim)


def test_shared_layers_attend_over_the_full_layers_selection(monkeypatch):
    seen: dict[int, list[torch.Tensor]] = {}
    orig = KVStore.decode_attention

    def spy(self, layer, q, topk, batch, staged):
        if self.name == "resident":
            seen.setdefault(layer, []).append(topk.clone())
        return orig(self, layer, q, topk, batch, staged)

    monkeypatch.setattr(KVStore, "decode_attention", spy)
    res = me.run(_cfg())
    assert res["compare"]["bitwise_equal"], res["compare"]
    for full, shared in ((0, 1), (2, 3)):
        assert len(seen[full]) == len(seen[shared]) > 0
        for a, b in zip(seen[full], seen[shared]):
            assert torch.equal(a, b)
    # the two Full layers draw different indexers: their selections differ somewhere
    assert any(not torch.equal(a, b) for a, b in zip(seen[0], seen[2]))


@pytest.mark.parametrize("mode", [None, me.DecodeMode.PADDED])
@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_prefetch_into_shared_layers_matches_and_leaves_at_most_the_displaced_row(mode, overlap):
    kw = dict(overlap=overlap, validate=mode is None)
    plain = me.run(_cfg(**kw), decode_mode=mode)
    pre = me.run(_cfg(prefetch=True, **kw), decode_mode=mode)
    for res in (plain, pre):
        assert res["compare"]["within_tolerance"] and res["hisparse"]["cache"]["invalid"] == 0, res["compare"]
    eng = me.MiniEngine(_cfg(prefetch=True, **kw), "hisparse", decode_mode=mode)
    stats = eng.run()["stats"]["layers"]
    assert [s["prefetch_rows"] > 0 for s in stats] == [False, True, False, True]  # into Shared layers only
    for i in (1, 3):
        # the prefetch staged everything the layer's resolve would miss, except the row
        # its own write then moved out of the reserved slot (the previous newest row):
        # at most one miss per resolve of a decode token (q = 1)
        assert stats[i]["misses"] <= stats[i]["resolves"], stats[i]
        assert stats[i]["misses"] < stats[i - 1]["misses"], stats
    cache_plain, cache_pre = plain["hisparse"]["cache"], pre["hisparse"]["cache"]
    assert cache_pre["prefetch_rows"] > 0 and cache_plain["prefetch_rows"] == 0
    assert cache_pre["misses"] < cache_plain["misses"]
    assert cache_pre["layer_hit_rates"][1] > cache_plain["layer_hit_rates"][1]


def test_prefetch_with_correlated_indexers_predicts_every_next_layer():
    eng = me.MiniEngine(_cfg(index_share=1, index_correlation=0.9, prefetch=True), "hisparse")
    res = eng.run()
    assert [s["prefetch_rows"] > 0 for s in res["stats"]["layers"]] == [False, True, True, True]


def test_prefetch_into_no_layer_is_refused():
    with pytest.raises(ValueError, match="prefetch would stage into no layer"):
        _cfg(index_share=1, prefetch=True)
    with pytest.raises(ValueError, match="prefetch would stage into no layer"):
        _cfg(num_layers=1, index_share=2, prefetch=True)


@pytest.mark.parametrize("kw", [dict(num_layers=5, index_share=2), dict(num_layers=3, index_share=8),
                                dict(num_layers=4, index_share=2, query_len=2, device_buffer_size=16,
                                     max_batch_tokens=64)])
def test_index_share_edge_layouts(kw):
    """A last group shorter than index_share, one Full layer for all, two decode tokens
    per request: the same outputs as resident, Shared layers prefetched into."""
    cfg = _cfg(prefetch=True, **kw)
    res = me.run(cfg)
    assert res["compare"]["bitwise_equal"], res["compare"]
    pf = res["hisparse"]["cache"]["layer_prefetch_rows"]
    assert [p > 0 for p in pf] == [not cfg.full_layer(i) for i in range(cfg.num_layers)], pf


def test_shared_layers_attend_prefill_over_the_full_layers_positions(monkeypatch):
    """Prefill chunks of a Shared layer attend over the Full layer's workspace offsets, and
    the workspace rows they read are the Shared layer's own (staged for that layer)."""
    seen: dict[int, list] = {}
    orig = KVStore.prefill_attention

    def spy(self, layer, q, idx, batch):
        out = orig(self, layer, q, idx, batch)
        if self.name == "resident":
            rows = self.attn.workspace[idx.clamp(min=0).long()].clone()
            seen.setdefault(layer, []).append((idx.clone(), rows))
        return out

    monkeypatch.setattr(KVStore, "prefill_attention", spy)
    res = me.run(_cfg())
    assert res["compare"]["bitwise_equal"]
    for full, shared in ((0, 1), (2, 3)):
        assert len(seen[full]) == len(seen[shared]) > 0
        for (ia, ra), (ib, rb) in zip(seen[full], seen[shared]):
            assert torch.equal(ia, ib)
            assert not torch.equal(ra, rb)  # another layer's rows at the same offsets


@pytest.mark.parametrize("kw, msg", [
    (dict(index_share=0), "index_share"),
    (dict(index_share=True), "index_share"),
])
def test_bad_index_share(kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        me.MiniEngineConfig(**kw)


def test_graphs_accept_prefetch():  # capture and replay: tests/test_mini_engine_graphs_gpu.py
    cfg = me.MiniEngineConfig(graphs=True, device="cuda", validate=False, prefetch=True, index_share=2,
                              num_layers=4)
    assert cfg.prefetch and cfg.graphs


def test_cli_index_share(capsys):
    assert me.main(["--index-share", "0"]) == 2
    assert "--index-share must be >= 1" in capsys.readouterr().err
    assert me.main(["--index-share", "2", "--layers", "4", "--prefetch", "--requests", "2",
                    "--max-decode", "3"]) == 0
    out = capsys.readouterr().out
    assert "prefetched rows" in out and "bitwise equal" in out


def test_index_correlation_mixes_only_the_indexers_and_makes_layers_overlap():
    base = _cfg(index_share=1, num_layers=3, top_k=16, min_prompt=200, max_prompt=200, synthetic_context=180,
                device_buffer_size=32, chunk=32, validate=False)
    m0 = me.Model(base, torch.device("cpu"))
    import dataclasses
    corr = dataclasses.replace(base, index_correlation=0.99)
    m1 = me.Model(corr, torch.device("cpu"))
    for name in ("w_q", "w_kv", "w_o", "w_out", "embed"):
        assert torch.equal(getattr(m0, name), getattr(m1, name)), name
    assert not torch.equal(m0.w_iq, m1.w_iq)
    r0, k0 = me.synthetic_rows(base, 1, 0, 50, torch.device("cpu"))
    r1, k1 = me.synthetic_rows(corr, 1, 0, 50, torch.device("cpu"))
    assert torch.equal(r0, r1) and not torch.equal(k0, k1)  # rows as before, keys mixed
    ov0, ov1 = me.adjacent_layer_overlap(base), me.adjacent_layer_overlap(corr)
    assert len(ov0) == len(ov1) == 2
    assert min(ov1) > max(ov0) + 0.2, (ov0, ov1)
    with pytest.raises(ValueError, match="index_correlation"):
        dataclasses.replace(base, index_correlation=1.0)
    with pytest.raises(ValueError, match="query_len must be 1"):
        me.adjacent_layer_overlap(dataclasses.replace(base, query_len=2, max_batch_tokens=64))


def test_prefetch_targets():
    def targets(**kw):
        kv = me.MiniEngine(_cfg(num_layers=6, prefetch=True, **kw), "hisparse").kv
        return [kv.prefetch_targets(i) for i in range(6)]
    assert targets(index_share=1, index_correlation=0.5) == [True] * 5 + [False]
    assert targets(index_share=3) == [True, True, False, True, True, False]  # not into independent Full layers
    assert targets(index_share=3, index_correlation=0.9) == [True] * 5 + [False]
    kv = me.MiniEngine(_cfg(num_layers=6, index_share=3), "hisparse").kv
    assert not any(kv.prefetch_targets(i) for i in range(6))


def test_recorder_adjacent_overlap():
    from hisparse_tools.traces import TraceRecorder
    rec = TraceRecorder(num_layers=3, top_k=4)
    rec.begin_step([0, 1], [10, 10])
    rec.add_layer(0, torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1]], dtype=torch.int32))
    rec.add_layer(1, torch.tensor([[4, 3, 9, 8], [6, 7, 5, -1]], dtype=torch.int32))
    rec.add_layer(2, torch.tensor([[-1, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32))
    assert rec.adjacent_overlap() == [(2 + 2) / 7, None]
