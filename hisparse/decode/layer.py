"""One sparse-MLA decode layer over a hisparse cache, with the miss staging hidden.

Notation: T query tokens, H heads, K top-k entries per token (see ``cache.state``).

Modes (``Overlap``):
  serial  resolve + stage the misses, then one attention over every entry (the compute
          stream waits for the staging first)
  split   the hit phase of the resolve, then attention over the hits *while* the miss
          phase and the staging copy run on the stage stream; then attention over the
          misses, merged into the hit result by LSE (``attention.miss``). When the hit
          attention has more programs than one wave of SMs, it starts after the miss
          phase instead (``split_waits_for_misses``), beside the copy

  auto    per (layer, T), whichever of the two its own GPU timings say is faster
          (``decode.auto``: the rule, what it costs, what a capture keeps); the default

Both leave the cache in the same state, bit for bit, and return the same attention
(split within the rounding of one merge of bf16 partials). When the cache's resolve
takes its resident path (every live request resident in the elastic tier:
``CacheGraphs.resident_resolve``), nothing can miss and both modes run the same
work on the current stream: one attention that maps the top-k through the page table
itself (``cache.paged_resolve.resolve_paged``, a backend with ``paged_problem``: Triton;
``begin`` then launches nothing and ``finish`` runs that attention), or the resident
resolve and then the attention (other backends, ``fuse_lookup=False``). The
hit attention runs on any backend (``attention.base.SparseMLABackend``: Triton,
FlashMLA, FlashInfer, the reference); the miss side runs our Triton kernels (their
torch references on CPU). Graph capturable with ``validate=False``: fixed shapes, no
host sync; plans (scratch buffers) are made once per (mode, T, H).

Prefetch: ``DecodeLayer.prefetch(layer, req_ids, topk)`` stages a layer's predicted
selection (typically the previous layer's top-k) on the stage stream so that its real
resolve finds those rows hot.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._checks import check_bool, check_int, sm_count
from ..attention.base import Phase, SparseMLABackend, check_decode_call
from ..attention.miss import MissConfig, MissMode, MissPlan, miss_attention_merge, plan_miss_attention
from ..cache.cache import HiSparseCache
from ..cache.results import ResolveResult, SplitResult
from ..cache import CopyShape
from ..cache.paged_resolve import resolve_paged
from ..formats import RowFormat
from ..device import capturing
from .auto import ModeChooser
from .graphs import MAX_GRAPHS, DecodeGraphs
from .overlap import Overlap


# A split layer's staging copy when the hit attention would fill every SM (its one wave,
# or more than one): 8 programs of 32 rows (8 warps) keep as many rows in flight as the
# default's quarter of the SMs at 8 rows each, so they stage as fast, and the hit
# attention plans its waves for the other SMs (BENCHMARKS.md, "One decode layer in a CUDA graph").
SPLIT_COPY = CopyShape(programs=8, rows=32, warps=8)
SPLIT_FREE_SMS = 4  # an attention leaving at least this many SMs free leaves the copy room
HEADS_PER_PROGRAM = 64  # heads per unit of a persistent-grid attention's work (FlashMLA's 64-head tiles)


def split_fills_sms(programs: int | None, sms: int) -> bool:
    """Whether a hit attention of ``programs`` programs, each needing a whole SM, leaves
    fewer than ``SPLIT_FREE_SMS`` of ``sms`` SMs to the staging copy in its last wave
    while fitting in one (None: a backend that does not say, e.g. a persistent grid)."""
    return programs is not None and sms - SPLIT_FREE_SMS < programs <= sms


def split_waits_for_misses(programs: int, sms: int) -> bool:
    """Whether a split layer's hit attention of ``programs`` programs, each needing a
    whole SM, should start only once the miss phase is done, after the staging copy's
    launch. Past one wave it should: launched beside the miss phase, its programs
    queued behind the first wave would take every SM that frees up before the copy,
    launched after the miss phase, got one, so the copy would run mostly after the
    attention, and slower than alone (BENCHMARKS.md, "Measured slower and removed")."""
    return programs > sms


class DeferredLookup:
    """What ``DecodeLayer.begin`` keeps instead of resolving on the resident path when the
    backend maps the top-k itself: the call's layer, request ids and top-k, attended
    (and mapped) in ``finish``. Stale, as a resolve's result, once the layer is
    appended to, resolved (a later begin, or this launch's own finish) or freed."""

    __slots__ = ("layer", "req_ids", "topk", "tokens", "_epochs", "_epoch")

    def __init__(self, cache: HiSparseCache, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> None:
        self.layer, self.req_ids, self.topk, self.tokens = layer, req_ids, topk, topk.shape[0]
        self._epochs = cache.requests.epochs
        self._epoch = self._epochs[layer]

    @property
    def stale(self) -> bool:
        return self._epochs[self.layer] != self._epoch


@dataclasses.dataclass(frozen=True)
class SplitLaunch:
    """What ``DecodeLayer.begin`` launched: the split resolve (or, on the cache's resident
    path, the whole resolve), the cache it resolved (no layer over another cache
    finishes it), the heads its query has, the SMs its hit attention plans for (None:
    all) and whether that attention waits for the miss phase (``split_waits_for_misses``)."""

    # a ResolveResult: the resident path (one attention, no miss side); a DeferredLookup:
    # the resident path of a backend that maps the top-k in its attention (in finish)
    result: SplitResult | ResolveResult | DeferredLookup
    cache: HiSparseCache = dataclasses.field(repr=False, compare=False)
    num_heads: int
    sms: int | None
    after_miss_phase: bool = False


class DecodeLayer:
    """Decode attention of a cache's layers in one overlap mode, with one backend.

    ``backend`` attends over the hits (and, serially, over everything); ``kernels``
    picks the miss-side implementation ("auto": Triton on CUDA, torch on CPU). To
    capture a layer in a CUDA graph, give a backend that does not read the device to
    check its inputs (``TritonBackend(validate=False)``, ``FlashMLABackend(check_ranges=False)``).
    ``graphs=True`` (a CUDA cache, ``validate=False``): calls replay a graph of the whole
    layer call per (layer, shape), at most ``max_graphs`` of them (``decode.graphs``).
    ``fuse_lookup``: on the resident path, a backend that can (``paged_problem``) maps the
    top-k itself instead of a resident resolve kernel in front of it (False: the two
    launches, as for other backends).
    """

    def __init__(self, cache: HiSparseCache, backend: SparseMLABackend, *,
                 overlap: Overlap | str = Overlap.AUTO, validate: bool = False,
                 kernels: str = "auto", miss_config: MissConfig | None = None,
                 graphs: bool = False, max_graphs: int = MAX_GRAPHS, fuse_lookup: bool = True) -> None:
        if not isinstance(cache, HiSparseCache):
            raise TypeError(f"cache must be a HiSparseCache, got {type(cache).__name__}")
        if not isinstance(backend, SparseMLABackend):
            raise TypeError(f"backend must be a SparseMLABackend, got {type(backend).__name__}")
        check_bool("graphs", graphs)
        check_int("max_graphs", max_graphs, 1)
        if graphs and (validate or not cache.cuda):
            raise ValueError("graphs=True replays CUDA graphs of unchecked calls: it needs a CUDA cache and "
                             "validate=False" + ("" if cache.cuda else f" (the cache is on {cache.device})"))
        self.cache = cache
        self.backend = backend
        self.overlap = Overlap.parse(overlap)
        self.validate = check_bool("validate", validate)
        self.kernels = kernels
        self.miss_config = miss_config  # launch shape of the miss kernels (None: their default)
        self._plans: dict[tuple, MissPlan] = {}
        self._supported: set = set()  # (device, row format, heads) the backend accepted
        self.graphs = DecodeGraphs(cache, max_graphs=max_graphs) if graphs else None
        self.fuse_lookup = check_bool("fuse_lookup", fuse_lookup)
        self._paged: dict = {}  # (layer, T, H, K) -> whether the backend maps the resident top-k itself
        # auto: a mode's first calls of a key compile, load kernels and (graphs) capture: untimed
        self.chooser = (ModeChooser(cache.device, warm=2 if graphs else 1)
                        if self.overlap is Overlap.AUTO else None)

    def with_backend(self, backend: SparseMLABackend) -> "DecodeLayer":
        """This layer attending with ``backend``: the same cache, mode, checks, kernels
        and miss configuration, sharing this layer's scratch (the miss plans depend on
        the head count, not on the backend), for a caller that gets a new backend object
        per forward."""
        layer = DecodeLayer(self.cache, backend, overlap=self.overlap, validate=self.validate,
                            kernels=self.kernels, miss_config=self.miss_config, fuse_lookup=self.fuse_lookup)
        layer._plans = self._plans
        layer.graphs = self.graphs  # their keys hold the backend: this one's are its own
        layer.chooser = self.chooser  # auto: the timings go on
        return layer

    def _plan(self, mode: MissMode, T: int, H: int, fmt: RowFormat) -> MissPlan:
        key = (mode, H, fmt)
        plan = self._plans.get(key)
        if plan is None or plan.max_tokens < T:
            plan = plan_miss_attention(mode=mode, max_tokens=max(T, self.cache.cfg.max_tokens), num_heads=H,
                                       row_format=fmt, device=self.cache.device, config=self.miss_config)
            self._plans[key] = plan
        return plan

    def __call__(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, q: torch.Tensor, *,
                 sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve ``topk`` (int32 [T, K]) of ``layer`` for ``req_ids`` (int32 [T]) and
        attend ``q`` (bf16 [T, H, 576]) over it. Returns out bf16 [T, H, 512] and lse
        float32 [T, H] (natural log); the current stream may read them when it reaches
        them (every wait is enqueued). With ``graphs=True`` (``decode.graphs``) a call
        of a (layer, shape) seen before replays a graph of the call, and returns that
        graph's output buffers: read them before the next call of that layer and shape."""
        cap = capturing(self.cache.device)
        if self.chooser is None:
            return self._call(layer, req_ids, topk, q, sm_scale, self.overlap, cap)
        if self.cache.graphs.resident_resolve():  # both modes run the same work: nothing to choose
            return self._call(layer, req_ids, topk, q, sm_scale, Overlap.SERIAL, cap)
        T = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() >= 1 else -1
        g = self.graphs
        work = g.one_off_work() if g is not None else None
        return self.chooser.run(layer, T, lambda mode: self._call(layer, req_ids, topk, q, sm_scale, mode, cap),
                                capturing=cap, steady=None if g is None else (lambda: g.one_off_work() == work))

    def auto_report(self) -> dict:
        """An auto layer's choices and timings per "layer/T" (``ModeChooser.report``);
        {} for a layer of a fixed mode."""
        return self.chooser.report() if self.chooser is not None else {}

    def _call(self, layer: int, req_ids, topk, q, sm_scale, mode: Overlap, cap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None and not cap:
            return self.graphs(self, layer, req_ids, topk, q, sm_scale, mode)
        return self._eager(layer, req_ids, topk, q, sm_scale, mode)

    def _eager(self, layer: int, req_ids, topk, q, sm_scale, mode: Overlap) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        view = c.layer_view(layer)
        hot, fmt = view.hot_rows, view.row_format
        # everything the backend would refuse, before the resolve changes the cache
        check_decode_call(self.backend, q, sm_scale, device=hot.device, row_format=fmt, supported=self._supported)
        T, H = q.shape[0], q.shape[1]
        if isinstance(topk, torch.Tensor) and topk.dim() == 2 and topk.shape[0] != T:
            raise ValueError(f"topk has {topk.shape[0]} rows but q has T={T} tokens")
        resident = c.graphs.resident_resolve()
        if mode is Overlap.SERIAL or resident:
            return self._resolve_attend(layer, req_ids, topk, q, hot, fmt, sm_scale,
                                        paged=resident and self._fuses(layer, topk, hot, H, fmt))
        return self._finish_split(self._begin_split(layer, req_ids, topk, H), q, sm_scale)

    def _resolve_attend(self, layer: int, req_ids, topk, q: torch.Tensor, hot: torch.Tensor, fmt: RowFormat,
                        sm_scale: float, *, paged: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The resolve, then one attention over every entry of the layer's rows ``hot``;
        ``paged``: the resident resolve folded into the attention (``resolve_paged``)."""
        c = self.cache
        if paged:
            return resolve_paged(c, layer, req_ids, topk, lambda tables: self.backend.decode(
                q, hot, topk, sm_scale=sm_scale, row_format=fmt, paged=tables), validate=self.validate)
        res = c.resolve(layer, req_ids, topk, validate=self.validate)
        return self.backend.decode(q, hot, res.physical, sm_scale=sm_scale, row_format=fmt)

    def _fuses(self, layer: int, topk, hot: torch.Tensor, H: int, fmt: RowFormat) -> bool:
        """Whether the resident path of this call maps the top-k in the attention of H
        heads (``fuse_lookup`` and a backend whose ``paged_problem`` is None for the shape)."""
        problem = getattr(self.backend, "paged_problem", None)
        if not self.fuse_lookup or problem is None or not isinstance(topk, torch.Tensor) or topk.dim() != 2:
            return False
        T, K = topk.shape[0], topk.shape[1]
        key = (layer, T, H, K)
        ok = self._paged.get(key)
        if ok is None:
            ok = self._paged[key] = problem(T, H, K, device=hot.device, row_format=fmt, kv_rows=hot) is None
        return ok

    def begin(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, *, num_heads: int) -> SplitLaunch:
        """The first half of a split layer, for an engine that has the top-k before the
        query: resolve ``topk`` (int32 [T, K]) of ``layer`` for ``req_ids`` (int32 [T])
        now -- the hit phase on the current stream, the miss phase and the staging on the
        stage stream -- so that they run beside the query projection. ``finish`` attends
        a query of ``num_heads`` heads. Split and auto layers (an auto layer's begun
        call is split, untimed). A head count the backend refuses is refused here,
        before the resolve (``finish`` could never attend it). On the resident path with
        a backend that maps the top-k itself (``fuse_lookup``), ``begin`` checks the call
        and launches nothing: ``finish``'s attention maps ``topk``, which must stay as it
        is until then (as the stage stream's reads of it require anyway)."""
        if self.overlap is Overlap.SERIAL:
            raise ValueError("begin/finish are the two halves of a split layer; this layer is serial")
        check_int("num_heads", num_heads, 1)
        if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
            raise ValueError("topk must be an int32 [T, K] tensor")  # the resolve checks the rest
        if self.graphs is not None and self.graphs.is_input_buffer(topk):
            raise ValueError("begin() reads its top-k on the staging stream after it returns, and the layer "
                             "graphs' input buffer is overwritten by the next call: pass a tensor of your own")
        view = self.cache.layer_view(layer)
        self._check_supported(view.hot_rows.device, view.row_format, num_heads)
        return self._begin_split(layer, req_ids, topk, num_heads)

    def _check_supported(self, device: torch.device, fmt: RowFormat, H: int) -> None:
        """Whether the backend runs a decode of H heads over ``fmt`` rows on ``device``:
        the question ``check_decode_call`` asks in ``finish``, for a query not made yet
        (ValueError with the backend's reason; accepted ones are noted in the same set)."""
        key = (device, fmt, H)
        if key in self._supported:
            return
        reason = self.backend.supports(device=device, row_format=fmt, num_heads=H, phase=Phase.DECODE)
        if reason is not None:
            raise ValueError(f"{self.backend.name} backend cannot run this decode: {reason}")
        self._supported.add(key)

    def finish(self, launch: SplitLaunch, q: torch.Tensor, *, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The second half: attend ``q`` (bf16 [T, H, 576]) over the hits while the misses
        stage, then over the misses, merged. Returns what ``__call__`` does. ``q`` and
        the launch (begun over this layer's cache, not stale since) are checked before
        anything is launched."""
        if not isinstance(launch, SplitLaunch):
            raise TypeError(f"launch must be the SplitLaunch of begin(), got {type(launch).__name__}")
        if launch.cache is not self.cache:
            raise ValueError("the launch was begun by a DecodeLayer over another cache (its indices point "
                             "into that cache's rows); finish it with a layer over that cache")
        sp = launch.result
        if sp.stale:
            raise ValueError(f"layer {sp.layer} was appended to, resolved or freed since begin(): its "
                             "indices may point at other rows now; begin() again")
        view = self.cache.layer_view(sp.layer)
        check_decode_call(self.backend, q, sm_scale, device=view.hot_rows.device, row_format=view.row_format,
                          supported=self._supported)
        tokens = sp.tokens if isinstance(sp, DeferredLookup) else sp.physical.shape[0]
        if tuple(q.shape[:2]) != (tokens, launch.num_heads):
            raise ValueError(f"q is [T={q.shape[0]}, H={q.shape[1]}, ...] but begin() resolved "
                             f"{tokens} tokens for {launch.num_heads} heads")
        return self._finish_split(launch, q, sm_scale)

    def _launch_plan(self, T: int, H: int, K: int, fmt: RowFormat) -> tuple[CopyShape | None, int | None, bool]:
        """(the staging copy's shape, the SMs the hit attention plans for, whether it
        waits for the miss phase) of a split layer on CUDA:
        - hit attention programs that fill the last SMs of one wave
          (``split_fills_sms``, a backend that plans for given SMs): a copy of few
          programs (``SPLIT_COPY``, or ``stage_programs`` of them) and an attention
          planned for the other SMs;
        - more programs than one wave (``split_waits_for_misses``; for a backend with a
          persistent grid, a program per token and head block of ``HEADS_PER_PROGRAM``):
          the same few-program copy, launched first, and an attention that starts
          after the miss phase (planned for the other SMs where the backend plans);
        - else the copy's default, beside an attention that leaves it SMs, and no plan.
        No plan off CUDA, nor for an attention whose programs share SMs (Triton's
        ``tl`` kernels) or that does not count them (FlashInfer, the reference)."""
        c = self.cache
        if not c.cuda:
            return None, None, False
        sms = sm_count(c.device)
        programs = self.backend.decode_programs(T, H, K, device=c.device, row_format=fmt)
        planned = None  # the SMs left to the attention, for a backend that counted its programs and plans
        if programs is None:
            if not self.backend.persistent_grid:
                return None, None, False
            programs = T * math.ceil(H / HEADS_PER_PROGRAM)
        elif self.backend.plans_sms:
            planned = max(1, sms - (c.stage_programs or SPLIT_COPY.programs))
        if split_waits_for_misses(programs, sms):
            return SPLIT_COPY, planned, True
        if planned is not None and split_fills_sms(programs, sms):
            return SPLIT_COPY, planned, False
        return None, None, False

    def _begin_split(self, layer: int, req_ids, topk, H: int) -> SplitLaunch:
        c = self.cache
        if c.graphs.resident_resolve():  # nothing can miss: the whole resolve, one attention in finish
            view = c.layer_view(layer)
            if self._fuses(layer, topk, view.hot_rows, H, view.row_format):
                # the attention in finish maps the top-k itself: nothing to launch now; the
                # checks run now (a bad top-k is refused here, as the resolve would be), and
                # results held from before are stale from here, as after a resolve
                c._check_resolve(layer, req_ids, topk, self.validate)
                c.requests.touch(layer)
                return SplitLaunch(result=DeferredLookup(c, layer, req_ids, topk), cache=c, num_heads=H, sms=None)
            res = c.resolve(layer, req_ids, topk, validate=self.validate)
            return SplitLaunch(result=res, cache=c, num_heads=H, sms=None)
        T, K = (topk.shape[0], topk.shape[1]) if isinstance(topk, torch.Tensor) and topk.dim() == 2 else (0, 0)
        copy, sms, after = self._launch_plan(T, H, K, self.cache.layer_view(layer).row_format)
        sp = self.cache.resolve(layer, req_ids, topk, validate=self.validate, copy_shape=copy, split=True)
        return SplitLaunch(result=sp, cache=self.cache, num_heads=H, sms=sms, after_miss_phase=after)

    def _finish_split(self, launch: SplitLaunch, q: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Hit attention (planned for ``launch.sms`` SMs where set; after the miss phase
        where ``launch.after_miss_phase``), the wait, the miss attention merged into it."""
        sp = launch.result
        view = self.cache.layer_view(sp.layer)
        hot, fmt = view.hot_rows, view.row_format
        if isinstance(sp, DeferredLookup):  # resident at begin; the layer unchanged since
            # unless a request joined hot since, or this layer's backend maps no top-k
            paged = self.cache.graphs.resident_resolve() and self._fuses(sp.layer, sp.topk, hot, q.shape[1], fmt)
            return self._resolve_attend(sp.layer, sp.req_ids, sp.topk, q, hot, fmt, sm_scale, paged=paged)
        if not isinstance(sp, SplitResult):  # the resident path: every row is on the device already
            return self.backend.decode(q, hot, sp.physical, sm_scale=sm_scale, row_format=fmt)
        plan = self._plan(MissMode.SPLIT, q.shape[0], q.shape[1], fmt)
        kw = {} if launch.sms is None else {"sms": launch.sms}
        if launch.after_miss_phase:
            self.cache.streams.wait_resolved(sp.layer)
        out, lse = self.backend.decode(q, hot, sp.hit_physical, sm_scale=sm_scale, row_format=fmt, **kw)
        sp.wait()
        miss_attention_merge(q, hot, sp.miss_physical, sp.miss_counts, out, lse, sm_scale=sm_scale,
                             row_format=fmt, plan=plan, kernels=self.kernels)
        return out, lse

    def prefetch(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> None:
        """Stage ``topk`` (int32 [T, K], a predicted selection) into ``layer`` ahead of
        its resolve (``HiSparseCache.prefetch``)."""
        self.cache.prefetch(layer, req_ids, topk)


__all__ = ["DecodeLayer", "DeferredLookup", "HEADS_PER_PROGRAM", "Overlap", "SPLIT_COPY", "SplitLaunch", "split_fills_sms",
           "split_waits_for_misses"]
