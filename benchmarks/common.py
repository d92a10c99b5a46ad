"""What the benchmarks share: timing statistics, CUDA-event timing, the environment
record, JSON output and the defaults of a few arguments.

- ``stats(samples)``: min / median / p99 (nearest rank) of a list, as a dict whose key
  names each benchmark keeps from its JSON format (``unit=``, ``count=``).
- ``time_calls(fn, ...)``: microseconds per call, CUDA events around each sample
  (perf_counter on a CPU smoke run), with an untimed ``before`` hook, back-to-back
  ``inner`` calls and an optional GPU sleep that hides the host's launch cost.
- ``L2Flush``: a 256 MiB scratch write that evicts the H200's 50 MiB L2 before a call.
- ``environment(device)``: python / torch / triton / CUDA / driver versions, the GPU,
  and the hisparse version and git commit the figures belong to.
- ``out_ok(path, prog)`` before the work, ``write_json(path, obj)`` after it.
- ``number_in(kind, lo, hi)``: argparse types for numbers in a range (``positive_int``,
  ``positive_float``, ``fraction``, ``locality``, ``percent`` made with it).
- ``flashmla_lib(cli)``: the FlashMLA library path (flag, env var, ``.gpu-deps``).
- ``interpret_dry_run()``: ``--dry-run`` runs the Triton kernels in the CPU interpreter.

hisparse and triton are imported inside ``environment`` rather than here: both read
``TRITON_INTERPRET`` when first imported, and a ``--dry-run`` benchmark sets it after
importing this module (``interpret_dry_run``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import traceback
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository root
FLUSH_BYTES = 256 << 20  # > 5x the H200's 50 MiB L2
FLASHMLA_LIB_ENV = "HISPARSE_FLASHMLA_LIB"
FLASHMLA_LIB_DEFAULT = ROOT / ".gpu-deps" / "vllm" / "_flashmla_C.abi3.so"


# ------------------------------------------------------------------ statistics
def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (0 < q <= 100) of ``samples`` (any order)."""
    s = sorted(samples)
    if not s:
        raise ValueError("percentile of no samples")
    return s[min(len(s) - 1, max(0, math.ceil(q / 100.0 * len(s)) - 1))]


def stats(samples: Sequence[float], *, unit: str = "", count: str = "n") -> dict[str, float]:
    """``{"min", "median", "p99", "n"}`` of ``samples``; ``unit`` is appended to the
    first three keys (``"_us"`` gives ``min_us`` ...) and ``count`` names the last."""
    if not samples:
        raise ValueError("stats of no samples")
    return {f"min{unit}": min(samples), f"median{unit}": statistics.median(samples),
            f"p99{unit}": percentile(samples, 99), count: len(samples)}


# ------------------------------------------------------------------ timing
class L2Flush:
    """Overwrites a 256 MiB device buffer; ``flush()`` before a timed call makes the
    call start from a cold L2 (a no-op on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self._junk = (torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
                      if device.type == "cuda" else None)

    def flush(self) -> None:
        if self._junk is not None:
            self._junk.zero_()


def capture(fn, before) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` captured in a CUDA graph after one eager call (which compiles), each call
    and the first replay after ``before()``; returns (graph, the captured output)."""
    before()
    fn()
    torch.cuda.synchronize()
    before()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout = fn()
    before()
    g.replay()
    torch.cuda.synchronize()
    return g, gout


def time_calls(fn: Callable[[], object], *, reps: int, warmup: int, cuda: bool,
               before: Callable[[], object] | None = None, inner: int = 1,
               gpu_sleep: bool = False) -> list[float]:
    """Microseconds per call of ``fn``, one sample per repetition.

    ``warmup`` untimed calls first. On CUDA each sample is the event time of ``inner``
    back-to-back calls divided by ``inner``, synchronised before the next sample;
    ``before`` (untimed) runs before every sample and warm-up call (an L2 flush, a
    state restore). ``gpu_sleep`` queues a ~0.5 ms GPU sleep ahead of the start event,
    so the host enqueues the calls while the GPU is busy and the sample is GPU time
    only. On CPU (smoke runs; the figures mean nothing) perf_counter stands in.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if gpu_sleep:
                torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU clock cycles
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) * 1e6 / inner)
    return out


# ------------------------------------------------------------------ environment
def _run(cmd: list[str]) -> str | None:
    """stdout of ``cmd`` (stripped), or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_commit() -> dict[str, Any]:
    """``{"commit": HEAD or None, "commit_dirty": tracked files changed or None}`` of
    the checkout this package sits in (None where there is no git or no checkout).
    ``HISPARSE_COMMIT`` set in the environment wins (dirtiness then unknown): a copy of
    the tree sent to another machine can carry git metadata older than the tree, so the
    sender names the commit (``benchmarks/gpu_run.sh`` reads it from ``.gpu-deps/commit``)."""
    given = os.environ.get("HISPARSE_COMMIT", "").strip()
    if given:
        return {"commit": given, "commit_dirty": None}
    head = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    if not head:
        return {"commit": None, "commit_dirty": None}
    dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": head, "commit_dirty": None if dirty is None else bool(dirty)}


def _cpu_model() -> str | None:
    """The host CPU's model name (Linux /proc/cpuinfo; None elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """The record every result carries: versions, GPU, driver, hisparse commit, time.

    ``device``: the CUDA device the benchmark runs on (default: the current one when
    CUDA is available); on CPU the GPU fields are None.
    """
    import triton  # here, not at the top: see the module docstring

    import hisparse

    cuda = torch.cuda.is_available()
    dev = torch.device(device) if device is not None else torch.device("cuda" if cuda else "cpu")
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "hisparse": hisparse.__version__,
        **git_commit(), "gpu": None, "sm": None, "sm_count": None, "gpu_mem_gib": None,
        "driver": None, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   gpu_mem_gib=round(p.total_memory / 2**30, 1),
                   driver=smi.splitlines()[0].strip() if smi else None)
    return env


# ------------------------------------------------------------------ arguments and output
def number_in(kind: type, lo: float | None = None, hi: float | None = None, *,
              lo_open: bool = False, hi_open: bool = False):
    """An argparse type: ``kind`` (int or float) within [lo, hi] (an open end with
    ``lo_open`` / ``hi_open``; None: unbounded). NaN and infinities are refused."""
    noun = "an int" if kind is int else "a number"
    if hi is None:
        want = f"{noun} {'>' if lo_open else '>='} {lo}" if lo is not None else noun
    elif lo is None:
        want = f"{noun} {'<' if hi_open else '<='} {hi}"
    else:
        want = f"{noun} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) \
            and (hi is None or (v < hi if hi_open else v <= hi))
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text}")
        return v
    return parse


positive_int = number_in(int, 1)  # counts and sizes
positive_float = number_in(float, 0, lo_open=True)
fraction = number_in(float, 0, 1)  # [0, 1]
locality = number_in(float, 0, 1, hi_open=True)  # [0, 1): 1 would select one block forever
percent = number_in(int, 0, 100)


def out_problem(path: str | None, flag: str = "--out") -> str | None:
    """Why results could not be written to ``path`` (None: they can, or no path)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        return f"{flag} {path} is a directory; give a file name"
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        return f"{flag} {path}: cannot create files under {parent}"
    try:  # os.access says yes to root everywhere (/proc included): try it
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot create files under {parent} ({e.strerror or e})"
    return None


def out_ok(path: str | None, prog: str, flag: str = "--out") -> bool:
    """False (after saying why on stderr) when results could not be written to
    ``path`` (given as ``flag``). Benchmarks call it before the work, so a typo costs
    no GPU time."""
    why = out_problem(path, flag)
    if why is not None:
        print(f"{prog}: {why}", file=sys.stderr)
    return why is None


def record_failure(result: dict, exc: BaseException) -> int:
    """Put a benchmark's exception into its result (``error``, ``traceback``), print the
    traceback on stderr and return exit status 1: a failed run still writes its JSON."""
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = "".join(traceback.format_exception(exc))
    print(result["traceback"], file=sys.stderr)
    return 1


def write_json(path: str | Path, obj: Any, *, indent: int = 1) -> None:
    """Write ``obj`` to ``path`` as JSON (parent folders created) and say so."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=indent, default=str))
    print(f"wrote {p}")


def flashmla_lib(cli: str | None) -> str | None:
    """The FlashMLA library to load: ``cli``, else ``$HISPARSE_FLASHMLA_LIB``, else
    ``.gpu-deps/vllm/_flashmla_C.abi3.so`` when present, else None (the backend then
    looks for an installed vllm / sgl_kernel)."""
    if cli:
        return cli
    env = os.environ.get(FLASHMLA_LIB_ENV)
    if env:
        return env
    return str(FLASHMLA_LIB_DEFAULT) if FLASHMLA_LIB_DEFAULT.is_file() else None


def interpret_dry_run(*, with_gpu: bool = False) -> None:
    """With ``--dry-run`` among this process's arguments, run Triton kernels in the CPU
    interpreter (``TRITON_INTERPRET=1``): on a machine without CUDA, or on any machine
    when ``with_gpu`` (a dry run that uses the CPU even where there is a GPU). Call it
    before hisparse or triton is imported."""
    if "--dry-run" in sys.argv[1:] and (with_gpu or not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")
