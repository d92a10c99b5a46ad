"""The mini engine's serving loop, and the resident-vs-hisparse comparison.

Serving: requests arrive at different steps, prefill in chunks (``chunk`` tokens, a
per-step token budget), then decode ``decode_len`` steps of ``query_len`` tokens each
(teacher-forced: every input token is fixed up front, so both runs see the same inputs),
and leave. Each step is one forward over decode tokens first, then prefill chunks.

:func:`run` serves the same workload twice, differing only in the KV store
(:mod:`.kv`), and compares the final hidden states token by token: the same rows are
gathered, so they normally match exactly; ``tolerance`` bounds the relative difference.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from hisparse.attention import FlashMLABackend, Phase, TritonBackend, choose_backend, get_backend
from hisparse.config import RowFormat, check_int
from hisparse.device import resolve_device
from hisparse.engine import SparseMLAMetadata, device_ints
from hisparse.formats import D_LATENT, D_ROW
from ..exit_codes import writing
from ..fields import plain_dict
from ..outputs import Outputs
from ..preflight import check_memory, parse_device, require_kernels
from ..traces import TraceRecorder
from .config import MiniEngineConfig, Request, make_workload, memory_needed
from .graphs import DecodeGraphs, DecodeMode, StaticInputs, bucket_for
from .kv import KV_STORES, Attention, Batch
from .model import Indexer, Model, synthetic_rows
from .prefix import IndexerPrefix


class MiniEngine:
    """Runs the workload through one KV store; records the final hidden state of every token."""

    def __init__(self, cfg: MiniEngineConfig, kv_kind: str, *, decode_mode: DecodeMode | None = None) -> None:
        """``decode_mode``: how decode-only steps run (``.graphs``); default GRAPHS with
        ``cfg.graphs``, PADDED with ``cfg.layer_graphs``, else EAGER. PADDED runs the
        graphs' padded forward eagerly."""
        if kv_kind not in KV_STORES:
            raise ValueError(f"kv_kind must be one of {sorted(KV_STORES)}, got {kv_kind!r}")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.slots = cfg.slots
        self.scratch_slot = self.slots  # the padding tokens' slot (indexer keys, resident rows)
        self.model = Model(cfg, self.device)
        self.indexer = Indexer(cfg, self.slots, self.device)
        self.recorder: TraceRecorder | None = None  # decode steps' top-k go there (run(record=))
        self.fmt = cfg.row_format
        self.decode_backend = self._pick(Phase.DECODE, self.fmt)
        self.prefill_backend = self._pick(Phase.PREFILL, RowFormat.BF16)
        ws = torch.zeros(self.slots * cfg.max_context, D_ROW, dtype=torch.bfloat16, device=self.device)
        self.attn = Attention(decode=self.decode_backend, prefill=self.prefill_backend,
                              sm_scale=self.model.sm_scale, row_format=self.fmt, workspace=ws)
        self.kv = KV_STORES[kv_kind](cfg, self.slots, self.device, self.attn)
        # prefix reuse: the indexer keys of cached prompt blocks (hisparse holds their rows)
        self.prefix = IndexerPrefix(cfg, self.indexer) if cfg.prefix_reuse and kv_kind == "hisparse" else None
        if decode_mode is not None:
            mode = decode_mode
        else:
            mode = DecodeMode.GRAPHS if cfg.graphs else DecodeMode.PADDED if cfg.layer_graphs else DecodeMode.EAGER
        if not isinstance(mode, DecodeMode):
            raise TypeError(f"decode_mode must be a DecodeMode, got {mode!r}")
        self.graphs = DecodeGraphs(self, mode) if mode is not DecodeMode.EAGER else None

    def _pick(self, phase: Phase, row_format: RowFormat):
        cfg = self.cfg
        be = choose_backend(device=self.device, row_format=row_format, num_heads=cfg.num_heads, phase=phase,
                            prefer=cfg.backend, flashmla_lib=cfg.flashmla_lib)
        if phase is Phase.DECODE and cfg.backend is not None and be.name != cfg.backend:
            # a backend asked for by name runs the decode or the run stops (prefill may fall
            # back: it reads the staged bf16 workspace, which not every backend attends over)
            why = get_backend(cfg.backend, flashmla_lib=cfg.flashmla_lib).supports(
                device=self.device, row_format=row_format, num_heads=cfg.num_heads, phase=phase)
            raise ValueError(f"backend {cfg.backend!r} cannot run the decode here ({why}); pick another "
                             f"or leave it out for the chooser's pick ({be.name})")
        if not cfg.validate and be.name == "triton":  # skip the host-syncing range check
            be = TritonBackend(validate=False)
        elif not cfg.validate and be.name == "flashmla":
            be = FlashMLABackend(library_path=cfg.flashmla_lib, check_ranges=False)
        return be

    # ---- scheduling -------------------------------------------------------
    def _schedule(self, running: list[Request]) -> list[tuple[Request, int]]:
        cfg = self.cfg
        dec = [(r, cfg.query_len) for r in running if r.done >= r.prompt_len]
        budget = cfg.max_batch_tokens - len(dec) * cfg.query_len
        pre = []
        for r in running:
            if r.done < r.prompt_len and budget > 0:
                n = min(cfg.chunk, r.prompt_len - r.done, budget)
                pre.append((r, n))
                budget -= n
        return dec + pre

    def _batch(self, items: list[tuple[Request, int]]) -> Batch:
        nd = sum(1 for r, _ in items if r.done >= r.prompt_len)
        md = SparseMLAMetadata.build(request_ids=[r.rid for r, _ in items], query_lens=[n for _, n in items],
                                     seq_lens=[r.done + n for r, n in items], num_decodes=nd,
                                     device=self.device)
        dec_slots = [r.slot for r, n in items[:nd] for _ in range(n)]
        starts, acc = [], 0
        for r, n in items[nd:]:
            starts.append(acc)
            acc += r.done + n
        both = device_ints(dec_slots + starts, self.device)  # one non-blocking copy (metadata.device_ints)
        return Batch(items, md, both[:len(dec_slots)], both[len(dec_slots):], starts, acc)

    # ---- one forward --------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        cfg, md, dev = self.cfg, batch.md, self.device
        toks, pos, slots, sub = [], [], [], []
        for r, n in batch.items:
            toks.append(r.tokens[r.done:r.done + n])
            pos += range(r.done, r.done + n)
            slots += [r.slot] * n
            sub += range(n)
        tok = torch.cat(toks).to(dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        sub_t = torch.tensor(sub, dtype=torch.int64, device=dev)
        flat = slot_t * cfg.max_context + pos_t
        td, nd = md.num_decode_tokens, md.num_decodes
        ctx = max((r.done + n for r, n in batch.items[:nd]), default=0)
        self.kv.begin(batch)
        x = x0 = self.model.embed[tok]
        T = x.shape[0]
        topk, pre_idx = None, None  # the last Full layer's (a Shared layer reuses them)
        for layer in range(cfg.num_layers):
            full = cfg.full_layer(layer)
            xb, rows, iq, ik = self.model.pre(layer, x, cfg.validate)
            self.kv.write(layer, rows, batch)
            if full:
                self.indexer.write(layer, ik, flat)
            out = torch.zeros(T, cfg.num_heads, D_LATENT, dtype=torch.bfloat16, device=dev)
            staged = None
            if td:
                if full:
                    topk = self.indexer.decode_topk(layer, iq[:td], slot_t[:td], sub_t[:td], pos_t[:td], ctx)
                if self.recorder is not None:
                    if layer == 0:  # one entry per decode token (q = 1): the request and its length
                        rids = [r.rid for r, n in batch.items[:nd] for _ in range(n)]
                        self.recorder.begin_step(rids, (pos_t[:td] + 1).tolist())
                    self.recorder.add_layer(layer, topk)
                staged = self.kv.stage_decode(layer, topk, batch)
            q = self.model.q_proj(layer, xb)
            if td:
                out[:td] = self.kv.decode_attention(layer, q[:td], topk, batch, staged)
            if T > td:
                if full:
                    parts, t = [], td
                    for j, (r, n) in enumerate(batch.items[nd:]):
                        tk = self.indexer.prefill_topk(layer, iq[t:t + n], r.slot, r.done)
                        start = batch.ws_starts_cpu[j]
                        parts.append(torch.where(tk >= 0, tk + start, tk))
                        t += n
                    pre_idx = torch.cat(parts)
                out[td:] = self.kv.prefill_attention(layer, q[td:], pre_idx, batch)
            x = self.model.post(layer, x, out, x0)
        return x

    def forward_padded(self, batch: Batch, st: StaticInputs) -> torch.Tensor:
        """A decode-only forward over the bucket's static inputs (fixed shapes, what a CUDA
        graph captures): fp32 [N * q, hidden], padding rows included. ``batch.dec_slots``
        is the bucket's static int32 slots."""
        cfg = self.cfg
        flat = st.slot * cfg.max_context + st.pos
        self.kv.begin_padded(batch, st)
        x = x0 = self.model.embed[st.tok]
        topk = None  # the last Full layer's (a Shared layer reuses it)
        for layer in range(cfg.num_layers):
            xb, rows, iq, ik = self.model.pre(layer, x, False)
            self.kv.write(layer, rows, batch)
            if cfg.full_layer(layer):
                self.indexer.write(layer, ik, flat)
                topk = self.indexer.decode_topk_fixed(layer, iq, st.slot, st.sub, st.lim)
            staged = self.kv.stage_decode(layer, topk, batch)  # before q: captured, they overlap
            q = self.model.q_proj(layer, xb)
            x = self.model.post(layer, x, self.kv.decode_attention(layer, q, topk, batch, staged), x0)
        return x

    # ---- serving loop ---------------------------------------------------------
    def run(self, progress: Callable[[int, int, int], None] | None = None,
            profile: tuple[int, int] | None = None) -> dict:
        """Serve the whole workload; ``progress(step, running, pending)`` after each step.

        ``profile=(after, n)``: the n graph replays after the first ``after`` ones run
        under torch.profiler (kernel times in the result's ``profile``, see
        :class:`ReplayProfile`) and are left out of the step times (not of ``time_s``)."""
        cfg, dev = self.cfg, self.device
        prof = ReplayProfile(dev, *profile) if profile is not None else None
        reqs = make_workload(cfg)
        pending = sorted(reqs, key=lambda r: r.arrival)
        running: list[Request] = []
        free_slots = list(range(self.slots - 1, -1, -1))
        s0 = cfg.synthetic_context  # positions written synthetically have no output
        # every request's output rows in one buffer (outputs[rid] views it): a step's rows
        # land with one index_copy_ instead of one copy per request
        base, acc = {}, 0
        for r in reqs:
            base[r.rid] = acc
            acc += r.total - s0
        out_rows = torch.zeros(acc, cfg.hidden, device=dev)
        outputs = {r.rid: out_rows[base[r.rid]:base[r.rid] + r.total - s0] for r in reqs}
        argmax: dict[int, torch.Tensor] = {}
        step, tokens, step_times, decode_step_times, replay_step_times = 0, 0, [], [], []
        replay_gpu_times: list[float] = []  # the replays' GPU time (CUDA events around each)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        sync()
        t_start = time.perf_counter()
        fill_time = 0.0
        # The step in flight (CUDA, async_steps): its GPU work was launched and the host
        # went on to prepare the next step; it is finished (timed, its requests released)
        # once the next step is launched, or before anything that must see it done.
        inflight: dict | None = None
        last_done = t_start

        def finish(f: dict) -> None:
            nonlocal last_done
            f["wait"]()
            now = time.perf_counter()
            # a step launched behind another takes from the end of that one to its own end
            dt = now - last_done if f["pipelined"] else now - f["t0"]
            last_done = now
            if f["profiled"]:  # a profiled step's time is the profiler's too: in no step list
                prof.stop(f["replay"])
            else:
                step_times.append(dt)
                if f["decode"]:
                    decode_step_times.append(dt)
            if f["replay"] and not f["profiled"]:
                replay_step_times.append(dt)
                replay_gpu_times.append(DecodeGraphs.replay_gpu_s(f["marks"]))
            for r in f["released"]:
                self.kv.release(r)
                if self.prefix is not None:
                    self.prefix.release(r)
                free_slots.append(r.slot)

        while pending or running:
            # an admission (whose fill syncs) waits for the step in flight, or needs its slots
            admits = pending and pending[0].arrival <= step and (
                free_slots or (inflight is not None and inflight["released"]))
            if inflight is not None and (admits or not running):
                finish(inflight)  # its slots may be needed, and a fill syncs anyway
                inflight = None
            while pending and pending[0].arrival <= step and free_slots:
                r = pending.pop(0)
                r.slot = free_slots.pop()
                r.done = 0
                r.cached = self.kv.admit(r)  # prefix reuse: tokens whose KV is cached, not computed
                if self.prefix is not None:
                    self.prefix.admit(r, r.cached)
                    r.done = r.cached
                if cfg.synthetic_context:
                    t0 = time.perf_counter()
                    self._fill(r)
                    sync()
                    fill_time += time.perf_counter() - t0
                running.append(r)
            if not running:
                step += 1
                continue
            items = self._schedule(running)
            batch = self._batch(items)
            profiled = prof is not None and prof.wants(self.graphs, batch)
            if profiled and inflight is not None:
                finish(inflight)
                inflight = None
            if profiled:
                prof.start()
            t0 = time.perf_counter()
            replay = False
            if self.graphs is not None and batch.md.num_prefills == 0:
                x = self.graphs.step(batch)
                replay = self.graphs.last == "replay"
            else:
                x = self.forward(batch)
            dst: list[int] = []
            for r, n in items:
                b = base[r.rid] + r.done - s0
                dst += range(b, b + n)
            idx = torch.tensor(dst, dtype=torch.int64)
            out_rows.index_copy_(0, idx.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else idx, x)
            ev = self._step_event()
            if replay and not profiled and prof is not None:
                prof.replays_seen += 1  # counted at launch: the next step asks prof.wants first
            tokens += x.shape[0]
            released = []
            for r, n in items:
                if self.prefix is not None:
                    self.prefix.save(r, r.done, r.done + n)
                r.done += n
                if r.done >= r.total:
                    running.remove(r)
                    released.append(r)
            ahead = ev is not None and cfg.async_steps and not profiled
            # one step ahead, a step is done when the compute stream passed its end (its
            # side streams' work is ordered by the cache's events); else the device idles
            this = {"wait": ev.synchronize if ahead else sync, "t0": t0, "profiled": profiled,
                    "replay": replay, "released": released, "decode": batch.md.num_prefills == 0,
                    "pipelined": inflight is not None, "marks": self.graphs.last_marks if replay else None}
            if inflight is not None:
                finish(inflight)  # the step before: this one is already launched behind it
            inflight = None
            if ahead:
                inflight = this
            else:
                finish(this)
            step += 1
            if progress is not None:
                progress(step, len(running), len(pending))
        if inflight is not None:
            finish(inflight)
        sync()
        total = time.perf_counter() - t_start - fill_time
        for r in reqs:
            argmax[r.rid] = self.model.logits(outputs[r.rid]).argmax(dim=-1)
        return {"outputs": outputs, "argmax": argmax, "skipped": {r.rid: r.cached for r in reqs},
                "tokens": tokens, "steps": step, "time_s": total,
                "step_times": step_times, "decode_step_times": decode_step_times,
                "replay_step_times": replay_step_times, "replay_gpu_times": replay_gpu_times,
                "fill_time_s": fill_time,
                "stats": self.kv.stats(), "synthetic": cfg.synthetic_context,
                "profile": prof.report() if prof is not None else None,
                "graphs": self.graphs.report() if self.graphs is not None else None,
                "layer_graphs": self.kv.layer_graphs()}

    def _step_event(self):
        """A CUDA event recorded after a step's launches, which the loop waits on to
        finish the step (None on CPU, where a step has run when its calls return)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _fill(self, r: Request) -> None:
        n = self.cfg.synthetic_context
        flat = r.slot * self.cfg.max_context + torch.arange(n, device=self.device)
        for layer in range(self.cfg.num_layers):
            rows, ik = synthetic_rows(self.cfg, r.rid, layer, n, self.device)
            self.kv.fill(r, layer, rows)
            if self.cfg.full_layer(layer):
                self.indexer.write(layer, ik, flat)
        r.done = n


# ---------------------------------------------------------------------- compare
class ReplayProfile:
    """Kernel times of ``n`` graph-replayed decode steps after the first ``after``
    replays, under torch.profiler (CUDA activity: the kernels a replay launches; on CPU
    the ops). ``report()``: steps profiled, GPU time per step (the kernels' durations
    summed: overlapping kernels count twice), the top kernels by time per step, and the
    step's timeline: its span (first start to last end), the idle time in it (no kernel
    or copy running) and the idle gaps summed by the pair of activities around them."""

    def __init__(self, device: torch.device, after: int, n: int, top: int = 20) -> None:
        if after < 0 or n < 1:
            raise ValueError(f"profile needs after >= 0 and n >= 1, got ({after}, {n})")
        self.device, self.after, self.n, self.top = device, after, n, top
        self.replays_seen = 0  # timed replays so far
        self.steps = 0  # profiled replays
        self._prof = None
        self._kernels: dict[str, list[float]] = {}  # name -> [count, total us]
        self._span_us = 0.0  # summed over profiled steps
        self._idle_us = 0.0
        self._gaps: dict[tuple[str, str], list[float]] = {}  # (ended before, started after) -> [count, us]

    def wants(self, graphs, batch: Batch) -> bool:
        """Whether this step should be profiled: a step that will replay a captured graph
        once ``after`` replays have been timed, until ``n`` have been profiled."""
        if graphs is None or batch.md.num_prefills or not batch.md.num_decodes:
            return False
        if self.replays_seen < self.after or self.steps >= self.n:
            return False
        n = bucket_for(batch.md.num_decodes, graphs.sizes)
        return any(k[0] == n for k in graphs.graphs)

    def start(self) -> None:
        act = ProfilerActivity.CUDA if self.device.type == "cuda" else ProfilerActivity.CPU
        self._prof = profile(activities=[act])
        self._prof.__enter__()

    def stop(self, replayed: bool) -> None:
        """End the step's profile; its kernels count only when the step replayed."""
        self._prof.__exit__(None, None, None)
        cuda = self.device.type == "cuda"
        events = self._prof.events() if replayed else []
        spans = []
        for e in events:
            if cuda and getattr(e.device_type, "name", "") != "CUDA":
                continue
            k = self._kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
            spans.append((e.time_range.start, e.time_range.end, e.name))
        if cuda and spans:
            self._timeline(spans)
        self._prof = None
        self.steps += int(replayed)

    def _timeline(self, spans: list[tuple[float, float, str]]) -> None:
        """Add one step's span, idle time and gaps (``spans``: (start us, end us, name))."""
        spans.sort()
        self._span_us += max(e for _, e, _ in spans) - spans[0][0]
        reach, last = spans[0][1], spans[0][2]  # the latest end so far, and what ended there
        for start, end, name in spans[1:]:
            if start > reach:
                gap = self._gaps.setdefault((last, name), [0, 0.0])
                gap[0] += 1
                gap[1] += start - reach
                self._idle_us += start - reach
            if end > reach:
                reach, last = end, name

    def report(self) -> dict:
        n = max(self.steps, 1)
        ranked = sorted(self._kernels.items(), key=lambda kv: -kv[1][1])
        total = sum(v[1] for v in self._kernels.values()) / n
        return {"steps": self.steps, "activity": "cuda" if self.device.type == "cuda" else "cpu",
                "busy_us_per_step": total,
                "top": [{"name": k, "calls_per_step": v[0] / n, "us_per_step": v[1] / n,
                         "share": (v[1] / n) / total if total else None} for k, v in ranked[:self.top]],
                "span_us_per_step": self._span_us / n, "idle_us_per_step": self._idle_us / n,
                "gaps": [{"after": a, "before": b, "per_step": v[0] / n, "us_per_step": v[1] / n}
                         for (a, b), v in sorted(self._gaps.items(), key=lambda kv: -kv[1][1])[:self.top]]}


def step_stats(xs: list[float]) -> dict:
    """n, min / median / p99 in ms of step times in seconds (nearest rank)."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"n": len(s), "min_ms": s[0] * 1e3, "median_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3}


def compare(cfg: MiniEngineConfig, a: dict, b: dict) -> dict:
    """Token-by-token comparison of two runs' final hidden states and argmax tokens (the
    positions either run skipped, prefix reuse's cached ones, have no output: left out)."""
    max_diff, scale, mismatched, n, skipped = 0.0, 0.0, 0, 0, 0
    for rid in a["outputs"]:
        k = max(a.get("skipped", {}).get(rid, 0), b.get("skipped", {}).get(rid, 0))
        k = max(0, k - cfg.synthetic_context)
        xa, xb = a["outputs"][rid][k:], b["outputs"][rid][k:]  # positions synthetic_context onwards
        max_diff = max(max_diff, float((xa - xb).abs().max()) if xa.numel() else 0.0)
        scale = max(scale, float(xa.abs().max()) if xa.numel() else 0.0)
        mismatched += int((a["argmax"][rid][k:] != b["argmax"][rid][k:]).sum())
        n += xa.shape[0]
        skipped += k
    rel = max_diff / scale if scale else 0.0
    return {"tokens_compared": n, "tokens_skipped": skipped, "max_abs_diff": max_diff, "max_rel_diff": rel,
            "argmax_mismatches": mismatched, "bitwise_equal": max_diff == 0.0,
            "within_tolerance": rel <= cfg.tolerance}


def preflight(cfg: MiniEngineConfig) -> None:
    """Before anything runs: the device and cache kernels (CUDA present, the Triton
    interpreter on for triton kernels on CPU) and the memory the run allocates
    (:func:`memory_needed`, a ``CapacityError`` when it can't fit)."""
    dev = parse_device(cfg.device)
    require_kernels(cfg.cache_kernels, dev, flag="--kernels")
    host, device = memory_needed(cfg)
    check_memory(host=host, device=device, on=dev, what="this mini-engine run",
                 hint="lower --requests, --max-prompt, --layers or --heads")


def run_engine(cfg: MiniEngineConfig, kind: str, *, progress: bool = False, decode_mode: DecodeMode | None = None,
               recorder: TraceRecorder | None = None, profile: tuple[int, int] | None = None) -> dict:
    """Serve the workload with one KV store (``kind``); the raw result (outputs included).
    The engine is freed (and the CUDA cache emptied) before it returns."""
    # each engine starts from a collected heap, so the second run's host calls do not
    # share the process with the first one's uncollected objects (GPU tensors included)
    gc.collect()
    eng = MiniEngine(cfg, kind, decode_mode=decode_mode)
    eng.recorder = recorder
    def show(step, nrun, npend):
        print(f"\r[{kind}] step {step} running {nrun} pending {npend}", end="", file=sys.stderr)
    cb = show if progress else None
    res = eng.run(cb, profile=profile)
    if progress:
        print(file=sys.stderr)
    res["backend"] = {"decode": eng.decode_backend.name, "prefill": eng.prefill_backend.name}
    del eng
    gc.collect()
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def adjacent_layer_overlap(cfg: MiniEngineConfig, *, requests: int = 2) -> list[float | None]:
    """Adjacent-layer top-k overlap of ``cfg``'s model (:meth:`TraceRecorder.adjacent_overlap`),
    from an eager resident run of its first ``requests`` requests (the same inputs as in a
    run of all of them; a batch of another size may round its GEMMs differently, which
    can move a selection at a tie). A pair ending in a Shared layer is 1 by
    construction, and so is one whose context is at most top_k. Needs query_len 1."""
    check_int("requests", requests, lo=1)
    if cfg.query_len != 1:
        raise ValueError(f"the overlap probe records one entry per request and step: query_len must be 1, "
                         f"got {cfg.query_len}")
    small = dataclasses.replace(cfg, num_requests=min(requests, cfg.num_requests), max_num_reqs=None,
                                graphs=False)
    rec = TraceRecorder(num_layers=small.num_layers, top_k=small.top_k)
    run_engine(small, "resident", decode_mode=DecodeMode.EAGER, recorder=rec)
    return rec.adjacent_overlap()


def summarize(res: dict) -> dict:
    """The timings of a :func:`run_engine` result (no tensors)."""
    tps = res["tokens"] / res["time_s"] if res["time_s"] > 0 else 0.0
    st_ms = step_stats(res["step_times"])
    med = st_ms.get("median_ms")
    slow = [t for t in res["step_times"] if med and t * 1e3 > 10 * med]
    out = {"tokens": res["tokens"], "steps": res["steps"], "time_s": res["time_s"],
           "tokens_per_s": tps, "step": st_ms,
           # steps over 10x the median (e.g. a kernel compiling for new shapes)
           # make tokens_per_s meaningless as a comparison: reported, not hidden
           "outlier_steps": len(slow), "outlier_s": sum(slow),
           "decode_step": step_stats(res["decode_step_times"]), "fill_time_s": res["fill_time_s"],
           # decode steps that replayed a captured graph (GRAPHS mode; no capture, no warm-up)
           "replay_step": step_stats(res["replay_step_times"]),
           # the same replays' GPU time alone (events around the replay: no host work)
           "replay_gpu": step_stats(res.get("replay_gpu_times", [])),
           "backend": res["backend"], "graphs": res["graphs"], "layer_graphs": res.get("layer_graphs")}
    tot = res["stats"].get("total", {})
    if tot:
        out["cache"] = {k: tot.get(k) for k in ("hits", "misses", "hit_rate", "prefetch_rows", "bytes_h2d",
                                                "bytes_d2h", "invalid", "resolves", "resident_rows",
                                                "resident_requests", "hot_requests", "pool_rows_used",
                                                "pool_rows_total", "spills", "seeded_rows",
                                                "finished_resident", "finished_hot", "prefix_query_tokens",
                                                "prefix_hit_tokens", "cached_blocks", "shared_blocks",
                                                "prefix_evictions", "pool_pages_shared",
                                                "prefix_resident_joins")}
        # a prefetched row a resolve then finds is a hit: per layer, so Shared layers show apart
        layers = res["stats"].get("layers", [])
        out["cache"]["layer_hit_rates"] = [d["hit_rate"] for d in layers]
        out["cache"]["layer_misses"] = [d["misses"] for d in layers]
        out["cache"]["layer_prefetch_rows"] = [d["prefetch_rows"] for d in layers]
    return out


def run(cfg: MiniEngineConfig, *, progress: bool = False, record: str | None = None,
        decode_mode: DecodeMode | None = None, outputs: Outputs | None = None) -> dict:
    """Run the workload resident then hisparse; return the comparison and timings (no tensors).

    ``record``: write the decode steps' top-k (this model's real indexer) to a trace file
    in the format of ``hisparse_tools.traces``, which ``hisparse stress --replay`` drives
    the cache with. Needs query_len 1 (one trace entry per request and step).
    ``decode_mode``: see :class:`MiniEngine`. :func:`preflight` runs first. ``outputs``:
    the command's :class:`~hisparse_tools.outputs.Outputs`, where ``record`` is checked.
    """
    preflight(cfg)
    recorder = None
    if record is not None:
        if cfg.query_len != 1:
            raise ValueError(f"--record needs query_len 1 (one trace entry per request and step), "
                             f"got {cfg.query_len}")
        if cfg.graphs or cfg.layer_graphs or decode_mode not in (None, DecodeMode.EAGER):
            raise ValueError("--record reads every decode step's top-k on the host; it cannot run with --graphs "
                             "or --layer-graphs (their decode steps run the padded forward)")
        outputs = outputs if outputs is not None else Outputs()
        outputs.file(record, flag="--record")
        recorder = TraceRecorder(num_layers=cfg.num_layers, top_k=cfg.top_k)
    results = {kind: run_engine(cfg, kind, progress=progress, decode_mode=decode_mode,
                                recorder=recorder if kind == "resident" else None)  # same selections in both
               for kind in ("resident", "hisparse")}
    cmp = compare(cfg, results["resident"], results["hisparse"])
    out = {"config": plain_dict(cfg), "compare": cmp}
    if recorder is not None:
        with writing("--record", record), outputs.open(record) as fh:
            recorder.save(fh)
        out["trace"] = {"path": str(record), "decode_steps": recorder.num_steps}
    for kind, res in results.items():
        out[kind] = summarize(res)
    r, h = out["resident"], out["hisparse"]
    out["ratio"] = {
        "tokens_per_s_hisparse_over_resident": h["tokens_per_s"] / r["tokens_per_s"] if r["tokens_per_s"] else None,
        "decode_step_median_hisparse_over_resident":
            (h["decode_step"]["median_ms"] / r["decode_step"]["median_ms"])
            if r["decode_step"].get("n") and h["decode_step"].get("n") else None,
    }
    if r["replay_step"].get("n") and h["replay_step"].get("n"):
        out["ratio"]["replay_step_median_hisparse_over_resident"] = (h["replay_step"]["median_ms"]
                                                                     / r["replay_step"]["median_ms"])
    return out


__all__ = ["MiniEngine", "compare", "run", "run_engine", "summarize", "preflight", "step_stats"]
