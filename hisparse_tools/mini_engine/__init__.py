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

from .cli import CONFIG_FLAGS, build_parser, config_from_args, main, run_args
from .config import PRESETS, MiniEngineConfig, Request, make_workload, memory_needed
from .kv import KV_STORES, Attention, Batch, HiSparseKV, KVStore, ResidentKV
from .ffn import FFN, V32_EP8_SHARE, FFNKind
from .graphs import DecodeGraphs, DecodeMode, bucket_for, capture_sizes
from .loop import MiniEngine, adjacent_layer_overlap, compare, preflight, run, run_engine, summarize
from .model import Indexer, Model, synthetic_rows
from .report import format_report

__all__ = ["MiniEngineConfig", "Request", "make_workload", "memory_needed", "PRESETS", "Model",
           "synthetic_rows", "Indexer", "Batch", "Attention", "KVStore", "ResidentKV", "HiSparseKV",
           "KV_STORES", "MiniEngine", "adjacent_layer_overlap", "compare", "run", "run_engine", "summarize", "preflight", "FFN", "FFNKind",
           "V32_EP8_SHARE", "DecodeGraphs", "DecodeMode", "bucket_for", "capture_sizes", "format_report", "build_parser",
           "config_from_args", "run_args", "main", "CONFIG_FLAGS"]
