"""The readable summary of a ``hisparse stress`` result (:func:`format_stress`)."""

from __future__ import annotations

from typing import Any

from .units import fmt_bytes
from .report import table
from .stress_prefix import format_prefix


def _run_line(o: dict[str, Any], w: dict[str, Any]) -> str:
    """The options that shape the run and are not on the line above, as key=value."""
    if o["replay"]:
        parts = [f"replay={o['replay']}"]
    else:
        parts = [f"requests={w['requests']}", f"context={w['context_min']}..{w['context']}",
                 f"churn={w['churn']}"]
        if w["drift"] is not None:
            parts.append(f"drift={w['drift']}")
    parts += [f"seed={o['seed']}", f"verify={o['verify']}", f"resolve={'checked' if o['checked'] else 'unchecked'}",
              f"block_size={o['block_size']}", f"prefill_chunk={o['prefill_chunk']}",
              f"belady={'n/a' if o.get('shared_prefix') else 'on' if o['optimal'] else 'off'}", f"prefetch={'on' if o['prefetch'] else 'off'}"]
    if o["record"]:
        parts.append(f"record={o['record']}")
    if o.get("pool_rows") is not None:
        parts.append(f"pool_rows={o['pool_rows']}")
    if o.get("ramp"):
        parts.append("ramp=on")
    if o.get("shared_prefix") is not None:
        parts.append(f"shared_prefix={o['shared_prefix']} prefix_groups={o.get('prefix_groups') or 1}")
    return " ".join(parts)


def _pool_lines(r: dict[str, Any]) -> list[str]:
    """The device pool's figures, and with --ramp its timeline (every step up to 32, else
    a thinned set that keeps the overflow and the last step)."""
    p = r["device_pool"]
    lines = [f"device pool: {p['pool_rows_total']} rows per layer ({p['hot_rows']} hot-buffer rows + "
             f"{p['pages']} pages of {p['page_rows']}; --pool-rows {p['pool_rows']}), "
             f"{fmt_bytes(p['device_bytes'])} on the device ({fmt_bytes(p['pages_bytes'])} of pages); "
             f"rows used peak {p['pool_rows_used_peak']}, at the end {p['pool_rows_used_end']}",
             f"tiers: resident requests peak {p['resident_requests_peak']} (end {p['resident_requests_end']}), "
             f"hot peak {p['hot_requests_peak']} (end {p['hot_requests_end']}); spills {p['spills']}, "
             f"promotions {p['promotions']}, seeded rows {p['seeded_rows']} ({p['seeded_rows_verified']} checked "
             f"right after their demotion); resident rows resolved {p['resident_rows']}; miss rate "
             f"{p['miss_rate']:.4f} (hit rates count resident rows as hits; the Belady bound is of S-slot hot "
             "buffers for every request, so it can lie below them)"]
    ramp = r.get("ramp")
    if ramp:
        turn = (f"the pool overflowed by step {ramp['overflow_step']}" if ramp["overflowed"]
                else "the pool NEVER overflowed")
        lines.append(f"ramp: {ramp['joined']} request{'' if ramp['joined'] == 1 else 's'} joined, one per step, "
                     f"until {turn} (peak "
                     f"{ramp['peak_live']} live); then one left per step: {ramp['steps']} steps; after every request "
                     f"left: {'pool and host blocks empty' if ramp['drained'] else 'NOT empty'}")
    ps = r["per_step"]
    n = len(ps.get("live", []))
    if ramp and n:
        keep = list(range(n))
        if n > 32:
            every = -(-n // 24)
            keep = sorted(set(range(0, n, every)) | {n - 1} |
                          ({ramp["overflow_step"]} if ramp["overflow_step"] is not None else set()))
        rows = [[i, ps["live"][i], ps["resident_requests"][i], ps["hot_requests"][i], ps["pool_rows_used"][i],
                 ps["spills"][i], f"{1.0 - ps['hit_rate'][i]:.4f}"] for i in keep]
        lines += ["", table(["step", "live", "resident", "hot", "pool rows used", "spills", "miss rate"], rows)]
    return lines


def format_stress(r: dict[str, Any]) -> str:
    """Readable summary table of a :func:`run_stress` result."""
    c, w, ov = r["config"], r["workload"], r["overall"]
    opt = (lambda v: "-" if v is None else f"{v:.4f}")
    head = (f"hisparse stress on {r['device']} (kernels: {r['kernels']}; timings: {r['timings_are']})\n"
            f"L={c['num_layers']} row_bytes={c['row_bytes']} top_k={c['top_k']} "
            f"S={c['device_buffer_size']} max_reqs={c['max_num_reqs']} trace={w['trace']} "
            f"steps={w['steps_run']}/{w['steps_planned']} joined={w['joined']} left={w['left']}\n"
            + _run_line(r["options"], w))
    pf = "prefetch" in r
    dp = "device_pool" in r
    rows = [[d["layer"], d["hits"], d["misses"]] + ([d["resident_rows"]] if dp else [])
            + [f"{d['hit_rate']:.4f}", opt(d["optimal_hit_rate"]),
               fmt_bytes(d["bytes_h2d"]), f"{d['h2d_GBps']:.3f}"] + ([d["prefetch_rows"]] if pf else [])
            for d in r["per_layer"]]
    rows.append(["all", ov["hits"], ov["misses"]] + ([ov["resident_rows"]] if dp else [])
                + [f"{ov['hit_rate']:.4f}", opt(ov["optimal_hit_rate"]),
                   fmt_bytes(ov["bytes_h2d"]), f"{ov['h2d_GBps']:.3f}"]
                + ([r["prefetch"]["rows_staged"]] if pf else []))
    lines = [head, "", table(["layer", "hits", "misses"] + (["resident rows"] if dp else [])
                             + ["hit rate", "optimal (Belady)", "H2D bytes",
                                "H2D GB/s"] + (["prefetched rows"] if pf else []), rows), ""]
    lines.append(f"step time: min {ov['step_ms_min']:.3f} ms, p50 {ov['step_ms_p50']:.3f} ms, "
                 f"p99 {ov['step_ms_p99']:.3f} ms (p50 split: appends {ov['append_ms_p50']:.3f} ms, "
                 f"resolves + staging {ov['resolve_ms_p50']:.3f} ms)\n"
                 f"prefill of joining requests: {ov['prefill_rows']} rows in {ov['prefill_s']:.2f} s")
    gpu = "-" if ov["gpu_peak_bytes"] is None else fmt_bytes(ov["gpu_peak_bytes"])
    lines.append(f"memory: host pool {fmt_bytes(ov['host_pool_bytes'])}, "
                 f"{'device rows (hot buffers and pool pages)' if dp else 'hot buffers'} "
                 f"{fmt_bytes(ov['hot_buffer_bytes'])}, process RSS peak "
                 f"{fmt_bytes(ov['host_rss_peak_bytes'])}, GPU peak {gpu}")
    if "prefetch" in r:
        q = r["prefetch"]
        lines.append(f"prefetch (layer l's selection into layer l+1): {q['rows_staged']} rows staged, "
                     f"precision {opt(q['precision'])}, recall {opt(q['recall'])}, "
                     f"{fmt_bytes(q['wasted_bytes'])} wasted; it evicted {q['misses_added']} rows the next "
                     f"layer then missed (net {q['net_rows_saved']} rows saved); {q['time_s']:.3f} s, "
                     f"step p50 with it {ov['step_ms_p50_with_prefetch']:.3f} ms; hit rates count a "
                     "prefetched row that is then selected, the Belady bound has no prefetch")
    if dp:
        lines += _pool_lines(r)
    if "prefix" in r:
        lines += format_prefix(r)
    lines.append(f"verified {ov['rows_verified']} rows byte-exact (hot and host copies)")
    if r["ok"]:
        lines.append("RESULT: PASS")
    else:
        lines.append(f"RESULT: FAIL ({len(r['failures'])} problem(s))")
        lines += ["  " + f for f in r["failures"][:10]]
    return "\n".join(lines)


__all__ = ["format_stress"]
