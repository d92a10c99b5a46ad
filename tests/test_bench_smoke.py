"""The benchmarks run end to end on CPU (tiny shapes, Triton interpreter) and write the
JSON fields BENCHMARKS.md is built from. Timings here mean nothing; what is checked is
that a benchmark still runs, verifies its results and records what it claims to."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import (bench_decode, bench_host_calls, bench_prefill, bench_prepare, bench_staging,
                        bench_vllm_resolve, profile_e2e_host, soak)


def test_bench_prefill_dry_run(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert bench_prefill.main(["--dry-run", "--rows", "64", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {(c["format"], c["workspace"]) for c in d["cases"]} == {
        ("fp8_ds_mla", "bf16"), ("fp8_ds_mla", "stored"), ("bf16", "bf16")}
    for c in d["cases"]:
        assert c["rows"] == 64 and c["host_us_per_call"] > 0
        assert c["best_graph"] is None  # graph replay is CUDA only
        assert all(v["rows_per_program"] and v["num_warps"] for v in c["variants"])
    assert "dry run" in d["summary"]["note"]


def test_bench_staging_dry_run_records_hit_rates(tmp_path, capsys):
    out = tmp_path / "staging.json"
    assert bench_staging.main(["--dry-run", "--no-sweep", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["B"] for r in d["resolve"]] == [1, 2]
    for r in d["resolve"]:
        for key in ("resolve_all_hit", "resolve_hit_90", "resolve_hit_50", "resolve_all_miss",
                    "resolve_copy_all_miss"):
            assert r[key]["median_us"] > 0, key


def test_bench_decode_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "decode.json"
    argv = ["--device", "cpu", "--tokens", "2", "--heads", "16", "--topk", "16", "--iters", "1",
            "--warmup", "0", "--formats", "fp8_ds_mla", "bf16", "--backends", "triton",
            "--rows-per-token", "32", "--out", str(out)]
    assert bench_decode.main(argv) == 0
    d = json.loads(out.read_text())
    tri = [r for r in d["results"] if r["backend"] == "triton"]
    assert len(tri) == 2 and all(r["status"] == "ok" for r in tri), [r.get("reason") for r in tri]
    assert all(r["max_err_out"] < 0.05 for r in tri)


def test_bench_vllm_resolve_missing_library_exits_2(tmp_path, capsys):
    """Without the vLLM library (no .so and no .so.xz) the script says so and exits 2
    before touching a GPU: no numbers are made up."""
    lib = tmp_path / "nowhere" / "_C_stable_libtorch.abi3.so"
    out = tmp_path / "vllm_resolve.json"
    rc = bench_vllm_resolve.main(["--lib", str(lib), "--reps", "3", "--batches", "1", "8",
                                           "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "vLLM library not found" in err and str(lib) in err and str(lib) + ".xz" in err
    assert not out.exists()


def test_bench_host_calls_cpu_smoke(capsys):
    argv = ["--device", "cpu", "--kernels", "torch", "--requests", "3", "--layers", "2",
            "--context", "40", "--top-k", "8", "--steps", "2", "--top", "3"]
    assert bench_host_calls.main(argv) == 0
    out = capsys.readouterr().out
    assert "write_new_rows" in out and "convert" in out and "kernels torch" in out


def test_bench_host_calls_compare_cpu_smoke(capsys, tmp_path):
    """--compare on CPU: the eager and padded modes interleaved, each mode's medians and
    its ratio to eager in the table and the JSON."""
    out_file = tmp_path / "cmp.json"
    argv = ["--device", "cpu", "--kernels", "torch", "--requests", "3", "--layers", "2", "--context", "40",
            "--top-k", "8", "--steps", "2", "--pad-to", "4", "--compare", "--out", str(out_file)]
    assert bench_host_calls.main(argv) == 0
    out = capsys.readouterr().out
    assert "interleaved" in out and "eager" in out and "padded" in out
    res = json.loads(out_file.read_text())
    assert set(res["modes"]) == {"eager", "padded"} and res["modes"]["eager"]["x_eager"] == 1.0
    for d in res["modes"].values():
        assert len(d["us"]["per_layer"]) == 3 and d["us"]["per_layer"]["median"] > 0
    assert res["modes"]["padded"]["mode"]["pad_to"] == 4


def test_bench_prepare_cpu_smoke(capsys, tmp_path):
    """Both modes interleaved, through a recycle of the requests and demotions of the
    elastic tier (a pool of 3 pages for 4 requests whose contexts outgrow a page)."""
    out_file = tmp_path / "prep.json"
    argv = ["--requests", "4", "--layers", "3", "--context", "62", "--steps", "6", "--warmup", "1",
            "--recycle", "4", "--top-k", "4", "--device-pool-rows", "256", "--profile", "--top", "3",
            "--out", str(out_file)]
    assert bench_prepare.main(argv) == 0
    out = capsys.readouterr().out
    assert "interleaved" in out and "eager" in out and "padded" in out and "prepare_for_batch" in out
    res = json.loads(out_file.read_text())
    assert set(res["modes"]) == {"eager", "padded"} and res["modes"]["eager"]["x_eager"] == 1.0
    assert res["modes"]["padded"]["pad_to"] == 4
    for d in res["modes"].values():
        assert d["us"]["median"] > 0 and d["spills"] > 0


def test_profile_e2e_host_timers_dry_run(tmp_path, capsys):
    """The host-timer pass runs both engines (collected between) and reports the calls."""
    out = tmp_path / "timers.txt"
    argv = ["--dry-run", "--host-timers", "--only-timers", "--kinds", "hisparse", "resident",
            "--out", str(out)]
    assert profile_e2e_host.main(argv) == 0
    text = out.read_text()
    for kind in ("hisparse", "resident"):
        assert f"== {kind}: host ms per decode step" in text
    assert "kv.write" in text and "kv.decode_rows" in text


def test_soak_tiny_records_memory_and_sizes_runs_to_the_budget(tmp_path, capsys):
    """A calibration run, then runs sized to what is left of the budget; host memory
    before, after and during every run; the total is the sum of the runs' steps."""
    out = tmp_path / "soak.json"
    argv = ["--preset", "tiny", "--steps", "4", "--calibrate-steps", "2", "--min-steps", "1",
            "--runs", "1", "--out", str(out)]
    assert soak.main(argv) == 0
    d = json.loads(out.read_text())
    assert [(r["steps"], r["calibration"]) for r in d["runs"]] == [(2, True), (4, False)]
    assert d["ok"] and d["total_steps"] == 6 and d["options"]["churn"] > 0
    for r in d["runs"]:
        m = r["memory"]
        assert r["ok"] and r["rows_verified"] > 0
        assert m["start"]["rss"] > 0 and m["end"]["rss"] > 0 and m["start"]["gpu_allocated"] is None
    assert "[soak] total tiny: 6 verified decode steps in 2 runs" in capsys.readouterr().out


def test_soak_stops_when_the_budget_is_spent(tmp_path, capsys):
    argv = ["--preset", "tiny", "--steps", "4", "--calibrate-steps", "2", "--min-steps", "3",
            "--runs", "3", "--budget-s", "0.01"]
    assert soak.main(argv) == 0
    text = capsys.readouterr().out
    assert "[soak] stopping" in text and "2 verified decode steps in 1 runs" in text


def test_soak_bad_input_exits_2(tmp_path, capsys):
    assert soak.main(["--preset", "tiny", "--churn", "2"]) == 2
    assert "churn must be a number in [0, 1]" in capsys.readouterr().err
    assert soak.main(["--preset", "tiny", "--out", str(tmp_path)]) == 2


def test_bench_layer_dry_run_compares_every_mode(tmp_path, capsys):
    """The one-layer benchmark on tiny shapes: every mode runs, each output equals the
    resident one, the ratios and the prefetch quality are recorded."""
    from benchmarks import bench_layer

    out = tmp_path / "layer.json"
    assert bench_layer.main(["--dry-run", "--hits", "100", "75", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["env"]["torch"] and len(rep["cases"]) == 2
    for case in rep["cases"]:
        for mode in ("serial", "split", "prefetch_2layers"):
            assert case[mode]["max_rel_diff"] < 2e-2, (case["hit"], mode)
            assert case[mode]["ratio_vs_resident"] > 0
        q = case["prefetch_quality"]
        assert 0.0 <= q["precision"] <= 1.0 and 0.0 <= q["recall"] <= 1.0
    assert rep["cases"][1]["prefetch_quality"]["rows_staged"] > 0


def test_bench_elastic_dry_run_attends_resident_rows(tmp_path, capsys):
    """The elastic tier's benchmark on tiny shapes: every request resident, no miss, and
    hisparse's output equal to attention over the same rows."""
    from benchmarks import bench_elastic

    out = tmp_path / "elastic.json"
    assert bench_elastic.main(["--dry-run", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    (case,) = rep["cases"]
    assert case["misses"] == 0 and case["resident_rows"] > 0
    for mode in ("serial", "split"):
        assert case[mode]["max_rel_diff"] == 0.0
        assert isinstance(case[mode]["meets_target"], bool)
    assert case["serial_full"]["max_rel_diff"] == 0.0 and "resolve_full_alone" in case


def test_bench_prefix_times_full_hits(tmp_path, capsys):
    """The prefix lookup benchmark (the lookup, a full hit asserted in every call, and
    naming every block): min <= median <= p99."""
    from benchmarks import bench_prefix

    out = tmp_path / "prefix.json"
    assert bench_prefix.main(["--tokens", "256", "1000", "--block", "16", "--reps", "3", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["call"], c["tokens"], c["blocks"]) for c in cases] == [
        ("lookup", 256, 16), ("names", 256, 16), ("lookup", 1000, 62), ("names", 1000, 62)]
    assert all(0 < c["min_us"] <= c["median_us"] <= c["p99_us"] for c in cases)


def test_bench_prefix_add_request_and_pool_modes(tmp_path, capsys):
    """add_request on a real cache: every timed call a full hit, with the publisher gone
    or live (aliases); pool: groups x shared + requests x own rows, the pool empty after."""
    from benchmarks import bench_prefix

    out = tmp_path / "prefix.json"
    assert bench_prefix.main(["--mode", "add_request", "pool", "--tokens", "1000", "--block", "16", "--reps", "3",
                              "--publisher", "left", "live", "--requests", "6", "--groups", "2", "--shared", "64",
                              "--own", "40", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    adds = [c for c in cases if c["mode"] == "add_request"]
    assert [c["publisher"] for c in adds] == ["left", "live"]
    assert all(c["hit_tokens"] == 992 and c["add_request"]["n"] == 3 and isinstance(c["meets_target"], bool)
               for c in adds)
    (pool,) = [c for c in cases if c["mode"] == "pool"]
    assert pool["rows_target"] == 2 * 64 + 6 * 40 and pool["alias_blocks"] == 4 * 4
    assert pool["rows_used"] == 2 * 64 + 6 * 48  # each request's own 40 tokens take 3 whole blocks of 16
    assert pool["sharer_hit_tokens_min"] == 64 and pool["first_of_group_hit_tokens"] == [0, 0]
    assert pool["blocks_used_after_reset"] == 0 and pool["within_tolerance"] is False  # 30% over: tiny blocks


def test_profile_layer_dry_run_lists_each_mode(tmp_path, capsys):
    """The layer profiler on tiny shapes: one timeline per (hit rate, mode), each with
    entries in start order and a span that covers them."""
    from benchmarks import profile_layer

    out = tmp_path / "profile.json"
    assert profile_layer.main(["--dry-run", "--hits", "100", "50", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    cases = rep["cases"]
    assert [(c["hit"], c["mode"]) for c in cases] == [
        (h, m) for h in (1.0, 0.5) for m in ("resident", "serial", "split")]
    for c in cases:
        assert c["kernels"] and all(k["dur_us"] >= 0 and k["name"] for k in c["kernels"])
    ops = {(c["hit"], c["mode"]): len(c["kernels"]) for c in cases}
    for h in (1.0, 0.5):  # the cache's modes do more than the resident attention alone
        assert ops[(h, "serial")] > ops[(h, "resident")] and ops[(h, "split")] > ops[(h, "resident")]
    assert rep["env"]["torch"] == torch.__version__


def test_profile_layer_refuses_bad_arguments(capsys):
    from benchmarks import profile_layer

    with pytest.raises(SystemExit) as e:
        profile_layer.main(["--dry-run", "--hits", "120"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        profile_layer.main(["--context", "100"])  # shorter than the hot slots + top-k
    assert e.value.code == 2
    assert profile_layer.main(["--dry-run", "--out", "/proc/nope/x.json"]) == 2


def test_periodic_trace_has_exact_steady_misses_and_no_repeats_in_a_step():
    """The trace alone: each step K distinct positions, the core in [0, S) every step,
    fresh ones in [S, ctx - 1) coming back only after cycling through all of them."""
    from benchmarks.periodic_trace import PeriodicTrace
    tr = PeriodicTrace(3, K=10, S=20, ctx=61, hit=0.7, seed=5, device=torch.device("cpu"))
    assert (tr.core_n, tr.fresh_n, tr.miss_rate) == (7, 3, 0.3)
    seen: list[set] = [set() for _ in range(3)]
    for t in range(tr.cold // tr.fresh_n):  # one pass over the cycle: no fresh position twice
        step = tr.step(t)
        assert step.dtype == torch.int32 and step.shape == (3, 10)
        for b in range(3):
            row = step[b].tolist()
            assert len(set(row)) == 10
            core = {p for p in row if p < 20}
            assert core == set(tr.core[b].tolist())
            fresh = set(row) - core
            assert all(20 <= p < 60 for p in fresh) and not fresh & seen[b]
            seen[b] |= fresh
    with pytest.raises(ValueError, match="evicted before it comes back"):
        PeriodicTrace(1, K=8, S=16, ctx=30, hit=0.5, seed=0, device=torch.device("cpu"))


def test_bench_layer_periodic_dry_run_measures_the_trace_miss_rate(tmp_path, capsys):
    """bench_layer --trace periodic: the LRU runs on across steps and modes, and the
    cache's own counters see exactly the trace's steady miss rate in every mode (auto:
    both modes timed, one chosen); --modes auto needs this trace."""
    from benchmarks import bench_layer
    out = tmp_path / "p.json"
    assert bench_layer.main(["--dry-run", "--trace", "periodic", "--hits", "90", "75", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["miss_rate"] for c in cases] == [0.125, 0.25]
    for c in cases:
        for m in ("serial", "split", "auto", "staging_alone"):
            assert c[m]["measured_miss_rate"] == c["miss_rate"], (c["hit"], m)
        assert c["max_rel_diff"] == 0.0
        (choice,) = c["auto"]["choice"].values()  # one layer, one batch size
        assert choice["chosen"] in ("serial", "split") and min(choice["runs"].values()) >= 2, choice
        assert c["auto"]["ratio_vs_better"] > 0
    assert "misses 0.1250 (trace 0.1250)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_layer.main(["--dry-run", "--trace", "periodic", "--modes", "prefetch"])
    with pytest.raises(SystemExit):
        bench_layer.main(["--dry-run", "--modes", "auto"])


def test_records_name_the_commit_the_sender_gives(monkeypatch):
    """``HISPARSE_COMMIT`` (what gpu_run.sh reads from .gpu-deps/commit) wins over the
    checkout's git metadata, which a copied tree may carry stale; without it, git's HEAD."""
    from benchmarks import common

    monkeypatch.delenv("HISPARSE_COMMIT", raising=False)
    own = common.git_commit()
    monkeypatch.setenv("HISPARSE_COMMIT", "0123abc")
    assert common.git_commit() == {"commit": "0123abc", "commit_dirty": None}
    assert common.environment()["commit"] == "0123abc"
    monkeypatch.setenv("HISPARSE_COMMIT", "  ")
    assert common.git_commit() == own
