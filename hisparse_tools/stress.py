"""``hisparse stress``: drive the real cache with a long-context workload and verify it.

Each decode step: requests that left are freed; joining requests are added and
prefilled (rows appended in chunks); every live request appends one new row per layer;
then each layer resolves the step's top-k for the whole batch. After every resolve a
sample of the physical rows (or all of them, ``verify="all"``) is checked byte-exact:
the hot row must equal the regenerated row and the host copy (``read_host_rows``)
must equal it too; padding must map to padding and distinct positions to distinct
rows. Any mismatch stops the run and fails it.

Row contents are deterministic pseudo-random bytes of (seed, layer, request instance,
position) (:func:`row_content`), generated on the cache device, so a verifier can
regenerate any row without trusting the cache. The request *instance* (a counter of
joins) rather than the id keys the bytes, so a reused id with stale mappings shows up.

Timing: the step time covers the decode appends and the resolves (misses staged),
synchronised on CUDA; top-k generation, verification and recording are outside it.
Prefill of joining requests is timed separately.

``pool_rows`` (``HiSparseConfig.device_pool_rows``): the elastic device tier. Requests
join resident (their rows in device pages) and a write that needs pages the pool lacks
demotes some to hot buffers, seeded from their pages (a spill). Every resolve is checked
as above, plus each valid physical row against its request's tier (a resident request's
rows lie in the pool's pages, a hot request's in its own hot buffer), and each request a
spill demoted has its whole hot buffer checked right after (before any resolve): every
occupied slot holds the bytes of the position it records, ``row_slot`` maps that
position's host row back to the slot, min(rows, S + 1) slots are occupied. ``ramp``
(:class:`~hisparse_tools.workload.RampSchedule`): one request joins per step until the
pool has overflowed (a spill left a request hot), then the oldest leaves per step until
none is left; at the end no device row or host block may stay taken.

``prefetch``: after layer l's resolve, its top-k is prefetched into layer l + 1
(``HiSparseCache.prefetch``, timed apart from the steps: ``prefetch.time_s``). A
prefetched row that layer l + 1 then selects is one of its hits. The Belady bound has
no prefetch, so the two are not comparable there.

Result (``run_stress`` / ``hisparse stress --json``), a dict:
  ok                 bool, False when any verification failed (the run stops there)
  failures           list[str], what differed and where
  device, kernels    the device name ("cpu" or the GPU's) and the cache kernels used
  timings_are        "GPU (CUDA-synchronised)", "CPU (torch reference path)" or
                     "CPU (Triton interpreter)"
  config             the HiSparseConfig as a dict
  options            the StressOptions, every field but progress (which changes only
                     what is printed): StressOptions(**options) repeats the run
  workload           trace, drift, replay, steps_run, steps_planned, requests, context,
                     context_min (the one used), churn, joined, left, verify, seed,
                     checked, prefill_chunk, record
  overall            hits, misses, resident_rows (entries resolved to device-pool
                     pages), hit_rate ((hits + resident_rows) / lookups), miss_rate,
                     optimal_hit_rate (Belady, None with optimal=False; S-slot hot
                     buffers for every request, even with a device pool), bytes_h2d, h2d_GBps (over resolve + staging time),
                     step_ms_min/p50/p99, append_ms_p50, resolve_ms_p50, prefill_rows,
                     prefill_s, rows_verified, host_pool_bytes, hot_buffer_bytes,
                     host_rss_peak_bytes, gpu_peak_bytes (None on CPU)
  per_layer          list of {layer, hits, misses, resident_rows, hit_rate, miss_rate,
                     optimal_hit_rate, bytes_h2d, h2d_GBps}
  per_step           {hit_rate: [..], optimal_hit_rate: [..] | None, step_ms: [..]}; with a
                     device pool also live, resident_requests, hot_requests,
                     pool_rows_used, spills, seeded_rows (stats()["total"] after each step)
  device_pool        (with pool_rows) pool_rows, pool_rows_total (device rows per layer),
                     hot_rows, pages, page_rows, device_bytes (all layers), pages_bytes,
                     resident_requests_end/_peak, hot_requests_end/_peak,
                     pool_rows_used_end/_peak, spills, promotions, seeded_rows,
                     seeded_rows_verified, resident_rows, miss_rate
  ramp               (with ramp) joined, overflowed, overflow_step (the step by whose end
                     the pool had overflowed), peak_live, steps, max_steps, drained (no
                     request, device row or host block left once all left)
  prefetch           (with prefetch) rows_staged, useful_rows (of them, selected by the
                     layer they went to), misses_left (layers >= 1), misses_added (selected
                     rows the prefetch evicted), net_rows_saved, precision, recall,
                     wasted_bytes, bytes, time_s, per_layer; per_layer entries then also
                     have prefetch_rows, bytes_h2d and h2d_GBps count those rows and their
                     time, and overall has step_ms_p50_with_prefetch
  prefix             (with shared_prefix) the prefix cache's figures: see
                     :mod:`hisparse_tools.stress_prefix`; per_step then also has
                     host_rows, host_rows_unshared and prefix_hit_rate
  plots              (CLI with --plot) paths of the PNGs written
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any, Callable

import numpy as np
import torch

from hisparse import HiSparseCache
from hisparse.config import DEVICE_PAGE_ROWS, HiSparseConfig
from .belady import OptimalTracker, hit_rate
from .exit_codes import writing
from .fields import plain_dict
from .outputs import Outputs
from .preflight import check_memory, parse_device, require_kernels
from .progress import Progress
from .sizing import gpu_bytes
from .sources import CorrelatedSource, IndexerSource, UniformSource, WorkingSetSource, workingset_state_bytes
from .stress_limits import check_ramp_overflows, check_stress_sizes
from .stress_pool import PoolChecks
from .stress_prefetch import prefetch_report, prefetch_useful, selected_host_rows, selected_hot, selected_rows
from .stress_prefix import PrefixRun, PrefixSchedule
from .traces import ReplaySource, Trace, TraceRecorder
from .workload import RampSchedule, Schedule, StressOptions

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x2C1B3C6D, 0x297A2D39  # < 2**31: products with 32-bit values fit int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (values kept in [0, 2**32), no overflow)."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * _C1) & _M32
    x = ((x ^ (x >> 15)) * _C2) & _M32
    return x ^ (x >> 16)


def row_content(seed: int, layer: int, instance: torch.Tensor, positions: torch.Tensor,
                row_bytes: int) -> torch.Tensor:
    """Deterministic row bytes of (seed, layer, instance, position).

    instance, positions: int64 [n] (same device). Returns uint8 [n, row_bytes] on that
    device (row_bytes a multiple of 4). Identical on CPU and CUDA.
    """
    dev = positions.device
    words = row_bytes // 4
    base = _mix(torch.full_like(positions, (int(seed) * 0x9E3779B1 + int(layer)) & _M32))
    base = _mix(base + (instance.long() & _M32))
    base = _mix(base + (positions.long() & _M32))
    j = torch.arange(words, dtype=torch.int64, device=dev) * 0x9E3779B1 & _M32
    h = _mix(base[:, None] ^ j[None, :])
    h = torch.where(h >= 2**31, h - 2**32, h).to(torch.int32)
    return h.view(torch.uint8).reshape(-1, words * 4)


# per_step series of the device pool (and the live requests), from each step's stats()["total"]
TIER_SERIES = ("live", "resident_requests", "hot_requests", "pool_rows_used", "spills", "seeded_rows")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


class StressRun(PoolChecks, PrefixRun):
    """One stress run; ``run()`` returns the JSON-able result dict (``ok`` False on failure).

    Building it checks everything that can be checked before work starts: the options,
    the device and kernels (:mod:`hisparse_tools.preflight`), the trace file, the cache
    config (int32 limits), and the memory the run will allocate (:meth:`memory_needed`
    against what the machine has: a ``CapacityError`` naming the bytes when it can't fit).
    ``outputs``: the command's :class:`~hisparse_tools.outputs.Outputs`, where ``o.record``
    is checked (a FIFO's handle is kept there until the trace is written through it).
    """

    def __init__(self, o: StressOptions, *, outputs: Outputs | None = None) -> None:
        self.o = o
        self.dev = parse_device(o.device)
        self.kernels = require_kernels(o.kernels, self.dev)
        self.outputs = outputs if outputs is not None else Outputs()
        self.outputs.file(o.record, flag="--record")
        self.replay = ReplaySource(o.replay, device=self.dev) if o.trace is Trace.REPLAY else None
        if self.replay is not None:
            L, K = self.replay.num_layers, self.replay.top_k
            steps = len(self.replay.steps)
            if steps == 0:
                raise ValueError(f"trace file {o.replay!r} has no steps")
            live_max = max(st.req_ids.size for st in self.replay.steps)
            if live_max == 0:
                raise ValueError(f"trace file {o.replay!r} has no request in any of its {steps} steps")
            max_len = max(int(st.seq_lens.max()) for st in self.replay.steps if st.seq_lens.size)
            max_id = max(int(st.req_ids.max()) for st in self.replay.steps if st.req_ids.size)
            self.source = self.replay
        else:
            L, K = o.num_layers, o.top_k
            steps = 2 * o.num_requests if o.ramp else o.steps  # a ramp's length: RampSchedule.max_steps
            live_max, max_len, max_id = o.num_requests, o.context + steps, 0
            if o.trace is Trace.UNIFORM:
                self.source = UniformSource(top_k=K, device=self.dev, seed=o.seed)
            elif o.trace is Trace.INDEXER:
                self.source = IndexerSource(top_k=K, max_context=max_len, drift=o.drift_used,
                                            device=self.dev, seed=o.seed)
            elif o.trace is Trace.WORKINGSET:  # the knobs stress has no flags for at their defaults, as whatif's
                self.source = WorkingSetSource(top_k=K, drift=o.drift_used, device=self.dev, seed=o.seed)
            else:
                self.source = CorrelatedSource(top_k=K, drift=o.drift_used, device=self.dev, seed=o.seed)
        self.L, self.K, self.steps = L, K, steps
        self.live_max, self.max_len = live_max, max_len
        B = o.block_size
        check_stress_sizes(layers=L, top_k=K, buffer=o.buffer_size, block_size=B, live=live_max,
                           max_len=max_len, replay=self.replay is not None, prefetch=o.prefetch,
                           pool_rows=o.pool_rows)
        blocks = live_max * math.ceil(max_len / B)
        self.cfg = HiSparseConfig(
            num_layers=L, host_pool_tokens=max(blocks, 1) * B, row_bytes=o.row_format.row_bytes,
            top_k=K, device_buffer_size=o.buffer_size, max_num_reqs=max(live_max, 1),
            host_block_size=B, max_request_id=max(max_id + 1, 2 * live_max + 1, 16), device=str(self.dev),
            device_pool_rows=o.pool_rows, prefix_caching=bool(o.shared_prefix))
        self.S = self.cfg.device_buffer_size
        if o.ramp:
            check_ramp_overflows(self.cfg, o)
        host, device = self.memory_needed()
        check_memory(host=host, device=device, on=self.dev, what="this stress run",
                     hint="lower --requests, --context, --layers, --top-k/--buffer, --pool-rows or --steps")
        if self.replay:
            self.schedule = None
        elif o.shared_prefix:
            self.schedule = PrefixSchedule(o, self.cfg.max_request_id, max_len)
        else:
            self.schedule = RampSchedule(o) if o.ramp else Schedule(o, self.cfg.max_request_id)
        self.vgen = torch.Generator(device=self.dev)
        self.vgen.manual_seed(o.seed + 2)
        self.keys = None  # PrefixKeys of a --shared-prefix run, set when it starts

    def memory_needed(self) -> tuple[dict[str, int], dict[str, int]]:
        """(host parts, device parts): bytes the run allocates, by what (an estimate for
        the Belady bound's event lists; exact for the cache's own tensors). On a CPU
        device everything is host memory."""
        cfg, L, steps = self.cfg, self.L, self.steps
        pool = L * cfg.pool_pages * DEVICE_PAGE_ROWS * cfg.row_bytes  # the pages past the hot buffers
        device = {"hot buffers and slot state": gpu_bytes(cfg, num_heads=0)["total"] - pool}
        if pool:
            device["device pool pages"] = pool
        if isinstance(self.source, IndexerSource):
            device["indexer keys"] = L * self.live_max * self.source.max_context * self.source.dim * 4
        if isinstance(self.source, WorkingSetSource):  # candidates, scores, mirror mask; position owners
            device["working-set state"] = L * self.live_max * workingset_state_bytes(self.K, self.max_len)
        if self.o.shared_prefix:  # PrefixKeys: a key per (live request, position)
            device["prefix row keys"] = self.live_max * self.max_len * 8
        host = {"host pool": cfg.host_pool_bytes, "per-step counters": 2 * L * steps * 8}
        if self.o.optimal and not self.o.shared_prefix:
            host["Belady bound events"] = steps * L * self.live_max * min(self.K, self.max_len) * 8
        if self.dev.type != "cuda":
            host.update(device)
            device = {}
        return host, device

    # ---- helpers ---------------------------------------------------------------
    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def _rows(self, layer: int, inst: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The expected bytes of rows: of (request instance, position), or with
        --shared-prefix of (the token prefix up to the position, position)."""
        key = inst if self.keys is None else self.keys.keys(inst, pos)
        return row_content(self.o.seed, layer, key, pos, self.cfg.row_bytes)

    def _verify(self, cache, layer: int, step: int, req_ids: np.ndarray, inst_t: torch.Tensor,
                topk: torch.Tensor, phys: torch.Tensor) -> tuple[int, list[str]]:
        """Check the resolve of one layer; returns (rows checked, failure messages)."""
        fails: list[str] = []
        vin, vout = topk >= 0, phys >= 0
        if not torch.equal(vin, vout):
            t, k = (vin != vout).nonzero()[0].tolist()
            fails.append(f"step {step} layer {layer}: padding mismatch at token {t} entry {k} "
                         f"(topk {int(topk[t, k])} -> physical {int(phys[t, k])})")
            return 0, fails
        big = torch.iinfo(torch.int32).max

        def dups(x):
            a = torch.sort(torch.where(x >= 0, x, torch.full_like(x, big)), dim=1).values
            return int(((a[:, 1:] == a[:, :-1]) & (a[:, 1:] != big)).sum())

        if dups(phys) != dups(topk):
            fails.append(f"step {step} layer {layer}: distinct positions share a physical row")
        if self.o.verify == "none":
            return 0, fails
        hot = cache.hot_rows(layer)
        if phys.numel() == 0:
            return 0, fails
        if int(phys.max()) >= hot.shape[0]:
            fails.append(f"step {step} layer {layer}: physical index {int(phys.max())} out of "
                         f"range [0, {hot.shape[0]})")
            return 0, fails
        idx = vin.nonzero()  # [V, 2]
        if self.o.verify != "all" and idx.shape[0] > int(self.o.verify):
            pick = torch.randperm(idx.shape[0], generator=self.vgen, device=self.dev)[:int(self.o.verify)]
            idx = idx[pick]
        if idx.shape[0] == 0:
            return 0, fails
        t, k = idx[:, 0], idx[:, 1]
        pos, ph = topk[t, k].long(), phys[t, k].long()
        want = self._rows(layer, inst_t[t], pos)
        got = hot.index_select(0, ph)
        bad = (got != want).any(dim=1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            fails.append(f"step {step} layer {layer}: hot row {int(ph[i])} for request "
                         f"{int(req_ids[int(t[i])])} position {int(pos[i])} differs from the "
                         f"expected bytes ({int(bad.sum())} of {bad.numel()} checked rows bad)")
        t_cpu, pos_cpu = t.cpu(), pos.cpu()
        want_cpu = want.cpu()
        for tt in torch.unique(t_cpu).tolist():
            sel = (t_cpu == tt).nonzero().flatten()
            host = cache.read_host_rows(layer, int(req_ids[tt]), pos_cpu[sel])
            hbad = (host != want_cpu[sel]).any(dim=1)
            if bool(hbad.any()):
                j = int(hbad.nonzero()[0])
                fails.append(f"step {step} layer {layer}: host copy of request {int(req_ids[tt])} "
                             f"position {int(pos_cpu[sel][j])} differs from the expected bytes")
                break
        return int(idx.shape[0]), fails

    # ---- the run -----------------------------------------------------------------
    def run(self, on_step: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run every step; ``on_step(steps_done, cache_stats)`` (e.g. a metrics writer)
        is called after each step with the cache's ``stats()`` dict of that step."""
        o, L, K, S = self.o, self.L, self.K, self.S
        cache = HiSparseCache(self.cfg, kernels=self.kernels.value)
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)
        # the Belady bound models requests appending their own rows: none with a prefix cache
        tracker = OptimalTracker(num_layers=L, buffer_size=S) if o.optimal and not o.shared_prefix else None
        self._prefix_begin()
        recorder = TraceRecorder(num_layers=L, top_k=K) if o.record else None
        live: dict[int, tuple[int, int]] = {}  # id -> (instance, length)
        n_inst = 0
        step_ms: list[float] = []
        append_ms: list[float] = []  # decode appends of a step (all layers and requests)
        pf = {k: np.zeros(L, np.int64) for k in ("staged", "useful", "evicted")}
        pf["s"], pf["step_ms"] = np.zeros(L), []  # prefetch time per layer; steps with it
        step_hits = np.zeros((L, self.steps), np.int64)
        step_miss = np.zeros((L, self.steps), np.int64)
        step_res = np.zeros((L, self.steps), np.int64)  # entries resolved to resident rows (device pool)
        resolve_s = np.zeros(L)
        prefill_s, prefill_rows, verified, joined, left = 0.0, 0, 0, 0, 0
        failures: list[str] = []
        stats = cache.stats()
        prev = np.array([[d["hits"], d["misses"], d["resident_rows"]] for d in stats["layers"]], np.int64)
        done = 0
        tiers: dict[int, str] = {}  # id -> its residency at the last check
        tier_steps: dict[str, list] = {k: [] for k in TIER_SERIES}
        seeded_checked = 0  # hot-buffer rows checked right after a demotion seeded them
        ramp = self.schedule if isinstance(self.schedule, RampSchedule) else None
        overflowed = False
        with Progress(self.steps, "stress", enabled=o.progress) as bar:
            for s in range(self.steps):
                if self.replay is not None:
                    st = self.replay.steps[s]
                    ids, lens = st.req_ids, st.seq_lens
                elif ramp is not None:
                    ids, lens = ramp.step(s, overflowed=overflowed)
                else:
                    ids, lens = self.schedule.step(s)
                # leave
                for rid in [r for r in live if r not in set(ids.tolist())]:
                    cache.free_request(rid)
                    self._leave(rid)
                    self.source.drop(rid)
                    del live[rid]
                    tiers.pop(rid, None)
                    left += 1
                if ramp is not None and ids.size == 0:
                    break  # the ramp is over: every request has left
                # join + prefill (all but the step's last row)
                for rid, n in zip(ids.tolist(), lens.tolist()):
                    if rid not in live:
                        cached = self._admit(cache, rid, n_inst)  # tokens cached already (--shared-prefix)
                        live[rid] = (n_inst, cached)
                        if cached:  # resident on a holder's prefix pages, else hot (its prefix on the host only)
                            tiers[rid] = cache.residency(rid)
                        n_inst += 1
                        joined += 1
                    inst, cur = live[rid]
                    if n < cur + 1:
                        raise ValueError(f"step {s}: request {rid} length {n} does not grow "
                                         f"(was {cur}); a trace must append one row or more per step")
                    if n - 1 > cur:
                        self._sync()
                        t0 = time.perf_counter()
                        for layer in range(L):
                            for a in range(cur, n - 1, o.prefill_chunk):
                                b = min(n - 1, a + o.prefill_chunk)
                                pos = torch.arange(a, b, device=self.dev)
                                rows = self._rows(layer, torch.full_like(pos, inst), pos)
                                cache.write(layer, rid, rows)
                            if tracker:
                                tracker.append(layer, inst, n - 1)
                        self._sync()
                        prefill_s += time.perf_counter() - t0
                        prefill_rows += (n - 1 - cur) * L
                    live[rid] = (inst, n - 1)
                inst_t = torch.tensor([live[r][0] for r in ids.tolist()], dtype=torch.int64,
                                      device=self.dev)
                last = torch.as_tensor(lens - 1, device=self.dev)
                lens_t = torch.as_tensor(lens, device=self.dev)
                req_t = torch.as_tensor(ids, device=self.dev).to(torch.int32)
                topks = [self.source.select(layer, torch.as_tensor(ids, device=self.dev), lens_t, s)
                         for layer in range(L)]
                new_rows = [self._rows(layer, inst_t, last) for layer in range(L)]
                if recorder:
                    recorder.begin_step(ids, lens)
                # ---- timed: decode appends + resolves --------------------------------
                self._sync()
                t0 = time.perf_counter()
                id_list, ones = ids.tolist(), [1] * len(ids)
                for layer in range(L):  # one batched append per layer (fixed launches)
                    cache.write(layer, cache.plan_write(id_list, ones), new_rows[layer])
                self._sync()
                t_step = time.perf_counter() - t0
                append_ms.append(t_step * 1e3)
                for rid, n in zip(ids.tolist(), lens.tolist()):
                    live[rid] = (live[rid][0], n)
                self._prefix_step(cache, ids, lens)
                # the tiers after this step's writes: a request a spill demoted (in a joining request's
                # prefill or in the appends) has its seeded hot buffer checked before any resolve
                admitted = "resident" if self.cfg.pool_pages else "hot"  # a joining request's first tier
                demoted = [rid for rid in ids.tolist() if tiers.get(rid, admitted) == "resident"
                           and cache.residency(rid) == "hot"]
                tiers = {rid: cache.residency(rid) for rid in ids.tolist()}
                for rid in demoted:
                    for layer in range(L):
                        n_chk, f = self._verify_hot_buffer(cache, layer, s, rid, live[rid][0])
                        seeded_checked += n_chk
                        failures += f
                resident_t = torch.tensor([tiers[r] == "resident" for r in ids.tolist()], dtype=torch.bool,
                                          device=self.dev)
                slot_t = torch.tensor([cache.request(r).slot for r in ids.tolist()], dtype=torch.int64,
                                      device=self.dev)
                t_pf = 0.0
                for layer in range(L):
                    t0 = time.perf_counter()
                    res = cache.resolve(layer, req_t, topks[layer], validate=o.checked)
                    phys = res.physical.clone()
                    self._sync()
                    dt = time.perf_counter() - t0
                    t_step += dt
                    resolve_s[layer] += dt
                    n_chk, f = self._verify(cache, layer, s, ids, inst_t, topks[layer], phys)
                    verified += n_chk
                    failures += f
                    failures += self._check_tiers(layer, s, ids, phys, resident_t, slot_t)
                    tk_np = topks[layer].cpu().numpy()
                    if recorder:
                        recorder.add_layer(layer, tk_np)
                    if tracker:
                        for t, rid in enumerate(ids.tolist()):
                            inst = live[rid][0]
                            tracker.append(layer, inst, int(lens[t]))
                            tracker.resolve(layer, inst, s, tk_np[t])
                    if o.prefetch and layer + 1 < L:  # timed apart: a step's time is appends + resolves
                        rows = selected_rows(cache, ids.tolist(), topks[layer + 1])
                        hot0 = selected_hot(cache, layer + 1, rows)
                        t0 = time.perf_counter()
                        out = cache.prefetch(layer + 1, req_t, topks[layer])
                        self._sync()
                        dt = time.perf_counter() - t0
                        t_pf += dt
                        pf["s"][layer + 1] += dt
                        staged, useful = prefetch_useful(out, topks[layer].shape[1],
                                                         selected_host_rows(cache, ids.tolist(), topks[layer + 1]))
                        hot1 = selected_hot(cache, layer + 1, rows)
                        pf["staged"][layer + 1] += staged
                        pf["useful"][layer + 1] += useful
                        pf["evicted"][layer + 1] += int((hot0 & ~hot1).sum())
                step_ms.append(t_step * 1e3)
                if o.prefetch:
                    pf["step_ms"].append((t_step + t_pf) * 1e3)
                stats = cache.stats()
                cur = np.array([[d["hits"], d["misses"], d["resident_rows"]] for d in stats["layers"]], np.int64)
                step_hits[:, s], step_miss[:, s], step_res[:, s] = (cur - prev).T
                prev = cur
                done = s + 1
                t = stats["total"]
                for k in TIER_SERIES:
                    tier_steps[k].append(len(ids) if k == "live" else t[k])
                overflowed = t["spills"] >= 1 and t["hot_requests"] >= 1
                if on_step is not None:
                    on_step(done, stats)
                good = step_hits[:, :done].sum() + step_res[:, :done].sum()
                tot = good + step_miss[:, :done].sum()
                note = f"hit {good / max(tot, 1):.3f}"
                if self.cfg.pool_pages:
                    note += f" resident {t['resident_requests']} hot {t['hot_requests']} spills {t['spills']}"
                note += self._prefix_note(t)
                bar.update(1, note=note)
                if failures:
                    break
        if recorder:
            with writing("--record", o.record), self.outputs.open(o.record) as fh:
                recorder.save(fh)
        if ramp is not None and not failures:
            failures += self._ramp_end(cache, ramp, stats)
            stats = cache.stats()  # the figures after every request left
        prefix = None
        if self.keys is not None:  # every request leaves, the prefix cache is reset: the pool must be empty
            prefix, f = self._prefix_end(cache, live, stats, check=not failures)
            failures += f
        res = self._summary(stats, tracker, done, step_ms, append_ms, step_hits[:, :done],
                            step_miss[:, :done], resolve_s, prefill_s, prefill_rows, verified,
                            joined, left, failures, step_res[:, :done])
        if self.cfg.pool_pages:
            res["device_pool"] = self._pool_report(stats, tier_steps, step_hits[:, :done], step_miss[:, :done],
                                                   step_res[:, :done], seeded_checked)
            res["per_step"].update({k: v for k, v in tier_steps.items()})
        if prefix is not None:
            res["prefix"] = prefix
            res["per_step"].update(self._px_steps)
        if ramp is not None:
            res["ramp"] = {"joined": ramp.next_id, "overflowed": ramp.overflow_step is not None,
                           "overflow_step": ramp.overflow_step, "peak_live": ramp.peak_live,
                           "steps": done, "max_steps": ramp.max_steps,
                           "drained": stats["live_requests"] == 0 and stats["total"]["pool_rows_used"] == 0}
        if o.prefetch:
            rb = self.cfg.row_bytes
            res["prefetch"] = prefetch_report(pf, step_miss[:, :done], rb)
            for d, st, mb, t_r, t_p in zip(res["per_layer"], pf["staged"], step_miss[:, :done].sum(axis=1),
                                           resolve_s, pf["s"]):
                d["prefetch_rows"] = int(st)
                d["bytes_h2d"] = int(mb + st) * rb
                d["h2d_GBps"] = d["bytes_h2d"] / (t_r + t_p) / 1e9 if t_r + t_p > 0 else 0.0
            ov, t_all = res["overall"], resolve_s.sum() + pf["s"].sum()
            ov["bytes_h2d"] = sum(d["bytes_h2d"] for d in res["per_layer"])
            ov["h2d_GBps"] = ov["bytes_h2d"] / t_all / 1e9 if t_all > 0 else 0.0
            ov["step_ms_p50_with_prefetch"] = _pct(pf["step_ms"], 50)
        return res

    def _summary(self, stats, tracker, done, step_ms, append_ms, hits, misses, resolve_s, prefill_s,
                 prefill_rows, verified, joined, left, failures, resident) -> dict[str, Any]:
        rb = self.cfg.row_bytes
        opt = tracker.compute(done) if tracker is not None else None
        per_layer = []
        for layer in range(self.L):
            h, m, rr = int(hits[layer].sum()), int(misses[layer].sum()), int(resident[layer].sum())
            d = {"layer": layer, "hits": h, "misses": m, "resident_rows": rr, "hit_rate": hit_rate(h + rr, m),
                 "miss_rate": 1.0 - hit_rate(h + rr, m),
                 "optimal_hit_rate": hit_rate(opt["hits"][layer], opt["misses"][layer]) if opt else None,
                 "bytes_h2d": m * rb,
                 "h2d_GBps": m * rb / resolve_s[layer] / 1e9 if resolve_s[layer] > 0 else 0.0}
            per_layer.append(d)
        H, M, RR = int(hits.sum()), int(misses.sum()), int(resident.sum())
        step_hr = [hit_rate(hits[:, s] + resident[:, s], misses[:, s]) for s in range(done)]
        opt_hr = [hit_rate(opt["hits"][:, s], opt["misses"][:, s]) for s in range(done)] if opt else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        gpu_peak = torch.cuda.max_memory_allocated(self.dev) if self.dev.type == "cuda" else None
        dev_name = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"
        o = self.o
        return {
            "ok": not failures,
            "failures": failures,
            "device": dev_name,
            "kernels": stats["kernels"],
            "timings_are": ("GPU (CUDA-synchronised)" if self.dev.type == "cuda" else
                            "CPU (Triton interpreter)" if stats["kernels"] == "triton" else
                            "CPU (torch reference path)"),
            "config": self.cfg.to_dict(),
            "options": {k: v for k, v in plain_dict(o).items() if k != "progress"},
            "workload": {"trace": o.trace.value,
                         "drift": o.drift_used if o.trace.drifts else None,
                         "replay": o.replay, "steps_run": done, "steps_planned": self.steps,
                         "requests": o.num_requests if self.replay is None else None,
                         "context": o.context if self.replay is None else None,
                         "context_min": self.schedule.cmin if self.replay is None else None,
                         "churn": o.churn if self.replay is None else None,
                         "joined": joined, "left": left, "verify": o.verify, "seed": o.seed,
                         "checked": o.checked, "prefill_chunk": o.prefill_chunk, "record": o.record},
            "overall": {
                "hits": H, "misses": M, "resident_rows": RR, "hit_rate": hit_rate(H + RR, M),
                "miss_rate": 1.0 - hit_rate(H + RR, M),
                "optimal_hit_rate": hit_rate(opt["hits"], opt["misses"]) if opt else None,
                "bytes_h2d": M * rb,
                "h2d_GBps": M * rb / resolve_s.sum() / 1e9 if resolve_s.sum() > 0 else 0.0,
                "step_ms_min": min(step_ms) if step_ms else 0.0,
                "step_ms_p50": _pct(step_ms, 50), "step_ms_p99": _pct(step_ms, 99),
                "append_ms_p50": _pct(append_ms, 50),
                "resolve_ms_p50": _pct([a - b for a, b in zip(step_ms, append_ms)], 50),
                "prefill_rows": prefill_rows, "prefill_s": prefill_s,
                "rows_verified": verified,
                "host_pool_bytes": self.cfg.host_pool_bytes,
                "hot_buffer_bytes": self.cfg.hot_buffer_bytes,
                "host_rss_peak_bytes": rss,
                "gpu_peak_bytes": gpu_peak,
            },
            "per_layer": per_layer,
            "per_step": {"hit_rate": step_hr, "optimal_hit_rate": opt_hr, "step_ms": step_ms},
        }


def run_stress(o: StressOptions) -> dict[str, Any]:
    """Run a stress workload; see the module docstring. ``result['ok']`` says pass/fail."""
    return StressRun(o).run()
