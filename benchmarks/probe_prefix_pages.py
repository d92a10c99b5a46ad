"""Whether sharing a prefix's device pages pays: one decode layer in a CUDA graph
(``benchmarks.bench_layer``'s setup and periodic trace, Triton), B requests sharing the
first ``--shared`` of their ``--context`` tokens, prefix caching on and an elastic
device pool with room for request 0's pages plus every other request's own pages
(``bench_layer.Setup(pool=True)``), in two kinds alternating per repetition:

- ``pages``: ``share_prefix_pages=True``: the sharers join resident on request 0's
  prefix pages (no misses; one device copy of the prefix);
- ``host``: ``share_prefix_pages=False``: the sharers join hot (their prefix on the
  host only: misses at the trace's hit rate), as before the pages were shared.

Same pool size, same rows, same top-k trace; resident attention over a private copy of
the rows is the baseline measured in the same case. Prints one row per case (medians,
us) and writes ``--out`` JSON (the environment, every case, the pool's resident
requests and shared pages).

  python -m benchmarks.probe_prefix_pages [--batch 16 64] [--hits 95 90] [--reps-outer 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import bench_layer as BL
from benchmarks import common


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pos = common.positive_int
    ap.add_argument("--batch", type=pos, nargs="+", default=[16, 64])
    ap.add_argument("--hits", type=pos, nargs="+", default=[95, 90], help="hot requests' hit rates, percent")
    ap.add_argument("--context", type=pos, default=32768)
    ap.add_argument("--shared", type=pos, default=16384, help="tokens every request shares with request 0")
    ap.add_argument("--reps-outer", type=pos, default=2)
    ap.add_argument("--reps", type=pos, default=40)
    ap.add_argument("--out", default=None)
    o = ap.parse_args(argv)
    if not common.out_ok(o.out, "probe_prefix_pages"):
        return 2
    if not torch.cuda.is_available():
        print("probe_prefix_pages: needs CUDA", file=sys.stderr)
        return 2
    if o.shared >= o.context:
        print(f"probe_prefix_pages: --shared {o.shared} must be below --context {o.context}", file=sys.stderr)
        return 2
    a = BL.parse_args(["--trace", "periodic", "--backends", "triton", "--context", str(o.context),
                       "--reps", str(o.reps)])
    dev = torch.device("cuda")
    be, _ = BL.make_backend("triton", a, dev, a.heads)
    rows = []
    env = common.environment(dev)
    print(f"{'rep':>3s} {'B':>4s} {'kind':6s} {'hit':>4s} {'resident us':>12s} {'serial us':>10s} {'x':>6s} "
          f"{'split us':>9s} {'x':>6s} {'miss rate':>9s} {'resident reqs':>13s} {'shared pages':>12s}", flush=True)
    for rep in range(o.reps_outer):
        for B in o.batch:
            for kind in ("pages", "host"):
                s = BL.Setup(B, o.context, a, dev, shared=o.shared, pool=True, share_pages=kind == "pages")
                tot = s.cache.stats()["total"]
                for h in o.hits:
                    r = BL.bench_case_periodic(s, be, h / 100, a)
                    row = {"rep": rep, "B": B, "kind": kind, "hit": h, "cached_tokens": s.cached,
                           "resident_requests": tot["resident_requests"], "pool_pages_shared": tot["pool_pages_shared"],
                           "pool_rows_total": tot["pool_rows_total"], "miss_rate": r["serial"]["measured_miss_rate"] or 0.0,  # None: nothing looked up (all resident)
                           "max_rel_diff": r["max_rel_diff"],
                           **{m: r[m]["median_us"] for m in ("resident", "serial", "split", "staging_alone")},
                           **{f"{m}_ratio": r[m]["ratio_vs_resident"] for m in ("serial", "split")},
                           "detail": {m: r[m] for m in ("resident", "serial", "split", "staging_alone")}}
                    rows.append(row)
                    print(f"{rep:3d} {B:4d} {kind:6s} {h:4d} {row['resident']:12.1f} {row['serial']:10.1f} "
                          f"{row['serial_ratio']:6.3f} {row['split']:9.1f} {row['split_ratio']:6.3f} "
                          f"{row['miss_rate']:9.4f} {row['resident_requests']:13d} {row['pool_pages_shared']:12d}",
                          flush=True)
                del s
                torch.cuda.empty_cache()
        if o.out:  # after every repetition: a run cut short keeps what it measured
            common.write_json(o.out, {"benchmark": "probe_prefix_pages", "env": env, "args": vars(o), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
