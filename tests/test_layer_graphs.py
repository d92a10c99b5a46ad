"""Per-layer graphs of padded forwards (``hisparse.engine.layer_graphs``), on CPU.

The CUDA backend is replaced by ``graph_trace.RecordingGraphs``: a capture records the
cache's launch-function calls, a replay runs them again. What these tests pin is the
part that is not CUDA: which calls capture and which replay, that the checks and the
bookkeeping around a replay leave the same cache as eager calls (every state tensor,
hot and host rows, physical indices, over a trace with joins, leaves and several
buckets), and that a refused call or a failed capture changes nothing. The CUDA graphs
themselves: tests/test_layer_graphs_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from graph_trace import (Runner, TraceShape, Truth, assert_same_state, cache_state,
                         decode_md, join, make_group, plan_trace, run_mixed, run_pair)
from hisparse import HiSparseConfig
from hisparse.config import Kernels
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata


@pytest.mark.parametrize("kernels,query_len,seed,inputs,stand_in", [
    ("torch", 1, 0, "new", "recording"), ("torch", 2, 1, "new", "recording"), ("triton", 1, 2, "new", "kernels"),
    ("torch", 2, 3, "in_place", "recording"), ("triton", 2, 4, "in_place", "kernels"),
    ("torch", 1, 5, "own", "recording"), ("triton", 2, 6, "own", "kernels")])
def test_layer_graph_forwards_equal_eager(kernels, query_len, seed, inputs, stand_in):
    """inputs: new tensors every call (copied into the static buffers), the group's
    ``layer_input_buffers``, or the engine's own buffers (steady addresses: read in place
    by graphs of their own)."""
    shape = TraceShape(query_len=query_len)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=10 if kernels == "triton" else 24, seed=seed)
    a = Runner(shape, "eager", "cpu", kernels, truth)
    b = Runner(shape, "padded", "cpu", kernels, truth, layer_graphs=stand_in, in_place=inputs == "in_place",
               own_buffers=inputs == "own")
    run_pair(trace, a, b)
    a.check_rows()
    b.check_rows()
    counts = b.group.layer_graphs()
    assert counts["replays"] > counts["captures"] > 0, counts  # the trace replays, not only warms up
    assert b.group.stats()["total"]["misses"] > 0
    if inputs == "own":  # each static graph's capture copied once; a graph of their own after that
        assert counts["in_place_graphs"] > 0, counts
        assert counts["copies"] == counts["captures"] - counts["in_place_graphs"], counts
    elif inputs == "in_place":
        assert counts["copies"] == counts["in_place_graphs"] == 0, counts




def _step(g, truth, lens, rids, bucket, topk_of, *, fail_capture_at=()):
    """One padded decode step of ``rids`` (bucket ``bucket``); ``fail_capture_at``:
    the (call, layer) pairs whose capture fails once (then retried). Returns the physical
    indices."""
    md = decode_md(rids, lens)
    g.prepare_for_batch(md, pad_to=bucket)
    out = []
    for layer in range(g.config.num_layers):
        rows = torch.cat([truth.rows(layer, r)[lens[r]:lens[r] + 1] for r in rids]
                         + [torch.zeros((bucket - len(rids), 656), dtype=torch.uint8)])
        tk = torch.full((bucket, g.config.top_k), -1, dtype=torch.int32)
        tk[:len(rids)] = topk_of(layer)
        for call in ("write", "convert"):
            fn = (lambda: g.write_new_rows(layer, rows, md)) if call == "write" else \
                 (lambda: out.append(g.convert_decode_logical_to_physical_topk(layer, tk, md).clone()))
            if (call, layer) in fail_capture_at:
                before = cache_state(g)
                g._layer_graphs.backend.fail_capture = True
                with pytest.raises(RuntimeError, match="injected"):
                    fn()
                assert_same_state(before, cache_state(g), f"a failed {call} capture changed {{}}")
            fn()
    for r in rids:
        lens[r] += 1
    return out


def test_capture_that_fails_changes_nothing_and_the_retry_matches():
    shape = TraceShape(layers=2)
    truth = Truth(shape)
    runs = {}
    for name, graphs in (("eager", None), ("graphs", "recording")):
        g = make_group(shape, "cpu", "torch", layer_graphs=graphs)
        lens: dict[int, int] = {}
        join(g, 1, 9, truth, lens)
        join(g, 2, 21, truth, lens)
        phys = []
        for step in range(4):
            def topk_of(layer, step=step):
                return torch.tensor([[p % (lens[r] + 1) for p in range(step + layer, step + layer + 8)]
                                     for r in (1, 2)], dtype=torch.int32)
            # the bucket's captures happen at its second step: fail one of each kind there
            fail = (("write", 1), ("convert", 0)) if graphs and step == 1 else ()
            phys.append(_step(g, truth, lens, [1, 2], 2, topk_of, fail_capture_at=fail))
        runs[name] = (g, phys)
    (ga, pa), (gb, pb) = runs["eager"], runs["graphs"]
    for s, (x, y) in enumerate(zip(pa, pb)):
        for layer, (u, v) in enumerate(zip(x, y)):
            assert torch.equal(u, v), f"step {s} layer {layer}"
    assert_same_state(cache_state(ga), cache_state(gb))
    assert gb.layer_graphs()["replays"] > 0


def _one_request(shape: TraceShape, kernels: str = "torch", stand_in: str = "recording"):
    """A group with a per-layer graphs stand-in and request 1 joined with 6 rows:
    (group, truth, lengths)."""
    truth = Truth(shape)
    g = make_group(shape, "cpu", kernels, layer_graphs=stand_in)
    lens: dict[int, int] = {}
    join(g, 1, 6, truth, lens)
    return g, truth, lens


def test_refused_calls_launch_nothing():
    shape = TraceShape(layers=2)
    g, truth, lens = _one_request(shape)
    for step in range(3):  # warm-up, capture, replay
        md = decode_md([1], lens)
        g.prepare_for_batch(md, pad_to=2)
        rows = torch.zeros((2, 656), dtype=torch.uint8)
        rows[0] = truth.rows(0, 1)[lens[1]]
        tk = torch.full((2, shape.top_k), -1, dtype=torch.int32)
        tk[0, 0] = 0
        g.write_new_rows(0, rows, md)
        before = cache_state(g)
        n = dict(g.layer_graphs())
        with pytest.raises(ValueError, match="already written"):
            g.write_new_rows(0, rows, md)
        with pytest.raises(ValueError, match="write_new_rows must run before"):
            g.convert_decode_logical_to_physical_topk(1, tk, md)
        assert_same_state(before, cache_state(g))
        assert g.layer_graphs() == n, "a refused call captured or replayed"
        g.convert_decode_logical_to_physical_topk(0, tk, md)
        g.write_new_rows(1, rows, md)
        g.convert_decode_logical_to_physical_topk(1, tk, md)
        lens[1] += 1
    # step 1 eager, step 2 captures and replays, step 3 replays: 2 calls x 2 layers each;
    # the inputs are new tensors each step: every replay copies them
    assert g.layer_graphs() == {"graphs": 4, "eager": 4, "captures": 4, "replays": 8, "copies": 8,
                                "in_place_graphs": 0, "write_replays": 4, "convert_replays": 4}


def test_unpadded_and_non_waiting_calls_stay_eager():
    shape = TraceShape(layers=1)
    g, truth, lens = _one_request(shape)
    for pad in (None, None, None):
        md = decode_md([1], lens)
        g.prepare_for_batch(md, pad_to=pad)
        g.write_new_rows(0, truth.rows(0, 1)[lens[1]:lens[1] + 1], md)
        g.convert_decode_logical_to_physical_topk(0, torch.zeros((1, shape.top_k), dtype=torch.int32), md)
        lens[1] += 1
    assert g.layer_graphs() == {"graphs": 0, "eager": 0, "captures": 0, "replays": 0, "copies": 0,
                                "in_place_graphs": 0, "write_replays": 0, "convert_replays": 0}
    for _ in range(3):  # padded, but the conversion does not wait: eager every time
        md = decode_md([1], lens)
        g.prepare_for_batch(md, pad_to=2)
        rows = torch.zeros((2, 656), dtype=torch.uint8)
        rows[0] = truth.rows(0, 1)[lens[1]]
        g.write_new_rows(0, rows, md)
        g.convert_decode_logical_to_physical_topk(0, torch.zeros((2, shape.top_k), dtype=torch.int32), md,
                                                  wait=False)
        g.wait_for_staging(0)
        lens[1] += 1
    c = g.layer_graphs()
    assert (c["eager"], c["captures"], c["replays"]) == (1, 1, 2), c  # the writes only


def test_layer_graphs_option_checks():
    cfg = HiSparseConfig(num_layers=1, row_bytes=656, top_k=8, device_buffer_size=16, max_num_reqs=2,
                         host_block_size=4, host_pool_tokens=64, device="cpu")
    with pytest.raises(ValueError, match="validate=False"):
        HiSparseIndexGroup(cfg, layer_graphs=True)
    with pytest.raises(ValueError, match="CUDA device"):
        HiSparseIndexGroup(cfg, validate=False, layer_graphs=True)
    with pytest.raises(TypeError, match="bool"):
        HiSparseIndexGroup(cfg, validate=False, layer_graphs=1)
    # kernels= as a string or a Kernels member (the tools pass members): the torch kernels are
    # refused, the others pass on to the device check
    for k in ("torch", Kernels.TORCH):
        with pytest.raises(ValueError, match="needs the Triton kernels"):
            HiSparseIndexGroup(cfg, validate=False, kernels=k, layer_graphs=True)
    for k in ("auto", "triton", Kernels.AUTO, Kernels.TRITON):
        with pytest.raises(ValueError, match="CUDA device"):
            HiSparseIndexGroup(cfg, validate=False, kernels=k, layer_graphs=True)
    assert HiSparseIndexGroup(cfg, validate=False).layer_graphs() is None


@pytest.mark.parametrize("kernels,steps", [("torch", 30)])
def test_layer_graphs_mixed_with_eager_prefetch_and_non_waiting_calls(kernels, steps):
    run_mixed("cpu", kernels, "recording", steps=steps)


def test_layer_input_buffers_are_read_in_place(monkeypatch):
    """Rows and top-k written into ``layer_input_buffers`` are not copied again by the
    calls (eager warm-up, capture or replays); the buffers are refused outside padded
    layer-graph forwards."""
    shape = TraceShape()
    truth = Truth(shape)
    g = make_group(shape, "cpu", "torch", layer_graphs="recording")
    lens = {0: 5, 1: 6}
    for rid, n in lens.items():
        g.add_request(rid)
        md = SparseMLAMetadata.build(request_ids=[rid], query_lens=[n], seq_lens=[n], num_decodes=0)
        g.prepare_for_batch(md)
        with pytest.raises(ValueError, match="pad_to"):
            g.layer_input_buffers(md)
        for layer in range(shape.layers):
            g.write_new_rows(layer, truth.rows(layer, rid)[:n], md)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *a, **k):
        copies.append(self.data_ptr())
        return real_copy(self, src, *a, **k)
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    first = None
    for step in range(4):  # warm-up, capture, replays
        md = decode_md([0, 1], lens)
        g.prepare_for_batch(md, pad_to=2)
        for layer in range(shape.layers):
            rows, topk = g.layer_input_buffers(md)
            first = first or (rows, topk)
            assert rows is first[0] and topk is first[1]  # one pair per bucket, every layer
            assert rows.shape == (2, 656) and rows.dtype == torch.uint8
            assert topk.shape == (2, shape.top_k) and topk.dtype == torch.int32
            real_copy(rows, torch.stack([truth.rows(layer, r)[lens[r]] for r in (0, 1)]))
            tk = torch.full((2, shape.top_k), -1, dtype=torch.int32)
            tk[0, :3], tk[1, :2] = torch.arange(3), torch.tensor([5, 0])
            real_copy(topk, tk)
            before = len(copies)
            g.write_new_rows(layer, rows if step % 2 else rows[:], md)  # a same-layout view: no copy either
            phys = g.convert_decode_logical_to_physical_topk(layer, topk, md)
            assert rows.data_ptr() not in copies[before:] and topk.data_ptr() not in copies[before:], step
            assert torch.all(phys[:, :2] >= 0) and torch.all(phys[0, 3:] == -1)
        for r in lens:
            lens[r] += 1
    monkeypatch.undo()
    c = g.layer_graphs()
    assert c["replays"] > c["captures"] > 0, c
    g2 = make_group(shape, "cpu", "torch")
    g2.add_request(0)
    md = SparseMLAMetadata.build(request_ids=[0], query_lens=[1], seq_lens=[1], num_decodes=1)
    g2.prepare_for_batch(md, pad_to=2)
    with pytest.raises(ValueError, match="layer_graphs=True"):
        g2.layer_input_buffers(md)


def _warm_capture_replay(g, truth, lens, steps=3, layers=None):
    """Decode forwards of request 1 padded to 2 (warm-up, capture, replays). The inputs
    are new tensors, all kept alive as long as the group, so no two calls pass a tensor
    at the same address: every replay copies its input (no graph of a tensor's own)."""
    alive = g.__dict__.setdefault("_test_inputs_alive", [])
    for _ in range(steps):
        md = decode_md([1], lens)
        g.prepare_for_batch(md, pad_to=2)
        for layer in range(layers if layers is not None else g.config.num_layers):
            rows = torch.zeros((2, 656), dtype=torch.uint8)
            rows[0] = truth.rows(layer, 1)[lens[1]]
            tk = torch.full((2, g.config.top_k), -1, dtype=torch.int32)
            tk[0, :2] = torch.tensor([0, lens[1]])
            alive += [rows, tk]
            g.write_new_rows(layer, rows, md)
            g.convert_decode_logical_to_physical_topk(layer, tk, md)
        lens[1] += 1


def test_a_replayed_write_refuses_a_released_pool():
    """The host mirror writes the pool over UVA; in a graph its launcher's pinning check
    ran only at capture, so a replayed write checks the pool itself (refused before any
    launch, the layer left pending). ``KernelGraphs`` replays the kernels alone."""
    shape = TraceShape(layers=1)
    g, truth, lens = _one_request(shape, "triton", "kernels")
    _warm_capture_replay(g, truth, lens)
    assert g.layer_graphs()["replays"] == 4
    c = g.hisparse_cache
    c.kernel_set.pinned.dev = torch.device("cuda", 0)  # as on a GPU: the pool must be pinned
    c.pool.buffer.pinned = False  # what release() / close() leave
    md = decode_md([1], lens)
    g.prepare_for_batch(md, pad_to=2)
    before, n = cache_state(g), dict(g.layer_graphs())
    with pytest.raises(ValueError, match="not pinned"):
        g.write_new_rows(0, torch.zeros((2, 656), dtype=torch.uint8), md)
    assert_same_state(before, cache_state(g))
    assert g.layer_graphs() == n and 0 in g._step.pending


def test_eager_side_stream_calls_refuse_the_input_buffers():
    """prefetch and wait=False conversions read their top-k on the staging stream after
    they return; the engine overwrites ``layer_input_buffers``' top-k for the next layer
    meanwhile, so those calls refuse it (a view of it too), before launching anything."""
    shape = TraceShape(layers=2)
    g, truth, lens = _one_request(shape)
    md = decode_md([1], lens)
    g.prepare_for_batch(md, pad_to=2)
    rows, topk = g.layer_input_buffers(md)
    topk.fill_(-1)
    topk[0, 0] = 0
    rows.zero_()
    g.write_new_rows(0, rows, md)
    before = cache_state(g)
    with pytest.raises(ValueError, match="staging stream"):
        g.prefetch(1, topk, md)
    with pytest.raises(ValueError, match="staging stream"):
        g.convert_decode_logical_to_physical_topk(0, topk[:], md, wait=False)
    assert_same_state(before, cache_state(g))
    g.prefetch(1, topk.clone(), md)  # a tensor of the engine's own goes through
    g.convert_decode_logical_to_physical_topk(0, topk.clone(), md, wait=False)
    g.wait_for_staging(0)


def test_a_new_staging_launch_shape_captures_again():
    """The staging copy's grid is part of a captured graph: setting ``stage_programs``
    after a capture warms up and captures the conversions again instead of replaying
    the old launch shape."""
    shape = TraceShape(layers=1)
    g, truth, lens = _one_request(shape)
    _warm_capture_replay(g, truth, lens)
    c0 = dict(g.layer_graphs())
    g.hisparse_cache.stager.stage_programs = 3
    _warm_capture_replay(g, truth, lens, steps=2)
    c1 = g.layer_graphs()
    assert c1["eager"] == c0["eager"] + 1 and c1["captures"] == c0["captures"] + 1, (c0, c1)
    assert c1["graphs"] == c0["graphs"] + 1


def _steps_with_buffers(g, truth, lens, schedule):
    """Decode forwards of request 1 padded to 2, layer 0 only, one per entry of
    ``schedule``: (rows, top-k) tensors of the caller's own that the step fills and passes.
    Returns each step's physical indices."""
    out = []
    for rows, tk in schedule:
        md = decode_md([1], lens)
        g.prepare_for_batch(md, pad_to=2)
        rows.zero_()
        rows[0] = truth.rows(0, 1)[lens[1]]
        tk.fill_(-1)
        tk[0, :2] = torch.tensor([0, lens[1]])
        g.write_new_rows(0, rows, md)
        out.append(g.convert_decode_logical_to_physical_topk(0, tk, md).clone())
        lens[1] += 1
    return out


@pytest.mark.parametrize("case", ["bounded", "alternating", "layouts"])
def test_graphs_of_engine_tensors_need_a_recurring_address_and_are_bounded(case):
    """A tensor of the caller's gets a graph of its own only when its address is among the
    last RECENT_INPUTS distinct addresses the key copied (and once the static buffer's
    graph exists), at most IN_PLACE_GRAPHS per (call, layer, bucket); a tensor with
    other strides or a misaligned address never; every other call copies. The physical indices and the cache equal an eager run's."""
    from hisparse.engine.layer_graphs import IN_PLACE_GRAPHS, RECENT_INPUTS
    assert IN_PLACE_GRAPHS == 2 and RECENT_INPUTS >= 2  # the schedules below count on these
    shape = TraceShape(layers=1)
    truth = Truth(shape)
    a, b, c = [(torch.empty((2, 656), dtype=torch.uint8), torch.empty((2, shape.top_k), dtype=torch.int32))
               for _ in range(3)]
    wide = torch.empty((2, 2 * shape.top_k), dtype=torch.int32)
    strided = (a[0], wide[:, :shape.top_k])  # a's rows, a top-k with strides (2K, 1)
    if case == "bounded":
        # warm-up, static capture (both calls copy), a again (own graphs), b (copies), b
        # (own graphs), c twice (past the bound: copies), a (its graphs), the strided top-k
        # twice (its conversions copy; the write replays a's graph)
        schedule = [a, a, a, b, b, c, c, a, strided, strided]
        copies, own = 2 + 2 + 4 + 2, 2 * IN_PLACE_GRAPHS
    elif case == "alternating":
        # a caching allocator's two addresses in turn: warm-up (a), static capture (b copies),
        # a (copies), then b and a recur (own graphs), b (its graphs)
        schedule = [a, b, a, b, a, b]
        copies, own = 2 + 2, 4
    else:
        # rows 4 bytes past an aligned address (always copied), and two top-k tensors at
        # one address with other strides: the packed one gets a graph, the strided one
        # does not (nor may it replay the packed one's)
        buf = torch.empty(2 * 656 + 16, dtype=torch.uint8)
        rows_off = buf[4:4 + 2 * 656].view(2, 656)
        assert rows_off.data_ptr() % 16
        base = torch.empty((2, 2 * shape.top_k), dtype=torch.int32)
        packed = base.view(-1)[:2 * shape.top_k].view(2, shape.top_k)
        assert packed.data_ptr() == base[:, :shape.top_k].data_ptr()
        schedule = [(rows_off, packed)] * 4 + [(rows_off, base[:, :shape.top_k])] * 2
        copies, own = 2 + 4 + 2, 1
    runs = {}
    for name, graphs in (("eager", None), ("graphs", "recording")):
        g = make_group(shape, "cpu", "torch", layer_graphs=graphs)
        lens: dict[int, int] = {}
        join(g, 1, 6, truth, lens)
        runs[name] = (g, _steps_with_buffers(g, truth, lens, schedule))
    (ga, pa), (gb, pb) = runs["eager"], runs["graphs"]
    for s, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"step {s}"
    assert_same_state(cache_state(ga), cache_state(gb))
    n = gb.layer_graphs()
    assert n["eager"] == 2 and n["in_place_graphs"] == own and n["copies"] == copies, n
    assert n["replays"] == 2 * (len(schedule) - 1), n
