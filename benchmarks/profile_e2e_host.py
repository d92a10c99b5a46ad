"""Where the host time of a mini-engine decode step goes: cProfile over one run of the
resident KV and one of hisparse, at bench_e2e's sizes, after bench_e2e's warm-up.

  python3 -m benchmarks.profile_e2e_host --quick [--top 30] [--out prof.txt]
  python3 -m benchmarks.profile_e2e_host --dry-run          # CPU, tiny (checks the script)

Prints, per run, the wall time, the time spent waiting in torch.cuda.synchronize (GPU
work the host waits for) and the top functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import gzip
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import common

common.interpret_dry_run(with_gpu=True)  # a dry run is on the CPU; before hisparse loads

from benchmarks import bench_e2e  # noqa: E402
from hisparse_tools import mini_engine as me  # noqa: E402
from hisparse_tools.preflight import check_output_dir  # noqa: E402


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="bench_e2e --quick sizes (default: full)")
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU run")
    ap.add_argument("--top", type=int, default=30, help="functions listed per table")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--torch-profiler", action="store_true",
                    help="also run each engine under torch.profiler (CPU + CUDA activity) and "
                         "list the ops by self CPU time and by device time")
    ap.add_argument("--host-timers", action="store_true",
                    help="first run each engine once with wall-clock timers (no profiler) around "
                         "its calls and list the host time per decode step of each")
    ap.add_argument("--kinds", nargs="+", default=["resident", "hisparse"],
                    choices=["resident", "hisparse"], help="engines to run, in this order")
    ap.add_argument("--no-gc", action="store_true", help="gc.disable() during the runs")
    ap.add_argument("--only-timers", action="store_true",
                    help="with --host-timers / --sync-debug: stop after them")
    ap.add_argument("--sync-debug", action="store_true",
                    help="first run each engine once with torch.cuda.set_sync_debug_mode('warn') "
                         "and list the code sites that synchronised with the GPU, with counts")
    ap.add_argument("--chrome-trace", metavar="DIR",
                    help="with --torch-profiler: write each run's trace to DIR/KIND.json.gz, "
                         "with ranges around every forward and every cache call (analyse with "
                         "python -m benchmarks.analyse_e2e_trace)")
    a = ap.parse_args(argv)
    if not common.out_ok(a.out, "profile_e2e_host"):
        return 2
    if a.chrome_trace and not a.torch_profiler:
        ap.error("--chrome-trace writes torch.profiler's traces: add --torch-profiler")
    if a.chrome_trace:  # a folder the traces go in: written after the runs, checked now
        try:
            check_output_dir(a.chrome_trace, flag="--chrome-trace")
        except ValueError as e:
            print(f"profile_e2e_host: {e}", file=sys.stderr)
            return 2
    cfg = bench_e2e.sizes(bench_e2e.parse_args(["--dry-run"] * a.dry_run + ["--quick"] * a.quick))
    if not a.dry_run and not torch.cuda.is_available():
        print("profile_e2e_host: no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    print(f"warm-up {bench_e2e.warm_up(cfg):.1f} s", flush=True)
    report = io.StringIO()
    if a.no_gc:
        gc.disable()
    if a.host_timers:
        for kind in a.kinds:
            _host_timers(cfg, kind, report)
    if a.sync_debug:
        for kind in a.kinds:
            _sync_sites(cfg, kind, report)
    if a.only_timers:
        print(report.getvalue())
        if a.out:
            Path(a.out).write_text(report.getvalue())
        return 0
    for kind in a.kinds:
        gc.collect()  # as mini_engine.run does between engines
        eng = me.MiniEngine(cfg, kind)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        res = eng.run(None)
        prof.disable()
        wall = time.perf_counter() - t0
        st = pstats.Stats(prof)
        sync_s = sum(v[3] for k, v in st.stats.items() if k[2] == "synchronize"
                     or "synchronize" in k[2])
        dec = res["decode_step_times"]
        print(f"== {kind}: wall {wall:.2f} s, {len(dec)} decode steps, median {_median_ms(dec):.2f} ms "
              f"(under cProfile), time in *synchronize*: {sync_s:.2f} s", file=report)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
            print(f"-- {kind}, by {key}", file=report)
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-8000:],
                  file=report)
        if a.torch_profiler:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            eng2 = me.MiniEngine(cfg, kind)
            if a.chrome_trace:
                _annotate(eng2)
            with profile(activities=acts) as tp:
                eng2.run(None)
            if a.chrome_trace:
                Path(a.chrome_trace).mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory() as tmp:
                    raw = os.path.join(tmp, "trace.json")
                    tp.export_chrome_trace(raw)
                    with open(raw, "rb") as f, gzip.open(Path(a.chrome_trace) / f"{kind}.json.gz", "wb") as g:
                        g.write(f.read())
            ka = tp.key_averages()
            print(f"-- {kind}, torch.profiler by self CPU time", file=report)
            print(ka.table(sort_by="self_cpu_time_total", row_limit=a.top), file=report)
            if torch.cuda.is_available():
                print(f"-- {kind}, torch.profiler by device time", file=report)
                print(ka.table(sort_by="self_device_time_total", row_limit=a.top), file=report)
            del eng2
        del eng
    text = report.getvalue()
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


def _host_timers(cfg, kind: str, report) -> None:
    """Run ``kind`` once with perf_counter timers around its calls (what the host spends
    in each, per decode step; no profiler, no syncs added)."""
    tot: collections.Counter = collections.Counter()
    per_step: list[dict] = []
    gc.collect()  # as mini_engine.run does between engines
    eng = me.MiniEngine(cfg, kind)

    @contextlib.contextmanager
    def timer(label):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            tot[label] += time.perf_counter() - t0

    _wrap_calls(eng, timer)
    fwd = eng.forward

    def forward(batch):
        tot.clear()
        t0 = time.perf_counter()
        out = fwd(batch)
        host = time.perf_counter() - t0
        per_step.append(dict(tot, forward=host, decode=batch.md.num_prefills == 0))
        return out
    eng.forward = forward
    res = eng.run(None)
    dec = [d for d in per_step if d["decode"]]
    med = _median_ms(res["decode_step_times"])
    keys = sorted({k for d in dec for k in d if k not in ("decode",)})
    print(f"== {kind}: host ms per decode step (median over {len(dec)}; decode step wall median "
          f"{med:.2f} ms)", file=report)
    for k in keys:
        print(f"   {k:22s} {_median_ms([d.get(k, 0.0) for d in dec]):8.3f}", file=report)
    del eng


def _sync_sites(cfg, kind: str, report) -> None:
    """Run ``kind`` once under torch's sync debug mode; print where it synchronised."""
    sites: collections.Counter = collections.Counter()
    orig = warnings.showwarning
    gc.collect()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/hisparse/" in f.filename or "/benchmarks/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/hisparse/')[-1]}:{f.lineno}({f.name})"
                            for f in reversed(frames[-4:]))
        sites[(str(message).split(".")[0][:60], where)] += 1

    eng = me.MiniEngine(cfg, kind)
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            res = eng.run(None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = orig
    med = _median_ms(res["decode_step_times"])
    print(f"== {kind}: synchronising calls (sync debug mode; decode step median {med:.2f} ms "
          f"in this run), {sum(sites.values())} in all", file=report)
    for (msg, where), n in sites.most_common(25):
        print(f"{n:7d}  {msg}  at {where}", file=report)
    del eng


def _annotate(eng) -> None:
    """Wrap the engine's forward and its calls in profiler ranges ("e2e.forward",
    "kv.write", "kv.decode_rows", ...), so a trace shows which host calls launched which
    kernels."""
    _wrap_calls(eng, record_function)
    fwd = eng.forward

    def forward(*args, **kw):
        with record_function("e2e.forward"):
            return fwd(*args, **kw)
    eng.forward = forward


def _wrap_calls(eng, around) -> None:
    """Run each of the engine's per-layer calls inside ``around(label)`` (a context
    manager factory): its KV object's, the indexer's, the decode backend's and the
    model's."""
    def wrap(obj, name, label):
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def inner(*args, **kw):
            with around(label):
                return fn(*args, **kw)
        setattr(obj, name, inner)

    for name in ("begin", "write", "decode_rows", "prefill_workspace", "fill"):
        wrap(eng.kv, name, f"kv.{name}")
    for name in ("decode_topk", "write"):
        wrap(eng.indexer, name, f"indexer.{name}")
    wrap(eng.decode_backend, "decode", "attn.decode")
    wrap(eng.model, "pre", "model.pre")
    wrap(eng.model, "q_proj", "model.q_proj")
    wrap(eng.model, "post", "model.post")


if __name__ == "__main__":
    sys.exit(main())
