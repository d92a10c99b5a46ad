"""Host time of the engine façade's per-layer calls, outside any engine: a decode step
of R requests over L layers (``prepare_for_batch``, then per layer ``write_new_rows`` and
``convert_decode_logical_to_physical_topk``), timed with perf_counter (no syncs added),
then the same steps under cProfile to show where that time goes.

  python3 -m benchmarks.bench_host_calls [--requests 64] [--layers 8] [--context 4200] [--steps 20]
  python3 -m benchmarks.bench_host_calls --device cpu --kernels torch    # CPU: the torch paths
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks.common import percentile
from hisparse import HiSparseConfig
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=4200, help="rows per request before the steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    R, L, C, K = a.requests, a.layers, a.context, a.top_k
    dev = torch.device(a.device)
    cfg = HiSparseConfig(num_layers=L, row_bytes=656, top_k=K, device_buffer_size=2 * K,
                         max_num_reqs=R, host_pool_tokens=R * (C + a.steps + 64) + 64 * R,
                         host_block_size=64, device=a.device, max_request_id=max(1000, R))
    g = HiSparseIndexGroup(cfg, validate=False, kernels=a.kernels)
    for _ in range(L):
        g.register_layer(kv_cache_dtype="fp8_ds_mla")
    ids = list(range(R))
    for r in ids:
        g.add_request(r)
    md = SparseMLAMetadata.build(request_ids=ids, query_lens=[C] * R, seq_lens=[C] * R,
                                 num_decodes=0, device=dev)
    g.prepare_for_batch(md)
    fill = torch.randint(0, 120, (R * C, 656), dtype=torch.uint8, device=dev)
    for layer in range(L):
        g.write_new_rows(layer, fill, md)
    del fill
    gen = torch.Generator(device=dev).manual_seed(0)
    seq = C

    def step(times):
        nonlocal seq
        seq += 1
        md = SparseMLAMetadata.build(request_ids=ids, query_lens=[1] * R, seq_lens=[seq] * R,
                                     num_decodes=R, device=dev)
        g.prepare_for_batch(md)
        rows = torch.randint(0, 120, (R, 656), dtype=torch.uint8, device=dev, generator=gen)
        # 90% of the top-k in the last 4K positions (mostly hits), the rest anywhere
        recent = seq - 1 - torch.randint(0, min(seq, 2 * K), (R, K), device=dev, generator=gen)
        far = torch.randint(0, seq, (R, K), device=dev, generator=gen)
        pick = torch.rand((R, K), device=dev, generator=gen) < 0.9
        topk = torch.where(pick, recent, far).to(torch.int32)
        for layer in range(L):
            t0 = time.perf_counter()
            g.write_new_rows(layer, rows, md)
            t1 = time.perf_counter()
            g.convert_decode_logical_to_physical_topk(layer, topk, md)
            t2 = time.perf_counter()
            times["write_new_rows"].append(t1 - t0)
            times["convert"].append(t2 - t1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    warm = {"write_new_rows": [], "convert": []}
    for _ in range(3):
        step(warm)
    times = {"write_new_rows": [], "convert": []}
    for _ in range(a.steps):
        step(times)
    print(f"host time per call, {R} requests, {L} layers, context {C}, kernels {g.hisparse_cache.kernels}, "
          f"device {dev}:")
    for k, v in times.items():
        print(f"  {k:16s} min {min(v) * 1e6:7.1f} us  median {percentile(v, 50) * 1e6:7.1f} us  "
              f"p90 {percentile(v, 90) * 1e6:7.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step({"write_new_rows": [], "convert": []})
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
