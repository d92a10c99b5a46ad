"""``hisparse autotune``: the largest decode batch that fits a GPU memory budget, and
the batch with the best tokens/s (optionally under a per-step latency limit).

1. Budget arithmetic (:func:`gpu_bytes`, exact for the cache's own tensors):

   hot rows            L * R * (S + 1) * row_bytes
   slot/LRU state      L * R * (S + 1) * 12 (slot_pos int32, slot_stamp int64) + L * R * 8
                       (step) + L * R * 4 (seq_lens) + R * NB * 4 (block_table) + L * H * 4
                       (row_slot) + max_request_id * 4 (id_to_slot) + stats
   resolve buffers     (L + 1) * (T * K * 12 + T * 4) (physical, stage src/dst, counts; per
                       layer and for prefetches) + T * K * 20 (undo log),  T = R * q
                       (``HiSparseConfig.device_bytes`` is the one formula)
   attention           T * heads * (576 * 2 + 512 * 2 + 4)   (q, out, lse)
   everything x (1 + reserve_frac) for allocator slack and backend workspaces.

   NB / H are the host blocks / rows of a pool sized for R requests of ``context``
   tokens (plus the timed steps). The largest R with total <= budget, whose host
   pool also fits the host budget (default: half the machine's RAM), is found by
   search (the total grows with R, quadratically through the block table).
2. Timing: for candidate batches (powers of two up to the maximum, and the maximum),
   serve R requests of ``context`` tokens with the mini engine's hisparse store
   (``hisparse_tools.capacity.measure``, the measurement ``benchmarks/bench_capacity``
   makes at each tier's largest batch): synthetic context rows, a short prefilled
   tail, then ``warmup + steps`` decode steps of all R requests, under CUDA graphs on a
   GPU (two more steps: the bucket's padded warm-up and its capture). A step is the
   whole decode forward over all layers: the new rows' writes (host mirror included),
   the indexer, resolve + miss staging, sparse-MLA attention and the model's
   projections. tokens/s = R * q / median step time of the last ``steps`` steps. The
   pick is the best tokens/s whose median step time is within ``latency_ms`` (if
   given). The run needs GPU memory beyond the cache (the mini model, its indexer keys,
   the prefill workspace); the engine's memory check refuses a run that can't fit.
3. The device pool (the elastic tier, ``HiSparseConfig.device_pool_rows``): at the
   chosen batch, the largest pool (hot buffers included, whole pages of 64 rows past
   them) whose cache still fits the budget is always reported (``pool.fit_rows``):
   the GPU memory the budget leaves after the hot buffers, slot state and resolve
   buffers. ``pool_rows="auto"`` puts that pool in the config. ``pool_rows=N`` fixes
   the pool instead: the batch search then finds the largest R whose cache with it fits
   the budget and whose hot buffers leave it at least one page. The timed steps run
   without a pool either way (``pool.timed`` is False; resident requests would skip
   their misses), which the result and the table say.
4. The JSON result carries ``key`` (device name + torch/triton/hisparse versions):
   :func:`load_tuned_config` refuses a result tuned elsewhere.

Result fields (``run_autotune`` / ``--json`` / ``--out``): format ("hisparse-autotune"),
version (1), key {device_name, torch, triton, hisparse, cuda}, timings_are,
max_num_reqs (the pick), max_fit_reqs (largest batch that fits), device_buffer_size,
backend, latency_limit_ms, budget {gpu_memory_bytes, host_memory_bytes, reserve_frac,
max_fit_bound (gpu_memory | host_memory | max_reqs | max_request_id | int32_index_limits |
pool_rows),
host_pool_bytes_at_max_fit, at_max_fit / at_chosen: :func:`gpu_bytes` dicts}, workload {context, num_heads, steps, warmup},
measurements [{num_reqs, step_ms_min, step_ms_p50, step_ms_p99, tokens_per_s, steps_timed,
hit_rate, decode_mode, backend, within_latency}], pool {asked ("auto", N or None), rows (the config's
device_pool_rows or None), hot_rows, pages, device_bytes (the config's device rows, all
layers), fit_rows (the largest pool that fits the budget at the pick, None when not even
a page does), fit_pages, fit_device_bytes, timed (False)}, config (HiSparseConfig dict at
the pick; what load_tuned_config returns).

On a machine without a GPU everything runs on CPU at the given (tiny) size; the
result then says ``"timings_are": "CPU ..."`` and the numbers only exercise the path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, BinaryIO

import torch

from hisparse import __version__
from hisparse.config import DEVICE_PAGE_ROWS, HiSparseConfig, RowFormat, check_int
from hisparse.errors import CapacityError
from .capacity import Budget, RunShape, engine_config, largest_fit, measure
from .fields import parse_choices
from .mini_engine.graphs import DecodeMode
from .units import fmt_bytes
from .preflight import check_memory, parse_device
from .progress import Progress
from .report import table
from .sizing import HOT_ALIGN, gpu_bytes, hot_buffer_rows  # gpu_bytes re-exported: the budget arithmetic

RESULT_FORMAT = "hisparse-autotune"
RESULT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class AutotuneOptions:
    """Knobs of an autotune run (the CLI flags, 1:1)."""

    num_layers: int = 2
    row_format: RowFormat = RowFormat.FP8_DS_MLA  # or its value
    top_k: int = 64
    buffer_size: int | None = None  # S, default 2 * top_k
    context: int = 512  # tokens per request during timing (and in the pool sizing)
    max_query_len: int = 1
    num_heads: int = 16
    gpu_memory: int | None = None  # budget in bytes; default 90% of free GPU memory (CUDA)
    host_memory: int | None = None  # host pool budget in bytes; default half the machine's RAM
    max_reqs: int | None = 1024  # upper bound of the search (None: max_request_id)
    reserve_frac: float = 0.05
    latency_ms: float | None = None
    steps: int = 5
    warmup: int = 2
    max_candidates: int = 4
    block_size: int = 64
    max_request_id: int = 1 << 16
    device: str | None = None
    backend: str | None = None  # preferred attention backend name
    flashmla_lib: str | None = None  # FlashMLA library path (see hisparse.attention.flashmla)
    pool_rows: int | str | None = None  # device pool: "auto" (what the budget leaves at the pick), N rows, None
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for n in ("num_layers", "top_k", "context", "max_query_len", "num_heads", "steps",
                  "max_candidates", "block_size", "max_request_id"):
            check_int(n, getattr(self, n), lo=1)
        check_int("warmup", self.warmup, lo=0)
        check_int("seed", self.seed)
        if not 0.0 <= float(self.reserve_frac) < 1.0:
            raise ValueError(f"reserve_frac must be in [0, 1), got {self.reserve_frac}")
        if self.latency_ms is not None and not float(self.latency_ms) > 0:
            raise ValueError(f"latency_ms must be > 0, got {self.latency_ms}")
        for n in ("gpu_memory", "host_memory", "max_reqs", "buffer_size"):
            if getattr(self, n) is not None:
                check_int(n, getattr(self, n), lo=1)
        if self.pool_rows is not None and self.pool_rows != "auto":
            check_int("pool_rows", self.pool_rows, lo=1)
            S = self.buffer_size if self.buffer_size is not None else 2 * self.top_k
            least = hot_buffer_rows(1, S + 1) + DEVICE_PAGE_ROWS
            if self.pool_rows < least:
                raise ValueError(f"pool_rows={self.pool_rows} leaves no page past one request's hot buffer "
                                 f"(S + 1 = {S + 1} rows, rounded up to {HOT_ALIGN}); give at least {least}, "
                                 "or auto")
        parse_choices(self, {"row_format": RowFormat.parse})

    def validate(self) -> None:
        """Kept for callers of the mutable version; the checks run when the options are built."""
        self.__post_init__()


def device_key(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a tuned result depends on: device name and library versions."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    import triton  # its version only: not loaded until a result is keyed

    tv = triton.__version__
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device_name": name, "torch": torch.__version__, "triton": tv,
            "hisparse": __version__, "cuda": torch.version.cuda}


def _make_cfg(o: AutotuneOptions, R: int, device: str, pool_rows: int | None = None) -> HiSparseConfig:
    B = o.block_size
    per_req = math.ceil(o.context / B) * B
    return HiSparseConfig(num_layers=o.num_layers, host_pool_tokens=R * per_req,
                          row_bytes=o.row_format.row_bytes, top_k=o.top_k,
                          device_buffer_size=o.buffer_size, max_num_reqs=R,
                          max_query_len=o.max_query_len, host_block_size=B,
                          max_request_id=max(o.max_request_id, R + 1), device=device,
                          device_pool_rows=pool_rows)


def _fixed_pool(o: AutotuneOptions) -> int | None:
    """The pool rows ``o.pool_rows`` fixes (None: no pool, or "auto": sized at the pick)."""
    return o.pool_rows if isinstance(o.pool_rows, int) else None


def pool_fit(o: AutotuneOptions, R: int, budget: int, device: str) -> int | None:
    """The largest device pool (rows per layer: R's hot buffers rounded up to 64, plus whole
    pages of 64) whose cache at R requests fits ``budget`` (:func:`gpu_bytes` with the
    reserve); None when not even one page does."""
    hot = _make_cfg(o, R, device).hot_rows_per_layer
    cap = max(1, (2**31 - 1 - hot) // DEVICE_PAGE_ROWS)

    def fits(pages: int) -> bool:
        try:
            cfg = _make_cfg(o, R, device, hot + pages * DEVICE_PAGE_ROWS)
        except ValueError:  # int32 index limits exceeded
            return False
        return gpu_bytes(cfg, num_heads=o.num_heads, reserve_frac=o.reserve_frac)["total"] <= budget

    pages = largest_fit(fits, cap)
    return hot + pages * DEVICE_PAGE_ROWS if pages else None


def host_ram_bytes() -> int:
    """Physical RAM of this machine (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def max_fit(o: AutotuneOptions, budget: int, device: str, host_budget: int | None = None) -> int:
    """Largest R whose :func:`gpu_bytes` total fits ``budget`` and whose host pool fits
    ``host_budget`` (None: unbounded), at most ``o.max_reqs`` / ``o.max_request_id``; with a
    fixed ``o.pool_rows`` N, the cache has that pool and R's hot buffers must leave it a page;
    0 if none (``hisparse_tools.capacity.largest_fit``, the capacity benchmark's search)."""
    cap = min(o.max_reqs or o.max_request_id, o.max_request_id)
    pool = _fixed_pool(o)

    def fits(R: int) -> bool:
        try:
            cfg = _make_cfg(o, R, device, pool)
        except ValueError:  # int32 index limits exceeded, or a fixed pool below the hot buffers
            return False
        if pool is not None and cfg.pool_pages == 0:  # the hot buffers leave the fixed pool no page
            return False
        if host_budget is not None and cfg.host_pool_bytes > host_budget:
            return False
        return gpu_bytes(cfg, num_heads=o.num_heads, reserve_frac=o.reserve_frac)["total"] <= budget

    return largest_fit(fits, cap)


def candidates(rmax: int, n: int) -> list[int]:
    """Powers of two up to ``rmax`` plus ``rmax``, thinned to at most ``n`` (ends kept)."""
    c = sorted({1 << i for i in range(rmax.bit_length()) if (1 << i) <= rmax} | {rmax})
    if len(c) <= n:
        return c
    if n == 1:
        return [rmax]
    idx = sorted({round(i * (len(c) - 1) / (n - 1)) for i in range(n)})
    return [c[i] for i in idx]


def time_batch(o: AutotuneOptions, R: int, device: torch.device) -> dict[str, Any]:
    """Serve R requests of ``o.context`` tokens with the mini engine's hisparse store and
    time its decode steps (``hisparse_tools.capacity.measure``, the capacity
    benchmark's measurement; see the module doc)."""
    cuda = device.type == "cuda"
    mode = DecodeMode.GRAPHS if cuda else DecodeMode.EAGER
    budget = Budget(num_layers=o.num_layers, row_format=o.row_format, top_k=o.top_k, hot_rows=o.buffer_size,
                    block_size=o.block_size)
    # GRAPHS: the first decode step of the bucket runs padded (compiling), the second captures
    extra = 2 if cuda else 0
    shape = RunShape(run_layers=o.num_layers, num_heads=o.num_heads, hidden=256 if cuda else 64, indexer_dim=16,
                     decode_steps=o.warmup + o.steps + extra, tail=max(1, min(16, o.context // 4)),
                     query_len=o.max_query_len, device=str(device), decode_mode=mode, backend=o.backend,
                     flashmla_lib=o.flashmla_lib, seed=o.seed)
    cfg = engine_config(budget, shape, context=o.context, batch=R)
    s, _ = measure(cfg, "hisparse", decode_mode=mode, skip=o.warmup)
    st = s["decode"]["step_ms"]
    return {"num_reqs": R, "step_ms_min": st["min_ms"], "step_ms_p50": st["median_ms"],
            "step_ms_p99": st["p99_ms"], "tokens_per_s": s["decode"]["tokens_per_s"] or float("inf"),
            "steps_timed": st["n"], "hit_rate": s["cache"]["hit_rate"], "decode_mode": mode.value,
            "backend": s["backend"]["decode"]}


def run_autotune(o: AutotuneOptions) -> dict[str, Any]:
    """Budget search + timing; returns the JSON-able result (see module doc)."""
    device = parse_device(o.device)
    cuda = device.type == "cuda"
    if o.gpu_memory is not None:
        budget = o.gpu_memory
    elif cuda:
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.9)
    else:
        raise ValueError("on a machine without a GPU give the budget explicitly, e.g. "
                         "--gpu-memory 64MiB (there is no device memory to measure)")
    host_budget = o.host_memory if o.host_memory is not None else host_ram_bytes() // 2
    rmax = max_fit(o, budget, str(device), host_budget)
    fixed = _fixed_pool(o)
    if rmax == 0:
        cfg1 = _make_cfg(o, 1, str(device), fixed)
        one = gpu_bytes(cfg1, num_heads=o.num_heads, reserve_frac=o.reserve_frac)
        raise CapacityError(f"not even one request fits: GPU budget {budget} bytes, one request "
                            f"needs {one['total']} ({one}); host budget {host_budget} bytes, one "
                            f"request's pool needs {cfg1.host_pool_bytes}; lower top_k/buffer/"
                            "context" + (", --pool-rows" if fixed else "") + " or raise --gpu-memory / "
                            "--host-memory")
    cfg_max = _make_cfg(o, rmax, str(device), fixed)
    _check_memory(o, cfg_max, device)
    if o.max_reqs is not None and rmax == o.max_reqs:
        bound = "max_reqs"
    elif rmax == o.max_request_id:
        bound = "max_request_id"
    elif fixed is not None and hot_buffer_rows(rmax + 1, cfg_max.slots_per_req) + DEVICE_PAGE_ROWS > fixed:
        bound = "pool_rows"  # one more request's hot buffer would leave the fixed pool no page
    else:
        try:
            more = _make_cfg(o, rmax + 1, str(device), fixed)
            gpu_fits = gpu_bytes(more, num_heads=o.num_heads,
                                 reserve_frac=o.reserve_frac)["total"] <= budget
            bound = "host_memory" if gpu_fits and more.host_pool_bytes > host_budget else "gpu_memory"
        except ValueError:
            bound = "int32_index_limits"
    cands = candidates(rmax, o.max_candidates)
    meas = []
    with Progress(len(cands), "autotune", enabled=o.progress) as bar:
        for i, R in enumerate(cands):
            bar.status(f"timing R={R} ({i + 1} of {len(cands)}) ...")
            m = time_batch(o, R, device)
            m["within_latency"] = o.latency_ms is None or m["step_ms_p50"] <= o.latency_ms
            meas.append(m)
            bar.update(1, note=f"R={R} p50 {m['step_ms_p50']:.2f} ms")
    ok = [m for m in meas if m["within_latency"]]
    if not ok:
        raise CapacityError(f"no batch meets --latency-ms {o.latency_ms}: the smallest "
                            f"(R={meas[0]['num_reqs']}) took {meas[0]['step_ms_p50']:.3f} ms per step")
    best = max(ok, key=lambda m: m["tokens_per_s"])
    fit_rows = pool_fit(o, best["num_reqs"], budget, str(device))
    rows = fit_rows if o.pool_rows == "auto" else fixed
    cfg = _make_cfg(o, best["num_reqs"], "cuda" if cuda else "cpu", rows)
    fit_cfg = _make_cfg(o, best["num_reqs"], str(device), fit_rows) if fit_rows else None
    return {
        "format": RESULT_FORMAT, "version": RESULT_VERSION,
        "key": device_key(device),
        "timings_are": ("GPU (CUDA-synchronised)" if cuda else
                        "CPU timings (no GPU here): they exercise the path only and say "
                        "nothing about GPU performance"),
        "max_num_reqs": best["num_reqs"],
        "max_fit_reqs": rmax,
        "device_buffer_size": cfg.device_buffer_size,
        "backend": meas[0]["backend"],
        "latency_limit_ms": o.latency_ms,
        "budget": {"gpu_memory_bytes": budget, "host_memory_bytes": host_budget,
                   "reserve_frac": o.reserve_frac, "max_fit_bound": bound,
                   "host_pool_bytes_at_max_fit": cfg_max.host_pool_bytes,
                   "at_max_fit": gpu_bytes(cfg_max, num_heads=o.num_heads,
                                           reserve_frac=o.reserve_frac),
                   "at_chosen": gpu_bytes(cfg, num_heads=o.num_heads, reserve_frac=o.reserve_frac)},
        "workload": {"context": o.context, "num_heads": o.num_heads, "steps": o.steps,
                     "warmup": o.warmup},
        "measurements": meas,
        "pool": {"asked": o.pool_rows, "rows": rows, "hot_rows": cfg.hot_rows_per_layer, "pages": cfg.pool_pages,
                 "device_bytes": cfg.hot_buffer_bytes, "fit_rows": fit_rows,
                 "fit_pages": fit_cfg.pool_pages if fit_cfg else 0,
                 "fit_device_bytes": fit_cfg.hot_buffer_bytes if fit_cfg else None, "timed": False},
        "config": cfg.to_dict(),
    }


def format_autotune(r: dict[str, Any]) -> str:
    """Readable summary of a :func:`run_autotune` result."""
    k = r["key"]
    rows = [[m["num_reqs"], round(m["step_ms_min"], 3), round(m["step_ms_p50"], 3),
             round(m["step_ms_p99"], 3), round(m["tokens_per_s"], 1),
             "yes" if m["within_latency"] else "no",
             "<- chosen" if m["num_reqs"] == r["max_num_reqs"] else ""] for m in r["measurements"]]
    lines = [f"hisparse autotune on {k['device_name']} (torch {k['torch']}, triton {k['triton']}, "
             f"hisparse {k['hisparse']})",
             f"timings: {r['timings_are']}",
             f"budget: GPU {fmt_bytes(r['budget']['gpu_memory_bytes'])}, host "
             f"{fmt_bytes(r['budget']['host_memory_bytes'])}: at most {r['max_fit_reqs']} requests "
             f"fit (GPU {fmt_bytes(r['budget']['at_max_fit']['total'])}, host pool "
             f"{fmt_bytes(r['budget']['host_pool_bytes_at_max_fit'])}; bound: "
             f"{r['budget']['max_fit_bound']})",
             "step = one mini-engine decode step over all layers: row writes, indexer, resolve + "
             "staging, attention (CUDA graphs on a GPU)",
             "", table(["requests", "min ms", "p50 ms", "p99 ms", "tokens/s", "within limit", ""], rows), "",
             f"chosen: max_num_reqs={r['max_num_reqs']} device_buffer_size={r['device_buffer_size']} "
             f"backend={r['backend']}" + (f" device_pool_rows={r['pool']['rows']}" if r["pool"]["rows"] else "")]
    p = r["pool"]
    pages = (lambda n: f"{n} page{'' if n == 1 else 's'}")
    room = (f"room for a device pool of {p['fit_rows']} rows per layer ({p['hot_rows']} hot-buffer rows + "
            f"{pages(p['fit_pages'])} of {DEVICE_PAGE_ROWS}, {fmt_bytes(p['fit_device_bytes'])})"
            if p["fit_rows"] else "no room for a device pool page")
    if p["asked"] is None:
        lines.append(f"device pool: the budget leaves {room} at {r['max_num_reqs']} requests; `--pool-rows auto` "
                     "puts it in the config")
    else:
        what = (f"device_pool_rows={p['rows']} ({pages(p['pages'])}, {fmt_bytes(p['device_bytes'])} of device rows)"
                if p["rows"] else "no pool (not even one page fits)")
        lines.append(f"device pool (--pool-rows {p['asked']}): {what}; the budget leaves {room} at "
                     f"{r['max_num_reqs']} requests; the timed steps ran without the pool")
    return "\n".join(lines)


def _check_memory(o: AutotuneOptions, cfg: HiSparseConfig, device: torch.device) -> None:
    """The largest candidate's cache (and its rows template) must fit this machine."""
    dev = {"cache and attention buffers": gpu_bytes(cfg, num_heads=o.num_heads)["total"]}
    host = {"host pool": cfg.host_pool_bytes}
    if device.type != "cuda":
        host.update(dev)
        dev = {}
    check_memory(host=host, device=dev, on=device, what=f"autotune at {cfg.max_num_reqs} requests",
                 hint="lower --gpu-memory / --host-memory / --max-reqs or --context")


def save_result(r: dict[str, Any], path: str | os.PathLike | BinaryIO) -> None:
    """Write an autotune result as JSON (``load_tuned_config`` reads it) to ``path`` or
    into an open binary file."""
    data = json.dumps(r, indent=2, sort_keys=True).encode()
    if hasattr(path, "write"):
        path.write(data)
        return
    with open(path, "wb") as f:
        f.write(data)


def load_tuned_config(path: str | os.PathLike, *, expect_gpu: str | None = None) -> HiSparseConfig:
    """The :class:`HiSparseConfig` of an autotune result, if it was tuned for this setup.

    ``expect_gpu``: the device name the result must carry (default: this machine's
    current device name, or "cpu" without CUDA). Raises ``ValueError`` naming every
    differing field when the result is stale (other GPU or library versions).
    """
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read autotune result {str(path)!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"autotune result {str(path)!r} is not JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != RESULT_FORMAT or d.get("version") != RESULT_VERSION:
        raise ValueError(f"{str(path)!r} is not a {RESULT_FORMAT} v{RESULT_VERSION} result")
    want = device_key()
    if expect_gpu is not None:
        want["device_name"] = expect_gpu
    have = d.get("key", {})
    diff = [f"{k}: tuned with {have.get(k)!r}, here {want[k]!r}"
            for k in ("device_name", "torch", "triton", "hisparse") if have.get(k) != want[k]]
    if diff:
        raise ValueError(f"stale autotune result {str(path)!r} (" + "; ".join(diff)
                         + "); re-run `hisparse autotune` on this machine")
    return HiSparseConfig.from_dict(d["config"])
