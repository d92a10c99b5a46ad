"""A forward's host work as array operations over the batch (``prepare_for_batch``,
``prepare_step``): the request table's uniform and per-layer rows against a per-layer
model, the decode-step plan against the general runs plan, and the façade's checks
(the same errors, in the same row order, and nothing changed) whatever shape the
table is in: layers that differ, a forward whose layers were not all written, a
padded bucket.

The façade tests use the public API only (they pass on the per-request implementation
too)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata

from invariants import assert_same, check_cache, snapshot

L = 3


# ------------------------------------------------------------------ request table
@pytest.mark.parametrize("seed", range(4))
def test_request_table_matches_a_per_layer_model(seed):
    """Random adds, frees, per-layer and all-layer writes and restores: every query
    (per slot, per layer, per batch, the uniform summary) equals a model that keeps a
    list per layer; values are drawn from a few, so layers often agree again."""
    from hisparse.cache.requests import RequestTable

    Ln, R = 4, 5
    t = RequestTable(num_layers=Ln, max_num_reqs=R, max_request_id=20)
    model: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (rows, occupants) per layer
    rng = random.Random(seed)
    val = lambda: rng.choice([0, 3, 4, 9])  # noqa: E731
    for _ in range(500):
        live = sorted(model)
        op = rng.choice(["add", "remove", "set_written", "set_written_layer", "set_written_rows", "restore",
                         "restore_rows", "summary"])
        some = np.array(rng.sample(live, rng.randint(1, len(live))), dtype=np.int64) if live else None
        if op == "add" and len(live) < R:
            rid = rng.choice([i for i in range(20) if not t.is_live(i)])
            model[t.add(rid)] = ([0] * Ln, [-1] * Ln)
        elif op == "remove" and live:
            rid = rng.choice(sorted(t.slot_map()))
            del model[t.remove(rid)]
        elif op == "set_written" and live:
            r, layer, end, res = rng.choice(live), rng.randrange(Ln), val(), rng.choice([-1, val()])
            t.set_written(r, layer, end, res)
            model[r][0][layer] = end
            if res >= 0:
                model[r][1][layer] = res
        elif op in ("set_written_layer", "set_written_rows") and live:
            ends = np.array([val() for _ in some], dtype=np.int64)
            res = np.array([rng.choice([-1, val()]) for _ in some], dtype=np.int64)
            layers = [rng.randrange(Ln)] if op == "set_written_layer" else range(Ln)
            if op == "set_written_layer":
                t.set_written_layer(some, layers[0], ends, res)
            else:
                t.set_written_rows(some, ends, res)
            for r, e, o in zip(some.tolist(), ends.tolist(), res.tolist()):
                for layer in layers:
                    model[r][0][layer] = e
                    if o >= 0:
                        model[r][1][layer] = o
        elif op == "restore" and live:
            r, layer, end, res = rng.choice(live), rng.randrange(Ln), val(), rng.choice([-1, val()])
            t.restore(r, layer, end, res)
            model[r][0][layer], model[r][1][layer] = end, res
        elif op == "restore_rows" and live:
            layers = np.array(sorted(rng.sample(range(Ln), rng.randint(1, Ln))), dtype=np.int64)
            ends = np.array([val() for _ in some], dtype=np.int64)
            res = np.array([rng.choice([-1, val()]) for _ in some], dtype=np.int64)
            t.restore_rows(some, layers, ends, res)
            for r, e, o in zip(some.tolist(), ends.tolist(), res.tolist()):
                for layer in layers.tolist():
                    model[r][0][layer], model[r][1][layer] = e, o
        elif op == "summary" and live:
            t.summary(some)  # may make slots uniform again: nothing a query sees
        for r, (lens, occ) in model.items():
            assert t.lengths(r) == lens and t.reserved_list(r) == occ, (r, lens, occ)
            assert [t.length(r, i) for i in range(Ln)] == lens
            assert [t.reserved(r, i) for i in range(Ln)] == occ
        if model:
            slots = np.array(sorted(model), dtype=np.int64)
            rows = t.rows_of(slots)
            assert rows.tolist() == [[model[r][0], model[r][1]] for r in slots.tolist()]
            layer = rng.randrange(Ln)
            got = t.layer_rows(slots, layer)
            assert [x.tolist() for x in got] == [[model[r][0][layer] for r in slots.tolist()],
                                                 [model[r][1][layer] for r in slots.tolist()]]
            same, len0, res0 = t.summary(slots)
            for r, s, n, o in zip(slots.tolist(), same.tolist(), len0.tolist(), res0.tolist()):
                lens, occ = model[r]
                assert s == (len(set(lens)) == 1 and len(set(occ)) == 1), (r, lens, occ)
                if s:
                    assert (n, o) == (lens[0], occ[0])


# ------------------------------------------------------------------ decode-step plan
@pytest.mark.parametrize("seed", range(6))
def test_single_row_step_lists_equal_runs_plan(seed):
    """The step planner's decode path (host blocks from the writer's block-table
    arrays) builds the lists of the general runs plan, in the same order: rows across
    the fits phase and the reserved slot, new and skipped blocks, resident requests."""
    from hisparse.cache.host_pool import HostPool
    from hisparse.cache.write_plan import _NAMES, NO_RESIDENT, Resident, _runs_plan, split_lists
    from hisparse.cache.write_step import StepWork, single_row_step_lists

    rng = random.Random(seed)
    R, S, B = 6, 5, 3
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=3 * 40, row_bytes=16, top_k=2, device_buffer_size=S,
                         max_num_reqs=R, host_block_size=B, device="cpu")
    pool = HostPool(cfg, pin=False)
    host_blocks = np.full((R, cfg.num_host_blocks), -1, dtype=np.int32)
    num_blocks = np.zeros(R, dtype=np.int64)
    work, t0 = [], 0
    for r in rng.sample(range(R), 5):
        p0 = rng.choice([0, 1, S - 1, S, S + 1, B * 2, B * 3 - 1, rng.randrange(0, 20)])
        have = rng.choice([-(-p0 // B), -(-(p0 + 1) // B)])  # sometimes the row opens a block
        if rng.random() < 0.2:
            have = max(0, p0 // B - 1)  # skip a block
        got = pool.allocator.allocate(r, have)
        host_blocks[r, :have], num_blocks[r] = got, have
        old = rng.choice([-1, max(0, p0 - 1)]) if p0 >= S else -1
        old = old if old < have * B else -1
        work.append((r, p0, p0 + 1, t0, old))
        t0 += 1
    ends = np.array([w[2] for w in work], dtype=np.int64)
    need = np.maximum(0, -(-ends // B) - num_blocks[[w[0] for w in work]])
    upcoming = pool.allocator.peek(int(need.sum()))
    new_blocks, o = {}, 0
    for (r, *_), n in zip(work, need.tolist()):
        if n:
            new_blocks[r] = upcoming[o:o + n]
            o += n
    col = lambda i: np.array([w[i] for w in work], dtype=np.int64)  # noqa: E731
    sw = StepWork(rid=col(0) + 100, slot=col(0), inc=np.zeros(len(work), dtype=np.int64), p0=col(1), p1=col(2),
                  old=col(4))
    owned = {r: list(pool.allocator.owned(r)) for r, *_ in work}
    pages = {r: rng.sample(range(1000), p1 // 64 + 1) for r, _, p1, _, _ in work if rng.random() < 0.5}
    for resident in (NO_RESIDENT, Resident(pages, base=4096, PB=64)):
        res_row = np.array([resident.row(r, p) if r in resident.pages else -1 for r, p, *_ in work], dtype=np.int64)
        got = single_row_step_lists(sw, col(3), need, new_blocks, host_blocks=host_blocks, num_blocks=num_blocks,
                                    B=B, S=S, res_row=res_row)
        flat, sizes = _runs_plan(work, owned=owned, new_blocks=new_blocks, B=B, S=S, resident=resident)
        want = split_lists(flat.numpy(), sizes)
        for name, a, b in zip(_NAMES, got, want):
            assert a.tolist() == b.tolist(), name


@pytest.mark.parametrize("seed", range(4))
def test_pool_page_rows_equal_the_plans_pages(seed):
    """``DevicePool.page_rows`` (the pool's arrays, the plan's grants on top) gives
    every resident request's row as the plan's pages do, demoted ones none; and a write
    for which ``needs_pages`` says no is one the plan changes nothing for."""
    from hisparse.cache.device_pool import DevicePool
    from hisparse.cache.write_plan import Resident

    rng = random.Random(seed)
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=4096, row_bytes=656, top_k=4, device_buffer_size=8,
                         max_num_reqs=6, host_block_size=16, device="cpu", device_pool_rows=128 + 64 * 12)
    dp = DevicePool(cfg)
    lens = {}
    for r in range(6):
        dp.admit(r)
        lens[r] = 0
    for _ in range(60):
        slots = rng.sample(range(6), rng.randint(1, 6))
        ends = [lens[r] + rng.choice([1, 1, 1, 30, 64]) for r in slots]
        s, e = np.array(slots, dtype=np.int64), np.array(ends, dtype=np.int64)
        ch = dp.plan(list(zip(slots, ends)))
        if not dp.needs_pages(s, e):
            assert ch.empty
        pos = e - 1
        got = dp.page_rows(s, pos, ch)
        res = Resident(ch.pages, dp.base, dp.PB)
        assert got.tolist() == [res.row(r, p) if r in ch.pages else -1 for r, p in zip(slots, pos.tolist())]
        for r in ch.demote:  # make the plan's changes (host side)
            dp.release(r)
        for r, want in ch.grants.items():
            if want:
                dp.grant(r, want)
        for r, n in zip(slots, ends):
            lens[r] = n
        assert [int(dp.npages[r]) for r in range(6)] == [len(dp.pages(r)) if dp.is_resident(r) else -1
                                                         for r in range(6)]


# ------------------------------------------------------------------ the façade's checks
def make_group(**kw) -> HiSparseIndexGroup:
    base = dict(num_layers=L, row_bytes=656, top_k=4, device_buffer_size=8, max_num_reqs=4, host_block_size=4,
                host_pool_tokens=4 * 48, max_request_id=16, device="cpu")
    base.update(kw)
    g = HiSparseIndexGroup(HiSparseConfig(**base), kernels="torch")
    for _ in range(L):
        g.register_layer()
    return g


def md_of(reqs: list[tuple[int, int, int]], num_decodes: int) -> SparseMLAMetadata:
    """reqs: (request id, query_len, seq_len after the forward)."""
    return SparseMLAMetadata.build(request_ids=[r for r, _, _ in reqs], query_lens=[q for _, q, _ in reqs],
                                   seq_lens=[s for _, _, s in reqs], num_decodes=num_decodes)


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 120, (n, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def forward(g: HiSparseIndexGroup, md: SparseMLAMetadata, layers=range(L), **kw) -> None:
    g.prepare_for_batch(md, **kw)
    for layer in layers:
        g.write_new_rows(layer, rows(g._fwd.tokens, layer), md)


def filled() -> HiSparseIndexGroup:
    """Requests 1, 2, 3 holding 12, 9 and 5 rows in every layer."""
    g = make_group()
    for rid in (1, 2, 3):
        g.add_request(rid)
    forward(g, md_of([(1, 12, 12), (2, 9, 9), (3, 5, 5)], 0))
    return g


def state(g: HiSparseIndexGroup) -> dict:
    c = g.hisparse_cache
    snap = snapshot(c)
    snap["epochs"] = list(c.requests.epochs)
    snap["lengths"] = {rid: [g.request_length(rid, i) for i in range(L)] for rid in c.live_requests()}
    step = g._step
    written = None if g._fwd is None else sorted(g._fwd.written)
    snap["step"] = (id(step), sorted(step.pending) if step is not None else None, written)
    return snap


def refused(g: HiSparseIndexGroup, md: SparseMLAMetadata, match: str, **kw) -> None:
    before = state(g)
    with pytest.raises(ValueError, match=match):
        g.prepare_for_batch(md, **kw)
    assert_same(before, state(g))
    if g._step is None or not g._step.pending:  # the cache's lengths count a pending step's layers
        check_cache(g.hisparse_cache)


@pytest.mark.parametrize("pad_to", [None, 4])
def test_the_first_bad_row_is_named_and_nothing_changes(pad_to):
    g = filled()
    cases = [
        ([(1, 1, 14), (9, 1, 1)], r"batch row 0: request 1 holds \[12, 12, 12\] rows per layer but the metadata "
                                  r"says its context before this forward is 13 \(seq_len 14 - query_len 1\)"),
        ([(9, 1, 1), (1, 1, 14)], r"batch row 0: request 9 is not live \(add_request first\)"),
        ([(1, 1, 13), (2, 1, 10), (3, 1, 5)], r"batch row 2: request 3 holds \[5, 5, 5\] rows per layer but the "
                                              r"metadata says its context before this forward is 4"),
        ([(3, 1, 6), (2, 1, 10), (4, 1, 1)], r"batch row 2: request 4 is not live"),
    ]
    for reqs, match in cases:
        refused(g, md_of(reqs, len(reqs)), match, pad_to=pad_to)
    forward(g, md_of([(1, 1, 13), (2, 1, 10), (3, 1, 6)], 3), pad_to=pad_to)
    assert [g.request_length(2, i) for i in range(L)] == [10] * L


def test_layers_that_differ_are_named_with_every_layers_rows():
    """A request appended in one layer only (the cache's per-layer path) holds
    different rows per layer: the façade names them all, the cache's step refuses it
    too, and nothing changes; once the other layers catch up, the batch goes through."""
    g = filled()
    c = g.hisparse_cache
    c.write(1, 2, rows(1, 7))
    refused(g, md_of([(1, 1, 13), (2, 1, 10)], 2), r"batch row 1: request 2 holds \[9, 10, 9\] rows per layer")
    refused(g, md_of([(2, 1, 11)], 1), r"request 2 holds \[9, 10, 9\] rows per layer but the metadata says its "
                                       r"context before this forward is 10")
    before = state(g)
    with pytest.raises(ValueError, match=r"request 2 holds \[9, 10, 9\] rows per layer: a step writes the same"):
        c.prepare_step(c.plan_write([1, 2], [1, 1]))
    assert_same(before, state(g))
    for layer in (0, 2):
        c.write(layer, 2, rows(1, 7))
    forward(g, md_of([(1, 1, 13), (2, 1, 11)], 2))
    assert [g.request_length(2, i) for i in range(L)] == [11] * L
    check_cache(c)


@pytest.mark.parametrize("pad_to", [None, 4])
def test_a_forward_cut_short_is_seen_as_before_it(pad_to):
    """Layers a forward did not write count as before it: the next forward is checked
    against those lengths (the error lists them per layer, the cut-short forward stays
    pending), and once prepared the layers are put back and every layer advances."""
    g = filled()
    md = md_of([(1, 1, 13), (3, 1, 6)], 2)
    forward(g, md, layers=[0], pad_to=pad_to)  # layer 0 written, 1 and 2 not
    assert [g.request_length(1, i) for i in range(L)] == [13, 12, 12]
    # layer 0 really holds the forward's row: the same row again would be a second one
    refused(g, md_of([(1, 1, 13), (3, 1, 6)], 2), r"batch row 0: request 1 holds \[13, 12, 12\] rows per layer",
            pad_to=pad_to)
    refused(g, md_of([(3, 1, 7), (1, 1, 14)], 2), r"batch row 0: request 3 holds \[6, 5, 5\] rows per layer",
            pad_to=pad_to)
    g.abandon_forward()
    g.free_request(1)
    g.free_request(3)
    forward(g, md_of([(2, 1, 10)], 1), pad_to=pad_to)
    assert [g.request_length(2, i) for i in range(L)] == [10] * L
    check_cache(g.hisparse_cache)


def test_a_forward_not_written_is_put_back_by_the_next():
    """Prepared and never written: the next forward of the same lengths is checked
    as before it and goes through (the first is put back)."""
    g = filled()
    md = md_of([(1, 1, 13), (2, 1, 10)], 2)
    g.prepare_for_batch(md)
    assert [g.request_length(1, i) for i in range(L)] == [12] * L
    forward(g, md_of([(2, 1, 10), (3, 3, 8)], 1))
    assert [g.request_length(rid, 0) for rid in (1, 2, 3)] == [12, 10, 8]
    forward(g, md_of([(1, 1, 13), (2, 1, 11)], 2))
    assert [[g.request_length(rid, i) for i in range(L)] for rid in (1, 2, 3)] == [[13] * L, [11] * L, [8] * L]
    check_cache(g.hisparse_cache)


def test_decode_token_ids_of_multi_token_decodes_and_padding():
    md = md_of([(5, 2, 7), (3, 2, 9), (4, 3, 3)], 2)
    assert md.decode_token_request_ids(6) == [5, 5, 3, 3, -1, -1]
    md1 = md_of([(5, 1, 7), (3, 1, 9)], 2)
    assert md1.decode_token_request_ids(3) == [5, 3, -1]
    assert md_of([(4, 3, 3)], 0).decode_token_request_ids(2) == [-1, -1]


@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_carried_from_the_last_equal_the_general_plan(seed, monkeypatch):
    """A decode step of the batch of the last one (the table as that step left it) is
    planned from what the last step carried (``DecodeCarry``, no summary of the table):
    the same plan lists and the same cache state as the general path, through rows
    that open blocks, cross into the reserved slot, batches that change order or
    members, prefills, frees and adds, forwards cut short, and padded buckets."""
    from hisparse.cache.write_carry import CarriedPlan
    from hisparse.cache.write_step import DecodeCarry

    rng = random.Random(seed)
    groups = [make_group(), make_group()]  # the second plans every step the general way
    live: dict[int, int] = {}  # request id -> rows in every layer
    last_batch: list[int] = []
    carried, followed = [], []
    lists, advance = DecodeCarry.lists, CarriedPlan.advance
    monkeypatch.setattr(DecodeCarry, "lists", lambda self, *a: carried.append(1) or lists(self, *a))
    monkeypatch.setattr(CarriedPlan, "advance", lambda self, *a: followed.append(1) or advance(self, *a))

    def run(reqs, num_decodes, layers=range(L), pad_to=None):
        md = md_of(reqs, num_decodes)
        plans = []
        for k, g in enumerate(groups):
            if k == 1:
                g.hisparse_cache.writer._carry = None
            forward(g, md, layers=layers, pad_to=pad_to)
            step = g._step
            plans.append((step.buffers.buf if step.buffers is not None else step.plan.buf).clone())
        assert torch.equal(plans[0], plans[1])
        a, b = (state(g) for g in groups)
        a["step"], b["step"] = a["step"][1:], b["step"][1:]  # (not the step objects' ids)
        assert_same(a, b)

    for _ in range(200):
        op = rng.random()
        if op < 0.12 and len(live) < 4:  # admit with a prefill of a few rows
            rid = rng.choice([i for i in range(1, 16) if i not in live])
            n = rng.randint(1, 20)
            for g in groups:
                g.add_request(rid)
            run([(rid, n, n)], 0)
            live[rid] = n
        elif op < 0.16 and live:  # free the longest (or any) request
            rid = max(live, key=live.get) if rng.random() < 0.7 else rng.choice(list(live))
            for g in groups:
                g.free_request(rid)
            del live[rid]
        elif live:
            same = [r for r in last_batch if r in live]
            batch = same if same and rng.random() < 0.8 else rng.sample(list(live), rng.randint(1, len(live)))
            cut = rng.random() < 0.08
            pad = 4 if rng.random() < 0.3 else None
            run([(r, 1, live[r] + 1) for r in batch], len(batch), layers=range(L) if not cut else [0], pad_to=pad)
            for r in batch:
                live[r] += 1
            if cut:  # the next forward is checked against the rows before this one: put it back
                for g in groups:
                    g.abandon_forward()
                for r in batch:
                    live[r] -= 1
                for g in groups:  # the cut-short request holds a row more in layer 0: only freed
                    for r in batch:
                        g.free_request(r)
                for r in batch:
                    del live[r]
            last_batch = batch
        for rid in [r for r, n in live.items() if n > 36]:  # keep inside the host pool
            for g in groups:
                g.free_request(rid)
            del live[rid]
    assert len(carried) > 20 and len(followed) > 10, (len(carried), len(followed))
    check_cache(groups[0].hisparse_cache)


def test_a_carried_decode_step_past_a_full_pool_is_a_capacity_error():
    """A decode step planned from what the last one carried, whose row opens a block
    when its request holds every block of the host pool: CapacityError (an engine
    preempts on it), nothing changed, as the general path says. The carried path looked
    the row's host block up before asking for the block: an IndexError past the block
    table's last column. Eager, the step follows the last step's lists (only the row
    that opens a block looks its host row up); padded, it is planned from the carry."""
    g = make_group()  # 48 host blocks of 4 rows
    n = 4 * 48 - 3
    g.add_request(1)
    forward(g, md_of([(1, n, n)], 0))
    for _ in range(3):  # the general path, one carried from it, one that follows: the pool is full
        forward(g, md_of([(1, 1, n + 1)], 1))
        n += 1
    assert g.hisparse_cache.writer._carry.follow is not None
    for pad_to in (None, 2):
        before = state(g)
        with pytest.raises(CapacityError, match="host pool full"):
            g.prepare_for_batch(md_of([(1, 1, n + 1)], 1), pad_to=pad_to)
        assert_same(before, state(g))
    check_cache(g.hisparse_cache)
    g.free_request(1)  # the pool is whole again
    g.add_request(2)
    forward(g, md_of([(2, 9, 9)], 0))
    forward(g, md_of([(2, 1, 10)], 1))
    check_cache(g.hisparse_cache)


def test_a_carry_is_not_used_once_the_table_changed_under_the_same_batch():
    """What a decode step carries for the next one holds only while the request table is
    as that step left it. Changes that keep the batch (no add or free: the same
    WriteBatch comes back) must still drop it: a row appended to every layer outside a
    forward (the cache's per-layer path), a prepared forward abandoned before any write,
    and one prepared again without its layers written. Each next step goes through with
    the plan and state of a group that never carries; a stale carry plans from the old
    rows (the step is refused, or writes the wrong positions)."""
    from hisparse.cache.write_carry import CarriedPlan
    from hisparse.cache.write_step import DecodeCarry

    groups = [make_group(), make_group()]  # the second plans every step the general way
    carried = []
    lists, advance = DecodeCarry.lists, CarriedPlan.advance
    live = {1: 12, 2: 9}

    def both(fn):
        for g in groups:
            fn(g)

    def step(layers=range(L), pad_to=None, prepare_only=False):
        md = md_of([(r, 1, n + 1) for r, n in live.items()], len(live))
        plans = []
        for k, g in enumerate(groups):
            if k == 1:
                g.hisparse_cache.writer._carry = None
            g.prepare_for_batch(md, pad_to=pad_to)
            if not prepare_only:
                for layer in layers:
                    g.write_new_rows(layer, rows(g._fwd.tokens, layer), md)
            s = g._step
            plans.append((s.buffers.buf if s.buffers is not None else s.plan.buf).clone())
        assert torch.equal(plans[0], plans[1])
        a, b = (state(g) for g in groups)
        a["step"], b["step"] = a["step"][1:], b["step"][1:]
        assert_same(a, b)

    both(lambda g: [g.add_request(r) for r in live])
    both(lambda g: forward(g, md_of([(r, n, n) for r, n in live.items()], 0)))
    import unittest.mock as mock
    with mock.patch.object(DecodeCarry, "lists", lambda self, *a: carried.append(1) or lists(self, *a)), \
            mock.patch.object(CarriedPlan, "advance", lambda self, *a: carried.append(2) or advance(self, *a)):
        for pad_to in (None, 4):
            n_carried = len(carried)
            for _ in range(3):  # the second step plans from the first's carry, the third from the second's lists
                step(pad_to=pad_to)
                live = {r: n + 1 for r, n in live.items()}
            assert {1, 2} <= set(carried[n_carried:]) and groups[0].hisparse_cache.writer._carry.follow is not None
            n_carried = len(carried)
            # a row appended to every layer of request 2 by the per-layer path
            both(lambda g: [g.hisparse_cache.write(layer, 2, rows(1, 5))[0] for layer in range(L)])
            live[2] += 1
            step(pad_to=pad_to)
            live = {r: n + 1 for r, n in live.items()}
            # prepared, nothing written, abandoned: the next forward has the same rows
            step(pad_to=pad_to, prepare_only=True)
            both(lambda g: g.abandon_forward())
            step(pad_to=pad_to)
            live = {r: n + 1 for r, n in live.items()}
            # prepared and never written: the next forward replaces it
            step(pad_to=pad_to, prepare_only=True)
            step(pad_to=pad_to)
            live = {r: n + 1 for r, n in live.items()}
            step(pad_to=pad_to)  # and carries again
            live = {r: n + 1 for r, n in live.items()}
            assert len(carried) > n_carried
    for g in groups:
        assert [g.request_length(r, i) for r in live for i in range(L)] == [n for n in live.values() for _ in range(L)]
        check_cache(g.hisparse_cache)


def test_steps_that_follow_take_host_plans_in_turn_only_once_done():
    """On a CPU cache the eager steps of a chain that follow one another take two plans
    in turn (their lists copied in, no plan made per step). A plan is taken again only
    when the step that last took it is done: while that step still has layers to write
    (prepared below the façade, with nothing replaced), the next step gets a plan of its
    own, and the pending step's lists stay as they were. Every step's lists and the
    cache's state equal those of a cache that plans every step the general way, and the
    rows land where they do there."""
    from hisparse.cache.cache import HiSparseCache
    from hisparse.cache.write_carry import HostPlans

    cfg = HiSparseConfig(num_layers=L, row_bytes=656, top_k=4, device_buffer_size=4, max_num_reqs=3,
                         host_block_size=4, host_pool_tokens=4 * 32, max_request_id=16, device="cpu")
    caches = [HiSparseCache(cfg, kernels="torch") for _ in range(2)]  # the second plans the general way
    taken = []
    take = HostPlans.take
    live = {1: 6, 2: 9, 3: 5}  # every row past S = 4: each step carries
    for c in caches:
        for rid, n in live.items():
            c.add_request(rid)
            batch = c.plan_write([rid], [n])
            for layer in range(L):
                c.write(layer, batch, rows(n, layer))

    def prepare(replaces):
        steps = []
        for k, c in enumerate(caches):
            if k == 1:
                c.writer._carry = None
            steps.append(c.prepare_step(c.plan_write(list(live), [1] * len(live)), replaces=replaces[k]))
        assert torch.equal(steps[0].plan.buf, steps[1].plan.buf)
        for r in live:
            live[r] += 1
        return steps

    def write(steps, seed):
        for c, s in zip(caches, steps):
            for layer in range(L):
                c.write_step(layer, s, rows(len(live), seed + layer))

    import unittest.mock as mock
    with mock.patch.object(HostPlans, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1]):
        last = [None, None]
        for i in range(4):  # general, carried, then two that follow: plans 0 and 1 taken
            last = prepare(last)
            write(last, 10 * i)
        assert len(taken) == 2 and all(p is not None for p in taken)
        held = prepare(last)  # plan 0 again (its step is done); not written yet
        assert taken[-1] is taken[0] and held[0].plan is taken[0]
        kept = held[0].plan.buf.clone()
        nxt = prepare([None, None])  # plan 1 again (done); nothing replaced
        assert nxt[0].plan is taken[1]
        after = prepare([None, None])  # plan 0's step still has every layer to write: a plan of its own
        assert taken[-1] is None and after[0].plan is not taken[0]
        assert torch.equal(held[0].plan.buf, kept)
        for i, steps in enumerate((held, nxt, after)):  # each step writes its own rows, in order
            write(steps, 50 + 10 * i)
    a, b = (snapshot(c) for c in caches)
    assert_same(a, b)
    for c in caches:
        check_cache(c)
