"""The mini engine's decode steps captured and replayed as CUDA graphs (H200).

Requests arrive one per step and leave at different steps, so the decode batch moves
through several buckets (padding requests included); graph replays must give the
eager outputs within the mini engine's tolerance, for the resident store and (with the
group's capturable decode, ``prepare_for_batch(md, pad_to=N)``) for hisparse.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hisparse_tools import mini_engine as me
from hisparse_tools.mini_engine.ffn import grouped_mm, grouped_mm_reference

pytestmark = pytest.mark.gpu



def _cfg(**kw):
    base = dict(device="cuda", validate=False, num_layers=2, num_heads=16, hidden=128, top_k=64,
                device_buffer_size=128, num_requests=7, max_num_reqs=10, arrival_every=1, min_prompt=300,
                max_prompt=400, synthetic_context=256, min_decode=6, max_decode=14, chunk=64,
                max_batch_tokens=1024, backend="triton")
    return me.MiniEngineConfig(**{**base, **kw})


def test_graphs_resident_equals_eager():
    cfg = _cfg()
    eager = me.run_engine(dataclasses.replace(cfg, graphs=False), "resident")
    graphs = me.run_engine(dataclasses.replace(cfg, graphs=True), "resident")
    c = me.compare(cfg, eager, graphs)
    assert c["within_tolerance"], c
    g = graphs["graphs"]
    assert g["captures"] >= 2 and g["replays"] > g["captures"] and g["padding_requests"] > 0, g
    # every timed replay has its GPU time, which the step's wall time (host work, replay, sync) bounds
    gpu, wall = graphs["replay_gpu_times"], graphs["replay_step_times"]
    assert len(gpu) == len(wall) > 0 and all(0 < x <= w for x, w in zip(gpu, wall)), (gpu, wall)


@pytest.mark.parametrize("overlap", ["serial", "split"])
@pytest.mark.parametrize("ffn", ["none", "moe"])
def test_graphs_hisparse_equals_resident(overlap, ffn):
    # split attends hits and misses apart and merges the partials by LSE: the hit partial
    # is rounded to bf16 once more than in one attention over every row
    cfg = _cfg(graphs=True, overlap=overlap, ffn=ffn, ffn_intermediate=64, ffn_experts=8, ffn_active=2,
               tolerance=2e-2 if overlap == "serial" else 5e-2)
    res = me.run(cfg)
    assert res["compare"]["within_tolerance"], res["compare"]
    cache = res["hisparse"]["cache"]
    assert cache["misses"] > 0 and cache["invalid"] == 0, cache
    for kind in ("resident", "hisparse"):
        assert res[kind]["graphs"]["replays"] > 0 and res[kind]["replay_step"]["n"] > 0


@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_graphs_hisparse_equals_eager_hisparse(overlap):
    """The same kernels on the same rows: replays must match eager steps (the padded
    batch changes no token's arithmetic)."""
    cfg = _cfg(overlap=overlap, tolerance=1e-3)
    eager = me.run_engine(cfg, "hisparse")
    graphs = me.run_engine(dataclasses.replace(cfg, graphs=True), "hisparse")
    c = me.compare(cfg, eager, graphs)
    assert c["within_tolerance"] and c["argmax_mismatches"] == 0, c


@pytest.mark.parametrize("pages,fits", [(200, True), (16, False)])
def test_graphs_hisparse_with_a_pool_equal_eager_hisparse(pages, fits):
    """The elastic tier: a pool that holds every request (each decode graph is of the
    resident resolve) and one that overflows (graphs of both resolves, each replayed
    while it applies); replays match eager steps."""
    hot = -(-10 * 129 // 64) * 64  # max_num_reqs x (S + 1), rounded up to 64
    cfg = _cfg(overlap="serial", tolerance=1e-3, device_pool_rows=hot + pages * 64)
    eager = me.run_engine(cfg, "hisparse")
    graphs = me.run_engine(dataclasses.replace(cfg, graphs=True), "hisparse")
    c = me.compare(cfg, eager, graphs)
    assert c["within_tolerance"] and c["argmax_mismatches"] == 0, c
    g = graphs["graphs"]
    assert g["replays"] > g["captures"] > 0, g
    assert g["variants"] == ["True"] if fits else "False" in g["variants"], g  # a hot request: the full resolve
    tot = graphs["stats"]["total"]
    assert tot["invalid"] == 0 and tot["resident_rows"] > 0 and (tot["spills"] > 0) != fits, tot


@pytest.mark.parametrize("prefetch", [False, True])
def test_layer_graphs_hisparse_equals_eager_and_resident(prefetch):
    """An eager engine whose hisparse per-layer calls replay graphs of their own
    (``layer_graphs``): the same outputs as eager hisparse (same kernels on the same rows)
    and as the resident engine, with the per-layer graphs replayed, not only warmed up.
    With prefetch (eager, between the replays) over Shared layers."""
    kw = dict(num_layers=4, index_share=2, prefetch=True) if prefetch else {}
    cfg = _cfg(tolerance=1e-3, **kw)
    eager = me.run_engine(cfg, "hisparse")
    lg = me.run_engine(dataclasses.replace(cfg, layer_graphs=True), "hisparse")
    c = me.compare(cfg, eager, lg)
    assert c["within_tolerance"] and c["argmax_mismatches"] == 0, c
    counts = lg["layer_graphs"]
    assert counts["replays"] > counts["captures"] >= 2 * cfg.num_layers, counts
    assert counts["write_replays"] > 0 and counts["convert_replays"] == counts["write_replays"], counts
    assert lg["graphs"]["padded_eager"] > 0 and lg["graphs"]["replays"] == 0, lg["graphs"]
    res = me.run(dataclasses.replace(cfg, layer_graphs=True, tolerance=2e-2))
    assert res["compare"]["within_tolerance"], res["compare"]
    assert res["hisparse"]["cache"]["misses"] > 0 and res["hisparse"]["cache"]["invalid"] == 0
    assert res["resident"]["layer_graphs"] is None and res["hisparse"]["layer_graphs"]["replays"] > 0


@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_graphs_index_share_with_prefetch(overlap):
    """Shared layers reuse the Full layer's top-k; the prefetch that stages their rows
    during the layer before is captured with the rest: replays equal the resident engine
    and eager hisparse, and the Shared layers' resolves find the rows hot."""
    cfg = _cfg(graphs=True, num_layers=4, index_share=2, prefetch=True, overlap=overlap,
               tolerance=2e-2 if overlap == "serial" else 5e-2)
    res = me.run(cfg)
    assert res["compare"]["within_tolerance"], res["compare"]
    cache = res["hisparse"]["cache"]
    assert cache["prefetch_rows"] > 0 and cache["invalid"] == 0, cache
    hr = cache["layer_hit_rates"]
    assert hr[1] > hr[0] and hr[3] > hr[2], hr
    eager = me.run_engine(dataclasses.replace(cfg, graphs=False, tolerance=1e-3), "hisparse")
    graphs = me.run_engine(dataclasses.replace(cfg, tolerance=1e-3), "hisparse")
    c = me.compare(dataclasses.replace(cfg, tolerance=1e-3), eager, graphs)
    assert c["within_tolerance"] and c["argmax_mismatches"] == 0, c
    assert graphs["graphs"]["replays"] > 0
    for i in (1, 3):  # at most the row its own write displaced from the reserved slot, per token
        st = graphs["stats"]["layers"][i]
        assert st["misses"] <= st["resolves"], st


@pytest.mark.parametrize("top_k", [64, 2048])
@pytest.mark.parametrize("ctx", [6000, 140000])  # past 100K columns torch's CUDA top-k sorts
def test_fixed_shape_indexer_equals_the_eager_one_on_cuda(top_k, ctx):
    """The top-k selects the same entries in the same order from the eager scores (the
    context's width) and the fixed-shape ones (the whole max context, -inf past each
    token), including tokens whose context is shorter than top_k."""
    cfg = me.MiniEngineConfig(top_k=top_k, num_requests=4, min_prompt=ctx, max_prompt=ctx,
                              device="cuda", validate=False)
    idx = me.Indexer(cfg, 4, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(3)
    idx.keys.copy_(torch.randn(idx.keys.shape, generator=g, device="cuda"))
    slot = torch.tensor([2, 0, 1, 3], device="cuda")
    sub = torch.zeros(4, dtype=torch.long, device="cuda")
    pos = torch.tensor([ctx - 1000, 1000, 37, ctx - 1900], device="cuda")  # 38 and 1001 < 2048 positions
    iq = torch.randn(4, cfg.indexer_dim, generator=g, device="cuda")
    eager = idx.decode_topk(0, iq, slot, sub, pos, int(pos.max()) + 1)
    fixed = idx.decode_topk_fixed(0, iq, slot, sub, pos)
    assert torch.equal(eager, fixed)
    for t in range(4):  # every position up to the token's own, once, when the context is short
        sel = eager[t][eager[t] >= 0]
        assert sel.numel() == min(top_k, int(pos[t]) + 1) and sel.unique().numel() == sel.numel()
        assert int(sel.max()) <= int(pos[t])


def test_grouped_mm_on_cuda_matches_the_per_expert_loop():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(96, 128, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn(8, 128, 64, generator=g, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([10, 10, 30, 31, 60, 60, 90, 96], dtype=torch.int32, device="cuda")
    assert torch.allclose(grouped_mm(a, b, offs).float(), grouped_mm_reference(a, b, offs).float(),
                          rtol=2e-2, atol=2e-1)


def test_moe_captures():
    f = me.FFN(kind="moe", num_layers=1, hidden=128, intermediate=64, experts=8, active=2, shared=1, seed=0,
               device=torch.device("cuda"))
    x = torch.randn(24, 128, device="cuda")
    f(0, x)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(0, x)
    x.copy_(torch.randn(24, 128, device="cuda"))
    want = f(0, x)
    graph.replay()
    assert torch.equal(y, want)
