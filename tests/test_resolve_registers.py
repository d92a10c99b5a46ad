"""CPU: ``benchmarks.resolve_registers`` compiles the resolve kernel for sm90 (ptxas from
the Triton wheel, no GPU) and reports its registers and spills; bad options exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import resolve_registers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reports_registers_and_spills_for_sm90():
    try:
        resolve_registers.ptxas_path(90)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "benchmarks.resolve_registers", "--slots", "300",
                        "--top-k", "100", "--json"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (case,) = json.loads(r.stdout)
    assert (case["S"], case["K"], case["SB"], case["warps"]) == (300, 100, 512, 4)
    assert 0 < case["registers"] <= 255
    assert case["spill_stores"] >= 0 and case["spill_loads"] >= 0 and case["stack"] >= 0


def test_interpreter_mode_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_registers.main(["--slots", "300", "--top-k", "100"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


def test_too_few_slots_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        resolve_registers.main(["--slots", "1024", "--top-k", "2048"])
    assert e.value.code == 2
    assert "exceeds --slots 1024" in capsys.readouterr().err
