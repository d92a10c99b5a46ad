"""One sparse-MLA decode layer in a CUDA graph: hisparse (resolve + miss staging +
attention) against a resident paged cache holding the same rows (attention alone),
same backend, same top-k, in one run.

Setup per batch size B: B requests of ``--context`` tokens, fp8_ds_mla rows, in a
pinned host pool (2 layers); the resident cache holds the same rows on the GPU. Each
token selects K entries, a fraction ``hit`` of them among the rows hot in its buffer
(the first S positions, which the write path keeps hot) and the rest among the others
(staged from host). Before every timed replay the cache's state and hot rows are
restored (the same misses every time) and the L2 is flushed; the resident replays get
the same flush.

Traces (``--trace``): ``restore`` (the default) as above; ``periodic``
(``benchmarks.periodic_trace``): every step a fixed core of round(hit K) positions plus
fresh ones that come back only after the LRU has evicted them, nothing restored between
steps (the LRU runs on, no block locality), an exact steady miss rate checked against the
cache's counters; modes serial and split only.

Modes: serial (resolve + copy, then attention), split (attention over the hits while
the misses stage, then the misses, LSE-merged), and ``prefetch``: two
layers (split), the second layer's selection prefetched from the first's while the
first computes, against two resident layers; the two selections share ``--overlap``
of their entries.

``--shared-prefix P``: every case runs three times: prefix caching off (as above); on,
every request admitted with prompt token ids of its own (nothing shared: what turning
it on costs); and on with the B requests sharing the first P tokens' host blocks
(request 0 writes them, the others map them under alias block ids and write only their
own rows; the hot buffers are then warmed with positions [0, S) so the hit positions
are hot as before). The report adds each mode's ratio to the case with it off
(``ratio_vs_prefix_off``).

Reported per (backend, B, hit rate): medians (min/p99 in the JSON), each mode's ratio
to resident, and the fraction of the staging time hidden, (serial - mode) /
(serial - resident); also the staging alone (resolve + copy) and the hit attention
alone, and the largest output difference from resident (relative to its largest |value|).

  python -m benchmarks.bench_layer [--batch 16 64 256] [--hits 100 95 90 80]
      [--backends triton flashmla] [--modes serial split prefetch] [--trace restore|periodic]
      [--shared-prefix P] [--out FILE]
  python -m benchmarks.bench_layer --dry-run      # tiny shapes on CPU (interpreter)
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks import common
from benchmarks.periodic_trace import PeriodicTrace, run_steps

common.interpret_dry_run(with_gpu=True)  # before hisparse loads (a dry run stays on CPU)

from hisparse import HiSparseConfig  # noqa: E402
from hisparse.attention import FlashMLABackend, Phase, SparseMLABackend, TritonBackend  # noqa: E402
from hisparse.cache import HiSparseCache  # noqa: E402
from hisparse.decode import DecodeLayer, ModeChooser, Overlap  # noqa: E402
from hisparse.formats import RowFormat, quantize_fp8_ds_mla  # noqa: E402

STATE = ("slot_pos", "slot_stamp", "row_slot", "step", "stats", "seq_lens")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pos = common.positive_int
    ap.add_argument("--batch", type=pos, nargs="+", default=[16, 64, 256])
    ap.add_argument("--hits", type=common.percent, nargs="+", default=[100, 95, 90, 80],
                    help="hit rates in percent, each in [0, 100]")
    ap.add_argument("--backends", nargs="+", default=["triton", "flashmla"], choices=["triton", "flashmla"])
    ap.add_argument("--modes", nargs="+", default=None, choices=["serial", "split", "auto", "prefetch"],
                    help="[serial split prefetch]; with --trace periodic [serial split auto]")
    ap.add_argument("--trace", choices=["restore", "periodic"], default="restore",
                    help="restore: the same misses every replay (state restored); periodic: a core plus "
                         "fresh positions, the LRU running on (see the module docstring)")
    ap.add_argument("--context", type=pos, default=65536, help="tokens per request (B <= 64)")
    ap.add_argument("--context-256", type=pos, default=32768, help="tokens per request at B > 64")
    ap.add_argument("--top-k", type=pos, default=2048)
    ap.add_argument("--slots", type=pos, default=4096, help="LRU hot slots per request (S)")
    ap.add_argument("--heads", type=pos, default=128)
    ap.add_argument("--overlap", type=common.fraction, default=0.8,
                    help="adjacent-layer selection overlap (prefetch), in [0, 1]")
    ap.add_argument("--stage-programs", type=pos, nargs="+", default=None,
                    help="sweep: the staging kernel's grid sizes (default: its own)")
    ap.add_argument("--reps", type=pos, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--flashmla-lib", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU; figures mean nothing")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="also run each case with the requests sharing the first P tokens (prefix caching)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    periodic = a.trace == "periodic"
    if a.modes is None:
        a.modes = ["serial", "split", "auto"] if periodic else ["serial", "split", "prefetch"]
    if periodic and ("prefetch" in a.modes or a.stage_programs):
        ap.error("--trace periodic runs the serial, split and auto modes only (no prefetch, no --stage-programs)")
    if not periodic and "auto" in a.modes:
        ap.error("--modes auto times its calls as they run: it needs --trace periodic (the other trace "
                 "restores the cache's state before every replay)")
    if a.dry_run:
        a.batch, a.context, a.context_256, a.top_k, a.slots, a.heads = [2], 96, 96, 8, 16, 16
        a.reps, a.warmup, a.backends = 1, 0, ["triton"]
    if a.slots < a.top_k:  # the cache's rule: one token's selection fits its hot buffer
        ap.error(f"--slots must be >= --top-k, got {a.slots} and {a.top_k}")
    # each token draws its misses among the positions past the hot slots
    need = a.slots + a.top_k + 1 if not periodic else 2 * a.slots + a.top_k + 1
    if a.shared_prefix < 0 or a.shared_prefix >= min(a.context, a.context_256):
        ap.error(f"--shared-prefix must be in [0, context), got {a.shared_prefix}")
    if min(a.context, a.context_256) < need:
        ap.error(f"--context and --context-256 must be >= --slots + --top-k + 1 = {need}, got "
                 f"{a.context} and {a.context_256}")
    return a


def fp8_rows(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """uint8 [n, 656] fp8_ds_mla rows of random values (valid codes, varied scales)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((n, 576), generator=g) * (torch.rand((n, 1), generator=g) * 4 + 0.25)
    return quantize_fp8_ds_mla(x.to(device=device, dtype=torch.bfloat16))


class Setup:
    """A cache and a resident copy of the same rows for B requests (two layers);
    ``shared`` > 0: prefix caching on, the requests share the blocks of the first
    ``shared`` tokens (rounded down to whole blocks); -1: on, nothing shared; 0: off.
    ``pool``: an elastic device pool with room for request 0's pages and every other
    request's own pages past the shared prefix, and ``share_pages`` passed on as
    ``share_prefix_pages`` (True: the sharers join resident on request 0's prefix pages;
    False: they join hot, their prefix on the host only)."""

    def __init__(self, B: int, ctx: int, a: argparse.Namespace, dev: torch.device, shared: int = 0,
                 pool: bool = False, share_pages: bool = True) -> None:
        self.B, self.ctx, self.K, self.S, self.dev = B, ctx, a.top_k, a.slots, dev
        blocks = math.ceil(ctx / 64) * B
        rows = None
        if pool:
            pages = math.ceil(ctx / 64) + (B - 1) * (math.ceil((ctx - max(shared, 0) // 64 * 64) / 64))
            rows = math.ceil(B * (a.slots + 1) / 64) * 64 + pages * 64
        cfg = HiSparseConfig(num_layers=2, host_pool_tokens=blocks * 64, row_bytes=656, top_k=a.top_k,
                             device_buffer_size=a.slots, max_num_reqs=B, host_block_size=64,
                             max_request_id=max(16, B), device=str(dev), prefix_caching=shared != 0,
                             device_pool_rows=rows, share_prefix_pages=share_pages)
        kern = "triton" if dev.type == "cuda" or a.dry_run else "torch"
        self.cache = HiSparseCache(cfg, kernels=kern)
        chunk = min(ctx, 1 << 16)
        base = [fp8_rows(chunk, 10 + layer, dev) for layer in range(2)]
        self.resident = [torch.empty((B * ctx, 656), dtype=torch.uint8, device=dev) for _ in range(2)]
        self.cached = 0
        for b in range(B):
            ids = None
            if shared:  # the prefix's token ids are common, the rest the request's own
                n0 = max(shared, 0)
                ids = list(range(n0)) + [1_000_000 * (b + 1) + i for i in range(ctx - n0)]
            got = self.cache.add_request(b, token_ids=ids)
            self.cached += got
            for layer in range(2):
                rows = torch.roll(base[layer], shifts=b * 7919, dims=0)
                reps = math.ceil(ctx / chunk)
                rows = rows.repeat(reps, 1)[:ctx] if reps > 1 else rows[:ctx]
                if shared > 0:  # the shared prefix holds request 0's rows
                    first = base[layer].repeat(reps, 1)[:ctx] if reps > 1 else base[layer][:ctx]
                    rows = torch.cat([first[:shared], rows[shared:]])
                self.cache.write(layer, b, rows[got:])
                self.resident[layer][b * ctx:(b + 1) * ctx] = rows
        if shared > 0:  # positions [0, S) hot, as the private run's write path leaves them
            req = torch.arange(B, dtype=torch.int32, device=dev)
            for layer in range(2):
                for p0 in range(0, self.S, self.K):
                    pos = torch.arange(p0, p0 + self.K, dtype=torch.int32, device=dev) % self.S
                    self.cache.resolve(layer, req, pos.expand(B, -1).contiguous())
            self.cache.streams.join_staging()
        self.cache.streams.join_backup()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        self.saved = {n: getattr(self.cache.state, n).clone() for n in STATE}
        self.saved_hot = self.cache.hot.clone()
        self.req = torch.arange(B, dtype=torch.int32, device=dev)
        self.flush = common.L2Flush(dev)

    def restore(self) -> None:
        for n in STATE:
            getattr(self.cache.state, n).copy_(self.saved[n])
        self.cache.hot.copy_(self.saved_hot)
        self.flush.flush()

    def topk(self, hit: float, seed: int, like: torch.Tensor | None = None, overlap: float = 0.0) -> torch.Tensor:
        """int32 [B, K]: round(hit K) distinct positions among the hot [0, S), the rest
        among the cold [S, ctx - 1); with ``like``, ``overlap`` of the entries are taken
        from it (the rest drawn afresh the same way)."""
        g = torch.Generator().manual_seed(seed)
        K, S, ctx = self.K, self.S, self.ctx
        nh = round(hit * K)
        out = torch.empty((self.B, K), dtype=torch.int32)
        for b in range(self.B):
            hot = torch.randperm(S, generator=g)[:nh]
            cold = S + torch.randperm(ctx - 1 - S, generator=g)[:K - nh]
            row = torch.cat([hot, cold])
            if like is not None:
                keep = round(overlap * K)
                prev = like[b].cpu().long()
                fresh = row[~torch.isin(row, prev[:keep])][:K - keep]
                row = torch.cat([prev[:keep], fresh])
                if row.numel() < K:  # rare: top up with unused cold positions
                    extra = S + torch.randperm(ctx - 1 - S, generator=g)
                    extra = extra[~torch.isin(extra, row)][:K - row.numel()]
                    row = torch.cat([row, extra])
            out[b] = row[torch.randperm(K, generator=g)].to(torch.int32)
        return out.to(self.dev)

    def resident_idx(self, topk: torch.Tensor) -> torch.Tensor:
        return topk + (torch.arange(self.B, device=self.dev, dtype=torch.int32) * self.ctx)[:, None]


def make_backend(name: str, a: argparse.Namespace, dev: torch.device, H: int) -> tuple[SparseMLABackend | None, str]:
    # unchecked backends: their index-range checks read the device (no host sync in a graph)
    be: SparseMLABackend = (TritonBackend(allow_interpreter=a.dry_run, validate=False) if name == "triton"
                            else FlashMLABackend(library_path=common.flashmla_lib(a.flashmla_lib), check_ranges=False))
    why = be.supports(device=dev, row_format=RowFormat.FP8_DS_MLA, num_heads=H, phase=Phase.DECODE)
    return (None, why) if why else (be, "")


def timed(fn, s: Setup, a: argparse.Namespace, *, restore: bool) -> tuple[dict, object]:
    """Capture ``fn`` in a graph (CUDA) and time its replays; returns (stats, output)."""
    before = s.restore if restore else s.flush.flush
    if s.dev.type != "cuda":  # a smoke run: one timed eager call, the figure means nothing
        before()
        out = fn()
        return common.stats(common.time_calls(fn, reps=1, warmup=0, cuda=False, before=before), unit="_us"), out
    g, gout = common.capture(fn, before)
    samples = common.time_calls(g.replay, reps=a.reps, warmup=a.warmup, cuda=True, before=before)
    return common.stats(samples, unit="_us"), gout


def max_diff(x, y) -> float:
    """Largest |out - resident out| relative to the largest |resident out|."""
    if not x[0].numel():
        return 0.0
    ref = y[0].float()
    return float((x[0].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def add_ratios(res: dict) -> None:
    """Each mode's ratio to resident, and the fraction of the staging time it hides,
    (serial - mode) / (serial - resident)."""
    r0 = res["resident"]["median_us"]
    ser = res.get("serial", {}).get("median_us")
    for m in ("serial", "split", "auto"):
        if m in res:
            res[m]["ratio_vs_resident"] = res[m]["median_us"] / r0
            if ser is not None and ser > r0:
                res[m]["staging_hidden"] = (ser - res[m]["median_us"]) / (ser - r0)
    fixed = [res[m]["median_us"] for m in ("serial", "split") if m in res]
    if "auto" in res and fixed:
        res["auto"]["ratio_vs_better"] = res["auto"]["median_us"] / min(fixed)


def bench_case(s: Setup, be: SparseMLABackend, hit: float, a: argparse.Namespace) -> dict:
    H, dev = a.heads, s.dev
    sm = 1.0 / math.sqrt(576)
    g = torch.Generator().manual_seed(int(hit * 1000))
    q = (torch.randn((s.B, H, 576), generator=g) * 0.5).to(device=dev, dtype=torch.bfloat16)
    tk0 = s.topk(hit, 1)
    tk1 = s.topk(hit, 2, like=tk0, overlap=a.overlap)
    c = s.cache
    fmt = RowFormat.FP8_DS_MLA
    res = {"hit": hit}

    def resident(layers=1):
        outs = []
        for layer, tk in list(enumerate((tk0, tk1)))[:layers]:
            outs.append(be.decode(q, s.resident[layer], s.resident_idx(tk), sm_scale=sm, row_format=fmt))
        return outs[-1]

    res["resident"], ref = timed(resident, s, a, restore=False)
    layers = {m: DecodeLayer(c, be, overlap=Overlap.parse(m)) for m in ("serial", "split")}
    for m in ("serial", "split"):
        if m not in a.modes:
            continue
        res[m], out = timed(lambda m=m: layers[m](0, s.req, tk0, q, sm_scale=sm), s, a, restore=True)
        res[m]["max_rel_diff"] = max_diff(out, ref)
    # staging alone and hit attention alone
    res["staging_alone"], _ = timed(lambda: c.resolve(0, s.req, tk0, validate=False), s, a, restore=True)
    s.restore()
    sp = c.resolve(0, s.req, tk0, validate=False, split=True)
    hits = sp.hit_physical.clone()
    res["hit_attention_alone"], _ = timed(
        lambda: be.decode(q, c.hot_rows(0), hits, sm_scale=sm, row_format=fmt), s, a, restore=False)
    for progs in a.stage_programs or []:  # grid-size sweep of the staging kernel
        c.stage_programs = progs
        row = {}
        for m, dl in layers.items():
            row[m], _ = timed(lambda dl=dl: dl(0, s.req, tk0, q, sm_scale=sm), s, a, restore=True)
            row[m]["ratio_vs_resident"] = row[m]["median_us"] / res["resident"]["median_us"]
        row["staging_alone"], _ = timed(lambda: c.resolve(0, s.req, tk0, validate=False), s, a, restore=True)
        res.setdefault("sweep", {})[str(progs)] = row
        c.stage_programs = None
    if "prefetch" in a.modes:
        res["resident_2layers"], ref2 = timed(lambda: resident(2), s, a, restore=False)

        def two(prefetch: bool):
            layers["split"](0, s.req, tk0, q, sm_scale=sm)
            if prefetch:
                c.prefetch(1, s.req, tk0)
            return layers["split"](1, s.req, tk1, q, sm_scale=sm)

        res["split_2layers"], _ = timed(lambda: two(False), s, a, restore=True)
        res["prefetch_2layers"], out = timed(lambda: two(True), s, a, restore=True)
        res["prefetch_2layers"]["max_rel_diff"] = max_diff(out, ref2)
        s.restore()
        pre = c.prefetch(1, s.req, tk0)  # what the prefetch staged, for precision / recall
        staged = int((pre.stage_dst[:s.B * s.K] >= 0).sum())
        real = c.resolve(1, s.req, tk1, validate=False)
        left = int((real.stage_dst >= 0).sum())
        sel = sum(len(set(tk1[b].tolist()) & set(tk0[b].tolist()) - set(range(s.S))) for b in range(s.B))
        res["prefetch_quality"] = {"rows_staged": staged, "misses_left": left, "useful_rows": sel,
                                   "precision": sel / staged if staged else 0.0,
                                   "recall": sel / (sel + left) if sel + left else 1.0,
                                   "wasted_bytes": (staged - sel) * 656}
    add_ratios(res)
    if "prefetch_2layers" in res:
        r2 = res["resident_2layers"]["median_us"]
        res["prefetch_2layers"]["ratio_vs_resident"] = res["prefetch_2layers"]["median_us"] / r2
        res["split_2layers"]["ratio_vs_resident"] = res["split_2layers"]["median_us"] / r2
    return res


def bench_case_periodic(s: Setup, be: SparseMLABackend, hit: float, a: argparse.Namespace) -> dict:
    """``bench_case`` over a periodic trace: every graph (resident, serial, split, the
    staging alone) replays over one top-k buffer that each step rewrites, the steps
    numbered on across the graphs so the cache's LRU state runs on; the misses of each
    mode's timed steps are counted (``miss_rate``: the trace's, ``measured_miss_rate``)."""
    H, dev, c = a.heads, s.dev, s.cache
    sm = 1.0 / math.sqrt(576)
    g = torch.Generator().manual_seed(int(hit * 1000))
    q = (torch.randn((s.B, H, 576), generator=g) * 0.5).to(device=dev, dtype=torch.bfloat16)
    trace = PeriodicTrace(s.B, s.K, s.S, s.ctx, hit, seed=int(hit * 1000) + 1, device=dev)
    buf = torch.empty((s.B, s.K), dtype=torch.int32, device=dev)  # the step's top-k, read by every graph
    fmt = RowFormat.FP8_DS_MLA
    cuda = dev.type == "cuda"
    res = {"hit": hit, "trace": "periodic", "miss_rate": trace.miss_rate}
    t = 0
    # the hot buffers reach the steady state before anything is timed
    warm = trace.warmup_steps
    resident_fn = lambda: be.decode(q, s.resident[0], s.resident_idx(buf), sm_scale=sm, row_format=fmt)  # noqa: E731
    res["resident"], _, t, _ = run_steps(resident_fn, trace, buf, t, warmup=a.warmup, reps=a.reps,
                                         flush=s.flush.flush, cuda=cuda)
    layers = {m: DecodeLayer(c, be, overlap=Overlap.parse(m)) for m in ("serial", "split")}
    for m in ("serial", "split"):
        if m in a.modes:
            res[m], _, t, rate = run_steps(lambda m=m: layers[m](0, s.req, buf, q, sm_scale=sm), trace, buf, t,
                                           warmup=warm + a.warmup, reps=a.reps, flush=s.flush.flush,
                                           cache=c, cuda=cuda)
            res[m]["measured_miss_rate"] = rate
    if "auto" in a.modes:
        # called eagerly, as an engine would: on CUDA with graphs=True (a graph per mode,
        # replayed from the call), timed as GPU time behind a sleep kernel. The warm-up
        # covers both modes' first timings and two exploring calls (decode.auto), so the
        # timed steps are the steady state; each rep's sleep makes its timing GPU time only
        auto = DecodeLayer(c, be, overlap=Overlap.AUTO, graphs=cuda)
        res["auto"], _, t, rate = run_steps(lambda: auto(0, s.req, buf, q, sm_scale=sm), trace, buf, t,
                                            warmup=warm + a.warmup + 2 * (ModeChooser.MIN_SAMPLES + 2) + 2 * ModeChooser.EXPLORE_EVERY,
                                            reps=a.reps,
                                            flush=s.flush.flush, cache=c, cuda=cuda, eager=True)
        res["auto"]["measured_miss_rate"] = rate
        res["auto"]["choice"] = auto.auto_report()
        res["auto"]["graphs"] = auto.graphs.report() if auto.graphs is not None else None
    res["staging_alone"], _, t, rate = run_steps(lambda: c.resolve(0, s.req, buf, validate=False), trace, buf, t,
                                                 warmup=warm + a.warmup, reps=a.reps, flush=s.flush.flush,
                                                 cache=c, cuda=cuda)
    res["staging_alone"]["measured_miss_rate"] = rate
    # outputs: one more step, the same top-k through resident attention and the serial layer
    buf.copy_(trace.step(t))
    ref = resident_fn()
    out = layers["serial"](0, s.req, buf, q, sm_scale=sm)
    res["max_rel_diff"] = max_diff(out, ref)
    add_ratios(res)
    return res


def add_prefix_ratios(r: dict, cases: list) -> None:
    """Each mode's median with prefix caching on over the same case's with it off (same
    backend, B, hit rate, earlier in ``cases``): ``ratio_vs_prefix_off``."""
    for c in cases:
        if (c.get("backend"), c.get("B"), c.get("hit"), c.get("prefix")) == (r["backend"], r["B"], r["hit"], "off"):
            for m in ("serial", "split", "staging_alone"):
                if m in r and m in c:
                    r[m]["ratio_vs_prefix_off"] = r[m]["median_us"] / c[m]["median_us"]


def print_case(r: dict, name: str, B: int, h: int) -> None:
    line = f"{name:8s} B={B:4d} hit={h:3d}%" + {"off": "", "on": " prefix on", "shared": f" shared, cached={r['cached_tokens']}"}[r["prefix"]]
    line += f"  resident {r['resident']['median_us']:8.1f} us"
    for m in ("serial", "split", "auto"):
        if m in r:
            hid = r[m].get("staging_hidden")
            line += f" | {m} {r[m]['ratio_vs_resident']:.2f}x" + (f" hid {hid:.0%}" if hid is not None else "")
            if m == "auto" and "ratio_vs_better" in r[m]:
                chosen = sorted({v["chosen"] for v in r[m]["choice"].values()} - {None})
                line += f" ({r[m]['ratio_vs_better']:.3f}x the better, runs {'/'.join(chosen) or '-'})"
            if "ratio_vs_prefix_off" in r[m]:
                line += f" (vs off {r[m]['ratio_vs_prefix_off']:.3f}x)"
    if "prefetch_2layers" in r:
        line += (f" | 2 layers split {r['split_2layers']['ratio_vs_resident']:.2f}x prefetch "
                 f"{r['prefetch_2layers']['ratio_vs_resident']:.2f}x")
    line += f" | staging {r['staging_alone']['median_us']:.1f} us"
    if "hit_attention_alone" in r:
        line += f", hit attn {r['hit_attention_alone']['median_us']:.1f} us"
    if "measured_miss_rate" in r.get("serial", {}):
        line += f" | misses {r['serial']['measured_miss_rate']:.4f} (trace {r['miss_rate']:.4f})"
    print(line, flush=True)
    for progs, row in r.get("sweep", {}).items():
        print(f"    programs {progs:>4s}: serial {row['serial']['ratio_vs_resident']:.2f}x split "
              f"{row['split']['ratio_vs_resident']:.2f}x "
              f"staging alone {row['staging_alone']['median_us']:.1f} us", flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    if not common.out_ok(a.out, "bench_layer"):
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    report = {"benchmark": "bench_layer", "env": common.environment(dev), "args": vars(a), "cases": []}
    for B in a.batch:
        ctx = a.context if B <= 64 else a.context_256
        for shared in ([0, -1, a.shared_prefix] if a.shared_prefix else [0]):
            s = Setup(B, ctx, a, dev, shared=shared)
            for name in a.backends:
                be, why = make_backend(name, a, dev, a.heads)
                if be is None:
                    print(f"{name}: skipped ({why})")
                    report["cases"].append({"backend": name, "B": B, "skipped": why})
                    continue
                for h in a.hits:
                    r = (bench_case_periodic if a.trace == "periodic" else bench_case)(s, be, h / 100.0, a)
                    r.update(backend=name, B=B, context=ctx, shared_prefix=max(shared, 0), cached_tokens=s.cached,
                             prefix="off" if shared == 0 else "on" if shared < 0 else "shared")
                    if shared:
                        add_prefix_ratios(r, report["cases"])
                    report["cases"].append(r)
                    print_case(r, name, B, h)
            del s
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if a.out:
        common.write_json(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
