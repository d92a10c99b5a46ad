"""Prefix caching in ``HiSparseCache`` (``hisparse.cache.prefix``), on CPU with the torch
kernels and the Triton kernels (interpreter).

A randomized churn trace (``prefix_trace.PrefixTrace``: requests of a few prompt
groups, follow-up turns that extend an earlier request's prompt and output, chunked
prefills, decode steps with resolves, frees, resets, refused calls) against a plain
model of the prefix cache, byte-exact; then focused cases: the cap at ``len - 1``,
salts, publishing only when every layer holds a block, publishing at free (multi-turn),
LRU eviction of unreferenced blocks only, admission counting evictable blocks as free,
a batched write that evicts, two live requests sharing a block with independent hot
state, stats / metrics, the engine façade, and the cache without prefix caching.

Rows are a function of (layer, salt, the token ids up to the position), as a model's
KV would be (``prefix_model.Rows``).
"""

from __future__ import annotations

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.prefix_index import block_names
from hisparse.cache.state import HotState

from invariants import _cpu_state, assert_same
from prefix_model import Rows
from prefix_trace import PrefixTrace, prefix_snapshot

B = 4


def make(kernels="torch", **kw) -> HiSparseCache:
    base = dict(num_layers=2, row_bytes=64, top_k=4, device_buffer_size=8, host_block_size=B,
                max_num_reqs=4, host_pool_tokens=B * 20, max_request_id=12, device="cpu",
                prefix_caching=True)
    base.update(kw)
    return HiSparseCache(HiSparseConfig(**base), kernels=kernels)


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


# ---------------------------------------------------------------- helpers
class Req:
    """A request of the focused tests: its tokens and rows (``prefix_model.Rows``)."""

    def __init__(self, cache, rid, tokens, salt=None, given=True):
        self.cache, self.rid, self.salt = cache, rid, salt
        self.rows = Rows(salt, cache.cfg.num_layers, cache.cfg.row_bytes)
        self.rows.extend(tokens)
        self.cached = cache.add_request(rid, list(tokens), salt) if given else cache.add_request(rid)

    @property
    def tokens(self):
        return self.rows.tokens

    def write(self, layers=None, end=None):
        """Write the rows each layer lacks up to ``end`` (default: every token)."""
        c = self.cache
        end = len(self.tokens) if end is None else end
        for l in (range(c.cfg.num_layers) if layers is None else layers):
            p0 = c.request(self.rid).lengths[l]
            if p0 < end:
                assert c.write(l, self.rid, self.rows.get(l, p0, end))[0] == p0

    def decode(self, tokens, give=True):
        for t in tokens:
            self.rows.extend([t])
            self.write()
        if give:
            self.cache.add_tokens(self.rid, list(tokens))

    def resolve(self, layer, positions):
        """Resolve ``positions`` (padded to top_k) and check every row byte-exact;
        returns the physical rows."""
        c = self.cache
        K = c.cfg.top_k
        row = list(positions) + [-1] * (K - len(positions))
        res = c.resolve(layer, torch.tensor([self.rid], dtype=torch.int32), torch.tensor([row], dtype=torch.int32))
        phys = res.physical[0].tolist()[:len(positions)]
        for p, x in zip(positions, phys):
            assert torch.equal(c.hot[layer, x], self.rows.get(layer, p, p + 1)[0]), (self.rid, layer, p, x)
        return phys


def toks(n, start=100):
    return list(range(start, start + n))


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


def test_eviction_is_lru_and_only_of_unreferenced_blocks():
    c = make(host_pool_tokens=10 * B, max_num_reqs=4)  # 10 blocks
    ix, alloc = c.prefix.index, c.pool.allocator
    reqs = []
    for i in range(3):  # three 2-block prompts, freed in order 2, 0, 1
        r = Req(c, i, toks(2 * B + 1, start=1000 * (i + 1)))
        r.write()
        reqs.append(r)
    blocks = {i: alloc.blocks(c.request(i).slot)[:2] for i in range(3)}
    for i in (2, 0, 1):
        c.free_request(i)
    assert ix.cached == 6 and ix.evictable == 6
    # least recently released first; a request's own blocks tail first (a head evicted
    # first would leave the rest of its chain unreachable)
    rev = {i: blocks[i][::-1] for i in blocks}
    assert ix.peek_evict(6) == rev[2] + rev[0] + rev[1]
    # request 0's prompt again: its blocks are referenced (not evictable) and move out of the LRU
    again = Req(c, 3, toks(2 * B + 1, start=1000))
    assert again.cached == 2 * B and ix.evictable == 4
    # a fresh request needs 7 blocks: the 4 free, then evicts the 3 least recently released
    # unreferenced ones
    n = Req(c, 4, toks(6 * B + 1, start=5))
    assert len(alloc._free) == 4
    free_before = sorted(alloc._free)
    n.write()
    got = alloc.blocks(c.request(4).slot)
    assert got == free_before + rev[2] + rev[1][:1]
    assert ix.evictions == 3 and ix.cached == 3
    assert all(ix.holds(b) for b in blocks[0]) and ix.holds(blocks[1][0])
    assert c.stats()["total"]["prefix_evictions"] == 3
    # request 2's prompt is gone; request 1 keeps its first block (the tail went first)
    assert Req(c, 5, toks(2 * B + 1, start=3000)).cached == 0
    c.free_request(5)
    assert Req(c, 6, toks(2 * B + 1, start=2000)).cached == B
    c.free_request(6)
    again.write()
    again.resolve(0, [0, 1, 7, 8])
    assert all(ix.refs(b) == 1 for b in blocks[0])


def test_admission_counts_evictable_blocks_as_free():
    c = make(host_pool_tokens=6 * B, max_num_reqs=3)  # 6 blocks
    alloc, ix = c.pool.allocator, c.prefix.index
    a = Req(c, 0, toks(4 * B + 1))
    a.write()  # 5 blocks
    c.free_request(0)  # 4 cached (evictable) + 1 free -> 2 free
    assert (alloc.num_used, alloc.num_free, ix.evictable) == (4, 6, 4)
    assert c.stats()["host_pool"]["blocks_used"] == 4
    b = Req(c, 1, toks(3 * B, start=9))
    b.write()  # 3 blocks: 2 free + 1 evicted
    assert ix.evictions == 1 and alloc.num_free == 3
    # 4 more blocks than exist free + evictable: refused, nothing changed
    d = Req(c, 2, toks(4 * B, start=50))
    before = prefix_snapshot(c)
    with pytest.raises(CapacityError):
        c.write(0, 2, d.rows.get(0, 0, 4 * B))
    with pytest.raises(CapacityError):
        c.prepare_step(c.plan_write([1, 2], [1, 3 * B + 1]))
    with pytest.raises(CapacityError):
        c.writer.allocate_for(c.request(2).slot, 4 * B)
    assert_same(before, prefix_snapshot(c))
    # exactly free + evictable: succeeds, evicting every cached block
    d.write(end=3 * B)
    assert ix.evictions == 4 and alloc.num_free == 0 and ix.evictable == 0
    assert ix.cached == 3 and [ix.refs(h) for h in alloc.blocks(c.request(1).slot)] == [1, 1, 1]  # b's, published by d's lookup
    d.resolve(0, [0, 5, 11])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_batched_write_that_evicts_gets_the_blocks_it_planned(kernels):
    """A batch whose requests together need evictions: the write plans with ``peek`` of
    the whole batch and allocates request by request; both must agree (a regression:
    the first request used to be handed a free block while the plan had given it an
    evicted one of lower id)."""
    c = make(kernels, host_pool_tokens=4 * B, num_layers=1)  # 4 blocks
    alloc = c.pool.allocator
    a = Req(c, 0, toks(B + 1))
    a.write()  # blocks 0 (published at free), 1
    o = Req(c, 1, toks(B, start=70), given=False)
    o.write()  # block 2
    c.free_request(0)
    assert sorted(alloc._free) == [1, 3] and c.prefix.index.peek_evict(1) == [0]
    n = Req(c, 2, toks(2 * B, start=90), given=False)
    o.rows.extend([5])
    rows = torch.cat([o.rows.get(0, B, B + 1), n.rows.get(0, 0, 2 * B)])
    assert alloc.peek(3) == [1, 3, 0]
    assert c.write(0, c.plan_write([1, 2], [1, 2 * B]), rows) == [B, 0]
    assert alloc.blocks(c.request(1).slot) == [2, 1] and alloc.blocks(c.request(2).slot) == [3, 0]
    assert c.prefix.index.evictions == 1
    o.resolve(0, [0, B])
    n.resolve(0, [0, 3, 4, 7])
    # the same through a prepared step (an engine's forward)
    c2 = make(kernels, host_pool_tokens=4 * B, num_layers=1)
    a = Req(c2, 0, toks(B + 1))
    a.write()
    o = Req(c2, 1, toks(B, start=70), given=False)
    o.write()
    c2.free_request(0)
    n = Req(c2, 2, toks(2 * B, start=90), given=False)
    o.rows.extend([5])
    step = c2.prepare_step(c2.plan_write([1, 2], [1, 2 * B]))
    c2.write_step(0, step, torch.cat([o.rows.get(0, B, B + 1), n.rows.get(0, 0, 2 * B)]))
    assert c2.pool.allocator.blocks(c2.request(1).slot) == [2, 1] and c2.pool.allocator.blocks(c2.request(2).slot) == [3, 0]
    n.resolve(0, [0, 7])


def test_reset_prefix_cache_drops_unreferenced_blocks_only():
    c = make()
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    b = Req(c, 1, toks(3 * B + 1, start=500))
    b.write()
    c.free_request(0)
    used = c.pool.allocator.num_used
    assert c.prefix.index.evictable == 2
    assert c.reset_prefix_cache() == 2
    assert c.pool.allocator.num_used == used - 2 and c.prefix.index.cached == 0
    assert c.prefix.index.evictions == 0  # a reset is not an eviction
    assert Req(c, 2, toks(2 * B + 1)).cached == 0
    # request 1's blocks, published by this lookup, are referenced: a reset keeps them
    assert Req(c, 3, toks(3 * B + 1, start=500)).cached == 3 * B
    assert c.reset_prefix_cache() == 0
    for rid in (1, 2, 3):
        c.free_request(rid)
    assert c.reset_prefix_cache() == 3
    assert c.pool.allocator.num_used == 0 and (c.state.row_slot == -1).all()


def test_failed_add_request_changes_nothing():
    c = make(max_num_reqs=2)
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    before = prefix_snapshot(c)
    for bad in ([1, -1], [2**32], [[1, 2]], [0.5], "abc"):
        with pytest.raises(ValueError):
            c.add_request(1, bad)
    with pytest.raises(TypeError):
        c.add_request(1, [1, 2], salt="str")
    with pytest.raises(ValueError, match="already live"):
        c.add_request(0, toks(2 * B + 1))
    assert_same(before, prefix_snapshot(c))
    Req(c, 1, [3])
    before = prefix_snapshot(c)
    with pytest.raises(CapacityError, match="request slots"):
        c.add_request(2, toks(2 * B + 1))  # would publish and hit: refused first
    assert_same(before, prefix_snapshot(c))
    assert c.prefix.index.cached == 0


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


def test_a_write_that_evicts_drops_the_blocks_before_its_launches():
    """Cached blocks a write takes leave the index before the write launches, so a launch
    that fails part way (after the host mirror overwrote their rows) leaves none of them
    findable; the blocks are free for the next allocation."""
    c = make(host_pool_tokens=3 * B, max_num_reqs=3)  # 3 host blocks
    a = Req(c, 0, toks(2 * B + 1))
    a.write()
    c.free_request(0)
    assert c.prefix.index.cached == 2
    n = Req(c, 1, toks(3 * B, start=900))  # needs all 3: the free one, then evicts 2

    def boom(*args, **kw):
        raise RuntimeError("apply launch failed (injected)")

    real, c.kernel_set.apply_write = c.kernel_set.apply_write, boom
    with pytest.raises(RuntimeError, match="injected"):
        c.write(0, 1, n.rows.get(0, 0, 3 * B))
    c.kernel_set.apply_write = real
    assert c.prefix.index.cached == 0 and c.pool.allocator.num_free == 3
    assert c.request(1).lengths[0] == 0
    n.write()
    n.resolve(0, [0, B, 2 * B + 1])
    c.free_request(1)
    assert Req(c, 2, toks(2 * B + 1)).cached == 0  # request 0's blocks are gone


def test_stress_prefetch_counts_by_row_key_for_sharers():
    """The stress tool's prefetch figures look rows up by row key: a sharer's aliases, not
    the writer's host rows."""
    from hisparse_tools.stress_prefetch import selected_hot, selected_rows
    c = make()
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
