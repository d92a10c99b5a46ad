"""Does the way the host pool is allocated change scattered-gather throughput?

Staging reads missed rows straight from pinned host memory over UVA. Scattered over a
large pool, every row lands on a different host page, so the GPU's address
translation for system memory can become the bottleneck. This compares three pool
allocations of the same size, each read by the same ``copy_rows`` launch:

  register   torch.empty + cudaHostRegister (hisparse.device.PinnedBuffer today)
  thp        anonymous mmap + madvise(MADV_HUGEPAGE), touched, then cudaHostRegister
  hostalloc  cudaHostAlloc through CuPy (the driver allocates the pinned pages)

Baseline in the same run: a bulk pinned host->device copy of the same bytes.
Usage: python benchmarks/bench_pool_kinds.py [--pool-gib 32] [--out F.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import time

import numpy as np
import torch
import triton

from hisparse.cache.transfer import copy_rows


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {int(err)}")


def alloc(kind: str, nbytes: int):
    """(uint8 CPU tensor of nbytes, release callable, seconds)."""
    t0 = time.perf_counter()
    if kind == "register":
        t = torch.empty(nbytes, dtype=torch.uint8)
        t[:: 4096].zero_()  # fault pages in before registering, like the others
        _register(t)
        rel = lambda: torch.cuda.cudart().cudaHostUnregister(t.data_ptr())  # noqa: E731
    elif kind == "thp":
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        t[:: 4096].zero_()
        _register(t)

        def rel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    elif kind == "hostalloc":
        import cupy

        ptr = cupy.cuda.runtime.hostAlloc(nbytes, 0)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        t = torch.from_numpy(arr)
        rel = lambda: cupy.cuda.runtime.freeHost(ptr)  # noqa: E731
    else:
        raise ValueError(kind)
    return t, rel, time.perf_counter() - t0


def time_us(fn, reps: int = 20) -> dict:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return {"min": ts[0], "median": statistics.median(ts), "p99": ts[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=float, default=32.0)
    ap.add_argument("--rows", type=int, nargs="+", default=[16384, 131072])
    ap.add_argument("--kinds", nargs="+", default=["register", "thp", "hostalloc"])
    ap.add_argument("--out")
    a = ap.parse_args()
    W = 656
    nbytes = int(a.pool_gib * 2**30) // W * W
    H = nbytes // W
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError as e:
        thp = f"unreadable: {e}"
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "pool_bytes": nbytes, "thp": thp, "cases": []}
    print(f"pool {nbytes / 2**30:.1f} GiB, THP: {thp}")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    for kind in a.kinds:
        try:
            pool, rel, secs = alloc(kind, nbytes)
        except Exception as e:  # report and go on with the next kind
            print(f"{kind}: allocation failed: {e!r}")
            res["cases"].append({"kind": kind, "error": repr(e)})
            continue
        rows = pool.view(H, W)
        print(f"{kind}: allocated + pinned in {secs:.1f} s, is_pinned={pool.is_pinned()}")
        for n in a.rows:
            src = torch.randperm(H, generator=g)[:n].to(torch.int32).to(dev)
            dst = torch.arange(n, dtype=torch.int32, device=dev)
            hot = torch.empty((n, W), dtype=torch.uint8, device=dev)
            bulk_src = rows[:n]
            t_bulk = time_us(lambda: hot.copy_(bulk_src, non_blocking=True))
            # random order, then the same rows in ascending host order (as a resolve emits
            # them per request), then rows clustered in 64-row blocks (a request's misses
            # fall in its own blocks)
            blk = torch.randperm(H // 64, generator=g)[: n // 64].repeat_interleave(64) * 64
            clustered = (blk + torch.arange(64).repeat(n // 64)).to(torch.int32).to(dev)
            for order, s_idx in (("random", src), ("sorted", src.sort().values),
                                 ("blocks64", clustered)):
                t_copy = time_us(lambda: copy_rows(rows, s_idx, hot, dst))
                ok = torch.equal(hot[:64].cpu(), rows[s_idx[:64].long().cpu()])
                gbs = n * W / t_copy["median"] / 1e3
                ratio = t_bulk["median"] / t_copy["median"]
                print(f"  {kind:9s} {order:8s} N={n:7d}: copy_rows med {t_copy['median']:8.1f} us "
                      f"({gbs:5.1f} GB/s), bulk med {t_bulk['median']:8.1f} us, ratio {ratio:.2f}x, "
                      f"bytes ok={ok}")
                res["cases"].append({"kind": kind, "order": order, "rows": n, "alloc_s": secs,
                                     "copy_us": t_copy, "bulk_us": t_bulk, "ratio": ratio,
                                     "gbs": gbs, "ok": ok})
        del rows, pool
        torch.cuda.synchronize()
        rel()
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
