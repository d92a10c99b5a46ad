"""The ``hisparse`` command: every subcommand at a small size, --json fields, exit codes.

The error cases run the CLI in-process (``main([...])``) and check the exit code, that
stderr is one line naming the problem, and that no traceback appears; cases that need
a clean environment (Triton's interpreter off) run as a subprocess. Output paths are
checked before any work: those tests replace the work itself with a function that
fails the test if it is reached.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hisparse
from hisparse import HiSparseCache
from hisparse_tools import cli, preflight, stress
from hisparse_tools.cli import main
from hisparse_tools.mini_engine import loop as me_loop
from hisparse_tools.outputs import Outputs
from hisparse_tools.traces import TraceRecorder
from cli_common import fails

STRESS_TINY = ["--requests", "2", "--context", "200", "--layers", "1", "--top-k", "8",
               "--buffer", "16", "--steps", "6", "--block-size", "16", "--device", "cpu", "--quiet"]


ME_TINY = ["--requests", "2", "--max-prompt", "24", "--max-decode", "3"]
NEEDS_MATPLOTLIB = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="needs matplotlib (the [tools] extra)")


def _json(capsys, argv, rc=0):
    got = main(argv)
    out = capsys.readouterr()
    assert got == rc, out.err
    return json.loads(out.out)


_fails = fails  # one refusal check for every CLI test (cli_common)


def _never(*args, **kw):
    raise AssertionError("work started before the output path was checked")


def _trace(path):
    rec = TraceRecorder(num_layers=1, top_k=4)
    for step, n in enumerate((30, 31)):
        rec.begin_step([0], [n])
        rec.add_layer(0, [[0, 1, 2, step + 3]])
    rec.save(path)
    return path


def test_help_everywhere(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    lines = top.splitlines()
    for cmd in ("stress", "autotune", "plan", "env", "mini-engine"):
        i = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [cmd])
        said = lines[i].split(None, 1)[1:] or [lines[i + 1].strip()]  # argparse puts a long name's help below it
        assert len(said[0]) > 20, lines[i:i + 2]  # each subcommand explained in one line
    assert "3 capacity" in top and "4 missing dependency" in top
    for cmd in ("stress", "autotune", "plan", "env"):
        assert main([cmd, "--help"]) == 0
        assert "--json" in capsys.readouterr().out
    assert main(["mini-engine", "--help"]) == 0
    assert "--tolerance" in capsys.readouterr().out
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


def test_stress_result_records_unchecked_and_context_min(capsys):
    r = _json(capsys, ["stress", "--json", "--unchecked", "--context-min", "120"] + STRESS_TINY)
    assert r["options"]["checked"] is False and r["options"]["context_min"] == 120
    assert r["workload"]["checked"] is False and r["workload"]["context_min"] == 120
    assert main(["stress", "--unchecked", "--context-min", "120"] + STRESS_TINY) == 0
    text = capsys.readouterr().out
    assert "context=120..200" in text and "resolve=unchecked" in text, text


def test_stress_prefetch_flag(capsys):
    r = _json(capsys, ["stress", "--json"] + STRESS_TINY + ["--prefetch", "--layers", "2"])
    assert r["ok"] is True and r["prefetch"]["rows_staged"] > 0
    assert set(r["prefetch"]) >= {"precision", "recall", "wasted_bytes", "per_layer"}
    assert r["per_layer"][1]["prefetch_rows"] == r["prefetch"]["rows_staged"]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hisparse {hisparse.__version__}"


def test_stress_table_and_corruption_exit_code(capsys, monkeypatch):
    assert main(["stress"] + STRESS_TINY) == 0
    assert "RESULT: PASS" in capsys.readouterr().out
    # a hot row corrupted after the second resolve (through public calls): exit 1
    orig, count = HiSparseCache.resolve, {"n": 0}

    def resolve(self, layer, req_ids, topk, **kw):
        res = orig(self, layer, req_ids, topk, **kw)
        count["n"] += 1
        if count["n"] == 2:
            valid = (res.physical >= 0).nonzero()
            self.hot_rows(layer)[int(res.physical[valid[0, 0], valid[0, 1]]), 0] ^= 0xFF
        return res

    monkeypatch.setattr(HiSparseCache, "resolve", resolve)
    assert main(["stress", "--verify", "all"] + STRESS_TINY) == 1
    out = capsys.readouterr().out
    assert "RESULT: FAIL" in out and "differs from the expected bytes" in out


def test_stress_record_replay(tmp_path, capsys):
    path = str(tmp_path / "t.npz")
    a = _json(capsys, ["stress", "--json", "--record", path] + STRESS_TINY)
    b = _json(capsys, ["stress", "--json", "--replay", path, "--quiet", "--device", "cpu"])
    assert b["workload"]["trace"] == "replay"
    assert (a["overall"]["hits"], a["overall"]["misses"]) == (b["overall"]["hits"], b["overall"]["misses"])


def test_stress_bad_input_exit_2(capsys):
    _fails(capsys, ["stress", "--trace", "replay", "--quiet"], 2, "needs a trace file")
    _fails(capsys, ["stress", "--verify", "lots"], 2, "argument --verify", "see `hisparse stress --help`")
    _fails(capsys, ["stress", "--replay", "/nonexistent.npz", "--quiet"], 2, "does not exist")
    _fails(capsys, ["stress", "--requests", "0", "--quiet"], 2, "--requests must be >= 1")


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    monkeypatch.setattr(stress, "StressRun", _never)
    _fails(capsys, ["stress", "--plot", str(tmp_path)] + STRESS_TINY, 4, "needs matplotlib")


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
    _fails(capsys, ["plan", "--gpu-memory", "lots"], 2, "cannot parse memory size")
    _fails(capsys, ["plan", "--hot-rows", "10"], 2, "--hot-rows must be >= --top-k")  # < top_k 2048
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
    _fails(capsys, ["autotune", "--quiet", "--device", "cpu", "--gpu-memory", "1KiB"], 3,
           "capacity: not even one request")


def test_env_json(capsys):
    r = _json(capsys, ["env", "--json", "--device", "cpu"])
    for k in ("torch", "triton", "cupy", "gpus", "pinned", "backends", "driver"):
        assert k in r, k
    assert any(b["name"] == "reference" for b in r["backends"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without CUDA")
def test_env_for_cuda_without_cuda_reports_it(capsys):
    r = _json(capsys, ["env", "--json", "--device", "cuda"])
    assert r["triton_decode"]["kernel"] is None
    assert "no CUDA device" in r["triton_decode"]["ws_off_reason"]


@pytest.mark.parametrize("cmd", [["stress", "--steps", "2"], ["mini-engine"], ["whatif", "--quiet"]])
def test_seed_out_of_range_is_named(capsys, cmd):
    _fails(capsys, cmd + ["--seed", "99999999999999999999"], 2, "seed")


def test_mini_engine_help_says_what_unset_defaults_mean(capsys):
    assert main(["mini-engine", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default None)" not in out and "2 x top-k" in out


def test_python_dash_m():
    p = subprocess.run([sys.executable, "-m", "hisparse_tools", "plan", "--json", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["binding"] in ("gpu", "host", "max_seqs")


# ----------------------------------------------------------------- error cases
@pytest.fixture
def no_cuda(monkeypatch):
    """Run as on a machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv", [
    ["stress", "--device", "cuda", "--quiet"],
    ["stress", "--preset", "gpu", "--quiet"],
    ["autotune", "--device", "cuda", "--quiet", "--gpu-memory", "1GiB"],
    ["mini-engine", "--device", "cuda"] + ME_TINY,
    ["mini-engine", "--preset", "h200"],
])
def test_cuda_without_cuda_is_exit_4(capsys, no_cuda, argv):
    _fails(capsys, argv, 4, "missing dependency", "needs a CUDA GPU", "use --device cpu")


@pytest.mark.parametrize("argv, msg", [
    (["stress", "--device", "tpu", "--quiet"], "--device 'tpu': expected cpu, cuda or cuda:N"),
    (["autotune", "--device", "tpu", "--quiet", "--gpu-memory", "1GiB"], "expected cpu, cuda or cuda:N"),
    (["env", "--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["mini-engine", "--device", "tpu"] + ME_TINY, "device must be cpu, cuda or cuda:N"),
])
def test_unknown_device_is_exit_2(capsys, argv, msg):
    _fails(capsys, argv, 2, msg)


def test_triton_kernels_on_cpu_without_the_interpreter_exit_4():
    """A clean environment (no TRITON_INTERPRET): --kernels triton on CPU says how to run it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run even on a GPU machine
    for flag, argv in (("--kernels", ["stress", "--kernels", "triton", "--device", "cpu", "--quiet"]),
                       ("--kernels", ["mini-engine", "--kernels", "triton", "--device", "cpu"]
                        + ME_TINY)):
        p = subprocess.run([sys.executable, "-m", "hisparse_tools", *argv], capture_output=True, text=True,
                           timeout=120, env=env)
        err = p.stderr.strip()
        assert p.returncode == 4, p.stderr
        assert "Traceback" not in p.stderr and len(err.splitlines()) == 1, err
        assert "TRITON_INTERPRET=1" in err and f"{flag} torch" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path")
def test_triton_kernels_on_cpu_with_the_interpreter(capsys):
    from hisparse._checks import interpreter_mode

    assert interpreter_mode()  # conftest sets TRITON_INTERPRET=1 without CUDA
    r = _json(capsys, ["stress", "--json", "--kernels", "triton"] + STRESS_TINY)
    assert r["ok"] and r["kernels"] == "triton" and r["timings_are"] == "CPU (Triton interpreter)"


def test_host_pool_larger_than_memory_is_exit_3(capsys, monkeypatch):
    # 64 requests x 1M tokens x 2 layers x 656 B = 88 GB of host pool; this machine's
    # MemAvailable is pinned at 16 GiB so the test means the same everywhere
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 16 << 30)
    err = _fails(capsys, ["stress", "--context", "1M", "--requests", "64", "--device", "cpu", "--quiet"],
                 3, "capacity: this stress run needs", "of host memory", "host pool 82.",
                 f"but {16 << 30} bytes")
    assert "MemAvailable" in err


def test_terabyte_top_k_refused_up_front(capsys):
    # K = 1e8, S = 2K: ~1 TB of hot buffers, more than any machine here: no allocation tried
    _fails(capsys, ["stress", "--top-k", "100000000", "--device", "cpu", "--quiet"], 3,
           "capacity:", "hot buffers and slot state")


def test_allocation_failures_map_to_exit_3(capsys, monkeypatch):
    def oom(*a, **kw):
        raise MemoryError()

    monkeypatch.setattr(cli, "plan", oom)
    _fails(capsys, ["plan"], 3, "capacity: out of host memory")

    def full(*a, **kw):
        raise hisparse.CapacityError("host pool allocation of 123 bytes failed")

    monkeypatch.setattr(cli, "plan", full)
    _fails(capsys, ["plan"], 3, "capacity: host pool allocation of 123 bytes failed")


def test_interrupt_is_one_line(capsys, monkeypatch):
    def stop(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "plan", stop)
    _fails(capsys, ["plan"], 130, "interrupted")


@pytest.mark.parametrize("argv, msg", [
    (["stress", "--record", "/nonexistent_dir/x.npz"] + STRESS_TINY, "directory '/nonexistent_dir' does not exist"),
    (["stress", "--plot", "/proc/forbidden"] + STRESS_TINY, "--plot '/proc/forbidden': cannot write in '/proc'"),
    (["stress", "--metrics-file", "/nonexistent_dir/m.prom"] + STRESS_TINY, "--metrics-file"),
])
def test_stress_output_paths_checked_before_work(capsys, monkeypatch, argv, msg):
    monkeypatch.setattr(stress, "StressRun", _never)
    _fails(capsys, argv, 2, msg)


def test_output_path_that_is_a_directory(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(stress, "StressRun", _never)
    _fails(capsys, ["stress", "--record", str(tmp_path)] + STRESS_TINY, 2, "is a directory")
    (tmp_path / "file").write_text("x")
    _fails(capsys, ["stress", "--plot", str(tmp_path / "file")] + STRESS_TINY, 2, "is not a directory")


def test_autotune_out_checked_before_work(capsys, monkeypatch):
    monkeypatch.setattr(cli, "run_autotune", _never)
    _fails(capsys, ["autotune", "--out", "/nonexistent/x.json", "--device", "cpu", "--gpu-memory", "1MiB",
                    "--quiet"], 2, "--out '/nonexistent/x.json'", "does not exist")


@pytest.mark.parametrize("flag", ["--record", "--out"])
def test_mini_engine_outputs_checked_before_work(capsys, monkeypatch, flag):
    monkeypatch.setattr(me_loop, "MiniEngine", _never)
    _fails(capsys, ["mini-engine", flag, "/nonexistent/x.npz"] + ME_TINY, 2, flag, "does not exist")


def test_mini_engine_bad_values(capsys):
    _fails(capsys, ["mini-engine", "--tolerance", "-1"] + ME_TINY, 2, "tolerance must be >= 0")
    _fails(capsys, ["mini-engine", "--layers", "0"] + ME_TINY, 2, "--layers must be >= 1")
    _fails(capsys, ["mini-engine", "--format", "fp4"] + ME_TINY, 2, "argument --format")


def test_mini_engine_memory_checked(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 1 << 20)
    monkeypatch.setattr(me_loop, "MiniEngine", _never)
    _fails(capsys, ["mini-engine"] + ME_TINY, 3, "capacity: this mini-engine run needs")


def test_replay_conflicts_refused(capsys, tmp_path, monkeypatch):
    path = str(_trace(tmp_path / "t.npz"))
    _fails(capsys, ["stress", "--replay", "/nonexistent.npz", "--trace", "uniform", "--quiet"], 2,
           "--replay FILE replays a recorded trace and --trace uniform generates one")
    _fails(capsys, ["stress", "--replay", path, "--layers", "3", "--top-k", "4", "--steps", "9",
                    "--requests", "2", "--quiet"], 2,
           "would be ignored", "--requests, --layers, --top-k, --steps")
    r = _json(capsys, ["stress", "--replay", path, "--trace", "replay", "--device", "cpu", "--quiet",
                       "--json"])
    assert r["ok"] and r["config"]["num_layers"] == 1 and r["config"]["top_k"] == 4


def test_replay_file_messages(capsys, tmp_path):
    text = tmp_path / "trace.json"
    text.write_text('{"steps": []}')
    err = _fails(capsys, ["stress", "--replay", str(text), "--quiet"], 2, "is not a .npz trace")
    assert "pickled" not in err
    good = dict(np.load(_trace(tmp_path / "t.npz")))
    np.savez(tmp_path / "meta.npz", **{**good, "meta": np.array("{oops")})
    _fails(capsys, ["stress", "--replay", str(tmp_path / "meta.npz"), "--quiet"], 2,
           str(tmp_path / "meta.npz"), "key 'meta' is not valid JSON")
    np.savez(tmp_path / "float.npz", **{**good, "topk": good["topk"].astype(np.float32)})
    _fails(capsys, ["stress", "--replay", str(tmp_path / "float.npz"), "--quiet"], 2,
           "key 'topk' has dtype float32")


def test_plan_bad_budgets_and_limits(capsys):
    _fails(capsys, ["plan", "--gpu-memory", "0"], 2, "argument --gpu-memory", "must be > 0")
    _fails(capsys, ["plan", "--host-memory", "0"], 2, "argument --host-memory", "must be > 0")
    _fails(capsys, ["plan", "--context", "1000000000000"], 2, "int32")
    _fails(capsys, ["plan", "--gpu-memory", "1KiB"], 3, "not even one request fits")
    _fails(capsys, ["plan", "--host-memory", "1KiB"], 3, "binding: host")


def test_metrics_port_without_prometheus_client(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setattr(stress, "StressRun", _never)
    _fails(capsys, ["stress", "--metrics-port", "9100"] + STRESS_TINY, 4, "needs prometheus_client")


def test_metrics_file_written(capsys, tmp_path):
    path = tmp_path / "hisparse.prom"
    r = _json(capsys, ["stress", "--json", "--metrics-file", str(path), "--metrics-every", "2"] + STRESS_TINY)
    text = path.read_text()
    assert "# TYPE hisparse_hits_total counter" in text
    hits = [ln for ln in text.splitlines() if ln.startswith('hisparse_hits_total{layer="0"}')]
    assert len(hits) == 1 and float(hits[0].split()[-1]) == r["overall"]["hits"]
    assert r["metrics_file"] == str(path)


def test_metrics_port_serves_during_the_run(capsys, monkeypatch):
    pytest.importorskip("prometheus_client")
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    orig, got = stress.StressRun.run, {}

    def run(self, on_step=None):
        r = orig(self, on_step)  # the server is still up until the command returns
        got["body"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return r

    monkeypatch.setattr(stress.StressRun, "run", run)
    r = _json(capsys, ["stress", "--json", "--metrics-port", str(port)] + STRESS_TINY)
    line = next(ln for ln in got["body"].splitlines() if ln.startswith('hisparse_misses_total{layer="0"}'))
    assert float(line.split()[-1]) == r["overall"]["misses"]
    with pytest.raises(OSError):  # shut down when the command ended
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.gpu
@pytest.mark.gpu_long
@pytest.mark.gpu_alone  # 64 x 128K contexts: the host pool and the memory check want the machine
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


def test_an_output_that_cannot_be_written_is_one_line_and_exit_1(capsys):
    """A write that fails after the up-front path checks (disk full, an I/O error) ends
    the command with one line and exit 1 (the run failed), not a traceback."""
    from hisparse_tools.exit_codes import EXIT_FAILED, run_command

    def body():
        raise OSError(28, "No space left on device", "/tmp/out.json")

    assert run_command("stress", body) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hisparse stress: I/O error:") and "No space left" in err[0]


@pytest.mark.parametrize("argv, flag", [
    (["stress", "--record", ""], "--record"),
    (["stress", "--out", " "], None),  # stress has no --out: an unknown flag, still exit 2
    (["stress", "--metrics-file", ""], "--metrics-file"),
    (["stress", "--plot", ""], "--plot"),
    (["stress", "--replay", ""], "--replay"),
    (["autotune", "--out", ""], "--out"),
    (["mini-engine", "--out", ""], "--out"),
    (["mini-engine", "--record", ""], "--record"),
    (["whatif", "--plot", ""], "--plot"),
    (["whatif", "--replay", ""], "--replay"),
])
def test_empty_path_is_refused_not_ignored(capsys, argv, flag):
    """An empty path read as "not given" would run the whole job and write nothing."""
    _fails(capsys, argv, 2, *([f"argument {flag}: empty path"] if flag else []))


def test_every_option_says_what_it_is_and_every_command_its_exit_status(capsys):
    """No option's help is only its default, and every command's help ends with the exit
    statuses."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        assert sp.epilog and "exit status" in sp.epilog, name
        for act in sp._actions:
            if act.help == argparse.SUPPRESS or not act.option_strings:
                continue
            text = (act.help or "").strip()
            assert text and not text.startswith(("(default", "[")), (name, act.option_strings, text)


def test_output_path_that_is_a_fifo_is_refused_up_front(capsys, tmp_path, monkeypatch):
    """Opening a FIFO to probe it would block until a reader came."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(stress, "StressRun", _never)
    _fails(capsys, ["stress", "--record", str(fifo)] + STRESS_TINY, 2, "FIFO that cannot be written")
    _fails(capsys, ["stress", "--metrics-file", str(fifo)] + STRESS_TINY, 2, "is not a regular file")
    # a device is fine for a file written in place, not for one replaced atomically
    assert preflight.check_output_file(os.devnull, flag="--out") == os.devnull
    _fails(capsys, ["stress", "--metrics-file", os.devnull] + STRESS_TINY, 2, "is not a regular file")


def test_pipe_with_a_reader_is_accepted_and_a_fifo_without_one_is_not(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="FIFO that cannot be written"):  # no reader: refused, no hang
        Outputs().file(fifo, flag="--out")
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # `--out /dev/stdout | jq`: a reader waits
    try:
        with Outputs() as outs:
            assert outs.file(fifo, flag="--out") == str(fifo)
    finally:
        os.close(rfd)


def test_metrics_file_symlink_is_checked_at_its_target(capsys, tmp_path, monkeypatch):
    link = tmp_path / "link.prom"
    link.symlink_to(tmp_path / "missing" / "real.prom")  # the target's directory does not exist
    monkeypatch.setattr(stress, "StressRun", _never)
    _fails(capsys, ["stress", "--metrics-file", str(link)] + STRESS_TINY, 2, "(of its target) does not exist")


@pytest.mark.parametrize("argv, name", [
    (["stress", "--steps", "2", "--quiet"], "hit_rate.png"),  # stress checks paths before matplotlib
    pytest.param(["whatif", "--quiet"], "whatif.png", marks=NEEDS_MATPLOTLIB),  # whatif the other way
])
def test_plot_dir_holding_a_directory_named_like_a_plot_is_refused_up_front(capsys, tmp_path, argv, name):
    (tmp_path / name).mkdir()
    _fails(capsys, argv + ["--plot", str(tmp_path)], 2, f"{name} exists there and is not a regular file")


@pytest.mark.parametrize("argv,who", [
    (["stress", "--bogus", "1"], "hisparse stress"),
    (["plan", "--bogus"], "hisparse plan"),
    (["autotune", "--nope"], "hisparse autotune"),
    (["env", "stray"], "hisparse env"),
    (["mini-engine", "--x"], "hisparse mini-engine"),
    (["whatif", "--nope"], "hisparse whatif"),
    (["--bogus"], "hisparse"),
    (["--bogus", "stress"], "hisparse"),
])
def test_unknown_argument_is_blamed_on_its_command(capsys, argv, who, monkeypatch):
    """An unknown flag after a command points at that command's --help (which lists what it
    takes), before any work starts."""
    for name in ("_cmd_stress", "_cmd_plan", "_cmd_autotune", "_cmd_env"):
        monkeypatch.setattr(cli, name, _never)
    err = _fails(capsys, argv, 2, "unrecognized arguments", f"see `{who} --help`")
    assert err.startswith(f"{who}: error:"), err


def test_plan_pool_rows(capsys):
    base = ["plan", "--layers", "2", "--context", "1000", "--top-k", "4", "--hot-rows", "8", "--indexer-bytes",
            "100", "--gpu-memory", "10000000", "--host-memory", "20000000", "--max-seqs", "100"]
    r = _json(capsys, base + ["--json", "--pool-rows", "auto"])
    assert r["device_pool"]["pool_rows"] == 5397 and r["device_pool"]["resident_requests"] == 5
    r = _json(capsys, base + ["--json", "--pool-rows", "1K", "--target", "30"])
    assert r["device_pool"]["pool_rows"] == 1024 and r["device_pool"]["requests"] == 30
    assert main(base + ["--pool-rows", "auto"]) == 0
    assert "device pool (auto" in capsys.readouterr().out
    _fails(capsys, base + ["--pool-rows", "100"], 2, "--pool-rows 100 is smaller than the hot buffers it includes",
           "(--hot-rows + 1) = 14 x 9 = 126", "give at least 126, or auto")
    _fails(capsys, base + ["--pool-rows", "some"], 2, "argument --pool-rows: cannot parse row count 'some'")


def test_plan_shared_prefix(capsys):
    base = ["plan", "--context", "36K", "--target", "64"]
    r = _json(capsys, base + ["--json", "--shared-prefix", "32K", "--prefix-groups", "8"])
    x = r["prefix"]
    assert x["host_rows_shared"] == 8 * 32768 + 64 * 4096 and x["host_rows_unshared"] == 64 * 36864
    assert r["inputs"]["shared_prefix"] == 32768 and r["inputs"]["prefix_groups"] == 8
    assert main(base + ["--shared-prefix", "32K", "--prefix-groups", "8"]) == 0
    assert "8 x 32768 + 64 x 4096 = 524288" in capsys.readouterr().out
    _fails(capsys, base + ["--shared-prefix", "36K"], 2, "--shared-prefix 36864 does not fit the context",
           "--context 36864", "give a --shared-prefix below 36864")
    _fails(capsys, base + ["--shared-prefix", "0"], 2, "--shared-prefix must be >= 1, got 0")
    _fails(capsys, base + ["--shared-prefix", "1K", "--prefix-groups", "0"], 2, "--prefix-groups must be >= 1, got 0")
    _fails(capsys, base + ["--prefix-groups", "8"], 2, "--prefix-groups has no effect without --shared-prefix")


def test_autotune_pool_rows(capsys):
    base = ["autotune", "--quiet", "--device", "cpu", "--layers", "1", "--top-k", "8", "--context", "32", "--heads",
            "2", "--steps", "1", "--warmup", "0", "--candidates", "1", "--block-size", "16", "--gpu-memory", "400KiB",
            "--max-reqs", "3"]
    r = _json(capsys, base + ["--json", "--pool-rows", "auto"])
    assert r["config"]["device_pool_rows"] == r["pool"]["fit_rows"] == 128
    _fails(capsys, base + ["--pool-rows", "10"], 2, "--pool-rows 10 leaves no page past one request's hot buffer",
           "give at least 128, or auto")
