"""``hisparse stress --shared-prefix P --prefix-groups G``: prefix caching under the stress
tool (CPU, tiny sizes, the torch reference kernels).

- Rows are keyed by the token prefix, so requests sharing a prefix expect the same bytes;
  a run with groups, follow-up turns, churn and a pool that fills (evictions) passes byte
  verification, reports the prefix figures and ends with an empty pool.
- A pool left in use after the reset fails the run; bad values are one-line errors.
"""

import json

import numpy as np
import pytest

from hisparse import HiSparseCache
from hisparse_tools import stress
from hisparse_tools.cli import _stress_options, build_parser, main
from hisparse_tools.stress import StressOptions, run_stress
from hisparse_tools.stress_prefix import PrefixSchedule, prefix_keys
from hisparse_tools.stress_report import format_stress
from cli_common import fails

BASE = dict(num_requests=3, context=300, num_layers=2, top_k=16, buffer_size=32, steps=30, churn=0.2,
            progress=False, device="cpu", block_size=16, kernels="torch")
PREFIX = dict(BASE, shared_prefix=128, prefix_groups=2, verify="all")
CLI = ["--requests", "3", "--context", "300", "--layers", "2", "--top-k", "16", "--buffer", "32", "--steps", "30",
       "--churn", "0.2", "--block-size", "16", "--device", "cpu", "--kernels", "torch", "--quiet"]


def _never(*args, **kw):
    raise AssertionError("the work started: the options should have been refused first")


def test_prefix_keys_hash_the_token_prefix():
    rng = np.random.default_rng(0)
    a = rng.integers(1, 2**31, 300).astype(np.uint32)
    h, want = 0, []
    for t in a.tolist():  # the sequential definition
        h = (h * 0x9E3779B1 + t) % 2**32
        want.append(h)
    assert prefix_keys(a).tolist() == want
    b = a.copy()
    b[200] += 1
    kb = prefix_keys(b)
    assert (kb[:200] == prefix_keys(a)[:200]).all() and (kb[200:] != prefix_keys(a)[200:]).all()
    assert prefix_keys(np.zeros(0, np.uint32)).size == 0


def test_schedule_prompts_share_their_groups_prefix_and_follow_ups_extend_a_request():
    o = StressOptions(**PREFIX)
    sch = PrefixSchedule(o, max_request_id=16, max_len=o.context + o.steps)
    firsts, followups = set(), 0
    for s in range(o.steps):
        ids, lens = sch.step(s)
        for rid in ids.tolist():
            t, n0 = sch.tokens[rid], sch.prompt[rid]
            assert t.size == o.context + o.steps and n0 <= o.context
            if sch.kind[rid] == "fresh":
                firsts.add(bytes(t[:128]))
                assert any((t[:128] == p).all() for p in sch.prefixes)
    assert len(firsts) == 2  # both groups' prefixes were drawn
    followups = sch.followups
    assert followups > 0 and len(sch.prefixes) == 2 and all(p.size == 128 for p in sch.prefixes)


def test_run_with_groups_follow_ups_and_evictions_verifies_and_drains():
    r = run_stress(StressOptions(**PREFIX))
    assert r["ok"], r["failures"]
    p, ov, L = r["prefix"], r["overall"], 2
    assert p["joins"] == r["workload"]["joined"] and p["followups"] > 0 and p["followup_hit_tokens"] > 0
    assert 0 < p["hit_tokens"] < p["query_tokens"] and p["hit_rate"] == p["hit_tokens"] / p["query_tokens"]
    assert p["hit_tokens"] % 16 == 0 and p["prefill_rows_saved"] == p["hit_tokens"] * L
    assert p["evictions"] > 0 and p["cached_blocks"] > 0  # the pool filled with cached blocks, then reused them
    assert p["drained"] and p["blocks_used_after_reset"] == 0
    assert p["host_rows_unshared_peak"] > p["host_rows_peak"] > 0 and p["host_rows_saved"] > 0  # concurrent sharers
    assert p["shared_blocks_peak"] > 0 and p["alias_blocks"] == r["config"]["host_pool_tokens"] // 16
    assert ov["rows_verified"] == ov["hits"] + ov["misses"] and ov["optimal_hit_rate"] is None
    assert len(r["per_step"]["host_rows"]) == len(r["per_step"]["prefix_hit_rate"]) == 30
    assert StressOptions(**r["options"], progress=False) == StressOptions(**PREFIX)
    text = format_stress(r)
    for part in ("shared_prefix=128 prefix_groups=2", "prefix hit rate (hit / query tokens)", "prefill rows saved",
                 "host rows per layer, peak", "evictions", "host pool empty", "belady=n/a", "RESULT: PASS"):
        assert part in text, (part, text)


def test_only_the_uncached_rows_are_prefilled():
    """Every prompt's rows but its last are prefilled (the last is the first decode
    step's append), except the cached ones: rows prefilled + rows saved = the prompts'."""
    r = run_stress(StressOptions(**{**PREFIX, "steps": 12, "verify": 16}))
    assert r["ok"], r["failures"]
    p, ov = r["prefix"], r["overall"]
    assert p["prefill_rows_saved"] > 0
    assert ov["prefill_rows"] + p["prefill_rows_saved"] == 2 * (p["query_tokens"] - p["joins"])


def test_concurrent_sharers_verify_with_the_triton_kernels():
    """Requests of one group live at once map the cached blocks under alias ids; the
    Triton resolve and staging (interpreted) read the host rows behind them."""
    r = run_stress(StressOptions(**{**PREFIX, "kernels": "triton", "num_layers": 1, "steps": 6, "churn": 0.3,
                                    "context": 200, "context_min": 150, "prefix_groups": None, "seed": 1}))
    assert r["ok"], r["failures"]
    p = r["prefix"]
    assert r["kernels"] == "triton" and p["shared_blocks_peak"] > 0 and p["host_rows_saved"] > 0
    assert r["overall"]["misses"] > 0 and p["drained"]


def test_a_pool_left_in_use_after_the_reset_fails_the_run(monkeypatch):
    monkeypatch.setattr(HiSparseCache, "reset_prefix_cache", lambda self: 0)
    r = run_stress(StressOptions(**{**PREFIX, "steps": 8, "verify": 8}))
    assert not r["ok"] and not r["prefix"]["drained"]
    assert "--shared-prefix: after every request left and reset_prefix_cache()" in r["failures"][0]
    assert "still used" in r["failures"][0] and "RESULT: FAIL" in format_stress(r)


def test_a_wrong_shared_row_fails_the_run(monkeypatch):
    """A cached row read back wrong (the host copy of a hit request's prefix) is caught."""
    orig = HiSparseCache.read_host_rows

    def read_host_rows(self, layer, req_id, positions):
        out = orig(self, layer, req_id, positions).clone()
        out[0, 1] ^= 0x40
        return out

    monkeypatch.setattr(HiSparseCache, "read_host_rows", read_host_rows)
    r = run_stress(StressOptions(**{**PREFIX, "steps": 4}))
    assert not r["ok"] and "host copy" in r["failures"][0]


# ------------------------------------------------------------------ the command line
def test_cli_json(capsys):
    assert main(["stress", "--json", "--shared-prefix", "128", "--prefix-groups", "2", "--verify", "all"] + CLI) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["options"]["shared_prefix"] == 128 and r["options"]["prefix_groups"] == 2
    assert r["config"]["prefix_caching"] is True and r["prefix"]["drained"] and r["prefix"]["hit_tokens"] > 0


def test_cli_prefix_groups_default_to_one():
    args = build_parser().parse_args(["stress", "--shared-prefix", "64"] + CLI)
    o = _stress_options(args)
    assert o.shared_prefix == 64 and o.prefix_groups is None and o.groups_used == 1


@pytest.mark.parametrize("argv, needles", [
    (["--shared-prefix", "0"], ["--shared-prefix must be >= 1, got 0"]),
    (["--shared-prefix", "64", "--prefix-groups", "0"], ["--prefix-groups must be >= 1, got 0"]),
    (["--shared-prefix", "8"], ["--shared-prefix 8 is shorter than one host block (--block-size 16)"]),
    (["--shared-prefix", "150"], ["--shared-prefix 150 does not fit the prompts", "shortest has 150 tokens",
                                  "give a --shared-prefix below 150"]),
    (["--shared-prefix", "1K", "--context-min", "200"], ["--shared-prefix 1024 does not fit",
                                                         "give a --shared-prefix below 200"]),
    (["--shared-prefix", "lots"], ["argument --shared-prefix: cannot parse token count 'lots'"]),
    (["--prefix-groups", "4"], ["--prefix-groups has no effect without --shared-prefix", "add --shared-prefix P"]),
    (["--shared-prefix", "64", "--pool-rows", "600", "--ramp"], ["--shared-prefix makes its own requests",
                                                                 "--ramp makes another schedule"]),
])
def test_cli_bad_values_are_one_line(capsys, monkeypatch, argv, needles):
    monkeypatch.setattr(stress.StressRun, "run", _never)
    argv = argv + [a for a in CLI if a not in ("--steps", "30", "--churn", "0.2")] if "--ramp" in argv else argv + CLI
    fails(capsys, ["stress"] + argv, 2, *needles)


def test_cli_shared_prefix_next_to_a_replay_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(stress.StressRun, "run", _never)
    fails(capsys, ["stress", "--shared-prefix", "64", "--replay", str(tmp_path / "t.npz"), "--device", "cpu",
                   "--quiet"], 2, "--shared-prefix makes its own requests", "--replay FILE replays another schedule")


def test_shared_prompts_share_device_pages_in_the_elastic_tier():
    """With ``--pool-rows``, a request whose cached prefix a resident request holds joins
    resident on its pages: every resolved row (resident through the shared pages, hot
    otherwise) byte-verified every step, the pool empty at the end."""
    hot = 4 * 33  # the stress tool's max_num_reqs (requests + 1) x (S + 1)
    r = run_stress(StressOptions(**{**PREFIX, "pool_rows": -(-hot // 64) * 64 + 24 * 64, "churn": 0.3, "seed": 2}))
    assert r["ok"], r["failures"]
    p = r["prefix"]
    assert p["resident_joins"] > 0 and p["shared_pages_peak"] > 0 and p["drained"], p
    assert r["overall"]["resident_rows"] > 0
    assert "joins resident on shared pages" in format_stress(r)
