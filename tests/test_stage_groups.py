"""Stage groups: a Full layer's decode top-k computed per group of requests, each group's
rows but the last's staged (an exact prefetch of the layer) while the next group's
indexer runs (CPU; tiny shapes). The model and its outputs are unchanged; only when
the rows are staged moves.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.config import HiSparseConfig
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.tools import mini_engine as me
from hisparse.tools.mini_engine.kv import KV_STORES


def _cfg(**kw):
    base = dict(num_layers=2, num_requests=5, arrival_every=0, min_prompt=20, max_prompt=30,
                min_decode=4, max_decode=7)
    return me.MiniEngineConfig(**{**base, **kw})


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_group_bounds_cover_the_step_in_near_equal_groups(n, groups):
    counts = [2] * n
    b = _cfg(stage_groups=groups).group_bounds(counts)
    assert len(b) == min(groups, n)
    if n:
        assert b[0][0] == 0 and b[-1][1] == 2 * n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        sizes = [(hi - lo) // 2 for lo, hi in b]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_uneven_request_sizes_split_on_request_boundaries():
    assert _cfg(stage_groups=2).group_bounds([3, 1, 2, 2]) == [(0, 4), (4, 8)]


@pytest.mark.parametrize("mode", [None, me.DecodeMode.PADDED])
@pytest.mark.parametrize("overlap", ["serial", "split"])
@pytest.mark.parametrize("groups", [2, 3])
def test_groups_change_when_rows_stage_not_what_is_attended(mode, overlap, groups):
    kw = dict(overlap=overlap, validate=mode is None)
    plain = me.run(_cfg(**kw), decode_mode=mode)
    grouped = me.run(_cfg(stage_groups=groups, **kw), decode_mode=mode)
    for res in (plain, grouped):
        assert res["compare"]["within_tolerance"] and res["hisparse"]["cache"]["invalid"] == 0, res["compare"]
    if overlap == "serial":
        assert grouped["compare"]["bitwise_equal"], grouped["compare"]
    a, b = plain["hisparse"]["cache"], grouped["hisparse"]["cache"]
    # every group but the last staged early: rows the resolve then finds hot; the same
    # rows cross PCIe, and without the prefetched rows the LRU rate is the plain one
    assert a["prefetch_rows"] == 0 and b["prefetch_rows"] > 0
    assert b["bytes_h2d"] == a["bytes_h2d"]
    assert b["misses"] + b["prefetch_rows"] == a["misses"]
    assert b["layer_hit_rates_unprefetched"] == a["layer_hit_rates"]
    assert all(p > 0 for p in b["layer_prefetch_rows"])


def test_the_last_group_is_not_prefetched_and_the_resident_does_not_group(monkeypatch):
    calls = []
    orig = me.Indexer.decode_topk

    def spy(self, layer, iq, *a):
        calls.append(iq.shape[0])
        return orig(self, layer, iq, *a)

    monkeypatch.setattr(me.Indexer, "decode_topk", spy)
    seen = []
    monkeypatch.setattr(KV_STORES["hisparse"], "prefetch_tokens", lambda self, layer, topk, tokens, batch:
                        seen.append((layer, tokens, topk.shape[0])))
    cfg = _cfg(stage_groups=2, num_layers=1, num_requests=4, min_decode=2, max_decode=2)
    me.run_engine(cfg, "resident")
    assert calls and all(n == 4 for n in calls)  # one top-k of the whole step
    calls.clear()
    me.run_engine(cfg, "hisparse")
    assert calls and all(n == 2 for n in calls)  # two groups of two requests
    assert seen and all(s == (0, (0, 2), 2) for s in seen)  # the first group only


def test_multi_token_decode_groups():
    kw = dict(query_len=2, device_buffer_size=32, max_batch_tokens=64)
    plain = me.run(_cfg(**kw))
    grouped = me.run(_cfg(stage_groups=2, **kw))
    assert grouped["compare"]["bitwise_equal"], grouped["compare"]
    assert grouped["hisparse"]["cache"]["bytes_h2d"] == plain["hisparse"]["cache"]["bytes_h2d"]
    assert grouped["hisparse"]["cache"]["prefetch_rows"] > 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_stage_groups(bad):
    with pytest.raises((TypeError, ValueError), match="stage_groups"):
        _cfg(stage_groups=bad)


def test_cli_stage_groups(capsys):
    from hisparse.tools.mini_engine.cli import build_parser, config_from_args
    args = build_parser().parse_args(["--stage-groups", "3"])
    assert config_from_args(args).stage_groups == 3


# ---- the group's prefetch of a token range ------------------------------------
def _group(q: int = 2):
    cfg = HiSparseConfig(num_layers=1, row_bytes=656, top_k=4, device_buffer_size=16, max_num_reqs=4,
                         host_pool_tokens=512, host_block_size=16, device="cpu", max_query_len=q)
    g = HiSparseIndexGroup(cfg, validate=True, kernels="torch")
    g.register_layer(kv_cache_dtype="fp8_ds_mla")
    for r in range(3):
        g.add_request(r)
    md = SparseMLAMetadata.build(request_ids=[0, 1, 2], query_lens=[40] * 3, seq_lens=[40] * 3, num_decodes=0)
    g.prepare_for_batch(md)
    g.write_new_rows(0, torch.randint(0, 120, (120, 656), dtype=torch.uint8), md)
    md = SparseMLAMetadata.build(request_ids=[0, 1, 2], query_lens=[q] * 3, seq_lens=[40 + q] * 3, num_decodes=3)
    g.prepare_for_batch(md, pad_to=4)
    g.write_new_rows(0, torch.randint(0, 120, (4 * q, 656), dtype=torch.uint8), md)
    return g, md


def test_prefetch_of_a_token_range_stages_those_requests_rows():
    g, md = _group()
    before = g.stats()["total"]["prefetch_rows"]
    topk = torch.tensor([[17, 18, 19, -1], [17, 20, -1, -1]], dtype=torch.int32)  # request 1's two tokens
    g.prefetch(0, topk, md, tokens=(2, 4))
    assert g.stats()["total"]["prefetch_rows"] == before + 4  # 17..20: past the 16 hot slots
    g.prefetch(0, torch.full((2, 4), -1, dtype=torch.int32), md, tokens=(6, 8))  # a padding request
    g.prefetch(0, torch.empty((0, 4), dtype=torch.int32), md, tokens=(4, 4))  # an empty range
    assert g.stats()["total"]["prefetch_rows"] == before + 4


@pytest.mark.parametrize("tokens, shape, err, msg", [
    ((1, 4), 3, ValueError, "inside request 0"),
    ((2, 5), 3, ValueError, "inside request 2"),
    ((2, 9), 7, ValueError, r"0 <= a <= b <= 8"),
    ((4, 2), 0, ValueError, r"0 <= a <= b"),
    ([0, 2], 2, TypeError, "tuple"),
    ((0, 2.0), 2, TypeError, "tokens"),
    ((0, 2), 3, ValueError, r"tokens 0..1: 2"),
])
def test_bad_token_ranges_are_refused_before_anything_changes(tokens, shape, err, msg):
    g, md = _group()
    st = g.stats()
    with pytest.raises(err, match=msg):
        g.prefetch(0, torch.full((max(shape, 0), 4), -1, dtype=torch.int32), md, tokens=tokens)
    assert g.stats() == st
