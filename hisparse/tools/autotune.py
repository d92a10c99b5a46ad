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
   build the cache, prefill R requests, warm up (compiles Triton kernels and plans
   the attention backend at that batch), then time decode steps: per layer, resolve
   a uniform top-k over the context (misses staged from host) and run sparse-MLA
   decode with the chosen backend. The write of the new rows is not timed: engines
   batch it (``hisparse.engine``), and per-request ``append_rows`` calls would time
   Python, not the GPU.
   tokens/s = R * q / median step time. The pick is the best tokens/s
   whose median step time is within ``latency_ms`` (if given).
3. The JSON result carries ``key`` (device name + torch/triton/hisparse versions):
   :func:`load_tuned_config` refuses a result tuned elsewhere.

Result fields (``run_autotune`` / ``--json`` / ``--out``): format ("hisparse-autotune"),
version (1), key {device_name, torch, triton, hisparse, cuda}, timings_are,
max_num_reqs (the pick), max_fit_reqs (largest batch that fits), device_buffer_size,
backend, latency_limit_ms, budget {gpu_memory_bytes, host_memory_bytes, reserve_frac,
max_fit_bound (gpu_memory | host_memory | max_reqs | max_request_id | int32_index_limits),
host_pool_bytes_at_max_fit, at_max_fit / at_chosen: :func:`gpu_bytes` dicts}, workload {context, num_heads, steps, warmup},
measurements [{num_reqs, step_ms_min, step_ms_p50, step_ms_p99, tokens_per_s,
within_latency}], config (HiSparseConfig dict at the pick; what load_tuned_config returns).

On a machine without a GPU everything runs on CPU at the given (tiny) size; the
result then says ``"timings_are": "CPU ..."`` and the numbers only exercise the path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import torch
import triton

from .. import HiSparseCache, __version__
from .._checks import check_int
from ..attention.base import Phase
from ..attention.chooser import choose_backend
from ..config import HiSparseConfig, RowFormat
from ..errors import CapacityError
from ..formats import D_LATENT, D_ROW, bf16_rows_to_bytes, quantize_fp8_ds_mla
from .plan import fmt_bytes
from .preflight import check_memory, parse_device
from .progress import Progress
from .report import table
from .sources import UniformSource

RESULT_FORMAT = "hisparse-autotune"
RESULT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class AutotuneOptions:
    """Knobs of an autotune run (the CLI flags, 1:1)."""

    num_layers: int = 2
    row_format: str = "fp8_ds_mla"
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
        RowFormat.parse(self.row_format)

    def validate(self) -> None:
        """Kept for callers of the mutable version; the checks run when the options are built."""
        self.__post_init__()


def device_key(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a tuned result depends on: device name and library versions."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    tv = triton.__version__
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"device_name": name, "torch": torch.__version__, "triton": tv,
            "hisparse": __version__, "cuda": torch.version.cuda}


def _make_cfg(o: AutotuneOptions, R: int, device: str) -> HiSparseConfig:
    B = o.block_size
    per_req = math.ceil(o.context / B) * B
    return HiSparseConfig(num_layers=o.num_layers, host_pool_tokens=R * per_req,
                          row_bytes=RowFormat.parse(o.row_format).row_bytes, top_k=o.top_k,
                          device_buffer_size=o.buffer_size, max_num_reqs=R,
                          max_query_len=o.max_query_len, host_block_size=B,
                          max_request_id=max(o.max_request_id, R + 1), device=device)


def gpu_bytes(cfg: HiSparseConfig, *, num_heads: int, reserve_frac: float = 0.0) -> dict[str, int]:
    """GPU bytes of a cache with this config plus decode attention I/O (see module doc)."""
    T = cfg.max_tokens
    cache = cfg.device_bytes()
    parts = {
        "hot_rows": cache["hot_rows"],
        "slot_state": cache["state"],
        "resolve_buffers": cache["resolve_buffers"],
        "attention_io": T * num_heads * (D_ROW * 2 + D_LATENT * 2 + 4),
    }
    raw = sum(parts.values())
    parts["reserve"] = int(raw * reserve_frac)
    parts["total"] = raw + parts["reserve"]
    return parts


def host_ram_bytes() -> int:
    """Physical RAM of this machine (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def max_fit(o: AutotuneOptions, budget: int, device: str, host_budget: int | None = None) -> int:
    """Largest R whose :func:`gpu_bytes` total fits ``budget`` and whose host pool fits
    ``host_budget`` (None: unbounded), at most ``o.max_reqs`` / ``o.max_request_id``; 0 if none."""
    cap = min(o.max_reqs or o.max_request_id, o.max_request_id)

    def fits(R: int) -> bool:
        try:
            cfg = _make_cfg(o, R, device)
        except ValueError:  # int32 index limits exceeded
            return False
        if host_budget is not None and cfg.host_pool_bytes > host_budget:
            return False
        return gpu_bytes(cfg, num_heads=o.num_heads, reserve_frac=o.reserve_frac)["total"] <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap)
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def candidates(rmax: int, n: int) -> list[int]:
    """Powers of two up to ``rmax`` plus ``rmax``, thinned to at most ``n`` (ends kept)."""
    c = sorted({1 << i for i in range(rmax.bit_length()) if (1 << i) <= rmax} | {rmax})
    if len(c) <= n:
        return c
    if n == 1:
        return [rmax]
    idx = sorted({round(i * (len(c) - 1) / (n - 1)) for i in range(n)})
    return [c[i] for i in idx]


def _template_rows(fmt: RowFormat, n: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """n valid rows of the format (uint8 [n, row_bytes]) from random latents."""
    x = torch.randn((n, D_ROW), generator=gen, device=device).to(torch.bfloat16)
    return quantize_fp8_ds_mla(x) if fmt is RowFormat.FP8_DS_MLA else bf16_rows_to_bytes(x)


def time_batch(o: AutotuneOptions, R: int, device: torch.device, backend) -> dict[str, Any]:
    """Build a cache for R requests, warm it, and time decode steps (see module doc)."""
    cfg = _make_cfg(o, R, str(device))
    fmt = RowFormat.parse(o.row_format)
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device)
    gen.manual_seed(o.seed)
    cache = HiSparseCache(cfg)
    tmpl = _template_rows(fmt, 256, device, gen)
    ctx = o.context
    for rid in range(R):
        cache.add_request(rid)
        idx = torch.arange(ctx, device=device) % tmpl.shape[0]
        rows = tmpl.index_select(0, idx)
        for layer in range(cfg.num_layers):
            cache.append_rows(layer, rid, rows)
    src = UniformSource(top_k=o.top_k, device=device, seed=o.seed)
    qlen = o.max_query_len
    # q tokens per request, a request's tokens contiguous
    ids = torch.arange(R, dtype=torch.int32, device=device).repeat_interleave(qlen)
    q = (torch.randn((R * qlen, o.num_heads, D_ROW), generator=gen, device=device)
         * 0.1).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(D_ROW)
    times: list[float] = []  # resolve + staging + attention, all layers (ms)
    lens = torch.full((R * qlen,), ctx, dtype=torch.int64, device=device)
    for it in range(o.warmup + o.steps):
        topks = [src.select(layer, ids.long(), lens, it) for layer in range(cfg.num_layers)]
        if cuda:
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        for layer in range(cfg.num_layers):
            res = cache.resolve(layer, ids, topks[layer], validate=False)
            kv = cache.hot_rows(layer)
            backend.decode(q, kv, res.physical, valid_counts=res.valid_counts, sm_scale=scale,
                           row_format=fmt)
        if cuda:
            torch.cuda.synchronize(device)
        if it >= o.warmup:
            times.append((time.perf_counter() - t1) * 1e3)
    del cache
    if cuda:
        torch.cuda.empty_cache()
    times.sort()
    p50 = times[len(times) // 2]
    p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
    return {"num_reqs": R, "step_ms_min": times[0], "step_ms_p50": p50, "step_ms_p99": p99,
            "tokens_per_s": R * o.max_query_len / (p50 / 1e3) if p50 > 0 else float("inf")}


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
    if rmax == 0:
        cfg1 = _make_cfg(o, 1, str(device))
        one = gpu_bytes(cfg1, num_heads=o.num_heads, reserve_frac=o.reserve_frac)
        raise CapacityError(f"not even one request fits: GPU budget {budget} bytes, one request "
                            f"needs {one['total']} ({one}); host budget {host_budget} bytes, one "
                            f"request's pool needs {cfg1.host_pool_bytes}; lower top_k/buffer/"
                            "context or raise --gpu-memory / --host-memory")
    cfg_max = _make_cfg(o, rmax, str(device))
    _check_memory(o, cfg_max, device)
    if o.max_reqs is not None and rmax == o.max_reqs:
        bound = "max_reqs"
    elif rmax == o.max_request_id:
        bound = "max_request_id"
    else:
        try:
            more = _make_cfg(o, rmax + 1, str(device))
            gpu_fits = gpu_bytes(more, num_heads=o.num_heads,
                                 reserve_frac=o.reserve_frac)["total"] <= budget
            bound = "host_memory" if gpu_fits and more.host_pool_bytes > host_budget else "gpu_memory"
        except ValueError:
            bound = "int32_index_limits"
    fmt = RowFormat.parse(o.row_format)
    backend = choose_backend(device=device, row_format=fmt, num_heads=o.num_heads,
                             phase=Phase.DECODE, prefer=o.backend, flashmla_lib=o.flashmla_lib)
    cands = candidates(rmax, o.max_candidates)
    meas = []
    with Progress(len(cands), "autotune", enabled=o.progress) as bar:
        for R in cands:
            m = time_batch(o, R, device, backend)
            m["within_latency"] = o.latency_ms is None or m["step_ms_p50"] <= o.latency_ms
            meas.append(m)
            bar.update(1, note=f"R={R} p50 {m['step_ms_p50']:.2f} ms")
    ok = [m for m in meas if m["within_latency"]]
    if not ok:
        raise CapacityError(f"no batch meets --latency-ms {o.latency_ms}: the smallest "
                            f"(R={meas[0]['num_reqs']}) took {meas[0]['step_ms_p50']:.3f} ms per step")
    best = max(ok, key=lambda m: m["tokens_per_s"])
    cfg = _make_cfg(o, best["num_reqs"], "cuda" if cuda else "cpu")
    return {
        "format": RESULT_FORMAT, "version": RESULT_VERSION,
        "key": device_key(device),
        "timings_are": ("GPU (CUDA-synchronised)" if cuda else
                        "CPU timings (no GPU here): they exercise the path only and say "
                        "nothing about GPU performance"),
        "max_num_reqs": best["num_reqs"],
        "max_fit_reqs": rmax,
        "device_buffer_size": cfg.device_buffer_size,
        "backend": backend.name,
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
             "step = resolve + staging + attention over all layers (new-row writes not timed)",
             "", table(["requests", "min ms", "p50 ms", "p99 ms", "tokens/s", "within limit", ""], rows), "",
             f"chosen: max_num_reqs={r['max_num_reqs']} device_buffer_size={r['device_buffer_size']} "
             f"backend={r['backend']}"]
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


def save_result(r: dict[str, Any], path: str | os.PathLike) -> None:
    """Write an autotune result as JSON (``load_tuned_config`` reads it)."""
    with open(path, "w") as f:
        json.dump(r, f, indent=2, sort_keys=True)


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
