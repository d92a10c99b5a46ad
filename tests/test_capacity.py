"""The capacity search against ``hisparse plan``, the shared search, and the benchmark's dry run."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_capacity, capacity_sweep
from hisparse_tools.capacity import Budget, RunShape, engine_config, largest_fit, tier_limits
from hisparse_tools.cli import main as hisparse_main
from hisparse_tools.mini_engine.graphs import DecodeMode
from hisparse_tools.plan import PlanInputs, plan


def test_defaults_agree_with_hisparse_plan(capsys):
    """One H200 (141 GB, plan's default 80 GiB for KV), 61 layers, 128K: the numbers
    ``hisparse plan`` prints (13 resident, 68 hisparse, GPU-bound)."""
    lim = tier_limits(Budget(), 131072)
    assert lim["resident"] == {"batch": 13, "bound": "gpu", "gpu_bytes_per_request": 131072 * 61 * (656 + 132),
                               "host_bytes_per_request": 0, "kv_rows_per_layer": 13 * 131072,
                               "kv_bytes": 13 * 131072 * 61 * 656}
    assert lim["hisparse"]["batch"] == 68 and lim["hisparse"]["bound"] == "gpu"
    assert hisparse_main(["plan", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["concurrency"]["resident"], p["concurrency"]["hisparse"]) == (13, 68)
    assert lim["hisparse"]["gpu_bytes_per_request"] == p["per_request_bytes"]["hisparse_gpu"]


@pytest.mark.parametrize("context", [32768, 65536, 131072, 1000])
@pytest.mark.parametrize("host", [1 << 40, 100 << 30, 8 << 30])
def test_limits_are_plans_numbers(context, host):
    b = Budget(host_memory=host)
    lim = tier_limits(b, context)
    p = plan(PlanInputs(num_layers=61, context_len=context, gpu_bytes=80 << 30, host_bytes=host, max_seqs=1024))
    assert lim["resident"]["batch"] == p["concurrency"]["resident"]
    assert lim["hisparse"]["batch"] == p["concurrency"]["hisparse"]
    assert lim["hisparse"]["bound"] == p["binding"]
    if lim["hisparse"]["bound"] == "host":  # the host pool of one more request would not fit
        n = lim["hisparse"]["batch"]
        assert (n + 1) * lim["hisparse"]["host_bytes_per_request"] > host >= n * lim["hisparse"]["host_bytes_per_request"]


def test_bounds_gpu_host_and_max_seqs():
    assert tier_limits(Budget(host_memory=100 << 30), 131072)["hisparse"]["bound"] == "host"
    small = tier_limits(Budget(max_seqs=8), 32768)
    assert small["resident"]["bound"] == "max_seqs" and small["hisparse"]["bound"] == "max_seqs"
    with pytest.raises(ValueError, match="leaves nothing"):
        Budget(reserve=Budget().gpu_total)


def test_largest_fit():
    for limit in (0, 1, 2, 3, 7, 64, 100):
        assert largest_fit(lambda n: n <= limit, 1000) == limit
    assert largest_fit(lambda n: True, 37) == 37
    assert largest_fit(lambda n: True, 1) == 1


def test_engine_config_of_a_tier():
    b = Budget(num_layers=2, top_k=8, hot_rows=16, block_size=16, max_seqs=64)
    s = RunShape(run_layers=2, num_heads=2, hidden=32, indexer_dim=16, decode_steps=3, tail=8, device="cpu",
                 decode_mode=DecodeMode.EAGER)
    cfg = engine_config(b, s, context=64, batch=5)
    assert (cfg.num_requests, cfg.min_prompt, cfg.max_prompt, cfg.synthetic_context) == (5, 64, 64, 56)
    assert cfg.min_decode == cfg.max_decode == 3 and cfg.arrival_every == 0 and not cfg.graphs
    assert cfg.max_batch_tokens >= 5 * 8 and cfg.cache_config().device_buffer_size == 16
    with pytest.raises(ValueError, match="CUDA device"):  # graphs (RunShape's default) on a CPU
        engine_config(b, RunShape(device="cpu"), context=64, batch=5)


def test_bench_capacity_dry_run(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--dry-run", "--contexts", "64", "--same-batch", "--locality", "0.8",
                                "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["shape"]["locality"] == 0.8
    c = d["contexts"]["64"]
    assert c["limits"]["resident"]["batch"] == 2 and c["limits"]["hisparse"]["batch"] == 5
    assert c["limits"]["hisparse"]["bound"] == "host"
    assert c["compare"]["within_tolerance"] and c["compare"]["tokens_compared"] > 0
    for name in ("resident", "hisparse", "hisparse_same_batch"):
        dec = c["runs"][name]["decode"]
        assert dec["step_ms"]["n"] == 3 and dec["tokens_per_s"] > 0 and dec["full_depth"]["layers"] == 2
    assert c["runs"]["hisparse"]["cache"]["hit_rate"] is not None
    assert c["ratio_tokens_per_s"] > 0 and c["same_batch_step_ratio"] > 0
    assert d["env"]["torch"] and d["shape"]["decode_mode"] == "padded"
    text = capsys.readouterr().out
    assert "x resident" in text and "hisparse vs resident, same batch" in text
    # the batch size alone, between the two batches the largest-batch comparison spans
    hb = c["compare_hisparse_batch_sizes"]
    assert hb["tokens_compared"] == c["compare"]["tokens_compared"]
    if c["compare_same_batch"]["bitwise_equal"]:  # then both compare the same outputs
        assert hb["max_abs_diff"] == c["compare"]["max_abs_diff"]
    assert "hisparse at the resident's batch vs at its own" in text


def test_bench_capacity_hisparse_batch_below_the_residents(tmp_path, capsys):
    """A buffer large for the context leaves hisparse fewer requests than the resident:
    the runs are compared over the requests both served, not failed."""
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--dry-run", "--contexts", "64", "--buffer", "128", "--same-batch",
                                "--out", str(out)]) == 0
    c = json.loads(out.read_text())["contexts"]["64"]
    assert c["limits"]["hisparse"]["batch"] < c["limits"]["resident"]["batch"]
    one = c["compare_hisparse_batch_sizes"]["tokens_compared"]  # hisparse's own batch's tokens
    assert 0 < one == c["compare"]["tokens_compared"] < c["compare_same_batch"]["tokens_compared"]
    assert c["compare"]["within_tolerance"]


def test_bench_capacity_buffer_sizes_hisparse(tmp_path):
    """--buffer S: hisparse's hot buffers (and so its GPU limit) grow with S; the run uses S."""
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--dry-run", "--contexts", "64", "--buffer", "24", "--out", str(out)]) == 0
    c = json.loads(out.read_text())["contexts"]["64"]
    assert c["runs"]["hisparse"]["config"]["device_buffer_size"] == 24
    lim = c["limits"]["hisparse"]
    assert lim["bound"] == "gpu" and lim["batch"] == lim["gpu_limit"] == 4  # 5 with the dry run's 16 slots
    assert c["limits"]["resident"]["batch"] == 2  # the resident tier has no hot buffer


def test_bench_capacity_bad_input(tmp_path, capsys):
    assert bench_capacity.main(["--dry-run", "--contexts", "12Q"]) == 2
    assert bench_capacity.main(["--dry-run", "--profile", "-1"]) == 2
    for bad in ("1", "-0.1", "x"):
        assert bench_capacity.main(["--dry-run", "--locality", bad]) == 2
    assert bench_capacity.main(["--dry-run", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_index_share_sizes_indexer_keys_of_full_layers_only():
    """One indexer per 4 layers (16 of 61 keep keys): both tiers hold fewer key bytes."""
    one, four = tier_limits(Budget(), 131072), tier_limits(Budget(index_share=4), 131072)
    C, L, row, I = 131072, 61, 656, 132
    assert four["resident"]["gpu_bytes_per_request"] == C * (L * row + 16 * I)
    drop = one["hisparse"]["gpu_bytes_per_request"] - four["hisparse"]["gpu_bytes_per_request"]
    assert drop == C * (L - 16) * I
    assert four["resident"]["batch"] == 15 and four["hisparse"]["batch"] == 180
    p = plan(PlanInputs(num_layers=61, context_len=C, gpu_bytes=80 << 30, host_bytes=1 << 40, max_seqs=1024,
                        index_share=4))
    assert (p["concurrency"]["resident"], p["concurrency"]["hisparse"]) == (15, 180)
    with pytest.raises(ValueError, match="index_share"):
        Budget(index_share=0)


def test_bench_capacity_dry_run_index_share_prefetch(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--dry-run", "--contexts", "64", "--index-share", "2", "--prefetch",
                                "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["budget"]["index_share"] == 2 and d["shape"]["prefetch"] is True
    c = d["contexts"]["64"]
    assert c["compare"]["within_tolerance"], c["compare"]
    hs = c["runs"]["hisparse"]
    assert hs["config"]["index_share"] == 2 and hs["config"]["prefetch"] is True
    assert hs["cache"]["prefetch_rows"] > 0 and c["runs"]["resident"].get("cache") is None
    assert "prefetched rows" in capsys.readouterr().out
    assert bench_capacity.main(["--dry-run", "--index-share", "0"]) == 2


def test_prefetch_quality_from_two_runs_of_one_trace():
    with_pf = {"layer_prefetch_rows": [0, 100, 80], "layer_misses": [50, 10, 30]}
    without = {"layer_misses": [50, 60, 40]}
    q = bench_capacity.prefetch_quality(with_pf, without, 656)
    assert [x["layer"] for x in q["layers"]] == [1, 2]
    assert q["layers"][0] == {"layer": 1, "prefetched": 100, "useful": 50, "precision": 0.5, "recall": 50 / 60,
                              "wasted_bytes": 50 * 656}
    assert q["precision"] == 60 / 180 and q["recall"] == 60 / 100 and q["wasted_bytes"] == 120 * 656
    assert q["recall_all_layers"] == 60 / 150


def test_bench_capacity_dry_run_prefetch_quality(tmp_path):
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--dry-run", "--contexts", "64", "--index-correlation", "0.9", "--prefetch",
                                "--same-batch", "--out", str(out)]) == 0
    c = json.loads(out.read_text())["contexts"]["64"]
    assert len(c["adjacent_layer_overlap"]) == 1 and c["adjacent_layer_overlap"][0] is not None
    assert "hisparse_same_batch_no_prefetch" in c["runs"] and "prefetch_quality" in c
    assert c["runs"]["hisparse_same_batch_no_prefetch"]["cache"]["prefetch_rows"] == 0
    assert c["runs"]["hisparse_same_batch"]["config"]["index_correlation"] == 0.9
    assert bench_capacity.main(["--dry-run", "--index-correlation", "1.5"]) == 2
    assert bench_capacity.main(["--dry-run", "--prefetch"]) == 2  # it would stage into no layer
    assert bench_capacity.main(["--dry-run", "--index-share", "3"]) == 2  # 2 run layers: not the model's share


# ------------------------------------------------------------------ --pool-rows (the elastic tier)
def test_bench_capacity_pool_rows_config_on_the_gpu_path():
    """The GPU run's arguments and configs, built on CPU (nothing allocated): --pool-rows
    auto gives every hisparse run the rows the resident tier keeps for its KV (its batch x
    the context per layer), the resident runs none; N gives every hisparse run N."""
    a = bench_capacity.parse_args(["--pool-rows", "auto", "--contexts", "128K", "--same-batch"])
    assert a.pool_rows == "auto"
    budget, shape, contexts = bench_capacity.setup(a)
    bench_capacity.check_pool_rows(budget, contexts, a)
    lim = tier_limits(budget, contexts[0])
    res, hs = lim["resident"], lim["hisparse"]
    assert res["kv_rows_per_layer"] == res["batch"] * 131072 > 0
    assert res["kv_bytes"] == res["kv_rows_per_layer"] * 61 * 656
    for b in bench_capacity.hisparse_batches(lim, a):
        assert b in (hs["batch"], res["batch"])
        pool = bench_capacity.pool_for(budget, lim, b, a)
        assert pool["rows"] == res["kv_rows_per_layer"] and pool["from"].startswith("auto")
        cfg = engine_config(budget, shape, context=131072, batch=b, pool_rows=pool["rows"])
        cc = cfg.cache_config()
        assert cc.device == "cuda" and cfg.graphs and cc.device_pool_rows == res["kv_rows_per_layer"]
        assert cc.hot_rows_per_layer == -(-b * 4097 // 64) * 64 and cc.pool_pages > 0
        assert cc.device_rows_per_layer <= res["kv_rows_per_layer"]
    assert engine_config(budget, shape, context=131072, batch=1).cache_config().device_pool_rows is None
    n = bench_capacity.parse_args(["--pool-rows", "2M"])
    assert n.pool_rows == 2 << 20
    assert bench_capacity.pool_for(budget, lim, hs["batch"], n)["rows"] == 2 << 20
    none = bench_capacity.parse_args([])
    assert none.pool_rows is None and bench_capacity.pool_for(budget, lim, 1, none) == {"rows": None, "from": None}


def test_bench_capacity_pool_budget_is_the_kv_budget_less_hisparse_state():
    """--pool-rows budget: the rows the GPU's KV budget holds at the run's batch once
    hisparse's other per-request GPU bytes are out; at 128K and the resident's batch it
    holds every request's pages beside the hot buffers (auto does not: one request short)."""
    a = bench_capacity.parse_args(["--pool-rows", "budget", "--contexts", "128K", "--buffer", "5120"])
    budget, _, contexts = bench_capacity.setup(a)
    lim = tier_limits(budget, contexts[0])
    hs, res = lim["hisparse"], lim["resident"]
    nonrow = hs["nonrow_gpu_bytes_per_request"]
    assert nonrow == hs["gpu_bytes_per_request"] - 61 * 5121 * 656 > 0
    b = res["batch"]
    p = bench_capacity.pool_for(budget, lim, b, a)
    assert p["rows"] == (budget.kv_bytes - b * nonrow) // (61 * 656) and p["from"].startswith("budget")
    hot = -(-b * 5121 // 64) * 64
    assert p["rows"] - hot >= b * -(-(131072 + 64) // 64) * 64  # every request resident, 64 decode steps on
    auto = bench_capacity.pool_for(budget, lim, b, bench_capacity.parse_args(["--pool-rows", "auto"]))
    assert auto["rows"] - hot < b * 131072  # the hot buffers leave auto a request short
    # at hisparse's own largest batch the budget holds little beyond the hot buffers
    big = bench_capacity.pool_for(budget, lim, hs["batch"], a)
    assert big["rows"] is None or big["rows"] < p["rows"]


def test_bench_capacity_pool_auto_below_the_hot_buffers_is_no_pool():
    a = bench_capacity.parse_args(["--dry-run", "--pool-rows", "auto"])
    budget, _, _ = bench_capacity.setup(a)
    lim = tier_limits(budget, 64)  # resident: 2 x 64 = 128 rows; hisparse's 5 x 17 hot rows -> 128, + a page
    p = bench_capacity.pool_for(budget, lim, 5, a)
    assert p["rows"] is None and "fewer than the 192 a batch of 5 needs" in p["note"]
    assert bench_capacity.pool_for(budget, lim, 1, a)["rows"] == 128


def test_bench_capacity_dry_run_with_a_pool_that_holds_every_request(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--dry-run", "--contexts", "64", "--pool-rows", "1024", "--out", str(out)]) == 0
    c = json.loads(out.read_text())["contexts"]["64"]
    h, r = c["runs"]["hisparse"], c["runs"]["resident"]
    assert h["config"]["device_pool_rows"] == 1024 and h["pool"] == {"rows": 1024, "from": "given", "minimum": 192}
    assert r["config"]["device_pool_rows"] is None and "pool" not in r
    k = h["cache"]  # 5 requests x 2 pages of 64 fit the 14 pages: every lookup resident, none missed
    assert k["resident_rows"] > 0 and k["misses"] == 0 and k["spills"] == 0 and k["hit_rate"] == 1.0
    assert (k["finished_resident"], k["finished_hot"]) == (5, 0)  # every request resident to the end
    assert c["compare"]["within_tolerance"]
    text = capsys.readouterr().out
    assert "hisparse: device pool 1024 rows per layer (given)" in text and "misses 0, spills 0" in text


# ------------------------------------------------------------------ --sweep (a batch sweep per context)
def test_sweep_batches_default_given_and_capped():
    assert capacity_sweep.default_batches(13, 68) == [1, 2, 4, 8, 13, 16, 32, 64, 68]
    assert capacity_sweep.default_batches(2, 5) == [1, 2, 4, 5]
    assert capacity_sweep.default_batches(0, 1) == [1]
    lim = {"context": 64, "resident": {"batch": 2}, "hisparse": {"batch": 5}}
    assert capacity_sweep.sweep_batches(lim, None, None) == ([1, 2, 4, 5], [])
    b, notes = capacity_sweep.sweep_batches(lim, [4, 9, 1, 4], None)
    assert b == [1, 4] and notes == ["batches [9] left out: above hisparse's largest batch (5) at context 64"]
    b, notes = capacity_sweep.sweep_batches(lim, None, 3)
    assert b == [1, 2, 3] and "capped" in notes[0]
    none = {"context": 64, "resident": {"batch": 0}, "hisparse": {"batch": 0}}
    assert capacity_sweep.sweep_batches(none, None, None)[0] == []


def test_sweep_targets_and_miss_rate():
    assert capacity_sweep.miss_rate({"hits": 6, "misses": 2, "resident_rows": 2}) == 0.2
    assert capacity_sweep.miss_rate({"hits": 0, "misses": 0, "resident_rows": 0}) is None
    rows = [{"batch": 1, "targets": {"throughput": True, "throughput_gpu": None, "miss_rate": True}},
            {"batch": 2, "targets": {"throughput": False, "throughput_gpu": None, "miss_rate": True}},
            {"batch": 4, "targets": {"throughput": None, "throughput_gpu": None, "miss_rate": False}}]
    t = capacity_sweep.sweep_targets(rows)
    assert t["throughput"] == {"batches": [1, 2], "missed": [2], "met": False}
    assert t["throughput_gpu"] == {"batches": [], "missed": [], "met": None}
    assert t["miss_rate"] == {"batches": [1, 2, 4], "missed": [4], "met": False}


def test_bench_capacity_sweep_on_the_gpu_path():
    """--sweep at 128K, built on CPU (nothing run): the default batches from 1 to
    hisparse's 68 with the resident's 13, and the elastic runs' auto pool at each: the
    resident tier's KV rows (13 x 128K per layer), every batch's hot buffers covered."""
    a = bench_capacity.parse_args(["--sweep", "--contexts", "128K"])
    budget, _, contexts = bench_capacity.setup(a)
    lim = tier_limits(budget, contexts[0])
    assert bench_capacity.hisparse_batches(lim, a) == [1, 2, 4, 8, 13, 16, 32, 64, 68]
    bench_capacity.check_pool_rows(budget, contexts, a)
    elastic = bench_capacity.parse_args(["--sweep", "--pool-rows", "auto"])
    for b in bench_capacity.hisparse_batches(lim, a):
        p = bench_capacity.pool_for(budget, lim, b, elastic)
        assert p["rows"] == 13 * 131072 and p["minimum"] <= p["rows"]


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    """One dry-run sweep at context 64 with a pool that holds every request (1024 rows:
    hisparse's 5 requests x 2 pages fit its 14 pages), with --plot where matplotlib is
    installed: (exit status, JSON, stdout, the plot's path or None)."""
    import contextlib
    import importlib.util
    import io

    d = tmp_path_factory.mktemp("sweep")
    out, png = d / "sweep.json", d / "sweep.png"
    plot = importlib.util.find_spec("matplotlib") is not None
    argv = ["--dry-run", "--sweep", "--contexts", "64", "--pool-rows", "1024", "--out", str(out)]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = bench_capacity.main(argv + (["--plot", str(png)] if plot else []))
    return rc, json.loads(out.read_text()), text.getvalue(), png if plot else None


def test_bench_capacity_sweep_dry_run_table_and_json(sweep_run):
    rc, d, text, _ = sweep_run
    assert rc == 0 and "error" not in d
    assert d["sweep"] == {"target_ratio": 0.97, "elastic_pool_rows": 1024}
    c = d["contexts"]["64"]
    assert c["sweep_batches"] == [1, 2, 4, 5] and [r["batch"] for r in c["rows"]] == [1, 2, 4, 5]
    assert c["limits"]["resident"]["batch"] == 2 and c["compare_failures"] == []
    for r in c["rows"]:
        b, runs = r["batch"], r["runs"]
        assert set(runs) == {"resident", "fixed", "elastic"}
        assert ("skipped" in runs["resident"]) == (b > 2)  # the resident tier only where it fits
        for k in ("fixed", "elastic"):
            dec = runs[k]["decode"]
            assert dec["batch"] == b and dec["step_ms"]["n"] == 3 and r["tokens_per_s"][k] > 0
            assert 0.0 <= r["miss_rate"][k] <= 1.0
        assert runs["fixed"]["config"]["device_pool_rows"] is None and "pool" not in runs["fixed"]
        assert runs["elastic"]["config"]["device_pool_rows"] == 1024
        assert r["miss_rate"]["fixed"] > 0  # 16 hot slots for 64 rows: the fixed design misses
        if b <= 2:
            assert r["ratio"]["elastic_over_resident"] > 0 and r["ratio"]["fixed_over_resident"] > 0
            assert isinstance(r["targets"]["throughput"], bool)
            assert set(r["compare"]) == {"fixed_vs_resident", "elastic_vs_resident", "elastic_vs_fixed"}
        else:
            assert r["ratio"]["elastic_over_resident"] is None and r["targets"]["throughput"] is None
            assert set(r["compare"]) == {"elastic_vs_fixed"}
        assert all(v["within_tolerance"] for v in r["compare"].values())
        assert r["targets"]["throughput_gpu"] is None  # no replays' GPU time on CPU
    t = c["targets"]
    assert t["threshold"] == 0.97 and t["throughput"]["batches"] == [1, 2]
    assert t["miss_rate"] == {"batches": [1, 2, 4, 5], "missed": [], "met": True}
    for head in ("resident tok/s", "elastic x res", "fixed miss", "elastic res/hot", "miss <= fixed"):
        assert head in text
    assert "context 64: target elastic miss rate <= fixed: met (batches [1, 2, 4, 5])" in text
    assert "context 64: elastic: device pool 1024 rows per layer (given)" in text


def test_bench_capacity_sweep_elastic_holding_everything_never_misses(sweep_run):
    """At the resident tier's batch (and every other), a pool that holds every request:
    each request stays resident to the end, no spill, no miss, outputs the resident's."""
    _, d, _, _ = sweep_run
    c = d["contexts"]["64"]
    res = {r["batch"]: r for r in c["rows"]}[c["limits"]["resident"]["batch"]]
    e = res["elastic"]
    assert (e["misses"], e["spills"], e["seeded_rows"]) == (0, 0, 0) and res["miss_rate"]["elastic"] == 0.0
    assert (e["resident_requests"], e["hot_requests"]) == (2, 0) and e["resident_rows"] > 0
    assert res["compare"]["elastic_vs_resident"]["bitwise_equal"]
    for r in c["rows"]:
        assert r["elastic"]["spills"] == 0 and r["elastic"]["misses"] == 0
        assert (r["elastic"]["resident_requests"], r["elastic"]["hot_requests"]) == (r["batch"], 0)


def test_bench_capacity_sweep_plot_written(sweep_run):
    _, d, text, png = sweep_run
    if png is None:
        pytest.skip("matplotlib is not installed: --plot was not asked for, so no plot to check")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert d["plot"] == str(png) and f"wrote {png}" in text


def test_bench_capacity_sweep_auto_pool_given_batches(tmp_path, capsys):
    """--sweep-batches, the default auto pool: at context 64 the resident tier's 128 KV
    rows hold one batch-1 request's hot buffer and a page (it spills: hot at the end), and
    not a batch of 4's hot buffers (no pool: no elastic run, said so); 9 is left out."""
    out = tmp_path / "sweep.json"
    assert bench_capacity.main(["--dry-run", "--sweep", "--contexts", "64", "--sweep-batches", "4", "1", "9",
                                "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["sweep"]["elastic_pool_rows"] == "auto"
    c = d["contexts"]["64"]
    one, four = c["rows"]
    assert (one["batch"], four["batch"]) == (1, 4) and "above hisparse's largest batch (5)" in c["notes"][0]
    assert one["elastic"]["pool"]["rows"] == 128 and one["elastic"]["ran"]
    assert one["elastic"]["spills"] == 1 and (one["elastic"]["resident_requests"], one["elastic"]["hot_requests"]) == (0, 1)
    assert not four["elastic"]["ran"] and "no pool" in four["runs"]["elastic"]["skipped"]
    assert four["miss_rate"]["elastic"] is None and four["targets"]["miss_rate"] is None
    assert c["targets"]["miss_rate"]["batches"] == [1]
    text = capsys.readouterr().out
    assert "batch 4: elastic skipped: no pool" in text and "no pool" in text
