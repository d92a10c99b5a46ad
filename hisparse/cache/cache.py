"""``HiSparseCache``: the public runtime of the tiered cache (control plane + streams).

What it owns (notation in ``hisparse.cache.state``):
  pool   ``HostPool``: pinned uint8 [L, H, row_bytes] + block allocator (cold tier)
  hot    uint8 [L, R * (S + 1) (rounded up to 64), row_bytes] on the device (hot tier)
  state  ``HotState``: slot maps, exact-LRU stamps, block table, device counters
  per-layer output buffers of resolve, sized once for R x max_query_len tokens

Calls (see DESIGN.md "Write path", "Resolve + staging", "Checked vs unchecked"):
  add_request / append_rows / append_rows_batch / resolve / hot_rows / read_host_rows /
  free_request / stats

Host-side mirrors (request id -> slot, per-layer lengths, reserved-slot occupant) let
every call except ``resolve`` decide without reading device memory; resolve's checked
mode reads its inputs once (a host sync), its unchecked mode never does.

Resolve outputs: one set of buffers *per layer*, so the result of layer l stays valid
until the next resolve of the same layer (results of different layers can be held at
once, e.g. when resolving ahead with ``wait=False``). The cost is L x R x q x top_k x
12 bytes, small next to the hot rows themselves.

GPU streams: hot-row writes and bookkeeping on the caller's (compute) stream; host
mirroring on ``streams.backup`` (records ``backup`` event); resolve + staging on
``streams.stage`` after it waits on the compute stream and the backup event.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import HiSparseConfig
from ..device import Streams, resolve_device
from ..errors import CapacityError
from . import validate as V
from .apply_write import apply_write_plan_reference
from .host_pool import HostPool
from .resolve_ref import copy_rows_reference, resolve_reference
from .state import (STAT_D2H_ROWS, STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_RESOLVES,
                    HotState, ResolveBuffers)
from .write_plan import WritePlan, build_write_plan

KERNEL_CHOICES = ("auto", "torch", "triton")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Event:
    """A CUDA event that remembers whether it was recorded during graph capture.

    A wait is skipped when the event was recorded on the other side of a capture
    boundary: a captured stream may not wait on an event recorded outside the capture,
    and an event recorded during capture marks nothing outside the graph. Graph replays
    run on the compute stream, which every stream here already waits on, so the only
    case left to the caller is eager work before a replay: see
    :meth:`HiSparseCache.join_backup`. On CPU every call is a no-op.
    """

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event() if cuda else None
        self.recorded = False
        self.in_capture = False

    def record(self, stream, capturing: bool) -> None:
        if self.event is None:
            return
        self.event.record(stream)
        self.recorded = True
        self.in_capture = capturing

    def wait_by(self, stream, capturing: bool) -> None:
        if self.event is None or not self.recorded or self.in_capture != capturing:
            return
        stream.wait_event(self.event)


class ResolveResult:
    """Output of :meth:`HiSparseCache.resolve` (views of the layer's reused buffers).

    physical:     int32 [T, K]  rows of ``hot_rows(layer)``, -1 = padding
    valid_counts: int32 [T]     non-padding entries per query token
    stage_src:    int32 [T * K] host rows staged this step (-1 = none), for inspection
    stage_dst:    int32 [T * K] flat hot rows they went to
    event:        CUDA event recorded after staging (None on CPU)

    The views are overwritten by the next resolve of the same layer.
    """

    __slots__ = ("physical", "valid_counts", "stage_src", "stage_dst", "event")

    def __init__(self, physical: torch.Tensor, valid_counts: torch.Tensor,
                 stage_src: torch.Tensor, stage_dst: torch.Tensor, event) -> None:
        self.physical = physical
        self.valid_counts = valid_counts
        self.stage_src = stage_src
        self.stage_dst = stage_dst
        self.event = event

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream) wait until staging is done."""
        if self.event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.physical.device)
        stream.wait_event(self.event)


def _pick_kernels(kernels: object, device: torch.device) -> tuple[Callable, Callable, Callable, str]:
    """(resolve_fn, copy_fn, apply_write_fn, description) for a kernel choice."""
    if not isinstance(kernels, str) or kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {list(KERNEL_CHOICES)}, got {kernels!r}")
    if kernels == "torch" or (kernels == "auto" and device.type == "cpu"):
        return resolve_reference, copy_rows_reference, apply_write_plan_reference, "torch"
    try:
        from .apply_write import apply_write_plan_triton
        from .resolve_triton import resolve_triton
        from .transfer import copy_rows
    except ModuleNotFoundError as e:
        if e.name not in ("hisparse.cache.resolve_triton", "hisparse.cache.transfer",
                          "hisparse.cache.apply_write"):
            raise
        if kernels == "triton":
            raise ValueError(
                f"kernels='triton' needs {e.name}, which is not available in this install"
            ) from e
        return (resolve_reference, copy_rows_reference, apply_write_plan_reference,
                f"torch (triton path missing: {e.name})")
    return resolve_triton, copy_rows, apply_write_plan_triton, "triton"


class HiSparseCache:
    """Tiered KV cache: pinned host pool + per-(layer, request) GPU hot buffers.

    ``kernels``: "auto" (Triton on CUDA, torch references on CPU), "torch", or "triton"
    (the Triton kernels; on CPU they run under ``TRITON_INTERPRET=1``).
    ``pin``: pin the host pool (default: when CUDA is available).
    """

    def __init__(self, cfg: HiSparseConfig, *, kernels: str = "auto",
                 pin: bool | None = None, host_pool: HostPool | None = None) -> None:
        if not isinstance(cfg, HiSparseConfig):
            raise TypeError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self._resolve_fn, self._copy_fn, self._apply_write_fn, self.kernels = \
            _pick_kernels(kernels, self.device)
        self.streams = Streams(self.device)
        self.cuda = self.streams.cuda
        L, R, S = cfg.num_layers, cfg.max_num_reqs, cfg.device_buffer_size
        self.S: int = S  # type: ignore[assignment]
        self.SP = cfg.slots_per_req
        if host_pool is None:
            self.pool = HostPool(cfg, pin=pin)
        else:  # e.g. a SharedHostPool mapped by every tensor-parallel rank of a node
            if not isinstance(host_pool, HostPool):
                raise TypeError(f"host_pool must be a HostPool, got {type(host_pool).__name__}")
            from .shared_pool import config_diff, config_fingerprint
            if config_fingerprint(host_pool.cfg) != config_fingerprint(cfg):
                raise ValueError("host_pool was built for another config: "
                                 f"{config_diff(host_pool.cfg.to_dict(), cfg.to_dict())}")
            self.pool = host_pool
        # a shared pool has one writer rank; the others only read (see shared_pool)
        self._pool_writer = bool(getattr(self.pool, "is_writer", True))
        self._pool_shared = hasattr(self.pool, "commit_append")
        self.state = HotState.allocate(cfg, self.device)
        # uint8 [L, R * (S + 1), row_bytes]; hot[l] is the flat view physical indices index
        self.hot = torch.zeros((L, cfg.hot_rows_per_layer, cfg.row_bytes), dtype=torch.uint8,
                               device=self.device)
        self.max_tokens = R * cfg.max_query_len
        cap = self.max_tokens * cfg.top_k
        i32 = dict(dtype=torch.int32, device=self.device)
        self._phys = torch.full((L, cap), -1, **i32)  # int32 [L, Tmax * top_k]
        self._valid = torch.zeros((L, self.max_tokens), **i32)  # int32 [L, Tmax]
        self._src = torch.full((L, cap), -1, **i32)  # int32 [L, Tmax * top_k]
        self._dst = torch.full((L, cap), -1, **i32)  # int32 [L, Tmax * top_k]
        self._ids32 = torch.zeros((L, self.max_tokens), **i32)  # int32 [L, Tmax] cast int64 ids
        # host mirrors
        self._slot_of: dict[int, int] = {}  # live request id -> request slot
        self._free_slots: list[int] = list(range(R - 1, -1, -1))  # pop() -> lowest
        self._lens: dict[int, list[int]] = {}  # slot -> rows appended per layer
        self._reserved: dict[int, list[int]] = {}  # slot -> position in slot S per layer
        # last batched-append plan, reused by the other layers of a forward; the
        # generation (bumped by add/free_request) keeps a plan from outliving them
        self._wplan: tuple[tuple, WritePlan] | None = None
        self._generation = 0
        # (req_ids, counts, generation, slots, counts list, total) of the last validated
        # append_rows_batch whose ids and counts were tuples (see there)
        self._batch_memo: tuple | None = None
        # events
        self._backup_ev = _Event(self.cuda)
        self._stage_evs = [_Event(self.cuda) for _ in range(L)]
        self._last_stage: _Event | None = None

    # ---- small queries ----------------------------------------------------
    def live_requests(self) -> list[int]:
        return sorted(self._slot_of)

    def request_slot(self, req_id: int) -> int:
        """Request slot r of a live id (ValueError otherwise)."""
        V.check_req_id(self.cfg, req_id)
        r = self._slot_of.get(req_id)
        if r is None:
            raise ValueError(f"request {req_id} is not live (add_request it first)")
        return r

    def layer_len(self, layer: int, req_id: int) -> int:
        """Rows appended to ``layer`` for the request."""
        V.check_layer(self.cfg, layer)
        return self._lens[self.request_slot(req_id)][layer]

    def seq_len(self, req_id: int) -> int:
        """Positions appended to every layer (the min of the layer lengths).

        Resolve of layer l accepts positions below ``layer_len(l, req_id)``."""
        return min(self._lens[self.request_slot(req_id)])

    def hot_rows(self, layer: int) -> torch.Tensor:
        """uint8 [cfg.hot_rows_per_layer, row_bytes] (R x (S + 1) rounded up to 64): the
        flat view physical indices point into."""
        V.check_layer(self.cfg, layer)
        return self.hot[layer]

    # ---- stream helpers ---------------------------------------------------
    def _after_stage(self, cur, capturing: bool) -> None:
        """The compute stream waits for in-flight resolves before touching state."""
        if self._last_stage is not None:
            self._last_stage.wait_by(cur, capturing)

    def join_backup(self, stream=None) -> None:
        """Make ``stream`` (default current) wait until every host mirror copy is done.

        Needed only before replaying a captured resolve after eager ``append_rows``.
        """
        if not self.cuda:
            return
        stream = stream if stream is not None else self.streams.current()
        self._backup_ev.wait_by(stream, _capturing(self.device))

    # ---- lifecycle --------------------------------------------------------
    def add_request(self, req_id: int) -> int:
        """Admit ``req_id``; returns its request slot. CapacityError when all are taken."""
        V.check_req_id(self.cfg, req_id)
        if req_id in self._slot_of:
            raise ValueError(f"request {req_id} is already live")
        if not self._free_slots:
            raise CapacityError(
                f"all max_num_reqs={self.cfg.max_num_reqs} request slots are taken; "
                "free a request first"
            )
        cur, capturing = self.streams.current(), _capturing(self.device)
        self._after_stage(cur, capturing)
        r = self._free_slots.pop()
        self.state.id_to_slot[req_id] = r
        self._slot_of[req_id] = r
        self._lens[r] = [0] * self.cfg.num_layers
        self._reserved[r] = [-1] * self.cfg.num_layers
        self._generation += 1
        return r

    def free_request(self, req_id: int) -> None:
        """Return every block, clear every slot mapping of every layer, release the id."""
        r = self.request_slot(req_id)
        cur, capturing = self.streams.current(), _capturing(self.device)
        self._after_stage(cur, capturing)
        st = self.state
        blocks = self.pool.allocator.owned(r)
        B = self.pool.B
        start = 0
        while start < len(blocks):  # clear row_slot run by run of consecutive blocks
            end = start + 1
            while end < len(blocks) and blocks[end] == blocks[end - 1] + 1:
                end += 1
            st.row_slot[:, blocks[start] * B:(blocks[end - 1] + 1) * B] = -1
            start = end
        st.slot_pos[:, r] = -1
        st.slot_stamp[:, r] = -1
        st.step[:, r] = 0
        st.seq_lens[:, r] = 0
        st.block_table[r] = -1
        st.id_to_slot[req_id] = -1
        self.pool.allocator.free(r)
        del self._slot_of[req_id], self._lens[r], self._reserved[r]
        self._free_slots.append(r)
        self._free_slots.sort(reverse=True)
        self._generation += 1

    # ---- write path -------------------------------------------------------
    def append_rows(self, layer: int, req_id: int, rows: torch.Tensor) -> int:
        """Append ``rows`` (uint8 [n, row_bytes], cache device) to one layer of a request.

        Returns the first position written (the layer's previous length). Host blocks
        are allocated on demand; CapacityError (nothing changed) when the pool is full.
        """
        V.check_layer(self.cfg, layer)
        r = self.request_slot(req_id)
        V.check_rows(self.cfg, rows, self.device)
        n = int(rows.shape[0])
        lens = self._lens[r]
        p0 = lens[layer]
        if n == 0:
            return p0
        p1 = p0 + n
        pool, st, S = self.pool, self.state, self.S
        need = pool.blocks_needed(r, p1)
        have = len(pool.allocator.owned(r))
        new_blocks = pool.allocator.allocate(r, need)  # CapacityError: nothing changed
        # ---- from here on nothing raises for caller reasons ----
        cur, capturing = self.streams.current(), _capturing(self.device)
        self._after_stage(cur, capturing)
        if new_blocks:
            st.block_table[r, have:have + need].copy_(
                torch.tensor(new_blocks, dtype=torch.int32), non_blocking=True)
        hot_l, base = self.hot[layer], r * self.SP
        fit_end = min(p1, S)
        if p0 < fit_end:  # fits phase: position p lives in slot p
            k = fit_end - p0
            hot_l[base + p0:base + fit_end].copy_(rows[:k])
            st.slot_pos[layer, r, p0:fit_end] = torch.arange(
                p0, fit_end, dtype=torch.int32, device=self.device)
            st.slot_stamp[layer, r, p0:fit_end] = st.step[layer, r]
            for a, b, h in pool.segments(r, p0, fit_end):
                st.row_slot[layer, h:h + (b - a)] = torch.arange(
                    a, b, dtype=torch.int32, device=self.device)
        last = p1 - 1
        if last >= S:  # the newest row takes the reserved slot S
            old = self._reserved[r][layer]
            if old >= 0:
                (_, _, h_old), = pool.segments(r, old, old + 1)
                st.row_slot[layer, h_old] = -1
                # the old occupant must be on host before its hot row is overwritten
                self._backup_ev.wait_by(cur, capturing)
            hot_l[base + S].copy_(rows[n - 1])
            st.slot_pos[layer, r, S] = last
            st.slot_stamp[layer, r, S] = st.step[layer, r]
            (_, _, h_new), = pool.segments(r, last, last + 1)
            st.row_slot[layer, h_new] = S
            self._reserved[r][layer] = last
        st.stats[layer, STAT_D2H_ROWS] += n
        # host mirror: every row, on the backup stream after the compute stream
        backup = self.streams.backup
        if backup is not None:
            backup.wait_stream(cur)
        with self.streams.on(backup):
            if self._pool_writer:
                for a, b, h in pool.segments(r, p0, p1):
                    pool.rows[layer, h:h + (b - a)].copy_(rows[a - p0:b - p0], non_blocking=True)
            self._backup_ev.record(backup, capturing)
        if backup is not None and not capturing:
            rows.record_stream(backup)
        self._commit_shared(layer)
        lens[layer] = p1
        st.seq_lens[layer, r] = p1
        return p0

    def append_rows_batch(self, layer: int, req_ids, rows: torch.Tensor, counts) -> list[int]:
        """Append ``counts[i]`` rows to request ``req_ids[i]`` of one layer, for every i.

        req_ids: distinct live request ids (a sequence of ints); counts: ints >= 0, one
        per id; rows: uint8 [sum(counts), row_bytes] on the cache device, the rows of
        request i being ``rows[sum(counts[:i]) : sum(counts[:i+1])]``. Same result as
        calling ``append_rows(layer, req_ids[i], those rows)`` for each i in order
        (blocks, slots, stamps, row maps, host rows, counters), in a fixed number of
        launches whatever the batch size. Returns the first position written for each
        request (its previous length in the layer). CapacityError (nothing changed)
        when the pool can't supply the blocks for all of them.

        The index plan is kept and reused by the next call with the same slots,
        positions, token offsets and reserved-slot occupants (the other layers of the
        same forward); add_request / free_request invalidate it. Passing ``req_ids`` and
        ``counts`` as tuples lets the next calls with the very same tuple objects skip
        re-validating them (until the next add_request / free_request).
        """
        V.check_layer(self.cfg, layer)
        memo = self._batch_memo
        if (memo is not None and memo[0] is req_ids and memo[1] is counts
                and memo[2] == self._generation):
            # the same (immutable) id and count tuples as a call already validated since
            # the last add/free_request: the other layers of one forward
            slots, counts, total = memo[3], memo[4], memo[5]
        else:
            ids = [V.check_req_id(self.cfg, i) for i in req_ids]
            if len(set(ids)) != len(ids):
                raise ValueError("append_rows_batch: req_ids must be distinct (one entry per request)")
            cl = list(counts)
            if len(cl) != len(ids):
                raise ValueError(f"append_rows_batch: {len(ids)} request ids but {len(cl)} counts")
            for c in cl:
                if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                    raise ValueError(f"append_rows_batch: counts must be ints >= 0, got {c!r}")
            slots = [self.request_slot(i) for i in ids]
            total = sum(cl)
            if isinstance(req_ids, tuple) and isinstance(counts, tuple):
                self._batch_memo = (req_ids, counts, self._generation, slots, cl, total)
            counts = cl
        V.check_rows(self.cfg, rows, self.device)
        if int(rows.shape[0]) != total:
            raise ValueError(f"append_rows_batch: counts sum to {total} but rows has "
                             f"{int(rows.shape[0])} rows")
        firsts, work, t0 = [], [], 0
        for r, n in zip(slots, counts):
            p0 = self._lens[r][layer]
            firsts.append(p0)
            if n:
                work.append((r, p0, p0 + n, t0, self._reserved[r][layer]))
            t0 += n
        if not work:
            return firsts
        pool, st, S = self.pool, self.state, self.S
        key = (self._generation, tuple(work))
        if self._wplan is not None and self._wplan[0] == key:
            plan = self._wplan[1]
        else:
            need = sum(pool.blocks_needed(r, p1) for r, _, p1, _, _ in work)
            if need > pool.allocator.num_free:
                raise CapacityError(
                    f"host pool full: {need} more blocks needed, {pool.allocator.num_free} free "
                    f"of {pool.allocator.num_blocks}; free requests or configure a larger pool"
                )
            # ---- from here on nothing raises for caller reasons ----
            plan = build_write_plan(pool, work, S=S, device=self.device)
            self._wplan = (key, plan)
        for r, _, p1, _, _ in work:  # host mirrors
            if p1 - 1 >= S:
                self._reserved[r][layer] = p1 - 1
            self._lens[r][layer] = p1
        # ---- device work, in append_rows' order ----
        cur, capturing = self.streams.current(), _capturing(self.device)
        self._after_stage(cur, capturing)
        if plan.unmap.numel():
            # the old occupants must be on host before their hot rows are overwritten
            self._backup_ev.wait_by(cur, capturing)
        # block table, hot rows, slot maps, stamps, lengths, counters (apply_write)
        self._apply_write_fn(st, self.hot[layer], rows, plan, layer)
        # host mirror: one row copy on the backup stream (device -> pinned host over UVA)
        backup = self.streams.backup
        if backup is not None:
            backup.wait_stream(cur)
        with self.streams.on(backup):
            if self._pool_writer:
                if self.cuda:
                    self._copy_fn(rows, plan.host_tok32, pool.rows[layer], plan.host_h32)
                else:
                    pool.rows[layer].index_copy_(0, plan.host_h, rows.index_select(0, plan.host_tok))
            self._backup_ev.record(backup, capturing)
        if backup is not None and not capturing:
            for t in (rows, plan.host_tok32, plan.host_h32):  # read on the backup stream
                t.record_stream(backup)
        self._commit_shared(layer)
        return firsts

    def append_token_rows(self, layer: int, req_ids, rows: torch.Tensor) -> list[int]:
        """One row to each of ``n`` distinct requests in one layer (a decode step).

        rows: uint8 [n, row_bytes], row i for ``req_ids[i]``. ``append_rows_batch`` with
        counts of 1; returns the position written for each request.
        """
        ids = list(req_ids)
        return self.append_rows_batch(layer, ids, rows, [1] * len(ids))

    def _commit_shared(self, layer: int) -> None:
        """Shared pool: count this append; the writer rank publishes it once on host."""
        if self._pool_shared:
            ev = self._backup_ev.event if (self._pool_writer and self.cuda) else None
            self.pool.commit_append(layer, ev)  # type: ignore[attr-defined]

    # ---- resolve + staging --------------------------------------------------
    def resolve(self, layer: int, req_ids: torch.Tensor, topk: torch.Tensor, *,
                validate: bool = True, wait: bool = True, compact: bool = False) -> ResolveResult:
        """Map logical top-k positions to rows of ``hot_rows(layer)``, staging misses.

        req_ids: int32/int64 [T] request id per query token (a request's tokens
        contiguous, at most max_query_len of them); topk: int32 [T, K] positions,
        -1 = padding. ``validate`` checks contents (host sync) and raises before any
        launch; unchecked, invalid entries become -1 and are counted. ``wait``: the
        current stream waits for staging before returning (else use ``result.wait``).
        ``compact``: valid entries of each row moved to its front.

        CUDA graphs: capture ``resolve(..., validate=False)`` with the Triton kernels
        (the torch reference syncs), compile them first with one eager call, replay on
        the compute stream, and call :meth:`join_backup` before a replay that follows
        eager ``append_rows``.
        """
        V.check_layer(self.cfg, layer)
        T, K = V.check_resolve_meta(self.cfg, self.device, req_ids, topk, self.max_tokens)
        if validate:
            lens = self._lens
            V.check_resolve_contents(self.cfg, req_ids, topk, self._slot_of,
                                     lambda r: lens[r][layer])
        out = ResolveBuffers(
            physical=self._phys[layer, :T * K].view(T, K),
            valid_counts=self._valid[layer, :T],
            stage_src=self._src[layer, :T * K],
            stage_dst=self._dst[layer, :T * K],
        )
        cur, capturing = self.streams.current(), _capturing(self.device)
        if self._pool_shared and not capturing:  # rows of the writer rank must be on host
            self.pool.wait_visible(layer)  # type: ignore[attr-defined]
        if req_ids.dtype != torch.int32:  # the kernels take int32 ids
            # clamp first so an out-of-range int64 id cannot wrap onto a live one (int32
            # ids skip this and its small temporary)
            ids32 = self._ids32[layer, :T]  # per layer: an in-flight resolve may read it
            ids32.copy_(req_ids.clamp(-1, self.cfg.max_request_id))
            req_ids = ids32
        stage = self.streams.stage
        if stage is not None:
            stage.wait_stream(cur)
            self._backup_ev.wait_by(stage, capturing)
        ev = self._stage_evs[layer]
        with self.streams.on(stage):
            self._resolve_fn(self.state, layer, req_ids, topk, out,
                             max_query_len=self.cfg.max_query_len, compact=compact)
            self._copy_fn(self.pool.rows[layer], out.stage_src, self.hot[layer], out.stage_dst)
            ev.record(stage, capturing)
        self._last_stage = ev
        if stage is not None and not capturing:
            req_ids.record_stream(stage)
            topk.record_stream(stage)
        res = ResolveResult(out.physical, out.valid_counts, out.stage_src, out.stage_dst,
                            ev.event)
        if wait:
            ev.wait_by(cur, capturing)
        return res

    # ---- reads ----------------------------------------------------------------
    def read_host_rows(self, layer: int, req_id: int, positions) -> torch.Tensor:
        """uint8 [n, row_bytes] CPU copy of the host-pool rows of ``positions``.

        Waits for pending host mirror copies first (a host sync on GPU).
        """
        V.check_layer(self.cfg, layer)
        r = self.request_slot(req_id)
        pos = V.check_positions(positions, self._lens[r][layer])
        if self._backup_ev.event is not None and self._backup_ev.recorded:
            self._backup_ev.event.synchronize()
        if self._pool_shared:
            self.pool.wait_visible(layer)  # type: ignore[attr-defined]
        rows = self.pool.host_rows(r, pos)
        return self.pool.rows[layer].index_select(0, rows)

    # ---- metrics ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters per layer and in total, host pool usage, live requests (host sync)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        raw = self.state.stats.cpu().tolist()
        rb = self.cfg.row_bytes
        layers = []
        tot = dict(hits=0, misses=0, invalid=0, resolves=0, bytes_h2d=0, bytes_d2h=0)
        for row in raw:
            d = dict(hits=row[STAT_HITS], misses=row[STAT_MISSES], invalid=row[STAT_INVALID],
                     resolves=row[STAT_RESOLVES], bytes_h2d=row[STAT_MISSES] * rb,
                     bytes_d2h=row[STAT_D2H_ROWS] * rb)
            for k in tot:
                tot[k] += d[k]
            d["hit_rate"] = _rate(d["hits"], d["misses"])
            layers.append(d)
        tot["hit_rate"] = _rate(tot["hits"], tot["misses"])  # type: ignore[assignment]
        alloc = self.pool.allocator
        return {
            "layers": layers,
            "total": tot,
            "host_pool": {
                "blocks_used": alloc.num_used,
                "blocks_total": alloc.num_blocks,
                "block_size": self.pool.B,
                "bytes": self.pool.nbytes,
                "bytes_used": alloc.num_used * self.pool.B * rb * self.cfg.num_layers,
                "pinned": self.pool.pinned,
            },
            "live_requests": len(self._slot_of),
            "kernels": self.kernels,
        }


def _rate(hits: int, misses: int) -> float:
    """hits / (hits + misses); 0.0 before any lookup."""
    n = hits + misses
    return hits / n if n else 0.0


__all__ = ["HiSparseCache", "ResolveResult", "KERNEL_CHOICES"]
