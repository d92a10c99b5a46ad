"""Why staging misses from pinned host memory costs more when requests share host rows.

With prefix caching the requests' misses read the shared prefix's host rows (a small
region of the pool, some rows several times in one launch); without it every request
reads its own rows, spread over the pool. The first case stages 2-5% slower. This
probe times one row-copy launch (``hisparse.cache.copy_rows``, and the
cache's own staging launcher ``copy_staged``: a quarter of the SMs, 8 rows per
iteration, 64 groups) of N = 13,120 fp8_ds_mla rows (656 bytes: 64 requests x 205
misses) from a 2M-row (1.37 GB) pinned host pool into distinct random rows of a
64 x 4097-row device buffer, for source-row patterns that separate

  H1  several reads of the same host row in one launch cost more than distinct rows
      (dup2 / dup8 vs spread; dup8_far: the duplicates apart in the list);
  H2  reads concentrated in a small region (16,384 rows, 10.7 MB) cost more than reads
      spread over the pool (region, region_far, mixed43, mixed43_far vs spread), e.g.
      through DRAM banks, the IOMMU or the NUMA node of those pages;
  H3  neither: then the list order matters (spread_sorted vs spread).

Patterns (each drawn fresh per repetition from a fixed seed; list order random unless
said; the destination list is one fresh random list per repetition, shared by all):
  spread         N distinct rows over the whole pool
  spread_sorted  the same kind of draw, sorted by host row
  region         N distinct rows of the first 16,384 rows
  region_far     N distinct rows of a random 16,384-row region elsewhere
  mixed43        43% distinct from the first 16,384 rows, 57% distinct over the rest
  mixed43_far    as mixed43, the 43% from a random 16,384-row region elsewhere
  dup2, dup8     N reads of N/2 (N/8) distinct spread rows, copies adjacent in the list
  dup2_far, dup8_far  the same lists shuffled (copies apart)
  region_dup     43% drawn with replacement from the first 12,288 rows (5,642 draws:
                 the duplicates random sampling gives), 57% distinct spread: the
                 closest to what the prefix-sharing layer probe stages

Each timed launch: (untimed) L2 flush (256 MiB write, so no pattern finds another's
host rows in L2; ``--no-flush`` keeps L2 warm), synchronize, a ~0.5 ms GPU sleep that
hides the launcher's host time, then CUDA events around the launch alone. Warm-up 5
repetitions, then ``--reps`` (50); in each repetition every (launcher, pattern) runs
once, the order rotated by one each repetition, so drift hits all alike. Reported per
case: min / median / p99 us, ns per row (median), the median over repetitions of the
paired ratio to "spread" (same launcher, same repetition) with its p25-p75, and what
the reads touch: distinct rows, 4 KiB pages, 2 MiB spans and, where the kernel says,
the share of reads on each NUMA node (means over the draws of the first 10 timed
repetitions). After the timing each case is run once more and checked byte for byte
against ``dst[dst_idx] = src[src_idx]``.

  python -m benchmarks.probe_host_gather [--rows N] [--reps R] [--out FILE]
      [--launchers rows staged] [--patterns spread region ...] [--no-flush]
      [--alloc register|torch]
  python -m benchmarks.probe_host_gather --cpu-smoke   # tiny sizes, Triton interpreter

``--alloc register`` (default) pins the pool as the cache does (``PinnedBuffer``: an
mmap registered with cudaHostRegister); ``torch`` uses ``pin_memory=True``
(cudaHostAlloc). Needs CUDA (exit 2 without it); ``--cpu-smoke`` runs every pattern
at a tiny size on CPU tensors through the interpreter and checks the copies (timings
meaningless). About 10-20 s on an H100 / H200, mostly pinning and filling the pool.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from benchmarks import common

PROG = "probe_host_gather"
SLEEP_CYCLES = 1_000_000  # ~0.5 ms of GPU clock: the launch is enqueued while it runs
LAUNCHERS = ("rows", "staged")


@dataclasses.dataclass(frozen=True)
class Sizes:
    rows: int = 13_120  # N: rows per launch (64 requests x 205 misses)
    requests: int = 64  # groups of the staged launch, and the destination's requests
    pool_rows: int = 2 << 20  # host pool rows (2,097,152 x 656 B = 1.37 GB)
    region_rows: int = 16_384  # the small region (10.7 MB)
    dup_region_rows: int = 12_288  # region_dup draws with replacement from these rows
    region_share: float = 0.43  # share of the mixed patterns' reads from the region
    dst_rows_per_request: int = 4097
    stage_k: int = 2048  # entries per group of the staged lists (a resolve's top-k)

    @property
    def dst_rows(self) -> int:
        return self.requests * self.dst_rows_per_request

    @property
    def n_region(self) -> int:
        return round(self.region_share * self.rows)

    def problem(self) -> str | None:
        """Why these sizes cannot make every pattern (None: they can)."""
        if self.rows < 8:
            return f"--rows must be >= 8, got {self.rows}"
        if self.rows > self.region_rows:
            return f"--rows {self.rows} exceeds the region ({self.region_rows} rows): 'region' draws distinct rows"
        if self.pool_rows < 2 * self.region_rows + self.rows:
            return f"pool of {self.pool_rows} rows too small for region {self.region_rows} and {self.rows} rows"
        if self.dst_rows < self.rows:
            return f"destination of {self.dst_rows} rows cannot take {self.rows} distinct rows"
        if self.stage_k * self.requests < self.rows or -(-self.rows // self.requests) > self.stage_k:
            return f"{self.requests} groups of {self.stage_k} entries cannot hold {self.rows} rows"
        if not 0 < self.dup_region_rows <= self.region_rows:
            return "dup_region_rows must be in (0, region_rows]"
        return None


DEFAULT = Sizes()
# --cpu-smoke: tiny, for the interpreter (only the code paths and the copies matter)
SMOKE = Sizes(rows=64, requests=4, pool_rows=4096, region_rows=256, dup_region_rows=192,
              dst_rows_per_request=41, stage_k=32)


# ------------------------------------------------------------------ index patterns
def distinct(g: torch.Generator, lo: int, hi: int, n: int) -> torch.Tensor:
    """n distinct ints of [lo, hi), a uniform random subset in random order (int64)."""
    span = hi - lo
    if n > span:
        raise ValueError(f"{n} distinct values from a range of {span}")
    if 4 * n >= span:
        return torch.randperm(span, generator=g)[:n] + lo
    while True:  # the distinct values of iid draws: a uniform subset given its size
        u = torch.unique(torch.randint(0, span, (n + n // 4 + 64,), generator=g))
        if u.numel() >= n:
            return u[torch.randperm(u.numel(), generator=g)[:n]] + lo


def distinct_outside(g: torch.Generator, lo: int, hi: int, n: int, a: int, r: int) -> torch.Tensor:
    """n distinct ints of [lo, hi) minus [a, a + r) (that interval inside [lo, hi))."""
    v = distinct(g, lo, hi - r, n)
    return torch.where(v >= a, v + r, v)


def shuffled(g: torch.Generator, x: torch.Tensor) -> torch.Tensor:
    return x[torch.randperm(x.numel(), generator=g)]


def far_region(g: torch.Generator, s: Sizes) -> int:
    """Start of a random region of region_rows rows outside the first region_rows rows."""
    return int(torch.randint(s.region_rows, s.pool_rows - s.region_rows + 1, (1,), generator=g))


def dup(g: torch.Generator, s: Sizes, k: int) -> torch.Tensor:
    base = distinct(g, 0, s.pool_rows, -(-s.rows // k))
    return base.repeat_interleave(k)[: s.rows]


def _mixed(g: torch.Generator, s: Sizes, far: bool) -> torch.Tensor:
    nr, ns, R = s.n_region, s.rows - s.n_region, s.region_rows
    if far:
        a = far_region(g, s)
        parts = (a + distinct(g, 0, R, nr), distinct_outside(g, 0, s.pool_rows, ns, a, R))
    else:
        parts = (distinct(g, 0, R, nr), distinct(g, R, s.pool_rows, ns))
    return shuffled(g, torch.cat(parts))


def _region_dup(g: torch.Generator, s: Sizes) -> torch.Tensor:
    nr, ns = s.n_region, s.rows - s.n_region
    draws = torch.randint(0, s.dup_region_rows, (nr,), generator=g)
    return shuffled(g, torch.cat((draws, distinct(g, s.region_rows, s.pool_rows, ns))))


PATTERNS = {
    "spread": lambda g, s: distinct(g, 0, s.pool_rows, s.rows),
    "spread_sorted": lambda g, s: torch.sort(distinct(g, 0, s.pool_rows, s.rows)).values,
    "region": lambda g, s: distinct(g, 0, s.region_rows, s.rows),
    "region_far": lambda g, s: far_region(g, s) + distinct(g, 0, s.region_rows, s.rows),
    "mixed43": lambda g, s: _mixed(g, s, far=False),
    "mixed43_far": lambda g, s: _mixed(g, s, far=True),
    "dup2": lambda g, s: dup(g, s, 2),
    "dup2_far": lambda g, s: shuffled(g, dup(g, s, 2)),
    "dup8": lambda g, s: dup(g, s, 8),
    "dup8_far": lambda g, s: shuffled(g, dup(g, s, 8)),
    "region_dup": _region_dup,
}


def gen(seed: int, rep: int, name: str) -> torch.Generator:
    """The generator of one pattern's draw in one repetition (independent of which
    other patterns run)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + rep * 7919 + zlib.crc32(name.encode())) % 2**63)


def draw(s: Sizes, names: list[str], reps: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({pattern: int32 [reps, N] host rows}, int32 [reps, N] destination rows), on CPU."""
    src = {n: torch.stack([PATTERNS[n](gen(seed, r, n), s) for r in range(reps)]).to(torch.int32) for n in names}
    dst = torch.stack([distinct(gen(seed, r, "dst"), 0, s.dst_rows, s.rows) for r in range(reps)]).to(torch.int32)
    for n, x in src.items():
        assert x.shape == (reps, s.rows) and int(x.min()) >= 0 and int(x.max()) < s.pool_rows, n
    return src, dst


# ------------------------------------------------------------------ what the reads touch
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}


def page_nodes(ptr: int, nbytes: int) -> torch.Tensor | None:
    """NUMA node of each 4 KiB page of [ptr, ptr + nbytes), from the first page
    boundary at or below ptr (move_pages with no target nodes: a query; a negative
    value is the errno of that page), int32; None where the call is unavailable or fails."""
    nr = _MOVE_PAGES.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        return None
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        if page != 4096:
            return None
        first = ptr - ptr % page
        count = -(-(ptr + nbytes - first) // page)
        pages = np.arange(first, first + count * page, page, dtype=np.uint64)
        status = np.full(count, -1, dtype=np.int32)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(0), ctypes.c_ulong(count),
                          ctypes.c_void_p(pages.ctypes.data), ctypes.c_void_p(None),
                          ctypes.c_void_p(status.ctypes.data), ctypes.c_int(0))
        return torch.from_numpy(status) if rc == 0 else None
    except Exception:  # noqa: BLE001 -- a diagnostic only
        return None


def touched(src: torch.Tensor, W: int, ptr: int, nodes: torch.Tensor | None) -> dict:
    """Mean over repetitions of what one launch's reads touch (src: int32 [reps, N] rows
    of the pool at address ``ptr``; ``nodes``: ``page_nodes`` of the pool)."""
    rows, pages, spans, share = [], [], [], {}
    first_page = ptr // 4096
    for x in src:
        b = x.long() * W + ptr  # addresses of the rows' first bytes
        rows.append(torch.unique(x).numel())
        pages.append(torch.unique(torch.cat((b // 4096, (b + W - 1) // 4096))).numel())
        spans.append(torch.unique(b >> 21).numel())
        if nodes is not None:
            nd = nodes[(b // 4096 - first_page).clamp(max=nodes.numel() - 1)]
            for v in torch.unique(nd).tolist():
                share.setdefault(int(v), []).append(float((nd == v).float().mean()))
    out = {"distinct_rows": statistics.mean(rows), "pages_4k": statistics.mean(pages),
           "spans_2m": statistics.mean(spans)}
    if nodes is not None:
        out["numa_read_share"] = {str(k): round(sum(v) / len(src), 4) for k, v in sorted(share.items())}
    return out


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def host_info(pool: torch.Tensor, nodes: torch.Tensor | None, dev: torch.device) -> dict:
    """Host facts that bear on H2: IOMMU, huge pages, NUMA placement, the PCIe link."""
    cmdline = _read("/proc/cmdline") or ""
    ptr = pool.data_ptr()
    info = {
        "iommu_devices": sorted(os.listdir("/sys/class/iommu")) if os.path.isdir("/sys/class/iommu") else None,
        "iommu_cmdline": [t for t in cmdline.split() if "iommu" in t.lower()],
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "numa_nodes_online": _read("/sys/devices/system/node/online"),
        "pool_ptr_mod_2m": ptr % (2 << 20),
        "pool_pages_per_node": ({str(int(k)): int(c) for k, c in zip(*torch.unique(nodes, return_counts=True))}
                                if nodes is not None else None),
        "gpu_pci": None, "gpu_numa_node": None, "pcie_link": None,
    }
    if dev.type == "cuda":
        query = ("--query-gpu=pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,"
                 "pcie.link.width.current,pcie.link.width.max")
        q = common._run(["nvidia-smi", "-i", str(dev.index or 0), query, "--format=csv,noheader"])
        if q:
            f = [x.strip() for x in q.splitlines()[0].split(",")]
            info["gpu_pci"] = f[0]
            info["pcie_link"] = {"gen": f[1], "gen_max": f[2], "width": f[3], "width_max": f[4]}
            node = _read(f"/sys/bus/pci/devices/{f[0][-12:].lower()}/numa_node")
            info["gpu_numa_node"] = int(node) if node and node.lstrip("-").isdigit() else None
    return info


# ------------------------------------------------------------------ the run
def make_pool(s: Sizes, W: int, dev: torch.device, alloc: str, seed: int) -> torch.Tensor:
    """uint8 [pool_rows, W] host pool, random bytes; pinned on CUDA."""
    from hisparse.device import PinnedBuffer

    nbytes = s.pool_rows * W
    if dev.type != "cuda":
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (s.pool_rows, W), dtype=torch.uint8, generator=g)
    if alloc == "torch":
        pool = torch.empty((s.pool_rows, W), dtype=torch.uint8, pin_memory=True)
    else:
        pool = PinnedBuffer(nbytes).tensor.view(s.pool_rows, W)
    flat = pool.view(-1)
    g = torch.Generator(device=dev).manual_seed(seed)
    chunk = 64 << 20
    for off in range(0, nbytes, chunk):
        c = min(chunk, nbytes - off)
        flat[off:off + c].copy_(torch.randint(0, 256, (c,), dtype=torch.uint8, device=dev, generator=g))
    torch.cuda.synchronize(dev)
    return pool


class Staged:
    """The staged launcher's lists: group t (a request) holds entries [t*K, t*K + counts[t])."""

    def __init__(self, s: Sizes, dev: torch.device) -> None:
        T, K, N = s.requests, s.stage_k, s.rows
        counts = [N // T + (t < N % T) for t in range(T)]
        pos = torch.cat([torch.arange(c) + t * K for t, c in enumerate(counts)])
        self.pos = pos.to(dev)
        self.counts = torch.tensor(counts, dtype=torch.int32, device=dev)
        self.src = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
        self.dst = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
        self.K = K

    def fill(self, si: torch.Tensor, di: torch.Tensor) -> None:
        self.src[self.pos] = si
        self.dst[self.pos] = di


def launch_fn(launcher: str, pool: torch.Tensor, dst: torch.Tensor, staged: Staged):
    """(prepare(si, di), launch()) of one launcher: prepare is untimed."""
    from hisparse.cache import copy_rows, copy_staged

    cur: list[torch.Tensor] = []
    if launcher == "rows":
        def prepare(si, di):
            cur[:] = [si, di]

        def launch():
            copy_rows(pool, cur[0], dst, cur[1])
    else:
        def prepare(si, di):
            staged.fill(si, di)

        def launch():
            copy_staged(pool, staged.src, dst, staged.dst, staged.counts, K=staged.K)
    return prepare, launch


def verify(pool: torch.Tensor, dst: torch.Tensor, si: torch.Tensor, di: torch.Tensor, launch) -> bool:
    """Run ``launch`` once; True when dst equals ``dst[di] = pool[si]`` applied to its
    previous contents, byte for byte."""
    dst.random_(0, 256)
    ref = dst.clone()
    ref[di.long()] = pool[si.cpu().long()].to(dst.device)
    launch()
    if dst.device.type == "cuda":
        torch.cuda.synchronize(dst.device)
    return bool(torch.equal(dst, ref))


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread: the draws are many small ops, which threads only slow."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


TOUCH_REPS = 10  # repetitions whose draws ``touched`` averages (the means hardly move)


def run(o: argparse.Namespace, s: Sizes, dev: torch.device) -> dict:
    from hisparse.formats import FP8_ROW_BYTES

    W = FP8_ROW_BYTES  # 656 = 41 x 16: copy_rows's 16-byte rule holds
    cuda = dev.type == "cuda"
    names, launchers = list(o.patterns), list(o.launchers)
    total = o.warmup + o.reps
    t0 = time.perf_counter()
    pool = make_pool(s, W, dev, o.alloc, o.seed)
    t_pool = time.perf_counter() - t0
    with one_thread():
        src_cpu, dst_cpu = draw(s, names, total, o.seed)
    t_draw = time.perf_counter() - t0 - t_pool
    src_dev = {n: x.to(dev) for n, x in src_cpu.items()}
    dst_dev = dst_cpu.to(dev)
    dst = torch.zeros((s.dst_rows, W), dtype=torch.uint8, device=dev)
    staged = Staged(s, dev)
    fns = {lz: launch_fn(lz, pool, dst, staged) for lz in launchers}
    flush = common.L2Flush(dev) if (cuda and not o.no_flush) else None
    cases = [(lz, n) for lz in launchers for n in names]
    samples: dict[tuple[str, str], list[float]] = {c: [] for c in cases}

    if cuda:  # compile each kernel before any repetition (also with --warmup 0)
        for prepare, launch in fns.values():
            prepare(src_dev[names[0]][0], dst_dev[0])
            launch()
        torch.cuda.synchronize(dev)
    for rep in range(total):
        k = rep % len(cases)
        for lz, n in cases[k:] + cases[:k]:
            prepare, launch = fns[lz]
            prepare(src_dev[n][rep], dst_dev[rep])
            if flush is not None:
                flush.flush()
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda._sleep(SLEEP_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1e3
            else:
                t = time.perf_counter()
                launch()
                us = (time.perf_counter() - t) * 1e6
            if rep >= o.warmup:
                samples[(lz, n)].append(us)

    checked = {}
    for lz, n in cases:  # after the timing: each case once more, checked
        prepare, launch = fns[lz]
        si, di = src_dev[n][total - 1], dst_dev[total - 1]
        prepare(si, di)
        checked[(lz, n)] = verify(pool, dst, si, di, launch)

    nodes = page_nodes(pool.data_ptr(), pool.numel())
    with one_thread():
        touch = {n: touched(src_cpu[n][o.warmup:o.warmup + TOUCH_REPS], W, pool.data_ptr(), nodes) for n in names}
    results = []
    for lz, n in cases:
        xs = samples[(lz, n)]
        st = common.stats(xs, unit="_us", count="reps")
        row = {"launcher": lz, "pattern": n, **st, "ns_per_row": st["median_us"] * 1e3 / s.rows,
               "checked": checked[(lz, n)], **touch[n]}
        if "spread" in names:
            ratio = [a / b for a, b in zip(xs, samples[(lz, "spread")])]
            row.update(vs_spread_median=statistics.median(ratio), vs_spread_p25=common.percentile(ratio, 25),
                       vs_spread_p75=common.percentile(ratio, 75))
        row["samples_us"] = [round(x, 3) for x in xs]
        results.append(row)
    return {"results": results, "host": host_info(pool, nodes, dev), "setup_s": {"pool": t_pool, "draw": t_draw},
            "row_bytes": W}


def print_table(res: dict, s: Sizes, cuda: bool) -> None:
    print(f"{s.rows} rows x {res['row_bytes']} B per launch; pool {s.pool_rows} rows "
          f"({s.pool_rows * res['row_bytes'] / 1e9:.2f} GB); region {s.region_rows} rows"
          + ("" if cuda else "  [CPU interpreter: timings mean nothing]"))
    hdr = (f"{'launcher':8} {'pattern':14} {'min_us':>8} {'med_us':>8} {'p99_us':>8} {'ns/row':>8} "
           f"{'vs_spread':>9} {'[p25-p75]':>13} {'rows':>6} {'pg4k':>6} {'sp2m':>5} ok  numa")
    print(hdr)
    print("-" * len(hdr))
    for r in res["results"]:
        vs = (f"{r['vs_spread_median']:9.4f} [{r['vs_spread_p25']:.3f}-{r['vs_spread_p75']:.3f}]"
              if "vs_spread_median" in r else f"{'':9} {'':13}")
        numa = r.get("numa_read_share")
        print(f"{r['launcher']:8} {r['pattern']:14} {r['min_us']:8.1f} {r['median_us']:8.1f} {r['p99_us']:8.1f} "
              f"{r['ns_per_row']:8.2f} {vs} {r['distinct_rows']:6.0f} {r['pages_4k']:6.0f} {r['spans_2m']:5.0f} "
              f"{'y ' if r['checked'] else 'NO'}  {numa if numa else ''}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{PROG}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=common.positive_int, default=None,
                    help=f"rows per launch (default {DEFAULT.rows}; smoke {SMOKE.rows})")
    ap.add_argument("--reps", type=common.positive_int, default=None, help="timed repetitions (default 50; smoke 2)")
    ap.add_argument("--warmup", type=common.number_in(int, 0), default=None,
                    help="untimed repetitions (default 5; smoke 1)")
    ap.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    ap.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS),
                    help="rows: copy_rows (default launch shape); staged: copy_staged as the cache stages")
    ap.add_argument("--alloc", choices=("register", "torch"), default="register",
                    help="register: PinnedBuffer (as the cache's pool); torch: pin_memory=True")
    ap.add_argument("--no-flush", action="store_true", help="no L2 flush before a timed launch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on CPU through the Triton interpreter; checks every pattern's copy")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    o = parse_args(argv)
    if o.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            if "triton" in sys.modules:
                print(f"{PROG}: --cpu-smoke needs TRITON_INTERPRET=1 set before triton is imported", file=sys.stderr)
                return 2
            os.environ["TRITON_INTERPRET"] = "1"
        dev, base = torch.device("cpu"), SMOKE
        o.reps = 2 if o.reps is None else o.reps
        o.warmup = 1 if o.warmup is None else o.warmup
    else:
        if not torch.cuda.is_available():
            print(f"{PROG}: needs a CUDA GPU (none here); --cpu-smoke runs it at a tiny size on CPU",
                  file=sys.stderr)
            return 2
        dev, base = torch.device("cuda", torch.cuda.current_device()), DEFAULT
        o.reps = 50 if o.reps is None else o.reps
        o.warmup = 5 if o.warmup is None else o.warmup
    s = dataclasses.replace(base, rows=o.rows) if o.rows is not None else base
    why = s.problem()
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
        return 2
    if not common.out_ok(o.out, PROG):
        return 2
    o.patterns = list(dict.fromkeys(o.patterns))
    o.launchers = list(dict.fromkeys(o.launchers))
    import hisparse  # noqa: F401  (after TRITON_INTERPRET: applies the interpreter fixes)

    t0 = time.perf_counter()
    res = run(o, s, dev)
    wall = time.perf_counter() - t0
    print_table(res, s, dev.type == "cuda")
    ok = all(r["checked"] for r in res["results"])
    if not ok:
        print(f"{PROG}: copies differ from the reference: "
              f"{[(r['launcher'], r['pattern']) for r in res['results'] if not r['checked']]}", file=sys.stderr)
    if o.out:
        common.write_json(o.out, {
            "benchmark": PROG, **common.environment(dev),
            "config": {**dataclasses.asdict(s), "row_bytes": res["row_bytes"], "reps": o.reps, "warmup": o.warmup,
                       "patterns": o.patterns, "launchers": o.launchers, "alloc": o.alloc, "l2_flush": not o.no_flush,
                       "seed": o.seed, "cpu_smoke": o.cpu_smoke, "sleep_cycles": SLEEP_CYCLES},
            "host": res["host"], "setup_s": res["setup_s"], "wall_s": wall, "results": res["results"]})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
