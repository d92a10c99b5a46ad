"""Failed calls change nothing; odd inputs land byte-exact; counters never wrap.

Each test names the defect it covers: rows with a row stride other than row_bytes and
rows at an odd storage offset (both land byte-exact, through the cache and the
engine), kernels='triton' on a CPU without the interpreter (refused at construction),
a CapacityError part-way through an engine batch (nothing written), the LRU step
counter past 2**31 (misses still staged, same state as the reference), a held resolve
result after an append (reported stale), an unchecked conversion whose row would
exceed int32 (-1, not a wrapped row), int64 ids on the unchecked hot path (refused).

Fault injection: every launch site of append (host mirror, hot-tier update), resolve
(resolve, staging copy) and prefill staging is made to raise, and the whole state must
be as before -- device tensors, hot rows, readable host rows, blocks, lengths,
reserved occupants, counters -- and the call must then succeed when retried. The same
for the engine façade's calls.
"""

from __future__ import annotations

import random

import pytest
import torch

import hisparse._checks as checks
from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.staging import BlockTable, convert_topk_to_physical
from hisparse.staging import prefill as prefill_mod
from invariants import check_cache

I32 = torch.int32
KERNELS = ["torch", "triton"]


def cfg(**kw) -> HiSparseConfig:
    base = dict(num_layers=2, host_pool_tokens=256, row_bytes=656, top_k=4, device_buffer_size=8,
                max_num_reqs=3, host_block_size=16, max_request_id=16, device="cpu")
    base.update(kw)
    return HiSparseConfig(**base)


def rand_rows(n: int, seed: int, width: int = 656) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


def full_state(c: HiSparseCache) -> dict:
    """Everything a failed call must leave as it was. Host rows: the readable ones (a
    host mirror that ran before a later launch failed wrote only rows past a length)."""
    st = c.state
    snap = {k: getattr(st, k).clone() for k in ("id_to_slot", "seq_lens", "block_table", "slot_pos",
                                                 "slot_stamp", "row_slot", "step", "stats")}
    snap["hot"] = c.hot.clone()
    alloc = c.pool.allocator
    snap["alloc"] = (alloc.num_free, {o: alloc.blocks(o) for o in alloc.owners()})
    snap["requests"] = {rid: (c.request(rid).slot, c.request(rid).lengths,
                              [c.requests.reserved(c.request(rid).slot, l) for l in range(c.cfg.num_layers)])
                        for rid in c.live_requests()}
    snap["host"] = {(rid, l): c.read_host_rows(l, rid, list(range(c.request(rid).lengths[l])))
                    for rid in c.live_requests() for l in range(c.cfg.num_layers)}
    snap["epochs"] = list(c.requests.epochs)
    return snap


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict) and a[k] and isinstance(next(iter(a[k].values())), torch.Tensor):
            assert a[k].keys() == b[k].keys(), k
            for kk in a[k]:
                assert torch.equal(a[k][kk], b[k][kk]), (k, kk)
        else:
            assert a[k] == b[k], k


def resolve_ok(c: HiSparseCache, layer: int, rid: int, positions: list[int], truth: torch.Tensor) -> None:
    """Resolve one token and check every physical row holds the truth bytes."""
    tk = torch.tensor([positions], dtype=I32)
    res = c.resolve(layer, torch.tensor([rid], dtype=I32), tk)
    got = c.hot_rows(layer)[res.physical[0].long()]
    assert torch.equal(got, truth[torch.tensor(positions)]), (layer, rid, positions)


# ---------------------------------------------------------------- odd row layouts
@pytest.mark.parametrize("kernels", KERNELS)
def test_strided_rows_land_byte_exact(kernels):
    """Defect 1: rows that are a column slice of a wider buffer (row stride 2 x 656)."""
    c = HiSparseCache(cfg(), kernels=kernels)
    c.add_request(0)
    wide = rand_rows(20, 1, 2 * 656)
    rows = wide[:, :656]
    assert rows.stride(0) == 2 * 656
    c.write(0, c.plan_write([0], [3]), rows[:3])
    c.write(0, 0, rows[3:20])[0]  # past S: fits phase, reserved slot and host-only rows
    resolve_ok(c, 0, 0, [0, 1, 2, -1][:3] + [19], rows)
    resolve_ok(c, 0, 0, [10, 11, 12, 13], rows)
    assert torch.equal(c.read_host_rows(0, 0, list(range(20))), rows)
    check_cache(c)


@pytest.mark.parametrize("kernels", KERNELS)
def test_rows_at_odd_storage_offset_land_byte_exact(kernels):
    """Defect 2: a contiguous view whose data starts 1 byte into its storage."""
    c = HiSparseCache(cfg(), kernels=kernels)
    c.add_request(0)
    raw = rand_rows(1, 2, 12 * 656 + 1)[0]
    rows = raw[1:].view(12, 656)
    assert rows.storage_offset() % 4 == 1 and rows.is_contiguous()
    c.write(0, 0, rows)
    assert c.request(0).lengths[0] == 12 and int(c.state.seq_lens[0, c.request(0).slot]) == 12
    resolve_ok(c, 0, 0, [0, 5, 9, 11], rows)
    c.write(0, 0, rows[:1])[0]  # the next append lands at position 12
    assert c.request(0).lengths[0] == 13
    check_cache(c)


def test_engine_writes_strided_rows_byte_exact():
    """Defect 1 through ``HiSparseIndexGroup.write_new_rows``."""
    g = HiSparseIndexGroup(cfg(num_layers=1), kernels="triton")
    g.register_layer()
    g.add_request(5)
    wide = rand_rows(10, 3, 3 * 656)
    rows = wide[:, 656:2 * 656]
    md = SparseMLAMetadata.build(request_ids=[5], query_lens=[10], seq_lens=[10], num_decodes=0)
    g.prepare_for_batch(md)
    g.write_new_rows(0, rows, md)
    c = g.hisparse_cache
    assert torch.equal(c.read_host_rows(0, 5, list(range(10))), rows)
    resolve_ok(c, 0, 5, [9, 0, 3, 7], rows)


# ---------------------------------------------------------------- kernel choice
def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    """Defect 3: refused at construction (before anything is allocated), not a silent
    torch fallback for resolve and a crash in the write path."""
    monkeypatch.setattr(checks, "interpreter_mode", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        HiSparseCache(cfg(), kernels="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        HiSparseIndexGroup(cfg(), kernels="triton")
    assert HiSparseCache(cfg(), kernels="auto").kernels == "torch"


# ---------------------------------------------------------------- engine capacity
def test_engine_capacity_error_mid_batch_changes_nothing_and_the_next_batch_works():
    """Defect 4: the second request of a batch runs the pool out of blocks."""
    g = HiSparseIndexGroup(cfg(num_layers=2, host_pool_tokens=64), kernels="torch")  # 4 blocks of 16
    for _ in range(2):
        g.register_layer()
    for rid in (1, 2):
        g.add_request(rid)
    c = g.hisparse_cache
    md = SparseMLAMetadata.build(request_ids=[1, 2], query_lens=[20, 40], seq_lens=[20, 40], num_decodes=0)
    before = full_state(c)
    with pytest.raises(CapacityError):
        g.prepare_for_batch(md)  # the forward's blocks are allocated when it is prepared
    assert_same(before, full_state(c))
    md2 = SparseMLAMetadata.build(request_ids=[1, 2], query_lens=[20, 10], seq_lens=[20, 10], num_decodes=0)
    g.prepare_for_batch(md2)  # the lengths are still 0: the next batch is accepted
    for layer in range(2):
        g.write_new_rows(layer, rand_rows(30, 5 + layer), md2)
    assert c.request(1).lengths == (20, 20) and c.request(2).lengths == (10, 10)


# ---------------------------------------------------------------- counter wrap
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("start", [2**31 - 3, 2**32 - 2])
def test_step_counter_past_int32_keeps_staging_misses(kernels, start):
    """Defect 5: the per-(layer, request) step is int64; set it near 2**31 (and 2**32)
    and resolve with misses: every miss is staged byte-exact and the state equals the
    torch reference driven the same way."""
    caches = [HiSparseCache(cfg(num_layers=1), kernels=kernels), HiSparseCache(cfg(num_layers=1), kernels="torch")]
    truth = rand_rows(40, 6)
    rng = random.Random(7)
    steps = [rng.sample(range(40), 4) for _ in range(8)]
    for c in caches:
        c.add_request(3)
        c.write(0, 3, truth)
        r = c.request(3).slot
        c.state.step[0, r] = start
        occupied = c.state.slot_pos[0, r] >= 0
        c.state.slot_stamp[0, r][occupied] = start  # the context's rows were stamped at that step
        for positions in steps:
            resolve_ok(c, 0, 3, positions, truth)
    a, b = caches
    assert int(a.state.step[0, a.request(3).slot]) == start + len(steps)
    for name in ("slot_pos", "slot_stamp", "row_slot", "step", "stats"):
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name
    assert a.stats()["total"]["misses"] > 0
    check_cache(a)


# ---------------------------------------------------------------- held results
def test_held_result_is_stale_after_an_append():
    """Defect 6: a result pointing at the reserved newest-token slot would read the next
    appended row; the contract (valid until the next append/resolve/free of the layer)
    is what ``stale`` reports."""
    c = HiSparseCache(cfg(num_layers=2), kernels="torch")
    c.add_request(0)
    for layer in range(2):
        c.write(layer, 0, rand_rows(12, 8 + layer))
    res = c.resolve(0, torch.tensor([0], dtype=I32), torch.tensor([[11, 0, -1, -1]], dtype=I32))
    other = c.resolve(1, torch.tensor([0], dtype=I32), torch.tensor([[1, -1, -1, -1]], dtype=I32))
    assert not res.stale and not other.stale
    c.write(0, 0, rand_rows(1, 10))
    assert res.stale and not other.stale  # only layer 0 changed
    c.free_request(0)
    assert other.stale


# ---------------------------------------------------------------- int32 rows in convert
@pytest.mark.parametrize("kernels", KERNELS)
def test_unchecked_convert_row_past_int32_is_invalid(kernels):
    """Defect 7: block * block_stride + pos >= 2**31 becomes -1 (not a wrapped row
    counted valid); checked mode raises."""
    bt = torch.tensor([[0, 2**20]], dtype=I32)  # block 2**20 x stride 2**12 = 2**32
    topk = torch.tensor([[1, 2**12 + 5, -1]], dtype=I32)
    blocks = BlockTable(bt, 2**12, 2**12)
    r = convert_topk_to_physical(topk, torch.tensor([0], dtype=I32), blocks, return_valid_counts=True,
                                 validate=False, kernels=kernels)
    assert r.physical.tolist() == [[1, -1, -1]] and r.valid_counts.tolist() == [1]
    with pytest.raises(ValueError, match="exceeds int32"):
        convert_topk_to_physical(topk, torch.tensor([0], dtype=I32), blocks, kernels=kernels)


# ---------------------------------------------------------------- fault injection
class Boom(RuntimeError):
    pass


def _raise(*_a, **_k):
    raise Boom("injected launch failure")


def warm_cache(kernels: str, seed: int) -> tuple[HiSparseCache, dict]:
    """A cache with three requests past the buffer, after some resolves with misses."""
    c = HiSparseCache(cfg(), kernels=kernels)
    truth = {}
    rng = random.Random(seed)
    for rid, n in ((1, 30), (2, 6), (4, 21)):
        c.add_request(rid)
        for layer in range(2):
            truth[(rid, layer)] = rand_rows(n, 100 * rid + layer)
            c.write(layer, rid, truth[(rid, layer)])
    for _ in range(4):
        for layer in range(2):
            ids = torch.tensor([1, 4], dtype=I32)
            tk = torch.tensor([rng.sample(range(30), 4), rng.sample(range(21), 4)], dtype=I32)
            c.resolve(layer, ids, tk)
    return c, truth


def _resolve_call(c):
    ids = torch.tensor([1, 1, 4], dtype=I32) if c.cfg.max_query_len > 1 else torch.tensor([1, 2, 4], dtype=I32)
    tk = torch.tensor([[29, 3, 17, 17], [5, 0, 1, 2], [20, 19, 11, 4]], dtype=I32)
    return lambda: c.resolve(1, ids, tk, validate=False)


def _append_call(c):
    rows = rand_rows(4, 55)
    return lambda: c.write(0, c.plan_write([1, 2, 4], [1, 2, 1]), rows)


SITES = [  # (what fails, the call that reaches it)
    ("kernel_set.mirror", _append_call),
    ("kernel_set.apply_write", _append_call),
    ("kernel_set.resolve", _resolve_call),
    ("kernel_set.copy_staged", _resolve_call),
]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("site,call", SITES, ids=[s for s, _ in SITES])
def test_a_failing_launch_changes_nothing(kernels, site, call):
    c, _ = warm_cache(kernels, seed=1)
    twin, _ = warm_cache(kernels, seed=1)
    part, attr = site.split(".")
    obj = getattr(c, part)
    good = getattr(obj, attr)
    before = full_state(c)
    setattr(obj, attr, _raise)
    with pytest.raises(Boom):
        call(c)()
    setattr(obj, attr, good)
    assert_same(before, full_state(c))
    check_cache(c)
    # retried, the call does exactly what it does on an untouched twin
    out_a, out_b = call(c)(), call(twin)()
    if hasattr(out_a, "physical"):
        assert torch.equal(out_a.physical, out_b.physical)
    else:
        assert out_a == out_b
    for name in ("slot_pos", "slot_stamp", "row_slot", "step", "stats", "block_table", "seq_lens"):
        assert torch.equal(getattr(c.state, name), getattr(twin.state, name)), name
    assert torch.equal(c.hot, twin.hot)


def _after(f):
    """``f`` runs, then the call raises (an error reported after the launch ran)."""
    def run(*a, **k):
        f(*a, **k)
        raise Boom("failure reported after the launch ran")
    return run


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("call", ["resolve", "prefetch", "resolve_split"])
def test_staging_that_ran_then_failed_changes_nothing(kernels, call):
    """The staging copied the misses into their victims' slots, then the call failed:
    the rollback puts back the victims' bytes too, not only their slot maps (else a
    later hit on such a slot reads another position's row)."""
    c, _ = warm_cache(kernels, seed=2)
    twin, _ = warm_cache(kernels, seed=2)
    ids = torch.tensor([1, 2, 4], dtype=I32)
    tk = torch.tensor([[29, 3, 17, 9], [5, 0, 1, 2], [20, 19, 11, 4]], dtype=I32)
    before = full_state(c)
    good = c.kernel_set.copy_staged
    c.kernel_set.copy_staged = _after(good)
    with pytest.raises(Boom):
        if call == "resolve_split":
            c.resolve(1, ids, tk, validate=False, split=True)
        else:
            c.resolve(1, ids, tk, validate=False) if call == "resolve" else c.prefetch(1, ids, tk)
    c.kernel_set.copy_staged = good
    assert_same(before, full_state(c))
    check_cache(c)
    a, b = c.resolve(1, ids, tk, validate=False), twin.resolve(1, ids, tk, validate=False)
    assert torch.equal(a.physical, b.physical)
    assert torch.equal(c.hot, twin.hot)


@pytest.mark.parametrize("kernels", KERNELS)
def test_staging_failure_rolls_back_multi_token_groups(kernels):
    """The undo of a resolve with multi-token groups, duplicate positions, padding and a
    second run of one request (counted invalid), against an untouched twin."""
    def make():
        c = HiSparseCache(cfg(max_query_len=2, device_buffer_size=8), kernels=kernels)
        for rid, n in ((1, 30), (4, 21)):
            c.add_request(rid)
            for layer in range(2):
                c.write(layer, rid, rand_rows(n, 7 * rid + layer))
        return c
    c, twin = make(), make()
    ids = torch.tensor([1, 1, 4, 1], dtype=I32)
    tk = torch.tensor([[29, 3, 17, 17], [17, 0, -1, 2], [20, 19, 11, 4], [5, 6, 7, 8]], dtype=I32)
    for x in (c, twin):
        x.resolve(0, ids[:3], tk[:3].flip(1).contiguous())
    before = full_state(c)
    good = c.kernel_set.copy_staged
    c.kernel_set.copy_staged = _raise
    with pytest.raises(Boom):
        c.resolve(0, ids, tk, validate=False)
    c.kernel_set.copy_staged = good
    assert_same(before, full_state(c))
    a, b = c.resolve(0, ids, tk, validate=False), twin.resolve(0, ids, tk, validate=False)
    assert torch.equal(a.physical, b.physical)
    for name in ("slot_pos", "slot_stamp", "row_slot", "step", "stats"):
        assert torch.equal(getattr(c.state, name), getattr(twin.state, name)), name


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefill_staging_failure_changes_nothing(kernels, monkeypatch):
    c, _ = warm_cache(kernels, seed=2)
    before = full_state(c)
    site = "_launch" if kernels == "triton" else "stage_prefill_reference"
    monkeypatch.setattr(prefill_mod, site, _raise)
    reqs = prefill_mod.StageRequests(req_slots=torch.tensor([c.request(1).slot], dtype=I32),
                                     seq_lens=torch.tensor([30], dtype=I32), starts=torch.tensor([0], dtype=I32))
    ws = torch.zeros((30, 576), dtype=torch.bfloat16)
    with pytest.raises(Boom):
        prefill_mod.stage_prefill(c.layer_view(0), reqs, ws, kernels=kernels)
    assert_same(before, full_state(c))


# ---- the engine façade ----------------------------------------------------------------
def make_group(kernels: str) -> HiSparseIndexGroup:
    g = HiSparseIndexGroup(cfg(), kernels=kernels)
    for _ in range(2):
        g.register_layer()
    for rid, n in ((1, 20), (2, 12)):
        g.add_request(rid)
        md = SparseMLAMetadata.build(request_ids=[rid], query_lens=[n], seq_lens=[n], num_decodes=0)
        g.prepare_for_batch(md)
        for layer in range(2):
            g.write_new_rows(layer, rand_rows(n, 10 * rid + layer), md)
    return g


def group_state(g: HiSparseIndexGroup) -> dict:
    snap = full_state(g.hisparse_cache)
    c = g.hisparse_cache
    # host rows a call can read: up to the lengths the group reports (a layer still to
    # be written in this forward does not count its rows yet)
    snap["host"] = {(rid, l): c.read_host_rows(l, rid, list(range(g.request_length(rid, l))))
                    for rid in c.live_requests() for l in range(c.cfg.num_layers)}
    snap["group"] = (sorted(g._fwd.written), sorted(g._fwd.resolved), list(g.resolves_per_layer))
    return snap


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("site", ["kernel_set.mirror", "kernel_set.apply_write", "kernel_set.resolve",
                                  "kernel_set.copy_staged", "prefill"])
def test_engine_calls_change_nothing_when_a_launch_fails(kernels, site, monkeypatch):
    g = make_group(kernels)
    c = g.hisparse_cache
    g.add_request(3)
    md = SparseMLAMetadata.build(request_ids=[1, 2, 3], query_lens=[1, 1, 5], seq_lens=[21, 13, 5],
                                 num_decodes=2)
    rows = rand_rows(7, 99)
    topk = torch.tensor([[20, 0, 5, 11], [12, 1, 2, -1]], dtype=I32)
    ws = torch.zeros((5, 576), dtype=torch.bfloat16)
    starts = torch.tensor([0], dtype=I32)
    g.prepare_for_batch(md)
    if site in ("kernel_set.mirror", "kernel_set.apply_write"):
        calls = [lambda: g.write_new_rows(0, rows, md)]
    elif site.startswith("kernel_set"):
        g.write_new_rows(0, rows, md)
        calls = [lambda: g.convert_decode_logical_to_physical_topk(0, topk, md)]
    else:
        g.write_new_rows(0, rows, md)
        calls = [lambda: g.gather_fp8_prefill(0, None, ws, None, starts, 1, md, 0),
                 lambda: g.stage_prefill_rows(0, torch.zeros((8, 656), dtype=torch.uint8), md)]
    for call in calls:
        before = group_state(g)
        if site == "prefill":
            name = "_launch" if kernels == "triton" else "stage_prefill_reference"
            monkeypatch.setattr(prefill_mod, name, _raise)
        else:
            part, attr = site.split(".")
            monkeypatch.setattr(getattr(c, part), attr, _raise)
        with pytest.raises(Boom):
            call()
        monkeypatch.undo()
        assert_same(before, group_state(g))
        call()  # and the retry completes


@pytest.mark.parametrize("what", ["add_request", "free_request"])
def test_requests_change_only_between_a_forwards_layers(what):
    """add / free part-way through a forward's writes is refused (nothing changed), so
    no request is left holding a row more in some layers than in others; once every
    layer is written it goes through. Before any write it goes through and the prepared
    forward is refused as out of date, with what to do; prepared again, it runs."""
    g = make_group("torch")
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[1], seq_lens=[21], num_decodes=1)
    g.prepare_for_batch(md)
    g.write_new_rows(0, rand_rows(1, 5), md)
    before = group_state(g)
    act = (lambda: g.add_request(3)) if what == "add_request" else (lambda: g.free_request(2))
    with pytest.raises(ValueError, match="part-way through a forward"):
        act()
    assert_same(before, group_state(g))
    g.write_new_rows(1, rand_rows(1, 6), md)
    act()
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[1], seq_lens=[22], num_decodes=1)
    g.prepare_for_batch(md)
    # before any write of the prepared forward (the other lifecycle call, for a free slot)
    g.free_request(2) if what == "add_request" else g.add_request(6)
    with pytest.raises(ValueError, match="prepare the forward again"):
        g.write_new_rows(0, rand_rows(1, 7), md)
    g.prepare_for_batch(md)
    for layer in range(2):
        g.write_new_rows(layer, rand_rows(1, 8 + layer), md)
    assert [g.request_length(1, l) for l in range(2)] == [22, 22]


def test_a_forward_cut_short_is_abandoned_then_its_requests_freed():
    g = make_group("torch")
    md = SparseMLAMetadata.build(request_ids=[1, 2], query_lens=[1, 1], seq_lens=[21, 13], num_decodes=2)
    g.prepare_for_batch(md)
    g.write_new_rows(0, rand_rows(2, 5), md)  # then an error: layer 1 never written
    with pytest.raises(ValueError, match="abandon_forward"):
        g.free_request(1)
    g.abandon_forward()
    g.free_request(1)
    g.free_request(2)
    g.add_request(1)
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[4], seq_lens=[4], num_decodes=0)
    g.prepare_for_batch(md)
    for layer in range(2):
        g.write_new_rows(layer, rand_rows(4, 9 + layer), md)
    assert [g.request_length(1, l) for l in range(2)] == [4, 4]


def test_stage_programs_checked_when_set():
    c, _ = warm_cache("torch", seed=3)
    for bad in (0, -4, 2.5, True):
        with pytest.raises((TypeError, ValueError), match="stage_programs"):
            c.stage_programs = bad
    c.stage_programs = 8
    assert c.stage_programs == 8
    c.stage_programs = None
