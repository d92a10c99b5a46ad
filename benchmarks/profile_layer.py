"""Kernel timeline of one decode layer replayed from a CUDA graph: where a split or serial
layer's time goes, beside the resident attention.

The same setup as ``bench_layer`` (B requests of ``--context`` tokens, fp8_ds_mla rows
in a pinned pool, K = 2048 of S = 4096 hot slots, a fraction ``hit`` of each token's
entries hot). For each backend, hit rate and mode, the layer is captured in a CUDA graph,
the cache state restored and the L2 flushed, and one replay runs under torch.profiler;
every kernel of that replay is listed with its start (us after the first kernel began)
and its duration, on whichever stream it ran. The span (first start to last end) is
the layer's GPU time; kernels that overlap (the hit attention beside the resolve's miss
phase and the staging copy, in split mode) show as intervals that intersect.

  python -m benchmarks.profile_layer [--batch 64] [--hits 100 95 90]
      [--backends triton flashmla] [--modes resident serial split] [--out FILE]
  python -m benchmarks.profile_layer --dry-run   # tiny shapes on CPU: the ops, not kernels
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common

common.interpret_dry_run(with_gpu=True)  # before hisparse loads (a dry run stays on CPU)

from benchmarks import bench_layer as bl  # noqa: E402
from hisparse.decode import DecodeLayer, Overlap  # noqa: E402
from hisparse.formats import RowFormat  # noqa: E402

MODES = ("resident", "serial", "split")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hits", type=int, nargs="+", default=[100, 95, 90], help="hit rates in percent")
    ap.add_argument("--backends", nargs="+", default=["triton", "flashmla"], choices=["triton", "flashmla"])
    ap.add_argument("--modes", nargs="+", default=["resident", "serial", "split"], choices=MODES)
    ap.add_argument("--context", type=int, default=65536, help="tokens per request")
    ap.add_argument("--flashmla-lib", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU; figures mean nothing")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for h in a.hits:
        if not 0 <= h <= 100:
            ap.error(f"--hits takes percentages in [0, 100], got {h}")
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, got {a.batch}")
    defaults = bl.parse_args([])
    need = defaults.slots + defaults.top_k + 1
    if not a.dry_run and a.context < need:
        ap.error(f"--context must be >= {need} (each token draws its misses among the positions "
                 f"past the {defaults.slots} hot slots), got {a.context}")
    return a


def layer_args(a: argparse.Namespace) -> argparse.Namespace:
    """bench_layer's arguments for the same shapes (its Setup and backends take them)."""
    argv = ["--batch", str(a.batch), "--context", str(a.context)] + (["--dry-run"] if a.dry_run else [])
    if a.flashmla_lib:
        argv += ["--flashmla-lib", a.flashmla_lib]
    return bl.parse_args(argv)


def timeline(fn, before, cuda: bool) -> list[dict]:
    """Kernels (CUDA) or ops (CPU) of one call of ``fn`` after ``before()``, in start order."""
    before()
    if cuda:
        torch.cuda.synchronize()
    act = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[act]) as p:
        fn()
        if cuda:
            torch.cuda.synchronize()
    want = "CUDA" if cuda else "CPU"
    ev = [e for e in p.events() if getattr(e.device_type, "name", "") == want]
    if not cuda:  # top-level ops only: nested ones would count twice
        ev = [e for e in ev if e.cpu_parent is None]
    ev.sort(key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start if ev else 0
    return [{"name": e.name, "start_us": e.time_range.start - t0, "dur_us": e.time_range.elapsed_us()}
            for e in ev]


def graphed(fn, s: "bl.Setup", restore: bool):
    """``fn`` captured in a CUDA graph (``bench_layer.capture``) and replayed warm, as a
    replay callable and the state reset it needs before each replay."""
    before = s.restore if restore else s.flush.flush
    g, _ = bl.capture(fn, before)
    for _ in range(2):  # two more warm replays
        before()
        g.replay()
    torch.cuda.synchronize()
    return g.replay, before


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "profile_layer"):
        return 2
    cuda = torch.cuda.is_available() and not a.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    la = layer_args(a)
    B, ctx = la.batch[0], la.context
    s = bl.Setup(B, ctx, la, dev)
    c = s.cache
    fmt = RowFormat.FP8_DS_MLA
    sm = 1.0 / math.sqrt(576)
    report = {"benchmark": "profile_layer", "env": common.environment(dev), "args": vars(a), "cases": []}
    for name in (a.backends if not a.dry_run else ["triton"]):
        be, why = bl.make_backend(name, la, dev, la.heads)
        if be is None:
            print(f"{name}: skipped ({why})")
            report["cases"].append({"backend": name, "skipped": why})
            continue
        for h in a.hits:
            g = torch.Generator().manual_seed(h)
            q = (torch.randn((B, la.heads, 576), generator=g) * 0.5).to(device=dev, dtype=torch.bfloat16)
            tk = s.topk(h / 100.0, 1)
            for mode in a.modes:
                if mode == "resident":
                    idx = s.resident_idx(tk)
                    fn = lambda idx=idx: be.decode(q, s.resident[0], idx, sm_scale=sm, row_format=fmt)  # noqa: E731
                else:
                    dl = DecodeLayer(c, be, overlap=Overlap.parse(mode))
                    fn = lambda dl=dl: dl(0, s.req, tk, q, sm_scale=sm)  # noqa: E731
                restore = mode != "resident"
                if cuda:
                    call, before = graphed(fn, s, restore)
                else:
                    call, before = fn, (s.restore if restore else (lambda: None))
                rows = timeline(call, before, cuda)
                span = max((r["start_us"] + r["dur_us"] for r in rows), default=0.0)
                report["cases"].append({"backend": name, "B": B, "hit": h / 100.0, "mode": mode,
                                        "span_us": span, "kernels": rows})
                print(f"== {name} B={B} hit={h}% {mode}: span {span:.1f} us, {len(rows)} "
                      f"{'kernels' if cuda else 'ops'}", flush=True)
                for r in rows if cuda else []:  # the CPU's op list is long and says little
                    print(f"   {r['start_us']:8.1f} {r['dur_us']:8.1f}  {r['name'][:70]}", flush=True)
    if a.out:
        common.write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
