"""The mini engine's readable report of a :func:`hisparse_tools.mini_engine.run` result."""

from __future__ import annotations


def format_report(res: dict) -> str:
    """Timings of both runs, their ratio, the cache counters and the output comparison."""
    c, r, h = res["compare"], res["resident"], res["hisparse"]
    cache = h["cache"]
    lines = [
        f"backends: decode={r['backend']['decode']} prefill={r['backend']['prefill']}",
        f"{'run':<10}{'tokens':>9}{'steps':>7}{'tok/s':>12}{'step med ms':>13}{'decode med ms':>15}"
        f"{'decode p99 ms':>15}",
    ]
    for name, d in (("resident", r), ("hisparse", h)):
        ds = d["decode_step"]
        lines.append(f"{name:<10}{d['tokens']:>9}{d['steps']:>7}{d['tokens_per_s']:>12.1f}"
                     f"{d['step'].get('median_ms', float('nan')):>13.3f}"
                     f"{ds.get('median_ms', float('nan')):>15.3f}{ds.get('p99_ms', float('nan')):>15.3f}")
    for name, d in (("resident", r), ("hisparse", h)):
        if d.get("outlier_steps"):
            lines.append(f"WARNING: {name} had {d['outlier_steps']} step(s) over 10x the median "
                         f"({d['outlier_s']:.2f} s in all, e.g. kernels compiling): compare the "
                         "step medians, not tokens/s")
    ratio = res["ratio"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines += [
        f"ratio hisparse/resident: tokens/s {fmt(ratio['tokens_per_s_hisparse_over_resident'])}, "
        f"decode step median {fmt(ratio['decode_step_median_hisparse_over_resident'])}",
        f"hisparse cache: hit rate {cache['hit_rate']:.4f} (hits {cache['hits']}, misses {cache['misses']}), "
        f"bytes h2d {cache['bytes_h2d']}, bytes d2h {cache['bytes_d2h']}, invalid {cache['invalid']}"
        + (f", prefetched rows {cache['prefetch_rows']} (counted as hits when selected; per-layer hit "
           f"rates {' '.join(f'{x:.3f}' for x in cache['layer_hit_rates'])})" if cache.get("prefetch_rows") else "")
        + (f"; device pool (--pool-rows): resident rows {cache['resident_rows']} (counted as hits), resident "
           f"requests {cache['resident_requests']}, hot {cache['hot_requests']} at the end (finished resident "
           f"{cache.get('finished_resident')}, hot {cache.get('finished_hot')}), spills "
           f"{cache['spills']}, seeded rows {cache['seeded_rows']}, rows used {cache['pool_rows_used']} of "
           f"{cache['pool_rows_total']}" if res.get("config", {}).get("device_pool_rows") else ""),
        *([f"prefix reuse: {cache['prefix_hit_tokens']} of {cache['prefix_query_tokens']} prompt tokens cached "
           f"(not computed), cached blocks {cache['cached_blocks']}, shared {cache['shared_blocks']}, evictions "
           f"{cache['prefix_evictions']}"] if cache.get("prefix_query_tokens") else []),
        f"outputs: {c['tokens_compared']} tokens compared"
        + (f" ({c['tokens_skipped']} cached ones not computed, left out)" if c.get("tokens_skipped") else "")
        + f", max |diff| {c['max_abs_diff']:.3e} "
        f"(relative {c['max_rel_diff']:.3e}), argmax mismatches {c['argmax_mismatches']}, "
        f"{'bitwise equal' if c['bitwise_equal'] else 'not bitwise equal'}, "
        f"{'WITHIN' if c['within_tolerance'] else 'OUTSIDE'} tolerance",
    ]
    return "\n".join(lines)


__all__ = ["format_report"]
