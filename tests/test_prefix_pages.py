"""Shared prefix pages: with prefix caching and the elastic tier, a request whose cached
prefix a resident request holds joins resident on that request's device pages
(``hisparse.cache.device_pool``, ``PrefixCache.holder``). Focused cases (torch and the
Triton kernels under the interpreter) and churn traces against the LRU sim, which
models the sharing and the spill policy's page references independently."""

from __future__ import annotations

import pytest
import torch


from invariants import _check_tier, _cpu_state
from prefix_common import Req, make, toks
from test_prefix_cache import run_trace

B = 16  # host block: four to a device page
PB = 64
KERNELS = ["torch", "triton"]


def pool(pages: int, **kw):
    """A cache with blocks of 16 tokens and ``pages`` device pages (64 rows each)."""
    base = dict(host_block_size=B, host_pool_tokens=B * 64, max_num_reqs=4, max_request_id=16, top_k=8,
                device_buffer_size=16)
    base.update(kw)
    R, SP = base["max_num_reqs"], base["device_buffer_size"] + 1
    return lambda kernels="torch": make(kernels, device_pool_rows=-(-R * SP // 64) * 64 + pages * PB, **base)


def check_cache(c):
    """The elastic tier's invariants (page references, page table, page rows = host rows;
    ``invariants.check_cache``'s block checks don't know prefix aliases)."""
    _check_tier(c, _cpu_state(c), c.hot.cpu(), {rid: c.request(rid).slot for rid in c.live_requests()})


def pages_of(c, rid):
    return list(c.dpool.pages(c.request(rid).slot))


def page_rows(c, rid, n):
    """int64 [n]: the flat device rows of positions 0..n-1 of resident ``rid``."""
    pt = c.state.page_table[c.request(rid).slot].long().cpu()
    p = torch.arange(n)
    return c.cfg.hot_rows_per_layer + pt[p // PB] * PB + p % PB


def assert_pages_hold(c, req):
    """Every layer's page rows of ``req`` (resident) are its rows, byte-exact."""
    n = len(req.tokens)
    for layer in range(c.cfg.num_layers):
        got = c.hot[layer, page_rows(c, req.rid, c.request(req.rid).lengths[layer])].cpu()
        assert torch.equal(got, req.rows.get(layer, 0, c.request(req.rid).lengths[layer])), (req.rid, layer, n)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_hit_joins_resident_on_the_holders_whole_pages(kernels):
    c = pool(8)(kernels)
    prompt = toks(2 * PB + 20)
    a = Req(c, 0, prompt)
    a.write()
    assert c.residency(0) == "resident" and len(pages_of(c, 0)) == 3
    b = Req(c, 1, prompt[:2 * PB] + toks(30, start=5000))
    assert b.cached == 2 * PB and c.residency(1) == "resident"
    assert pages_of(c, 1) == pages_of(c, 0)[:2]  # the same device rows, no copy
    tot = c.stats()["total"]
    assert (tot["pool_pages_shared"], tot["prefix_resident_joins"]) == (2, 1)
    check_cache(c)
    b.write()  # its own rows go to a page of its own
    assert pages_of(c, 1)[:2] == pages_of(c, 0)[:2] and pages_of(c, 1)[2] not in pages_of(c, 0)
    b.resolve(0, [0, 5, PB + 3, 2 * PB - 1, 2 * PB, 2 * PB + 29])  # prefix rows and its own, byte-exact
    a.resolve(1, [1, 2 * PB + 19])
    assert c.stats()["total"]["misses"] == 0
    assert_pages_hold(c, a), assert_pages_hold(c, b)
    check_cache(c)
    held = pages_of(c, 0)
    c.free_request(0)  # the holder leaves: its shared pages stay (b references them)
    assert pages_of(c, 1)[:2] == held[:2] and held[2] in c.dpool._free
    assert c.stats()["total"]["pool_pages_shared"] == 0
    b.resolve(1, [0, PB, 2 * PB + 1])
    check_cache(c)
    c.free_request(1)
    assert c.dpool.num_free == 8 and not c.dpool.refs.any()
    check_cache(c)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_partial_last_page_is_copied_device_to_device(kernels):
    c = pool(8)(kernels)
    prompt = toks(PB + 40)
    a = Req(c, 0, prompt)
    a.write()
    b = Req(c, 1, prompt[:PB + 32] + [7])  # 6 blocks: a whole page plus 32 rows
    assert b.cached == PB + 32 and c.residency(1) == "resident"
    pa, pb = pages_of(c, 0), pages_of(c, 1)
    assert pb[0] == pa[0] and pb[1] not in pa and c.dpool.refs[pb[1]] == 1
    assert_pages_hold(c, b)
    b.write()
    assert_pages_hold(c, b), assert_pages_hold(c, a)
    b.resolve(0, [0, PB, PB + 31, PB + 32])
    check_cache(c)


def test_no_free_page_for_the_copy_joins_hot():
    c = pool(2)()
    prompt = toks(PB + 40)
    a = Req(c, 0, prompt)
    a.write()  # both pages
    assert c.dpool.num_free == 0
    b = Req(c, 1, prompt[:PB + 32] + [7])
    assert b.cached == PB + 32 and c.residency(1) == "hot"
    c2 = Req(c, 2, prompt[:PB] + [7])  # whole pages only: no copy needed, resident
    assert c2.cached == PB and c.residency(2) == "resident" and pages_of(c, 2) == pages_of(c, 0)[:1]
    tot = c.stats()["total"]
    assert (tot["pool_pages_shared"], tot["prefix_resident_joins"]) == (1, 1)
    b.write(), b.resolve(0, [0, PB + 20])
    check_cache(c)


def test_without_a_resident_holder_or_with_sharing_off_a_hit_joins_hot():
    prompt = toks(2 * PB + 8)
    c = pool(8, share_prefix_pages=False)()
    a = Req(c, 0, prompt)
    a.write()
    assert Req(c, 1, prompt[:2 * PB] + [1]).cached == 2 * PB and c.residency(1) == "hot"
    assert c.stats()["total"]["prefix_resident_joins"] == 0
    c = pool(8)()
    a = Req(c, 0, prompt)
    a.write()
    c.free_request(0)  # the blocks stay cached on the host, no resident request holds them
    assert Req(c, 1, prompt[:2 * PB] + [1]).cached == 2 * PB and c.residency(1) == "hot"
    check_cache(c)


def test_a_holder_whose_blocks_are_not_published_yet_holds_nothing():
    c = pool(8)()
    prompt = toks(2 * PB + 8)
    a = Req(c, 0, prompt)
    a.write(layers=[0])  # layer 1 lacks the rows: nothing published
    assert Req(c, 1, prompt).cached == 0 and c.residency(1) == "resident" and pages_of(c, 1) == []
    check_cache(c)


def test_the_spill_policy_counts_only_pages_a_demotion_frees():
    """a holds 3 pages, 2 of them shared with b; d holds 2 of its own. A write that needs a
    page with none free demotes d (2 pages freed), not a (3 pages held, 1 freed)."""
    c = pool(6)()
    prompt = toks(2 * PB + 20)
    a = Req(c, 0, prompt)
    a.write()
    b = Req(c, 1, prompt[:2 * PB] + [9])
    d = Req(c, 2, toks(PB + 10, start=3000))
    d.write()
    assert c.dpool.num_free == 1 and c.dpool.exclusive(0) == 1 and c.dpool.exclusive(2) == 2
    b.write()  # b's first own page: the last free one
    assert c.dpool.num_free == 0
    e = Req(c, 3, toks(3, start=4000))
    e.write()  # needs a page: d goes hot
    assert [c.residency(i) for i in range(4)] == ["resident", "resident", "hot", "resident"]
    assert c.stats()["total"]["spills"] == 1
    check_cache(c)
    # demoting a sharer frees only its own page; the holder's references keep the rest
    shared = pages_of(c, 1)[:2]
    c.free_request(3)
    f = Req(c, 3, toks(3 * PB, start=6000))
    f.write()  # 3 pages, 2 free (e's and d's): a or b frees 1 (a, the lower slot) and that fits
    assert c.residency(0) == "hot" and c.residency(1) == "resident" and pages_of(c, 1)[:2] == shared
    assert c.dpool.refs[shared].tolist() == [1, 1]
    b.resolve(0, [0, PB + 1, 2 * PB])
    a.resolve(1, [0, 2 * PB + 19])  # a is hot now: its seeded rows and misses, byte-exact
    check_cache(c)


def test_churn_traces_share_prefix_pages_and_spill():
    """Random churn with groups of 64-144-token prompts (whole pages to share) and a pool
    of 3 pages: joins on shared pages, copies, spills of holders and sharers; after every
    operation the sim's pages and references, every resident request's page rows and
    every resolve byte-exact. Seeds 0-3 together cover each of those."""
    got = dict(page_shares=0, resident_joins=0, spills=0, shared_spills=0, shared_pages_seen=0)
    for seed in range(4):
        t, counts = run_trace(pool(3, host_pool_tokens=1280)(), seed, 300, group_len=(4, 9), suffix=(0, 40))
        for k in ("page_shares", "resident_joins", "shared_pages_seen"):
            got[k] += counts.get(k, 0)
        got["spills"] += t.sim.spills
        got["shared_spills"] += t.sim.shared_spills
    assert all(v > 0 for v in got.values()), got


def test_churn_trace_shares_prefix_pages_with_triton_kernels():
    c = pool(4, host_pool_tokens=1280)("triton")
    assert c.kernels == "triton"
    t, counts = run_trace(c, 0, 80, group_len=(4, 9), suffix=(0, 40))
    assert counts["page_shares"] > 0 and counts["resolve"] > 5, counts
