"""Host cost of a prefix lookup (``hisparse.cache.prefix_index``): naming the blocks of
a request's token ids and finding its cached prefix, the host work an
``add_request(token_ids=...)`` with a full prefix hit does before it maps the blocks.

Per token count: an index holding every block of one request's tokens; the timed call
names the blocks of the same tokens (chained blake2b, 64-token blocks), looks them up,
references them and lets them go. Prints min / median / p99 us per call (perf_counter,
this host's CPU) and writes ``--out`` JSON.

  python -m benchmarks.bench_prefix [--tokens 8192 32768 131072] [--block 64] [--reps 50]
      [--algo sha256 xxh3_128] [--numpy] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import sys

from benchmarks import common
import numpy as np

from hisparse.cache.prefix_index import HASHES, PrefixIndex, block_names


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=common.positive_int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--block", type=common.positive_int, default=64, help="tokens per host block")
    ap.add_argument("--reps", type=common.positive_int, default=50)
    ap.add_argument("--algo", nargs="+", choices=HASHES, default=["sha256"], help="block-name hashes to time")
    ap.add_argument("--numpy", action="store_true", help="token ids as a numpy int64 array (else a list)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "bench_prefix"):
        return 2
    report = {"benchmark": "bench_prefix", "env": common.environment("cpu"), "args": vars(a), "cases": []}
    print(f"{'algo':>9s} {'tokens':>8s} {'blocks':>7s} {'min us':>9s} {'median us':>10s} {'p99 us':>9s}  "
          f"(names + lookup + refs; token ids as {'numpy' if a.numpy else 'a list'})")
    rng = random.Random(0)
    for algo in a.algo:
        for n in a.tokens:
            toks = [rng.randrange(1 << 17) for _ in range(n)]
            if a.numpy:
                toks = np.array(toks, dtype=np.int64)
            ix = PrefixIndex()
            for i, name in enumerate(block_names(toks, a.block, algo=algo)):
                ix.publish(name, i, referenced=False)

            def call(toks=toks, ix=ix, algo=algo) -> None:
                names = block_names(toks, a.block, algo=algo)
                hit = ix.lookup(names)
                ix.acquire(hit, queried=len(names))
                ix.release(hit)

            st = common.stats(common.time_calls(call, reps=a.reps, warmup=3, cuda=False), unit="_us")
            assert ix.hit_blocks == ix.query_blocks == (a.reps + 3) * (n // a.block)  # every call a full hit
            report["cases"].append({"algo": algo, "tokens": n, "blocks": n // a.block, **st})
            print(f"{algo:>9s} {n:8d} {n // a.block:7d} {st['min_us']:9.1f} {st['median_us']:10.1f} "
                  f"{st['p99_us']:9.1f}", flush=True)
    if a.out:
        common.write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
