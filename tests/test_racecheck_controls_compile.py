"""CPU: the racecheck control kernels (benchmarks/racecheck_controls.py) compile for sm90
(ptxas from the Triton wheel, no GPU) and contain what each control claims: the bare
warp-specialised kernel no shared-memory access but Triton's own partition switch, the
mbarrier exchange its waits and arrives, the unsynchronised one none of the consumer's,
the CTA-barrier one no mbarrier at all. They run on the H200 under compute-sanitizer
(``bash benchmarks/gpu_run.sh racecheck_controls``)."""

import pytest
from attention_common import run_sm90_compile

from hisparse.kernels.gluon_support import gluon_ws_problem

_COMPILE = r'''
import json
from benchmarks.racecheck_controls import compile_controls
print(json.dumps(compile_controls()))
'''


def test_racecheck_controls_compile_for_sm90():
    problem = gluon_ws_problem()
    if problem is not None:
        pytest.skip(f"no Gluon SM 9.x kernels on this Triton: {problem}")
    got = {row["control"]: row for row in run_sm90_compile(_COMPILE)}
    assert sorted(got) == ["ctl_a_ws_bar", "ctl_a_ws_bare", "ctl_a_ws_inits", "ctl_a_ws_inits_nobar",
                           "ctl_b_mbarrier", "ctl_c_unsynced", "ctl_d_cta_barrier"]
    for name in ("ctl_a_ws_bare", "ctl_a_ws_bar", "ctl_a_ws_inits", "ctl_a_ws_inits_nobar",
                 "ctl_b_mbarrier", "ctl_c_unsynced"):
        assert got[name]["warps"] == 12, got[name]  # the decode kernel's 4 + 4 + 4 warps
        # the partition switch: barrier.sync 1 over the whole CTA on both sides
        assert got[name]["barrier_sync"] > 0, got[name]
    bare = got["ctl_a_ws_bare"]
    # only the switch's shared bytes: the default warps store the partition numbers (at the
    # fork and the exit value at the join), each worker warp loads its own
    assert (bare["st_shared"], bare["ld_shared"]) == (2, 1), bare
    assert bare["mbarrier_wait"] == bare["mbarrier_arrive"] == 0, bare
    for name in ("ctl_a_ws_inits", "ctl_a_ws_inits_nobar", "ctl_a_ws_bar"):
        assert (got[name]["st_shared"], got[name]["ld_shared"]) == (2, 1), got[name]
    # the pre-fork CTA barrier is the only difference between bar and bare
    assert bare["bar_sync"] == 0 and got["ctl_a_ws_bar"]["bar_sync"] >= 1, got["ctl_a_ws_bar"]
    b, c = got["ctl_b_mbarrier"], got["ctl_c_unsynced"]
    assert b["mbarrier_wait"] == 2 and b["mbarrier_arrive"] == 2, b  # ready and empty
    assert c["mbarrier_wait"] == 0 and c["mbarrier_arrive"] == 1, c  # the producer's ready only
    assert b["st_shared"] == c["st_shared"] > 2 and b["ld_shared"] == c["ld_shared"] > 1, (b, c)
    d = got["ctl_d_cta_barrier"]
    assert d["warps"] == 8 and d["barrier_sync"] == 0 and d["bar_sync"] >= 2, d
    assert d["mbarrier_wait"] == d["mbarrier_arrive"] == 0, d
