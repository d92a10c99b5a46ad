"""Capacity benchmark: each tier's largest decode batch on one GPU, and its tokens/s.

For each context (default 32K, 64K, 128K): the largest batch of the resident tier (KV
pages and indexer keys on the GPU) and of hisparse (hot buffers, slot state and indexer
keys on the GPU, rows in the pinned host pool), sized for the full model
(``hisparse_tools.capacity.tier_limits``: ``hisparse plan``'s formulas, the same
numbers it prints) and saying where each limit came from (gpu / host / max_seqs). Then
the mini engine serves each tier at its largest batch (synthetic contexts, a short
prefilled tail, all requests decoding together) under CUDA graphs, with the MoE
stand-in of one H200's share of a DeepSeek-V3.2 layer
(``hisparse_tools.mini_engine.ffn.v32_share_at``), ``--run-layers`` layers standing for
the model's ``--layers``: decode tokens/s as measured and scaled to the full depth,
their ratio hisparse / resident, hisparse's hit rate, min / median / p99 of the
replayed steps, and the outputs of the requests both runs serve compared (within the
mini engine's tolerance). ``--same-batch`` also runs hisparse at the resident batch
(the per-step overhead at equal batch) and compares its outputs with the resident's
(the like-for-like check, which sets the exit status) and with hisparse's own at its
largest batch (what the batch size alone changes: batched GEMMs pick other kernels).
``--index-share N`` sizes and runs a model whose every N-th layer runs the indexer and
the others reuse its top-k (IndexCache's Full /
Shared layers: indexer keys only in the Full layers, for both tiers); ``--prefetch``
has hisparse stage each Shared layer's rows while the layer before it computes (with
``--index-correlation A`` > 0 the mini engine's Full layers select overlapping positions
and the prefetch into them is a prediction). Each context reports the model's
adjacent-layer top-k overlap (an eager probe of two requests); with ``--prefetch
--same-batch`` hisparse also runs without prefetch at the resident batch, and the
difference in misses gives the prefetch's precision, recall and wasted bytes on the
same trace. ``--buffer S`` sizes and runs hisparse with S hot slots per (layer, request)
(default 2 x top-k): more slots mean fewer misses and fewer requests; the buffer fills
over the first decode steps, so compare buffer sizes with ``--decode-steps`` long enough
for the timed steps to be past that. ``--pool-rows auto|N`` runs hisparse with the elastic
device tier (``HiSparseConfig.device_pool_rows``: requests resident in device pages of 64
rows, hot buffers included, until a spill demotes them): ``auto`` gives every hisparse run
the rows the resident tier keeps for its KV at that context (its batch x the context, per
layer: every byte of its KV, the indexer keys aside), or no pool where those rows don't
cover the run's hot buffers plus one page; ``budget`` gives each run the rows the GPU's KV
budget (the memory the resident tier is sized from, its unused remainder included) holds
at the run's batch once hisparse's other per-request GPU bytes (indexer keys, slot
state, row maps) are taken out; ``N`` gives every hisparse run N rows per
layer (refused up front below a run's hot buffers plus one page). The runs then report
the lookups resolved to resident rows, the spills and the rows they seeded.

``--sweep`` runs, instead of the largest batches, a batch sweep per context
(``benchmarks.capacity_sweep``): batches 1, 2, 4, ... up to hisparse's largest, plus the
resident tier's largest and hisparse's (``--sweep-batches N [N ...]`` gives them; one
above hisparse's largest is left out, said so), and at each batch the resident tier
(where the batch fits it), hisparse with fixed hot buffers (no pool) and hisparse with
the elastic pool (``--pool-rows N``, else ``auto`` as above: no pool, and no elastic run,
where those rows don't cover the batch's hot buffers plus a page), each for
``--decode-steps``. Per batch: tokens/s of each, elastic / resident and fixed / resident
by wall and by the replays' GPU time, each hisparse run's miss rate, the elastic run's
requests that finished resident / hot and its spills, the outputs at the batch compared
(the like-for-like check, which sets the exit status); the targets flagged: elastic >=
0.97x resident at every batch the resident tier fits, elastic's miss rate <= fixed's at
every batch. The table is printed, everything goes in ``--out`` (written after every
batch), and ``--plot FILE`` writes a PNG of tokens/s and miss rate vs batch (needs
matplotlib).

Exit status: 1 when outputs differ beyond tolerance or a run fails, 2 bad input, 4 --plot
without matplotlib, else 0.

  python -m benchmarks.bench_capacity --out capacity.json [--contexts 131072] [--run-layers 4]
  python -m benchmarks.bench_capacity --dry-run     # tiny shapes on CPU (interpreter), padded decode
  python -m benchmarks.bench_capacity --pool-rows auto --contexts 131072   # hisparse with the elastic tier
  python -m benchmarks.bench_capacity --sweep --contexts 128K --out sweep.json --plot sweep.png
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from benchmarks import common

common.interpret_dry_run(with_gpu=True)  # a dry run is on the CPU; before hisparse loads

from hisparse_tools.capacity import Budget, RunShape, engine_config, measure, tier_limits  # noqa: E402
from hisparse_tools.fields import plain_dict  # noqa: E402
from hisparse_tools.mini_engine import adjacent_layer_overlap, compare  # noqa: E402
from hisparse_tools.mini_engine.ffn import v32_share_at  # noqa: E402
from hisparse_tools.mini_engine.graphs import DecodeMode  # noqa: E402
from hisparse.config import DEVICE_PAGE_ROWS  # noqa: E402
from hisparse_tools.sizing import HOT_ALIGN, hot_buffer_rows  # noqa: E402
from hisparse_tools.units import fmt_bytes, parse_bytes, parse_count, parse_rows, parse_tokens  # noqa: E402
from hisparse_tools.report import PlotUnavailable, require_matplotlib, table  # noqa: E402
from benchmarks import capacity_sweep  # noqa: E402


def pool_rows_arg(text: str) -> int | str:
    """``--pool-rows``: ``auto``, ``budget`` or a row count >= 1 (``1M`` ...)."""
    if text in ("auto", "budget"):
        return text
    try:
        n = parse_rows(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'budget' or a row count >= 1, got {text!r}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Budget()
    ap.add_argument("--contexts", nargs="+", type=parse_tokens, default=None, help="[32K 64K 128K]")
    ap.add_argument("--layers", type=int, default=d.num_layers, help="model layers the sizing is for [61]")
    ap.add_argument("--gpu-total", type=parse_bytes, default=d.gpu_total, help="GPU memory [141GB]")
    ap.add_argument("--reserve", type=parse_bytes, default=d.reserve,
                    help="weights + activations + slack [141GB - 80GiB: plan's default 80 GiB for KV]")
    ap.add_argument("--host-memory", type=parse_bytes, default=d.host_memory, help="host pool budget [1TiB]")
    ap.add_argument("--max-seqs", type=int, default=d.max_seqs)
    ap.add_argument("--buffer", dest="hot_rows", type=common.positive_int, default=None, metavar="S",
                    help="hisparse's hot LRU slots per (layer, request) [2 x top-k]: fewer misses, fewer requests")
    ap.add_argument("--pool-rows", type=pool_rows_arg, default=None, metavar="auto|budget|N",
                    help="hisparse's device pool (the elastic tier), rows per layer, hot buffers included: auto = "
                         "the rows the resident tier keeps for its KV at each context (its batch x the context); "
                         "budget = the rows the GPU's KV budget (what the resident tier is sized from) holds at "
                         "the run's batch once hisparse's other per-request GPU bytes (indexer keys, slot state, "
                         "maps) are taken out; N = the same N for every hisparse run [none]")
    ap.add_argument("--run-layers", type=int, default=4, help="layers the measured runs have [4]")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1344, help="mini model width (see v32_share_at) [1344]")
    ap.add_argument("--ffn", choices=["none", "mlp", "moe"], default="moe")
    ap.add_argument("--ffn-routing", choices=["content", "token"], default="content",
                    help="MoE: experts chosen from the hidden state, or from the input token's embedding "
                         "(token: rounding-level differences, e.g. a split layer's, can't reroute a token, so "
                         "the output comparison sees the attention's numerics alone) [content]")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--locality", type=common.locality, default=None,
                    help="how alike consecutive indexer queries are, in [0, 1): higher means more "
                         f"hot-row reuse, a higher hit rate [{RunShape.locality}; --dry-run 0.9]")
    ap.add_argument("--max-batch", type=common.positive_int, default=None,
                    help="cap the measured batches (not the search), >= 1 [no cap]")
    ap.add_argument("--decode-mode", choices=[m.value for m in DecodeMode], default=None,
                    help="graphs (default on CUDA) | padded (default for --dry-run) | eager")
    ap.add_argument("--same-batch", action="store_true", help="also run hisparse at the resident batch")
    ap.add_argument("--index-share", type=int, default=1, metavar="N",
                    help="only every N-th layer runs an indexer; the next N - 1 reuse its top-k [1]")
    ap.add_argument("--index-correlation", type=common.locality, default=0.0, metavar="A",
                    help="the Full layers' indexers share a common part with weight A in [0, 1), so adjacent "
                         "layers select overlapping positions [0: independent]")
    ap.add_argument("--prefetch", action="store_true",
                    help="hisparse: stage a layer's top-k into the next layer while it computes: into Shared "
                         "layers (exact), into Full layers as a prediction with --index-correlation > 0")
    ap.add_argument("--sync-steps", dest="async_steps", action="store_false",
                    help="finish each step before the host prepares the next (default: the host works "
                         "one step ahead, as an engine's async scheduler does)")
    ap.add_argument("--overlap", choices=["serial", "split"], default="serial",
                    help="hisparse decode: miss staging before attention (serial) or hidden behind the hit "
                         "attention (split)")
    ap.add_argument("--backend", default=None, help="attention backend (default triton)")
    ap.add_argument("--flashmla-lib", default=None)
    ap.add_argument("--profile", type=parse_count, default=0, metavar="N",
                    help="the last N replayed steps of each run go under torch.profiler (not timed): "
                         "GPU time per step and its top kernels [0: off]")
    ap.add_argument("--sweep", action="store_true",
                    help="per context, a batch sweep from 1 to hisparse's largest batch: resident (where it "
                         "fits), hisparse with fixed hot buffers and with the elastic pool (--pool-rows, else "
                         "auto) at each batch, instead of the largest batches")
    ap.add_argument("--sweep-batches", type=common.positive_int, nargs="+", default=None, metavar="N",
                    help="--sweep's batches [1, 2, 4, ... up to hisparse's largest, plus the resident's "
                         "largest and hisparse's]")
    ap.add_argument("--plot", default=None, metavar="FILE",
                    help="--sweep: write a PNG of tokens/s and miss rate vs batch (needs matplotlib)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU; figures mean nothing")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def setup(a: argparse.Namespace) -> tuple[Budget, RunShape, list[int]]:
    if a.dry_run:
        # 2 layers, top-k 8, 16 hot rows: at 64 tokens resident fits 2 requests, hisparse 5 (host-bound)
        budget = Budget(num_layers=2, gpu_total=300_000, reserve=50_000, host_memory=420_000, top_k=8,
                        hot_rows=a.hot_rows or 16, block_size=16, max_seqs=64, index_share=a.index_share)
        ffn = dict(ffn=a.ffn, ffn_intermediate=16, ffn_experts=4, ffn_active=2, ffn_shared=1,
                   ffn_routing=a.ffn_routing)
        mode = DecodeMode(a.decode_mode or "padded")
        shape = RunShape(run_layers=2, num_heads=2, hidden=32, indexer_dim=16, vocab=97, ffn=ffn, decode_steps=3,
                         tail=8, locality=0.9 if a.locality is None else a.locality, device="cpu", decode_mode=mode, cache_kernels="torch",
                         overlap=a.overlap, prefetch=a.prefetch, index_correlation=a.index_correlation)
        return budget, shape, a.contexts or [64, 96]
    budget = Budget(num_layers=a.layers, gpu_total=a.gpu_total, reserve=a.reserve, host_memory=a.host_memory,
                    max_seqs=a.max_seqs, index_share=a.index_share, hot_rows=a.hot_rows)
    ffn = {k: v for k, v in v32_share_at(a.hidden).items() if k.startswith("ffn")}
    ffn["ffn"] = a.ffn
    ffn["ffn_routing"] = a.ffn_routing
    shape = RunShape(run_layers=a.run_layers, num_heads=a.heads, hidden=a.hidden, ffn=ffn,
                     decode_steps=a.decode_steps, device="cuda", decode_mode=DecodeMode(a.decode_mode or "graphs"),
                     backend=a.backend or "triton", flashmla_lib=common.flashmla_lib(a.flashmla_lib),
                     overlap=a.overlap, prefetch=a.prefetch, index_correlation=a.index_correlation,
                     async_steps=a.async_steps, locality=RunShape.locality if a.locality is None else a.locality)
    return budget, shape, a.contexts or [32768, 65536, 131072]


def pool_minimum(budget: Budget, batch: int) -> int:
    """The least pool a hisparse run of ``batch`` requests can use: its hot buffers,
    batch x (S + 1) rows rounded up to 64, plus one page of 64 rows."""
    S = budget.hot_rows if budget.hot_rows is not None else 2 * budget.top_k
    return hot_buffer_rows(batch, S + 1) + DEVICE_PAGE_ROWS


def hisparse_batches(lim: dict, a: argparse.Namespace) -> list[int]:
    """The batches the hisparse runs of one context use (--same-batch adds the resident's;
    --max-batch caps them; a batch of 0 is skipped; --sweep: the sweep's batches)."""
    if a.sweep:
        return capacity_sweep.sweep_batches(lim, a.sweep_batches, a.max_batch)[0]
    out = [lim["hisparse"]["batch"]] + ([lim["resident"]["batch"]] if a.same_batch else [])
    return [min(b, a.max_batch) if a.max_batch else b for b in out if b]


def pool_for(budget: Budget, lim: dict, batch: int, a: argparse.Namespace) -> dict:
    """The device pool of a hisparse run of ``batch`` requests at ``lim['context']``:
    {rows (None: no pool), from, note}."""
    if a.pool_rows is None:
        return {"rows": None, "from": None}
    least = pool_minimum(budget, batch)
    if a.pool_rows not in ("auto", "budget"):
        return {"rows": a.pool_rows, "from": "given", "minimum": least}
    if a.pool_rows == "budget":
        hs = lim["hisparse"]
        kv = (budget.kv_bytes - batch * hs["nonrow_gpu_bytes_per_request"]) // (budget.num_layers * hs["row_bytes"])
        what = "the KV budget's"
        d = {"from": f"budget: the GPU's KV budget ({budget.kv_bytes} bytes) less {batch} x "
                     f"{hs['nonrow_gpu_bytes_per_request']} bytes of hisparse's other per-request GPU state, "
                     f"over {budget.num_layers} layers x {hs['row_bytes']} bytes", "minimum": least}
    else:
        kv = lim["resident"]["kv_rows_per_layer"]
        what = "the resident tier's"
        d = {"from": f"auto: the resident tier's KV, {lim['resident']['batch']} x {lim['context']} rows per layer",
             "minimum": least, "resident_kv_bytes": lim["resident"]["kv_bytes"]}
    if kv < least:
        return d | {"rows": None, "note": f"no pool: {what} {kv} KV rows per layer are fewer than the "
                                          f"{least} a batch of {batch} needs (hot buffers + one page)"}
    return d | {"rows": kv}


def check_pool_rows(budget: Budget, contexts: list[int], a: argparse.Namespace) -> None:
    """--pool-rows N must give every hisparse run its hot buffers plus one page (the
    largest batch short of them is named)."""
    if not isinstance(a.pool_rows, int):
        return
    for ctx in contexts:
        lim = tier_limits(budget, ctx)
        for b in sorted(hisparse_batches(lim, a), reverse=True):
            if a.pool_rows < pool_minimum(budget, b):
                least = pool_minimum(budget, b)
                raise ValueError(f"--pool-rows {a.pool_rows} is below {least}, the hot buffers of hisparse's batch of "
                                 f"{b} at context {ctx} (rounded up to {HOT_ALIGN}) plus one page of "
                                 f"{DEVICE_PAGE_ROWS} rows; give at least {least}, auto or budget")


def check_buffer(budget: Budget) -> None:
    """--buffer S: every hisparse step may select top-k distinct rows, so S >= top-k."""
    if budget.hot_rows is not None and budget.hot_rows < budget.top_k:
        raise ValueError(f"--buffer {budget.hot_rows} is below top-k ({budget.top_k}): one step may select "
                         f"top-k distinct rows; give at least {budget.top_k}")


def run_context(budget: Budget, shape: RunShape, ctx: int, a: argparse.Namespace) -> dict:
    lim = tier_limits(budget, ctx)
    out = {"limits": lim, "runs": {}}
    print(f"[capacity] context {ctx}: resident {lim['resident']['batch']} ({lim['resident']['bound']}), "
          f"hisparse {lim['hisparse']['batch']} ({lim['hisparse']['bound']}; GPU allows "
          f"{lim['hisparse']['gpu_limit']}, host {lim['hisparse']['host_limit']})", flush=True)
    ov = adjacent_layer_overlap(engine_config(budget, shape, context=ctx, batch=max(lim["resident"]["batch"], 1)))
    out["adjacent_layer_overlap"] = ov
    print("[capacity]   adjacent-layer top-k overlap (layer l+1's entries layer l selected): "
          + " ".join("-" if x is None else f"{x:.3f}" for x in ov), flush=True)
    plan_runs = [("resident", "resident", lim["resident"]["batch"]), ("hisparse", "hisparse", lim["hisparse"]["batch"])]
    if a.same_batch:
        plan_runs.append(("hisparse_same_batch", "hisparse", lim["resident"]["batch"]))
        if shape.prefetch:  # the same trace without prefetch: what the prefetch saved and wasted
            plan_runs.append(("hisparse_same_batch_no_prefetch", "hisparse", lim["resident"]["batch"]))
        if lim["resident"]["batch"] > 1:  # how much the batch size alone moves the outputs
            plan_runs.append(("resident_smaller_batch", "resident", lim["resident"]["batch"] - 1))
    raw = {}
    for name, kind, batch in plan_runs:
        if batch == 0:
            out["runs"][name] = {"skipped": "not even one request fits"}
            continue
        b = min(batch, a.max_batch) if a.max_batch else batch
        run_shape = dataclasses.replace(shape, prefetch=False) if name.endswith("_no_prefetch") else shape
        pool = pool_for(budget, lim, b, a) if kind == "hisparse" else {"rows": None, "from": None}
        out["runs"][name], raw[name] = run_one(budget, run_shape, ctx, a, name=name, kind=kind, batch=b,
                                               pool=pool, capped=b < batch)
    if "resident" in raw and "hisparse" in raw:
        r, h = out["runs"]["resident"]["decode"], out["runs"]["hisparse"]["decode"]
        out["ratio_tokens_per_s"] = (h["tokens_per_s"] / r["tokens_per_s"]
                                     if r["tokens_per_s"] and h["tokens_per_s"] else None)
        if r.get("tokens_per_s_gpu") and h.get("tokens_per_s_gpu"):  # the replays' GPU time alone
            out["ratio_tokens_per_s_gpu"] = h["tokens_per_s_gpu"] / r["tokens_per_s_gpu"]
        # the requests both runs serve (ids 0 .. the smaller batch - 1) see the same inputs
        out["compare"] = compare_served(raw["resident"][0], raw["resident"][1], raw["hisparse"][1])
    if "hisparse_same_batch" in raw and "resident" in raw:
        r, h = out["runs"]["resident"]["decode"], out["runs"]["hisparse_same_batch"]["decode"]
        out["same_batch_step_ratio"] = (h["step_ms"]["median_ms"] / r["step_ms"]["median_ms"]
                                        if r["step_ms"]["median_ms"] and h["step_ms"]["median_ms"] else None)
        if r.get("gpu_step_ms") and h.get("gpu_step_ms"):
            out["same_batch_gpu_step_ratio"] = h["gpu_step_ms"]["median_ms"] / r["gpu_step_ms"]["median_ms"]
        out["compare_same_batch"] = compare(raw["resident"][0], raw["resident"][1], raw["hisparse_same_batch"][1])
    if "hisparse_same_batch" in raw and "hisparse" in raw:
        # hisparse at the resident's batch vs at its own, the same requests and cache code:
        # what the batch size alone does to the outputs between the two batches compared
        # above (when the same-batch run is bitwise the resident's, the same figures)
        out["compare_hisparse_batch_sizes"] = compare_served(raw["hisparse_same_batch"][0],
                                                             raw["hisparse_same_batch"][1], raw["hisparse"][1])
    if "hisparse_same_batch_no_prefetch" in raw:
        out["prefetch_quality"] = prefetch_quality(out["runs"]["hisparse_same_batch"]["cache"],
                                                   out["runs"]["hisparse_same_batch_no_prefetch"]["cache"],
                                                   raw["hisparse_same_batch"][0].cache_config().row_bytes)
    if "resident_smaller_batch" in raw and "resident" in raw:
        # resident at B - 1 vs resident at B, the same requests: batched GEMMs (projections,
        # MoE) round differently at another batch size, so runs at different batches are
        # compared for what they are, and the like-for-like check is the same-batch one
        sm = raw["resident_smaller_batch"]
        out["compare_resident_batch_sizes"] = compare(sm[0], sm[1], raw["resident"][1])
    return out


def run_context_sweep(budget: Budget, shape: RunShape, ctx: int, a: argparse.Namespace,
                      on_batch=lambda out: None) -> dict:
    """--sweep: one context's batch sweep (``capacity_sweep.run_sweep`` with this
    module's runs); ``on_batch(out)`` after every batch, with what the sweep has so far."""
    lim = tier_limits(budget, ctx)
    batches, notes = capacity_sweep.sweep_batches(lim, a.sweep_batches, a.max_batch)
    out = {"limits": lim, "sweep_batches": batches, "notes": notes, "rows": []}
    print(f"[capacity] context {ctx}: resident {lim['resident']['batch']} ({lim['resident']['bound']}), "
          f"hisparse {lim['hisparse']['batch']} ({lim['hisparse']['bound']}); sweep over batches {batches}"
          + "".join(f"; {n}" for n in notes), flush=True)
    elastic = argparse.Namespace(**(vars(a) | {"pool_rows": "auto" if a.pool_rows is None else a.pool_rows}))
    return capacity_sweep.run_sweep(
        out, lim, batches,
        run=lambda name, kind, b, pool: run_one(budget, shape, ctx, a, name=name, kind=kind, batch=b, pool=pool),
        elastic_pool=lambda b: pool_for(budget, lim, b, elastic), on_batch=lambda: on_batch(out))


def run_one(budget: Budget, shape: RunShape, ctx: int, a: argparse.Namespace, *, name: str, kind: str,
            batch: int, pool: dict, capped: bool = False) -> tuple[dict, tuple]:
    """One measured run: ``kind`` (resident / hisparse) serving ``batch`` requests of
    context ``ctx`` with ``pool`` (:func:`pool_for`; ``rows`` None: no device pool).
    Returns (its summary, (config, raw result with the outputs)) and prints both ends."""
    cfg = engine_config(budget, shape, context=ctx, batch=batch, pool_rows=pool["rows"])
    t0 = time.perf_counter()
    where = ""
    if pool["from"] is not None:
        where = (f", device pool {pool['rows']} rows per layer ({pool['from']})" if pool["rows"]
                 else f", {pool['note']}")
    print(f"[capacity]   {name}: batch {batch}{' (capped)' if capped else ''}, {shape.run_layers} layers"
          f"{where} ...", flush=True)
    prof = None
    if a.profile:  # the replays after the timed ones (decode steps - 2: padded, capture)
        prof = (max(shape.decode_steps - 2 - a.profile, 1), a.profile)
    s, res = measure(cfg, kind, decode_mode=shape.decode_mode, full_layers=budget.num_layers, profile=prof)
    s["wall_s"] = time.perf_counter() - t0
    s["config"] = plain_dict(cfg)
    if kind == "hisparse" and pool["from"] is not None:
        s["pool"] = pool
    dec = s["decode"]
    print(f"[capacity]   {name}: {dec['tokens_per_s'] or 0:.1f} tok/s at {shape.run_layers} layers "
          f"(median step {dec['step_ms']['median_ms'] or 0:.3f} ms over {dec['step_ms']['n']} "
          f"{dec['steps_from']}"
          + (f"; GPU time {dec['gpu_step_ms']['median_ms']:.3f} ms" if dec.get("gpu_step_ms") else "")
          + f"), {s['wall_s']:.1f} s", flush=True)
    if s.get("profile"):
        print(format_profile(name, s["profile"]), flush=True)
    return s, (cfg, res)


def compare_served(cfg, a: dict, b: dict) -> dict:
    """``compare`` over the requests both runs served: request ids 0 .. n - 1 of the run
    with fewer (hisparse's largest batch can be the smaller one, with a large --buffer
    at a short context)."""
    if not set(a["outputs"]) <= set(b["outputs"]):
        a, b = b, a
    return compare(cfg, a, b)


def prefetch_quality(with_pf: dict, without: dict, row_bytes: int) -> dict:
    """Two runs of one trace, with and without prefetch (their summaries' ``cache``), per
    layer that received prefetches and in total:

      useful     misses the prefetch removed, net: a prefetched row that evicted a row
                 the layer then needed counts against it (so precision can be < 0)
      precision  useful / rows prefetched
      recall     useful / misses without prefetch, over the layers that received
                 prefetches (``recall``) and over all layers (``recall_all_layers``)
      wasted     (rows prefetched - useful) x row bytes (extra bytes moved, net)
    """
    layers, tot = [], {"prefetched": 0, "useful": 0, "misses_without": 0}
    for i, (pf, m1, m0) in enumerate(zip(with_pf["layer_prefetch_rows"], with_pf["layer_misses"],
                                         without["layer_misses"])):
        if not pf:
            continue
        useful = m0 - m1
        layers.append({"layer": i, "prefetched": pf, "useful": useful, "precision": useful / pf,
                       "recall": useful / m0 if m0 else None, "wasted_bytes": (pf - useful) * row_bytes})
        tot["prefetched"] += pf
        tot["useful"] += useful
        tot["misses_without"] += m0
    p, u, m = tot["prefetched"], tot["useful"], tot["misses_without"]
    m_all = sum(without["layer_misses"])
    return {"layers": layers, "precision": u / p if p else None, "recall": u / m if m else None,
            "recall_all_layers": u / m_all if m_all else None,
            "wasted_bytes": (p - u) * row_bytes, "prefetched_bytes": p * row_bytes}


def format_profile(name: str, p: dict, top: int = 12) -> str:
    """The top kernels of a run's profiled replays, per step, and the idle gaps of their timeline."""
    lines = [f"[capacity]   {name}: {p['steps']} profiled replays, {p['busy_us_per_step'] / 1e3:.3f} ms of "
             f"{p['activity']} time per step (overlaps count twice); top:"]
    for k in p["top"][:top]:
        lines.append(f"[capacity]     {k['us_per_step'] / 1e3:8.3f} ms  {100 * (k['share'] or 0):5.1f}%  "
                     f"x{k['calls_per_step']:g}  {k['name'][:110]}")
    if p.get("span_us_per_step"):
        lines.append(f"[capacity]   {name}: step span {p['span_us_per_step']:.1f} us, idle {p['idle_us_per_step']:.1f} us "
                     "(nothing running); largest gaps (us per step, count, after -> before):")
        for g in p["gaps"][:top]:
            lines.append(f"[capacity]     {g['us_per_step']:8.1f}  x{g['per_step']:g}  {g['after'][:50]} -> {g['before'][:50]}")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    rows = []
    for ctx, c in result["contexts"].items():
        for name, s in c["runs"].items():
            if "skipped" in s:
                rows.append([ctx, name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", s["skipped"]])
                continue
            tier = "hisparse" if name.startswith("hisparse") else "resident"
            d, st = s["decode"], s["decode"]["step_ms"]
            full = d.get("full_depth", {})
            hit = s.get("cache", {}).get("hit_rate")
            l0 = s.get("cache", {}).get("layer_hit_rates")  # layer 0 gets no prefetch: the trace's LRU rate
            rows.append([ctx, name, d["batch"], c["limits"][tier]["bound"] if name == tier else "-",
                         f"{st['min_ms']:.3f}/{st['median_ms']:.3f}/{st['p99_ms']:.3f}" if st["n"] else "-",
                         f"{d['tokens_per_s']:.1f}" if d["tokens_per_s"] else "-",
                         f"{full['tokens_per_s']:.1f}" if full else "-",
                         "-" if hit is None else f"{hit:.4f}",
                         f"{l0[0]:.4f}" if l0 else "-",
                         s.get("cache", {}).get("prefetch_rows") or "-",
                         f"{c['ratio_tokens_per_s']:.2f}" if name == "hisparse" and c.get("ratio_tokens_per_s")
                         else "-",
                         f"{d['gpu_step_ms']['median_ms']:.3f}" if d.get("gpu_step_ms") else "-",
                         f"{c['ratio_tokens_per_s_gpu']:.2f}" if name == "hisparse" and c.get("ratio_tokens_per_s_gpu")
                         else "-", ""])
    head = ["context", "run", "batch", "bound", "step min/med/p99 ms", "tok/s", "tok/s full depth",
            "hits (prefetched count)", "layer-0 hits", "prefetched rows", "x resident", "GPU ms/step", "x resident (GPU)", ""]
    lines = [table(head, rows)]
    for ctx, c in result["contexts"].items():
        for key, what in (("compare_same_batch", "hisparse vs resident, same batch"),
                          ("compare", "hisparse vs resident, each at its largest batch"),
                          ("compare_hisparse_batch_sizes",
                           "hisparse at the resident's batch vs at its own (the batch size alone, these two sizes)"),
                          ("compare_resident_batch_sizes", "resident at B - 1 vs B (the batch size alone)")):
            if key in c:
                k = c[key]
                lines.append(f"context {ctx}: {what}: {k['tokens_compared']} tokens, max rel diff "
                             f"{k['max_rel_diff']:.3e}, argmax mismatches {k['argmax_mismatches']}, "
                             f"{'bitwise equal' if k['bitwise_equal'] else 'WITHIN' if k['within_tolerance'] else 'OUTSIDE'}"
                             f"{'' if k['bitwise_equal'] else ' tolerance'}")
        if c.get("prefetch_quality"):
            q = c["prefetch_quality"]
            fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            lines.append(f"context {ctx}: prefetch at the resident batch: precision {fmt(q['precision'])}, "
                         f"recall {fmt(q['recall'])} in the layers it staged into "
                         f"({fmt(q['recall_all_layers'])} of all layers' misses), "
                         f"{fmt_bytes(q['prefetched_bytes'])} prefetched, {fmt_bytes(q['wasted_bytes'])} wasted")
        for name, s in c["runs"].items():
            p, k = s.get("pool"), s.get("cache", {})
            if not p:
                continue
            if p["rows"] is None:
                lines.append(f"context {ctx}: {name}: {p['note']}")
                continue
            looked = sum(k.get(x) or 0 for x in ("hits", "misses", "resident_rows"))
            lines.append(f"context {ctx}: {name}: device pool {p['rows']} rows per layer ({p['from']}): "
                         f"{k.get('resident_rows')} of {looked} lookups resolved to resident rows (counted as hits), "
                         f"misses {k.get('misses')}, spills {k.get('spills')}, seeded rows {k.get('seeded_rows')}")
        if c.get("same_batch_step_ratio"):
            gpu = c.get("same_batch_gpu_step_ratio")
            lines.append(f"context {ctx}: same batch, hisparse / resident median step "
                         f"{c['same_batch_step_ratio']:.3f}" + (f", GPU time {gpu:.3f}" if gpu else ""))
    return "\n".join(lines)


def check_sweep_flags(a: argparse.Namespace) -> None:
    """--sweep-batches and --plot belong to --sweep; --same-batch does not combine with it."""
    for flag, given in (("--sweep-batches", a.sweep_batches), ("--plot", a.plot)):
        if given is not None and not a.sweep:
            raise ValueError(f"{flag} needs --sweep")
    if a.sweep and a.same_batch:
        raise ValueError("--same-batch does not combine with --sweep (the sweep runs hisparse at the "
                         "resident's batch already)")
    if a.plot is not None and a.out is not None and Path(a.plot).resolve() == Path(a.out).resolve():
        raise ValueError(f"--plot and --out are the same file ({a.plot}); give two")


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        check_sweep_flags(a)
    except ValueError as e:
        print(f"bench_capacity: {e}", file=sys.stderr)
        return 2
    if not common.out_ok(a.out, "bench_capacity") or not common.out_ok(a.plot, "bench_capacity", "--plot"):
        return 2
    if a.plot is not None:
        try:  # before any run: a missing matplotlib costs no GPU time
            require_matplotlib()
        except PlotUnavailable as e:
            print(f"bench_capacity: {e}", file=sys.stderr)
            return 4
    if not a.dry_run and not torch.cuda.is_available():
        print("bench_capacity: no CUDA device; use --dry-run for the CPU check", file=sys.stderr)
        return 2
    try:
        budget, shape, contexts = setup(a)
        check_buffer(budget)
        check_pool_rows(budget, contexts, a)
        tier_limits(budget, contexts[0])  # the sizing's inputs are valid
        engine_config(budget, shape, context=contexts[0], batch=1)  # the run's config is valid (no allocation)
    except (ValueError, TypeError) as e:
        print(f"bench_capacity: {e}", file=sys.stderr)
        return 2
    result = {"bench": "capacity", "env": common.environment("cpu" if a.dry_run else None),
              "dry_run": a.dry_run, "budget": plain_dict(budget) | {"kv_bytes": budget.kv_bytes},
              "shape": plain_dict(shape), "contexts": {}}
    print(f"[capacity] {result['env']}")
    print(f"[capacity] sizing for {budget.num_layers} layers: GPU {fmt_bytes(budget.gpu_total)} - reserve "
          f"{fmt_bytes(budget.reserve)} = {fmt_bytes(budget.kv_bytes)} for KV, host pool "
          f"{fmt_bytes(budget.host_memory)}; runs: {shape.run_layers} layers, {shape.num_heads} heads, "
          f"hidden {shape.hidden}, ffn {shape.ffn}, decode {shape.decode_mode.value}", flush=True)
    if a.sweep:
        result["sweep"] = {"target_ratio": capacity_sweep.TARGET_RATIO,
                           "elastic_pool_rows": "auto" if a.pool_rows is None else a.pool_rows}
        return sweep_main(a, budget, shape, contexts, result)
    rc = 0
    try:
        for ctx in contexts:
            c = result["contexts"][ctx] = run_context(budget, shape, ctx, a)
            # the like-for-like check: hisparse and resident at the same batch (at different
            # batches the outputs also move with the batch size: compare_resident_batch_sizes)
            for key in (("compare_same_batch",) if "compare_same_batch" in c else ("compare",)):
                if key in c and not c[key]["within_tolerance"]:
                    print(f"[capacity] FAIL: context {ctx}: outputs differ beyond tolerance ({key})", file=sys.stderr)
                    rc = 1
            if a.out:  # after every context: a run cut short keeps what it measured
                common.write_json(a.out, result, indent=2)
        print(format_table(result))
    except Exception as e:  # record the failure in the JSON, then fail loudly
        rc = common.record_failure(result, e)
    if a.out:
        common.write_json(a.out, result, indent=2)
    return rc


def sweep_main(a: argparse.Namespace, budget: Budget, shape: RunShape, contexts: list[int], result: dict) -> int:
    """--sweep: every context's sweep, the table, the JSON (after every batch) and the plot."""
    rc = 0

    def keep(ctx, out):
        result["contexts"][ctx] = out
        if a.out:  # after every batch: a sweep cut short keeps what it measured
            common.write_json(a.out, result, indent=2)
    try:
        for ctx in contexts:
            c = run_context_sweep(budget, shape, ctx, a, on_batch=lambda out, ctx=ctx: keep(ctx, out))
            result["contexts"][ctx] = c
            if c["compare_failures"]:
                print(f"[capacity] FAIL: context {ctx}: outputs differ beyond tolerance at the same batch: "
                      + ", ".join(c["compare_failures"]), file=sys.stderr)
                rc = 1
        print(capacity_sweep.format_sweep(result))
        if a.plot:
            result["plot"] = capacity_sweep.plot_sweep(a.plot, result)
            print(f"wrote {a.plot}")
    except Exception as e:  # record the failure in the JSON, then fail loudly
        rc = common.record_failure(result, e)
    if a.out:
        common.write_json(a.out, result, indent=2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
