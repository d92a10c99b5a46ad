"""The capacity benchmark's batch sweep (``bench_capacity --sweep``): per context, a list
of batches from 1 to hisparse's largest, and at each batch three runs of the same
requests:

  resident  the resident tier (KV pages on the GPU), only where the batch fits it
  fixed     hisparse with fixed hot buffers, no device pool (the LRU design)
  elastic   hisparse with the elastic device tier (``HiSparseConfig.device_pool_rows``):
            ``--pool-rows`` N, else ``auto`` (every row the resident tier keeps for its
            KV at that context); a batch whose hot buffers plus one page don't fit
            those rows has no pool, and its elastic run is skipped (it would be the
            fixed run)

Per batch: tokens/s of each, elastic / resident and fixed / resident by wall time and
by the replays' GPU time (where measured), each hisparse run's miss rate (misses over
lookups; resident rows count as hits), the elastic run's requests that finished
resident / hot (demoted), its spills and seeded rows, and the outputs of the runs at
the batch compared (the like-for-like check). The targets flagged: elastic >=
``TARGET_RATIO`` x resident at every batch the resident tier fits, and a miss rate of
the elastic run no higher than the fixed run's at every batch.

The runs themselves are ``bench_capacity``'s (:func:`run_sweep` takes them as
callables, so this module imports nothing of it); :func:`format_sweep` prints the
table, :func:`plot_sweep` writes the PNG (matplotlib, optional: ``--plot``).
"""

from __future__ import annotations

from typing import Callable

from hisparse_tools.mini_engine import compare
from hisparse_tools.report import require_matplotlib, table

TARGET_RATIO = 0.97  # elastic tokens/s over resident's, where the resident tier fits
RUNS = ("resident", "fixed", "elastic")
NO_POOL = {"rows": None, "from": None}


def default_batches(resident: int, hisparse: int) -> list[int]:
    """1, 2, 4, ... up to hisparse's largest batch, plus the resident tier's largest
    batch and hisparse's own (a tier that fits no request adds nothing)."""
    out = {1 << i for i in range(hisparse.bit_length())}
    out |= {b for b in (resident, hisparse) if b}
    return sorted(b for b in out if b <= hisparse)


def sweep_batches(lim: dict, given: list[int] | None, max_batch: int | None) -> tuple[list[int], list[str]]:
    """The batches of one context (``lim``: ``tier_limits``): ``given`` (--sweep-batches)
    or :func:`default_batches`; a given batch above hisparse's largest is left out, said
    so in the notes; ``max_batch`` caps every batch (as it caps the other runs)."""
    hs, rs = lim["hisparse"]["batch"], lim["resident"]["batch"]
    notes = []
    if not hs:
        return [], [f"no batch: not even one hisparse request fits at context {lim['context']}"]
    if given:
        over = sorted({b for b in given if b > hs})
        if over:
            notes.append(f"batches {over} left out: above hisparse's largest batch ({hs}) at context "
                         f"{lim['context']}")
        batches = sorted({b for b in given if b <= hs})
    else:
        batches = default_batches(rs, hs)
    if max_batch and any(b > max_batch for b in batches):
        notes.append(f"batches above --max-batch {max_batch} capped to it")
        batches = sorted({min(b, max_batch) for b in batches})
    return batches, notes


def miss_rate(cache: dict | None) -> float | None:
    """misses / (hits + resident rows + misses): 1 - the hit rate; None before any lookup."""
    if not cache:
        return None
    n = sum(cache.get(k) or 0 for k in ("hits", "misses", "resident_rows"))
    return (cache.get("misses") or 0) / n if n else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def batch_figures(runs: dict) -> dict:
    """What one batch's runs (summaries, or {"skipped": why}) add up to: tokens/s, the
    ratios, miss rates, the elastic tier's requests and spills, and the targets."""
    dec = {k: runs[k].get("decode", {}) for k in RUNS}
    tps = {k: dec[k].get("tokens_per_s") for k in RUNS}
    gpu = {k: dec[k].get("tokens_per_s_gpu") for k in RUNS}
    ratio = {"elastic_over_resident": _ratio(tps["elastic"], tps["resident"]),
             "fixed_over_resident": _ratio(tps["fixed"], tps["resident"]),
             "elastic_over_resident_gpu": _ratio(gpu["elastic"], gpu["resident"]),
             "fixed_over_resident_gpu": _ratio(gpu["fixed"], gpu["resident"])}
    miss = {k: miss_rate(runs[k].get("cache")) for k in ("fixed", "elastic")}
    e = runs["elastic"]
    k = e.get("cache") or {}
    elastic = {"pool": e.get("pool"), "ran": "skipped" not in e,
               "resident_requests": k.get("finished_resident"), "hot_requests": k.get("finished_hot"),
               "spills": k.get("spills"), "seeded_rows": k.get("seeded_rows"), "resident_rows": k.get("resident_rows"),
               "misses": k.get("misses")}
    r = ratio["elastic_over_resident"]
    rg = ratio["elastic_over_resident_gpu"]
    targets = {
        # None: not applicable (the resident tier doesn't fit the batch, or no elastic run)
        "throughput": None if r is None else r >= TARGET_RATIO,
        "throughput_gpu": None if rg is None else rg >= TARGET_RATIO,
        "miss_rate": (None if miss["elastic"] is None or miss["fixed"] is None
                      else miss["elastic"] <= miss["fixed"] + 1e-12),
    }
    return {"tokens_per_s": tps, "tokens_per_s_gpu": gpu, "ratio": ratio, "miss_rate": miss,
            "elastic": elastic, "targets": targets}


def sweep_targets(rows: list[dict]) -> dict:
    """Each target over the sweep: the batches it applies to, those that missed it, and
    met (None where it applies to none)."""
    out = {"threshold": TARGET_RATIO}
    for key in ("throughput", "throughput_gpu", "miss_rate"):
        seen = [(r["batch"], r["targets"][key]) for r in rows if r["targets"][key] is not None]
        missed = [b for b, ok in seen if not ok]
        out[key] = {"batches": [b for b, _ in seen], "missed": missed, "met": (not missed) if seen else None}
    return out


def run_sweep(out: dict, lim: dict, batches: list[int], *,
              run: Callable[[str, str, int, dict], tuple[dict, tuple]],
              elastic_pool: Callable[[int], dict], on_batch: Callable[[], None] = lambda: None) -> dict:
    """Fill ``out`` (one context's result) with the sweep over ``batches``.

    ``run(name, kind, batch, pool)``: one measured run, (summary, (config, raw result));
    ``elastic_pool(batch)``: the elastic run's pool (``bench_capacity.pool_for``: rows
    None and a note where there is none); ``on_batch()`` after every batch (the caller
    writes its JSON: a sweep cut short keeps what it measured)."""
    rs = lim["resident"]["batch"]
    out.setdefault("rows", [])
    out["compare_failures"] = []
    for b in batches:
        print(f"[capacity]   batch {b}:", flush=True)
        runs, raw = {}, {}
        if b <= rs:
            runs["resident"], raw["resident"] = run("resident", "resident", b, NO_POOL)
        else:
            runs["resident"] = {"skipped": f"above the resident tier's largest batch ({rs})"}
        runs["fixed"], raw["fixed"] = run("fixed", "hisparse", b, NO_POOL)
        pool = elastic_pool(b)
        if pool["rows"] is None:
            runs["elastic"] = {"skipped": pool["note"], "pool": pool}
            print(f"[capacity]   elastic: skipped ({pool['note']})", flush=True)
        else:
            runs["elastic"], raw["elastic"] = run("elastic", "hisparse", b, pool)
        row = {"batch": b, "runs": runs} | batch_figures(runs)
        # the like-for-like check: the same requests at the same batch
        row["compare"] = {}
        for x, y in (("fixed", "resident"), ("elastic", "resident"), ("elastic", "fixed")):
            if x in raw and y in raw:
                c = row["compare"][f"{x}_vs_{y}"] = compare(raw[y][0], raw[y][1], raw[x][1])
                if not c["within_tolerance"]:
                    out["compare_failures"].append(f"batch {b}: {x} vs {y}")
        out["rows"].append(row)
        out["targets"] = sweep_targets(out["rows"])
        on_batch()
    out["targets"] = sweep_targets(out["rows"])
    return out


# ------------------------------------------------------------------ report
def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _flag(ok: bool | None) -> str:
    return "-" if ok is None else "ok" if ok else "MISSED"


def format_sweep(result: dict) -> str:
    """The sweep's table (one row per context and batch) and, per context, the pool, the
    notes, the output comparisons and the targets."""
    rows = []
    for ctx, c in result["contexts"].items():
        for r in c.get("rows", []):
            t, ra, m, e = r["tokens_per_s"], r["ratio"], r["miss_rate"], r["elastic"]
            rows.append([ctx, r["batch"], _f(t["resident"], ".1f"), _f(t["fixed"], ".1f"), _f(t["elastic"], ".1f"),
                         _f(ra["fixed_over_resident"], ".3f"), _f(ra["elastic_over_resident"], ".3f"),
                         _f(ra["fixed_over_resident_gpu"], ".3f"), _f(ra["elastic_over_resident_gpu"], ".3f"),
                         _f(m["fixed"], ".4f"), _f(m["elastic"], ".4f"),
                         f"{e['resident_requests']}/{e['hot_requests']}" if e["ran"] else "no pool",
                         "-" if e["spills"] is None else e["spills"],
                         _flag(r["targets"]["throughput"]), _flag(r["targets"]["throughput_gpu"]),
                         _flag(r["targets"]["miss_rate"])])
    head = ["context", "batch", "resident tok/s", "fixed tok/s", "elastic tok/s", "fixed x res", "elastic x res",
            "fixed x res (GPU)", "elastic x res (GPU)", "fixed miss", "elastic miss", "elastic res/hot",
            "spills", f">= {TARGET_RATIO}x", f">= {TARGET_RATIO}x (GPU)", "miss <= fixed"]
    lines = [table(head, rows),
             "tok/s: at the run's layers; x res: over resident's tokens/s, by wall and by the replays' GPU time; "
             "miss: misses / lookups (resident rows count as hits); elastic res/hot: the elastic run's requests "
             "that finished resident / hot (demoted by a spill)"]
    for ctx, c in result["contexts"].items():
        for n in c.get("notes", []):
            lines.append(f"context {ctx}: {n}")
        pools = {(e["pool"]["rows"], e["pool"]["from"]) for e in (r["elastic"] for r in c.get("rows", []))
                 if e["ran"]}
        for rows_, frm in sorted(pools, key=str):
            lines.append(f"context {ctx}: elastic: device pool {rows_} rows per layer ({frm})")
        for r in c.get("rows", []):
            if not r["elastic"]["ran"]:
                lines.append(f"context {ctx}: batch {r['batch']}: elastic skipped: {r['runs']['elastic']['skipped']}")
        cmp = [(r["batch"], k, v) for r in c.get("rows", []) for k, v in r["compare"].items()]
        if cmp:
            eq = sum(v["bitwise_equal"] for _, _, v in cmp)
            worst = max(cmp, key=lambda x: x[2]["max_rel_diff"])
            lines.append(f"context {ctx}: outputs at the same batch: {len(cmp)} comparisons, {eq} bitwise equal, "
                         f"largest rel diff {worst[2]['max_rel_diff']:.3e} (batch {worst[0]}, "
                         f"{worst[1].replace('_', ' ')}); "
                         + ("all WITHIN tolerance" if not c.get("compare_failures")
                            else "OUTSIDE tolerance: " + ", ".join(c["compare_failures"])))
        tg = c.get("targets")
        if tg:
            for key, what in (("throughput", f"elastic >= {TARGET_RATIO}x resident (wall)"),
                              ("throughput_gpu", f"elastic >= {TARGET_RATIO}x resident (GPU time)"),
                              ("miss_rate", "elastic miss rate <= fixed")):
                x = tg[key]
                state = ("not measured" if x["met"] is None else "met" if x["met"]
                         else f"MISSED at batches {x['missed']}")
                lines.append(f"context {ctx}: target {what}: {state}"
                             + (f" (batches {x['batches']})" if x["batches"] else ""))
    return "\n".join(lines)


def plot_sweep(path: str, result: dict) -> str:
    """One PNG: per context, tokens/s vs batch (resident, fixed, elastic; dashed: by the
    replays' GPU time where measured) and miss rate vs batch (fixed, elastic)."""
    plt = require_matplotlib()
    ctxs = [(ctx, c) for ctx, c in result["contexts"].items() if c.get("rows")]
    n = max(len(ctxs), 1)
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.6 * n), squeeze=False)
    colors = {"resident": "tab:gray", "fixed": "tab:blue", "elastic": "tab:orange"}
    for (ctx, c), (ax_t, ax_m) in zip(ctxs, axes):
        rows = c["rows"]
        for k in RUNS:
            for key, style, label in (("tokens_per_s", "o-", k), ("tokens_per_s_gpu", "x--", f"{k} (GPU time)")):
                pts = [(r["batch"], r[key][k]) for r in rows if r[key][k]]
                if pts:
                    ax_t.plot(*zip(*pts), style, color=colors[k], label=label)
        for k in ("fixed", "elastic"):
            pts = [(r["batch"], r["miss_rate"][k]) for r in rows if r["miss_rate"][k] is not None]
            if pts:
                ax_m.plot(*zip(*pts), "o-", color=colors[k], label=k)
        rb = c["limits"]["resident"]["batch"]
        ticks = [r["batch"] for r in rows]
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(b) for b in ticks])
            ax.minorticks_off()
            ax.set_xlabel("batch (requests decoding together)")
            if rb:
                ax.axvline(rb, color="tab:gray", linestyle=":", linewidth=1)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        ax_t.set_ylabel("decode tokens/s")
        ax_t.set_title(f"context {ctx}: tokens/s (dotted: resident's largest batch, {rb})", fontsize=10)
        ax_m.set_ylabel("miss rate")
        ax_m.set_title(f"context {ctx}: miss rate of the hisparse runs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return path


__all__ = ["TARGET_RATIO", "default_batches", "sweep_batches", "miss_rate", "batch_figures", "sweep_targets",
           "run_sweep", "format_sweep", "plot_sweep"]
