"""The ``hisparse`` options as a user meets them: messages in the flags' words.

Everything runs in-process on the CPU at tiny sizes; where a check happens before the
work, the work is replaced by a function that fails the test if it is reached.
"""

import json
import sys

import pytest

from hisparse import CapacityError, HiSparseCache, HiSparseConfig
from hisparse.tools import cli
from hisparse.tools.cli import main
from hisparse.tools.exit_codes import EXIT_FAILED, run_command
from hisparse.tools.traces import TraceRecorder

STRESS_TINY = ["--requests", "2", "--context", "200", "--top-k", "8", "--steps", "2", "--block-size", "16",
               "--device", "cpu", "--quiet"]
WHATIF_TINY = ["--trace", "uniform", "--requests", "2", "--context", "200", "--layers", "1", "--top-k", "8",
               "--steps", "3", "--quiet"]


def _fails(capsys, argv, rc, *needles, absent=()):
    """main(argv) exits ``rc`` with one line on stderr holding every needle and none of
    ``absent``, no traceback; returns the line."""
    got = main(argv)
    out = capsys.readouterr()
    err = out.err.strip()
    assert "Traceback" not in out.err + out.out, out.err
    assert got == rc, (got, err)
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    for n in absent:
        assert n not in err, (n, err)
    return err


def _never(*args, **kw):
    raise AssertionError("the work started: the options should have been refused first")


# ------------------------------------------------------------ messages in the flags' words
@pytest.mark.parametrize("argv, needles, absent", [
    (["--buffer", "5"], ["--buffer 5 is smaller than --top-k (8)", "--buffer >= 8"], ["device_buffer_size"]),
    (["--requests", "99999999999999999999999"], ["--requests 99999999999999999999999", "int32"],
     ["max_request_id"]),
    (["--block-size", "100000000000"], ["--block-size 100000000000", "a block size below the context"],
     ["host pool"]),
    (["--top-k", "1000000000", "--buffer", "1000000000", "--requests", "3"],
     ["--requests 3 with 1000000000 hot slots each (--buffer)"],
     ["max_num_reqs", "device_buffer_size"]),
])
def test_stress_size_errors_name_the_flag(capsys, monkeypatch, argv, needles, absent):
    monkeypatch.setattr(cli.StressRun, "run", _never)
    base = [a for a in STRESS_TINY]
    for flag in argv[::2]:  # the case's own value replaces the tiny one
        if flag in base:
            del base[base.index(flag):base.index(flag) + 2]
    _fails(capsys, ["stress"] + argv + base, 2, *needles, absent=absent)


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
    from hisparse.tools.exit_codes import OutputError, writing

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

