"""Sizes of the mini engine's model, workload and cache, and the workload itself.

``MiniEngineConfig`` is checked when built (every field, before anything is
allocated; its choice fields parsed to enum members there, :mod:`hisparse_tools.fields`);
:func:`memory_needed` says what a run will allocate, so the CLI can refuse
a size the machine can't hold before it starts. :func:`make_workload` draws the
requests (arrival step, prompt and decode lengths, teacher-forced tokens) from
``seed``, so both runs of a comparison see the same inputs.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from hisparse.config import HiSparseConfig, Kernels, RowFormat, ceil_div
from hisparse.decode import Overlap
from hisparse.formats import D_LATENT, D_ROW
from ..fields import check_fields, parse_choices
from ..sizing import gpu_bytes
from .ffn import FFNKind, FFNRouting, ffn_weight_bytes

_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")

# MiniEngineConfig's fields, each checked alone (.fields.check_fields): int ranges [lo, hi)
_INTS = {**dict.fromkeys(("num_layers", "num_heads", "hidden", "indexer_dim", "vocab", "top_k", "num_requests",
                          "min_prompt", "max_prompt", "max_decode", "query_len", "chunk", "max_batch_tokens",
                          "host_block_size", "ffn_intermediate", "ffn_experts", "ffn_active", "index_share",
                          "prefix_groups"), (1, None)),
         **dict.fromkeys(("arrival_every", "min_decode", "synthetic_context", "ffn_shared", "shared_prefix"),
                         (0, None)),
         "seed": (0, 2**62)}  # the tools derive seed + 1, seed + 2, ... from it
_OPTIONAL_INTS = dict.fromkeys(("device_buffer_size", "max_num_reqs", "device_pool_rows"), (1, None))
_BOOLS = ("validate", "prefetch", "graphs", "layer_graphs", "async_steps", "prefix_reuse")
_FINITE = ("locality", "tolerance", "index_correlation")
# finite numbers: [lo, hi) and its words in the error
_RANGES = {"locality": (0.0, 1.0, "in [0, 1)"), "index_correlation": (0.0, 1.0, "in [0, 1)"),
           "tolerance": (0.0, float("inf"), ">= 0 (a relative difference)")}
# choice fields: their parse (a member, or a ValueError naming the field and the spellings)
_CHOICES = {"row_format": RowFormat.parse, "cache_kernels": lambda v: Kernels.parse(v, "cache_kernels"),
            "overlap": Overlap.parse, "ffn": FFNKind.parse, "ffn_routing": FFNRouting.parse}


@dataclasses.dataclass(frozen=True)
class MiniEngineConfig:
    """Sizes of the model, the workload and the hisparse cache (see the package docstring).

    The choice fields (``row_format``, ``cache_kernels``, ``overlap``, ``ffn``,
    ``ffn_routing``) hold enum members and take their string values too.
    """

    num_layers: int = 2
    num_heads: int = 2
    hidden: int = 64
    indexer_dim: int = 16
    vocab: int = 97
    top_k: int = 8
    num_requests: int = 4
    min_prompt: int = 20
    max_prompt: int = 40
    min_decode: int = 3
    max_decode: int = 8
    arrival_every: int = 2  # request i arrives at step i * arrival_every
    query_len: int = 1  # decode tokens per request per step (MTP > 1)
    chunk: int = 16  # prefill chunk per request per step
    max_batch_tokens: int = 64
    device_buffer_size: int | None = None  # hot slots per (layer, request); default 2 * top_k
    device_pool_rows: int | None = None  # hisparse's elastic device tier (HiSparseConfig.device_pool_rows)
    host_block_size: int = 16
    max_num_reqs: int | None = None  # default num_requests
    row_format: RowFormat = RowFormat.FP8_DS_MLA
    device: str = "cpu"  # cpu, cuda or cuda:N
    seed: int = 0
    locality: float = 0.9
    synthetic_context: int = 0
    backend: str | None = None  # attention backend name (None: chooser default)
    flashmla_lib: str | None = None  # path of FlashMLA's _flashmla_C library (backend "flashmla")
    cache_kernels: Kernels = Kernels.AUTO  # HiSparseCache kernels (triton on CPU: interpreter)
    validate: bool = True  # checked mode for cache and attention calls
    overlap: Overlap = Overlap.SERIAL  # hisparse decode: serial | split
    prefetch: bool = False  # hisparse decode: stage layer l's top-k into layer l+1 (prefetches_into)
    index_share: int = 1  # layers per indexer: layer l computes a top-k iff l % index_share == 0 (a
    #                      "Full" layer, IndexCache's terms); the layers after it reuse that top-k
    index_correlation: float = 0.0  # 0..1: the Full layers' indexers share a common part with this
    #                      weight, so adjacent layers' selections overlap (0: independent layers)
    async_steps: bool = True  # CUDA: prepare step t + 1 on the host while step t runs (one step ahead)
    tolerance: float = 2e-2  # max |x_resident - x_hisparse| allowed, relative to max |x|
    graphs: bool = False  # decode-only steps as CUDA graphs per batch-size bucket (needs CUDA, unchecked)
    layer_graphs: bool = False  # decode-only steps padded to buckets and run eagerly, hisparse's per-layer
    #                      calls replaying graphs of their own (HiSparseIndexGroup layer_graphs=True)
    ffn: FFNKind = FFNKind.NONE  # rest-of-layer stand-in after attention: none | mlp | moe (.ffn)
    ffn_intermediate: int = 64  # MLP / per-expert intermediate size
    ffn_experts: int = 4  # MoE: experts on this GPU
    ffn_active: int = 2  # MoE: experts per token
    ffn_shared: int = 1  # MoE: shared experts (each of ffn_intermediate) on every token
    ffn_routing: FFNRouting = FFNRouting.CONTENT  # MoE: experts chosen from the hidden state (content) or
    #                      from the input token's embedding (token; .ffn)
    shared_prefix: int = 0  # request i's prompt starts with the shared_prefix tokens of group i % prefix_groups
    prefix_groups: int = 1
    prefix_reuse: bool = False  # hisparse: prefix caching; a request computes only its uncached tokens (.prefix)

    def __post_init__(self) -> None:
        check_fields(self, ints=_INTS, optional_ints=_OPTIONAL_INTS, bools=_BOOLS, finite=_FINITE)
        parse_choices(self, _CHOICES)
        for name, (lo, hi, what) in _RANGES.items():
            if not lo <= getattr(self, name) < hi:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)}")
        if not isinstance(self.device, str) or not _DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        self._check_rules()
        self.cache_config()  # the cache's own limits (buffer >= q x K, int32 indices)

    def _check_rules(self) -> None:
        """The rules between fields (each field alone is checked already)."""
        if self.shared_prefix >= self.min_prompt:
            raise ValueError(f"shared_prefix={self.shared_prefix} does not fit the prompts: a prompt is the shared "
                             f"prefix plus at least one token of its own, and the shortest has min_prompt="
                             f"{self.min_prompt} tokens; give a shared_prefix below {self.min_prompt}")
        if self.prefix_groups > 1 and not self.shared_prefix:
            raise ValueError(f"prefix_groups={self.prefix_groups} has no effect without shared_prefix (it says how "
                             "many groups share a prefix); give a shared_prefix or drop it")
        if self.prefix_reuse and self.synthetic_context:
            raise ValueError("prefix_reuse and synthetic_context both decide a prompt's first rows (cached, or "
                             "written as random rows): give one of the two")
        if self.ffn is FFNKind.MOE and self.ffn_active > self.ffn_experts:
            raise ValueError(f"ffn_active={self.ffn_active} exceeds ffn_experts={self.ffn_experts}")
        if self.ffn is not FFNKind.NONE and (self.hidden % 8 or self.ffn_intermediate % 8):
            raise ValueError(f"the ffn stand-in needs hidden and ffn_intermediate multiples of 8, got "
                             f"{self.hidden} and {self.ffn_intermediate}")
        for flag in ("graphs", "layer_graphs"):
            if not getattr(self, flag):
                continue
            if not self.device.startswith("cuda"):
                raise ValueError(f"{flag} (CUDA graphs) need a CUDA device, got device={self.device!r}")
            if self.validate:
                raise ValueError(f"{flag} need unchecked mode (--unchecked): checked mode reads device "
                                 "values on the host, which a captured call cannot do")
        if self.overlap is Overlap.AUTO:
            raise ValueError("overlap 'auto' picks a mode per layer call from its own timings; the mini engine "
                             "begins each layer's resolve before its query (begin_decode_attention, a split "
                             "call) and may capture whole steps: use overlap serial or split")
        if self.layer_graphs:
            if self.graphs:
                raise ValueError("layer_graphs are for a forward that runs eagerly; with graphs the whole decode "
                                 "forward is captured already: give one of the two")
            if self.overlap is not Overlap.SERIAL:
                raise ValueError(f"layer_graphs replay the serial conversion; overlap={self.overlap.value!r} runs "
                                 "decode_attention, which stays eager: use overlap serial")
            if self.cache_kernels is Kernels.TORCH:
                raise ValueError(f"layer_graphs need the Triton cache kernels, got cache_kernels="
                                 f"{self.cache_kernels.value!r}")
        if self.prefetch and not any(self.prefetches_into(i) for i in range(self.num_layers)):
            raise ValueError("prefetch would stage into no layer: with index_share=1 and index_correlation=0 "
                             "every layer has its own independent indexer, so a layer's top-k predicts nothing "
                             "of the next; use index_share > 1 (Shared layers) or index_correlation > 0")
        if self.min_decode > self.max_decode:
            raise ValueError(f"need 0 <= min_decode <= max_decode, got {self.min_decode}, {self.max_decode}")
        if self.min_prompt > self.max_prompt:
            raise ValueError(f"min_prompt {self.min_prompt} > max_prompt {self.max_prompt}")
        if not self.synthetic_context < self.min_prompt:
            raise ValueError(f"synthetic_context must be in [0, min_prompt={self.min_prompt}), "
                             f"got {self.synthetic_context}")
        if self.max_batch_tokens < self.num_requests * self.query_len:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} cannot hold one decode step of all "
                             f"{self.num_requests} requests x query_len {self.query_len}")

    @property
    def max_context(self) -> int:
        return self.max_prompt + self.max_decode * self.query_len

    def full_layer(self, layer: int) -> bool:
        """Whether ``layer`` runs its own indexer (else it reuses the top-k of the Full
        layer ``layer - layer % index_share``)."""
        return layer % self.index_share == 0

    def prefetches_into(self, layer: int) -> bool:
        """With ``prefetch``, whether layer - 1's top-k is staged into ``layer`` while layer
        - 1 computes: into a Shared layer always (that top-k is its selection exactly),
        into a Full layer only when the indexers are correlated (``index_correlation`` >
        0: a prediction); independent Full layers would get rows they mostly do not select."""
        if not self.prefetch or layer < 1 or layer >= self.num_layers:
            return False
        return not self.full_layer(layer) or self.index_correlation > 0

    @property
    def index_layers(self) -> int:
        """Layers with an indexer (and indexer keys): ceil(num_layers / index_share)."""
        return ceil_div(self.num_layers, self.index_share)

    @property
    def slots(self) -> int:
        """Requests served at once (engine slots)."""
        return self.max_num_reqs or self.num_requests

    def cache_config(self) -> HiSparseConfig:
        R = self.slots
        return HiSparseConfig(
            num_layers=self.num_layers, row_bytes=self.row_format.row_bytes, top_k=self.top_k,
            device_buffer_size=self.device_buffer_size, max_num_reqs=R, max_query_len=self.query_len,
            host_block_size=self.host_block_size,
            host_pool_tokens=R * (ceil_div(self.max_context, self.host_block_size) + 1) * self.host_block_size,
            max_request_id=max(self.num_requests, 1), device=self.device, device_pool_rows=self.device_pool_rows,
            prefix_caching=self.prefix_reuse)


def memory_needed(cfg: MiniEngineConfig) -> tuple[dict[str, int], dict[str, int]]:
    """(host parts, device parts) in bytes of one run (the two engines run one after the
    other: the larger KV store counts). On a CPU device everything is host memory."""
    L, D, H, R, C = cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.slots, cfg.max_context
    F = cfg.index_layers
    rb = cfg.row_format.row_bytes
    cc = cfg.cache_config()
    resident = L * (R + 1) * ceil_div(C, cfg.host_block_size) * cfg.host_block_size * rb
    hisparse_dev = gpu_bytes(cc, num_heads=H)["total"]
    device = {
        "weights": L * D * (H * D_ROW + D_ROW + H * D_LATENT) * 2 + F * D * cfg.indexer_dim * 8
                   + (cfg.vocab + D) * D * 4,
        "indexer keys": F * (R + 1) * C * cfg.indexer_dim * 4,  # + the padding slot
        "ffn stand-in weights": ffn_weight_bytes(kind=cfg.ffn, num_layers=L, hidden=D,
                                                 intermediate=cfg.ffn_intermediate, experts=cfg.ffn_experts,
                                                 shared=cfg.ffn_shared),
        "prefill workspace": R * C * D_ROW * 2,
        "KV rows (resident or hot buffers)": max(resident, hisparse_dev),
        "outputs": cfg.num_requests * (C - cfg.synthetic_context) * D * 4,  # synthetic rows have none
    }
    if cfg.prefix_reuse:  # .prefix.IndexerPrefix keeps every prompt block's keys: at most every prompt's
        device["indexer keys of cached prompt blocks"] = F * cfg.num_requests * cfg.max_prompt * cfg.indexer_dim * 4
    host = {"host pool": cc.host_pool_bytes}
    if not cfg.device.startswith("cuda"):
        host.update(device)
        device = {}
    return host, device


# ---------------------------------------------------------------------- workload
@dataclasses.dataclass
class Request:
    rid: int
    arrival: int
    prompt_len: int
    decode_len: int  # decode steps
    tokens: torch.Tensor  # int64 [prompt_len + decode_len * q] teacher-forced inputs (CPU)
    done: int = 0  # positions processed
    cached: int = 0  # leading positions whose KV the hisparse store had cached (prefix_reuse): not computed
    slot: int = -1  # engine slot (indexer store, resident block table)
    _decode_list: list | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.tokens.numel()

    def decode_tokens(self, a: int, b: int) -> list[int]:
        """tokens[a:b] as ints for prompt_len <= a <= b (the decode part, made a list once)."""
        if not self.prompt_len <= a <= b <= self.total:
            raise ValueError(f"decode_tokens({a}, {b}) outside the decode part "
                             f"[{self.prompt_len}, {self.total}) of request {self.rid}")
        if self._decode_list is None:
            self._decode_list = self.tokens[self.prompt_len:].tolist()
        return self._decode_list[a - self.prompt_len:b - self.prompt_len]


def make_workload(cfg: MiniEngineConfig) -> list[Request]:
    """The requests of ``cfg``'s workload; with ``shared_prefix``, request i's prompt
    starts with its group's (i % prefix_groups) prefix, drawn apart from the rest."""
    g = torch.Generator().manual_seed(cfg.seed)
    gp = torch.Generator().manual_seed(cfg.seed + 7)
    prefixes = [torch.randint(0, cfg.vocab, (cfg.shared_prefix,), generator=gp) for _ in range(cfg.prefix_groups)]
    reqs = []
    for i in range(cfg.num_requests):
        p = int(torch.randint(cfg.min_prompt, cfg.max_prompt + 1, (1,), generator=g))
        d = int(torch.randint(cfg.min_decode, cfg.max_decode + 1, (1,), generator=g))
        toks = torch.randint(0, cfg.vocab, (p + d * cfg.query_len,), generator=g)
        toks[:cfg.shared_prefix] = prefixes[i % cfg.prefix_groups]
        reqs.append(Request(rid=i, arrival=i * cfg.arrival_every, prompt_len=p, decode_len=d, tokens=toks))
    return reqs


PRESETS = {
    "cpu": {},
    "h200": dict(num_layers=8, num_heads=128, hidden=256, indexer_dim=64, vocab=1024, top_k=2048,
                 num_requests=64, min_prompt=30 * 1024, max_prompt=32 * 1024, min_decode=24, max_decode=32,
                 arrival_every=0, chunk=2048, max_batch_tokens=8192, host_block_size=64, device="cuda",
                 synthetic_context=28 * 1024, locality=0.98),
}

__all__ = ["MiniEngineConfig", "Request", "make_workload", "memory_needed", "PRESETS"]
