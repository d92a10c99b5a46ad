"""The ``hisparse`` command: every subcommand at a small size, --json fields, exit codes."""

import json
import subprocess
import sys

import pytest

from hisparse.tools.cli import main

STRESS_TINY = ["--requests", "2", "--context", "200", "--layers", "1", "--top-k", "8",
               "--buffer", "16", "--steps", "6", "--block-size", "16", "--device", "cpu", "--quiet"]


def _json(capsys, argv, rc=0):
    got = main(argv)
    out = capsys.readouterr()
    assert got == rc, out.err
    return json.loads(out.out)


def test_help_everywhere(capsys):
    assert main(["--help"]) == 0
    for cmd in ("stress", "autotune", "plan", "env"):
        assert main([cmd, "--help"]) == 0
        assert "--json" in capsys.readouterr().out
    assert main(["plan", "--help"]) == 0
    assert "N_hisparse = min(" in capsys.readouterr().out  # formulas documented
    assert main([]) == 2  # no command: usage on stderr, non-zero


def test_stress_json_fields(capsys):
    r = _json(capsys, ["stress", "--json"] + STRESS_TINY)
    assert r["ok"] is True and r["failures"] == []
    for k in ("hit_rate", "optimal_hit_rate", "bytes_h2d", "h2d_GBps", "step_ms_p50", "step_ms_p99",
              "host_pool_bytes", "host_rss_peak_bytes", "gpu_peak_bytes", "rows_verified"):
        assert k in r["overall"], k
    assert [d["layer"] for d in r["per_layer"]] == [0]
    assert len(r["per_step"]["hit_rate"]) == 6
    assert r["config"]["top_k"] == 8 and r["config"]["device_buffer_size"] == 16


def test_stress_table_and_corruption_exit_code(capsys):
    assert main(["stress"] + STRESS_TINY) == 0
    assert "RESULT: PASS" in capsys.readouterr().out
    assert main(["stress", "--verify", "all", "--corrupt-step", "1"] + STRESS_TINY) == 1
    out = capsys.readouterr().out
    assert "RESULT: FAIL" in out and "differs from the expected bytes" in out


def test_stress_record_replay(tmp_path, capsys):
    path = str(tmp_path / "t.npz")
    a = _json(capsys, ["stress", "--json", "--record", path] + STRESS_TINY)
    b = _json(capsys, ["stress", "--json", "--replay", path, "--quiet", "--device", "cpu"])
    assert b["workload"]["trace"] == "replay"
    assert (a["overall"]["hits"], a["overall"]["misses"]) == (b["overall"]["hits"], b["overall"]["misses"])


def test_stress_bad_input_exit_2(capsys):
    assert main(["stress", "--trace", "replay", "--quiet"]) == 2
    assert "needs a trace file" in capsys.readouterr().err
    assert main(["stress", "--verify", "lots"]) == 2  # argparse rejects it
    assert main(["stress", "--replay", "/nonexistent.npz", "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    assert main(["stress", "--plot", str(tmp_path)] + STRESS_TINY) == 4
    assert "needs matplotlib" in capsys.readouterr().err


def test_plot_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["stress", "--plot", str(tmp_path)] + STRESS_TINY) == 0
    assert (tmp_path / "hit_rate.png").stat().st_size > 0
    assert (tmp_path / "step_time.png").stat().st_size > 0


def test_plan_json_and_errors(capsys):
    r = _json(capsys, ["plan", "--json", "--layers", "2", "--context", "1000", "--format", "fp8_ds_mla",
                       "--top-k", "4", "--hot-rows", "8", "--indexer-bytes", "100",
                       "--gpu-memory", "10000000", "--host-memory", "20000000", "--max-seqs", "100",
                       "--target", "30"])
    assert r["concurrency"]["hisparse"] == 14 and r["binding"] == "host"
    assert r["concurrency"]["resident"] == 6
    assert r["target"]["host_pool_bytes"] == 30 * 1_343_488
    assert set(r["per_request_bytes"]) == {"resident_gpu", "hisparse_gpu", "hisparse_gpu_breakdown",
                                           "hisparse_host"}
    assert main(["plan", "--gpu-memory", "lots"]) == 2
    assert main(["plan", "--hot-rows", "10"]) == 2  # < top_k 2048
    assert "hot_rows" in capsys.readouterr().err
    assert main(["plan"]) == 0
    assert "concurrent requests" in capsys.readouterr().out


def test_autotune_json_cpu(tmp_path, capsys):
    out = tmp_path / "tuned.json"
    r = _json(capsys, ["autotune", "--json", "--quiet", "--device", "cpu", "--layers", "1",
                       "--top-k", "8", "--context", "32", "--heads", "2", "--steps", "2",
                       "--warmup", "1", "--candidates", "2", "--block-size", "16",
                       "--gpu-memory", "400KiB", "--out", str(out)])
    for k in ("max_num_reqs", "device_buffer_size", "backend", "measurements", "key", "config",
              "timings_are", "max_fit_reqs", "budget"):
        assert k in r, k
    assert "CPU timings" in r["timings_are"]
    assert json.loads(out.read_text())["max_num_reqs"] == r["max_num_reqs"]
    assert main(["autotune", "--quiet", "--device", "cpu", "--gpu-memory", "1KiB"]) == 3
    assert "not even one request" in capsys.readouterr().err


def test_env_json(capsys):
    r = _json(capsys, ["env", "--json", "--device", "cpu"])
    for k in ("torch", "triton", "cupy", "gpus", "pinned", "backends", "driver"):
        assert k in r, k
    assert any(b["name"] == "reference" for b in r["backends"])


def test_python_dash_m():
    p = subprocess.run([sys.executable, "-m", "hisparse", "plan", "--json", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["binding"] in ("gpu", "host", "max_seqs")


@pytest.mark.gpu
def test_gpu_preset_runs(capsys):
    """The GPU preset (64 requests x 128K x 4 layers, K=2048, S=4096), shortened to 10 steps."""
    r = _json(capsys, ["stress", "--preset", "gpu", "--steps", "10", "--json", "--quiet"])
    assert r["ok"] and r["kernels"] == "triton"
    assert r["config"]["max_num_reqs"] == 64 and r["config"]["num_layers"] == 4
    ov = r["overall"]
    print(f"gpu preset: hit {ov['hit_rate']:.4f} (optimal {ov['optimal_hit_rate']:.4f}), step p50 "
          f"{ov['step_ms_p50']:.2f} ms (appends {ov['append_ms_p50']:.2f}, resolves "
          f"{ov['resolve_ms_p50']:.2f}), H2D {ov['h2d_GBps']:.2f} GB/s, GPU peak {ov['gpu_peak_bytes']}")
    assert main(["stress", "--device", "cuda", "--unchecked", "--requests", "8", "--context", "16K",
                 "--top-k", "512", "--steps", "5", "--quiet"]) == 0
