"""The output files of the ``hisparse`` commands: what a path may be, and how it is written.

A file written once, front to back (``--record``, ``--out``), may be anything that takes
a sequential write: a regular file, ``/dev/null``, a FIFO with a reader. The FIFO tests
use real FIFOs (``os.mkfifo``) with a reader thread, and every wait has a timeout, so a
command that hangs fails its test instead of hanging the suite.
"""

import json
import os
import threading

import numpy as np
import pytest

from hisparse_tools import cli, stress
from hisparse_tools.cli import main
from hisparse_tools.mini_engine import loop as me_loop
from hisparse_tools.traces import TraceRecorder, load_trace

# a trace whose last archive member (topk) is large enough that zipfile, seeking on
# /dev/null (where tell() stays 0), computed a negative directory size (struct.error)
STRESS_BIG_TOPK = ["--requests", "2", "--context", "200", "--layers", "1", "--top-k", "64",
                   "--buffer", "128", "--steps", "2", "--block-size", "16", "--device", "cpu", "--quiet"]
STRESS_TINY = ["--requests", "2", "--context", "200", "--layers", "1", "--top-k", "8",
               "--buffer", "16", "--steps", "6", "--block-size", "16", "--device", "cpu", "--quiet"]
ME_TINY = ["--requests", "2", "--max-prompt", "24", "--max-decode", "8"]
AUTOTUNE_TINY = ["--quiet", "--device", "cpu", "--layers", "1", "--top-k", "8", "--context", "32",
                 "--heads", "2", "--steps", "2", "--warmup", "1", "--candidates", "2", "--block-size", "16",
                 "--gpu-memory", "400KiB"]
WAIT_S = 120  # a reader or a command that takes longer than this hangs


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err
    return rc, out


def _refused(capsys, argv, *needles):
    rc, out = _run(capsys, argv)
    err = out.err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, (rc, err)
    for n in needles:
        assert n in err, (n, err)
    return err


def _never(*args, **kw):
    raise AssertionError("work started before the output paths were checked")


def _in_thread(fn, timeout=WAIT_S):
    """fn()'s value, run in a daemon thread: a hang fails the test instead of stalling it."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread, raised there
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Reader(threading.Thread):
    """The reader of a FIFO: reads it to end-of-file (``leave``: closes it at once)."""

    def __init__(self, path, *, leave=False):
        super().__init__(daemon=True)
        self.path, self.leave, self.data = path, leave, None
        self.start()

    def run(self):
        with open(self.path, "rb") as f:  # waits for a writer
            self.data = b"" if self.leave else f.read()

    def result(self):
        self.join(WAIT_S)
        assert not self.is_alive(), f"the reader of {self.path} got no end-of-file in {WAIT_S} s"
        return self.data


@pytest.fixture
def fifo(tmp_path):
    """A factory of FIFOs; at the end every thread still waiting to open one is released
    (a read-write open is a reader and a writer at once and never blocks)."""
    made = []

    def make(name="ff"):
        path = tmp_path / name
        os.mkfifo(path)
        made.append(path)
        return str(path)

    yield make
    for path in made:
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


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


# ----------------------------------------------------------------- --metrics-file's mode
def test_metrics_file_is_readable_by_others_under_a_022_umask(capsys, tmp_path):
    """node_exporter's textfile collector reads it as another user (docs/METRICS.md)."""
    old = os.umask(0o022)
    try:
        rc, _ = _run(capsys, ["stress", "--metrics-file", str(tmp_path / "h.prom")] + STRESS_TINY)
    finally:
        os.umask(old)
    assert rc == 0 and (tmp_path / "h.prom").stat().st_mode & 0o777 == 0o644


# ----------------------------------------------------------------- FIFOs
def _trace_of(data, tmp_path):
    (tmp_path / "got.npz").write_bytes(data)
    return load_trace(tmp_path / "got.npz")


def test_stress_record_into_a_fifo_reaches_its_reader(capsys, fifo, tmp_path):
    """The check opened the FIFO and closed it, so the reader saw end-of-file and left
    before the trace was written; the run then exited 2 (no reader any more)."""
    ff = fifo()
    reader = _Reader(ff)
    rc, _ = _in_thread(lambda: _run(capsys, ["stress", "--record", ff] + STRESS_TINY))
    assert rc == 0
    meta, steps = _trace_of(reader.result(), tmp_path)
    assert meta["num_steps"] == 6 and len(steps) == 6


def test_autotune_out_into_a_fifo_reaches_its_reader_and_never_hangs(capsys, fifo):
    """After the check's open and close the reader had left, and writing the result
    waited forever for another one."""
    ff = fifo()
    reader = _Reader(ff)
    rc, out = _in_thread(lambda: _run(capsys, ["autotune", "--json", "--out", ff] + AUTOTUNE_TINY))
    assert rc == 0
    assert json.loads(reader.result()) == json.loads(out.out)


def test_mini_engine_out_and_record_into_fifos(capsys, fifo, tmp_path):
    out_ff, rec_ff = fifo("out"), fifo("rec")
    out_reader, rec_reader = _Reader(out_ff), _Reader(rec_ff)
    rc, out = _in_thread(lambda: _run(capsys, ["mini-engine", "--json", "--out", out_ff, "--record", rec_ff]
                                      + ME_TINY))
    assert rc == 0
    assert json.loads(out_reader.result()) == json.loads(out.out)
    meta, _ = _trace_of(rec_reader.result(), tmp_path)
    assert meta["num_steps"] == json.loads(out.out)["trace"]["decode_steps"]


def test_a_fifo_whose_reader_left_fails_the_write_not_hangs(capsys, fifo):
    ff = fifo()
    _Reader(ff, leave=True)
    rc, out = _in_thread(lambda: _run(capsys, ["stress", "--record", ff] + STRESS_TINY))
    err = out.err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "I/O error" in err, (rc, err)


@pytest.mark.parametrize("argv", [["stress", "--record", "{}"] + STRESS_TINY,
                                  ["autotune", "--out", "{}"] + AUTOTUNE_TINY,
                                  ["mini-engine", "--out", "{}"] + ME_TINY,
                                  ["mini-engine", "--record", "{}"] + ME_TINY],
                         ids=["stress-record", "autotune-out", "mini-engine-out", "mini-engine-record"])
def test_a_fifo_without_a_reader_is_refused_up_front(capsys, fifo, monkeypatch, argv):
    ff = fifo()
    for mod, name in ((stress, "StressRun"), (cli, "run_autotune"), (me_loop, "MiniEngine")):
        monkeypatch.setattr(mod, name, _never)
    flag = argv[1]
    _in_thread(lambda: _refused(capsys, [a.format(ff) for a in argv], f"{flag} {ff!r} is a FIFO",
                                "no reader"))


# ----------------------------------------------------------------- two outputs, one file
def _same_file_cases(tmp_path):
    """(name, argv suffix, the flags named) of two outputs that are one file."""
    t = str(tmp_path)
    (tmp_path / "real.prom").write_text("")
    os.symlink(tmp_path / "real.prom", tmp_path / "link.prom")
    os.link(tmp_path / "real.prom", tmp_path / "hard.prom")
    os.symlink(tmp_path / "new.npz", tmp_path / "dangling")
    return {
        "stress same path": (["stress", "--record", f"{t}/same", "--metrics-file", f"{t}/same"],
                             "--metrics-file", "--record"),
        "stress relative and absolute": (["stress", "--record", "rel", "--metrics-file", f"{t}/rel"],
                                         "--metrics-file", "--record"),
        "stress symlink": (["stress", "--record", f"{t}/link.prom", "--metrics-file", f"{t}/real.prom"],
                           "--metrics-file", "--record"),
        "stress hard link": (["stress", "--record", f"{t}/hard.prom", "--metrics-file", f"{t}/real.prom"],
                             "--metrics-file", "--record"),
        "stress dangling symlink": (["stress", "--record", f"{t}/dangling", "--metrics-file", f"{t}/new.npz"],
                                    "--metrics-file", "--record"),
        "stress record is a plot": (["stress", "--record", f"{t}/plots/hit_rate.png", "--plot", f"{t}/plots"],
                                    "--plot", "(its hit_rate.png)"),
        "stress plot dir is the record": (["stress", "--record", f"{t}/out", "--plot", f"{t}/out"],
                                          "--plot", "(the directory)"),
        "stress metrics file is a plot": (["stress", "--plot", t, "--metrics-file", f"{t}/step_time.png"],
                                          "--metrics-file", "(its step_time.png)"),
        "mini-engine same path": (["mini-engine", "--out", f"{t}/same", "--record", f"{t}/same"],
                                  "--record", "--out"),
    }


@pytest.mark.parametrize("case", ["stress same path", "stress relative and absolute", "stress symlink",
                                  "stress hard link", "stress dangling symlink", "stress record is a plot",
                                  "stress plot dir is the record", "stress metrics file is a plot",
                                  "mini-engine same path"])
def test_two_outputs_of_one_file_are_refused_up_front(capsys, tmp_path, monkeypatch, case):
    (tmp_path / "plots").mkdir()
    argv, *flags = _same_file_cases(tmp_path)[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(stress, "StressRun", _never)
    monkeypatch.setattr(me_loop, "MiniEngine", _never)
    tail = STRESS_TINY if argv[0] == "stress" else ME_TINY
    _refused(capsys, argv + tail, "are the same file", "one output would overwrite the other", *flags)
    assert not (tmp_path / "out").exists() and not (tmp_path / "same").exists()


def test_dev_null_takes_several_outputs(tmp_path):
    from hisparse_tools.outputs import Outputs

    with Outputs() as outs:
        assert outs.file(os.devnull, flag="--out") == os.devnull
        assert outs.file(os.devnull, flag="--record") == os.devnull
        outs.file(tmp_path / "a", flag="--metrics-file", replace=True)
        outs.file(tmp_path / "a", flag="--metrics-file", replace=True)  # the same output checked again
        with pytest.raises(ValueError, match="same file"):
            outs.file(tmp_path / "a", flag="--record")


# ----------------------------------------------------------------- an output that is an input
def test_recording_over_the_replayed_trace_is_refused_up_front(capsys, tmp_path, monkeypatch):
    trace = tmp_path / "t.npz"
    assert main(["stress", "--record", str(trace)] + STRESS_TINY) == 0
    capsys.readouterr()
    before = trace.read_bytes()
    os.symlink(trace, tmp_path / "link.npz")
    os.link(trace, tmp_path / "hard.npz")
    monkeypatch.setattr(stress, "StressRun", _never)
    for replay, record in ((trace, trace), (tmp_path / "link.npz", trace), (trace, tmp_path / "hard.npz")):
        _refused(capsys, ["stress", "--replay", str(replay), "--record", str(record), "--quiet"],
                 f"--record {str(record)!r} is the file --replay {str(replay)!r} reads", "another path")
    assert trace.read_bytes() == before


def test_an_input_and_an_output_in_either_order():
    from hisparse_tools.outputs import Outputs

    with Outputs() as outs:
        outs.file("/tmp/hisparse-never-written.npz", flag="--record")
        with pytest.raises(ValueError, match="is the file --replay"):
            outs.input("/tmp/hisparse-never-written.npz", flag="--replay")
        outs.input(os.devnull, flag="--replay")  # a character device: shared on purpose
        outs.file(os.devnull, flag="--out")


def test_a_reader_that_leaves_stdout_ends_the_command_quietly():
    """`hisparse stress | head -1`: a command's print finds no reader; exit 141, as a
    process killed by SIGPIPE, with nothing on stderr (no traceback, no I/O error). The
    child's command writes lines until its reader has left, so the end is certain."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = ("import sys\n"
             "from hisparse_tools.exit_codes import run_command\n"
             "def body():\n"
             "    while True:\n"
             "        print('a line of the report', flush=True)\n"
             "sys.exit(run_command('stress', body))\n")
    p = subprocess.Popen([sys.executable, "-c", child], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": root})
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=WAIT_S)
    assert first == b"a line of the report\n", first
    assert rc == 141 and err == "", (rc, err)


def test_a_broken_pipe_that_is_not_the_commands_output_is_an_io_error(capsys):
    """A BrokenPipeError from elsewhere (a socket, a pipe the command opened) while
    stdout and stderr still have their readers: one line, exit 1, not the quiet 141."""
    from hisparse_tools.exit_codes import EXIT_FAILED, run_command

    def fn():
        raise BrokenPipeError(32, "Broken pipe")

    assert run_command("stress", fn) == EXIT_FAILED
    err = capsys.readouterr().err.strip()
    assert err == "hisparse stress: I/O error: [Errno 32] Broken pipe", err
