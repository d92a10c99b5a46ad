"""CPU: ``benchmarks.resolve_phases`` builds its clock-instrumented copy of the resolve
kernel from the current source (every phase anchor found once), the copy compiles for
sm90 (ptxas from the Triton wheel, no GPU), its clock summary does the arithmetic it
says, and bad options exit 2 before any work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks import resolve_phases as rp
from benchmarks import resolve_registers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_tick_is_inserted_once_in_order():
    src = rp.instrumented_source()
    ticks = [int(i) for i in re.findall(r"_tick\(clk_ptr, t, (\d+)\)", src)]
    assert ticks == list(range(rp.NTICKS))
    assert "def resolve_kernel(\n    clk_ptr,\n    req_ids_ptr," in src
    assert len(rp.PHASES) == rp.NTICKS - 1


def test_a_moved_anchor_is_reported():
    src = rp.KERNEL_SRC.read_text().replace("# P1: positions, host rows", "# P1: moved")
    with pytest.raises(rp.AnchorError, match="anchor 3 occurs 0 times"):
        rp.instrumented_source(src)


def test_instrumented_kernel_takes_the_clock_first():
    k = rp.load_instrumented()
    from hisparse.kernels.resolve import resolve_kernel
    assert k.arg_names == ["clk_ptr", *resolve_kernel.arg_names]


def test_summary_arithmetic():
    clk = torch.zeros((3, rp.CLK_COLS), dtype=torch.int64)
    # program 0: every tick 1000 ns apart; program 1: no misses (P3/P4 ticks 7-12 absent);
    # program 2: not a leader (only tick 0), left out
    clk[0, :rp.NTICKS] = 10_000 + 1000 * torch.arange(rp.NTICKS)
    clk[1, :7] = 10_500 + 2000 * torch.arange(7)
    clk[1, 13] = clk[1, 6] + 3000
    clk[2, 0] = 9_000
    clk[0, 24], clk[0, 25], clk[0, 26] = 40, 17 * 1000 + 3, 195
    clk[1, 24] = 0
    s = rp.summarize(clk)
    assert s["programs"] == 2
    assert s["span_us"] == pytest.approx((max(10_000 + 13_000, 10_500 + 12_000 + 3000) - 10_000) / 1e3)
    assert s["start_spread_us"] == pytest.approx(0.5)
    ph = s["phases_us"]
    assert ph["0-1 group"] == pytest.approx(1.5)  # mean of 1.0 and 2.0
    assert ph["7-8 P3 stamp bisection"] == pytest.approx(1.0)  # program 0 only
    assert "12-13 P5 stores" in ph and ph["12-13 P5 stores"] == pytest.approx(1.0)
    assert s["misses_per_program"] == 20 and s["stamp_probes"] == 1.5 and s["position_probes"] == 8.5


def test_dry_run_and_bad_options(capsys, tmp_path):
    assert rp.main(["--dry-run"]) == 0
    assert "instrumented kernel built" in capsys.readouterr().out
    assert rp.main(["standalone", "--", "--contexts", "128K"]) == 2
    assert "after --" in capsys.readouterr().err
    assert rp.main(["--context", "100"]) == 2
    assert "--context" in capsys.readouterr().err
    assert rp.main(["--out", str(tmp_path / "missing-dir" / "x.json")]) == 2
    assert rp.main(["--hit", "1.5"]) == 2


def test_instrumented_kernel_compiles_for_sm90():
    try:
        resolve_registers.ptxas_path(90)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from benchmarks import resolve_phases as rp
        k = rp.load_instrumented()
        consts = dict(STAT_HITS=0, STAT_MISSES=1, STAT_INVALID=2, STAT_RESOLVES=3, STAT_PREFETCH=4,
                      STAMPED=False, MISS_LISTS=False, PREFETCH=False, Q=1, KB=128, GQ=1,
                      SMALL_SORT=128, SB=512, COMPACT=False, CH=256)
        i64 = {"clk_ptr", "slot_stamp_ptr", "undo_hit_ptr", "undo_vstamp_ptr", "step_ptr", "stats_ptr"}
        sig = {n: "constexpr" if n in consts else ("*i64" if n in i64 else "*i32") if n.endswith("_ptr")
               else "i32" for n in k.arg_names}
        c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert "globaltimer" in c.asm["ptx"]
        print("compiled")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
