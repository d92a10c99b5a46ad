"""The mini engine's bucketed decode (what CUDA graphs capture) and its ffn stand-in, on CPU.

Capture and replay need CUDA (tests/test_mini_engine_graphs_gpu.py); here: the bucket
sizes, the static inputs and their padding, the fixed-shape indexer against the eager
one, the padded forward (run eagerly) against the ordinary one, and the MoE's grouped
GEMMs against one matmul per expert. Tiny shapes (2 layers, hidden 64, top-k 8).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from hisparse_tools import mini_engine as me
from hisparse_tools.mini_engine.ffn import FFN, ffn_weight_bytes, grouped_mm, grouped_mm_reference
from hisparse_tools.mini_engine.graphs import StaticInputs
from hisparse_tools.mini_engine.loop import ReplayProfile
from hisparse_tools.mini_engine.scores import indexer_scores_reference, indexer_scores_triton



def test_capture_sizes_and_buckets():
    assert me.capture_sizes(1) == [1]
    assert me.capture_sizes(3) == [1, 2, 3]
    assert me.capture_sizes(13) == [1, 2, 4, 8, 13]
    assert me.capture_sizes(68) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 68]
    assert me.capture_sizes(300) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300]
    sizes = me.capture_sizes(68)
    assert [me.bucket_for(b, sizes) for b in (1, 3, 5, 9, 33, 64, 65, 68)] == [1, 4, 8, 16, 48, 64, 68, 68]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        me.bucket_for(69, sizes)
    with pytest.raises(ValueError):
        me.bucket_for(0, sizes)


def test_static_inputs_pad_with_the_scratch_slot():
    cfg = me.MiniEngineConfig(query_len=2, device_buffer_size=16)
    reqs = me.make_workload(cfg)[:2]
    for i, r in enumerate(reqs):  # decoding: past the prompt
        r.slot, r.done = i, r.prompt_len + i
    p0, p1 = reqs[0].done, reqs[1].done
    st = StaticInputs.make(4, 2, torch.device("cpu"))
    st.fill([(r, 2) for r in reqs], scratch_slot=9)
    assert st.pos.tolist() == [p0, p0 + 1, p1, p1 + 1, 0, 0, 0, 0]
    assert st.slot.tolist() == [0, 0, 1, 1, 9, 9, 9, 9]
    assert st.sub.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert st.lim.tolist() == [p0, p0 + 1, p1, p1 + 1, -1, -1, -1, -1]
    assert st.tok.tolist()[:4] == reqs[0].tokens[p0:p0 + 2].tolist() + reqs[1].tokens[p1:p1 + 2].tolist()
    with pytest.raises(ValueError, match="outside the decode part"):
        reqs[0].decode_tokens(reqs[0].prompt_len - 1, reqs[0].prompt_len)
    assert st.tok.tolist()[4:] == [0] * 4
    assert st.dec_slots.dtype == torch.int32 and st.dec_slots.tolist() == st.slot.tolist()
    with pytest.raises(ValueError, match="do not fit bucket"):
        StaticInputs.make(1, 2, torch.device("cpu")).fill([(r, 2) for r in reqs], scratch_slot=9)
    with pytest.raises(ValueError, match="tokens in a decode step of 2"):
        st.fill([(reqs[0], 1)], scratch_slot=9)


@pytest.mark.parametrize("q", [1, 2])
def test_fixed_shape_indexer_equals_the_eager_one(q):
    cfg = me.MiniEngineConfig(query_len=q, top_k=8, device_buffer_size=16 * q, num_requests=3)
    idx = me.Indexer(cfg, 3, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    idx.keys.copy_(torch.randn(idx.keys.shape, generator=g))
    lens = [30, 7, 41]  # own positions of the first token of each request
    slot = torch.tensor([s for s in (2, 0, 1) for _ in range(q)])
    sub = torch.arange(q).repeat(3)
    pos = torch.tensor([lens[i] + j for i in range(3) for j in range(q)])
    iq = torch.randn(3 * q, cfg.indexer_dim, generator=g)
    eager = idx.decode_topk(1, iq, slot, sub, pos, int(pos.max()) + 1)
    fixed = idx.decode_topk_fixed(1, iq, slot, sub, pos)
    assert torch.equal(eager, fixed)
    # padding tokens (scratch slot, limit -1) select nothing
    pad_slot = torch.cat([slot, torch.full((2,), 3)])
    pad = idx.decode_topk_fixed(1, torch.cat([iq, torch.randn(2, cfg.indexer_dim, generator=g)]), pad_slot,
                                torch.cat([sub, torch.zeros(2, dtype=torch.long)]),
                                torch.cat([pos, torch.full((2,), -1)]))
    assert torch.equal(pad[:3 * q], fixed) and bool((pad[3 * q:] == -1).all())


def test_padded_resident_decode_equals_eager():
    """The padded forward (bucketed, scratch slot, fixed-shape indexer), run eagerly,
    gives the ordinary forward's outputs: same rows, same selections."""
    cfg = me.MiniEngineConfig(num_requests=3, arrival_every=0, min_prompt=20, max_prompt=30, min_decode=3,
                              max_decode=6)
    eager = me.run_engine(cfg, "resident")
    padded = me.run_engine(cfg, "resident", decode_mode=me.DecodeMode.PADDED)
    c = me.compare(cfg, eager, padded)
    assert c["bitwise_equal"], c
    gr = padded["graphs"]
    assert gr["mode"] == "padded" and gr["padded_eager"] > 0 and gr["captures"] == 0
    assert set(gr["buckets"]) <= {1, 2, 3}  # 3 slots: buckets 1, 2, 3


def test_padded_mode_pads_to_a_larger_bucket():
    """5 slots: buckets 1, 2, 4, 5; 3 requests decode in bucket 4 with one padding request."""
    cfg = me.MiniEngineConfig(num_requests=3, max_num_reqs=5, arrival_every=0, min_prompt=20, max_prompt=24,
                              min_decode=3, max_decode=3)
    eager = me.run_engine(cfg, "resident")
    padded = me.run_engine(cfg, "resident", decode_mode=me.DecodeMode.PADDED)
    assert me.compare(cfg, eager, padded)["bitwise_equal"]
    assert 4 in padded["graphs"]["buckets"] and padded["graphs"]["padding_requests"] >= 1


@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_padded_hisparse_decode_equals_resident(overlap):
    cfg = me.MiniEngineConfig(num_requests=3, max_num_reqs=5, arrival_every=0, min_prompt=20, max_prompt=30,
                              min_decode=3, max_decode=6, overlap=overlap, validate=False)
    res = me.run(cfg, decode_mode=me.DecodeMode.PADDED)
    assert res["compare"]["within_tolerance"], res["compare"]
    assert res["hisparse"]["cache"]["misses"] > 0 and res["hisparse"]["cache"]["invalid"] == 0


def test_layer_graphs_decode_replays_both_calls(monkeypatch):
    """``--layer-graphs`` on the CPU: the per-layer graphs' recording stand-in
    (tests/graph_trace) in the hisparse store's group (the configuration refuses
    layer_graphs off CUDA), padded decode steps. Both per-layer calls of a decode step must
    replay (a conversion with ``wait=False`` would run eagerly instead), and the outputs
    equal eager hisparse's. Eager conversions wait too (only a captured forward defers
    the wait, tests/test_mini_engine_graphs_gpu.py)."""
    from graph_trace import RecordingGraphs
    from hisparse.engine import HiSparseIndexGroup
    from hisparse.engine.layer_graphs import LayerGraphs
    from hisparse_tools.mini_engine import loop

    waits = []
    convert = HiSparseIndexGroup.convert_decode_logical_to_physical_topk

    def spy(self, layer, topk, md, **kw):
        waits.append(kw.get("wait", True))
        return convert(self, layer, topk, md, **kw)
    monkeypatch.setattr(HiSparseIndexGroup, "convert_decode_logical_to_physical_topk", spy)
    cfg = me.MiniEngineConfig(num_requests=3, arrival_every=0, min_prompt=20, max_prompt=30, min_decode=5,
                              max_decode=7, validate=False, cache_kernels="torch")
    eager = me.run_engine(cfg, "hisparse")
    assert waits and all(waits), "an eager engine's conversion did not wait for its staging"
    waits.clear()
    init = loop.MiniEngine.__init__

    def with_stand_in(self, *a, **kw):
        init(self, *a, **kw)
        g = self.kv.group
        g._layer_graphs = LayerGraphs(g.hisparse_cache, RecordingGraphs(g.hisparse_cache))
    monkeypatch.setattr(loop.MiniEngine, "__init__", with_stand_in)
    lg = me.run_engine(cfg, "hisparse", decode_mode=me.DecodeMode.PADDED)
    assert waits and all(waits), "a layer-graphs conversion did not wait (it ran eagerly)"
    c = lg["layer_graphs"]
    assert c["write_replays"] > 0 and c["convert_replays"] == c["write_replays"], c
    cmp = me.compare(cfg, eager, lg)
    assert cmp["bitwise_equal"], cmp


@pytest.mark.parametrize("kw, msg", [
    (dict(graphs=True), "need a CUDA device"),
    (dict(graphs=True, device="cuda", validate=True), "unchecked"),
    (dict(graphs=True, device="cuda", validate=False, overlap="fused"), r"overlap must be one of \['serial', 'split', 'auto'\]"),
    (dict(overlap="auto"), "use overlap serial or split"),
    (dict(layer_graphs=True), "need a CUDA device"),
    (dict(layer_graphs=True, device="cuda", validate=True), "unchecked"),
    (dict(layer_graphs=True, device="cuda", validate=False, graphs=True), "one of the two"),
    (dict(layer_graphs=True, device="cuda", validate=False, overlap="split"), "overlap serial"),
    (dict(layer_graphs=True, device="cuda", validate=False, cache_kernels="torch"), "Triton cache kernels"),
    (dict(ffn="moe", ffn_active=5, ffn_experts=4), "ffn_active"),
    (dict(ffn="mlp", ffn_intermediate=60), "multiples of 8"),
    (dict(ffn="dense"), "ffn must be one of"),
    (dict(ffn="moe", ffn_routing="hash"), "ffn_routing must be one of"),
])
def test_bad_graph_and_ffn_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        me.MiniEngineConfig(**kw)


def test_grouped_mm_matches_one_matmul_per_group():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(11, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(4, 16, 24, generator=g).to(torch.bfloat16)
    offs = torch.tensor([3, 3, 10, 11], dtype=torch.int32)  # an empty group included
    out = grouped_mm(a, b, offs)
    ref = grouped_mm_reference(a, b, offs)
    assert out.shape == (11, 24) and torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(ref[3:10].float(), (a[3:10] @ b[2]).float())


def _moe(**kw):
    args = dict(kind="moe", num_layers=2, hidden=32, intermediate=16, experts=4, active=2, shared=1, seed=0,
                device=torch.device("cpu"))
    return FFN(**{**args, **kw})


def test_moe_against_a_per_token_reference():
    f = _moe()
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    y = f(1, x)
    assert torch.allclose(y, f(1, x, reference=True), rtol=2e-2, atol=2e-2)
    # per token, straight from the definition: the chosen experts' MLPs, softmax-weighted, + shared
    p = f.layers[1]
    xb = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    idx, wts = f.route(1, xb)
    for t in range(7):
        acc = f._mlp(xb[t:t + 1], p["shared_gate_up"], p["shared_down"]).float()
        for j in range(2):
            e = int(idx[t, j])
            acc = acc + wts[t, j] * f._mlp(xb[t:t + 1], p["gate_up"][e], p["down"][e]).float()
        assert torch.allclose(y[t], x[t] + acc[0], rtol=3e-2, atol=3e-2), t
    assert f(0, x).shape == x.shape and not torch.equal(f(0, x), f(1, x))  # per-layer weights


def test_moe_is_deterministic_and_mlp_and_none_work():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_moe()(0, x), _moe()(0, x))  # same seed, same weights, no atomics
    assert not torch.equal(_moe()(0, x), _moe(seed=1)(0, x))
    mlp = FFN(kind="mlp", num_layers=1, hidden=32, intermediate=16, experts=1, active=1, shared=0, seed=0,
              device=torch.device("cpu"))
    assert mlp(0, x).shape == x.shape and not torch.equal(mlp(0, x), x)
    none = FFN(kind="none", num_layers=1, hidden=32, intermediate=16, experts=1, active=1, shared=0, seed=0,
               device=torch.device("cpu"))
    assert none(0, x) is x


def test_moe_token_routing_routes_by_the_input_embedding():
    """"token" routing chooses each token's experts from route_x (its input embedding):
    a perturbation of the hidden state that reroutes tokens under "content" routing
    reroutes none under "token"; the experts' MLPs still read the hidden state."""
    g = torch.Generator().manual_seed(4)
    x, x0 = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    xp = x + 0.3 * torch.randn(64, 32, generator=g)
    content, token = _moe(), _moe(routing="token")
    norm = FFN._normed
    assert not torch.equal(content.route(1, norm(x))[0], content.route(1, norm(xp))[0])  # some token rerouted
    ref = _moe()
    y = token(1, x, route_x=x0)
    # the same weights routed by x0: each token's chosen experts, applied to x
    idx, wts = ref.route(1, norm(x0))
    p, xb = ref.layers[1], norm(x)
    for t in (0, 17, 63):
        acc = ref._mlp(xb[t:t + 1], p["shared_gate_up"], p["shared_down"]).float()
        for j in range(2):
            e = int(idx[t, j])
            acc = acc + wts[t, j] * ref._mlp(xb[t:t + 1], p["gate_up"][e], p["down"][e]).float()
        assert torch.allclose(y[t], x[t] + acc[0], rtol=3e-2, atol=3e-2), t
    assert not torch.equal(y, content(1, x))
    with pytest.raises(ValueError, match="route_x"):
        token(1, x)
    with pytest.raises(ValueError, match="routing"):
        _moe(routing="hash")


def test_ffn_weight_bytes():
    assert ffn_weight_bytes(kind="none", num_layers=3, hidden=8, intermediate=8, experts=2, shared=1) == 0
    assert ffn_weight_bytes(kind="mlp", num_layers=3, hidden=8, intermediate=16, experts=2, shared=1) == 3 * 3 * 8 * 16 * 2
    assert ffn_weight_bytes(kind="moe", num_layers=1, hidden=8, intermediate=16, experts=2, shared=1) == \
        3 * 3 * 8 * 16 * 2 + 8 * 2 * 4
    f = _moe()
    got = sum(t.numel() * t.element_size() for p in f.layers for t in p.values())
    assert got == ffn_weight_bytes(kind="moe", num_layers=2, hidden=32, intermediate=16, experts=4, shared=1)
    # one H200's share of a DeepSeek-V3.2 MoE layer: 32 experts x 3 x 7168 x 2048 bf16 + shared + router
    v = me.V32_EP8_SHARE
    per_layer = ffn_weight_bytes(kind="moe", num_layers=1, hidden=v["hidden"], intermediate=v["ffn_intermediate"],
                                 experts=v["ffn_experts"], shared=v["ffn_shared"])
    assert 2.9e9 < per_layer < 3.0e9


@pytest.mark.parametrize("ffn", ["mlp", "moe"])
def test_engine_with_ffn_stand_in_matches(ffn):
    cfg = me.MiniEngineConfig(num_requests=2, min_prompt=20, max_prompt=24, min_decode=2, max_decode=3, ffn=ffn,
                              ffn_intermediate=32, ffn_experts=4, ffn_active=2)
    res = me.run(cfg)
    assert res["compare"]["bitwise_equal"], res["compare"]
    host, _ = me.memory_needed(cfg)
    assert host["ffn stand-in weights"] > 0


def test_cli_graphs_flag_on_cpu_is_bad_input(capsys):
    assert me.main(["--graphs", "--unchecked"]) == 2
    assert "CUDA device" in capsys.readouterr().err


def test_replay_profile_picks_replays_after_the_timed_ones_and_ranks_ops():
    prof = ReplayProfile(torch.device("cpu"), after=2, n=1)
    graphs = NS(sizes=[1, 2, 4], graphs={(2, None): object()})  # (bucket, KV store graph variant)
    decode = NS(md=NS(num_prefills=0, num_decodes=2))
    assert not prof.wants(None, decode)
    assert not prof.wants(graphs, NS(md=NS(num_prefills=1, num_decodes=2)))  # a mixed step
    assert not prof.wants(graphs, NS(md=NS(num_prefills=0, num_decodes=3)))  # bucket 4 not captured
    assert not prof.wants(graphs, decode)  # no replay timed yet
    prof.replays_seen = 2
    assert prof.wants(graphs, decode)
    prof.start()
    a = torch.randn(64, 64)
    for _ in range(3):
        a = a @ a
    prof.stop(True)
    assert not prof.wants(graphs, decode)  # n reached
    rep = prof.report()
    assert rep["steps"] == 1 and rep["activity"] == "cpu"
    mm = [k for k in rep["top"] if k["name"] == "aten::mm"]
    assert mm and mm[0]["calls_per_step"] == 3 and mm[0]["us_per_step"] > 0
    assert rep["busy_us_per_step"] >= mm[0]["us_per_step"]
    with pytest.raises(ValueError, match="after >= 0 and n >= 1"):
        ReplayProfile(torch.device("cpu"), after=0, n=0)


@pytest.mark.parametrize("C,d", [(300, 24), (256, 32), (17, 16)])
def test_indexer_scores_kernel_matches_the_reference(C, d):
    g = torch.Generator().manual_seed(C + d)
    keys_all = torch.randn(4, C + 5, d, generator=g)
    keys = keys_all[:, :C]  # a view with the max context's stride, as decode_topk passes
    slots = torch.tensor([0, 0, 2, 3, 3, 1], dtype=torch.int64)
    sub = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.int64)
    lim = torch.tensor([C - 1, 5, -1, C + 10, 0, C // 2], dtype=torch.int64)
    iq = torch.randn(6, d, generator=g)
    ref = indexer_scores_reference(keys, iq, slots, sub, lim, 2)
    got = indexer_scores_triton(keys, iq, slots, lim)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    assert bool(torch.isneginf(got[2]).all()) and int((~torch.isneginf(got[4])).sum()) == 1
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_replay_profile_timeline_finds_the_idle_gaps_and_what_bounds_them():
    """A step's span, idle time and gaps from its activities' intervals (the CUDA
    timeline): overlapping and nested activities are not idle; a gap is named by the
    activity whose end it follows and the one whose start ends it."""
    prof = ReplayProfile(torch.device("cuda"), after=0, n=2)
    prof._timeline([(0.0, 10.0, "write"), (2.0, 5.0, "mirror"), (14.0, 20.0, "resolve"),
                    (20.0, 30.0, "attn"), (12.0, 13.0, "tiny"), (35.0, 40.0, "attn")])
    prof._timeline([(100.0, 104.0, "write"), (107.0, 110.0, "resolve")])
    prof.steps = 2
    rep = prof.report()
    assert rep["span_us_per_step"] == (40 + 10) / 2
    # gaps: write->tiny 2, tiny->resolve 1, attn->attn 5 (step 1); write->resolve 3 (step 2)
    assert rep["idle_us_per_step"] == (2 + 1 + 5 + 3) / 2
    gaps = {(g["after"], g["before"]): (g["per_step"], g["us_per_step"]) for g in rep["gaps"]}
    assert gaps == {("write", "tiny"): (0.5, 1.0), ("tiny", "resolve"): (0.5, 0.5), ("attn", "attn"): (0.5, 2.5),
                    ("write", "resolve"): (0.5, 1.5)}
    assert rep["gaps"][0]["after"] == "attn"  # largest first
