"""``DecodeLayer(..., graphs=True)`` on the GPU: whole decode layers captured once per
(layer, shape) and replayed from eager calls give the eager layer's outputs and leave
its cache state, bit for bit, over random steps with misses, in both overlap modes and
whichever way the inputs come (copied into the static buffers, the buffers themselves,
an engine's tensors read in place once their addresses recur); a refused call changes
nothing; the graph count stays within ``max_graphs``."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.attention.triton_backend import TritonBackend
from hisparse.decode import DecodeLayer

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs CUDA", allow_module_level=True)

from test_overlap_gpu import B, DEV, I32, SM, STATE, make, topk  # noqa: E402


def _state_equal(a, b, what) -> None:
    torch.cuda.synchronize()
    for n in STATE:
        assert torch.equal(getattr(a.state, n), getattr(b.state, n)), (what, n)
    assert torch.equal(a.hot, b.hot), what


@pytest.mark.parametrize("mode", ["serial", "split"])
def test_graph_layers_equal_the_eager_layer(mode):
    a, b = make(), make()
    eager = DecodeLayer(a, TritonBackend(validate=False), overlap=mode)
    graphed = DecodeLayer(b, TritonBackend(validate=False), overlap=mode, graphs=True)
    ids = torch.arange(B, dtype=I32, device=DEV)
    rng = random.Random(3)
    g = torch.Generator(device="cpu").manual_seed(4)
    persistent_q = torch.empty((B, 128, 576), dtype=torch.bfloat16, device=DEV)
    persistent_tk = torch.empty((B, 256), dtype=I32, device=DEV)
    for step in range(14):
        layer = step % 2
        tk = topk(rng, 0.5 + 0.1 * (step % 5))
        q = (torch.randn((B, 128, 576), generator=g) * 0.3).to(DEV, torch.bfloat16)
        if step < 4:  # an engine's q not 16-byte aligned: the first calls (eager) compile nothing the capture needs
            buf = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device=DEV)
            q = buf[4:4 + q.numel()].view(q.shape).copy_(q)
            assert q.data_ptr() % 16
        want = eager(layer, ids, tk, q, sm_scale=SM)
        ids_in = ids
        if step >= 8:  # the same tensors every step: read in place once their addresses recur
            persistent_q.copy_(q)
            persistent_tk.copy_(tk)
            q, tk = persistent_q, persistent_tk
        elif step >= 6:  # the static buffers themselves
            sr, stk, sq = graphed.graphs.input_buffers(B, 256, 128)
            sr.copy_(ids)
            stk.copy_(tk)
            sq.copy_(q)
            ids_in, q, tk = sr, sq, stk
        got = graphed(layer, ids_in, tk, q, sm_scale=SM)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mode, step)
        _state_equal(a, b, (mode, step))
    rep = graphed.graphs.report()
    assert rep["eager"] == 2 and rep["replays"] == 12 and rep["in_place_graphs"] >= 1, rep
    assert rep["copies"] < 12 and rep["memory_bytes"] > 0, rep


def test_refused_calls_change_nothing_and_graphs_stay_bounded():
    a, b = make(), make()
    eager = DecodeLayer(a, TritonBackend(validate=False), overlap="split")
    graphed = DecodeLayer(b, TritonBackend(validate=False), overlap="split", graphs=True, max_graphs=1)
    rng = random.Random(5)
    g = torch.Generator(device="cpu").manual_seed(6)
    for step in range(8):
        T = B if step % 2 else B // 2  # two shapes: one graph kept, the other dropped and captured again
        ids = torch.arange(T, dtype=I32, device=DEV)
        tk = topk(rng, 0.7)[:T].contiguous()
        q = (torch.randn((T, 128, 576), generator=g) * 0.3).to(DEV, torch.bfloat16)
        counts = dict(graphed.graphs.counts)
        for bad, exc in ((dict(q=q.float()), TypeError), (dict(tk=tk[:, :200].long()), TypeError),
                         (dict(q=q[:1]), ValueError), (dict(layer=2), ValueError)):
            args = {**dict(layer=0, ids=ids, tk=tk, q=q), **bad}
            with pytest.raises(exc):
                graphed(args["layer"], args["ids"], args["tk"], args["q"], sm_scale=SM)
        _state_equal(a, b, ("refused", step))
        assert graphed.graphs.counts == counts
        want = eager(0, ids, tk, q, sm_scale=SM)
        got = graphed(0, ids, tk, q, sm_scale=SM)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        _state_equal(a, b, step)
        assert len(graphed.graphs.graphs) <= 1
    assert graphed.graphs.report()["dropped"] >= 2


def test_graphs_need_unchecked_cuda_calls():
    c = make()
    with pytest.raises(ValueError, match="validate=False"):
        DecodeLayer(c, TritonBackend(validate=False), graphs=True, validate=True)
    layer = DecodeLayer(c, TritonBackend(validate=True), overlap="split", graphs=True)  # a backend that reads the device
    ids = torch.arange(B, dtype=I32, device=DEV)
    rng = random.Random(7)
    q = torch.zeros((B, 128, 576), dtype=torch.bfloat16, device=DEV)
    layer(0, ids, topk(rng, 0.9), q, sm_scale=SM)  # eager: fine
    epochs = list(c.requests.epochs)
    with pytest.raises(RuntimeError, match="could not capture"):
        layer(0, ids, topk(rng, 0.9), q, sm_scale=SM)
    assert c.requests.epochs == epochs and not layer.graphs.graphs


@pytest.mark.parametrize("mode", ["serial", "split"])
def test_resident_batches_replay_the_resident_path(mode):
    """Every live request resident (the elastic tier with room): the graphs are of the
    resident resolve, keyed apart from the full path's; outputs equal the eager layer's
    bit for bit, and the state's counters too."""
    from test_resolve_resident_gpu import _cache
    lens = [2100, 3000, 4097, 2500]
    a, b = _cache(4, lens, 1), _cache(4, lens, 1)
    eager = DecodeLayer(a, TritonBackend(validate=False), overlap=mode)
    graphed = DecodeLayer(b, TritonBackend(validate=False), overlap=mode, graphs=True)
    ids = torch.tensor([0, 2, 4, 6], dtype=I32, device=DEV)
    rng = random.Random(11)
    g = torch.Generator(device="cpu").manual_seed(12)
    for step in range(5):
        tk = torch.tensor([rng.sample(range(n), 2048) for n in lens], dtype=I32, device=DEV)
        q = (torch.randn((4, 128, 576), generator=g) * 0.3).to(DEV, torch.bfloat16)
        want = eager(0, ids, tk, q, sm_scale=SM)
        got = graphed(0, ids, tk, q, sm_scale=SM)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mode, step)
        assert torch.equal(a.state.stats, b.state.stats), step
    keys = list(graphed.graphs.graphs)
    assert keys and all(k[5] is True for k in keys), keys  # the resident path's graphs
