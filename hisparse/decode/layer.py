"""One sparse-MLA decode layer over a hisparse cache, with the miss staging hidden.

Notation: T query tokens, H heads, K top-k entries per token (see ``cache.state``).

Modes (``Overlap``):
  serial  resolve + stage the misses, then one attention over every entry (the compute
          stream waits for the staging first)
  split   the hit phase of the resolve, then attention over the hits *while* the miss
          phase and the staging copy run on the stage stream; then attention over the
          misses, merged into the hit result by LSE (``attention.miss``)
  fused   as split, but no copy: one kernel on the stage stream reads the missed rows
          from pinned host memory, writes them into their hot slots and attends over
          them, concurrently with the hit attention; then an LSE merge

All three leave the cache in the same state, bit for bit, and return the same
attention (split and fused within the rounding of one merge of bf16 partials). The
hit attention runs on any backend (``attention.base.SparseMLABackend``: Triton,
FlashMLA, FlashInfer, the reference); the miss side runs our Triton kernels (their
torch references on CPU). Graph capturable with ``validate=False``: fixed shapes, no
host sync; plans (scratch buffers) are made once per (mode, T, H).

Prefetch: ``DecodeLayer.prefetch(layer, req_ids, topk)`` stages a layer's predicted
selection (typically the previous layer's top-k) on the stage stream so that its real
resolve finds those rows hot.
"""

from __future__ import annotations

import enum

import torch

from .._checks import check_bool, parse_enum
from ..attention.base import SparseMLABackend, check_decode_call
from ..attention.miss import (MissConfig, MissMode, MissPlan, fused_miss_attention, merge_lse,
                              miss_attention_merge, plan_miss_attention)
from ..cache.cache import HiSparseCache
from ..formats import D_LATENT, RowFormat


class Overlap(enum.Enum):
    """How a decode layer orders miss staging and attention (module docstring)."""

    SERIAL = "serial"
    SPLIT = "split"
    FUSED = "fused"

    @classmethod
    def parse(cls, value: "Overlap | str") -> "Overlap":
        return parse_enum(cls, value, "overlap")


class DecodeLayer:
    """Decode attention of a cache's layers in one overlap mode, with one backend.

    ``backend`` attends over the hits (and, serially, over everything); ``kernels``
    picks the miss-side implementation ("auto": Triton on CUDA, torch on CPU). To
    capture a layer in a CUDA graph, give a backend that does not read the device to
    check its inputs (``TritonBackend(validate=False)``, ``FlashMLABackend(check_ranges=False)``).
    """

    def __init__(self, cache: HiSparseCache, backend: SparseMLABackend, *,
                 overlap: Overlap | str = Overlap.SPLIT, validate: bool = False,
                 kernels: str = "auto", miss_config: MissConfig | None = None) -> None:
        if not isinstance(cache, HiSparseCache):
            raise TypeError(f"cache must be a HiSparseCache, got {type(cache).__name__}")
        if not isinstance(backend, SparseMLABackend):
            raise TypeError(f"backend must be a SparseMLABackend, got {type(backend).__name__}")
        self.cache = cache
        self.backend = backend
        self.overlap = Overlap.parse(overlap)
        self.validate = check_bool("validate", validate)
        self.kernels = kernels
        self.miss_config = miss_config  # launch shape of the miss kernels (None: their default)
        self._plans: dict[tuple, MissPlan] = {}
        self._partials: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._supported: set = set()  # (device, row format, heads) the backend accepted

    def _plan(self, mode: MissMode, T: int, H: int, fmt: RowFormat) -> MissPlan:
        key = (mode, H, fmt)
        plan = self._plans.get(key)
        if plan is None or plan.max_tokens < T:
            plan = plan_miss_attention(mode=mode, max_tokens=max(T, self.cache.cfg.max_tokens), num_heads=H,
                                       row_format=fmt, device=self.cache.device, config=self.miss_config)
            self._plans[key] = plan
        return plan

    def _partial(self, T: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [T, H, 512], [T, H] miss partials of the fused mode (made once per H)."""
        Tm = max(T, self.cache.cfg.max_tokens)
        bufs = self._partials.get((H,))
        if bufs is None:
            dev = self.cache.device
            bufs = (torch.empty((Tm, H, D_LATENT), dtype=torch.float32, device=dev),
                    torch.empty((Tm, H), dtype=torch.float32, device=dev))
            self._partials[(H,)] = bufs
        return bufs[0][:T], bufs[1][:T]

    def __call__(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, q: torch.Tensor, *,
                 sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve ``topk`` (int32 [T, K]) of ``layer`` for ``req_ids`` (int32 [T]) and
        attend ``q`` (bf16 [T, H, 576]) over it. Returns out bf16 [T, H, 512] and lse
        float32 [T, H] (natural log); the current stream may read them when it reaches
        them (every wait is enqueued)."""
        c = self.cache
        view = c.layer_view(layer)
        hot, fmt = view.hot_rows, view.row_format
        # everything the backend would refuse, before the resolve changes the cache
        check_decode_call(self.backend, q, sm_scale, device=hot.device, row_format=fmt, supported=self._supported)
        T, H = q.shape[0], q.shape[1]
        if isinstance(topk, torch.Tensor) and topk.dim() == 2 and topk.shape[0] != T:
            raise ValueError(f"topk has {topk.shape[0]} rows but q has T={T} tokens")
        if self.overlap is Overlap.SERIAL:
            res = c.resolve(layer, req_ids, topk, validate=self.validate)
            return self.backend.decode(q, hot, res.physical, sm_scale=sm_scale, row_format=fmt)
        if self.overlap is Overlap.SPLIT:
            plan = self._plan(MissMode.SPLIT, T, H, fmt)
            sp = c.resolve_split(layer, req_ids, topk, validate=self.validate)
            out, lse = self.backend.decode(q, hot, sp.hit_physical, sm_scale=sm_scale, row_format=fmt)
            sp.wait()
            miss_attention_merge(q, hot, sp.miss_physical, sp.miss_counts, out, lse, sm_scale=sm_scale,
                                 row_format=fmt, plan=plan, kernels=self.kernels)
            return out, lse
        plan = self._plan(MissMode.FUSED, T, H, fmt)
        part_out, part_lse = self._partial(T, H)
        host = view.host_rows

        def fused(miss_phys, miss_host, miss_counts):  # on the stage stream
            fused_miss_attention(q, host, miss_host, hot, miss_phys, miss_counts, part_out, part_lse,
                                 sm_scale=sm_scale, row_format=fmt, plan=plan, kernels=self.kernels)

        sp = c.resolve_split(layer, req_ids, topk, validate=self.validate, stage_with=fused)
        if c.cuda and not torch.cuda.is_current_stream_capturing():
            q.record_stream(c.stage_stream)  # read on the stage stream
        out, lse = self.backend.decode(q, hot, sp.hit_physical, sm_scale=sm_scale, row_format=fmt)
        sp.wait()
        merge_lse(out, lse, part_out, part_lse, kernels=self.kernels)
        return out, lse

    def prefetch(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> None:
        """Stage ``topk`` (int32 [T, K], a predicted selection) into ``layer`` ahead of
        its resolve (``HiSparseCache.prefetch``)."""
        self.cache.prefetch(layer, req_ids, topk)


__all__ = ["DecodeLayer", "Overlap"]
