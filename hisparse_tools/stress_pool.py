"""The stress run's checks and report of the elastic device tier (``--pool-rows``,
``--ramp``): a mixin of ``stress.StressRun``, which provides ``cfg``, ``S``, ``dev``
and ``_rows`` (the expected bytes of a row)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hisparse.config import DEVICE_PAGE_ROWS

from .belady import hit_rate
from .workload import RampSchedule


class PoolChecks:
    """The elastic tier's per-step checks and the ``device_pool`` report."""

    def _check_tiers(self, layer: int, step: int, req_ids: np.ndarray, phys: torch.Tensor,
                     resident: torch.Tensor, slots: torch.Tensor) -> list[str]:
        """Every valid physical row of a token lies in its request's own tier: a resident
        request's in the device pool's pages (past the hot buffers), a hot request's in
        its own hot buffer (rows r x (S + 1) .. r x (S + 1) + S)."""
        cfg = self.cfg
        SP = cfg.slots_per_req
        lo = torch.where(resident, cfg.hot_rows_per_layer, slots * SP)
        hi = torch.where(resident, cfg.device_rows_per_layer, (slots + 1) * SP)
        p = phys.long()
        bad = (p >= 0) & ((p < lo[:, None]) | (p >= hi[:, None]))
        if not bool(bad.any()):
            return []
        t, k = bad.nonzero()[0].tolist()
        tier = "resident" if bool(resident[t]) else "hot"
        return [f"step {step} layer {layer}: request {int(req_ids[t])} ({tier}) entry {k} resolved to row "
                f"{int(p[t, k])}, outside its {tier} rows [{int(lo[t])}, {int(hi[t])})"]

    def _verify_hot_buffer(self, cache, layer: int, step: int, req_id: int, inst: int) -> tuple[int, list[str]]:
        """A hot request's whole buffer in ``layer`` (run right after a spill demoted it, so
        on the rows the demotion seeded): every occupied slot holds the bytes of the
        position it records, the positions are distinct, ``row_slot`` maps each one's host
        row back to its slot, and min(rows, S + 1) slots are occupied. Returns (rows
        checked, failure messages)."""
        SP = self.cfg.slots_per_req
        r = cache.request(req_id).slot
        pos = cache.layer_view(layer).slot_pos[r].long()  # the position each slot holds
        occ = (pos >= 0).nonzero().flatten()
        p = pos[occ]
        n = cache.request(req_id).lengths[layer]
        where = f"step {step} layer {layer}: request {req_id}, demoted to a hot buffer"
        if occ.numel() != min(n, SP):
            return 0, [f"{where}: {occ.numel()} slots occupied, expected min({n} rows, {SP}) = {min(n, SP)}"]
        if occ.numel() == 0:
            return 0, []
        if torch.unique(p).numel() != p.numel() or int(p.max()) >= n:
            return 0, [f"{where}: its slots hold positions {sorted(p.tolist())[:8]}... (repeated or past {n})"]
        want = self._rows(layer, torch.full_like(p, inst), p)
        got = cache.hot_rows(layer).index_select(0, r * SP + occ)
        bad = (got != want).any(dim=1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            return 0, [f"{where}: slot {int(occ[i])} (hot row {r * SP + int(occ[i])}) holding position "
                       f"{int(p[i])} differs from the expected bytes ({int(bad.sum())} of {bad.numel()} slots bad)"]
        h = cache.pool.row_keys(r, p.cpu()).to(self.dev)
        back = cache.layer_view(layer).row_slot.index_select(0, h).long()
        if not torch.equal(back, occ):
            i = int((back != occ).nonzero()[0])
            return 0, [f"{where}: position {int(p[i])} is in slot {int(occ[i])} but row_slot maps its row key "
                       f"to {int(back[i])}"]
        return int(occ.numel()), []

    def _ramp_end(self, cache, ramp: RampSchedule, stats: dict[str, Any]) -> list[str]:
        """A ramp's end: the pool overflowed on the way, and once every request left no
        device page, hot buffer or host block stays taken."""
        fails = []
        if ramp.overflow_step is None:
            fails.append(f"--ramp: the device pool never overflowed ({ramp.next_id} requests joined; no spill "
                         "left a request hot)")
        st = cache.stats()
        t = st["total"]
        if st["live_requests"] or t["pool_rows_used"] or st["host_pool"]["blocks_used"]:
            fails.append(f"--ramp: after every request left, {st['live_requests']} request(s), "
                         f"{t['pool_rows_used']} device rows per layer and {st['host_pool']['blocks_used']} host "
                         "blocks are still taken")
        return fails

    def _pool_report(self, stats, series, hits, misses, resident, seeded_checked) -> dict[str, Any]:
        """The elastic device tier's figures (``result['device_pool']``)."""
        cfg, t = self.cfg, stats["total"]
        H, M, RR = int(hits.sum()), int(misses.sum()), int(resident.sum())
        peak = (lambda k: max(series[k]) if series[k] else 0)
        return {
            "pool_rows": cfg.device_pool_rows, "pool_rows_total": cfg.device_rows_per_layer,
            "hot_rows": cfg.hot_rows_per_layer, "pages": cfg.pool_pages, "page_rows": DEVICE_PAGE_ROWS,
            "device_bytes": cfg.hot_buffer_bytes,
            "pages_bytes": cfg.num_layers * cfg.pool_pages * DEVICE_PAGE_ROWS * cfg.row_bytes,
            "resident_requests_end": t["resident_requests"], "hot_requests_end": t["hot_requests"],
            "resident_requests_peak": peak("resident_requests"), "hot_requests_peak": peak("hot_requests"),
            "pool_rows_used_end": t["pool_rows_used"], "pool_rows_used_peak": peak("pool_rows_used"),
            "spills": t["spills"], "promotions": t["promotions"], "seeded_rows": t["seeded_rows"],
            "seeded_rows_verified": seeded_checked, "resident_rows": RR,
            "miss_rate": 1.0 - hit_rate(H + RR, M),
        }


__all__ = ["PoolChecks"]
