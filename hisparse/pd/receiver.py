"""The decode side of a prefill/decode transfer: ``PDReceiver``.

One NIXL agent per cache registers the cache's whole pinned host pool once (and a small
table of int64 generation words, one per request slot). Per request:

``reserve(req_id, num_tokens)``
    admits the request (``add_request``; under the elastic tier it may be admitted
    resident), gives it the host blocks of ``num_tokens`` positions (block-table
    entries written, lengths still 0: nothing of it is readable), stores a fresh
    generation in the request slot's word and returns the ``PDDescriptor`` the prefill
    side writes by. CapacityError (request slots or host blocks), nothing changed.
``commit(req_id, generation)``
    once the rows are in the blocks: the rows count as appended in every layer, through
    the cache's own step write (``prepare_step`` + ``write_step`` of the rows now in
    the pool, ``host_written``: no host mirror), so a hot request's slots and a
    resident request's pages are filled exactly as ``append_rows`` fills them.
    The generation word is cleared.
``abort(req_id)``
    clears the word and frees the request: every block returns, the cache is as it was
    before the reservation.
``poll()`` / ``wait(req_id, timeout_s)``
    read NIXL notifications: a sender's "done" notice of the open generation commits
    (after checking its row format, block size and byte count against the
    reservation; a mismatch aborts), a "fail" notice aborts, notices of other
    generations are counted (``stale_notices``) and dropped; a reservation past its
    deadline (``reserve(..., timeout_s=)``, or ``wait``'s) is aborted.

A failed commit aborts the reservation before raising (``PDError``): the cache is then
as before ``reserve``. Other requests' rows are never written by any of these calls.

Limit: a WRITE is one-sided. The sender reads the generation word before it writes and
refuses a descriptor whose reservation is closed (``StaleDescriptorError``), but a
transfer already in flight when the decode side aborts still lands in the returned
blocks; so give the decode side's deadline a margin over the sender's ``timeout_s``.
Calls are not thread-safe: one thread drives a receiver.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from .._checks import check_int
from ..cache.cache import HiSparseCache
from ..errors import CapacityError
from ..formats import RowFormat
from .descriptor import PDDescriptor, parse_notice
from .errors import PDError, StaleDescriptorError, TransferError, TransferTimeout
from .nixl_api import make_agent


def row_format_name(row_bytes: int) -> str:
    """The row format of ``row_bytes``-byte rows ("fp8_ds_mla", "bf16"; "raw<N>" otherwise)."""
    fmt = {f.row_bytes: f for f in RowFormat}.get(row_bytes)
    return fmt.value if fmt is not None else f"raw{row_bytes}"


@dataclasses.dataclass
class ReserveInfo:
    """An open reservation."""

    req_id: int
    slot: int
    generation: int
    num_tokens: int
    deadline: float | None  # time.monotonic() after which poll() aborts it; None = never


@dataclasses.dataclass(frozen=True)
class PollResult:
    committed: tuple[int, ...]          # request ids committed by this poll
    failed: dict[int, str]              # request id -> why it was aborted


class PDReceiver:
    """The decode side (module docstring). ``name``: the NIXL agent's name, unique among
    the agents that talk to each other; ``backends``: NIXL backends (UCX by default)."""

    def __init__(self, cache: HiSparseCache, *, name: str = "hisparse-decode",
                 backends: tuple[str, ...] = ("UCX",)) -> None:
        if not isinstance(cache, HiSparseCache):
            raise TypeError(f"cache must be a HiSparseCache, got {type(cache).__name__}")
        if not cache.pool.is_writer:
            raise ValueError("a P/D receiver commits rows through the cache's writes: give it the cache of "
                             "the rank that writes the (shared) host pool")
        self.cache = cache
        cfg = cache.cfg
        self.row_format = row_format_name(cfg.row_bytes)
        self._agent = make_agent(name, tuple(backends), progress_thread=True)
        self.name = name
        pool = cache.pool.buffer.tensor  # uint8 [host_pool_bytes], the cache's host pool
        self._pool_base = pool.data_ptr()
        self._words = np.zeros(cfg.max_num_reqs, dtype=np.int64)  # generation per request slot, 0 = none
        self._regs = [self._agent.register_memory([(self._pool_base, pool.numel(), 0, "")], "DRAM"),
                      self._agent.register_memory([(self._words.ctypes.data, self._words.nbytes, 0, "")],
                                                  "DRAM")]
        self._metadata = self._agent.get_agent_metadata()
        self._next_gen = 1
        self._open: dict[int, ReserveInfo] = {}
        self._finished: dict[int, str | None] = {}  # poll's outcomes not yet taken by wait (None = committed)
        self.stale_notices = 0

    # ---- the three transitions ------------------------------------------------
    def reserve(self, req_id: int, num_tokens: int, *, timeout_s: float | None = None) -> PDDescriptor:
        """Admit ``req_id`` and give it the blocks of ``num_tokens`` rows per layer (module
        docstring). ``timeout_s``: ``poll`` aborts the reservation after that long."""
        cache = self.cache
        check_int("req_id", req_id, 0, cache.cfg.max_request_id)
        check_int("num_tokens", num_tokens, 1)
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        if req_id in self._open or cache.requests.is_live(req_id):
            raise ValueError(f"request {req_id} is live already (reserve a new request id)")
        if len(cache.requests) >= cache.cfg.max_num_reqs:
            raise CapacityError(f"reserve request {req_id}: all {cache.cfg.max_num_reqs} request slots are taken")
        need = -(-num_tokens // cache.pool.B)
        free = cache.pool.allocator.num_free
        if need > free:
            raise CapacityError(f"reserve request {req_id}: {num_tokens} tokens need {need} host blocks, "
                                f"{free} of {cache.pool.allocator.num_blocks} are free")
        r = cache.add_request(req_id)
        try:
            cache.reserve_blocks(req_id, num_tokens)
        except BaseException:
            cache.free_request(req_id)
            raise
        gen = self._next_gen
        self._next_gen += 1
        self._words[r] = gen
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._open[req_id] = ReserveInfo(req_id, r, gen, num_tokens, deadline)
        self._finished.pop(req_id, None)
        return self.descriptor(req_id)

    def descriptor(self, req_id: int) -> PDDescriptor:
        """The descriptor of an open reservation."""
        res = self._reservation(req_id)
        cfg = self.cache.cfg
        stride = cfg.num_host_rows * cfg.row_bytes
        return PDDescriptor(
            agent_name=self.name, agent_metadata=self._metadata, request_id=req_id, generation=res.generation,
            generation_addr=self._words.ctypes.data + 8 * res.slot, row_format=self.row_format,
            row_bytes=cfg.row_bytes, block_size=cfg.host_block_size, num_tokens=res.num_tokens,
            num_layers=cfg.num_layers, runs=tuple(self.cache.pool.segments(res.slot, 0, res.num_tokens)),
            layer_addrs=tuple(self._pool_base + layer * stride for layer in range(cfg.num_layers)))

    def commit(self, req_id: int, generation: int) -> None:
        """The reserved rows count as appended in every layer (module docstring).
        StaleDescriptorError for another generation (nothing changed); PDError when the
        write fails (the reservation is aborted first)."""
        res = self._reservation(req_id)
        if generation != res.generation:
            raise StaleDescriptorError(f"commit of request {req_id} with generation {generation}; the open "
                                       f"reservation has generation {res.generation}")
        cache = self.cache
        if any(cache.lengths(req_id)):
            raise ValueError(f"request {req_id} holds rows {cache.lengths(req_id)} although it is reserved: "
                             "nothing may append to a reserved request before its commit")
        try:
            step = cache.prepare_step(cache.plan_write([req_id], [res.num_tokens]), host_written=True)
            for layer in range(cache.cfg.num_layers):
                cache.write_step(layer, step, self._rows(layer, res))
        except BaseException as e:
            self.abort(req_id)
            raise PDError(f"commit of request {req_id} failed and the reservation was aborted: "
                          f"{type(e).__name__}: {e}") from e
        self._close(res)

    def abort(self, req_id: int) -> None:
        """Return every block and release the request (module docstring)."""
        res = self._reservation(req_id)
        self._close(res)
        self.cache.free_request(req_id)

    # ---- notifications ------------------------------------------------------------
    def poll(self) -> PollResult:
        """Act on the NIXL notifications that arrived and on expired deadlines."""
        committed: list[int] = []
        failed: dict[int, str] = {}
        for msgs in self._agent.get_new_notifs().values():
            for msg in msgs:
                parsed = parse_notice(msg)
                if parsed is None:
                    continue
                kind, f = parsed
                res = self._open.get(f["request_id"])
                if res is None or f["generation"] != res.generation:
                    self.stale_notices += 1
                    continue
                problem = self._notice_problem(kind, f, res)
                if problem is not None:
                    self.abort(res.req_id)
                    failed[res.req_id] = problem
                    continue
                try:
                    self.commit(res.req_id, res.generation)
                except PDError as e:
                    failed[res.req_id] = str(e)
                    continue
                committed.append(res.req_id)
        now = time.monotonic()
        for res in [r for r in self._open.values() if r.deadline is not None and now > r.deadline]:
            self.abort(res.req_id)
            failed[res.req_id] = f"no transfer of request {res.req_id} arrived before its deadline (aborted)"
        self._finished.update({rid: None for rid in committed})
        self._finished.update(failed)
        return PollResult(tuple(committed), failed)

    def wait(self, req_id: int, timeout_s: float = 30.0, *, interval_s: float = 0.0005) -> None:
        """Poll until ``req_id`` is committed. TransferError when it was aborted (a fail
        notice, a mismatch); TransferTimeout after ``timeout_s`` (the reservation is
        aborted first)."""
        check_int("req_id", req_id)
        end = time.monotonic() + timeout_s
        while True:
            if req_id in self._finished:
                why = self._finished.pop(req_id)
                if why is None:
                    return
                raise TransferError(why)
            if req_id not in self._open:
                raise ValueError(f"request {req_id} has no open reservation")
            if time.monotonic() > end:
                self.abort(req_id)
                raise TransferTimeout(f"request {req_id}: no transfer arrived in {timeout_s} s; the reservation "
                                      "was aborted (blocks returned)")
            self.poll()
            if req_id not in self._finished:
                time.sleep(interval_s)

    def open_requests(self) -> list[int]:
        return sorted(self._open)

    def close(self) -> None:
        """Abort every open reservation and deregister the memory."""
        for rid in list(self._open):
            self.abort(rid)
        for reg in self._regs:
            self._agent.deregister_memory(reg)
        self._regs = []

    # ---- helpers ------------------------------------------------------------------
    def _reservation(self, req_id: int) -> ReserveInfo:
        res = self._open.get(req_id)
        if res is None:
            raise StaleDescriptorError(f"request {req_id} has no open reservation (never reserved, or "
                                       "committed / aborted already)")
        return res

    def _close(self, res: ReserveInfo) -> None:
        self._words[res.slot] = 0
        del self._open[res.req_id]

    def _notice_problem(self, kind: str, f: dict, res: ReserveInfo) -> str | None:
        cfg = self.cache.cfg
        if kind == "fail":
            return f"the prefill side reported a failed transfer of request {res.req_id}: {f.get('reason')}"
        if kind != "done":
            return f"unknown notice {kind!r} for request {res.req_id}"
        want = dict(row_format=self.row_format, row_bytes=cfg.row_bytes, block_size=cfg.host_block_size,
                    bytes=cfg.num_layers * res.num_tokens * cfg.row_bytes)
        diff = {k: (f.get(k), v) for k, v in want.items() if f.get(k) != v}
        if diff:
            return (f"request {res.req_id}: the transfer does not match the reservation "
                    + ", ".join(f"{k} {got!r} (expected {exp!r})" for k, (got, exp) in diff.items())
                    + "; aborted")
        return None

    def _rows(self, layer: int, res: ReserveInfo) -> torch.Tensor:
        """uint8 [C, row_bytes] on the cache device: the request's rows of ``layer`` as the
        pool holds them (a view when they are one run on a CPU cache)."""
        cache = self.cache
        rows = cache.pool.rows[layer]
        runs = cache.pool.segments(res.slot, 0, res.num_tokens)
        if cache.device.type == "cpu" and len(runs) == 1:
            return rows[runs[0][2]:runs[0][2] + res.num_tokens]
        out = torch.empty((res.num_tokens, cache.cfg.row_bytes), dtype=torch.uint8, device=cache.device)
        for a, b, h in runs:
            out[a:b].copy_(rows[h:h + b - a], non_blocking=True)
        return out


__all__ = ["PDReceiver", "ReserveInfo", "PollResult", "row_format_name"]
