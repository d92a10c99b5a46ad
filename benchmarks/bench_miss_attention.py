"""Miss-attention benchmark: the split-mode miss attention (rows already staged) and the
staging copy, against the resident Triton decode over all K entries and a bulk pinned
host->device copy of the same miss bytes, all measured in the same run.

  python -m benchmarks.bench_miss_attention --out results/bench_miss_attention.json
  python -m benchmarks.bench_miss_attention --quick                # T = 64 only, fewer reps
  python -m benchmarks.bench_miss_attention --dry-run              # CPU, tiny, interpreter

Setup per case (T query tokens, H = 128 heads, K = 2048 entries, miss fraction f, one
token per request): a hot buffer of T x 4096 rows; token t's K entries are distinct
rows of its own 4096-row region, m = round(f K) of them misses (their host rows: m
sorted distinct positions of a --context-row range of a pinned host pool, the range of
request t % --requests), the rest hits. fp8_ds_mla rows by default.

Timed (CUDA events, an L2 flush and a ~0.5 ms GPU sleep before each sample, so a sample
is GPU time from a cold L2; min / median / p99 over --reps):
  resident    Triton decode over all K entries of the staged hot buffer (the baseline)
  hit         Triton decode over the K - m hit entries (compacted, valid counts)
  staging     hisparse's copy_rows kernel: the m misses per token, host pool -> hot rows
  split       miss_attention_merge over the staged misses into the hit partial
  bulk_h2d    one pinned host -> device copy of T x m rows' bytes (the PCIe ceiling)
and whole layers without the resolve (the side stream forked from and joined to the
timed stream): serial = staging then resident decode; split = staging on a side stream
beside the hit decode, then split. ``hidden_split`` = (serial - split) / staging.

Every case is checked before it is timed: staging + split + merge against the resident
decode (and the float32 reference on a few tokens), and the hot rows the staging copy
wrote against the host rows byte for byte. A failed check is recorded and the script
exits 1 after writing its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import torch

from benchmarks import common

common.interpret_dry_run(with_gpu=True)  # a dry run is on the CPU; before hisparse loads

from hisparse.attention import (ReferenceBackend, TritonBackend, miss_attention_merge,  # noqa: E402
                                plan_miss_attention)
from hisparse.cache import copy_rows  # noqa: E402
from hisparse.device import PinnedBuffer  # noqa: E402
from hisparse.formats import D_ROW, RowFormat, quantize_fp8_ds_mla  # noqa: E402

SLOTS_PER_TOKEN = 4096
SPOT_TOKENS = 2
TOL_OUT, TOL_LSE = 5e-2, 2e-3  # max |err| allowed against the resident decode / reference


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write results as JSON to this file")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    p.add_argument("--quick", action="store_true", help="T = 64 only, 10 reps")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="T values (16 64 256)")
    p.add_argument("--heads", type=int, default=None, help="H (128)")
    p.add_argument("--topk", type=int, default=None, help="K (2048)")
    p.add_argument("--miss-fracs", type=float, nargs="+", default=None,
                   help="miss fractions (0 0.05 0.1 0.2)")
    p.add_argument("--format", choices=[f.value for f in RowFormat], default="fp8_ds_mla")
    p.add_argument("--context", type=int, default=None, help="host rows per request (65536)")
    p.add_argument("--requests", type=int, default=None, help="requests in the pool (64)")
    p.add_argument("--reps", type=int, default=None, help="timed samples per measurement (30)")
    p.add_argument("--no-overlap", action="store_true", help="skip the whole-layer timings")
    return p.parse_args(argv)


def fill_defaults(args) -> None:
    dry = args.dry_run
    if args.tokens is None:
        args.tokens = [2] if dry else ([64] if args.quick else [16, 64, 256])
    if args.heads is None:
        args.heads = 16 if dry else 128
    if args.topk is None:
        args.topk = 32 if dry else 2048
    if args.miss_fracs is None:
        args.miss_fracs = [0.0, 0.1] if dry else [0.0, 0.05, 0.1, 0.2]
    if args.context is None:
        args.context = 256 if dry else 65536
    if args.requests is None:
        args.requests = 2 if dry else 64
    if args.reps is None:
        args.reps = 1 if dry else (10 if args.quick else 30)


def problems(args) -> list[str]:
    out = []
    if any(t < 1 for t in args.tokens) or args.heads < 1 or args.topk < 1:
        out.append("--tokens, --heads and --topk must be >= 1")
    if args.topk > SLOTS_PER_TOKEN:
        out.append(f"--topk must be <= {SLOTS_PER_TOKEN} (rows per token's hot region)")
    if any(not 0.0 <= f <= 1.0 for f in args.miss_fracs):
        out.append("--miss-fracs must lie in [0, 1]")
    if args.context < args.topk or args.requests < 1 or args.reps < 1:
        out.append("--context must be >= --topk; --requests and --reps >= 1")
    return out


# ------------------------------------------------------------------ problem
def make_rows(n: int, fmt: RowFormat, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes] random rows in ``fmt``, built in chunks on ``dev``."""
    out = torch.empty((n, fmt.row_bytes), dtype=torch.uint8, device=dev)
    for r0 in range(0, n, 1 << 18):
        x = torch.randn(min(1 << 18, n - r0), D_ROW, generator=g, device=dev)
        out[r0:r0 + x.shape[0]] = (quantize_fp8_ds_mla(x) if fmt is RowFormat.FP8_DS_MLA
                                   else x.bfloat16().view(torch.uint8))
    return out


def make_pool(args, fmt: RowFormat, dev: torch.device, pin: bool):
    """(PinnedBuffer, uint8 [requests x context, row_bytes] view) of random rows."""
    n = args.requests * args.context
    buf = PinnedBuffer(n * fmt.row_bytes, pin=pin)
    pool = buf.tensor.view(n, fmt.row_bytes)
    g = torch.Generator(device=dev).manual_seed(0)
    for r0 in range(0, n, 1 << 20):
        m = min(1 << 20, n - r0)
        pool[r0:r0 + m].copy_(make_rows(m, fmt, dev, g))
    return buf, pool


@dataclasses.dataclass
class Case:
    """One (T, miss fraction) problem; every tensor on the device except ``pool``."""

    T: int
    m: int  # misses per token
    q: torch.Tensor  # bf16 [T, H, 576]
    hot: torch.Tensor  # uint8 [T * 4096, row_bytes]: hits resident, miss slots zero
    full_idx: torch.Tensor  # int32 [T, K]: every entry's hot row (resident baseline)
    hit_idx: torch.Tensor  # int32 [T, K]: hit rows first, then -1
    hit_counts: torch.Tensor  # int32 [T] = K - m
    miss_idx: torch.Tensor  # int32 [T, K]: miss hot rows first, then -1
    miss_host: torch.Tensor  # int32 [T, K]: their host rows, then -1
    miss_counts: torch.Tensor  # int32 [T] = m


def make_case(T: int, frac: float, args, pool: torch.Tensor, fmt: RowFormat,
              dev: torch.device) -> Case:
    K, H = args.topk, args.heads
    m = int(round(frac * K))
    g = torch.Generator().manual_seed(1000 * T + m)
    base = torch.arange(T, dtype=torch.int64)[:, None] * SLOTS_PER_TOKEN
    slots = torch.stack([torch.randperm(SLOTS_PER_TOKEN, generator=g)[:K] for _ in range(T)])
    slots = (slots + base).to(torch.int32)  # [T, K]: first m misses, the rest hits
    req = torch.arange(T) % args.requests
    pos = torch.stack([torch.randperm(args.context, generator=g)[:m].sort().values
                       for _ in range(T)]) if m else torch.zeros(T, 0, dtype=torch.int64)
    host_rows = (req[:, None] * args.context + pos).to(torch.int32)
    pad = torch.full((T, K - m), -1, dtype=torch.int32)
    miss_idx = torch.cat([slots[:, :m], pad], 1)
    miss_host = torch.cat([host_rows, pad], 1)
    hit_idx = torch.cat([slots[:, m:], torch.full((T, m), -1, dtype=torch.int32)], 1)
    shuffle = torch.stack([torch.randperm(K, generator=g) for _ in range(T)])
    full_idx = torch.gather(slots, 1, shuffle)
    hot = torch.zeros((T * SLOTS_PER_TOKEN, fmt.row_bytes), dtype=torch.uint8, device=dev)
    gd = torch.Generator(device=dev).manual_seed(T + m)
    hit_rows = slots[:, m:].reshape(-1).long().to(dev)
    hot[hit_rows] = make_rows(hit_rows.numel(), fmt, dev, gd)
    q = torch.randn(T, H, D_ROW, generator=gd, device=dev).bfloat16()
    cnt = lambda v: torch.full((T,), v, dtype=torch.int32, device=dev)  # noqa: E731
    return Case(T, m, q, hot, full_idx.to(dev), hit_idx.to(dev), cnt(K - m), miss_idx.to(dev),
                miss_host.to(dev), cnt(m))


# ------------------------------------------------------------------ the calls
class Calls:
    """The measured operations of one case (eager calls; outputs preallocated where the
    API takes them)."""

    def __init__(self, c: Case, pool: torch.Tensor, fmt: RowFormat, sm_scale: float,
                 dev: torch.device):
        self.c, self.pool, self.fmt, self.scale, self.dev = c, pool, fmt, sm_scale, dev
        T, H = c.q.shape[0], c.q.shape[1]
        self.kv = c.hot if fmt is RowFormat.FP8_DS_MLA else c.hot.view(torch.bfloat16)
        # the Triton decode as the layer runs it, no host sync (a sample is GPU time: the
        # host's checks run while a GPU sleep ahead of it is still going)
        self.triton = TritonBackend(validate=False, allow_interpreter=True)
        self.split_plan = plan_miss_attention(mode="split", max_tokens=T, num_heads=H,
                                              row_format=fmt, device=dev)
        self.src_flat, self.dst_flat = c.miss_host.reshape(-1), c.miss_idx.reshape(-1)
        self.cuda = dev.type == "cuda"
        self.side = torch.cuda.Stream(device=dev) if self.cuda else None

    def resident(self):
        c = self.c
        return self.triton.decode(c.q, self.kv, c.full_idx, sm_scale=self.scale, row_format=self.fmt)

    def hit_decode(self):
        c = self.c
        return self.triton.decode(c.q, self.kv, c.hit_idx, valid_counts=c.hit_counts, sm_scale=self.scale,
                                  row_format=self.fmt)

    def staging(self):
        copy_rows(self.pool, self.src_flat, self.c.hot, self.dst_flat)

    def split(self, out, lse):
        c = self.c
        miss_attention_merge(c.q, self.kv, c.miss_idx, c.miss_counts, out, lse,
                             sm_scale=self.scale, row_format=self.fmt, plan=self.split_plan,
                             kernels="triton")

    # whole layers (no resolve); the side stream is forked from and joined to the caller's
    def _beside(self, side_fn):
        if not self.cuda:
            side_fn()
            return lambda: None
        main = torch.cuda.current_stream(self.dev)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            side_fn()
        return lambda: main.wait_stream(self.side)

    def layer_serial(self):
        self.staging()
        return self.resident()

    def layer_split(self):
        join = self._beside(self.staging)
        out, lse = self.hit_decode()
        join()
        self.split(out, lse)
        return out, lse


def check_case(calls: Calls, c: Case) -> dict:
    """Correctness of one case before timing: returns the errors (and whether they pass)."""
    calls.staging()
    ref_out, ref_lse = calls.resident()
    out, lse = calls.hit_decode()
    calls.split(out, lse)
    err_split = _err(out, lse, ref_out, ref_lse)
    rows_ok = True
    if c.m:
        n = min(SPOT_TOKENS, c.T)
        got = c.hot[c.miss_idx[:n, :c.m].reshape(-1).long()].cpu()
        want = calls.pool[c.miss_host[:n, :c.m].reshape(-1).long().cpu()]
        rows_ok = bool(torch.equal(got, want))
    n = min(SPOT_TOKENS, c.T)  # the float32 reference on a few tokens
    f_out, f_lse = ReferenceBackend().decode(c.q[:n], calls.kv, c.full_idx[:n], sm_scale=calls.scale,
                                             row_format=calls.fmt)
    err_ref = _err(out[:n], lse[:n], f_out, f_lse)
    ok = (rows_ok and max(err_split[0], err_ref[0]) <= TOL_OUT
          and max(err_split[1], err_ref[1]) <= TOL_LSE)
    return {"max_err_split": err_split[0], "max_err_lse_split": err_split[1],
            "max_err_vs_reference": err_ref[0], "staged_rows_exact": rows_ok, "ok": ok}


def _err(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    fin = torch.isfinite(ref_lse)
    if not torch.equal(fin, torch.isfinite(lse)):
        return math.inf, math.inf
    e_lse = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    return (out.float() - ref_out.float()).abs().max().item(), e_lse


# ------------------------------------------------------------------ timing and output
def summary(us: list[float], nbytes: int | None = None) -> dict:
    d = common.stats(us, unit="_us", count="reps")
    if nbytes:
        d["bytes"] = nbytes
        d["GBps_median"] = nbytes / (d["median_us"] * 1e-6) / 1e9
    return d


def line(name: str, d: dict | None, base: dict | None = None, base_name: str = "", *,
         speed: bool = False) -> str:
    """One printed measurement; with ``base`` its median time as a multiple of the
    base's (``speed``: the base's time over its own, i.e. the fraction of the base's
    speed reached)."""
    if d is None:
        return f"  {name:<30s} (none)"
    s = (f"  {name:<30s} min {d['min_us']:8.1f}  med {d['median_us']:8.1f}  "
         f"p99 {d['p99_us']:8.1f} us")
    if "GBps_median" in d:
        s += f"  {d['GBps_median']:6.1f} GB/s"
    if base is not None and speed:
        s += f"  {base['median_us'] / d['median_us']:.2f}x {base_name} speed"
    elif base is not None:
        s += f"  {d['median_us'] / base['median_us']:.2f}x {base_name} time"
    return s


def ratios(r: dict) -> dict:
    """The same-run ratios of one case (medians): times over the resident decode's, and
    PCIe speed as a fraction of the bulk copy's."""
    med = lambda k: r[k]["median_us"] if r.get(k) else None  # noqa: E731
    res, bulk = med("resident_decode"), med("bulk_h2d")
    out = {f"{k}_vs_resident": med(k) / res
           for k in ("hit_decode", "split", "layer_serial", "layer_split")
           if med(k) is not None}
    if bulk:
        out["staging_bulk_speed"] = bulk / med("staging")
    return out


def run_case(T: int, frac: float, args, pool, fmt, dev, timer) -> dict:
    c = make_case(T, frac, args, pool, fmt, dev)
    scale = 1.0 / math.sqrt(D_ROW)
    calls = Calls(c, pool, fmt, scale, dev)
    rec = {"T": T, "H": args.heads, "K": args.topk, "miss_frac": frac, "misses_per_token": c.m,
           "miss_bytes": T * c.m * fmt.row_bytes, "format": fmt.value,
           "split_config": dataclasses.asdict(calls.split_plan.config)}
    rec.update(check_case(calls, c))
    nb = rec["miss_bytes"]
    out0, lse0 = calls.hit_decode()

    def merged(fn):  # a fresh copy of the hit partial before each sample (untimed)
        buf = [out0.clone(), lse0.clone()]

        def before():
            buf[0].copy_(out0)
            buf[1].copy_(lse0)
            timer.flush()
        return (lambda: fn(buf[0], buf[1])), before

    rec["resident_decode"] = summary(timer.run(calls.resident))
    rec["hit_decode"] = summary(timer.run(calls.hit_decode))
    rec["staging"] = summary(timer.run(calls.staging), nb)
    rec["split"] = summary(timer.run(*merged(calls.split)))
    if nb:
        src = pool.view(-1)[:nb]
        dst = torch.empty(nb, dtype=torch.uint8, device=dev)
        rec["bulk_h2d"] = summary(timer.run(lambda: dst.copy_(src, non_blocking=True)), nb)
    else:
        rec["bulk_h2d"] = None
    if not args.no_overlap:
        for name in ("serial", "split"):
            rec[f"layer_{name}"] = summary(timer.run(getattr(calls, f"layer_{name}")))
        st = rec["staging"]["median_us"]
        rec["hidden_split"] = ((rec["layer_serial"]["median_us"]
                                - rec["layer_split"]["median_us"]) / st if c.m else None)
    rec["ratios"] = ratios(rec)
    print_case(rec)
    return rec


def print_case(r: dict) -> None:
    res, bulk = r["resident_decode"], r["bulk_h2d"]
    print(f"T={r['T']} H={r['H']} K={r['K']} misses={r['miss_frac']:.0%} ({r['misses_per_token']}"
          f"/token, {r['miss_bytes'] / 2**20:.2f} MiB)  check {'ok' if r['ok'] else 'FAILED'} "
          f"(err split {r['max_err_split']:.3g}, rows exact {r['staged_rows_exact']})")
    print(line("resident decode (baseline)", res))
    print(line("hit decode", r["hit_decode"], res, "resident"))
    print(line("bulk pinned H2D (PCIe ceiling)", bulk))
    print(line("staging copy_rows", r["staging"], bulk, "bulk", speed=True))
    print(line("split miss attention + merge", r["split"], res, "resident"))
    for name in ("serial", "split"):
        if f"layer_{name}" in r:
            extra = r.get(f"hidden_{name}")
            print(line(f"layer {name}", r[f"layer_{name}"], res, "resident")
                  + (f"  hidden {extra:.0%}" if extra is not None else ""))


class Timer:
    """``common.time_calls`` with an L2 flush and a GPU sleep before each sample."""

    def __init__(self, dev: torch.device, reps: int, warmup: int):
        self.cuda, self.reps, self.warmup = dev.type == "cuda", reps, warmup
        self._l2 = common.L2Flush(dev)

    def flush(self):
        self._l2.flush()

    def run(self, fn, before=None) -> list[float]:
        return common.time_calls(fn, reps=self.reps, warmup=self.warmup, cuda=self.cuda,
                                 before=before or self.flush, gpu_sleep=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not common.out_ok(args.out, "bench_miss_attention"):
        return 2
    fill_defaults(args)
    bad = problems(args)
    if bad:
        print("bench_miss_attention: " + "; ".join(bad), file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench_miss_attention: no CUDA GPU; use --dry-run to exercise the script on CPU",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    fmt = RowFormat.parse(args.format)
    results = {"benchmark": "miss_attention", "args": vars(args), "env": common.environment(dev),
               "note": ("dry run: CPU interpreter, tiny shapes; the timings mean nothing"
                        if args.dry_run else "H200 timings, GPU time per call"),
               "cases": []}
    print("env:", json.dumps(results["env"]))
    buf, pool = make_pool(args, fmt, dev, pin=cuda)
    results["pool_pinned"] = buf.pinned
    timer = Timer(dev, args.reps, 0 if args.dry_run else 3)
    for T in args.tokens:
        for frac in args.miss_fracs:
            results["cases"].append(run_case(T, frac, args, pool, fmt, dev, timer))
    if cuda:
        torch.cuda.synchronize()
    if args.out:
        common.write_json(args.out, results)
    failed = [(c["T"], c["miss_frac"]) for c in results["cases"] if not c["ok"]]
    if failed:
        print(f"bench_miss_attention: correctness check FAILED for (T, miss fraction) {failed}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
