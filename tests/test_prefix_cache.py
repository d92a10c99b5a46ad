"""Prefix caching in ``HiSparseCache`` (``hisparse.cache.prefix``), on CPU with the torch
kernels and the Triton kernels (interpreter): lookup, publishing and sharing.

A randomized churn trace (``prefix_trace.PrefixTrace``: requests of a few prompt
groups, follow-up turns that extend an earlier request's prompt and output, chunked
prefills, decode steps with resolves, frees, resets, refused calls) against a plain
model of the prefix cache, byte-exact; then focused cases: the cap at ``len - 1``,
salts, publishing only when every layer holds a block, publishing at free (multi-turn),
a live writer's blocks found by the next lookup (aliases), two live requests sharing a
block with independent hot state, and rows of a prepared step, a salt without token
ids and a failed commit that publish nothing. Eviction is in
test_prefix_cache_eviction.py; stats, the engine façade and the cache without prefix
caching are in test_prefix_cache_api.py.

Rows are a function of (layer, salt, the token ids up to the position), as a model's
KV would be (``prefix_model.Rows``).
"""

from __future__ import annotations

import pytest
import torch

from prefix_common import B, Req, make, toks
from prefix_model import Rows
from prefix_trace import PrefixTrace


# ---------------------------------------------------------------- the churn trace
TRACE = {
    # K=4, S=8, blocks of 4, 4 requests, a pool of 16 blocks: evictions and refusals
    "K4_B4": dict(top_k=4, device_buffer_size=8, host_block_size=4, max_num_reqs=4, host_pool_tokens=64),
    # K=8, S=16, blocks of 8, 6 requests, 3 layers, 20 blocks
    "K8_B8": dict(num_layers=3, top_k=8, device_buffer_size=16, host_block_size=8, max_num_reqs=6,
                  host_pool_tokens=160, max_request_id=16),
}


def run_trace(cache, seed: int, n_ops: int, **kw) -> tuple[PrefixTrace, dict]:
    t = PrefixTrace(cache, seed, **kw)
    t.check()
    t.run(n_ops)
    counts = dict(t.counts)
    t.finish()
    return t, counts


# aliases: None = the default (one per host block): a second live request that maps a
# cached block gets alias ids, and its misses are staged through host_block; 0: no
# aliases (the second sharer gets fewer cached tokens instead); 2: mapping stops where
# the alias ids run out
@pytest.mark.parametrize("aliases", [None, 0, 2], ids=["aliases", "no_aliases", "2_aliases"])
@pytest.mark.parametrize("shape", sorted(TRACE))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_churn_trace_torch(seed, shape, aliases):
    cache = make(**TRACE[shape], prefix_alias_blocks=aliases)
    _, counts = run_trace(cache, seed, 250)
    assert counts["resolve"] > 20 and counts["add"] > 10, counts


def test_churn_traces_cover_hits_evictions_aliases_and_refusals():
    """Traces of further seeds (as many as it takes, at most 6 of each) together hit,
    evict, map under aliases, run out of alias ids, refuse adds and writes, and reset."""
    need = dict(hit_tokens=50, alias_maps=3, evictions=6, add_refused=1, write_refused=1, reset=1,
                bad_add=1, decode_step=1, give=1, ids_short=1)
    got: dict = {}
    for seed in range(3, 9):
        for shape, aliases in (("K4_B4", None), ("K8_B8", None), ("K4_B4", 2)):
            t, counts = run_trace(make(**TRACE[shape], prefix_alias_blocks=aliases), seed, 200)
            counts["evictions"] = t.model.evictions
            for k in need:
                got[k] = got.get(k, 0) + counts.get(k, 0)
        if all(got[k] >= v for k, v in need.items()):
            return
    raise AssertionError(f"the traces of seeds 3..8 covered {got}, want at least {need}")


@pytest.mark.parametrize("seed", [0, 1])
def test_churn_trace_with_the_elastic_tier(seed):
    """With device pool pages: a request without a hit joins resident, one with a hit
    hot; demotions seed hot buffers from pages (the LRU sim models both)."""
    kw = dict(TRACE["K4_B4"])
    kw["device_pool_rows"] = kw["max_num_reqs"] * (kw["device_buffer_size"] + 1) + 3 * 64
    t, counts = run_trace(make(**kw), seed, 160)
    assert t.sim.spills > 0 and counts["hit_tokens"] > 0, (t.sim.spills, counts)


@pytest.mark.parametrize("aliases", [None, 0], ids=["aliases", "no_aliases"])
def test_churn_trace_triton(aliases):
    cache = make("triton", **TRACE["K4_B4"], prefix_alias_blocks=aliases)
    assert cache.kernels == "triton"
    _, counts = run_trace(cache, 0 if aliases is None else 3, 100)  # seed 0 fails without host_block
    assert counts["hit_tokens"] > 0 and counts["resolve"] > 10, counts  # (seeds that do)
    assert aliases == 0 or counts.get("alias_maps", 0) > 0, counts


# ---------------------------------------------------------------- focused cases
def test_cap_leaves_one_token_to_compute():
    c = make()
    a = Req(c, 0, toks(2 * B))
    assert a.cached == 0
    a.write()
    c.free_request(0)  # both blocks published
    assert c.stats()["total"]["cached_blocks"] == 2
    assert Req(c, 1, toks(2 * B)).cached == B  # exactly whole blocks: the last one is computed
    assert Req(c, 2, toks(2 * B + 1)).cached == 2 * B
    assert Req(c, 3, toks(2 * B - 1)).cached == B
    c.free_request(1), c.free_request(2), c.free_request(3)
    assert Req(c, 4, toks(1)).cached == 0 and Req(c, 5, toks(B + 1)).cached == B
    assert Req(c, 6, []).cached == 0


def test_salt_separates():
    c = make()
    a = Req(c, 0, toks(3 * B), salt=b"model-a")
    a.write()
    c.free_request(0)
    assert Req(c, 1, toks(3 * B)).cached == 0  # no salt
    assert Req(c, 2, toks(3 * B), salt=b"model-b").cached == 0
    d = Req(c, 3, toks(3 * B), salt=b"model-a")
    assert d.cached == 2 * B
    # the rows it maps are the salted writer's, byte-exact (d's rows are model-a's too)
    d.write()
    d.resolve(0, [0, 1, 2 * B])
    d.resolve(1, [B + 3, 2 * B + 1])


def test_block_findable_only_when_every_layer_holds_it():
    c = make(num_layers=2)
    a = Req(c, 0, toks(3 * B))
    a.write(layers=[0])  # layer 0 holds every row, layer 1 none
    assert c.stats()["total"]["cached_blocks"] == 0
    assert Req(c, 1, toks(3 * B)).cached == 0
    c.free_request(1)
    a.write(layers=[1], end=B + 1)  # layer 1: the first block and one row
    assert Req(c, 2, toks(3 * B)).cached == B
    c.free_request(2)
    a.write(layers=[1])
    r3 = Req(c, 3, toks(3 * B + 1))
    assert r3.cached == 3 * B
    r3.write()
    r3.resolve(0, [0, 5, 11, 12])
    r3.resolve(1, [1, 4, 10])
    # and a block whose tokens were not told (no add_tokens) is never published
    c.free_request(3)
    p = Req(c, 4, [], given=False)
    p.rows.extend(toks(2 * B, start=7))
    p.write()
    assert Req(c, 5, toks(2 * B, start=7) + [1]).cached == 0
    c.add_tokens(4, toks(2 * B, start=7))  # now told: the next lookup publishes them
    r6 = Req(c, 6, toks(2 * B, start=7) + [1])
    assert r6.cached == 2 * B
    r6.write()
    r6.resolve(0, [0, 7, 8])
    r6.resolve(1, [3, 4, 8])


@pytest.mark.parametrize("give", [True, False])
def test_multi_turn_hits_the_previous_turn_when_freed(give):
    """Turn 2, a new request, maps turn 1's blocks, its generated tokens included when
    they were told with add_tokens (published when turn 1 is freed)."""
    c = make(max_num_reqs=3)
    prompt = toks(B + 2)
    t1 = Req(c, 0, prompt)
    t1.write()
    t1.decode([7, 8, 9, 10, 11, 12], give=give)  # 12 tokens: 3 whole blocks
    c.free_request(0)
    t2 = Req(c, 1, t1.tokens + [40, 41])
    assert t2.cached == (3 * B if give else B)
    assert c.request(1).seq_len == t2.cached and c.request(1).lengths == (t2.cached,) * 2
    t2.write()
    t2.decode([50])
    for layer in range(2):
        t2.resolve(layer, [0, B + 1, 2 * B + 3, len(t2.tokens) - 1])
    tot = c.stats()["total"]
    assert tot["prefix_hit_tokens"] == t2.cached
    assert tot["prefix_query_tokens"] == len(prompt) + len(t1.tokens) + 2


def test_lookup_publishes_a_live_writer_and_a_second_sharer_needs_an_alias():
    """A live writer's finished blocks are found by the next lookup; mapping them while
    the writer holds their ids takes aliases (none: fewer cached tokens)."""
    for aliases, want in ((None, 2 * B), (0, 0)):
        c = make(prefix_alias_blocks=aliases)
        a = Req(c, 0, toks(2 * B + 3))
        a.write()
        assert c.prefix.index.cached == 0  # lazy: nothing published yet
        b = Req(c, 1, toks(2 * B + 3))
        assert b.cached == want, aliases
        assert c.prefix.index.cached == 2
        ids = c.pool.allocator.blocks(c.request(1).slot)
        NB = c.cfg.num_host_blocks
        assert ids == ([NB, NB + 1] if aliases is None else [])
        if aliases is None:
            assert c.state.host_block[NB:NB + 2].tolist() == [0, 1]
            assert c.stats()["total"]["shared_blocks"] == 2
            assert [c.prefix.index.refs(h) for h in (0, 1)] == [2, 2]


def test_two_sharers_have_independent_hot_state():
    """Two live requests map the same cached blocks (one under aliases): their rows are
    hot at their own row keys, and resolving one leaves the other's LRU state as it was."""
    c = make(device_buffer_size=8, top_k=4)
    w = Req(c, 0, toks(4 * B + 1))
    w.write()
    c.free_request(0)  # 4 blocks cached
    x = Req(c, 1, toks(4 * B + 2))
    y = Req(c, 2, toks(4 * B + 3))
    assert x.cached == y.cached == 4 * B
    NB = c.cfg.num_host_blocks
    alloc = c.pool.allocator
    rx, ry = c.request(1).slot, c.request(2).slot
    assert alloc.blocks(rx) == [0, 1, 2, 3] and alloc.blocks(ry) == [NB, NB + 1, NB + 2, NB + 3]
    assert alloc.host_blocks(ry).tolist() == [0, 1, 2, 3]
    x.write(), y.write()
    st = c.state
    for layer in range(2):
        before_y = (st.slot_pos[layer, ry].clone(), st.slot_stamp[layer, ry].clone(), int(st.step[layer, ry]))
        px = x.resolve(layer, [0, 5, 9, 14])  # misses: cached rows staged from host block 0..3
        # x's rows are hot at x's row keys (its own ids), none at y's (the aliases)
        for p, phys in zip([0, 5, 9, 14], px):
            assert int(st.row_slot[layer, p]) == phys - rx * c.cfg.slots_per_req
            assert int(st.row_slot[layer, NB * B + p]) == -1
        after_y = (st.slot_pos[layer, ry], st.slot_stamp[layer, ry], int(st.step[layer, ry]))
        assert torch.equal(before_y[0], after_y[0]) and torch.equal(before_y[1], after_y[1])
        assert before_y[2] == after_y[2]
        before_x = (st.slot_pos[layer, rx].clone(), st.slot_stamp[layer, rx].clone())
        py = y.resolve(layer, [0, 5, 10, 15])
        for p, phys in zip([0, 5, 10, 15], py):
            assert int(st.row_slot[layer, NB * B + p]) == phys - ry * c.cfg.slots_per_req
        assert int(st.row_slot[layer, 10]) == -1  # x never asked for position 10
        assert torch.equal(before_x[0], st.slot_pos[layer, rx]) and torch.equal(before_x[1], st.slot_stamp[layer, rx])
    # freeing x clears its row keys only; y still reads its rows
    c.free_request(1)
    assert (st.row_slot[:, :4 * B] == -1).all()
    assert (st.row_slot[:, NB * B:(NB + 4) * B] >= 0).sum() > 0
    y.resolve(0, [0, 5, 10, 15])
    y.resolve(1, [1, 2, 3, 16])
    assert [c.prefix.index.refs(h) for h in range(4)] == [1, 1, 1, 1]


# ---------------------------------------------------------------- found by review
def test_rows_of_a_prepared_step_not_written_are_never_published():
    """A prepared step counts its rows in the lengths before any layer is written; a free
    (allowed between prepare and the first write), stats() or a lookup in between must
    not publish those blocks, and an abandoned step leaves nothing findable."""
    c = make()
    Req(c, 0, toks(2 * B + 1))
    step = c.prepare_step(c.plan_write([0], [2 * B + 1]))  # lengths count 9 rows, none written
    c.stats()
    c.free_request(0)
    assert c.prefix.index.cached == 0 and step.pending
    b = Req(c, 1, toks(2 * B + 1))
    assert b.cached == 0
    b.write()
    b.resolve(0, [0, 1, B])  # its own rows, byte-exact
    c2 = make()
    Req(c2, 0, toks(2 * B + 1))
    step = c2.prepare_step(c2.plan_write([0], [2 * B + 1]))
    c2.stats()
    step.abandon()
    assert Req(c2, 1, toks(2 * B + 1)).cached == 0
    # once every layer is written, the blocks are published
    c3 = make()
    Req(c3, 0, toks(2 * B + 1))
    step = c3.prepare_step(c3.plan_write([0], [2 * B + 1]))
    w = Req.__new__(Req)
    w.rows = Rows(None, c3.cfg.num_layers, c3.cfg.row_bytes)
    w.rows.extend(toks(2 * B + 1))
    for layer in range(c3.cfg.num_layers):
        c3.write_step(layer, step, w.rows.get(layer, 0, 2 * B + 1))
    assert Req(c3, 1, toks(2 * B + 1)).cached == 2 * B


def test_a_salt_given_without_token_ids_names_the_later_tokens():
    c = make()
    a = Req(c, 0, [], salt=b"tenant-a", given=False)
    c.free_request(0)
    c.add_request(0, salt=b"tenant-a")
    a.rows.extend(toks(2 * B))
    a.write()
    c.add_tokens(0, toks(2 * B))
    c.free_request(0)
    assert c.add_request(1, toks(2 * B + 1)) == 0  # unsalted: another tenant
    assert c.add_request(2, toks(2 * B + 1), b"tenant-a") == 2 * B


def test_a_failed_commit_of_reserved_blocks_publishes_nothing():
    """P/D: reserve (no token ids), the prompt told by add_tokens, the commit's step
    prepared, its write fails and the request is freed: every reserved block goes back
    to the free list (the receiver quarantines what free_request returns)."""
    c = make()
    c.add_request(0)
    got = c.writer.allocate_for(c.request(0).slot, 2 * B + 1)
    c.add_tokens(0, toks(2 * B + 1))
    step = c.prepare_step(c.plan_write([0], [2 * B + 1]), host_written=True)  # noqa: F841 (held, as the receiver does)
    freed = []
    c.free_listeners.append(lambda rid, r, blocks: freed.extend(blocks))
    c.free_request(0)
    assert sorted(freed) == sorted(got) and c.prefix.index.cached == 0
