"""benchmarks.probe_host_gather: the source-row patterns are what they say, and the
--cpu-smoke run copies every pattern byte for byte (Triton interpreter, tiny sizes)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import probe_host_gather as P
from hisparse._checks import interpreter_mode


def test_patterns_have_their_shape():
    s = P.SMOKE
    reps = 3
    src, dst = P.draw(s, list(P.PATTERNS), reps, seed=1)
    R, nr = s.region_rows, s.n_region
    for r in range(reps):
        d = dst[r]
        assert torch.unique(d).numel() == s.rows and int(d.max()) < s.dst_rows
        x = {n: v[r].long() for n, v in src.items()}
        for n in ("spread", "spread_sorted", "region", "region_far", "mixed43", "mixed43_far"):
            assert torch.unique(x[n]).numel() == s.rows, n  # distinct rows
        assert torch.equal(x["spread_sorted"], torch.sort(x["spread_sorted"]).values)
        assert int(x["region"].max()) < R
        far = x["region_far"]
        assert int(far.min()) >= R and int(far.max()) - int(far.min()) < R
        m = x["mixed43"]
        assert int((m < R).sum()) == nr
        mf = x["mixed43_far"]  # nr rows within one region of R rows outside the first one
        assert any(int(((mf >= a) & (mf < a + R)).sum()) >= nr for a in mf.tolist() if a >= R)
        for k in (2, 8):
            v = x[f"dup{k}"]
            assert torch.equal(v, v[::k].repeat_interleave(k))  # copies adjacent
            assert torch.unique(v[::k]).numel() == s.rows // k
            f = x[f"dup{k}_far"]
            _, counts = torch.unique(f, return_counts=True)
            assert bool((counts == k).all()) and not torch.equal(f, f[::k].repeat_interleave(k))
        rd = x["region_dup"]
        assert int((rd < s.dup_region_rows).sum()) == nr and int(((rd >= s.dup_region_rows) & (rd < R)).sum()) == 0
        assert torch.unique(rd[rd >= R]).numel() == s.rows - nr
    # fixed seed: the same draws again
    again, _ = P.draw(s, ["mixed43"], reps, seed=1)
    assert torch.equal(again["mixed43"], src["mixed43"])


def test_default_sizes():
    s = P.DEFAULT
    assert s.problem() is None and P.SMOKE.problem() is None
    assert s.rows == 64 * 205 and s.n_region == 5642 and s.dst_rows == 64 * 4097
    assert s.pool_rows == 2 * 2**20 and s.region_rows * 656 < 11e6
    assert P.Sizes(rows=20_000).problem() is not None  # more rows than the region holds


@pytest.mark.skipif(not interpreter_mode(), reason="the smoke run needs TRITON_INTERPRET=1 (the CPU test runner's)")
def test_cpu_smoke_checks_every_pattern(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert P.main(["--cpu-smoke", "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    cases = {(r["launcher"], r["pattern"]) for r in d["results"]}
    assert cases == {(lz, n) for lz in P.LAUNCHERS for n in P.PATTERNS}
    assert all(r["checked"] and r["reps"] == 1 for r in d["results"])
    assert d["benchmark"] == "probe_host_gather" and d["config"]["cpu_smoke"] and "torch" in d
    spread = [r for r in d["results"] if r["pattern"] == "spread"]
    assert all(r["vs_spread_median"] == 1.0 for r in spread)
    assert "region_dup" in capsys.readouterr().out


def test_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert P.main(["--reps", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_rows_refused_before_work(capsys):
    assert P.main(["--cpu-smoke", "--rows", "100000"]) == 2
    assert "exceeds the region" in capsys.readouterr().err
