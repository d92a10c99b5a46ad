"""Where the host time of a mini-engine decode step goes: cProfile over one run of the
resident KV and one of hisparse, at bench_e2e's sizes, after bench_e2e's warm-up.

  python3 scripts/profile_e2e_host.py --quick [--top 30] [--out prof.txt]
  python3 scripts/profile_e2e_host.py --dry-run          # CPU, tiny (checks the script)

Prints, per run, the wall time, the time spent waiting in torch.cuda.synchronize (GPU
work the host waits for) and the top functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _bench_e2e():
    spec = importlib.util.spec_from_file_location("_bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="bench_e2e --quick sizes (default: full)")
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU run")
    ap.add_argument("--top", type=int, default=30, help="functions listed per table")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--torch-profiler", action="store_true",
                    help="also run each engine under torch.profiler (CPU + CUDA activity) and "
                         "list the ops by self CPU time and by device time")
    a = ap.parse_args(argv)
    import torch

    from hisparse.tools import mini_engine as me

    be = _bench_e2e()
    ns = be.main.__globals__["argparse"].Namespace(
        dry_run=a.dry_run, quick=a.quick, layers=None, heads=None, requests=None, context=None,
        top_k=None, backend=None, flashmla_lib=None, locality=None, row_format=None)
    cfg = be.sizes(ns)
    if not a.dry_run and not torch.cuda.is_available():
        print("profile_e2e_host: no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    print(f"warm-up {be.warm_up(cfg):.1f} s", flush=True)
    report = io.StringIO()
    for kind in ("resident", "hisparse"):
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
        dec = sorted(res["decode_step_times"])
        med = dec[len(dec) // 2] * 1e3 if dec else float("nan")
        print(f"== {kind}: wall {wall:.2f} s, {len(dec)} decode steps, median {med:.2f} ms "
              f"(under cProfile), time in *synchronize*: {sync_s:.2f} s", file=report)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
            print(f"-- {kind}, by {key}", file=report)
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-8000:],
                  file=report)
        if a.torch_profiler:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            eng2 = me.MiniEngine(cfg, kind)
            with profile(activities=acts) as tp:
                eng2.run(None)
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


if __name__ == "__main__":
    sys.exit(main())
