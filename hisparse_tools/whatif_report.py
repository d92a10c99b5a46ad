"""The output of ``hisparse whatif``: its table (:func:`format_whatif`) and its plot
(:func:`plot_whatif`, into a directory the command checked before any work)."""

from __future__ import annotations

import os
from typing import Any

from .units import fmt_bytes
from .report import require_matplotlib, table

def format_whatif(res: dict[str, Any]) -> str:
    """The readable table of a :func:`run_whatif` result."""
    t, K = res["trace"], res["trace"]["top_k"]
    src = (f"file {t['file']}" if t["source"] == "replay" else
           f"preset {t['preset']}" if t["preset"] else f"generator {t['source']}")
    knobs = " ".join(f"{k}={v}" for k, v in t["knobs"].items())
    head = (f"hisparse whatif: {src} ({knobs or 'no knobs'}); {t['num_layers']} layers, top_k={K}, "
            f"{t['steps']} steps, up to {t['max_live_requests']} requests, context "
            f"{t['context_min']}..{t['context_max']}, warmup {t['warmup']} steps not counted\n"
            f"staging projected at {res['row_bytes']} B/row and {res['pcie_GBps']:g} GB/s "
            f"(per layer-step = one layer's resolve of the whole batch)")
    ref = any("reference_miss_rate" in e for e in res["results"])
    hdr = ["buffer", "x top-k", "LRU miss", "Belady miss", "LRU rows/layer-step",
           "LRU MB/layer-step", "LRU us mean", "LRU us p99", "prefetch gain"]
    if ref:
        hdr += ["published", "rel err"]
    rows = []
    for e in res["results"]:
        pg = e["prefetch_hit_gain"]
        row = [e["buffer"], round(e["buffer_over_topk"], 3), f"{e['lru_miss_rate']:.4f}",
               f"{e['belady_miss_rate']:.4f}", round(e["lru_staging_rows"]["mean"], 1),
               round(e["lru_staging_bytes"]["mean"] / 1e6, 3), round(e["lru_staging_us"]["mean"], 1),
               round(e["lru_staging_us"]["p99"], 1), "-" if pg is None else f"{pg:.4f}"]
        if ref:
            rr = e.get("reference_miss_rate")
            row += ["-" if rr is None else f"{rr:.3f}",
                    "-" if rr is None else f"{e['reference_rel_error']:+.1%}"]
        rows.append(row)
    ov = res["overlap"]
    f = (lambda v: "-" if v is None else f"{v:.3f}")
    lines = [head, "", table(hdr, rows), "",
             f"measured overlap: adjacent layers {f(ov['adjacent_layer'])} (share of a layer's "
             f"selection the previous layer selected in the step), consecutive steps "
             f"{f(ov['consecutive_step'])}",
             "prefetch gain: share of lookups (layers >= 1) that are LRU misses the previous "
             "layer selected in the same step",
             f"total LRU staging per step over all {t['num_layers']} layers at the smallest buffer: "
             f"{fmt_bytes(res['results'][0]['lru_staging_bytes']['mean'] * t['num_layers'])} mean",
             f"time: generate {res['timings']['generate_s']:.1f} s, simulate "
             f"{res['timings']['simulate_s']:.1f} s"]
    if ref:
        r0 = res["reference"]
        ok = all(abs(e["reference_rel_error"]) <= r0["band"] for e in res["results"]
                 if "reference_rel_error" in e)
        lines.append(f"reference: {r0['source']}; LRU within +-{r0['band']:.0%}: "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def plot_whatif(directory: str, res: dict[str, Any]) -> list[str]:
    """whatif.png: miss rate against buffer / top-k (LRU, Belady, published reference)
    and LRU staging per layer-step over the decode steps, per buffer size. Returns the paths."""
    plt = require_matplotlib()
    os.makedirs(directory, exist_ok=True)
    K = res["trace"]["top_k"]
    x = [e["buffer_over_topk"] for e in res["results"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(x, [e["lru_miss_rate"] for e in res["results"]], "o-", label="LRU (the cache)")
    a1.plot(x, [e["belady_miss_rate"] for e in res["results"]], "s--", label="Belady (offline optimum)")
    if "reference" in res:
        ref = res["reference"]["miss_rate_by_buffer_over_topk"]
        rx = sorted(float(k) for k in ref)
        ry = [ref[str(k)] if str(k) in ref else ref[k] for k in rx]
        band = res["reference"]["band"]
        a1.errorbar(rx, ry, yerr=[[v * band for v in ry], [v * band for v in ry]], fmt="k*",
                    capsize=4, label=f"published GLM-5.1 (+-{band:.0%})")
    a1.set_xlabel(f"hot buffer / top-k (top-k = {K})")
    a1.set_ylabel("miss rate (unique rows per resolve)")
    a1.set_ylim(bottom=0)
    a1.grid(alpha=0.3)
    a1.legend()
    a1.set_title("miss rate against buffer size")
    bw, rb = res["pcie_GBps"], res["row_bytes"]
    for e in res["results"]:
        ys = [None if v is None else v * rb / 1e6 for v in e["lru_staging_rows_per_step"]]
        a2.plot(range(len(ys)), [float("nan") if v is None else v for v in ys],
                label=f"S = {e['buffer_over_topk']:.3g}x")
    a2.set_xlabel("decode step")
    a2.set_ylabel("LRU staging MB per layer-step")
    a2.set_ylim(bottom=0)
    a2.grid(alpha=0.3)
    a2.legend(fontsize="small", ncol=2)
    sec = a2.secondary_yaxis("right", functions=(lambda mb: mb / bw * 1e3, lambda us: us * bw / 1e3))
    sec.set_ylabel(f"us at {bw:g} GB/s")
    warm = res["trace"]["warmup"]
    title = f"staging per layer-step ({res['trace']['max_live_requests']} requests, {rb} B rows)"
    a2.set_title(title + (f"; first {warm} steps not counted" if warm else ""), fontsize="medium")
    fig.tight_layout()
    p = os.path.join(directory, "whatif.png")
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return [p]


__all__ = ["format_whatif", "plot_whatif"]
