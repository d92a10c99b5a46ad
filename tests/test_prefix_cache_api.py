"""Prefix caching on CPU as other code sees it (helpers: ``prefix_common``).

Stats and metrics, the engine façade (``HiSparseIndexGroup.add_request`` returning
cached tokens), the cache without prefix caching (token ids refused, its device tables
and sizes), the names blocks are published under (``block_names``), and the stress
tool's prefetch counts for a request sharing cached blocks.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.prefix_index import block_names
from hisparse.cache.state import HotState

from invariants import _cpu_state
from prefix_common import B, Req, make, toks
from prefix_model import Rows


def test_stats_and_metrics():
    from hisparse.metrics import format_text

    c = make()
    keys = ("prefix_query_tokens", "prefix_hit_tokens", "cached_blocks", "shared_blocks", "prefix_evictions")
    assert {k: c.stats()["total"][k] for k in keys} == dict.fromkeys(keys, 0)
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    b = Req(c, 1, toks(2 * B + 3))
    tot = c.stats()["total"]
    assert {k: tot[k] for k in keys} == dict(prefix_query_tokens=4 * B + 4, prefix_hit_tokens=2 * B,
                                             cached_blocks=2, shared_blocks=2, prefix_evictions=0)
    assert b.cached == 2 * B
    text = format_text(c.stats())
    for name in ("hisparse_prefix_query_tokens", "hisparse_prefix_hit_tokens", "hisparse_prefix_cached_blocks",
                 "hisparse_prefix_shared_blocks", "hisparse_prefix_evictions"):
        assert name in text, name
    assert "hisparse_prefix_cached_blocks 2" in text
    # stats publishes a live request's finished blocks too
    d = Req(c, 2, toks(B + 1, start=300))
    d.write()
    assert c.stats()["total"]["cached_blocks"] == 3
    plain = HiSparseCache(HiSparseConfig(num_layers=1, host_pool_tokens=16, row_bytes=16, top_k=2,
                                         max_num_reqs=2, host_block_size=4, device="cpu"), kernels="torch")
    assert {k: plain.stats()["total"][k] for k in keys} == dict.fromkeys(keys, 0)


def test_engine_group_add_request_returns_cached_tokens():
    from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata

    cfg = HiSparseConfig(num_layers=2, row_bytes=656, top_k=4, device_buffer_size=8, max_num_reqs=3,
                         host_block_size=B, host_pool_tokens=3 * 48, max_request_id=16, device="cpu",
                         prefix_caching=True)
    g = HiSparseIndexGroup(cfg)
    for _ in range(2):
        g.register_layer(kv_cache_dtype="fp8_ds_mla")
    rows = {}

    def forward(rid, n0, n1, decode):
        md = SparseMLAMetadata.build(request_ids=[rid], query_lens=[n1 - n0], seq_lens=[n1],
                                     num_decodes=1 if decode else 0, device="cpu")
        g.prepare_for_batch(md)
        for layer in range(2):
            g.write_new_rows(layer, rows[rid].get(layer, n0, n1), md)
        return md

    prompt = toks(3 * B + 2)
    assert g.add_request(1, prompt) == 0
    rows[1] = Rows(None, 2, 656)
    rows[1].extend(prompt)
    forward(1, 0, len(prompt), False)
    rows[1].extend([9])
    forward(1, len(prompt), len(prompt) + 1, True)
    assert g.add_tokens(1, [9]) == len(prompt) + 1
    g.free_request(1)
    turn2 = prompt + [9, 10, 11]
    assert g.add_request(2, turn2) == 3 * B
    rows[2] = Rows(None, 2, 656)
    rows[2].extend(turn2 + [12])
    forward(2, 3 * B, len(turn2), False)
    md = forward(2, len(turn2), len(turn2) + 1, True)
    for layer in range(2):
        topk = torch.tensor([[0, 5, 3 * B + 1, len(turn2)]], dtype=torch.int32)
        phys, counts = g.convert_decode_logical_to_physical_topk(layer, topk, md, return_valid_counts=True)
        assert counts.tolist() == [4]
        hot = g.physical_kv_cache(layer)
        for p, x in zip(topk[0].tolist(), phys[0].tolist()):
            assert torch.equal(hot[x], rows[2].get(layer, p, p + 1)[0]), (layer, p)
    assert g.stats()["total"]["prefix_hit_tokens"] == 3 * B
    g.free_request(2)
    assert g.reset_prefix_cache() == 4


def test_token_ids_need_prefix_caching():
    c = HiSparseCache(HiSparseConfig(num_layers=1, host_pool_tokens=16, row_bytes=16, top_k=2,
                                     max_num_reqs=2, host_block_size=4, device="cpu"), kernels="torch")
    assert c.prefix is None
    with pytest.raises(ValueError, match="prefix_caching"):
        c.add_request(0, [1, 2, 3])
    with pytest.raises(ValueError, match="prefix_caching"):
        c.add_request(0, salt=b"x")
    assert c.live_requests() == []
    assert c.add_request(0) == 0
    with pytest.raises(ValueError, match="prefix_caching"):
        c.add_tokens(0, [1])
    assert c.reset_prefix_cache() == 0
    with pytest.raises(ValueError, match="prefix_alias_blocks"):
        HiSparseConfig(num_layers=1, host_pool_tokens=64, prefix_alias_blocks=4, device="cpu")


def _state_bytes(st: HotState) -> int:
    return sum(t.numel() * t.element_size() for t in vars(st).values() if isinstance(t, torch.Tensor))


def test_default_config_keeps_its_device_tables():
    """Without prefix caching: no alias ids, row_slot indexed by host row, and
    device_bytes what the state tensors take (the old sizes plus the 4 x NB bytes of
    the host_block map)."""
    kw = dict(num_layers=3, host_pool_tokens=40 * B, row_bytes=32, top_k=4, max_num_reqs=3,
              host_block_size=B, max_request_id=64, device="cpu")
    cfg = HiSparseConfig(**kw)
    assert cfg.prefix_alias_blocks == 0 and not cfg.prefix_caching
    assert cfg.num_virtual_blocks == cfg.num_host_blocks and cfg.num_virtual_rows == cfg.num_host_rows
    c = HiSparseCache(cfg, kernels="torch")
    L, H, NB, R, SP = 3, cfg.num_host_rows, cfg.num_host_blocks, 3, cfg.slots_per_req
    assert tuple(c.state.row_slot.shape) == (L, H)
    assert c.state.host_block.tolist() == list(range(NB))
    db = cfg.device_bytes()
    assert db["state"] == _state_bytes(c.state)
    old_state = (4 * 64 + 4 * L * R + 4 * R * NB + 12 * L * R * SP + 4 * L * H + 8 * L * R + 8 * L * 7
                 + 4 * R * (1 + max(1, cfg.max_pages_per_request)))  # before prefix caching
    assert db["state"] == old_state + 4 * NB
    # with prefix caching: one alias per host block by default, row_slot over every id
    pc = HiSparseConfig(**kw, prefix_caching=True)
    assert pc.prefix_alias_blocks == NB and pc.num_virtual_rows == 2 * H
    cp = HiSparseCache(pc, kernels="torch")
    assert tuple(cp.state.row_slot.shape) == (L, 2 * H)
    assert pc.device_bytes()["state"] == _state_bytes(cp.state) == db["state"] + 4 * L * H + 4 * NB
    assert pc.device_bytes()["hot_rows"] == db["hot_rows"]
    assert HiSparseConfig(**kw, prefix_caching=True, prefix_alias_blocks=0).device_bytes() == db


def test_block_names_are_the_caches():
    """The names a request's blocks are published under are ``block_names`` of its
    tokens (salted), whether told at admission or later with add_tokens."""
    c = make()
    a = Req(c, 0, toks(B + 1), salt=b"s")
    a.write()
    a.decode(toks(B, start=9))
    c.stats()  # publishes
    names = block_names(a.tokens[:2 * B], B, salt=b"s")
    assert [c.prefix.index.lookup(names)] == [c.pool.allocator.blocks(c.request(0).slot)[:2]]
    assert _cpu_state(c)["seq_lens"][:, 0].tolist() == [2 * B + 1] * 2


# ---------------------------------------------------------------- found by review
def test_stress_prefetch_counts_by_row_key_for_sharers():
    """The stress tool's prefetch figures look rows up by row key: a sharer's aliases, not
    the writer's host rows."""
    from hisparse_tools.stress_prefetch import selected_hot, selected_rows
    c = make(row_bytes=656)  # a row format, as the stress run's caches have (selected_hot reads layer_view)
    w = Req(c, 0, toks(2 * B + 1))
    w.write()
    m = Req(c, 1, toks(2 * B + 1))
    assert m.cached == 2 * B
    m.write()
    w.resolve(0, [0, 1, 2, 3])  # the writer's rows hot, the sharer's not
    hot = selected_hot(c, 0, selected_rows(c, [1], torch.tensor([[0, 1, 2, 3]])))
    assert hot.tolist() == [False] * 4


def test_stress_prefetch_counts_a_sharers_staged_rows():
    """``hisparse stress --prefetch``'s count: a prefetch stages host rows (``stage_src``), so
    a sharer mapping cached blocks under alias ids has its staged rows matched against
    the host rows of its selection, and all of them count as useful."""
    from hisparse_tools.stress_prefetch import prefetch_useful, selected_host_rows
    c = make()
    w = Req(c, 0, toks(2 * B + 1))
    w.write()
    m = Req(c, 1, toks(2 * B + 1))  # maps request 0's two cached blocks under alias ids
    assert m.cached == 2 * B
    assert all(v >= c.pool.allocator.num_blocks for v in c.pool.allocator.owned(c.request(1).slot)[:2])
    m.write()
    topk = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    rows = selected_host_rows(c, [1], topk)  # the next layer selects exactly these rows
    out = c.prefetch(1, torch.tensor([1], dtype=torch.int32), topk)
    assert prefetch_useful(out, c.cfg.top_k, rows) == (4, 4)
