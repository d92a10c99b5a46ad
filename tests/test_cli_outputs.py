"""The output files of the ``hisparse`` commands: what a path may be, and how it is written.

A file written once, front to back (``--record``, ``--out``), may be anything that takes
a sequential write: a regular file, ``/dev/null``, a FIFO with a reader. The FIFO tests
use real FIFOs (``os.mkfifo``) with a reader thread, and every wait has a timeout, so a
command that hangs fails its test instead of hanging the suite.
"""

import os
import threading

import numpy as np
import pytest

from hisparse.tools.cli import main
from hisparse.tools.traces import TraceRecorder, load_trace

# a trace whose last archive member (topk) is large enough that zipfile, seeking on
# /dev/null (where tell() stays 0), computed a negative directory size (struct.error)
STRESS_BIG_TOPK = ["--requests", "2", "--context", "200", "--layers", "1", "--top-k", "64",
                   "--buffer", "128", "--steps", "2", "--block-size", "16", "--device", "cpu", "--quiet"]
ME_TINY = ["--num-requests", "2", "--max-prompt", "24", "--max-decode", "8"]
WAIT_S = 120  # a reader or a command that takes longer than this hangs


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err
    return rc, out


def _trace(num_steps=40, top_k=64):
    rec = TraceRecorder(num_layers=1, top_k=top_k)
    for s in range(num_steps):
        rec.begin_step([0, 1], [200 + s, 300 + s])
        rec.add_layer(0, np.arange(2 * top_k).reshape(2, top_k) % (200 + s))
    return rec


# ----------------------------------------------------------------- /dev/null (a device)
def test_a_trace_written_to_dev_null_does_not_crash():
    _trace().save(os.devnull)


@pytest.mark.parametrize("argv", [["stress"] + STRESS_BIG_TOPK, ["mini-engine"] + ME_TINY],
                         ids=["stress", "mini-engine"])
def test_record_to_dev_null_completes(capsys, argv):
    rc, _ = _run(capsys, argv + ["--record", os.devnull])
    assert rc == 0


def test_a_trace_is_written_front_to_back_and_reads_back(tmp_path):
    """The archive is a zip stream (no seek back), which numpy and load_trace read."""
    rec = _trace(num_steps=3, top_k=8)
    rec.save(tmp_path / "t.npz")
    meta, steps = load_trace(tmp_path / "t.npz")
    assert meta["num_steps"] == 3 and steps[2].seq_lens.tolist() == [202, 302]
    with open(tmp_path / "t2.npz", "wb") as fh:  # an open binary file works the same
        rec.save(fh)
    assert load_trace(tmp_path / "t2.npz")[1][2].topk.tolist() == steps[2].topk.tolist()
