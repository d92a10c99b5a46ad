"""What prefix caching costs one decode layer in a CUDA graph (``benchmarks.bench_layer``'s
setup, periodic trace, Triton): prefix caching off ("off"), on with nothing shared ("on":
alias ids exist, so the resolve writes each miss's host row through ``host_block``) and on
with the requests sharing half their context ("shared": their misses read the shared
blocks through alias ids), at B = 16 and 64, 95% and 90% hits, the three alternating per
repetition. Prints one row per case (medians, us) and writes ``--out`` JSON.

  python -m benchmarks.probe_prefix_layer [--reps-outer 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks import bench_layer as BL
from benchmarks import common


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps-outer", type=int, default=2)
    ap.add_argument("--out", default=None)
    o = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_prefix_layer: needs CUDA", file=sys.stderr)
        return 2
    a = BL.parse_args(["--trace", "periodic", "--batch", "16", "--hits", "95", "90", "--backends", "triton",
                       "--context", "32768", "--reps", "40"])
    dev = torch.device("cuda")
    be, _ = BL.make_backend("triton", a, dev, a.heads)
    rows = []
    env = common.environment()
    for rep in range(o.reps_outer):
        for B in (16, 64):
            for kind, shared in (("off", 0), ("on", -1), ("shared", 16384)):
                s = BL.Setup(B, 32768, a, dev, shared=shared)
                for h in (0.95, 0.90):
                    r = BL.bench_case_periodic(s, be, h, a)
                    row = {"rep": rep, "B": B, "kind": kind, "hit": h,
                           **{m: r[m]["median_us"] for m in ("resident", "serial", "split", "staging_alone")}}
                    rows.append(row)
                    print(row, flush=True)
                del s
                torch.cuda.empty_cache()
        if o.out:  # after every repetition: a run cut short keeps what it measured
            with open(o.out, "w") as f:
                json.dump({"benchmark": "probe_prefix_layer", **env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
