"""Per-forward host and GPU time from a trace of ``benchmarks.profile_e2e_host --chrome-trace``.

  python3 -m benchmarks.analyse_e2e_trace DIR/hisparse.json.gz [DIR/resident.json.gz ...]

For every ``e2e.forward`` range (one engine step) it reports the host time of the call,
the GPU time the kernels it launched took (their union over all streams), the gap
between the first and last of them, and the host time of each annotated call inside
(``kv.write``, ``kv.decode_rows``, ``attn.decode``, ...), summed over the step. A step
whose host time exceeds its GPU busy time is bound by the host: the GPU waits for
Python. Prints a table per trace (median over the steps without prefill is the last
line) and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import statistics
import sys
from collections import defaultdict

from benchmarks.common import out_ok, write_json


def load(path: str) -> list[dict]:
    """The events of a Chrome trace (``.json`` or ``.json.gz``); ``ValueError`` saying
    what is wrong with a file that isn't one."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise ValueError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("traceEvents"), list):
        raise ValueError(f"{path}: no traceEvents list; expected a trace of "
                         "`profile_e2e_host --torch-profiler --chrome-trace DIR`")
    return d["traceEvents"]


def union(intervals: list[tuple[float, float]]) -> float:
    tot, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


def analyse(events: list[dict]) -> list[dict]:
    xs = [e for e in events if e.get("ph") == "X"]
    ann = [e for e in xs if e.get("cat") == "user_annotation"]
    runtime = [e for e in xs if e.get("cat") == "cuda_runtime"]
    gpu = [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu_by_corr = defaultdict(list)
    for e in gpu:
        c = e.get("args", {}).get("correlation")
        if c is not None:
            gpu_by_corr[c].append((e["ts"], e["ts"] + e["dur"]))
    runtime.sort(key=lambda e: e["ts"])
    rts_ts = [e["ts"] for e in runtime]
    steps = []
    fwd = sorted((e for e in ann if e["name"] == "e2e.forward"), key=lambda e: e["ts"])
    for f in fwd:
        a, b = f["ts"], f["ts"] + f["dur"]
        iv = []
        for r in runtime:
            if r["ts"] < a:
                continue
            if r["ts"] > b:
                break
            iv += gpu_by_corr.get(r.get("args", {}).get("correlation"), [])
        calls = defaultdict(float)
        rt = defaultdict(float)  # (annotation, runtime call) -> host us
        for e in ann:
            if e["name"] != "e2e.forward" and a <= e["ts"] <= b:
                calls[e["name"]] += e["dur"]
                j = bisect.bisect_left(rts_ts, e["ts"])
                while j < len(runtime) and runtime[j]["ts"] <= e["ts"] + e["dur"]:
                    rt[f"{e['name']} / {runtime[j]['name']}"] += runtime[j]["dur"]
                    j += 1
        steps.append({
            "host_us": f["dur"],
            "gpu_busy_us": union(iv),
            "gpu_span_us": (max(x[1] for x in iv) - min(x[0] for x in iv)) if iv else 0.0,
            "kernels": len(iv),
            "prefill": calls.get("kv.prefill_workspace", 0.0) > 0 or calls.get("kv.fill", 0) > 0,
            "calls_us": dict(calls),
            "runtime_us": dict(rt),
        })
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", help="write the per-step numbers here")
    a = ap.parse_args(argv)
    if not out_ok(a.json, "analyse_e2e_trace", flag="--json"):
        return 2
    for path in a.traces:  # every input exists before the first is parsed
        if not os.path.isfile(path):
            why = "not a file" if os.path.exists(path) else "no such file"
            print(f"analyse_e2e_trace: {path}: {why}; give the .json.gz traces of "
                  "`profile_e2e_host --chrome-trace DIR`", file=sys.stderr)
            return 2
    out = {}
    for path in a.traces:
        try:
            events = load(path)
        except ValueError as e:
            print(f"analyse_e2e_trace: {e}", file=sys.stderr)
            return 2
        steps = analyse(events)
        out[path] = steps
        print(f"== {path}: {len(steps)} forwards")
        names = sorted({k for s in steps for k in s["calls_us"]})
        print(f"{'step':>4s} {'host ms':>8s} {'gpu busy':>8s} {'gpu span':>8s} {'kern':>5s} "
              + " ".join(f"{n[:14]:>14s}" for n in names))
        for i, s in enumerate(steps):
            print(f"{i:4d} {s['host_us'] / 1e3:8.2f} {s['gpu_busy_us'] / 1e3:8.2f} "
                  f"{s['gpu_span_us'] / 1e3:8.2f} {s['kernels']:5d} "
                  + " ".join(f"{s['calls_us'].get(n, 0) / 1e3:14.2f}" for n in names)
                  + ("  prefill" if s["prefill"] else ""))
        dec = [s for s in steps if not s["prefill"]]
        if dec:
            med = lambda k: statistics.median(s[k] for s in dec) / 1e3  # noqa: E731
            print(f"median of {len(dec)} decode-only forwards: host {med('host_us'):.2f} ms, "
                  f"GPU busy {med('gpu_busy_us'):.2f} ms, GPU span {med('gpu_span_us'):.2f} ms; "
                  + ", ".join(f"{n} {statistics.median(s['calls_us'].get(n, 0) for s in dec) / 1e3:.2f}"
                              for n in names))
            rts = sorted({k for s in dec for k in s["runtime_us"]})
            meds = sorted(((statistics.median(s["runtime_us"].get(k, 0.0) for s in dec), k) for k in rts),
                          reverse=True)
            print("CUDA runtime calls inside each annotated call, median host ms per decode step:")
            for v, k in meds[:25]:
                print(f"   {v / 1e3:8.3f}  {k}")
    if a.json:
        write_json(a.json, out)  # creates the folders out_ok found missing
    return 0


if __name__ == "__main__":
    sys.exit(main())
