"""Host time of ``HiSparseIndexGroup.prepare_for_batch`` alone: a decode step of R
requests over L layers (default 64 x 61, a full-size model's sparse-MLA layers), on tiny
rows and contexts so that memory stays small and the host work is all there is to time.

Each step builds the metadata (untimed), times ``prepare_for_batch`` with perf_counter,
then writes every layer's rows (untimed, so that the next step finds every layer
written, as an engine's forward leaves it). Two modes run their steps in turn, one step
of each after the other, so that a drift in the host's speed reaches both alike:
``eager`` (no padding) and ``padded`` (``pad_to`` = the bucket, as a graph-capturing
engine prepares). Every ``--recycle`` steps the requests are freed and admitted again
with a fresh prefill (untimed), which keeps the contexts short; with
``--device-pool-rows`` (the elastic tier) a step that outgrows the pool demotes
requests, as it would in an engine. Prints min / median / p99 per mode and the ratio of
the padded median to the eager one, measured in the same run; ``--profile`` then runs
each mode's ``prepare_for_batch`` calls under cProfile and lists where the time goes.

  python3 -m benchmarks.bench_prepare [--requests 64] [--layers 61] [--steps 200] [--out r.json]
  python3 -m benchmarks.bench_prepare --device-pool-rows 4096     # the elastic tier, with demotions
  python3 -m benchmarks.bench_prepare --profile                   # where the time goes
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks import common
from hisparse import CapacityError, HiSparseConfig
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse_tools.exit_codes import MissingDependency
from hisparse_tools.preflight import parse_device, require_kernels

ROW_BYTES = 656  # fp8_ds_mla rows


def make_case(a: argparse.Namespace, dev: torch.device, pad_to: int | None):
    """A group of ``a.requests`` live requests over ``a.layers`` layers, and
    ``step(times)``: one decode step whose ``prepare_for_batch`` host time is appended
    to ``times`` (the rest of the step untimed)."""
    R, L, C = a.requests, a.layers, a.context
    grow = a.recycle + 1  # rows a request gains before it is recycled
    cfg = HiSparseConfig(num_layers=L, row_bytes=ROW_BYTES, top_k=a.top_k, device_buffer_size=2 * a.top_k,
                         max_num_reqs=max(R, pad_to or R), host_pool_tokens=R * (C + grow + 2 * 16),
                         host_block_size=16, device=str(dev), max_request_id=1 << 20,
                         device_pool_rows=a.device_pool_rows)
    g = HiSparseIndexGroup(cfg, validate=False, kernels=a.kernels)
    for _ in range(L):
        g.register_layer(kv_cache_dtype="fp8_ds_mla")
    state = {"ids": [], "seq": 0, "next": 0, "age": 0}

    def admit() -> None:
        """Free the live requests and admit R new ones with ``C`` rows in every layer."""
        for rid in state["ids"]:
            g.free_request(rid)
        ids = list(range(state["next"], state["next"] + R))
        state["next"] += R
        for rid in ids:
            g.add_request(rid)
        md = SparseMLAMetadata.build(request_ids=ids, query_lens=[C] * R, seq_lens=[C] * R,
                                     num_decodes=0, device=dev)
        g.prepare_for_batch(md)
        fill = torch.zeros((R * C, ROW_BYTES), dtype=torch.uint8, device=dev)
        for layer in range(L):
            g.write_new_rows(layer, fill, md)
        state.update(ids=ids, seq=C, age=0)

    admit()
    T = pad_to or R
    rows = torch.zeros((T, ROW_BYTES), dtype=torch.uint8, device=dev)

    def step(times: list[float], prof: cProfile.Profile | None = None) -> None:
        if state["age"] == a.recycle:
            admit()
        state["seq"] += 1
        state["age"] += 1
        md = SparseMLAMetadata.build(request_ids=state["ids"], query_lens=[1] * R, seq_lens=[state["seq"]] * R,
                                     num_decodes=R, device=dev)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        g.prepare_for_batch(md, pad_to=pad_to)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
        for layer in range(L):
            g.write_new_rows(layer, rows, md)

    return g, step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pos = common.positive_int
    ap.add_argument("--requests", type=pos, default=64, help="decode requests per step [%(default)s]")
    ap.add_argument("--layers", type=pos, default=61, help="[%(default)s]")
    ap.add_argument("--context", type=pos, default=24, help="rows per request when admitted [%(default)s]")
    ap.add_argument("--steps", type=pos, default=200, help="timed decode steps per mode [%(default)s]")
    ap.add_argument("--warmup", type=pos, default=5, help="untimed steps per mode first [%(default)s]")
    ap.add_argument("--recycle", type=pos, default=40,
                    help="steps after which the requests are freed and admitted again [%(default)s]")
    ap.add_argument("--top-k", type=pos, default=8, help="(hot buffer: 2 x top-k slots) [%(default)s]")
    ap.add_argument("--device-pool-rows", type=pos, default=None,
                    help="the elastic device pool's rows per layer [none]")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N [%(default)s]")
    ap.add_argument("--kernels", default="torch", choices=["auto", "torch", "triton"], help="[%(default)s]")
    ap.add_argument("--profile", action="store_true", help="then profile each mode's steps (cProfile)")
    ap.add_argument("--top", type=pos, default=25, help="functions listed per profile [%(default)s]")
    ap.add_argument("--out", help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if not common.out_ok(a.out, "bench_prepare"):
        return 2
    modes = {"eager": None, "padded": a.requests}
    try:
        dev = parse_device(a.device)
        require_kernels(a.kernels, dev)
        cases = {name: make_case(a, dev, pad) for name, pad in modes.items()}
    except (ValueError, TypeError, CapacityError, MissingDependency) as e:
        print(f"bench_prepare: {e}", file=sys.stderr)
        return 2
    for _, step in cases.values():
        for _ in range(a.warmup):
            step([])
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(a.steps):
        for name, (_, step) in cases.items():
            step(times[name])
    R, L = a.requests, a.layers
    print(f"prepare_for_batch host time, {R} decode requests, {L} layers, kernels "
          f"{cases['eager'][0].hisparse_cache.kernels}, device {dev}, device_pool_rows {a.device_pool_rows}, "
          f"{a.steps} steps per mode, interleaved:")
    print(f"  {'mode':8s} {'min us':>9s} {'median us':>10s} {'p99 us':>9s} {'x eager':>8s}")
    result = {"benchmark": "prepare", "env": common.environment(dev),
              "options": {k: getattr(a, k) for k in ("requests", "layers", "context", "steps", "recycle",
                                                    "top_k", "device_pool_rows", "kernels")},
              "modes": {}}
    base = None
    for name in modes:
        st = common.stats([t * 1e6 for t in times[name]])  # us
        base = base if base is not None else st["median"]
        result["modes"][name] = {"pad_to": modes[name], "us": st, "x_eager": st["median"] / base,
                                 "spills": cases[name][0].stats()["total"]["spills"]}
        print(f"  {name:8s} {st['min']:9.1f} {st['median']:10.1f} {st['p99']:9.1f} {st['median'] / base:8.3f}")
    print("  the 200 us target: " + ", ".join(
        f"{n} {'met' if d['us']['median'] <= 200 else 'not met'}" for n, d in result["modes"].items()))
    if a.out:
        common.write_json(a.out, result)
    if a.profile:
        for name, (_, step) in cases.items():
            prof = cProfile.Profile()
            for _ in range(a.steps):
                step([], prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            print(f"\n---- {name}: prepare_for_batch")
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
