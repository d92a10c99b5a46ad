"""A runnable mini inference engine: N layers of sparse MLA served with and without hisparse.

A random-weight model (deterministic from ``seed``; :mod:`.model`) with a real q.k
top-k indexer serves a workload of requests that arrive, prefill in chunks, decode and
leave (:mod:`.config`, :mod:`.loop`). The same workload runs twice, differing only in
where KV rows live (:mod:`.kv`, one interface for both):

  resident  an ordinary paged device KV cache: decode attention reads it through a block
            table (``convert_topk_to_physical``), prefill gathers context rows into a
            bf16 workspace
  hisparse  ``hisparse.engine.HiSparseIndexGroup``: rows in the host pool, a hot buffer
            smaller than the contexts; decode attention reads the hot buffer through the
            resolved physical indices, prefill through ``gather_fp8_prefill``

Both use the same attention backend objects. The final hidden states must match token
by token within ``tolerance`` (the same rows are gathered, so they normally match
exactly); the report (:mod:`.report`) has tokens/s of both, their ratio, hisparse's hit
rate and bytes moved. ``hisparse mini-engine`` (:mod:`.cli`) runs it from the shell.

``graphs`` (:mod:`.graphs`): decode-only steps padded to batch-size buckets and replayed
as CUDA graphs, for both stores. ``ffn`` (:mod:`.ffn`): a dense MLP or grouped-GEMM MoE
stand-in for the rest of each layer, so a step is not all attention. ``index_share``:
only every n-th layer runs an indexer, the layers after it reuse its top-k (the
Full / Shared layers of IndexCache, arXiv 2603.12201); with ``prefetch`` hisparse stages
a Shared layer's rows while the layer before it computes.

``async_steps`` (CUDA, the default): the loop prepares and launches step t + 1 before it
waits for step t, as an engine's asynchronous scheduler does. A step launched behind
another is timed from the end of that one to its own end (scheduling included). Requests
finished by a step are released once it has run, and an admission waits for the step in
flight. Only graph-replayed decode steps are prepared without waiting: eager steps still
copy some inputs from pageable memory.

``synthetic_context`` (benchmarks): the first n positions of every prompt get random
rows and indexer keys written straight into both caches instead of being prefilled,
so a 32K context costs seconds, not minutes; the rest of the prompt is prefilled.
"""

from __future__ import annotations

import importlib

# exported name -> submodule that defines it. Imported when first used, so that the
# ``hisparse`` command's parser (``build_parser``, the presets, the config) loads no cache
# or kernel; ``run`` and the KV stores bring them in.
_EXPORTS = {
    "MiniEngineConfig": "config", "Request": "config", "make_workload": "config",
    "memory_needed": "config", "PRESETS": "config",
    "Model": "model", "synthetic_rows": "model", "Indexer": "model",
    "Batch": "kv", "Attention": "kv", "KVStore": "kv", "ResidentKV": "kv", "HiSparseKV": "kv",
    "KV_STORES": "kv",
    "MiniEngine": "loop", "adjacent_layer_overlap": "loop", "compare": "loop", "run": "loop",
    "run_engine": "loop", "summarize": "loop", "preflight": "loop",
    "FFN": "ffn", "FFNKind": "ffn", "V32_EP8_SHARE": "ffn",
    "DecodeGraphs": "graphs", "DecodeMode": "graphs", "bucket_for": "graphs",
    "capture_sizes": "graphs",
    "format_report": "report",
    "build_parser": "cli", "config_from_args": "cli", "run_args": "cli", "main": "cli",
    "CONFIG_FLAGS": "cli",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
