"""CUDA graphs as a mode of the cache's calls (``hisparse.cache.graphs``), on CPU.

A planned call's eager run equals the eager call (results, state, counters); a run with
a replay does the eager call's checks and bookkeeping around whatever the replay
enqueues, and the launches it stands for are the planned call's ``launch``; a refused
call changes nothing. Also pinned: the cache's public surface (issue 44: at most 20
public methods, no graph-mode doubles).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.write_step import StepCapacity
from invariants import assert_same, check_cache, snapshot

I32, U8 = torch.int32, torch.uint8
ROW_BYTES = 16


def _cfg(**kw) -> HiSparseConfig:
    base = dict(num_layers=2, host_pool_tokens=192, row_bytes=ROW_BYTES, top_k=4, device_buffer_size=6,
                max_num_reqs=4, max_query_len=1, host_block_size=4, max_request_id=10, device="cpu")
    base.update(kw)
    return HiSparseConfig(**base)


def _twins(kernels: str, **kw) -> tuple[HiSparseCache, HiSparseCache]:
    """Two caches holding the same three requests of 20 rows in every layer."""
    out = []
    for _ in range(2):
        c = HiSparseCache(_cfg(**kw), kernels=kernels)
        for rid in (1, 2, 3):
            c.add_request(rid)
        g = torch.Generator().manual_seed(5)
        for layer in range(c.cfg.num_layers):
            c.write(layer, c.plan_write([1, 2, 3], [20, 20, 20]),
                    torch.randint(0, 256, (60, ROW_BYTES), dtype=U8, generator=g))
        out.append(c)
    return out[0], out[1]


def _topks(steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 20, (3, 4), dtype=I32, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_planned_resolve_runs_as_the_eager_call(kernels):
    """``plan_resolve(...).run(topk)`` and ``run(replay=...)`` over the planned call's
    ``launch`` leave the cache as ``resolve(..., validate=False)`` does, step after step."""
    a, b = _twins(kernels)
    ids = torch.tensor([1, 2, 3], dtype=I32)
    static = torch.empty((3, 4), dtype=I32)
    call = b.graphs.plan_resolve(0, ids, static)
    epochs = list(b.requests.epochs)
    for i, tk in enumerate(_topks(6, seed=1)):
        ra = a.resolve(0, ids, tk, validate=False)
        if i % 2:
            rb = call.run(tk)
        else:
            static.copy_(tk)
            rb = call.run(replay=lambda: call.launch(static))
            assert rb.event is None
        assert torch.equal(ra.physical, rb.physical) and torch.equal(ra.valid_counts, rb.valid_counts)
        assert_same(snapshot(a), snapshot(b))
    assert b.requests.epochs[0] == epochs[0] + 6, "each run counts as a resolve of the layer"
    check_cache(b)


def test_a_run_takes_the_top_k_or_a_replay():
    _, c = _twins("torch")
    call = c.graphs.plan_resolve(0, torch.tensor([1, 2, 3], dtype=I32), torch.zeros((3, 4), dtype=I32))
    before = snapshot(c)
    with pytest.raises(ValueError, match="not both"):
        call.run()
    with pytest.raises(ValueError, match="not both"):
        call.run(torch.zeros((3, 4), dtype=I32), replay=lambda: None)
    with pytest.raises(ValueError, match="planned for"):
        call.run(torch.zeros((2, 4), dtype=I32))
    assert_same(before, snapshot(c))


def test_plan_resolve_refuses_what_an_unchecked_resolve_refuses():
    _, c = _twins("torch")
    before = snapshot(c)
    with pytest.raises(TypeError, match="int32 req_ids"):
        c.graphs.plan_resolve(0, torch.tensor([1, 2, 3]), torch.zeros((3, 4), dtype=I32))
    with pytest.raises(ValueError, match="layer"):
        c.graphs.plan_resolve(5, torch.tensor([1, 2, 3], dtype=I32), torch.zeros((3, 4), dtype=I32))
    assert_same(before, snapshot(c))


def test_a_resident_plan_is_refused_once_a_request_is_hot():
    """A call planned while every live request was resident takes the resident path; once
    a request is hot, its run is refused before anything changes."""
    c = HiSparseCache(_cfg(device_pool_rows=64 + 2 * 64), kernels="torch")
    c.add_request(1)
    for layer in range(2):
        c.write(layer, 1, torch.full((10, ROW_BYTES), 3, dtype=U8))
    assert c.graphs.all_resident() and c.graphs.resident_resolve()
    ids = torch.tensor([1], dtype=I32)
    call = c.graphs.plan_resolve(0, ids, torch.zeros((1, 4), dtype=I32))
    assert call.resident
    res = call.run(torch.tensor([[0, 1, 2, 3]], dtype=I32))
    assert res.valid_counts.tolist() == [4]
    c.add_request(2)
    for layer in range(2):  # more than the pool's pages hold: request 1 or 2 is demoted
        c.write(layer, 2, torch.full((130, ROW_BYTES), 4, dtype=U8))
    assert not c.graphs.all_resident()
    before = snapshot(c)
    with pytest.raises(ValueError, match="plan it again"):
        call.run(torch.tensor([[0, 1, 2, 3]], dtype=I32))
    assert_same(before, snapshot(c))
    with pytest.raises(ValueError, match="hot"):
        with c.graphs.resident_capture():
            pass


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_planned_write_runs_as_write_step(kernels):
    """A padded step's ``plan_write(layer, step).run(rows)`` equals ``write_step``; a run
    with a replay of the planned call's ``launch`` leaves the same cache; a second run of
    a written layer is refused and changes nothing."""
    a, b = _twins(kernels)
    cap = StepCapacity(requests=4, tokens=4)
    g = torch.Generator().manual_seed(3)
    for step_i in range(3):
        rows = torch.randint(0, 256, (4, ROW_BYTES), dtype=U8, generator=g)
        sa = a.prepare_step(a.plan_write([1, 2, 3], [1, 1, 1]), capacity=cap)
        sb = b.prepare_step(b.plan_write([1, 2, 3], [1, 1, 1]), capacity=cap)
        for layer in range(2):
            a.write_step(layer, sa, rows)
            call = b.graphs.plan_write(layer, sb)
            if (step_i + layer) % 2:
                call.run(rows)
            else:
                call.run(replay=lambda: call.launch(rows))
            before = snapshot(b)
            with pytest.raises(ValueError, match="already written"):
                b.graphs.plan_write(layer, sb)
            with pytest.raises(ValueError, match="already written"):
                call.run(replay=lambda: pytest.fail("a refused run replayed"))
            assert_same(before, snapshot(b))
        assert_same(snapshot(a), snapshot(b))
        assert b.request(2).lengths == (21 + step_i, 21 + step_i)
    check_cache(b)


def test_a_capture_keeps_every_event_and_reports_what_it_recorded():
    """On CPU the events are None; the bookkeeping still holds: flags unchanged by a
    capture, the events it recorded reported, a replay marks them recorded by a replay."""
    _, c = _twins("torch")
    cs = c.streams
    before = cs.flags()

    def capture():
        cs.stage[1].records += 1  # what a captured launch's record does to the counter
        return "graph"

    got = c.graphs.capture(capture)
    assert got.graph == "graph" and got.events == [cs.stage[1]]
    assert cs.flags() == before
    got.replayed()
    assert (cs.stage[1].recorded, cs.stage[1].in_capture) == (True, True)


RETIRED = ("resolve_by", "resolve_replay", "launch_resolve", "check_resolve", "write_step_by", "launch_write_step",
           "check_write_step", "resolve_split", "append_rows", "append_rows_batch", "append_token_rows",
           "lend_events", "return_events", "note_replay", "resident_capture", "join_backup")


def test_the_cache_has_at_most_20_public_methods_and_no_graph_doubles():
    public = [n for n, _ in inspect.getmembers(HiSparseCache) if not n.startswith("_")]
    assert len(public) <= 20, public
    assert not set(RETIRED) & set(public)
    assert not [n for n in public if n.endswith("_by") or n.endswith("_replay") or n.startswith("launch_")]
    from hisparse.cache.stager import CacheStreams
    assert not {"lend_events", "return_events", "restore_flags", "forget_captured"} & set(dir(CacheStreams))
