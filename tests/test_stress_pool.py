"""``hisparse stress --pool-rows N [--ramp]``: the elastic device tier under the stress
tool (CPU, tiny sizes, the torch reference kernels).

- A ramp joins requests until the device pool overflows (a spill leaves a request
  hot), then lets them leave one by one; every resolved entry is verified across the
  spills, the seeded hot buffer of each demoted request right after its demotion, and
  at the end no device row or host block stays taken.
- Corruption of a resident page row, of a seeded hot row, or a row resolved outside
  its request's tier fails the run; a leak at the end of a ramp fails it too.
- The flags: --ramp needs --pool-rows and replaces --steps / --churn; --pool-rows below
  the hot buffers plus one page, and a ramp whose pool can't overflow, are one-line
  errors naming the flag and the number to give (exit 2).
"""

import json

import numpy as np
import pytest
import torch

from hisparse import HiSparseCache
from hisparse.cache import write_pool  # a write's demotions: apply_changes is looked up there
from hisparse_tools import stress
from hisparse_tools.cli import main
from hisparse_tools.stress import StressOptions, StressRun, run_stress
from hisparse_tools.stress_limits import pool_rows_minimum
from hisparse_tools.stress_report import format_stress
from hisparse_tools.workload import RampSchedule
from cli_common import fails

# 4 requests x 33 hot rows = 132 -> 192 hot-buffer rows per layer; contexts 150..300: 3..5 pages each
POOL = dict(num_requests=4, context=300, context_min=150, num_layers=2, top_k=16, buffer_size=32,
            progress=False, device="cpu", block_size=16, kernels="torch")
RAMP = dict(POOL, pool_rows=600, ramp=True, verify="all")  # 6 pages: the second or third join spills
CLI = ["--requests", "4", "--context", "300", "--context-min", "150", "--layers", "2", "--top-k", "16",
       "--buffer", "32", "--block-size", "16", "--device", "cpu", "--kernels", "torch", "--quiet"]


_fails = fails  # one refusal check for every CLI test (cli_common)


def _never(*args, **kw):
    raise AssertionError("the work started: the options should have been refused first")


# ------------------------------------------------------------------ the ramp
def test_ramp_schedule_joins_until_overflow_then_drains():
    sch = RampSchedule(StressOptions(**RAMP))
    ids, lens = sch.step(0)
    assert ids.tolist() == [0] and 150 <= lens[0] <= 300
    ids1, lens1 = sch.step(1)
    assert ids1.tolist() == [0, 1] and lens1[0] == lens[0] + 1  # every live request appends a row
    ids2, _ = sch.step(2, overflowed=True)  # the pool overflowed in step 1: the oldest leaves
    assert ids2.tolist() == [1] and sch.overflow_step == 1 and sch.phase == "leave"
    assert sch.step(3, overflowed=True)[0].size == 0  # none left: the ramp is over
    assert sch.peak_live == 2 and sch.max_steps == 8
    # every request slot taken without an overflow: the ramp turns anyway
    full = RampSchedule(StressOptions(**{**RAMP, "num_requests": 2}))
    full.step(0), full.step(1)
    assert full.step(2)[0].tolist() == [1] and full.overflow_step is None


def test_ramp_overflows_verifies_across_spills_and_drains():
    r = run_stress(StressOptions(**RAMP))
    assert r["ok"], r["failures"]
    ramp, pool, ps = r["ramp"], r["device_pool"], r["per_step"]
    assert ramp["overflowed"] and ramp["drained"]
    assert ramp["steps"] == 2 * ramp["joined"] - 1 == len(ps["live"])  # joins, then a leave per step
    assert ps["live"] == list(range(1, ramp["joined"] + 1)) + list(range(ramp["joined"] - 1, 0, -1))
    assert pool["spills"] >= 1 and pool["hot_requests_peak"] >= 1 and pool["resident_requests_peak"] >= 1
    assert pool["seeded_rows"] > 0 and pool["seeded_rows_verified"] > 0
    assert pool["pool_rows_used_end"] == 0 and pool["hot_requests_end"] == pool["resident_requests_end"] == 0
    assert pool["pool_rows_total"] == 192 + 6 * 64 and pool["pages"] == 6 and pool["hot_rows"] == 192
    assert 0 < pool["pool_rows_used_peak"] <= pool["pool_rows_total"]
    ov = r["overall"]
    assert ov["resident_rows"] == pool["resident_rows"] > 0 and ov["misses"] > 0
    assert ov["rows_verified"] == ov["hits"] + ov["misses"] + ov["resident_rows"]  # verify all: every entry
    assert abs(ov["hit_rate"] + ov["miss_rate"] - 1) < 1e-12 and pool["miss_rate"] == ov["miss_rate"]
    assert ps["spills"][ramp["overflow_step"]] >= 1 and ps["hot_requests"][ramp["overflow_step"]] >= 1
    assert all(ps["spills"][s] == 0 for s in range(ramp["overflow_step"]))
    text = format_stress(r)
    for part in ("device pool: 576 rows per layer", "resident rows", "spills", "pool_rows=600 ramp=on",
                 f"ramp: {ramp['joined']} requests joined", "pool and host blocks empty", "miss rate",
                 "RESULT: PASS"):
        assert part in text, (part, text)


def test_pool_that_holds_everything_never_misses():
    r = run_stress(StressOptions(**POOL, pool_rows=192 + 4 * 6 * 64, steps=4, churn=0.0))
    assert r["ok"], r["failures"]
    ov, pool = r["overall"], r["device_pool"]
    assert ov["misses"] == ov["hits"] == 0 and ov["resident_rows"] > 0 and ov["hit_rate"] == 1.0
    assert pool["spills"] == 0 and pool["resident_requests_end"] == 4 and pool["hot_requests_end"] == 0
    assert "ramp" not in r and r["config"]["device_pool_rows"] == 192 + 4 * 6 * 64


def test_without_a_pool_the_result_has_no_pool_figures():
    r = run_stress(StressOptions(**POOL, steps=2))
    assert r["ok"] and "device_pool" not in r and "live" not in r["per_step"]
    assert r["overall"]["resident_rows"] == 0 and "device pool" not in format_stress(r)


# ------------------------------------------------------------------ what the checks catch
def test_a_corrupted_resident_row_fails_the_run(monkeypatch):
    orig = HiSparseCache.resolve
    seen = {}

    def resolve(self, layer, req_ids, topk, **kw):
        res = orig(self, layer, req_ids, topk, **kw)
        p = res.physical[res.physical >= self.cfg.hot_rows_per_layer]  # a page row of a resident request
        if "row" not in seen and p.numel():
            seen["row"] = int(p[0])
            self.hot_rows(layer)[seen["row"], 3] ^= 0x10
        return res

    monkeypatch.setattr(HiSparseCache, "resolve", resolve)
    r = run_stress(StressOptions(**RAMP))
    assert not r["ok"] and f"hot row {seen['row']} " in r["failures"][0]
    assert "differs from the expected bytes" in r["failures"][0] and "ramp" in r
    assert r["ramp"]["drained"] is False  # a failed run stops where it failed


def test_a_corrupted_seeded_row_fails_the_run_before_any_resolve_reads_it(monkeypatch):
    orig = write_pool.apply_changes
    seen = {}

    def apply_changes(ch, *, pool, state, hot, **kw):
        orig(ch, pool=pool, state=state, hot=hot, **kw)
        if ch.demote and "slot" not in seen:
            r = ch.demote[0]
            SP = state.S + 1
            seen["slot"] = int((state.slot_pos[1, r] >= 0).nonzero()[0])
            hot[1, r * SP + seen["slot"], 0] ^= 0x01  # layer 1: a row of the demoted request's seeded buffer

    monkeypatch.setattr(write_pool, "apply_changes", apply_changes)
    r = run_stress(StressOptions(**{**RAMP, "verify": "none"}))  # the resolve checks off: the seed check sees it
    assert not r["ok"] and "slot" in seen
    f = r["failures"][0]
    assert "layer 1" in f and "demoted to a hot buffer" in f and f"slot {seen['slot']} " in f


def test_a_row_outside_its_requests_tier_is_caught():
    run = StressRun(StressOptions(**POOL, pool_rows=600))
    SP, base = 33, 192
    ids = np.array([7, 9])
    resident = torch.tensor([True, False])
    slots = torch.tensor([0, 1])
    ok = torch.tensor([[base, base + 5, -1], [SP, SP + 32, -1]], dtype=torch.int32)
    assert run._check_tiers(0, 3, ids, ok, resident, slots) == []
    for bad, who in (([[5, base, -1], [SP, SP, -1]], "request 7 (resident) entry 0"),
                     ([[base, base, -1], [SP, 2 * SP, -1]], "request 9 (hot) entry 1"),
                     ([[base + 6 * 64, base, -1], [SP, SP, -1]], "request 7 (resident) entry 0")):
        f = run._check_tiers(0, 3, ids, torch.tensor(bad, dtype=torch.int32), resident, slots)
        assert len(f) == 1 and who in f[0] and "step 3 layer 0" in f[0], f


def test_a_ramp_that_leaves_rows_taken_fails():
    class Leaky:
        def stats(self):
            return {"live_requests": 0, "total": {"pool_rows_used": 64}, "host_pool": {"blocks_used": 2}}

    run = StressRun(StressOptions(**RAMP))
    ramp = RampSchedule(run.o)
    f = run._ramp_end(Leaky(), ramp, {})
    assert any("never overflowed" in x for x in f)
    assert any("64 device rows per layer and 2 host blocks are still taken" in x for x in f)


# ------------------------------------------------------------------ the command line
def test_cli_ramp_json_verifies_every_entry(capsys):
    assert main(["stress", "--json", "--pool-rows", "600", "--ramp"] + CLI) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["options"]["verify"] == "all" and r["options"]["ramp"] is True
    assert r["ramp"]["overflowed"] and r["ramp"]["drained"] and r["device_pool"]["spills"] >= 1
    ov = r["overall"]
    assert ov["rows_verified"] == ov["hits"] + ov["misses"] + ov["resident_rows"]
    assert StressOptions(**r["options"], progress=False).pool_rows == 600  # repeatable from its result


def test_cli_ramp_table_and_progress(capsys):
    assert main(["stress", "--pool-rows", "600", "--ramp"] + [a for a in CLI if a != "--quiet"]) == 0
    out = capsys.readouterr()
    assert "ramp:" in out.out and "pool rows used" in out.out and "RESULT: PASS" in out.out
    assert "spills" in out.err and "stress:" in out.err  # progress on stderr, with the tiers


@pytest.mark.parametrize("argv, rc, needles", [
    (["--ramp"], 2, ["--ramp has no effect without --pool-rows", "add --pool-rows N"]),
    (["--pool-rows", "600", "--ramp", "--steps", "5"], 2, ["--steps has no effect with --ramp"]),
    (["--pool-rows", "600", "--ramp", "--churn", "0.1", "--steps", "3"], 2,
     ["--steps, --churn have no effect with --ramp"]),
    (["--pool-rows", "100"], 2, ["--pool-rows 100 is below its minimum 256", "--requests 4 x (32 hot slots (--buffer)"
                                 " + 1) = 132 rows per layer", "give --pool-rows >= 256"]),
    (["--pool-rows", "200"], 2, ["--pool-rows 200 is below its minimum 256"]),  # the hot buffers, but no page
    (["--pool-rows", "1000", "--ramp"], 2, ["--ramp: --pool-rows 1000 would never overflow",
                                            "give --pool-rows below 960"]),
    (["--pool-rows", "lots"], 2, ["argument --pool-rows: cannot parse row count 'lots'"]),
])
def test_cli_pool_errors_are_one_line(capsys, monkeypatch, argv, rc, needles):
    monkeypatch.setattr(stress.StressRun, "run", _never)
    _fails(capsys, ["stress"] + argv + CLI, rc, *needles)


def test_ramp_next_to_a_replay_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(stress.StressRun, "run", _never)
    _fails(capsys, ["stress", "--pool-rows", "600", "--ramp", "--replay", str(tmp_path / "t.npz"), "--device", "cpu",
                    "--quiet"], 2, "--ramp makes its own join/leave schedule and --replay FILE")
    with pytest.raises(ValueError, match="ramp needs pool_rows"):
        StressOptions(ramp=True)


def test_pool_minimum():
    assert pool_rows_minimum(4, 32) == (132, 256)
    assert pool_rows_minimum(2, 31) == (64, 128)  # already a multiple of 64: one page on top


def test_a_ramp_pool_that_holds_no_request_is_refused(capsys, monkeypatch):
    """A pool whose pages can't hold one request of --context-min: every request would go
    hot as it joins, and no spill would seed a hot buffer from its pages."""
    monkeypatch.setattr(stress.StressRun, "run", _never)
    _fails(capsys, ["stress", "--pool-rows", "256", "--ramp"] + CLI, 2,
           "--ramp: --pool-rows 256 leaves 1 page of 64 rows past the hot buffers (192 rows), fewer than one "
           "request of 150 tokens (--context-min) takes (3)", "give --pool-rows >= 384")
