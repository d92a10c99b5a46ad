"""``hisparse whatif`` and the simulator behind it.

- The simulated LRU equals the real cache (``HiSparseCache``, torch kernels, CPU), layer
  by layer and step by step, on traces with joins, leaves, reused ids, padding,
  duplicates, contexts that fit and multi-row appends; and equals the counters of a
  ``stress`` run and of the mini engine's own hisparse run on their recorded traces.
- Belady <= LRU misses on random traces of every generator.
- The glm51 preset lands within +-20% of the published GLM-5.1 miss rates at 1x / 2x /
  4x top-k (at a smaller scale than the full preset: 8 requests, 60 steps, one layer).
- The working-set generator's knobs do what docs/WHATIF.md says; the CLI's JSON
  interface, plots and exit codes.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse_tools import whatif as W
from hisparse_tools.belady import LayerTrace, Policy, hit_rate, simulate
from hisparse_tools.cli import main
from hisparse_tools.stress import StressOptions, run_stress
from hisparse_tools.sources import WorkingSetSource
from hisparse_tools.traces import TraceRecorder, TraceStep, load_trace


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second OpenMP thread only waits on a shared 2-core machine (the
    whatif runs set this themselves; the direct simulator and cache calls here do not)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------ helpers
def _cache_counts(steps, *, L, K, S, max_len):
    """Drive the real cache with a trace; per (layer, step) (hits, misses) from its stats."""
    live_max = max(st.req_ids.size for st in steps)
    cfg = HiSparseConfig(num_layers=L, host_pool_tokens=live_max * ((max_len + 3) // 4 * 4) + 16,
                         row_bytes=16, top_k=K, device_buffer_size=S,
                         max_num_reqs=live_max, host_block_size=4,
                         max_request_id=64, device="cpu")
    cache = HiSparseCache(cfg, kernels="torch")
    live: dict[int, int] = {}
    out = np.zeros((L, len(steps), 2), np.int64)
    for s, st in enumerate(steps):
        ids = st.req_ids.tolist()
        for rid in [r for r in live if r not in ids]:
            cache.free_request(rid)
            del live[rid]
        for rid, n in zip(ids, st.seq_lens.tolist()):
            if rid not in live:
                cache.add_request(rid)
                live[rid] = 0
            for layer in range(L):
                cache.write(layer, rid, torch.zeros((n - live[rid], 16), dtype=torch.uint8))
            live[rid] = n
        for layer in range(L):
            before = cache.stats()["layers"][layer]
            cache.resolve(layer, torch.tensor(ids, dtype=torch.int32),
                          torch.from_numpy(np.ascontiguousarray(st.topk[:, layer])))
            after = cache.stats()["layers"][layer]
            out[layer, s] = (after["hits"] - before["hits"], after["misses"] - before["misses"])
    return out


def _sim_counts(steps, *, L, S, policy=Policy.LRU):
    inst = W._instances(steps)
    out = np.zeros((L, len(steps), 2), np.int64)
    for layer in range(L):
        tr = LayerTrace.build(inst, [st.seq_lens for st in steps], [st.topk[:, layer] for st in steps])
        h, m = simulate(tr, S=S, policy=policy)
        out[layer, :, 0] = [int(x.sum()) for x in h]
        out[layer, :, 1] = [int(x.sum()) for x in m]
    return out


def _random_trace(seed, *, L=2, K=8, steps=30, max_req=3, dup=True):
    """Joins/leaves with id reuse, lengths growing by 1-5 rows, short and long contexts,
    padding and duplicate positions in the top-k rows."""
    rng = np.random.default_rng(seed)
    live: dict[int, int] = {}
    out = []
    for s in range(steps):
        if s:
            for rid in list(live):
                if rng.random() < 0.15:
                    del live[rid]
        # an id that left in this step is not reused before the next one (the trace format
        # reads an id present in consecutive steps as the same request)
        busy = set(live) | set(out[-1].req_ids.tolist() if out else [])
        while not live or (len(live) < max_req and rng.random() < 0.4):
            rid = min(set(range(3 * max_req + 1)) - busy)
            busy.add(rid)
            live[rid] = int(rng.integers(1, 3 * K))
        for rid in live:
            live[rid] += int(rng.integers(1, 6))
        ids = np.array(sorted(live), dtype=np.int64)
        lens = np.array([live[r] for r in ids], dtype=np.int64)
        tk = np.full((ids.size, L, K), -1, np.int32)
        for t, n in enumerate(lens):
            for layer in range(L):
                k = int(rng.integers(0, min(K, n) + 1))
                hot = max(1, n // 3)  # a hot region: positions come back
                pick = np.where(rng.random(k) < 0.7, rng.integers(n - hot, n, k), rng.integers(0, n, k))
                if not dup:
                    pick = np.unique(pick)
                tk[t, layer, :pick.size] = pick
        out.append(TraceStep(ids, lens, tk))
    return out


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("seed,S", [(0, 8), (1, 8), (2, 12), (3, 9), (4, 16)])
def test_simulated_lru_equals_the_cache_step_by_step(seed, S):
    steps = _random_trace(seed)
    max_len = max(int(st.seq_lens.max()) for st in steps)
    want = _cache_counts(steps, L=2, K=8, S=S, max_len=max_len)
    got = _sim_counts(steps, L=2, S=S)
    assert want[..., 1].sum() > 0 and want[..., 0].sum() > 0  # the trace overflows the buffer
    np.testing.assert_array_equal(got, want)
    opt = _sim_counts(steps, L=2, S=S, policy=Policy.BELADY)
    assert (opt[..., 0] + opt[..., 1] == got[..., 0] + got[..., 1]).all()  # same lookups
    assert opt[..., 1].sum() <= got[..., 1].sum()


def test_simulated_lru_equals_the_cache_on_the_workingset_generator():
    src = WorkingSetSource(top_k=8, sinks=1, recent=1, pool=2.0, persistence=0.5, drift=0.1,
                           layer_overlap=0.5, seed=3)
    steps, live = [], {0: 4, 1: 20, 2: 40}
    for s in range(25):
        if s == 10:
            del live[1]
            src.drop(1)
        if s == 12:
            live[1] = 30  # id 1 comes back as a new request
        for rid in live:
            live[rid] += 1
        ids = np.array(sorted(live), dtype=np.int64)
        lens = np.array([live[r] for r in ids], dtype=np.int64)
        tk = [src.select(layer, torch.from_numpy(ids), torch.from_numpy(lens), s).numpy() for layer in range(2)]
        steps.append(TraceStep(ids, lens, np.stack(tk, 1)))
    want = _cache_counts(steps, L=2, K=8, S=10, max_len=80)
    np.testing.assert_array_equal(_sim_counts(steps, L=2, S=10), want)
    assert want[..., 1].sum() > 0


def test_replay_equals_a_stress_run_and_its_belady_bound(tmp_path):
    path = str(tmp_path / "t.npz")
    o = StressOptions(num_requests=3, context=120, num_layers=2, top_k=16, buffer_size=24, steps=20,
                      churn=0.2, trace="correlated", drift=0.3, record=path, verify="none",
                      device="cpu", kernels="torch", block_size=16, progress=False)
    r = run_stress(o)
    assert r["ok"] and r["workload"]["left"] > 0 and r["overall"]["misses"] > 0
    res = W.run_whatif(W.WhatifOptions(replay=path, buffers=(24,), progress=False))
    e = res["results"][0]
    assert (e["lru_hits"], e["lru_misses"]) == (r["overall"]["hits"], r["overall"]["misses"])
    assert hit_rate(e["belady_hits"], e["belady_misses"]) == r["overall"]["optimal_hit_rate"]
    # whatif's own generator with stress's flags produces the very same trace
    gen = W.run_whatif(W.WhatifOptions(trace="correlated", requests=3, context=120, context_min=60,
                                       layers=2, top_k=16, steps=20, churn=0.2, drift=0.3, seed=0,
                                       buffers=(24,), warmup=0, progress=False))
    assert (gen["results"][0]["lru_hits"], gen["results"][0]["lru_misses"]) == (e["lru_hits"], e["lru_misses"])
    _, rec = load_trace(path)
    r2 = W._resolve(W.WhatifOptions(trace="correlated", requests=3, context=120, context_min=60, layers=2,
                                    top_k=16, steps=20, churn=0.2, drift=0.3, seed=0))
    for a, b in zip(rec, W.generate(r2, torch.device("cpu"))):
        np.testing.assert_array_equal(a.topk, b.topk)


def test_stress_runs_the_workingset_generator_whatif_does(tmp_path):
    path = str(tmp_path / "ws.npz")
    o = StressOptions(num_requests=3, context=200, num_layers=2, top_k=80, buffer_size=100, steps=8,
                      churn=0.2, trace="workingset", record=path, verify="none",
                      device="cpu", kernels="torch", block_size=16, progress=False)
    r0 = run_stress(o)
    assert r0["ok"] and r0["workload"]["drift"] == 0.03  # the generator's default, as whatif's
    _, rec = load_trace(path)
    r = W._resolve(W.WhatifOptions(trace="workingset", requests=3, context=200, context_min=100, layers=2,
                                   top_k=80, steps=8, churn=0.2, seed=0, warmup=0))
    gen = list(W.generate(r, torch.device("cpu")))
    assert len(rec) == len(gen) == 8
    for a, b in zip(rec, gen):
        np.testing.assert_array_equal(a.topk, b.topk)
    with pytest.raises(ValueError, match="top_k > 68"):
        run_stress(dataclasses.replace(o, top_k=64, record=None))


def test_replay_of_the_mini_engine_equals_its_cache_counters(tmp_path):
    from hisparse_tools import mini_engine as me

    path = str(tmp_path / "engine.npz")
    cfg = me.MiniEngineConfig()
    res = me.run(cfg, record=path)
    eng = res["hisparse"]["cache"]
    S = cfg.device_buffer_size or 2 * cfg.top_k
    e = W.run_whatif(W.WhatifOptions(replay=path, buffers=(S,), progress=False))["results"][0]
    assert (e["lru_hits"], e["lru_misses"]) == (eng["hits"], eng["misses"])
    assert eng["misses"] > 0 and e["belady_misses"] <= e["lru_misses"]


# ------------------------------------------------------------------ Belady <= LRU
@pytest.mark.parametrize("trace", ["uniform", "correlated", "workingset", "indexer"])
def test_belady_never_worse_than_lru_on_generated_traces(trace):
    kw = dict(requests=3, context=300, context_min=100, layers=2, top_k=16, steps=25, churn=0.1,
              seed=7, buffers=(16, 20, 32, 48), warmup=0, progress=False, trace=trace)
    if trace in ("correlated", "indexer"):
        kw["drift"] = 0.3
    if trace == "workingset":  # the preset's window would not fit K = 16
        kw.update(sinks=1, recent=2, drift=0.1)
    res = W.run_whatif(W.WhatifOptions(**kw))
    prev = None
    for e in res["results"]:
        assert e["belady_misses"] <= e["lru_misses"]
        assert e["belady_hits"] + e["belady_misses"] == e["lookups"] == e["lru_hits"] + e["lru_misses"]
        if prev is not None:  # more buffer never hurts the optimum
            assert e["belady_misses"] <= prev
        prev = e["belady_misses"]
    assert res["results"][0]["lru_misses"] > 0


@pytest.mark.parametrize("seed", range(6))
def test_belady_never_worse_than_lru_on_random_traces(seed):
    steps = _random_trace(100 + seed, K=6, steps=25)
    for S in (6, 7, 10):
        lru = _sim_counts(steps, L=2, S=S)
        opt = _sim_counts(steps, L=2, S=S, policy=Policy.BELADY)
        assert opt[..., 1].sum() <= lru[..., 1].sum()


# ------------------------------------------------------------------ calibration
def test_glm51_preset_within_the_published_band():
    """Smaller scale than the preset (8 requests, 60 steps, one layer); full-scale numbers
    are in docs/WHATIF.md."""
    res = W.run_whatif(W.WhatifOptions(preset="glm51", requests=8, steps=60, layers=1,
                                       buffers=(2048, 4096, 8192), progress=False))
    ref = W.PRESETS["glm51"].reference
    for e in res["results"]:
        want = ref[e["buffer"] / 2048]
        assert abs(e["lru_miss_rate"] / want - 1.0) <= W.REFERENCE_BAND, (e["buffer"], e["lru_miss_rate"], want)
        assert e["reference_miss_rate"] == want
        assert e["belady_miss_rate"] <= e["lru_miss_rate"]
    assert res["trace"]["context_min"] > 96 * 1024 - 1


def test_generator_defaults_are_the_preset():
    import inspect

    sig = inspect.signature(WorkingSetSource.__init__).parameters
    assert {k: sig[k].default for k in W.PRESETS["glm51"].knobs} == W.PRESETS["glm51"].knobs


def test_layer_overlap_knob_and_prefetch_gain():
    base = dict(preset="glm51", requests=4, steps=30, layers=3, buffers=(2048, 4096), progress=False)
    got = {}
    for c in (0.0, 0.5, 1.0):
        got[c] = W.run_whatif(W.WhatifOptions(layer_overlap=c, **base))
    assert got[0.0]["overlap"]["adjacent_layer"] < 0.1  # sinks, recent window and chance
    assert abs(got[0.5]["overlap"]["adjacent_layer"] - 0.5) < 0.1
    assert got[1.0]["overlap"]["adjacent_layer"] == 1.0
    for e in got[1.0]["results"]:  # identical layers: every miss of layers 1, 2 was selected by the layer before
        # layers 1 and 2 miss exactly like layer 0, so gain = miss rate
        assert e["prefetch_hit_gain"] == pytest.approx(e["lru_miss_rate"])
    for e0, e5 in zip(got[0.0]["results"], got[0.5]["results"]):
        assert e0["prefetch_hit_gain"] < 0.02 < e5["prefetch_hit_gain"]
    # the knob leaves each layer's own curve alone
    m0 = [e["lru_miss_rate"] for e in got[0.0]["results"]]
    m1 = [e["lru_miss_rate"] for e in got[1.0]["results"]]
    assert np.allclose(m0, m1, rtol=0.1)


def _miss(**kw):
    base = dict(preset="glm51", requests=4, steps=40, layers=1, buffers=(2048, 8192), progress=False)
    res = W.run_whatif(W.WhatifOptions(**{**base, **kw}))
    return [e["lru_miss_rate"] for e in res["results"]], res


def test_knobs_move_the_curve_as_documented():
    ref, r = _miss()
    hi_pers, r2 = _miss(persistence=0.9)
    assert hi_pers[0] < ref[0] and r2["overlap"]["consecutive_step"] > r["overlap"]["consecutive_step"]
    more_drift, _ = _miss(drift=0.1)
    assert more_drift[1] > 1.5 * ref[1]  # the floor at large buffers rises
    big_pool, _ = _miss(pool=5.0)
    assert big_pool[1] > ref[1]
    window, _ = _miss(recent=1024)  # half the selection always hits
    assert window[0] < 0.7 * ref[0]


# ------------------------------------------------------------------ generator
def test_workingset_rows_are_valid_selections():
    src = WorkingSetSource(top_k=64, sinks=3, recent=5, pool=3.0, drift=0.2, layer_overlap=0.7, seed=1)
    ids = torch.tensor([0, 5, 9])
    for s in range(12):
        n = torch.tensor([40 + s, 70 + s, 5000 + s])
        for layer in range(3):
            out = src.select(layer, ids, n, s)
            assert out.dtype == torch.int32 and out.shape == (3, 64)
            # 40+s <= 64: every position; the others: K distinct positions in range
            short = out[0][out[0] >= 0]
            assert sorted(short.tolist()) == list(range(int(n[0])))
            for t in (1, 2):
                row = out[t]
                assert (row >= 0).all() and (row < n[t]).all() and row.unique().numel() == 64
                assert set(range(3)) <= set(row.tolist())  # sinks
                assert set(range(int(n[t]) - 5, int(n[t]))) <= set(row.tolist())  # recent window
    src.drop(5)  # a reused id starts afresh: a short context selects all its positions
    out = src.select(0, torch.tensor([5]), torch.tensor([10]), 12)
    assert sorted(out[0][out[0] >= 0].tolist()) == list(range(10))


@pytest.mark.parametrize("kw,msg", [
    (dict(sinks=200, recent=60), "sinks \\+ recent"), (dict(persistence=1.0), "persistence"),
    (dict(pool=0.5), "pool"), (dict(drift=2.0), "drift"), (dict(layer_overlap=-0.1), "layer_overlap"),
    (dict(sinks=-1), "sinks"),
])
def test_workingset_bad_knobs(kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        WorkingSetSource(top_k=256, **kw)


@pytest.mark.parametrize("trace", ["replay", "bogus", W.Trace.REPLAY])
def test_options_take_a_generator_as_trace(trace):
    """``trace`` is a generator: a recorded trace is ``replay=FILE``; the error lists the
    generators only."""
    with pytest.raises(ValueError, match=r"trace must be a generator, one of \['workingset', 'correlated', "
                                         r"'uniform', 'indexer'\].*--replay FILE"):
        W.WhatifOptions(trace=trace)
    assert W.WhatifOptions(trace="indexer").trace is W.Trace.INDEXER


# ------------------------------------------------------------------ CLI
SMALL = ["--requests", "2", "--steps", "25", "--layers", "2", "--quiet"]


def test_cli_fixed_interface_json(capsys):
    rc = main(["whatif", "--preset", "glm51", "--top-k", "2048", "--buffers", "2048", "4096", "8192",
               "--json"] + SMALL)
    out = capsys.readouterr()
    assert rc == 0, out.err
    r = json.loads(out.out)
    assert [e["buffer"] for e in r["results"]] == [2048, 4096, 8192]
    for e in r["results"]:
        assert isinstance(e["buffer"], int)
        assert isinstance(e["lru_miss_rate"], float) and isinstance(e["belady_miss_rate"], float)
        assert e["belady_miss_rate"] <= e["lru_miss_rate"]
        assert set(e["lru_staging_us"]) == {"mean", "p99", "max"}
    e = r["results"][1]
    assert e["lru_staging_bytes"]["mean"] == pytest.approx(e["lru_staging_rows"]["mean"] * 656)
    assert e["lru_staging_us"]["mean"] == pytest.approx(e["lru_staging_bytes"]["mean"] / 55e9 * 1e6)
    assert r["trace"]["preset"] == "glm51" and r["pcie_GBps"] == 55.0
    assert 0.0 < r["overlap"]["adjacent_layer"] <= 1.0


def test_cli_table_plot_and_bf16(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = str(tmp_path / "plots")
    assert main(["whatif", "--plot", d, "--format", "bf16", "--pcie-gbps", "25"] + SMALL) == 0
    out = capsys.readouterr().out
    assert "LRU miss" in out and "Belady miss" in out and "1152 B/row" in out and "25 GB/s" in out
    assert os.path.getsize(os.path.join(d, "whatif.png")) > 1000


def test_cli_replay_of_a_recorded_file(tmp_path, capsys):
    rec = TraceRecorder(num_layers=1, top_k=4)
    for s in range(6):
        rec.begin_step([0, 1], [20 + s, 9 + s])
        rec.add_layer(0, np.array([[0, 5, 10 + s, 19 + s], [1, 2, 3, -1]], np.int32))
    path = str(tmp_path / "t.npz")
    rec.save(path)
    assert main(["whatif", "--replay", path, "--buffers", "4", "8", "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["trace"]["source"] == "replay" and r["trace"]["warmup"] == 0
    assert r["overlap"]["adjacent_layer"] is None and r["results"][0]["prefetch_hit_gain"] is None
    assert r["results"][1]["lru_misses"] <= r["results"][0]["lru_misses"]


@pytest.mark.parametrize("argv,msg", [
    (["--replay", "/nonexistent.npz"], "nonexistent.npz"),
    (["--buffers", "100"], "buffer size"),
    (["--trace", "uniform", "--persistence", "0.5"], "does not apply"),
    (["--replay", "x.npz", "--requests", "3"], "generated traces"),
    (["--persistence", "1.5"], "persistence"),
    (["--row-bytes", "0"], "--row-bytes must be >= 1"),
    (["--threads", "0"], "threads"),
    (["--threads", "100000"], "threads=100000 is out of range"),  # torch would crash the process
    (["--steps", "20"], "nothing to count"),  # the preset's 20 warm-up steps
])
def test_cli_bad_input_exit_2_one_line(capsys, argv, msg):
    assert main(["whatif", "--quiet"] + argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


_TINY = ["--requests", "2", "--context", "4K", "--steps", "10", "--layers", "2", "--top-k", "128", "--warmup", "0"]


@pytest.mark.parametrize("argv,code,msg", [
    (["--buffers", "99999999999"], 3, "of host memory"),  # refused before allocating anything
    (["--pool", "nan"], 2, "pool must be"),
    (["--pool", "1e12"], 3, "of host memory"),
    (["--requests", "10000000", "--context", "1M", "--trace", "uniform"], 3, "of host memory"),
])
def test_cli_sizes_refused_before_work(capsys, argv, code, msg):
    assert main(["whatif", "--quiet"] + _TINY + argv) == code
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_cli_cuda_without_cuda_is_a_missing_dependency(capsys):
    assert main(["whatif", "--quiet", "--device", "cuda"] + _TINY) == 4
    assert "no CUDA device" in capsys.readouterr().err


def test_cli_malformed_trace_file_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    assert main(["whatif", "--replay", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "bad.npz" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_plot_dir_checked_before_work(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")  # whatif asks for matplotlib (exit 4) before it looks at the path
    monkeypatch.setattr(W, "run_whatif", lambda o: pytest.fail("ran before checking --plot"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["whatif", "--plot", str(blocker / "sub")] + SMALL) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_is_refused_before_work(tmp_path, capsys, monkeypatch):
    def missing():
        raise W.PlotUnavailable("--plot needs matplotlib")

    monkeypatch.setattr(W, "require_matplotlib", missing)
    monkeypatch.setattr(W, "run_whatif", lambda o: pytest.fail("ran before checking --plot"))
    assert main(["whatif", "--plot", str(tmp_path)] + SMALL) == 4
    assert "matplotlib" in capsys.readouterr().err
