"""``HiSparseCache``: the public runtime of the tiered cache, a small coordinator.

Its parts (notation in ``hisparse.cache.state``):
  pool      ``HostPool``: pinned uint8 [L, H, row_bytes] + block allocator (cold tier)
  hot       uint8 [L, device_rows_per_layer, row_bytes] on the device: the hot buffers
            (R * (S + 1) rows, rounded up to 64), then the elastic pool's pages
  dpool     ``DevicePool``: pages and residency of the elastic tier (``device_pool``)
  state     ``HotState``: slot maps, exact-LRU stamps, block table, device counters
  requests  ``RequestTable``: live ids, per-layer lengths, reserved occupants (host side)
  writer    ``Writer``: the one write path (plan then commit; ``cache.write``)
  stager    ``Stager``: resolve + miss staging on the stage stream (``cache.stager``)

Every call except ``resolve`` decides from host-side mirrors, without reading device
memory; resolve's checked mode reads its inputs once (a host sync), its unchecked mode
never does. A call either completes or raises before it changes anything.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from .._checks import Kernels
from ..config import HiSparseConfig
from ..device import resolve_device
from ..formats import RowFormat
from ..staging.view import BlockTable, LayerView
from . import lifecycle
from . import validate as V
from .device_pool import DevicePool
from .host_pool import HostPool, check_pool
from .kernel_set import cache_kernels
from .prefix import PrefixCache
from .requests import RequestTable
from .resolve_launch import check_state
from .graphs import CacheGraphs
from .results import PoolUsage, RequestInfo, ResolveResult, SplitResult
from .stager import CacheStreams, CopyShape, Stager
from .state import HotState, ResolveBuffers
from .stats import cache_stats
from .write import WriteBatch, Writer
from .write_step import StepCapacity, StepPlan


def _split_buffers(memo: dict, cfg: HiSparseConfig, device: torch.device, layer: int, T: int,
                   K: int) -> tuple[torch.Tensor, tuple]:
    """int32 [T, K] hit rows and the (miss rows, miss row keys, counts) lists of a
    layer's split resolves (allocated into ``memo`` on the layer's first split resolve)."""
    bufs = memo.get(layer)
    if bufs is None:
        Tm, Km = cfg.max_tokens, cfg.top_k
        i32 = dict(dtype=torch.int32, device=device)
        bufs = memo[layer] = (torch.empty((Tm * Km,), **i32), torch.empty((Tm * Km,), **i32),
                              torch.empty((Tm * Km,), **i32), torch.empty((Tm,), **i32))
    hit, mp, mh, mc = bufs
    n = T * K
    return hit[:n].view(T, K), (mp[:n].view(T, K), mh[:n].view(T, K), mc[:T])


class HiSparseCache:
    """Tiered KV cache: pinned host pool + per-(layer, request) GPU hot buffers.

    ``kernels``: "auto" (Triton on CUDA, torch references on CPU), "torch", or
    "triton" (on CPU only under ``TRITON_INTERPRET=1``; otherwise a ValueError here).
    ``pin``: pin the host pool (default: when CUDA is available). ``host_pool``: a pool
    built elsewhere (e.g. ``SharedHostPool``) for the same config.

    Attributes besides the methods: ``pool`` (the ``HostPool``: a request's row keys and
    host rows, its block allocator), ``graphs`` (``CacheGraphs``: CUDA graphs as a mode
    of the calls), ``streams`` (``CacheStreams``: the waits an engine orders its streams
    with) and ``kernel_set`` (the torch or Triton kernels the calls launch). ``state``
    (``HotState``) and ``hot`` (uint8 [L, device rows, row_bytes]) are the kernel level's
    view of the hot tier, for benchmarks and checks that drive a launcher on its own
    (``hisparse.cache`` exports that level); an engine reads them through ``layer_view``,
    ``request`` and ``stats``. The rest is internal.
    """

    def __init__(self, cfg: HiSparseConfig, *, kernels: Kernels | str = "auto",
                 pin: bool | None = None, host_pool: HostPool | None = None) -> None:
        if not isinstance(cfg, HiSparseConfig):
            raise TypeError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        choice = Kernels.parse(kernels).pick(self.device)
        self.kernels = choice.value
        check_pool(host_pool, cfg)
        V.check_device_memory(cfg, self.device)
        L = cfg.num_layers
        self.pool = host_pool if host_pool is not None else HostPool(cfg, pin=pin)
        if cfg.prefix_caching and self.pool.shared:
            raise ValueError("prefix_caching with a host pool shared by several processes is not supported")
        # prefix caching (hisparse.cache.prefix): block names, the index, eviction; None when off
        self.prefix = PrefixCache(cfg, self.pool.allocator) if cfg.prefix_caching else None
        self.state = HotState.allocate(cfg, self.device)
        if choice is Kernels.TRITON:
            check_state(self.state)  # once: the per-call launches rely on it
        # the launches, torch references or Triton (hisparse.cache.kernel_set)
        self.kernel_set = cache_kernels(choice, self.device, self.pool)
        # uint8 [L, device_rows_per_layer, row_bytes]; hot[l] is what physical indices index
        self.hot = torch.zeros((L, cfg.device_rows_per_layer, cfg.row_bytes), dtype=torch.uint8,
                               device=self.device)
        self.dpool = DevicePool(cfg)
        self.requests = RequestTable(num_layers=L, max_num_reqs=cfg.max_num_reqs,
                                     max_request_id=cfg.max_request_id)
        self.streams = CacheStreams(self.device, L)
        self.cuda = self.streams.cuda
        self.writer = Writer(cfg, requests=self.requests, pool=self.pool, state=self.state, hot=self.hot,
                             streams=self.streams, kernel_set=self.kernel_set,
                             device=self.device, device_pool=self.dpool)
        self.stager = Stager(self.streams, self.state, self.kernel_set, max_query_len=cfg.max_query_len)
        T, K = cfg.max_tokens, cfg.top_k
        self._prefetch_out = ResolveBuffers.allocate(T, K, self.device)  # its undo log serves all
        self._bufs = [ResolveBuffers.allocate(T, K, self.device, undo_of=self._prefetch_out) for _ in range(L)]
        self.writer.last_selection = [b.physical[:0].view(-1) for b in self._bufs]
        self._shapes: dict[int, dict[int, int]] = {}  # layer -> {T: K} of its resolves (graphs.note_replay)
        self._views: dict[int, LayerView] = {}
        self._hot_l = self.writer.hot_layers  # uint8 [N, row_bytes] per layer (views, made once)
        self._host_l = self.writer.host_layers  # uint8 [H, row_bytes] per layer
        self._split: dict[int, tuple] = {}  # layer -> (hit, miss lists), made on first use
        # called as fn(req_id, slot, blocks) at the end of each free_request (hisparse.pd's
        # receiver: a reserved request freed here has its reservation closed); must not raise
        self.free_listeners: list[Callable[[int, int, list[int]], None]] = []
        # graph capture and replay of the calls (hisparse.cache.graphs)
        self.graphs = CacheGraphs(self)

    # ---- small queries ----------------------------------------------------
    def live_requests(self) -> list[int]:
        """The live request ids, ascending."""
        return self.requests.live_ids()

    def request(self, req_id: int, step: StepPlan | None = None) -> RequestInfo:
        """A live request's slot and rows per layer (ValueError for an id that is not
        live). ``step``: a prepared step of this cache; a layer it has not written yet
        counts as it was before the step (what a forward's earlier layers see)."""
        r = self.requests.slot(req_id)
        if step is None:
            return RequestInfo(r, tuple(self.requests.lengths(r)))
        return RequestInfo(r, tuple(self.writer.visible(step, req_id, r)[0]))

    def batch_lengths(self, req_ids: Sequence[int],
                      step: StepPlan | None) -> tuple[list[int | None], np.ndarray, np.ndarray]:
        """``request(..., step)`` of a batch, summed up: (the request slot of each id,
        None for an id that is not live; same bool [n]: whether the request holds the
        same rows in every layer; len0 int64 [n]: those rows, meaningful where ``same``
        and live). Ids are not checked. Array operations over the batch, whatever the
        number of layers."""
        slots = self.requests.slots_of(req_ids)
        live = np.array([0 if s is None else s for s in slots], dtype=np.int64) if None in slots else tuple(slots)
        same, len0, _ = self.writer.visible_summary(step, req_ids, live)
        return slots, same, len0

    def residency(self, req_id: int) -> str:
        """"resident" (the whole context in device pages, no misses) or "hot" (an LRU
        hot buffer) for a live request (the elastic tier, ``cfg.device_pool_rows``)."""
        return "resident" if self.dpool.is_resident(self.requests.slot(req_id)) else "hot"

    def pool_usage(self) -> PoolUsage:
        """The elastic tier's occupancy from host-side bookkeeping (no device sync):
        resident and hot live requests, free and total pages of the pool
        (``DEVICE_PAGE_ROWS`` rows each, the same pages in every layer; 0 without a pool).
        A step whose writes need at most ``pages_free`` new pages demotes no request."""
        d = self.dpool
        n = len(self.requests)
        resident = d.num_resident if d.enabled else 0
        return PoolUsage(resident, n - resident, d.num_free if d.enabled else 0,
                         d.num_pages if d.enabled else 0)

    @property
    def stage_programs(self) -> int | None:
        """The staging copy kernel's grid (None: a quarter of the SMs, or the split
        resolve's ``copy_shape``); settable (checked here, not part-way through a resolve).
        Part of a per-layer graph's key: a new value captures again."""
        return self.stager.stage_programs

    @stage_programs.setter
    def stage_programs(self, programs: int | None) -> None:
        self.stager.stage_programs = programs

    def hot_rows(self, layer: int) -> torch.Tensor:
        """uint8 [cfg.device_rows_per_layer, row_bytes]: the flat view physical indices
        point into (hot buffers, then the pool's pages)."""
        V.check_layer(self.cfg, layer)
        return self.hot[layer]

    def layer_view(self, layer: int) -> LayerView:
        """The frozen view staging and conversion read (``hisparse.staging``); its tensors
        are views of the cache's own buffers, valid for the cache's lifetime. With the
        elastic tier (``cfg.device_pool_rows``) it carries the residency flags and the
        device page table, so staging reads a resident request's rows from its pages
        (device to device) instead of the host pool; without one it carries neither.
        With prefix-cache aliases (``cfg.prefix_alias_blocks``) it carries the block-id
        map ``host_block``, so staging reads an alias's rows from the cached host block."""
        V.check_layer(self.cfg, layer)
        view = self._views.get(layer)
        if view is None:
            cfg = self.cfg
            fmt = {f.row_bytes: f for f in RowFormat}.get(cfg.row_bytes)
            if fmt is None:
                raise ValueError(f"row_bytes={cfg.row_bytes} is not a row format staging knows "
                                 f"({[f.value for f in RowFormat]})")
            blocks = BlockTable(self.state.block_table, cfg.host_block_size, seq_lens=self.state.seq_lens[layer])
            st = self.state
            pool = (dict(resident=st.resident, page_table=st.page_table, pool_base=st.pool_base, page_rows=st.PB)
                    if self.dpool.enabled else {})
            view = LayerView(host_rows=self.pool.rows[layer], blocks=blocks, row_format=fmt,
                             hot_rows=self.hot[layer], row_slot=st.row_slot[layer],
                             slots_per_req=cfg.slots_per_req, slot_pos=st.slot_pos[layer],
                             host_block=st.host_block if cfg.prefix_alias_blocks else None, **pool)
            self._views[layer] = view
        return view

    # ---- lifecycle --------------------------------------------------------
    def add_request(self, req_id: int, token_ids=None, salt: bytes | None = None) -> int:
        """Admit ``req_id`` (CapacityError when every request slot is taken). With
        ``token_ids`` (its prompt, ints; the cache must have ``prefix_caching``): map the
        longest run of cached whole blocks that prefix it and return their tokens (a
        multiple of ``host_block_size``, at most ``len(token_ids) - 1``); those positions
        read as appended in every layer and the request appends from there (it starts
        hot). ``salt``: bytes that key whatever else changes the KV (model, adapter).
        Returns 0 without ``token_ids``. Nothing changes when it raises."""
        return lifecycle.admit(self, req_id, token_ids, salt)

    def add_tokens(self, req_id: int, token_ids) -> int:
        """Tell the prefix cache the next tokens of a live request (its decode output, a
        next turn's prompt) so that its blocks become findable once their rows are
        written in every layer; returns the request's tokens known now."""
        if self.prefix is None:
            raise ValueError("add_tokens needs a cache configured with prefix_caching=True")
        return self.prefix.add_tokens(self.requests.slot(req_id), token_ids)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no live request references; returns how many
        (0 without prefix caching)."""
        if self.prefix is None:
            return 0
        self.streams.join_staging()
        return self.prefix.reset()

    def free_request(self, req_id: int) -> None:
        """Return every block (a cached block stays cached; the request's own blocks
        whose rows every layer holds are published first), clear every slot mapping of
        every layer, release the id, then call each of ``free_listeners``."""
        r = self.requests.slot(req_id)
        freed = lifecycle.release(self, req_id)
        for fn in self.free_listeners:
            fn(req_id, r, freed)

    # ---- write path -------------------------------------------------------
    def plan_write(self, req_ids, counts) -> WriteBatch:
        """Check a batch of appends once (distinct live ids, a row count each); the
        returned batch serves :meth:`write` of every layer until requests change, in
        this cache only (another refuses it)."""
        return self.writer.prepare(req_ids, counts)

    def write(self, layer: int, batch: WriteBatch | int, rows: torch.Tensor) -> list[int]:
        """Append rows to ``layer``: ``batch``'s (a ``plan_write`` result; rows uint8
        [batch.total, row_bytes]), or, given one live request id, ``rows`` (uint8 [n,
        row_bytes]) to that request (a batch of one). Rows on the cache device, any
        strides. Returns the first position written per request. CapacityError (nothing
        changed) when the host pool can't supply the blocks."""
        V.check_layer(self.cfg, layer)
        if isinstance(batch, int) and not isinstance(batch, bool):
            n = int(rows.shape[0]) if isinstance(rows, torch.Tensor) and rows.dim() == 2 else 0
            batch = self.writer.prepare([batch], [n])
        return self.writer.write(layer, batch, rows)

    def prepare_step(self, batch: WriteBatch, *, capacity: StepCapacity | None = None,
                     replaces: StepPlan | None = None, host_written: bool = False,
                     ends: Sequence[int] | None = None) -> StepPlan:
        """Plan ``batch``'s append to every layer at once (an engine's forward); then
        :meth:`write_step` per layer only launches. ``capacity``: fixed-shape lists in
        a bucket's persistent buffers (CUDA graphs). ``ends``: the rows each request must
        hold after the step (ValueError otherwise). ``host_written``: the rows are in the
        host pool already (``hisparse.cache.write_pooled``). The step serves this cache
        only (another refuses it). See ``Writer.prepare_step``."""
        return self.writer.prepare_step(batch, capacity=capacity, replaces=replaces, host_written=host_written,
                                        ends=ends)

    def write_step(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """Write ``layer``'s rows of a prepared step (uint8 [step.rows, row_bytes])."""
        V.check_layer(self.cfg, layer)
        self.writer.write_step(layer, step, rows)

    # ---- resolve + staging --------------------------------------------------
    def resolve(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, *,
                validate: bool = True, wait: bool = True, compact: bool = False, split: bool = False,
                copy_shape: CopyShape | None = None) -> ResolveResult:
        """Map logical top-k positions to rows of ``hot_rows(layer)``, staging misses.

        req_ids: int32 [T] request id per query token (a request's tokens contiguous,
        at most max_query_len of them; int64 is accepted in checked mode only);
        topk: int32 [T, K] positions, -1 = padding. ``validate`` checks contents (host
        sync) and raises before any launch; unchecked, invalid entries become -1 and are
        counted. ``wait``: the current stream waits for staging before returning (else
        ``result.wait``). ``compact``: valid entries of each row moved to its front.

        ``split``: resolve in two phases, so that attention over the hits need not wait
        for the misses; returns a ``SplitResult`` once the hit phase is enqueued on the
        current stream (``result.hit_physical`` may be attended right away); the miss
        phase and the staging run on the stage stream and record ``result.event``, which
        the current stream must wait on before it reads ``result.miss_physical`` rows
        (``wait`` does not apply). The state after the call equals the one-phase call's
        bit for bit. ``copy_shape``: the split staging kernel's grid (``stager.CopyShape``;
        None: a quarter of the SMs, 8 rows a program; ``stage_programs`` overrides its
        programs).

        CUDA graphs: capture ``resolve(..., validate=False)`` with the Triton kernels,
        after one eager call compiled them; replay on the compute stream, and call
        ``streams.join_backup`` before a replay that follows eager appends. An engine
        that captures one call at a time plans it through ``graphs`` (``hisparse.cache.graphs``).

        While every live request is resident (``graphs.all_resident``), an eager call
        takes the resident path (``graphs.resident_resolve``: one launch on the current
        stream, no staging; ``result.event`` None with ``wait``); a capture takes it only
        inside ``graphs.resident_capture``.
        """
        if not split and copy_shape is not None:
            raise ValueError("copy_shape is the split resolve's staging grid: pass split=True")
        T, K, req_ids = self._check_resolve(layer, req_ids, topk, validate)
        out = self._out(layer, T, K)
        if split:
            hit, miss_lists = _split_buffers(self._split, self.cfg, self.device, layer, T, K)
            event = self.stager.run_split(layer, req_ids, topk, out, hit, miss_lists,
                                          host_rows=self._host_l[layer], hot_rows=self._hot_l[layer],
                                          compact=compact, copy_shape=copy_shape)
            self.requests.touch(layer)
            return SplitResult(out, hit, miss_lists, event, self.requests.epochs, layer)
        if self.graphs.resident_resolve():
            event = self.stager.run_resident(layer, req_ids, topk, out, compact=compact, wait=wait)
        else:
            event = self.stager.run(layer, req_ids, topk, out, host_rows=self._host_l[layer],
                                    hot_rows=self._hot_l[layer], compact=compact, wait=wait)
        self.requests.touch(layer)
        return ResolveResult(out, event, self.requests.epochs, layer)

    def _out(self, layer: int, T: int, K: int) -> ResolveBuffers:
        """Layer ``layer``'s resolve buffers as [T, K]; their physical rows are what a
        demotion seeds first (``Writer.last_selection``)."""
        out = self._bufs[layer].view(T, K)
        if self.dpool.enabled:  # only a pool demotes: no host time otherwise
            self.writer.last_selection[layer] = out.physical.view(-1)
            self._shapes.setdefault(layer, {})[T] = K  # a graph captured now resolves [T, K] when replayed
        return out

    def prefetch(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> ResolveBuffers:
        """Stage a *predicted* selection of ``layer`` (e.g. the previous layer's top-k)
        on the stage stream, ahead of the layer's real resolve, which waits on it.

        Predicted rows become hot like a resolve's; positions the layer does not hold
        yet are skipped; only the staged rows are counted (``prefetch_rows``). Unchecked
        (``validate=False``) semantics: graph capturable. Returns the prefetch's
        ``ResolveBuffers``: its staging lists (the host rows it staged in ``stage_src``,
        their slots in ``stage_dst``, ``stage_counts`` per group) are written on the
        stage stream and valid until the next prefetch; its undo log is shared with
        every layer's resolves.
        """
        T, K, req_ids = self._check_resolve(layer, req_ids, topk, False)  # K <= top_k among its checks
        out = self._prefetch_out.view(T, K)
        self.stager.run_prefetch(layer, req_ids, topk, out, host_rows=self._host_l[layer],
                                 hot_rows=self._hot_l[layer])
        self.requests.touch(layer)
        return out

    def _check_resolve(self, layer: int, req_ids, topk, validate: bool):
        T, K, req_ids = self._check_resolve_args(layer, req_ids, topk, validate)
        self._runtime_checks(layer)
        return T, K, req_ids

    def _check_resolve_args(self, layer: int, req_ids, topk, validate: bool):
        """A resolve's argument checks (the layer, the tensors' metadata, with ``validate``
        their contents): ``_check_resolve`` less the runtime checks, for a planned call
        whose ``run`` makes those (``graphs.ResolveCall``)."""
        V.check_layer(self.cfg, layer)
        T, K = V.check_resolve_meta(self.cfg, self.device, req_ids, topk, self.cfg.max_tokens)
        if validate:
            req = self.requests
            V.check_resolve_contents(self.cfg, req_ids, topk, req.slot_map(), lambda r: req.length(r, layer))
            if req_ids.dtype != torch.int32:  # checked above: every id is live
                req_ids = req_ids.to(torch.int32)
        elif req_ids.dtype != torch.int32:
            raise TypeError("an unchecked resolve (validate=False) takes int32 req_ids: the hot path "
                            f"neither converts nor allocates; got {req_ids.dtype}")
        return T, K, req_ids

    def _runtime_checks(self, layer: int) -> None:
        """What a resolve checks at every call, planned or not: the host pool's pinning
        (staging reads it over UVA: refused before any launch) and, for a pool shared by
        several processes, that the writer rank's rows of ``layer`` are on host."""
        self.kernel_set.check_pinned("the host pool")
        if self.pool.shared and not self.streams.capturing():
            self.pool.wait_visible(layer)

    # ---- reads and metrics ------------------------------------------------------
    def read_host_rows(self, layer: int, req_id: int, positions) -> torch.Tensor:
        """uint8 [n, row_bytes] CPU copy of the host-pool rows of ``positions``.

        Waits for pending host mirror copies first (a host sync on GPU)."""
        V.check_layer(self.cfg, layer)
        r = self.requests.slot(req_id)
        pos = V.check_positions(positions, self.requests.length(r, layer))
        self.streams.backup.synchronize()
        self.pool.wait_visible(layer)
        return self.pool.rows[layer].index_select(0, self.pool.host_rows(r, pos))

    def stats(self) -> dict[str, Any]:
        """Counters per layer and in total, host pool usage, live requests (host sync)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.prefix is not None:
            self.prefix.publish(self.requests, self.writer.unwritten_from())
        return cache_stats(self.state, self.pool, row_bytes=self.cfg.row_bytes,
                           num_layers=self.cfg.num_layers, live_requests=len(self.requests),
                           kernels=self.kernels, device_pool=self.dpool,
                           slots_per_req=self.cfg.slots_per_req, prefix=self.prefix)


__all__ = ["HiSparseCache", "ResolveResult"]
