"""The benchmark CLIs on a user's mistake: exit status 2, the reason on stderr naming
the flag, no traceback, and nothing run first; a benchmark that needs a GPU says so
(exit 2) where there is none. All in-process and before any real work: fast."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks import (analyse_e2e_trace, bench_capacity, bench_e2e, bench_host_calls, bench_layer,
                        bench_pool_kinds, bench_prefill, bench_staging, bench_triton_configs,
                        common, profile_decode, profile_e2e_host, sanitize_trace, soak)


def run(main, argv, capsys):
    """(exit status, stdout, stderr) of ``main(argv)``, argparse's exits included."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, cap.out, cap.err


def refused(main, argv, capsys, *words):
    rc, _, err = run(main, argv, capsys)
    assert rc == 2, (argv, err)
    last = err.strip().splitlines()[-1]  # argparse prints its usage above the one-line reason
    for w in words:
        assert w in last, (argv, last)
    return last


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_common_types():
    assert common.positive_int("3") == 3 and common.positive_float("0.5") == 0.5
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(Exception, match="int >= 1"):
            common.positive_int(bad)
    for bad in ("0", "-2", "nan", "inf", "x"):
        with pytest.raises(Exception, match="number > 0"):
            common.positive_float(bad)


@pytest.mark.parametrize("argv, flag", [
    ([], "--device cuda"),  # the default, on a machine without CUDA
    (["--device", "tpu"], "--device"),
    (["--device", "cpu", "--requests", "0"], "--requests"),
    (["--device", "cpu", "--kernels", "bogus"], "--kernels"),
    (["--device", "cpu", "--steps", "0"], "--steps"),
    (["--device", "cpu", "--requests", "4", "--pad-to", "2"], "--pad-to"),
    (["--device", "cpu", "--requests", "4", "--layer-graphs"], "--pad-to"),
    (["--device", "cpu", "--pad-to", "64", "--inputs", "in-place"], "--layer-graphs"),
    (["--device", "cpu", "--pad-to", "64", "--compare", "--layer-graphs"], "--compare"),
])
def test_bench_host_calls_refuses(argv, flag, capsys, no_gpu):
    refused(bench_host_calls.main, argv, capsys, flag)


def test_bench_host_calls_help_and_a_bucket_larger_than_the_batch(capsys):
    rc, out, _ = run(bench_host_calls.main, ["--help"], capsys)
    assert rc == 0 and "[2048]" in out and "[cuda]" in out
    argv = ["--device", "cpu", "--kernels", "torch", "--requests", "2", "--layers", "1", "--context", "20",
            "--top-k", "8", "--steps", "1", "--top", "1", "--pad-to", "3"]
    rc, out, _ = run(bench_host_calls.main, argv, capsys)
    assert rc == 0 and "pad_to 3" in out


@pytest.mark.parametrize("argv, flag", [
    (["--top-k", "0"], "--top-k"), (["--locality", "1"], "--locality"),
    (["--context", "100"], "--context"), (["--backend", "nope"], "--backend"),
])
def test_bench_e2e_refuses(argv, flag, capsys):
    refused(bench_e2e.main, ["--dry-run", *argv], capsys, flag)


@pytest.mark.parametrize("value", ["-1", "0"])
def test_bench_capacity_max_batch(value, capsys):
    refused(bench_capacity.main, ["--dry-run", "--max-batch", value], capsys, "--max-batch")


@pytest.mark.parametrize("value", ["0", "4", "x"])
def test_bench_capacity_buffer(value, capsys):
    refused(bench_capacity.main, ["--dry-run", "--buffer", value], capsys, "--buffer")  # 4 < the dry run's top-k


@pytest.mark.parametrize("argv, words", [
    (["--buffer", "1"], ["--buffer 1 is smaller than"]),  # the cache's own rule, checked before the runs
    (["--runs", "0"], ["--runs"]), (["--budget-s", "nan"], ["--budget-s"]),
])
def test_soak_refuses(argv, words, capsys):
    rc, out, _ = run(soak.main, ["--preset", "tiny", *argv], capsys)
    assert rc == 2 and "[soak]" not in out  # nothing planned or run
    refused(soak.main, ["--preset", "tiny", *argv], capsys, *words)


@pytest.mark.parametrize("main, argv, flag", [
    (bench_staging.main, ["--reps", "0"], "--reps"),
    (bench_staging.main, ["--pool-gib", "nan"], "--pool-gib"),
    (bench_prefill.main, ["--rows", "0"], "--rows"),
    (bench_layer.main, ["--overlap", "nan"], "--overlap"),
    (bench_layer.main, ["--stage-programs", "0"], "--stage-programs"),
    (bench_layer.main, ["--hits", "150"], "--hits"),
    (bench_layer.main, ["--hits", "-5"], "--hits"),
])
def test_dry_run_benchmarks_refuse(main, argv, flag, capsys):
    refused(main, ["--dry-run", *argv], capsys, flag)


def test_gpu_only_tools_say_so(tmp_path, capsys, no_gpu):
    refused(profile_decode.main, [], capsys, "no CUDA device")
    refused(profile_decode.main, ["--shape", "1,2"], capsys, "--shape")
    refused(bench_triton_configs.main, ["--out", str(tmp_path / "t.json")], capsys, "no CUDA device")
    refused(bench_pool_kinds.main, [], capsys, "no CUDA device")
    refused(bench_pool_kinds.main, ["--pool-gib", "0"], capsys, "--pool-gib")
    refused(sanitize_trace.main, [], capsys, "needs a CUDA GPU")
    rc, out, _ = run(sanitize_trace.main, ["--help"], capsys)
    assert rc == 0 and "compute-sanitizer" in out and "--cpu" in out


def test_bench_pool_kinds_exits_1_when_nothing_is_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common, "environment", lambda *a: {"gpu": None, "torch": "t", "triton": "t"})

    def no_pool(kind, nbytes):
        raise RuntimeError("cudaHostRegister failed")
    monkeypatch.setattr(bench_pool_kinds, "alloc", no_pool)
    out = tmp_path / "pool.json"
    rc, _, err = run(bench_pool_kinds.main, ["--pool-gib", "0.01", "--rows", "64", "--out", str(out)], capsys)
    assert rc == 1 and "nothing measured" in err
    assert all("error" in c for c in json.loads(out.read_text())["cases"])


def test_analyse_e2e_trace_refuses_bad_files(tmp_path, capsys):
    missing = str(tmp_path / "missing.json.gz")
    refused(analyse_e2e_trace.main, [missing], capsys, missing, "no such file")
    text = tmp_path / "t.json"
    text.write_text("not json")
    refused(analyse_e2e_trace.main, [str(text)], capsys, "not JSON")
    text.write_text('{"a": 1}')
    refused(analyse_e2e_trace.main, [str(text)], capsys, "traceEvents")
    # the output path is checked before any input is read
    refused(analyse_e2e_trace.main, [missing, "--json", "/proc/nope/x.json"], capsys, "--json")


def test_profile_e2e_host_checks_chrome_trace_first(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    refused(profile_e2e_host.main, ["--dry-run", "--torch-profiler", "--chrome-trace", str(f)], capsys,
            "--chrome-trace")
    refused(profile_e2e_host.main, ["--dry-run", "--chrome-trace", str(tmp_path / "d")], capsys,
            "--torch-profiler")


@pytest.mark.parametrize("value, words", [
    ("0", ["--pool-rows", "expected 'auto', 'budget' or a row count >= 1"]),
    ("x", ["--pool-rows", "cannot parse row count 'x'"]),
    ("100", ["--pool-rows 100 is below 192", "hisparse's batch of 5 at context 64", "give at least 192, auto or budget"]),
])
def test_bench_capacity_pool_rows(value, words, capsys):
    refused(bench_capacity.main, ["--dry-run", "--contexts", "64", "--pool-rows", value], capsys, *words)


@pytest.mark.parametrize("argv, words", [
    (["--sweep-batches", "2"], ["--sweep-batches needs --sweep"]),
    (["--plot", "x.png"], ["--plot needs --sweep"]),
    (["--sweep", "--same-batch"], ["--same-batch does not combine with --sweep"]),
    (["--sweep", "--sweep-batches", "0"], ["--sweep-batches", "expected an int >= 1"]),
    (["--sweep", "--plot", "/"], ["--plot / is a directory"]),
    (["--sweep", "--plot", "same.json", "--out", "same.json"], ["--plot and --out are the same file"]),
    (["--sweep", "--contexts", "64", "--pool-rows", "100"], ["--pool-rows 100 is below 192",
                                                               "hisparse's batch of 5 at context 64"]),
])
def test_bench_capacity_sweep_refuses(argv, words, capsys):
    rc, out, _ = run(bench_capacity.main, ["--dry-run", *argv], capsys)
    assert rc == 2 and "[capacity]" not in out  # nothing run
    refused(bench_capacity.main, ["--dry-run", *argv], capsys, *words)


def test_bench_capacity_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    """--plot without matplotlib: exit 4 (a missing dependency, as `hisparse stress
    --plot`), one line naming the install, before anything runs or is written."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = tmp_path / "sweep.json"
    rc, text, err = run(bench_capacity.main, ["--dry-run", "--sweep", "--plot", str(tmp_path / "s.png"),
                                              "--out", str(out)], capsys)
    assert rc == 4 and "[capacity]" not in text and not out.exists()
    assert err.strip() == ("bench_capacity: --plot needs matplotlib, which is not installed; `pip install matplotlib` "
                           "(or `pip install hisparse[tools]`), or run without --plot")


def test_probe_graph_nodes_refuses_without_a_gpu_or_with_a_bad_flag(tmp_path, capsys, no_gpu):
    from benchmarks import probe_graph_nodes
    refused(probe_graph_nodes.main, [], capsys, "needs a CUDA GPU")
    refused(probe_graph_nodes.main, ["unpin"], capsys, "needs a CUDA GPU")
    refused(probe_graph_nodes.main, ["--chain", "0"], capsys, "--chain")
    refused(probe_graph_nodes.main, ["other"], capsys, "probe")
    (tmp_path / "a_file").write_text("")
    refused(probe_graph_nodes.main, ["--out", str(tmp_path / "a_file" / "x.json")], capsys, "--out")
