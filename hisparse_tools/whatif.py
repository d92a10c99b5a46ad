"""``hisparse whatif``: miss rate against hot-buffer size, from a trace, without the cache.

Input: a recorded trace (``--replay FILE``, the ``.npz`` of ``stress --record`` or
``mini-engine --record``) or a generated one (``--trace NAME`` with its knobs, or a
``--preset``: the default is ``glm51``, a working-set generator calibrated to the
HiSparse GLM-5.1 miss rates, see docs/WHATIF.md). Generated traces follow the stress
tool's schedule and sources exactly, so ``whatif`` with stress's flags replays what
``stress`` would run.

For every buffer size S of ``--buffers`` (default 1, 1.5, 2, 3, 4 x top-k) and every
layer, the trace's streams run through the cache's exact LRU and through Belady's
offline optimum (``hisparse_tools.belady``; the LRU model equals the real cache's
hit/miss counters, resolve by resolve). Reported per buffer size:

- ``lru_miss_rate`` / ``belady_miss_rate``: misses / lookups (unique valid positions of
  each resolve, as the cache's STAT_HITS / STAT_MISSES count them);
- staging per layer-step (one layer's resolve of the whole batch): rows, bytes = rows x
  row size, time = bytes / PCIe bandwidth (default 55 GB/s, the H200's bulk pinned
  host -> device copy: a lower bound, scattered-row gathers run slower), mean / p99 /
  max over the layer-steps;
- ``prefetch_hit_gain``: share of the lookups of layers >= 1 that are LRU misses the
  previous layer selected in the same step (a prefetch of the previous layer's
  selection, staged while that layer computes, would turn them into hits).

Also the trace's measured overlaps: ``adjacent_layer`` (share of a layer's selection
the previous layer selected in the same step) and ``consecutive_step`` (share a
request's selection shares with its previous step in the same layer).

``--warmup N``: each request's first N decode steps are simulated but not counted
(steady-state figures; the preset uses it). Exit status: 0 ok, 2 bad input, 3 a run
whose tables would not fit host memory (refused before any work), 4 missing dependency
(matplotlib for ``--plot``, CUDA for ``--device cuda``; checked before any work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any

import numpy as np
import torch

from hisparse.config import RowFormat, check_int
from .exit_codes import MissingDependency, writing
from .fields import parse_choices
from .flag_rules import check_whatif
from .belady import (LayerTrace, Policy, hit_rate, make_plan, next_uses, row_membership,
                     simulate)
from .units import token_arg
from .preflight import check_memory, check_output_dir, path_arg
from .progress import Progress
from .report import PlotUnavailable, require_matplotlib  # noqa: F401 (PlotUnavailable: raised from here)
from .sources import CorrelatedSource, IndexerSource, UniformSource, WorkingSetSource, workingset_state_bytes
from .traces import Trace, TraceStep, load_trace
from .whatif_report import format_whatif, plot_whatif
from .workload import Schedule, StressOptions

EXIT_OK = 0
PCIE_GBPS = 55.0  # H200 bulk pinned host -> device copy: the ceiling for staging (docs/PERF_NOTES.md)
MAX_THREADS = 1024  # --threads bound: torch.set_num_threads crashes the process on absurd counts
GENERATORS = (Trace.WORKINGSET, Trace.CORRELATED, Trace.UNIFORM, Trace.INDEXER)
WORKLOAD_KEYS = ("requests", "context", "context_min", "layers", "top_k", "steps", "churn", "seed")
KNOB_KEYS = {Trace.WORKINGSET: ("sinks", "recent", "pool", "persistence", "drift", "layer_overlap"),
             Trace.CORRELATED: ("drift",), Trace.INDEXER: ("drift",), Trace.UNIFORM: ()}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A generated workload: schedule sizes, generator knobs, and published reference
    miss rates (buffer / top-k -> LRU miss rate) it is calibrated to, if any."""

    description: str
    workload: dict
    trace: Trace
    knobs: dict
    warmup: int
    reference: dict
    reference_source: str


PRESETS = {
    "glm51": Preset(
        description="GLM-5.1-like decode: 128K contexts, sinks + recent window + a drifting "
                    "working set, adjacent layers overlapping about 80%",
        workload=dict(requests=32, context=128 * 1024, context_min=96 * 1024, layers=2,
                      top_k=2048, steps=100, churn=0.0, seed=0),
        trace=Trace.WORKINGSET,
        knobs=dict(sinks=4, recent=64, pool=2.5, persistence=0.72, drift=0.03, layer_overlap=0.8),
        warmup=20,  # a 4x buffer fills in about 15 steps (see the plot in docs/WHATIF.md)
        reference={1.0: 0.30, 2.0: 0.134, 4.0: 0.067},
        reference_source="HiSparse (SGLang) LRU miss rates for GLM-5.1 at buffer = 1x / 2x / 4x "
                         "top-k",
    ),
}
REFERENCE_BAND = 0.20  # the preset must land within +-20% (relative) of its reference


@dataclasses.dataclass(frozen=True)
class WhatifOptions:
    """What to simulate (the CLI flags, 1:1). ``preset`` fills what is None;
    ``row_format`` takes its string value too (parsed when built)."""

    replay: str | None = None
    preset: str | None = None
    trace: Trace | None = None  # a generator (not REPLAY: --replay FILE)
    requests: int | None = None
    context: int | None = None
    context_min: int | None = None
    layers: int | None = None
    top_k: int | None = None
    steps: int | None = None
    churn: float | None = None
    seed: int | None = None
    sinks: int | None = None
    recent: int | None = None
    pool: float | None = None
    persistence: float | None = None
    drift: float | None = None
    layer_overlap: float | None = None
    buffers: tuple[int, ...] | None = None
    warmup: int | None = None
    row_format: RowFormat = RowFormat.FP8_DS_MLA
    row_bytes: int | None = None
    pcie_gbps: float = PCIE_GBPS
    device: str = "cpu"
    threads: int = 1  # torch CPU threads while it runs (restored after), 1..MAX_THREADS
    progress: bool = True

    def __post_init__(self) -> None:
        parse_choices(self, {"row_format": RowFormat.parse})
        if self.trace is not None:
            try:
                trace = Trace.parse(self.trace)
            except ValueError:
                trace = None
            if trace not in GENERATORS:  # REPLAY is --replay FILE
                raise ValueError(f"trace must be a generator, one of {[g.value for g in GENERATORS]}, got "
                                 f"{self.trace!r} (a recorded trace is --replay FILE)")
            object.__setattr__(self, "trace", trace)


@dataclasses.dataclass(frozen=True)
class _Resolved:
    source: Trace
    preset: Preset | None
    workload: dict
    knobs: dict
    warmup: int
    row_bytes: int


def _resolve(o: WhatifOptions) -> _Resolved:
    """Merge preset and flags; ValueError for a bad or inapplicable option."""
    given = {k: getattr(o, k) for k in WORKLOAD_KEYS + KNOB_KEYS[Trace.WORKINGSET]
             if getattr(o, k) is not None}
    if o.row_bytes is not None:
        row_bytes = check_int("row_bytes", o.row_bytes, 1)
    else:
        row_bytes = o.row_format.row_bytes
    bw = o.pcie_gbps
    if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not 0 < bw < math.inf:
        raise ValueError(f"--pcie-gbps must be a positive, finite number of GB/s (an infinite bandwidth "
                         f"would make every staging time 0), got {bw!r}")
    if o.warmup is not None:
        check_int("warmup", o.warmup, 0)
    if o.replay is not None:
        extra = sorted(set(given) - {"top_k"})
        if o.preset or o.trace:
            raise ValueError("--replay takes its trace from the file; drop --preset / --trace")
        if extra:
            raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in extra)} "
                             f"appl{'ies' if len(extra) == 1 else 'y'} to generated traces, not --replay")
        return _Resolved(Trace.REPLAY, None, {"top_k": o.top_k}, {}, o.warmup or 0, row_bytes)
    if o.preset is not None and o.preset not in PRESETS:
        raise ValueError(f"unknown preset {o.preset!r}; expected one of {sorted(PRESETS)}")
    pre = PRESETS[o.preset or "glm51"]
    source = o.trace or pre.trace
    if source not in GENERATORS:
        raise ValueError(f"--trace {source.value} is not a generator; expected one of "
                         f"{[g.value for g in GENERATORS]} (a recorded trace is --replay FILE)")
    bad = [k for k in KNOB_KEYS[Trace.WORKINGSET] if k in given and k not in KNOB_KEYS[source]]
    if bad:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in bad)} "
                         f"do{'es' if len(bad) == 1 else ''} not apply to --trace {source.value}")
    workload = {**pre.workload, **{k: v for k, v in given.items() if k in WORKLOAD_KEYS}}
    if "context" in given and "context_min" not in given and workload["context_min"] > workload["context"]:
        workload["context_min"] = max(1, workload["context"] // 2)
    base = pre.knobs if source is pre.trace else {}
    knobs = {k: given.get(k, base.get(k)) for k in KNOB_KEYS[source]}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    for k in ("requests", "context", "layers", "top_k", "steps", "seed"):
        check_int(k, workload[k], 0 if k == "seed" else 1, 2**62 if k == "seed" else None)
    check_int("context_min", workload["context_min"], 1, workload["context"] + 1)
    if not 0.0 <= float(workload["churn"]) <= 1.0:
        raise ValueError(f"churn must be in [0, 1], got {workload['churn']!r}")
    is_pre = o.trace is None or o.trace is pre.trace
    # another generator counts every step by default, as stress does
    warmup = o.warmup if o.warmup is not None else (pre.warmup if is_pre else 0)
    if warmup >= workload["steps"]:
        raise ValueError(f"nothing to count: --warmup {warmup} >= --steps {workload['steps']}")
    return _Resolved(source, pre if is_pre else None, workload, knobs, warmup, row_bytes)


def _make_source(r: _Resolved, dev: torch.device):
    w, kn, K = r.workload, r.knobs, r.workload["top_k"]
    if r.source is Trace.WORKINGSET:
        return WorkingSetSource(top_k=K, device=dev, seed=w["seed"], **kn)
    if r.source is Trace.CORRELATED:
        return CorrelatedSource(top_k=K, device=dev, seed=w["seed"], **kn)
    if r.source is Trace.INDEXER:
        return IndexerSource(top_k=K, max_context=w["context"] + w["steps"], device=dev,
                             seed=w["seed"], **kn)
    return UniformSource(top_k=K, device=dev, seed=w["seed"])


def generate(r: _Resolved, dev: torch.device, bar: Progress | None = None) -> list[TraceStep]:
    """The stress tool's schedule and top-k source, recorded: one TraceStep per step."""
    w = r.workload
    so = StressOptions(num_requests=w["requests"], context=w["context"], context_min=w["context_min"],
                       num_layers=w["layers"], top_k=w["top_k"], steps=w["steps"],
                       churn=float(w["churn"]), seed=w["seed"])
    sched = Schedule(so, 0)
    src = _make_source(r, dev)
    steps, live = [], set()
    for s in range(w["steps"]):
        ids, lens = sched.step(s)
        for rid in live - set(ids.tolist()):
            src.drop(rid)
        live = set(ids.tolist())
        ids_t, lens_t = torch.as_tensor(ids, device=dev), torch.as_tensor(lens, device=dev)
        tk = [src.select(layer, ids_t, lens_t, s).cpu().numpy() for layer in range(w["layers"])]
        steps.append(TraceStep(ids, lens, np.stack(tk, axis=1).astype(np.int32)))
        if bar is not None:
            bar.update(1, note="generating")
    return steps


def _instances(steps: list[TraceStep]) -> list[np.ndarray]:
    """Stream id per entry: a request id absent from the previous step starts a new life."""
    out, prev, cur, nxt = [], {}, {}, 0
    for st in steps:
        cur = {}
        for rid in st.req_ids.tolist():
            if rid in prev:
                cur[rid] = prev[rid]
            else:
                cur[rid], nxt = nxt, nxt + 1
        out.append(np.array([cur[r] for r in st.req_ids.tolist()], dtype=np.int64))
        prev = cur
    return out


def _stats(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    return {"mean": float(x.mean()), "p99": float(np.percentile(x, 99)), "max": float(x.max())}


def run_whatif(o: WhatifOptions) -> dict[str, Any]:
    """Simulate LRU and Belady over the buffer sweep; the JSON-able result dict.

    Runs with ``o.threads`` torch CPU threads (default 1: the per-step tensors are small,
    and on a shared 2-core machine a second OpenMP thread mostly waits) and restores the
    caller's setting afterwards.
    """
    check_int("threads", o.threads, 1, MAX_THREADS + 1)
    before = torch.get_num_threads()
    torch.set_num_threads(o.threads)
    try:
        return _run(o)
    finally:
        torch.set_num_threads(before)


def _run(o: WhatifOptions) -> dict[str, Any]:
    t_start = time.perf_counter()
    r = _resolve(o)
    if o.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {o.device!r}")
    dev = torch.device(o.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MissingDependency("--device cuda: no CUDA device is available here; use --device cpu")
    if r.source is Trace.REPLAY:
        meta, steps = load_trace(o.replay)
        if not steps:
            raise ValueError(f"trace file {o.replay!r} has no steps")
        K, L = int(meta["top_k"]), int(meta["num_layers"])
        if r.workload["top_k"] is not None and r.workload["top_k"] != K:
            raise ValueError(f"--top-k {r.workload['top_k']} differs from the trace's top_k {K}")
    else:
        K, L = r.workload["top_k"], r.workload["layers"]
    buffers = list(o.buffers) if o.buffers else sorted({int(round(m * K)) for m in (1, 1.5, 2, 3, 4)})
    for i, b in enumerate(buffers):
        check_int(f"buffers[{i}]", b)
        if b < K:
            raise ValueError(f"every buffer size must be >= top_k={K} (a resolve needs up to "
                             f"top_k free slots), got {b}")
    buffers = sorted(set(buffers))
    if r.source is Trace.REPLAY:
        live = max(st.req_ids.size for st in steps)
        if live == 0:
            raise ValueError(f"trace file {o.replay!r} has no request in any of its {len(steps)} steps")
        max_len = max(int(st.seq_lens.max()) for st in steps if st.seq_lens.size)
        n_steps = len(steps)
    else:
        live, n_steps = r.workload["requests"], r.workload["steps"]
        max_len = r.workload["context"] + n_steps
    host = _memory_needed(r, K=K, L=L, S=buffers[-1], live=live, max_len=max_len, steps=n_steps)
    check_memory(host=host, device={}, on=torch.device("cpu"), what="this whatif run",
                 hint="lower --requests, --context, --steps, --top-k or --buffers"
                 + (" (or the working set's --pool)" if r.source is Trace.WORKINGSET else ""))
    n_gen = r.workload["steps"] if r.source is not Trace.REPLAY else 0
    n_sim = 2 * L * len(buffers) * (r.workload["steps"] if r.source is not Trace.REPLAY else len(steps))
    with Progress(n_gen + n_sim, "whatif", enabled=o.progress) as bar:
        t0 = time.perf_counter()
        if r.source is not Trace.REPLAY:
            steps = generate(r, dev, bar)
        t_gen = time.perf_counter() - t0
        insts = _instances(steps)
        res = _simulate_all(steps, insts, L, K, buffers, r, dev, bar)
    res["timings"] = {"generate_s": t_gen, "simulate_s": time.perf_counter() - t_start - t_gen}
    lens = np.concatenate([st.seq_lens for st in steps])
    res["trace"] = {
        "source": r.source.value, "file": o.replay,
        "preset": (o.preset or "glm51") if r.preset is not None else None,
        "workload": r.workload if r.source is not Trace.REPLAY else None, "knobs": r.knobs,
        "num_layers": L, "top_k": K, "steps": len(steps),
        "max_live_requests": max(st.req_ids.size for st in steps),
        "requests_seen": int(max([int(i.max()) for i in insts if i.size] + [-1]) + 1),
        "context_max": int(lens.max()) if lens.size else 0,
        "context_min": int(lens.min()) if lens.size else 0,
        "warmup": r.warmup}
    res["row_bytes"], res["pcie_GBps"] = r.row_bytes, float(o.pcie_gbps)
    bw = float(o.pcie_gbps) * 1e9
    for e in res["results"]:
        for pol in ("lru", "belady"):
            rows = e.pop(f"_{pol}_rows")
            e[f"{pol}_staging_rows"] = _stats(rows)
            e[f"{pol}_staging_bytes"] = _stats(rows * r.row_bytes)
            e[f"{pol}_staging_us"] = _stats(rows * r.row_bytes / bw * 1e6)
    if r.preset is not None and r.preset.reference:
        for e in res["results"]:
            ref = r.preset.reference.get(e["buffer"] / K)
            if ref is not None:
                e["reference_miss_rate"] = ref
                e["reference_rel_error"] = e["lru_miss_rate"] / ref - 1.0
        res["reference"] = {"source": r.preset.reference_source, "band": REFERENCE_BAND,
                            "miss_rate_by_buffer_over_topk": {str(k): v for k, v in r.preset.reference.items()}}
    res["elapsed_s"] = time.perf_counter() - t_start
    return res


def _memory_needed(r: _Resolved, *, K: int, L: int, S: int, live: int, max_len: int, steps: int) -> dict[str, int]:
    """Bytes of host memory a run holds at its peak, by part (an estimate from the
    shapes: every step's top-k, the exact simulation's per-lane tables at the largest
    buffer and its next-use lists, and the working-set generator's state)."""
    out = {"traces": steps * live * L * K * 4,
           "next uses": 2 * steps * live * K * 8,
           "simulation": live * ((S + 1) * 16 + (max_len + 2) * 4)}
    if r.source is Trace.WORKINGSET:
        kn = {k: r.knobs[k] for k in ("sinks", "recent", "pool") if k in r.knobs}
        out["generator"] = L * live * workingset_state_bytes(K, max_len, **kn)
    return out


def _simulate_all(steps, insts, L, K, buffers, r: _Resolved, dev, bar) -> dict[str, Any]:
    """Every layer x buffer size x policy; counts, staging rows per layer-step, overlaps."""
    inst = [torch.from_numpy(i).to(dev) for i in insts]
    lens = [torch.from_numpy(st.seq_lens.astype(np.int64)).to(dev) for st in steps]
    N, B = len(steps), len(buffers)
    cnt = {p: np.zeros((B, 2)) for p in Policy}  # hits, misses (counted rows)
    rows = {p: np.zeros((B, L, N)) for p in Policy}  # counted misses per layer-step
    pf_cov = np.zeros(B)  # LRU misses of layers >= 1 the previous layer selected
    pf_look = 0  # lookups of layers >= 1 (counted)
    ov = {"adj": [0, 0], "step": [0, 0]}  # (shared, total)
    prev_rows = None
    for layer in range(L):
        tr = LayerTrace.build(inst, lens, [torch.from_numpy(st.topk[:, layer]).to(dev) for st in steps])
        plan = make_plan(tr, max(buffers))
        counted = [a >= r.warmup for a in plan.age]
        valid = [u >= 0 for u in tr.topk]
        in_prev = None
        if prev_rows is not None:
            in_prev = [row_membership(u, p) for u, p in zip(tr.topk, prev_rows)]
            for s in range(N):
                c = counted[s][:, None]
                ov["adj"][0] += int((in_prev[s] & c).sum())
                ov["adj"][1] += int((valid[s] & c).sum())
            pf_look += sum(int((valid[s] & counted[s][:, None]).sum()) for s in range(N))
        last = torch.full((max(plan.num_lanes, 1), K), -1, dtype=torch.int64, device=dev)
        for s in range(N):  # overlap with the same request's previous step
            ln, u = plan.lanes[s], tr.topk[s]
            c = (counted[s] & (plan.age[s] > 0))[:, None]
            ov["step"][0] += int((row_membership(u, last[ln]) & c).sum())
            ov["step"][1] += int((valid[s] & c).sum())
            last[ln] = u
        nu = next_uses(tr, plan)
        for bi, S in enumerate(buffers):
            for pol in (Policy.LRU, Policy.BELADY):
                def on_step(s, out, bi=bi, pol=pol):
                    c = counted[s]
                    h, m = int(out.hits[c].sum()), int(out.misses[c].sum())
                    cnt[pol][bi] += (h, m)
                    rows[pol][bi, layer, s] = m
                    if pol is Policy.LRU and in_prev is not None:
                        pf_cov[bi] += int((out.miss & in_prev[s] & c[:, None]).sum())
                    bar.update(1, note=f"layer {layer} S={S} {pol.value}")
                simulate(tr, S=S, policy=pol, plan=plan, nu=nu if pol is Policy.BELADY else None,
                         on_step=on_step)
        prev_rows = tr.topk
    if not cnt[Policy.LRU].any():
        raise ValueError(f"nothing to count: no lookup falls after the first {r.warmup} steps of "
                         f"a request (--warmup) in this {N}-step trace")
    any_counted = np.zeros((L, N), dtype=bool)
    for s in range(N):
        any_counted[:, s] = bool(counted[s].any())  # same schedule in every layer
    results = []
    for bi, S in enumerate(buffers):
        e = {"buffer": S, "buffer_over_topk": S / K}
        for pol in Policy:
            h, m = cnt[pol][bi]
            e[f"{pol.value}_hits"], e[f"{pol.value}_misses"] = int(h), int(m)
            e[f"{pol.value}_miss_rate"] = 1.0 - hit_rate(h, m)
            e[f"_{pol.value}_rows"] = rows[pol][bi][any_counted]
        per_step = rows[Policy.LRU][bi].mean(axis=0)
        e["lru_staging_rows_per_step"] = [float(v) if any_counted[0, s] else None
                                          for s, v in enumerate(per_step)]
        e["lookups"] = int(cnt[Policy.LRU][bi].sum())
        e["prefetch_hit_gain"] = pf_cov[bi] / pf_look if pf_look else None
        results.append(e)
    return {"results": results,
            "overlap": {"adjacent_layer": ov["adj"][0] / ov["adj"][1] if ov["adj"][1] else None,
                        "consecutive_step": ov["step"][0] / ov["step"][1] if ov["step"][1] else None}}


# ------------------------------------------------------------------ CLI
def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``hisparse whatif`` on an argparse subparsers object."""
    p = sub.add_parser(
        "whatif", help="miss rate against hot-buffer size (LRU and Belady) from a trace",
        description=(
            "Simulate the cache's exact LRU and the offline optimum (Belady) for a sweep of "
            "hot-buffer sizes on a recorded trace (--replay FILE) or a generated one (--trace, or "
            "--preset; default: the glm51 preset, calibrated to the HiSparse GLM-5.1 miss rates); "
            "project staging bytes and time per layer-step. Generated traces use stress's "
            "schedule (--requests/--context/--churn/...) and sources."))
    a = p.add_argument
    a("--replay", type=path_arg, metavar="FILE", help="a recorded .npz trace (stress/mini-engine --record)")
    a("--preset", choices=sorted(PRESETS), help="generated workload [glm51 unless --replay]")
    a("--trace", choices=[g.value for g in GENERATORS], help="generator (overrides the preset's)")
    for k, typ, h in (("requests", int, "live requests"),
                      ("context", token_arg, "max context of a joining request, e.g. 128K"),
                      ("context-min", token_arg, "min context of a joining request"), ("layers", int, "layers"),
                      ("top-k", int, "top-k K"), ("steps", int, "decode steps"),
                      ("churn", float, "per step and request: probability it leaves"), ("seed", int, "seed"),
                      ("sinks", int, "workingset: attention-sink tokens always selected"),
                      ("recent", int, "workingset: newest tokens always selected"),
                      ("pool", float, "workingset: candidates per free place"),
                      ("persistence", float, "workingset: step-to-step score correlation"),
                      ("drift", float, "workingset/correlated/indexer: per step replacement rate"),
                      ("layer-overlap", float, "workingset: share of candidates mirrored from the layer before")):
        d = {**PRESETS["glm51"].workload, **PRESETS["glm51"].knobs}.get(k.replace("-", "_"))
        a(f"--{k}", type=typ, default=None, help=h + ("" if d is None else f" [glm51: {d}]"))
    a("--buffers", type=int, nargs="+", help="hot LRU slots S per (layer, request) [1,1.5,2,3,4 x top-k]")
    a("--warmup", type=int, help="first decode steps of each request simulated but not counted "
                                 "[the preset's with its generator, else 0]")
    a("--format", dest="row_format", choices=[f.value for f in RowFormat], default=None,
      help="row format for the staging projection [fp8_ds_mla]")
    a("--row-bytes", type=int, help="row size in bytes (overrides --format)")
    a("--pcie-gbps", type=float, default=PCIE_GBPS,
      help=f"host->device GB/s for the time projection [{PCIE_GBPS:g}: the H200's bulk copy ceiling]")
    a("--device", default="cpu", choices=["cpu", "cuda"], help="device the simulation runs on [cpu]")
    a("--threads", type=int, default=1,
      help=f"torch CPU threads, 1..{MAX_THREADS} [1: the per-step tensors are small, and more threads only "
           "add waiting on a shared machine]")
    a("--plot", type=path_arg, metavar="DIR", help="write whatif.png there (needs matplotlib)")
    a("--json", action="store_true", help="print the result as JSON on stdout")
    a("--quiet", action="store_true", help="no progress output on stderr")
    p.set_defaults(func=run_args)
    return p


def run_args(args) -> int:
    """Run ``hisparse whatif`` from parsed arguments; returns the exit status. Errors
    propagate to the caller (``hisparse``'s one-line report, exit 2 / 3 / 4)."""
    check_whatif(args)
    if args.plot:
        require_matplotlib()  # before any work
        check_output_dir(args.plot, flag="--plot", files=("whatif.png",))
    o = WhatifOptions(
        replay=args.replay, preset=args.preset, trace=args.trace, requests=args.requests,
        context=args.context, context_min=args.context_min, layers=args.layers,
        top_k=args.top_k, steps=args.steps, churn=args.churn, seed=args.seed,
        sinks=args.sinks, recent=args.recent, pool=args.pool, persistence=args.persistence,
        drift=args.drift, layer_overlap=args.layer_overlap,
        buffers=tuple(args.buffers) if args.buffers else None, warmup=args.warmup,
        row_format=args.row_format or "fp8_ds_mla", row_bytes=args.row_bytes, pcie_gbps=args.pcie_gbps,
        device=args.device, threads=args.threads, progress=not args.quiet)
    res = run_whatif(o)
    if args.plot:
        with writing("--plot", args.plot):
            res["plots"] = plot_whatif(args.plot, res)
    if args.json:
        print(json.dumps(res, indent=2, sort_keys=True))
    else:
        text = format_whatif(res)
        if args.plot:
            text += "\nplots: " + ", ".join(res["plots"])
        print(text)
    return EXIT_OK
