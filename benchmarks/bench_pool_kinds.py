"""Does the way the host pool is allocated change scattered-gather throughput?

Staging reads missed rows straight from pinned host memory over UVA. Scattered over a
large pool, every row lands on a different host page, so the GPU's address
translation for system memory can become the bottleneck. This compares pool
allocations of the same size, each read by the same row-copy launch (``copy_rows_unchecked``:
``copy_rows`` without its checks, whose pinning check knows only page-locked ranges, not the
pools the driver maps for the GPU itself, vmm_host and managed):

  register   torch.empty + cudaHostRegister (what hisparse.device.PinnedBuffer does)
  thp        anonymous mmap + madvise(MADV_HUGEPAGE), touched, then cudaHostRegister
  hostalloc  cudaHostAlloc through CuPy (the driver allocates the pinned pages)
  hugetlb2m  MAP_HUGETLB mapping of 2 MiB hugetlbfs pages, then cudaHostRegister
  hugetlb1g  the same with 1 GiB pages (MAP_HUGE_1GB)
  vmm_host   driver virtual-memory API: cuMemCreate on host NUMA node 0 (2 MiB+
             granularity), mapped with cuMemMap, access granted to the GPU and the CPU
  managed    cudaMallocManaged, preferred location CPU, accessed-by the GPU (mapped,
             never migrated)

The hugetlb kinds need reserved huge pages: the script raises
/proc/sys/vm/nr_hugepages (or the 1 GiB pool's nr_hugepages) when it may (root) and
puts the old value back afterwards. For thp it reports how much of the pool the
kernel really backed with huge pages (AnonHugePages of /proc/self/smaps_rollup).

Baseline in the same run: a bulk pinned host->device copy of the same bytes.
Usage: python -m benchmarks.bench_pool_kinds [--pool-gib 32] [--out F.json]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time

import numpy as np
import torch

from benchmarks import common
from hisparse.cache import copy_rows_unchecked


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {int(err)}")


MAP_HUGETLB = 0x40000  # linux/mman.h (x86_64 and arm64)
MAP_HUGE_SHIFT = 26
KINDS = ("register", "thp", "hostalloc", "hugetlb2m", "hugetlb1g", "vmm_host", "managed")
HUGE = {"hugetlb2m": (2 << 20, "/proc/sys/vm/nr_hugepages", 21),
        "hugetlb1g": (1 << 30, "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages", 30)}


def _meminfo(key: str) -> str:
    for line in open("/proc/meminfo"):
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return "?"


def _smaps_kb(key: str) -> int:
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def reserve_huge(kind: str, nbytes: int) -> tuple[str, int, int]:
    """Make sure enough huge pages of ``kind`` are reserved; (sysctl path, old, now)."""
    page, path, _ = HUGE[kind]
    need = -(-nbytes // page)
    old = int(open(path).read())
    free_path = path.replace("nr_hugepages", "free_hugepages") if "hugepages-" in path else None
    free = int(open(free_path).read()) if free_path else int(_meminfo("HugePages_Free").split()[0])
    if free < need:
        try:
            with open(path, "w") as f:
                f.write(str(old + need - free))
        except OSError as e:
            raise RuntimeError(f"need {need} free huge pages of {page >> 20} MiB, {free} free, "
                               f"and cannot raise {path}: {e}") from e
    now = int(open(path).read())
    return path, old, now


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


def _vmm_host(nbytes: int):
    """(ptr, size, release) of host memory from cuMemCreate(HOST_NUMA 0), GPU+CPU RW."""
    cu = ctypes.CDLL("libcuda.so.1")

    def ck(name, *args):
        rc = getattr(cu, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    dev = torch.cuda.current_device()
    prop = _AllocProp(type=1, requestedHandleTypes=0, location=_Loc(3, 0))  # PINNED, HOST_NUMA 0
    gran = ctypes.c_size_t()
    ck("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 1)  # RECOMMENDED
    size = -(-nbytes // gran.value) * gran.value
    handle = ctypes.c_ulonglong()
    ck("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    ptr = ctypes.c_ulonglong()
    ck("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(1 << 30),
       ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    ck("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    desc = (_AccessDesc * 2)(_AccessDesc(_Loc(1, dev), 3), _AccessDesc(_Loc(3, 0), 3))  # RW
    ck("cuMemSetAccess", ptr, ctypes.c_size_t(size), desc, ctypes.c_size_t(2))

    def rel():
        cu.cuMemUnmap(ptr, ctypes.c_size_t(size))
        cu.cuMemRelease(handle)
        cu.cuMemAddressFree(ptr, ctypes.c_size_t(size))
    return ptr.value, size, gran.value, rel


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
    elif kind in HUGE:
        page, path, log2 = HUGE[kind]
        path, old, now = reserve_huge(kind, nbytes)
        size = -(-nbytes // page) * page
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | (log2 << MAP_HUGE_SHIFT)
        try:
            mm = mmap.mmap(-1, size, flags=flags)
        except OSError as e:
            with open(path, "w") as f:
                f.write(str(old))
            raise RuntimeError(f"MAP_HUGETLB mmap of {size} bytes failed ({e}); reserved {now} "
                               f"pages in {path}") from e
        t = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
        t[:: 4096].zero_()
        _register(t)

        def rel():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            try:
                with open(path, "w") as f:
                    f.write(str(old))
            except OSError:
                pass
    elif kind == "vmm_host":
        ptr, size, gran, vrel = _vmm_host(nbytes)
        print(f"vmm_host: granularity {gran} bytes")
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        t = torch.from_numpy(arr)
        t[:: 4096].zero_()  # the CPU can write it (access granted to host NUMA 0)
        rel = vrel
    elif kind == "managed":
        import cupy  # optional: only these two kinds need it

        ptr = cupy.cuda.runtime.mallocManaged(nbytes, 1)  # cudaMemAttachGlobal
        cupy.cuda.runtime.memAdvise(ptr, nbytes, 3, -1)  # SetPreferredLocation = CPU
        cupy.cuda.runtime.memAdvise(ptr, nbytes, 5, torch.cuda.current_device())  # SetAccessedBy
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        t = torch.from_numpy(arr)
        t[:: 4096].zero_()

        def rel():
            cupy.cuda.runtime.free(ptr)
    elif kind == "hostalloc":
        import cupy  # optional, see above

        ptr = cupy.cuda.runtime.hostAlloc(nbytes, 0)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        t = torch.from_numpy(arr)
        rel = lambda: cupy.cuda.runtime.freeHost(ptr)  # noqa: E731
    else:
        raise ValueError(kind)
    return t, rel, time.perf_counter() - t0


def time_us(fn, reps: int = 20) -> dict:
    """min / median / p99 microseconds of ``reps`` event-timed calls after one warm-up."""
    return common.stats(common.time_calls(fn, reps=reps, warmup=1, cuda=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=common.positive_float, default=32.0, help="pool size [32]")
    ap.add_argument("--rows", type=common.positive_int, nargs="+", default=[16384, 131072],
                    help="rows per gather, multiples of 64 (the blocks64 order reads whole 64-row blocks)")
    ap.add_argument("--kinds", nargs="+", default=["register", "thp", "hostalloc"], choices=KINDS)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    W = 656
    nbytes = int(a.pool_gib * 2**30) // W * W
    H = nbytes // W
    bad = [n for n in a.rows if n % 64 or n > H // 64 * 64]
    if bad:
        ap.error(f"--rows {bad}: each must be a multiple of 64 and at most the pool's {H // 64 * 64} rows "
                 f"(--pool-gib {a.pool_gib:g} of {W}-byte rows)")
    if not common.out_ok(a.out, "bench_pool_kinds"):
        return 2
    if not torch.cuda.is_available():
        print("bench_pool_kinds: no CUDA device; it times GPU gathers from host memory", file=sys.stderr)
        return 2
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError as e:
        thp = f"unreadable: {e}"
    env = common.environment()
    res = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"], "env": env,
           "pool_bytes": nbytes, "thp": thp, "cases": []}
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
        huge = {"anon_huge_kb": _smaps_kb("AnonHugePages"),
                "hugetlb_total": _meminfo("HugePages_Total"), "hugetlb_free": _meminfo("HugePages_Free")}
        print(f"{kind}: allocated + pinned in {secs:.1f} s, is_pinned={pool.is_pinned()}, "
              f"AnonHugePages {huge['anon_huge_kb'] / 2**20:.1f} GiB, hugetlb total/free "
              f"{huge['hugetlb_total']}/{huge['hugetlb_free']}")
        res["cases"].append({"kind": kind, "huge_pages": huge})
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
                t_copy = time_us(lambda: copy_rows_unchecked(rows, s_idx, hot, dst, hot.device))
                ok = torch.equal(hot[:64].cpu(), rows[s_idx[:64].long().cpu()])
                gbs = n * W / t_copy["median"] / 1e3
                ratio = t_bulk["median"] / t_copy["median"]
                print(f"  {kind:9s} {order:8s} N={n:7d}: copy_rows med {t_copy['median']:8.1f} us "
                      f"({gbs:5.1f} GB/s), bulk med {t_bulk['median']:8.1f} us, ratio {ratio:.2f}x, "
                      f"bytes ok={ok}")
                res["cases"].append({"kind": kind, "order": order, "rows": n, "alloc_s": secs,
                                     "copy_us": t_copy, "bulk_us": t_bulk, "ratio": ratio,
                                     "gbs": gbs, "ok": ok})
        rows = pool = None
        torch.cuda.synchronize()
        rel()
    if a.out:
        common.write_json(a.out, res)
    if all("error" in c for c in res["cases"]):
        print(f"bench_pool_kinds: nothing measured: no pool of {nbytes / 2**30:.1f} GiB could be "
              f"allocated as {' / '.join(a.kinds)} (errors above); try a smaller --pool-gib or "
              "other --kinds", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
