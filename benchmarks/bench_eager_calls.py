"""Host time of hisparse's eager per-layer decode calls, as an engine that runs attention
outside CUDA graphs pays it: B requests (K-entry top-k, one decode token each) over
one layer, each call timed with perf_counter around it and the GPU queue drained
between samples (so the call never waits for the GPU). Calls:

- ``attention``: ``TritonBackend(validate=False).decode`` over the hot rows;
  ``attention_out``: the same writing into buffers given once (``out=``, ``lse=``), as an
  engine's attention layer hands its backend the layer's output;
- ``resolve``: ``cache.resolve(validate=False)``; ``resolve_checked``: ``cache.resolve()``;
- ``layer_serial`` / ``layer_split`` / ``layer_auto``: ``DecodeLayer(..., overlap=...)`` (resolve +
  attention; auto: the mode it measured faster, ``decode.auto``);
- ``layer_*_graphs``: the same with ``graphs=True`` (a graph of the whole layer replayed
  per call), given the same tensors every call (read in place), and ``..._copied`` given
  a ring of six (copied into the graph's static inputs every call).

Then the GPU time of each call (CUDA events around it, enqueued behind a ~1 ms sleep
kernel so that the host's enqueueing does not show).

Each call runs with compiled kernels launched directly (``hisparse.kernels.fast_launch``)
and through Triton's JIT (``set_direct_launch(False)``), the two alternating sample by
sample in one process; prints min / median / p99 per call and path, the ratio of the
medians, and writes ``--out`` JSON with the environment. Run from a checkout of a tree
without the direct path, it measures the JIT column alone (``python -m`` imports the
hisparse of the current directory first, whatever PYTHONPATH says).

  python3 -m benchmarks.bench_eager_calls [--batch 64] [--top-k 2048] [--samples 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch

from benchmarks import common


CALLS = ("attention", "attention_out", "resolve", "resolve_checked", "layer_serial", "layer_split", "layer_auto", "layer_serial_graphs",
         "layer_serial_graphs_copied", "layer_split_graphs", "layer_split_graphs_copied", "layer_auto_graphs",
         "layer_auto_graphs_copied")


def _setup(B: int, K: int, context: int, dev: torch.device):
    from hisparse import HiSparseCache, HiSparseConfig
    from hisparse.formats import quantize_fp8_ds_mla
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=B * (-(-context // 64) * 64), row_bytes=656, top_k=K,
                         device_buffer_size=2 * K, max_num_reqs=B, max_query_len=1, host_block_size=64,
                         max_request_id=2 * B, device=str(dev))
    cache = HiSparseCache(cfg, kernels="triton")
    g = torch.Generator(device=dev).manual_seed(1)
    for r in range(B):
        cache.add_request(r)
        x = (torch.randn((context, 576), device=dev, generator=g) * 0.5).to(torch.bfloat16)
        cache.write(0, r, quantize_fp8_ds_mla(x))
    req = torch.arange(B, dtype=torch.int32, device=dev)
    topk = torch.stack([torch.randperm(context, device=dev, generator=g)[:K] for _ in range(B)]).to(torch.int32)
    q = (torch.randn((B, 128, 576), device=dev, generator=g) * 0.3).to(torch.bfloat16)
    return cache, req, topk, q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pos = common.positive_int
    ap.add_argument("--batch", type=pos, default=64, help="decode requests [%(default)s]")
    ap.add_argument("--top-k", type=pos, default=2048, help="[%(default)s]")
    ap.add_argument("--context", type=pos, default=4200, help="rows per request [%(default)s]")
    ap.add_argument("--samples", type=pos, default=300, help="timed calls per call and path [%(default)s]")
    ap.add_argument("--calls", nargs="+", default=None, metavar="CALL", choices=CALLS,
                    help="measure only these calls, in this order (names as printed; default: all). "
                         "Each call waits for nothing but the GPU work queued before it, so the order "
                         "decides which earlier call's events and streams a call may find pending")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    o = ap.parse_args(argv)
    if not common.out_ok(o.out, "bench_eager_calls"):
        return 2
    if not torch.cuda.is_available():
        print("bench_eager_calls: needs CUDA (host time of GPU launches)", file=sys.stderr)
        return 2
    if o.top_k > o.context:
        print(f"bench_eager_calls: --top-k {o.top_k} needs --context >= it", file=sys.stderr)
        return 2
    import hisparse.kernels as hk
    from hisparse.attention import TritonBackend
    from hisparse.decode import DecodeLayer
    # an older tree (the baseline) has no direct path: only the JIT column is measured
    problem = getattr(hk, "fast_launch_problem", None) if "fast_launch_problem" in getattr(hk, "__all__", ()) else None
    dev = torch.device("cuda")
    cache, req, topk, q = _setup(o.batch, o.top_k, o.context, dev)
    be = TritonBackend(validate=False)
    serial = DecodeLayer(cache, be, overlap="serial")
    split = DecodeLayer(cache, be, overlap="split")
    scale = 576 ** -0.5
    res = cache.resolve(0, req, topk, validate=False)
    hot = cache.layer_view(0).hot_rows
    phys = res.physical.clone()
    out, lse = be.decode(q, hot, phys, sm_scale=scale, row_format="fp8_ds_mla")
    calls = {
        "attention": lambda: be.decode(q, hot, phys, sm_scale=scale, row_format="fp8_ds_mla"),
        "resolve": lambda: cache.resolve(0, req, topk, validate=False),
        "resolve_checked": lambda: cache.resolve(0, req, topk),
        "layer_serial": lambda: serial(0, req, topk, q, sm_scale=scale),
        "layer_split": lambda: split(0, req, topk, q, sm_scale=scale),
    }
    if "out" in inspect.signature(be.decode).parameters:  # given outputs (a tree without them measures the rest)
        calls["attention_out"] = lambda: be.decode(q, hot, phys, sm_scale=scale, row_format="fp8_ds_mla",
                                                   out=out, lse=lse)
    auto = None
    try:  # the auto mode (a tree without it measures the rest)
        auto = DecodeLayer(cache, be, overlap="auto")
        calls["layer_auto"] = lambda: auto(0, req, topk, q, sm_scale=scale)
    except ValueError:
        pass
    try:  # whole layers as graphs replayed from the eager call (a tree without them measures the rest)
        graphed = {m: DecodeLayer(cache, be, overlap=m, graphs=True) for m in ("serial", "split")}
    except TypeError:
        graphed = {}
    try:
        if graphed:
            graphed["auto"] = DecodeLayer(cache, be, overlap="auto", graphs=True)
    except ValueError:
        pass
    # inputs: the same tensors every call (read in place once their addresses recur), or
    # a ring of more tensors than the graphs remember (copied into the static buffers each call)
    ring = [(topk.clone(), q.clone()) for _ in range(6)]
    turn = [0]

    def copied(layer):
        turn[0] += 1
        tk, qq = ring[turn[0] % len(ring)]
        return layer(0, req, tk, qq, sm_scale=scale)

    for m, layer in graphed.items():
        calls[f"layer_{m}_graphs"] = lambda layer=layer: layer(0, req, topk, q, sm_scale=scale)
        calls[f"layer_{m}_graphs_copied"] = lambda layer=layer: copied(layer)
    if o.calls is not None:
        missing = [c for c in o.calls if c not in calls]
        if missing:
            print(f"bench_eager_calls: this hisparse has no {', '.join(missing)}", file=sys.stderr)
            return 2
        calls = {c: calls[c] for c in dict.fromkeys(o.calls)}
    why_not = "this hisparse has no direct launch" if problem is None else problem()
    paths = ["direct", "jit"] if why_not is None else ["jit"]
    samples = {c: {p: [] for p in paths} for c in calls}
    for name, fn in calls.items():  # warm-up: compile, then fill the direct path's cache
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    print(f"bench_eager_calls: B={o.batch} K={o.top_k} context={o.context}, {o.samples} samples per call and path"
          + ("" if why_not is None else f"; direct launch off: {why_not}"), flush=True)
    for i in range(o.samples):
        for name, fn in calls.items():
            for p in (paths if i % 2 == 0 else paths[::-1]):
                if problem is not None:
                    hk.set_direct_launch(p == "direct")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                samples[name][p].append((t1 - t0) * 1e6)
    if problem is not None:
        hk.set_direct_launch(True)
    torch.cuda.synchronize()
    gpu = {c: [] for c in calls}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for i in range(min(o.samples, 100)):
        for name, fn in calls.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)  # ~1 ms: the call is enqueued before the GPU reaches it
            ev[0].record()
            fn()
            ev[1].record()
            torch.cuda.synchronize()
            gpu[name].append(ev[0].elapsed_time(ev[1]) * 1e3)
    rows = {}
    print(f"{'call':26s} " + " ".join(f"{p + ' min/med/p99 us':>26s}" for p in paths) + ("   direct/jit" if len(paths) > 1 else "")
          + "   GPU us (median)")
    for name in calls:
        st = {p: common.stats(samples[name][p], unit="_us") for p in paths}
        rows[name] = st
        line = f"{name:26s} " + " ".join(f"{s['min_us']:8.1f} {s['median_us']:8.1f} {s['p99_us']:8.1f}" for s in st.values())
        if len(paths) > 1:
            r = st["direct"]["median_us"] / st["jit"]["median_us"]
            rows[name]["ratio_direct_jit"] = r
            line += f"   {r:10.3f}"
        rows[name]["gpu"] = common.stats(gpu[name], unit="_us")
        line += f"   GPU {rows[name]['gpu']['median_us']:7.1f}"
        print(line)
    counts = None
    if problem is not None:
        counts = hk.direct_launch_counts()
        print("launches direct / through the JIT per kernel: "
              + ", ".join(f"{k} {v['direct']}/{v['jit']}" for k, v in counts.items()))
    autos = {n: lay.auto_report() for n, lay in (("layer_auto", auto), ("layer_auto_graphs", graphed.get("auto")))
             if lay is not None}
    if autos:
        print("auto: " + "; ".join(f"{n} {r}" for n, r in autos.items()))
    graph_counts = {m: layer.graphs.report() for m, layer in graphed.items()}
    if graph_counts:
        print("layer graphs: " + "; ".join(f"{m} {r}" for m, r in graph_counts.items()))
    if o.out:
        common.write_json(o.out, {"environment": common.environment(dev), "args": vars(o), "paths": paths,
                                  "direct_off_reason": why_not, "calls": rows, "launch_counts": counts,
                                  "layer_graphs": graph_counts, "auto": autos})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
