"""The ``hisparse`` options as a user meets them: one vocabulary across subcommands, one
rule for options that would do nothing, graphs choosing their mode, messages in the
flags' words, and help that an installed command carries.

Everything runs in-process on the CPU at tiny sizes; where a check happens before the
work, the work is replaced by a function that fails the test if it is reached.
"""

import argparse
import importlib
import json
import os
import re
import sys

import pytest

from hisparse import CapacityError, HiSparseCache, HiSparseConfig
from hisparse.config import Kernels
from hisparse_tools import cli, stress
from hisparse_tools.cli import main
from hisparse_tools.exit_codes import EXIT_FAILED, run_command
from hisparse_tools.mini_engine import loop as me_loop
from hisparse_tools.traces import TraceRecorder
from cli_common import fails

me_cli = importlib.import_module("hisparse_tools.mini_engine.cli")

STRESS_TINY = ["--requests", "2", "--context", "200", "--top-k", "8", "--steps", "2", "--block-size", "16",
               "--device", "cpu", "--quiet"]
ME_TINY = ["--requests", "2", "--max-prompt", "24", "--max-decode", "3"]
WHATIF_TINY = ["--trace", "uniform", "--requests", "2", "--context", "200", "--layers", "1", "--top-k", "8",
               "--steps", "3", "--quiet"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_fails = fails  # one refusal check for every CLI test (cli_common)


def _never(*args, **kw):
    raise AssertionError("the work started: the options should have been refused first")


@pytest.fixture
def fake_me_run(monkeypatch):
    """mini-engine's run replaced by one that records its arguments and returns a result
    that passes (no engine runs, no device is touched)."""
    seen = {}

    def run(cfg, *, progress=False, record=None, outputs=None):
        seen.update(cfg=cfg, progress=progress, record=record)
        return {"compare": {"within_tolerance": True}}

    monkeypatch.setattr(me_loop, "run", run)
    monkeypatch.setattr(me_cli, "format_report", lambda res: "report")
    return seen


def _me_args(argv):
    return me_cli.build_parser().parse_args(argv)


# ------------------------------------------------------------ --graphs chooses unchecked mode
@pytest.mark.parametrize("flag", ["--graphs", "--layer-graphs"])
def test_graphs_choose_unchecked_mode_and_say_so(capsys, fake_me_run, flag):
    assert main(["mini-engine", "--device", "cuda", flag] + ME_TINY) == 0
    cfg = fake_me_run["cfg"]
    assert cfg.validate is False and (cfg.graphs or cfg.layer_graphs)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hisparse mini-engine: note: {flag}: running unchecked (as --unchecked does), which CUDA "
                   "graphs need: checked mode reads device values on the host, as a captured graph cannot"]


def test_graphs_with_unchecked_given_say_nothing_and_at_parse_level_too(capsys, fake_me_run):
    assert main(["mini-engine", "--device", "cuda", "--graphs", "--unchecked"] + ME_TINY) == 0
    assert fake_me_run["cfg"].validate is False and capsys.readouterr().err == ""
    notes = []
    cfg = me_cli.config_from_args(_me_args(["--device", "cuda", "--graphs"]), notes)
    assert cfg.validate is False and cfg.graphs and len(notes) == 1
    assert me_cli.config_from_args(_me_args([])).validate is True  # no graphs: checked, as before


def test_graphs_with_checked_is_refused_naming_both(capsys, monkeypatch):
    monkeypatch.setattr(me_loop, "run", _never)
    _fails(capsys, ["mini-engine", "--device", "cuda", "--graphs", "--checked"] + ME_TINY, 2,
           "--graphs needs unchecked mode", "--checked", "drop --checked")
    _fails(capsys, ["mini-engine", "--checked", "--unchecked"] + ME_TINY, 2, "--unchecked", "--checked")


# ------------------------------------------------------------ options that would do nothing
@pytest.mark.parametrize("argv, needles", [
    (["stress", "--metrics-every", "5"], ["--metrics-every has no effect without --metrics-file"]),
    (["stress", "--metrics-addr", "0.0.0.0"], ["--metrics-addr has no effect without --metrics-port"]),
    (["stress", "--layers", "1", "--prefetch"], ["--prefetch has no effect with one layer (--layers 1)"]),
])
def test_stress_options_that_do_nothing_are_refused(capsys, monkeypatch, argv, needles):
    monkeypatch.setattr(stress.StressRun, "run", _never)
    _fails(capsys, argv + STRESS_TINY, 2, *needles)


def test_stress_prefetch_into_a_one_layer_trace_is_refused(capsys, monkeypatch, tmp_path):
    rec = TraceRecorder(num_layers=1, top_k=4)
    for step, n in enumerate((30, 31)):
        rec.begin_step([0], [n])
        rec.add_layer(0, [[0, 1, 2, step + 3]])
    rec.save(tmp_path / "t.npz")
    monkeypatch.setattr(stress.StressRun, "run", _never)
    _fails(capsys, ["stress", "--replay", str(tmp_path / "t.npz"), "--prefetch", "--device", "cpu", "--quiet"],
           2, "--prefetch has no effect with one layer (the trace has one)")


@pytest.mark.parametrize("argv, needles", [
    (["--ffn", "none", "--ffn-experts", "8"], ["--ffn-experts has no effect with --ffn none", "--ffn moe"]),
    (["--ffn-routing", "token"], ["--ffn-routing has no effect with --ffn none (the default)"]),
    (["--ffn", "mlp", "--ffn-routing", "token", "--ffn-active", "1"],
     ["--ffn-active, --ffn-routing have no effect with --ffn mlp"]),
    (["--ffn-intermediate", "32"], ["--ffn-intermediate has no effect", "--ffn mlp or --ffn moe"]),
    (["--sync-steps"], ["--sync-steps has no effect on a CPU device"]),
    (["--flashmla-lib", "/nonexistent.so"], ["--flashmla-lib '/nonexistent.so' does not exist"]),
    (["--flashmla-lib", __file__], ["--flashmla-lib has no effect on a CPU device"]),
    (["--flashmla-lib", __file__, "--backend", "reference"], ["--flashmla-lib has no effect with --backend reference"]),
])
def test_mini_engine_options_that_do_nothing_are_refused(capsys, monkeypatch, argv, needles):
    monkeypatch.setattr(me_loop, "MiniEngine", _never)
    _fails(capsys, ["mini-engine"] + argv + ME_TINY, 2, *needles)


@pytest.mark.parametrize("argv, needles", [
    (["plan", "--tp-share", "--tp", "1"], ["--tp-share has no effect with --tp 1"]),
    (["plan", "--tp-share"], ["--tp-share has no effect with --tp 1"]),
    (["whatif", "--pcie-gbps", "inf"] + WHATIF_TINY, ["--pcie-gbps must be a positive, finite number"]),
    (["whatif", "--row-bytes", "512", "--format", "bf16"] + WHATIF_TINY, ["--format has no effect with --row-bytes"]),
    (["env", "--flashmla-lib", "/nonexistent.so"], ["--flashmla-lib '/nonexistent.so' does not exist"]),
    (["autotune", "--flashmla-lib", "/nonexistent.so", "--quiet"], ["does not exist"]),
    (["autotune", "--flashmla-lib", __file__, "--device", "cpu", "--gpu-memory", "1MiB", "--quiet"],
     ["--flashmla-lib has no effect on a CPU device"]),
])
def test_other_options_that_do_nothing_are_refused(capsys, monkeypatch, argv, needles):
    for name in ("collect_env", "run_autotune", "plan"):
        monkeypatch.setattr(cli, name, _never)
    _fails(capsys, argv, 2, *needles)


def test_what_a_default_or_an_enabling_flag_supplies_is_not_refused(capsys):
    """Given means typed: defaults, presets and options whose feature is on pass."""
    from hisparse_tools import flag_rules

    for argv in (["--ffn", "moe", "--ffn-experts", "8", "--ffn-routing", "token", "--ffn-intermediate", "32"],
                 ["--ffn", "mlp", "--ffn-intermediate", "32"], ["--device", "cuda", "--sync-steps"],
                 ["--preset", "h200"], []):
        args = _me_args(argv)
        flag_rules.check_mini_engine(args, me_cli.config_from_args(args))
    stress = cli.build_parser().parse_args(["stress", "--metrics-file", "m.prom", "--metrics-port", "9100",
                                            "--metrics-addr", "0.0.0.0", "--metrics-every", "3"])
    flag_rules.check_stress(stress)
    bare = cli.build_parser().parse_args(["stress"])
    flag_rules.check_stress(bare)  # the defaults stand in for what was not given
    assert (bare.metrics_every, bare.metrics_addr) == (10, "127.0.0.1")
    assert json.loads(_run_ok(capsys, ["plan", "--tp", "2", "--tp-share", "--json"]))["host_pool_copies_per_node"] == 1


def _run_ok(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out


# ------------------------------------------------------------ messages in the flags' words
@pytest.mark.parametrize("argv, needles, absent", [
    (["--requests", "99999999999999999999999"], ["--requests 99999999999999999999999", "int32"],
     ["max_request_id"]),
    (["--block-size", "100000000000"], ["--block-size 100000000000", "a block size below the context"],
     ["host pool"]),
    (["--top-k", "1000000000", "--buffer", "1000000000", "--requests", "3"],
     ["--requests 3 with 1000000000 hot slots each (--buffer)"],
     ["max_num_reqs", "device_buffer_size"]),
])
def test_stress_size_errors_name_the_flag(capsys, monkeypatch, argv, needles, absent):
    monkeypatch.setattr(stress.StressRun, "run", _never)
    base = [a for a in STRESS_TINY]
    for flag in argv[::2]:  # the case's own value replaces the tiny one
        if flag in base:
            del base[base.index(flag):base.index(flag) + 2]
    _fails(capsys, ["stress"] + argv + base, 2, *needles, absent=absent)


def test_stress_buffer_below_top_k_is_a_capacity_error_in_its_flags_words(capsys, monkeypatch):
    """A hot buffer smaller than the top-k is the cache's capacity failure (exit 3, as
    HiSparseConfig and mini-engine report it), named by the flag."""
    monkeypatch.setattr(stress.StressRun, "run", _never)
    _fails(capsys, ["stress", "--buffer", "5"] + STRESS_TINY, 3, "capacity:",
           "--buffer 5 is smaller than --top-k (8)", "--buffer >= 8", absent=["device_buffer_size"])


@pytest.mark.parametrize("command, argv, rc, needles, absent", [
    ("stress", ["--layers", "0"], 2, ["--layers must be >= 1, got 0"], ["num_layers"]),
    ("stress", ["--requests", "0"], 2, ["--requests must be >= 1"], ["num_requests"]),
    ("stress", ["--context", "0"], 2, ["--context must be >= 1"], []),
    ("stress", ["--steps", "0"], 2, ["--steps must be >= 1"], []),
    ("mini-engine", ["--layers", "0"], 2, ["--layers must be >= 1, got 0"], ["num_layers"]),
    ("mini-engine", ["--requests", "0"], 2, ["--requests must be >= 1"], ["num_requests"]),
    ("mini-engine", ["--heads", "0"], 2, ["--heads must be >= 1"], ["num_heads"]),
    ("mini-engine", ["--block-size", "0"], 2, ["--block-size must be >= 1"], ["host_block_size"]),
    ("mini-engine", ["--buffer", "3"], 3, ["--buffer 3 is smaller than --query-len x --top-k", "set --buffer >= "],
     ["device_buffer_size", "max_query_len"]),
])
def test_config_errors_name_the_flags_as_typed(capsys, monkeypatch, command, argv, rc, needles, absent):
    """Every option check of the options / config a command builds names the flag the
    user typed, not the field behind it, whatever check raised it."""
    monkeypatch.setattr(stress.StressRun, "run", _never)
    monkeypatch.setattr(me_loop, "run", _never)
    base = STRESS_TINY if command == "stress" else ME_TINY + ["--device", "cpu"]
    base = list(base)
    for flag in argv[::2]:
        if flag in base:
            del base[base.index(flag):base.index(flag) + 2]
    _fails(capsys, [command] + argv + base, rc, *needles, absent=absent)


@pytest.mark.parametrize("argv, path", [
    (["stress", "--record", "/nonexistent-dir/top_k.npz"] + STRESS_TINY, "'/nonexistent-dir/top_k.npz'"),
    (["stress", "--metrics-file", "/nonexistent-dir/metrics_every.prom"] + STRESS_TINY,
     "'/nonexistent-dir/metrics_every.prom'"),
    (["mini-engine", "--out", "/nonexistent-dir/num_layers.json", "--device", "cpu"] + ME_TINY,
     "'/nonexistent-dir/num_layers.json'"),
])
def test_a_path_in_an_error_is_left_as_typed(capsys, monkeypatch, argv, path):
    """Naming the flags rewrites field names, never a path the user gave that holds one."""
    monkeypatch.setattr(stress.StressRun, "run", _never)
    monkeypatch.setattr(me_loop, "run", _never)
    _fails(capsys, argv, 2, path, "does not exist")


def test_name_flags_leaves_quoted_text_paths_and_words_inside_words_alone():
    from hisparse_tools.exit_codes import name_flags
    flags = {"top_k": "--top-k", "num_layers": "--layers", "steps": "--steps"}
    assert name_flags("top_k must be >= 1; num_layers=0.", flags) == "--top-k must be >= 1; --layers 0."
    assert name_flags("trace '/a/top_k.npz' and /b/top_k.npz, x_top_k, top_k.json", flags) == \
        "trace '/a/top_k.npz' and /b/top_k.npz, x_top_k, top_k.json"
    assert name_flags("steps must be >= 1; steps left", flags) == "--steps must be >= 1; steps left"
    assert name_flags("it ends at top_k.", flags) == "it ends at --top-k."


def test_autotune_buffer_error_names_the_flag(capsys):
    _fails(capsys, ["autotune", "--buffer", "3", "--top-k", "8", "--device", "cpu", "--gpu-memory", "1GiB",
                    "--quiet"], 3, "--buffer 3 is smaller than", "set --buffer >= 8",
           absent=["device_buffer_size", "max_query_len"])


def test_python_m_mini_engine_names_the_flags_too(capsys):
    assert me_cli.main(["--layers", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--layers must be >= 1, got 0") and "num_layers" not in err, err


def test_plan_write_twice_the_same_request_names_it_not_an_internal():
    c = HiSparseCache(HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=4, max_num_reqs=2,
                                     host_block_size=16, device="cpu"))
    c.add_request(7)
    with pytest.raises(ValueError) as e:
        c.plan_write([7, 7], [1, 1])
    assert "append_rows_batch" not in str(e.value) and "request 7 appears 2 times" in str(e.value)
    with pytest.raises(ValueError) as e:
        c.plan_write([7], [1, 1])
    assert "append_rows_batch" not in str(e.value) and "1 request ids but 2 counts" in str(e.value)


def test_oversized_hot_buffer_advice_is_about_the_hot_buffer(monkeypatch):
    import hisparse.device as device

    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=4, device_buffer_size=1 << 20,
                         max_num_reqs=2, host_block_size=16, device="cpu")
    monkeypatch.setattr(device, "available_host_bytes", lambda: cfg.device_bytes()["total"] - 1)
    with pytest.raises(CapacityError) as e:
        HiSparseCache(cfg)
    assert "hot rows" in str(e.value) and "device_buffer_size" in str(e.value)
    assert "host pool" not in str(e.value)


def test_an_output_that_fails_to_write_names_its_flag_and_path(capsys, monkeypatch, tmp_path):
    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TraceRecorder, "save", full)
    path = str(tmp_path / "t.npz")
    _fails(capsys, ["stress", "--record", path] + STRESS_TINY, 1,
           f"hisparse stress: I/O error: --record {path!r} could not be written: No space left on device")
    from hisparse_tools.exit_codes import OutputError, writing

    def body():
        with writing("--out", "/dev/full"):
            raise OSError(5, "Input/output error")

    assert run_command("autotune", body) == EXIT_FAILED
    assert capsys.readouterr().err.strip() == ("hisparse autotune: I/O error: --out '/dev/full' could not be "
                                               "written: Input/output error")
    assert issubclass(OutputError, OSError)


def test_whatif_missing_matplotlib_says_its_kind(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    _fails(capsys, ["whatif", "--plot", str(tmp_path)] + WHATIF_TINY, 4,
           "hisparse whatif: missing dependency: --plot needs matplotlib")


# ------------------------------------------------------------ one vocabulary
FORMER = {"--num-layers": "--layers", "--num-requests": "--requests", "--num-heads": "--heads",
          "--row-format": "--format", "--device-buffer-size": "--buffer", "--host-block-size": "--block-size",
          "--cache-kernels": "--kernels"}


def _subparsers():
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_one_vocabulary_across_subcommands():
    """A concept has one visible flag everywhere; every command takes --quiet."""
    for name, sp in _subparsers().items():
        visible = {s for a in sp._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
        assert not visible & (set(FORMER) | {"--progress"}), (name, visible & set(FORMER))
        assert "--quiet" in visible, name
    me = {s for a in _subparsers()["mini-engine"]._actions for s in a.option_strings}
    assert set(FORMER.values()) <= me


def test_new_and_former_spellings_give_the_same_config(capsys, fake_me_run):
    vals = {"--layers": "3", "--requests": "5", "--heads": "4", "--format": "bf16", "--buffer": "32",
            "--block-size": "8", "--kernels": "torch"}
    new = me_cli.config_from_args(_me_args([x for k, v in vals.items() for x in (k, v)]))
    old_argv = [x for k, v in FORMER.items() for x in (k, vals[v])]
    old_args = _me_args(old_argv)
    assert me_cli.config_from_args(old_args) == new
    assert new.num_layers == 3 and new.device_buffer_size == 32 and new.cache_kernels is Kernels.TORCH
    assert len(old_args.notes) == len(FORMER)
    assert main(["mini-engine", "--num-layers", "1"] + ME_TINY) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hisparse mini-engine: note: --num-layers is deprecated and will be removed; use --layers "
                   "(the same option)"]
    _fails(capsys, ["mini-engine", "--num-layers", "0"] + ME_TINY, 2, "--layers must be >= 1")  # no note


def test_quiet_and_the_former_progress_flag(capsys, fake_me_run):
    assert main(["mini-engine"] + ME_TINY) == 0 and fake_me_run["progress"] is False  # stderr: not a terminal
    assert main(["mini-engine", "--quiet"] + ME_TINY) == 0 and fake_me_run["progress"] is False
    capsys.readouterr()
    assert main(["mini-engine", "--progress"] + ME_TINY) == 0 and fake_me_run["progress"] is True
    assert "--progress is deprecated" in capsys.readouterr().err
    _fails(capsys, ["mini-engine", "--progress", "--quiet"] + ME_TINY, 2, "--progress", "--quiet")


# ------------------------------------------------------------ help an installed command carries
def test_help_lists_whatif_and_points_to_installed_help(capsys):
    assert "whatif" in cli.__doc__.split("\n", 1)[0]
    assert main(["--help"]) == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "whatif" in top and "docs/CLI.md" not in top
    assert "hisparse COMMAND --help" in top and "no effect given the others is refused" in top
    for name in _subparsers():
        assert main([name, "--help"]) == 0
        assert "docs/CLI.md" not in capsys.readouterr().out, name
    with open(os.path.join(REPO, "dev")) as f:
        lines = f.read().splitlines()
    shown = "\n".join(lines[1:13])  # what `./dev` with no job prints (sed -n '2,13p')
    assert "whatif" in shown and "100 s" not in "\n".join(lines)
    assert "sed -n '2,13p'" in "\n".join(lines)
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert not re.search(r"\b100 s\b", readme) and "under a minute" in readme  # the set-up time README states


def _message_strings(path: str) -> list[str]:
    """The string constants of a module that are not docstrings (what it can print)."""
    import ast
    with open(path) as f:
        tree = ast.parse(f.read())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_message_points_to_docs_cli_md():
    """A pip-installed user has no docs/CLI.md: no help text or error message names it
    (docstrings may, for readers of the source)."""
    found = []
    for pkg in ("hisparse", "hisparse_tools"):
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    found += [(path, m) for m in _message_strings(path) if "docs/CLI.md" in m]
    assert found == []


def test_mini_engine_pool_rows(capsys, monkeypatch):
    """mini-engine --pool-rows N: hisparse's device pool (spelled as in stress, plan and
    autotune; no former spelling); a pool below the hot buffers names the flag."""
    assert me_cli.config_from_args(_me_args(["--pool-rows", "1K"])).device_pool_rows == 1024
    assert me_cli.config_from_args(_me_args([])).device_pool_rows is None
    assert "--device-pool-rows" not in {s for a in me_cli.build_parser()._actions for s in a.option_strings}
    monkeypatch.setattr(me_loop, "run", _never)
    _fails(capsys, ["mini-engine", "--pool-rows", "10"] + ME_TINY, 2, "--pool-rows 10 is smaller than the hot "
           "buffers it includes", absent=["device_pool_rows"])
