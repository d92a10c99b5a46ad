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

import contextlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .._checks import Kernels, check_int
from ..config import HiSparseConfig
from ..device import resolve_device
from ..formats import RowFormat
from ..staging.view import BlockTable, LayerView
from . import lifecycle
from . import validate as V
from .device_pool import DevicePool
from .host_pool import HostPool, check_pool
from .kernel_set import kernel_set
from .prefix import PrefixCache
from .requests import RequestTable
from .resolve_triton import check_state
from .results import ResolveResult, SplitResult
from .stager import CacheStreams, CopyShape, Stager, capturing
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
        fns = kernel_set(choice, self.device, self.pool)
        self._pinned_check = fns.pop("pinned_check")
        # uint8 [L, device_rows_per_layer, row_bytes]; hot[l] is what physical indices index
        self.hot = torch.zeros((L, cfg.device_rows_per_layer, cfg.row_bytes), dtype=torch.uint8,
                               device=self.device)
        self.dpool = DevicePool(cfg)
        self.requests = RequestTable(num_layers=L, max_num_reqs=cfg.max_num_reqs,
                                     max_request_id=cfg.max_request_id)
        self.streams = CacheStreams(self.device, L)
        self.cuda = self.streams.cuda
        self.writer = Writer(cfg, requests=self.requests, pool=self.pool, state=self.state, hot=self.hot,
                             streams=self.streams, apply_fn=fns["apply_fn"], mirror_fn=fns["mirror_fn"],
                             device=self.device, device_pool=self.dpool)
        self.stager = Stager(self.streams, self.state, resolve_fn=fns["resolve_fn"], lookup_fn=fns["lookup_fn"],
                             resident_fn=fns["resident_fn"], copy_fn=fns["copy_fn"],
                             max_query_len=cfg.max_query_len)
        self._resident_capture = False  # inside resident_capture()
        T, K = cfg.max_tokens, cfg.top_k
        self._prefetch_out = ResolveBuffers.allocate(T, K, self.device)  # its undo log serves all
        self._bufs = [ResolveBuffers.allocate(T, K, self.device, undo_of=self._prefetch_out) for _ in range(L)]
        self.writer.last_selection = [b.physical[:0].view(-1) for b in self._bufs]
        self._shapes: dict[int, dict[int, int]] = {}  # layer -> {T: K} of its resolves (note_replay)
        self._views: dict[int, LayerView] = {}
        self._hot_l = self.writer.hot_layers  # uint8 [N, row_bytes] per layer (views, made once)
        self._host_l = self.writer.host_layers  # uint8 [H, row_bytes] per layer
        self._split: dict[int, tuple] = {}  # layer -> (hit, miss lists), made on first use
        # called as fn(req_id, slot, blocks) at the end of each free_request (hisparse.pd's
        # receiver: a reserved request freed here has its reservation closed); must not raise
        self.free_listeners: list[Callable[[int, int, list[int]], None]] = []

    # ---- small queries ----------------------------------------------------
    def live_requests(self) -> list[int]:
        return self.requests.live_ids()

    def request_slot(self, req_id: int) -> int:
        """Request slot r of a live id (ValueError otherwise)."""
        return self.requests.slot(req_id)

    def layer_len(self, layer: int, req_id: int) -> int:
        """Rows appended to ``layer`` for the request."""
        V.check_layer(self.cfg, layer)
        return self.requests.length(self.requests.slot(req_id), layer)

    def seq_len(self, req_id: int) -> int:
        """Positions appended to every layer (the min of the layer lengths)."""
        return min(self.requests.lengths(self.requests.slot(req_id)))

    def lengths(self, req_id: int) -> tuple[int, ...]:
        """Rows appended to each layer for the request."""
        return tuple(self.requests.lengths(self.requests.slot(req_id)))

    def residency(self, req_id: int) -> str:
        """"resident" (the whole context in device pages, no misses) or "hot" (an LRU
        hot buffer) for a live request (the elastic tier, ``cfg.device_pool_rows``)."""
        return "resident" if self.dpool.is_resident(self.requests.slot(req_id)) else "hot"

    def all_resident(self) -> bool:
        """Whether every live request is resident (the elastic tier with a pool; no live
        request at all counts too): then no resolve can miss."""
        return self.dpool.enabled and self.dpool.num_resident == len(self.requests)

    def pool_pages_free(self) -> int:
        """Free pages of the elastic pool (``DEVICE_PAGE_ROWS`` rows each, the same pages
        in every layer): a step whose writes need at most this many new pages demotes
        no request."""
        return self.dpool.num_free

    def resident_resolve(self) -> bool:
        """Whether a resolve called now takes the resident path: one launch on the
        current stream, a page-table lookup per entry, no LRU state, no staging copy, no
        stage-stream fork, no event (``kernels.resolve_resident``). It does when every
        live request is resident (``all_resident``), eagerly or, while a stream is being
        captured, inside :meth:`resident_capture` only. Its outputs equal the full
        resolve's (physical rows, valid counts, empty staging lists, counters)."""
        return self.all_resident() and (self._resident_capture or not capturing(self.device))

    @contextlib.contextmanager
    def resident_capture(self) -> Iterator[None]:
        """Resolves captured inside take the resident path (``resident_resolve``); outside
        it a capture takes the full path, which replays correctly whatever the
        residency. A graph captured inside is correct only while ``all_resident()``
        holds: keep one graph of each kind per shape and replay the resident one only
        then (``engine.layer_graphs`` does). Refused (ValueError) when some live request
        is hot now."""
        if not self.all_resident():
            hot = len(self.requests) - self.dpool.num_resident
            raise ValueError(f"resident_capture: {hot} live request(s) are hot"
                             + ("" if self.dpool.enabled else " (no device pool: cfg.device_pool_rows is None)")
                             + "; a resident resolve would give them no rows")
        prev, self._resident_capture = self._resident_capture, True
        try:
            yield
        finally:
            self._resident_capture = prev

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
                             slots_per_req=cfg.slots_per_req,
                             host_block=st.host_block if cfg.prefix_alias_blocks else None, **pool)
            self._views[layer] = view
        return view

    def join_backup(self, stream=None) -> None:
        """``stream`` (default current) waits until every host mirror copy is done; needed
        before replaying a captured resolve after eager appends, or before staging reads
        rows appended in the same step from host."""
        self.streams.join_backup(stream)

    def note_replay(self, tokens: int | None = None) -> None:
        """Call before replaying a graph captured over this cache's calls (host waits then
        cover the replay). ``tokens``: the replay resolves every layer for that many query
        tokens (a whole forward's graph, as a bucket was captured): each layer's last
        selection (what a demotion seeds first) is then that [tokens, K] view, K as its
        capture had it."""
        self.streams.note_replay()
        if tokens is not None:
            for layer, shapes in self._shapes.items():
                K = shapes.get(tokens)
                if K is not None:
                    self.writer.last_selection[layer] = self._bufs[layer].view(tokens, K).physical.view(-1)  # type: ignore[index]

    def wait_staging(self, layer: int, stream=None) -> None:
        """``stream`` (default current) waits until the last staging of ``layer`` (a
        ``resolve(..., wait=False)``) landed; inside a capture, for the one captured."""
        self.streams.wait_stage(layer, stream)

    def wait_resolved(self, layer: int, stream=None) -> None:
        """``stream`` (default current) waits until the last resolve of ``layer`` updated
        the LRU state and chose its slots (a split resolve's miss phase), but not for its
        staging; inside a capture, for the one captured."""
        self.streams.wait_resolved(layer, stream)

    def join_staging(self) -> None:
        """The current stream waits for every layer's in-flight resolve and staging
        (before buffers those read are rewritten)."""
        self.streams.before_lifecycle()

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
        self.streams.before_lifecycle()
        return self.prefix.reset()

    def free_request(self, req_id: int) -> None:
        """Return every block (a cached block stays cached; the request's own blocks
        whose rows every layer holds are published first), clear every slot mapping of
        every layer, release the id, then call each of ``free_listeners``."""
        r = self.requests.slot(req_id)
        freed = lifecycle.release(self, req_id)
        for fn in self.free_listeners:
            fn(req_id, r, freed)

    def reserve_blocks(self, req_id: int, num_tokens: int) -> list[int]:
        """Host blocks for positions ``0 .. num_tokens - 1`` of a live request, no row
        written (its lengths stay): the rows land in them from elsewhere, then a write
        of the same rows follows (``hisparse.pd``). CapacityError, nothing changed."""
        check_int("num_tokens", num_tokens, 0)
        return self.writer.allocate_for(self.requests.slot(req_id), num_tokens)

    # ---- write path -------------------------------------------------------
    def plan_write(self, req_ids, counts) -> WriteBatch:
        """Check a batch of appends once (distinct live ids, a row count each); the
        returned batch serves :meth:`write` of every layer until requests change, in
        this cache only (another refuses it)."""
        return self.writer.prepare(req_ids, counts)

    def write(self, layer: int, batch: WriteBatch, rows: torch.Tensor) -> list[int]:
        """Append ``batch``'s rows (uint8 [batch.total, row_bytes], cache device; any
        strides) to ``layer``; returns the first position written per request.
        CapacityError (nothing changed) when the host pool can't supply the blocks."""
        V.check_layer(self.cfg, layer)
        return self.writer.write(layer, batch, rows)

    def prepare_step(self, batch: WriteBatch, *, capacity: StepCapacity | None = None,
                     replaces: StepPlan | None = None, host_written: bool = False,
                     ends: Sequence[int] | None = None) -> StepPlan:
        """Plan ``batch``'s append to every layer at once (an engine's forward); then
        :meth:`write_step` per layer only launches. ``capacity``: fixed-shape lists in
        a bucket's persistent buffers (CUDA graphs). ``ends``: the rows each request must
        hold after the step (ValueError otherwise). The step serves this cache only
        (another refuses it). See ``Writer.prepare_step``."""
        return self.writer.prepare_step(batch, capacity=capacity, replaces=replaces, host_written=host_written,
                                        ends=ends)

    def write_step(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """Write ``layer``'s rows of a prepared step (uint8 [step.rows, row_bytes])."""
        V.check_layer(self.cfg, layer)
        self.writer.write_step(layer, step, rows)

    def write_step_by(self, layer: int, step: StepPlan, launch) -> None:
        """``write_step`` of a padded step whose launches ``launch()`` enqueues, e.g. the
        replay of a graph captured over :meth:`launch_write_step` (``Writer.write_step_by``).
        The host pool's pinning is checked here: in a graph the mirror's own check ran
        only when it was captured."""
        V.check_layer(self.cfg, layer)
        if self.pool.is_writer:
            self._pinned_check("the host pool")  # the mirror writes it over UVA
        self.writer.write_step_by(layer, step, launch)

    def check_write_step(self, layer: int, step: StepPlan) -> None:
        """The checks ``write_step`` makes of the step and layer (ValueError)."""
        V.check_layer(self.cfg, layer)
        self.writer.check_step(layer, step)

    def launch_write_step(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """The launches of ``write_step`` alone, joined back into the current stream (for
        a graph capture; rows uint8 [step.rows, row_bytes], packed)."""
        V.check_layer(self.cfg, layer)
        self.writer.launch_step(layer, step, rows)

    def lengths_before(self, req_id: int, step: StepPlan | None) -> list[int]:
        """Rows per layer, a layer ``step`` has not written counted as before it."""
        return self.writer.visible(step, req_id, self.request_slot(req_id))[0]

    def lengths_before_batch(self, req_ids: Sequence[int],
                             step: StepPlan | None) -> tuple[list[int | None], np.ndarray, np.ndarray]:
        """``lengths_before`` of a batch, summed up: (the request slot of each id, None
        for an id that is not live; same bool [n]: whether the request holds the same
        rows in every layer; len0 int64 [n]: those rows, meaningful where ``same`` and
        live). Ids are not checked. Array operations over the batch, whatever the
        number of layers."""
        slots = self.requests.slots_of(req_ids)
        live = np.array([0 if s is None else s for s in slots], dtype=np.int64) if None in slots else tuple(slots)
        same, len0, _ = self.writer.visible_summary(step, req_ids, live)
        return slots, same, len0

    def abandon_step(self, step: StepPlan, *, captured: bool = False) -> None:
        """Put back every layer of ``step`` whose write did not run (``captured``: and
        those captured in a graph that failed)."""
        self.writer.abandon_step(step, captured=captured)

    def append_rows_batch(self, layer: int, req_ids, rows: torch.Tensor, counts) -> list[int]:
        """Append ``counts[i]`` rows to request ``req_ids[i]`` of one layer, for every i
        (rows of request i = ``rows[sum(counts[:i]) : sum(counts[:i+1])]``), in a fixed
        number of launches. Returns each request's first position written."""
        V.check_layer(self.cfg, layer)
        return self.writer.write(layer, self.writer.prepare(req_ids, counts), rows)

    def append_rows(self, layer: int, req_id: int, rows: torch.Tensor) -> int:
        """Append ``rows`` (uint8 [n, row_bytes]) to one layer of a request; returns the
        first position written (a batch of one)."""
        n = int(rows.shape[0]) if isinstance(rows, torch.Tensor) and rows.dim() == 2 else 0
        return self.append_rows_batch(layer, [req_id], rows, [n])[0]

    def append_token_rows(self, layer: int, req_ids, rows: torch.Tensor) -> list[int]:
        """One row to each of ``n`` distinct requests in one layer (a decode step)."""
        ids = list(req_ids)
        return self.append_rows_batch(layer, ids, rows, [1] * len(ids))

    # ---- resolve + staging --------------------------------------------------
    def resolve(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, *,
                validate: bool = True, wait: bool = True, compact: bool = False) -> ResolveResult:
        """Map logical top-k positions to rows of ``hot_rows(layer)``, staging misses.

        req_ids: int32 [T] request id per query token (a request's tokens contiguous,
        at most max_query_len of them; int64 is accepted in checked mode only);
        topk: int32 [T, K] positions, -1 = padding. ``validate`` checks contents (host
        sync) and raises before any launch; unchecked, invalid entries become -1 and are
        counted. ``wait``: the current stream waits for staging before returning (else
        ``result.wait``). ``compact``: valid entries of each row moved to its front.

        CUDA graphs: capture ``resolve(..., validate=False)`` with the Triton kernels,
        after one eager call compiled them; replay on the compute stream, and call
        :meth:`join_backup` before a replay that follows eager appends.

        While every live request is resident (``all_resident``), an eager call takes the
        resident path (``resident_resolve``: one launch on the current stream, no
        staging; ``result.event`` None with ``wait``); a capture takes it only inside
        :meth:`resident_capture`.
        """
        T, K, req_ids = self._check_resolve(layer, req_ids, topk, validate)
        out = self._out(layer, T, K)
        if self.resident_resolve():
            event = self.stager.run_resident(layer, req_ids, topk, out, compact=compact, wait=wait)
        else:
            event = self.stager.run(layer, req_ids, topk, out, host_rows=self._host_l[layer],
                                    hot_rows=self._hot_l[layer], compact=compact, wait=wait)
        self.requests.touch(layer)
        return ResolveResult(out, event, self.requests.epochs, layer)

    def resolve_by(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, launch) -> ResolveResult:
        """An unchecked, waiting ``resolve`` whose launches ``launch()`` enqueues, e.g. the
        replay of a graph captured over :meth:`launch_resolve` with the same arguments:
        the same checks first, the same bookkeeping after. The result's ``event`` is None:
        the staging is part of what ``launch()`` enqueued on the current stream (a graph
        joins the streams it forks), so another stream waits on that one instead."""
        T, K, req_ids = self._check_resolve(layer, req_ids, topk, False)
        out = self._out(layer, T, K)
        launch()
        self.requests.touch(layer)
        return ResolveResult(out, None, self.requests.epochs, layer)

    def resolve_replay(self, layer: int, T: int, K: int, launch) -> ResolveResult:
        """``resolve_by`` of arguments that passed its checks in an earlier call (the
        same static req_ids int32 [T] and top-k int32 [T, K] tensors): only the checks
        whose outcome can change since (the host pool's pinning, a shared pool's
        visibility wait), then ``launch()`` and the same bookkeeping."""
        self._pinned_check("the host pool")
        if self.pool.shared and not self.streams.capturing():
            self.pool.wait_visible(layer)
        out = self._out(layer, T, K)
        launch()
        self.requests.touch(layer)
        return ResolveResult(out, None, self.requests.epochs, layer)

    def _out(self, layer: int, T: int, K: int) -> ResolveBuffers:
        """Layer ``layer``'s resolve buffers as [T, K]; their physical rows are what a
        demotion seeds first (``Writer.last_selection``)."""
        out = self._bufs[layer].view(T, K)
        if self.dpool.enabled:  # only a pool demotes: no host time otherwise
            self.writer.last_selection[layer] = out.physical.view(-1)  # type: ignore[index]
            self._shapes.setdefault(layer, {})[T] = K  # a graph captured now resolves [T, K] when replayed
        return out

    def check_resolve(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> None:
        """The checks an unchecked ``resolve`` makes before it launches."""
        self._check_resolve(layer, req_ids, topk, False)

    def launch_resolve(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor) -> None:
        """The launches of ``resolve(layer, req_ids, topk, validate=False, wait=True)``
        alone (checked by the caller), for a graph capture: no bookkeeping."""
        T, K = topk.shape
        if self.resident_resolve():
            self.stager.run_resident(layer, req_ids, topk, self._out(layer, T, K), compact=False)
            return
        self.stager.run(layer, req_ids, topk, self._out(layer, T, K), host_rows=self._host_l[layer],
                        hot_rows=self._hot_l[layer], compact=False, wait=True)

    def resolve_split(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, *,
                      validate: bool = True, compact: bool = False,
                      copy_shape: CopyShape | None = None) -> SplitResult:
        """``resolve`` in two phases, so that attention over the hits need not wait for
        the misses: returns once the hit phase is enqueued on the current stream
        (``result.hit_physical`` may be attended right away); the miss phase and the
        staging run on the stage stream and record ``result.event``, which the current
        stream must wait on before it reads ``result.miss_physical`` rows. The state after
        the call equals ``resolve``'s bit for bit.

        ``copy_shape``: the staging kernel's grid (``stager.CopyShape``; None: a quarter of
        the SMs, 8 rows a program; ``stager.stage_programs`` overrides its programs).
        """
        T, K, req_ids = self._check_resolve(layer, req_ids, topk, validate)
        out = self._out(layer, T, K)
        hit, miss_lists = _split_buffers(self._split, self.cfg, self.device, layer, T, K)
        event = self.stager.run_split(layer, req_ids, topk, out, hit, miss_lists,
                                      host_rows=self._host_l[layer], hot_rows=self._hot_l[layer],
                                      compact=compact, copy_shape=copy_shape)
        self.requests.touch(layer)
        return SplitResult(out, hit, miss_lists, event, self.requests.epochs, layer)

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
        T, K, req_ids = self._check_resolve(layer, req_ids, topk, False)
        if K > self.cfg.top_k:
            raise ValueError(f"topk has K={K} columns, more than top_k={self.cfg.top_k}")
        out = self._prefetch_out.view(T, K)
        self.stager.run_prefetch(layer, req_ids, topk, out, host_rows=self._host_l[layer],
                                 hot_rows=self._hot_l[layer])
        self.requests.touch(layer)
        return out

    @property
    def stage_stream(self):
        """The stream staging runs on (None on CPU)."""
        return self.streams.streams.stage

    def _check_resolve(self, layer: int, req_ids, topk, validate: bool):
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
        self._pinned_check("the host pool")  # staging reads it over UVA: refused before any launch
        if self.pool.shared and not self.streams.capturing():
            self.pool.wait_visible(layer)  # rows of the writer rank must be on host
        return T, K, req_ids

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
