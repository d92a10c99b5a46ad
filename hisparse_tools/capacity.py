"""Each tier's largest decode batch in a memory budget, and a measured decode run at it.

1. Search (:func:`tier_limits`): the formulas of :mod:`hisparse_tools.plan` (the same
   numbers ``hisparse plan`` prints) for a full model of ``num_layers`` layers:

     resident   KV pages and indexer keys on the GPU: floor(G / (C (L row + Li I)))
     hisparse   hot buffers, slot state, row->slot map and indexer keys on the GPU, every
                row in the pinned host pool: min(GPU limit, host limit, max seqs, int32)

   G = ``gpu_total - reserve`` (the reserve stands for weights, activations and the
   allocator's slack), the host budget is the pool of this GPU's requests; Li =
   ceil(L / index_share) layers keep indexer keys (the model's Full layers). Each tier
   says where its limit came from (``bound``: gpu | host | max_seqs | int32_indices).
2. Measurement (:func:`measure`): the mini engine (:mod:`hisparse_tools.mini_engine`)
   serving ``batch`` requests of the context (synthetic rows, a short prefilled tail)
   through one KV store for ``decode_steps`` decode steps, all requests decoding
   together. ``run_layers`` layers stand for the model's ``num_layers``: the decode
   tokens/s is reported as measured and scaled to the full depth (step time x
   num_layers / run_layers; the embedding and logits are outside the per-layer part and
   negligible). Under CUDA graphs the step statistics are the replayed steps only.
3. :func:`largest_fit`: the search for the largest n with ``fits(n)`` that ``hisparse
   autotune`` also uses (its own exact byte count of one cache).

``hisparse autotune`` times its candidate batches with :func:`measure` too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from hisparse.config import Kernels, RowFormat, check_int
from hisparse.decode import Overlap
from .fields import parse_choices
from .mini_engine import MiniEngineConfig
from .mini_engine.graphs import DecodeMode
from .plan import PlanInputs, plan

GiB = 1 << 30
H200_BYTES = 141 * 10**9  # one H200's HBM3e as sold (141 GB)
DEFAULT_RESERVE = H200_BYTES - 80 * GiB  # leaves hisparse plan's default 80 GiB for KV
TIERS = ("resident", "hisparse")


def largest_fit(fits: Callable[[int], bool], cap: int) -> int:
    """The largest n in [1, cap] with ``fits(n)`` (fits must be monotone: true up to a
    point, false after), 0 when not even 1 fits. Doubling, then bisection."""
    check_int("cap", cap, lo=1)
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


@dataclasses.dataclass(frozen=True)
class Budget:
    """The model and memory of one GPU the search sizes for (plan's symbols)."""

    num_layers: int = 61  # L, DeepSeek-V3.2
    gpu_total: int = H200_BYTES
    reserve: int = DEFAULT_RESERVE  # weights + activations + slack; G = gpu_total - reserve
    host_memory: int = 1 << 40  # Hm, this GPU's share of the node's pinned pool
    row_format: RowFormat = RowFormat.FP8_DS_MLA  # or its value
    top_k: int = 2048
    hot_rows: int | None = None  # S, default 2 * top_k
    block_size: int = 64
    indexer_bytes: int = 132  # I: 128 fp8 values + a float32 scale per token and layer
    index_share: int = 1  # layers per indexer (IndexCache-style Full / Shared layers; 1: DeepSeek-V3.2)
    max_seqs: int = 1024

    def __post_init__(self) -> None:
        for name in ("num_layers", "gpu_total", "host_memory", "top_k", "block_size", "max_seqs", "index_share"):
            check_int(name, getattr(self, name), lo=1)
        check_int("reserve", self.reserve, lo=0)
        check_int("indexer_bytes", self.indexer_bytes, lo=0)
        parse_choices(self, {"row_format": RowFormat.parse})
        if self.reserve >= self.gpu_total:
            raise ValueError(f"reserve {self.reserve} leaves nothing of gpu_total {self.gpu_total} for KV")

    @property
    def kv_bytes(self) -> int:
        return self.gpu_total - self.reserve


def tier_limits(budget: Budget, context: int) -> dict:
    """Largest batch of each tier at ``context`` tokens and what bounds it (module doc)."""
    check_int("context", context, lo=1)
    p = plan(PlanInputs(num_layers=budget.num_layers, context_len=context, gpu_bytes=budget.kv_bytes,
                        host_bytes=budget.host_memory, row_format=budget.row_format, top_k=budget.top_k,
                        indexer_bytes=budget.indexer_bytes, index_share=budget.index_share,
                        hot_rows=budget.hot_rows,
                        max_seqs=budget.max_seqs, block_size=budget.block_size))
    c, b = p["concurrency"], p["per_request_bytes"]
    res_bound = "max_seqs" if c["resident"] == budget.max_seqs else "gpu"
    return {
        "context": context,
        # kv_rows_per_layer: the KV rows the resident tier keeps per layer at its batch (its KV bytes, the
        # indexer keys aside, over L x row bytes): what `bench_capacity --pool-rows auto` gives hisparse's pool
        "resident": {"batch": c["resident"], "bound": res_bound, "gpu_bytes_per_request": b["resident_gpu"],
                     "host_bytes_per_request": 0, "kv_rows_per_layer": c["resident"] * context,
                     "kv_bytes": c["resident"] * context * budget.num_layers * p["inputs"]["row_bytes"]},
        # nonrow_gpu_bytes_per_request: hisparse's GPU bytes per request beyond its hot buffer's rows (slot
        # state, indexer keys, row map, tables): what `bench_capacity --pool-rows budget` leaves out of the KV budget
        "hisparse": {"batch": c["hisparse"], "bound": p["binding"], "gpu_bytes_per_request": b["hisparse_gpu"],
                     "nonrow_gpu_bytes_per_request": b["hisparse_gpu"] - budget.num_layers * (
                         p["inputs"]["hot_rows"] + 1) * p["inputs"]["row_bytes"],
                     "row_bytes": p["inputs"]["row_bytes"],
                     "host_bytes_per_request": b["hisparse_host"], "gpu_limit": c["hisparse_gpu_limit"],
                     "host_limit": c["hisparse_host_limit"]},
        "gain": p["gain"],
    }


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The measured run's model and workload (the mini engine's fields)."""

    run_layers: int = 4
    num_heads: int = 128
    hidden: int = 1344  # see hisparse_tools.mini_engine.ffn.v32_share_at
    indexer_dim: int = 32  # fp32 keys: 128 bytes per token and layer, about the real 132
    vocab: int = 1024
    ffn: dict = dataclasses.field(default_factory=dict)  # ffn_* fields of MiniEngineConfig
    decode_steps: int = 16
    tail: int = 16  # prompt tokens prefilled for real (the rest is synthetic)
    query_len: int = 1
    locality: float = 0.98
    index_correlation: float = 0.0  # the mini engine's adjacent-layer indexer correlation (0: independent)
    device: str = "cuda"
    decode_mode: DecodeMode = DecodeMode.GRAPHS
    backend: str | None = None
    flashmla_lib: str | None = None
    cache_kernels: Kernels = Kernels.AUTO  # or its value
    seed: int = 0
    overlap: Overlap = Overlap.SERIAL  # hisparse decode: serial | split (the miss staging hidden); or its value
    prefetch: bool = False  # hisparse decode: stage the next layer's rows from this one's top-k (prefetches_into)
    async_steps: bool = True  # the host prepares step t + 1 while step t runs (MiniEngineConfig)

    def __post_init__(self) -> None:
        for name in ("run_layers", "num_heads", "hidden", "indexer_dim", "vocab", "decode_steps", "tail",
                     "query_len"):
            check_int(name, getattr(self, name), lo=1)
        if not isinstance(self.decode_mode, DecodeMode):
            raise TypeError(f"decode_mode must be a DecodeMode, got {self.decode_mode!r}")
        parse_choices(self, {"cache_kernels": lambda v: Kernels.parse(v, "cache_kernels"), "overlap": Overlap.parse})


def engine_config(budget: Budget, shape: RunShape, *, context: int, batch: int,
                  pool_rows: int | None = None) -> MiniEngineConfig:
    """The mini engine at ``batch`` requests of ``context`` tokens (all arrive at step 0,
    the same prompt and decode lengths: the batch stays ``batch`` while decoding).
    ``pool_rows``: hisparse's device pool (``HiSparseConfig.device_pool_rows``; None: none)."""
    check_int("batch", batch, lo=1)
    if shape.run_layers % budget.index_share:
        raise ValueError(f"run_layers={shape.run_layers} must be a multiple of index_share={budget.index_share}: "
                         "the run stands for the whole model, so it needs the model's share of Full layers")
    tail = min(shape.tail, context)
    graphs = shape.decode_mode is DecodeMode.GRAPHS
    return MiniEngineConfig(
        num_layers=shape.run_layers, num_heads=shape.num_heads, hidden=shape.hidden,
        indexer_dim=shape.indexer_dim, vocab=shape.vocab, top_k=budget.top_k, num_requests=batch,
        min_prompt=context, max_prompt=context, min_decode=shape.decode_steps, max_decode=shape.decode_steps,
        arrival_every=0, query_len=shape.query_len, chunk=tail,
        max_batch_tokens=batch * max(tail, shape.query_len), device_buffer_size=budget.hot_rows,
        device_pool_rows=pool_rows,
        host_block_size=budget.block_size, row_format=budget.row_format, device=shape.device, seed=shape.seed,
        locality=shape.locality, index_correlation=shape.index_correlation, synthetic_context=context - tail, backend=shape.backend,
        flashmla_lib=shape.flashmla_lib, cache_kernels=shape.cache_kernels,
        validate=shape.device == "cpu" and shape.decode_mode is DecodeMode.EAGER,
        graphs=graphs, overlap=shape.overlap, prefetch=shape.prefetch, index_share=budget.index_share,
        async_steps=shape.async_steps,
        tolerance=2e-2 if shape.overlap is Overlap.SERIAL else 5e-2,  # split: the hit partial rounds to bf16 once more
        **shape.ffn)


def measure(cfg: MiniEngineConfig, kind: str, *, decode_mode: DecodeMode, full_layers: int | None = None,
            skip: int = 0, progress: bool = False, profile: tuple[int, int] | None = None) -> tuple[dict, dict]:
    """Serve ``cfg`` with one KV store; returns (summary, raw result with the outputs).

    summary: :func:`summarize`'s fields plus ``decode`` {batch, step_ms {min, median,
    p99, n} over the replayed steps (graphs) or all decode-only steps, tokens_per_s =
    batch x q / median step, and the same scaled from ``cfg.num_layers`` to
    ``full_layers`` layers; with graphs also gpu_step_ms and tokens_per_s_gpu, from the
    replays' GPU time alone (CUDA events around each replay)}. ``skip``: steps dropped from the front of those samples
    (a warm-up beyond the graphs' own). ``profile=(after, n)``: n replays after the
    first ``after`` run under torch.profiler instead of being timed (summary ``profile``).
    """
    check_int("skip", skip, lo=0)
    from .mini_engine.loop import run_engine, step_stats, summarize  # the engine: loaded to measure

    res = run_engine(cfg, kind, progress=progress, decode_mode=decode_mode, profile=profile)
    s = summarize(res)
    if res.get("profile") is not None:
        s["profile"] = res["profile"]
    replays = bool(res["replay_step_times"])
    st = step_stats((res["replay_step_times"] if replays else res["decode_step_times"])[skip:])
    B, q = cfg.num_requests, cfg.query_len
    med = st.get("median_ms")
    dec = {"batch": B, "steps_from": "replays" if replays else "decode-only steps",
           "step_ms": {k: st.get(k) for k in ("min_ms", "median_ms", "p99_ms", "n")},
           "tokens_per_s": B * q / (med / 1e3) if med else None}
    gpu = step_stats(res.get("replay_gpu_times", [])[skip:]) if replays else {}
    if gpu.get("median_ms"):  # the replays' GPU time alone: what an engine that overlaps its host work sees
        dec["gpu_step_ms"] = {k: gpu.get(k) for k in ("min_ms", "median_ms", "p99_ms", "n")}
        dec["tokens_per_s_gpu"] = B * q / (gpu["median_ms"] / 1e3)
    if full_layers is not None and med:
        scale = full_layers / cfg.num_layers
        dec["full_depth"] = {"layers": full_layers, "step_ms": med * scale,
                             "tokens_per_s": B * q / (med * scale / 1e3)}
    s["decode"] = dec
    return s, res


__all__ = ["Budget", "RunShape", "tier_limits", "engine_config", "measure", "largest_fit", "TIERS",
           "H200_BYTES", "DEFAULT_RESERVE"]
