"""The decode side of a prefill/decode transfer: ``PDReceiver``.

One NIXL agent per cache registers the cache's whole pinned host pool when the receiver
is made (and a small table of int64 generation words, one per request slot). Per
request:

``reserve(req_id, num_tokens)``
    admits the request (``add_request``; under the elastic tier it may be admitted
    resident), gives it the host blocks of ``num_tokens`` positions (block-table
    entries written, lengths still 0: nothing of it is readable), stores a fresh
    generation in the request slot's word and returns the ``PDDescriptor`` the prefill
    side writes by. CapacityError (request slots or host blocks), nothing changed.
``commit(req_id, generation)``
    once the rows are in the blocks: clears the generation word first (a send of the
    same descriptor is refused from then on), then the rows count as appended in every
    layer, through the cache's own step write (``prepare_step(..., host_written=True)``:
    no host mirror; then ``hisparse.cache.write_pooled``: every layer in one launch,
    the rows read from the pool), so a hot request's slots and a resident request's
    pages are filled exactly as ``HiSparseCache.write`` fills them.
``abort(req_id)``
    clears the word and frees the request; its blocks go into *quarantine* (below).
``poll()`` / ``wait(req_id, timeout_s)``
    read NIXL notifications: a sender's "done" notice of the open generation commits
    (after checking its row format, block size and byte count against the
    reservation; a mismatch aborts), a "fail" notice aborts, a notice of a quarantined
    generation releases its quarantine, notices of other generations are counted
    (``stale_notices``) and dropped, and so are messages that are not notices
    (``bad_notices``). Each notice is handled on its own: one that raises aborts its
    reservation and is reported in ``failed``; the others are still handled. A
    reservation past its deadline (``reserve(..., timeout_s=)``, or ``wait``'s) is
    aborted.

Quarantine. A WRITE is one-sided: the sender reads the generation word before it writes
and refuses a closed reservation (``StaleDescriptorError``), but a sender that read it
before an abort may still be writing after it. So an abort does not return the
request's host blocks to the free list: they stay allocated to an owner that is no
request (``("pd-quarantine", agent name, generation)`` in the pool's block allocator),
so no other request can be given them and no row of theirs is ever read. They are
released (freed) when that generation's "done" or "fail" notice arrives (the sender's
transfers are over: completed, or cancelled before the notice), or ``quarantine_s``
after the abort, whichever comes first; a "fail" notice that says the sender could not
cancel its transfers (``in_flight``) leaves them to the timer. ``quarantine_s`` must
exceed what a sender can take between reading the word and its last write landing:
its ``read_timeout_s`` plus its ``send`` ``timeout_s`` (10 s + 30 s by default) plus a
margin (default 60 s). ``poll`` releases expired quarantines; ``quarantined()`` lists
them. Apart from those blocks (held, then free again) and the pool bytes a late WRITE
put in them, an abort leaves the cache as before ``reserve`` for every other request:
its table entries, lengths, slots, device pages and rows; counters that move with every
admission (``requests.generation``, the slot's ``born``) have moved on.

A request freed outside the receiver (``HiSparseCache.free_request`` or
``HiSparseIndexGroup.free_request`` of a reserved id) is handled as an abort: the
receiver listens on ``cache.free_listeners``, closes the reservation (word cleared),
puts the freed blocks in quarantine and reports the request in the next ``poll``'s
``failed`` (``wait`` raises ``TransferError``). As a second guard each reservation
records the slot's incarnation (``requests.incarnation``, distinct per admission) and
every call checks it: a mismatch clears the word (when it still holds the
reservation's generation) and drops the reservation, never touching the slot's new
occupant.

Generations start at ``time.time_ns()`` when the receiver is made and count up by one
per reservation, so a restarted receiver never hands out a generation an old
descriptor holds. The host pool must be this process's own (a pool several ranks
share, ``cache.pool.shared``, is refused: tensor parallelism is not supported yet).
Calls are not thread-safe: one thread drives a receiver.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .._checks import check_int
from ..cache.cache import HiSparseCache
from ..cache.write_pooled import write_pooled
from ..errors import CapacityError
from ..formats import RowFormat
from .descriptor import PDDescriptor, parse_notice
from .errors import PDError, StaleDescriptorError, TransferError, TransferTimeout
from .nixl_api import default_agent_name, make_agent

QUARANTINE_S = 60.0  # > a sender's read_timeout_s (10 s) + send timeout_s (30 s) + a 20 s margin


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
    born: int               # requests.incarnation(slot) at reserve: which admission it is


@dataclasses.dataclass
class Quarantine:
    """The blocks of an aborted reservation, held until no WRITE of it can land."""

    req_id: int
    generation: int
    blocks: list[int]
    until: float            # time.monotonic() after which they are freed whatever comes
    in_flight: bool = False  # a fail notice said its transfers could not be cancelled


@dataclasses.dataclass(frozen=True)
class PollResult:
    committed: tuple[int, ...]          # request ids committed by this poll
    failed: dict[int, str]              # request id -> why it was aborted


class PDReceiver:
    """The decode side (module docstring). ``name``: the NIXL agent's name, unique among
    the agents that talk to each other (default: host, pid and a random part);
    ``backends``: NIXL backends (UCX by default); ``quarantine_s``: how long an
    aborted reservation's blocks stay held at most."""

    def __init__(self, cache: HiSparseCache, *, name: str | None = None, backends: tuple[str, ...] = ("UCX",),
                 quarantine_s: float = QUARANTINE_S) -> None:
        if not isinstance(cache, HiSparseCache):
            raise TypeError(f"cache must be a HiSparseCache, got {type(cache).__name__}")
        if cache.pool.shared:
            raise ValueError("a P/D receiver needs a host pool of its own: this cache's pool is shared across "
                             "ranks (SharedHostPool), and P/D transfers under tensor parallelism are not "
                             "supported yet")
        if not (isinstance(quarantine_s, (int, float)) and not isinstance(quarantine_s, bool)
                and quarantine_s > 0):
            raise ValueError(f"quarantine_s must be a positive number of seconds, got {quarantine_s!r}")
        name = default_agent_name("decode") if name is None else name
        self.cache = cache
        cfg = cache.cfg
        self.row_format = row_format_name(cfg.row_bytes)
        self.quarantine_s = float(quarantine_s)
        self._agent = make_agent(name, tuple(backends), progress_thread=True)
        self.name = name
        pool = cache.pool.buffer.tensor  # uint8 [host_pool_bytes], the cache's host pool
        self._pool_base = pool.data_ptr()
        self._words = np.zeros(cfg.max_num_reqs, dtype=np.int64)  # generation per request slot, 0 = none
        self._regs = [self._agent.register_memory([(self._pool_base, pool.numel(), 0, "")], "DRAM"),
                      self._agent.register_memory([(self._words.ctypes.data, self._words.nbytes, 0, "")],
                                                  "DRAM")]
        self._metadata = self._agent.get_agent_metadata()
        self._next_gen = time.time_ns()  # above any generation an earlier receiver handed out
        self._open: dict[int, ReserveInfo] = {}
        self._quarantine: dict[int, Quarantine] = {}  # generation -> its held blocks
        self._finished: dict[int, str | None] = {}  # outcomes not yet taken by wait (None = committed)
        self._unreported: dict[int, str] = {}  # frees outside the receiver, for the next poll's failed
        self._aborting: int | None = None  # the request abort() is freeing (the listener knows it)
        self.stale_notices = 0
        self.bad_notices = 0
        cache.free_listeners.append(self._on_free)

    # ---- the three transitions ------------------------------------------------
    def reserve(self, req_id: int, num_tokens: int, *, timeout_s: float | None = None,
                salt: bytes | None = None) -> PDDescriptor:
        """Admit ``req_id`` and give it the blocks of ``num_tokens`` rows per layer (module
        docstring). ``timeout_s``: ``poll`` aborts the reservation after that long.
        ``salt`` (prefix caching): the salt of its block names, whose tokens
        ``cache.add_tokens`` gives later (the prompt, once committed)."""
        if salt is not None and not isinstance(salt, (bytes, bytearray)):
            raise TypeError(f"salt must be bytes or None, got {type(salt).__name__}")
        if salt is not None and self.cache.prefix is None:
            raise ValueError("salt needs a cache configured with prefix_caching=True")
        self._check_running("reserve")
        cache = self.cache
        check_int("req_id", req_id, 0, cache.cfg.max_request_id)
        check_int("num_tokens", num_tokens, 1)
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        self._drop_stale()
        if req_id in self._open or cache.requests.is_live(req_id):
            raise ValueError(f"request {req_id} is live already (reserve a new request id)")
        if len(cache.requests) >= cache.cfg.max_num_reqs:
            raise CapacityError(f"reserve request {req_id}: all {cache.cfg.max_num_reqs} request slots are taken")
        need = -(-num_tokens // cache.pool.B)
        free = cache.pool.allocator.num_free
        if need > free:
            held = sum(len(q.blocks) for q in self._quarantine.values())
            raise CapacityError(f"reserve request {req_id}: {num_tokens} tokens need {need} host blocks, "
                                f"{free} of {cache.pool.allocator.num_blocks} are free"
                                + (f" ({held} in quarantine)" if held else ""))
        cache.add_request(req_id, salt=salt)
        r = cache.request(req_id).slot
        try:
            cache.writer.allocate_for(r, num_tokens)  # blocks, no row written: the rows land from elsewhere
        except BaseException:
            cache.free_request(req_id)  # no reservation yet: the listener ignores it
            raise
        gen = self._next_gen
        self._next_gen += 1
        self._words[r] = gen
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._open[req_id] = ReserveInfo(req_id, r, gen, num_tokens, deadline, cache.requests.incarnation(r))
        self._finished.pop(req_id, None)
        self._unreported.pop(req_id, None)
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
        StaleDescriptorError for another generation, ValueError when the request holds
        rows already (nothing changed either way); PDError when the write fails (the
        reservation is aborted first: its blocks go into quarantine)."""
        res = self._reservation(req_id)
        if generation != res.generation:
            raise StaleDescriptorError(f"commit of request {req_id} with generation {generation}; the open "
                                       f"reservation has generation {res.generation}")
        cache = self.cache
        if any(cache.request(req_id).lengths):
            raise ValueError(f"request {req_id} holds rows {cache.request(req_id).lengths} although it is reserved: "
                             "nothing may append to a reserved request before its commit")
        self._words[res.slot] = 0  # from here on a send of this descriptor is refused
        try:
            step = cache.prepare_step(cache.plan_write([req_id], [res.num_tokens]), host_written=True)
            write_pooled(cache.writer, step)
        except BaseException as e:
            self._abort(res)
            raise PDError(f"commit of request {req_id} failed and the reservation was aborted: "
                          f"{type(e).__name__}: {e}") from e
        del self._open[req_id]

    def abort(self, req_id: int) -> None:
        """Free the request; its blocks go into quarantine (module docstring)."""
        self._abort(self._reservation(req_id))

    # ---- notifications ------------------------------------------------------------
    def poll(self) -> PollResult:
        """Act on the NIXL notifications that arrived, on expired deadlines and on
        expired quarantines. Never raises for what a notice holds (module docstring)."""
        self._check_running("poll")
        committed: list[int] = []
        failed, self._unreported = self._unreported, {}
        self._drop_stale(failed)
        try:
            notifs = self._agent.get_new_notifs()
        except BaseException:
            self._unreported.update(failed)  # reported by the next poll
            raise
        for msgs in notifs.values():
            for msg in msgs:
                parsed = parse_notice(msg)
                if parsed is None:
                    self.bad_notices += 1
                    continue
                try:
                    self._handle(parsed[0], parsed[1], committed, failed)
                except Exception as e:  # one notice's error: its reservation aborts, the rest go on
                    rid = parsed[1]["request_id"]
                    if rid in self._open:
                        self._fail(rid, f"the notice of request {rid} could not be handled: "
                                   f"{type(e).__name__}: {e}", failed)
                    else:
                        self.bad_notices += 1
        now = time.monotonic()
        for res in [r for r in self._open.values() if r.deadline is not None and now > r.deadline]:
            self._fail(res.req_id, f"no transfer of request {res.req_id} arrived before its deadline", failed)
        self.release_quarantine(now)
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
                self._finished.pop(req_id, None)
                raise TransferTimeout(f"request {req_id}: no transfer arrived in {timeout_s} s; the reservation "
                                      "was aborted (blocks in quarantine)")
            self.poll()
            if req_id not in self._finished:
                time.sleep(interval_s)

    def open_requests(self) -> list[int]:
        return sorted(self._open)

    def quarantined(self) -> dict[int, Quarantine]:
        """Generation -> the quarantine of its blocks (a copy)."""
        return {g: dataclasses.replace(q, blocks=list(q.blocks)) for g, q in self._quarantine.items()}

    def release_quarantine(self, now: float | None = None) -> list[int]:
        """Free the quarantined blocks whose time is up (``now``: time.monotonic(), default
        the current); returns their generations. Works after ``close`` too."""
        now = time.monotonic() if now is None else now
        gens = [g for g, q in self._quarantine.items() if now >= q.until]
        for g in gens:
            self._release(g)
        return gens

    def close(self) -> None:
        """Abort every open reservation (quarantined like any abort), free the
        quarantines whose time is up, deregister the memory and drop the agent (its
        progress thread stops). Quarantines still running stay held: call
        ``release_quarantine()`` after ``quarantine_s`` to free them."""
        if self._agent is None:
            return
        self._drop_stale()
        for rid in list(self._open):
            self.abort(rid)
        self.release_quarantine()
        try:
            for reg in self._regs:
                self._agent.deregister_memory(reg)
        finally:
            self._regs = []
            self._agent = None
            if self._on_free in self.cache.free_listeners:
                self.cache.free_listeners.remove(self._on_free)

    # ---- helpers ------------------------------------------------------------------
    def _check_running(self, what: str) -> None:
        if self._agent is None:
            raise PDError(f"{what}: the receiver {self.name!r} is closed")

    def _reservation(self, req_id: int) -> ReserveInfo:
        res = self._open.get(req_id)
        if res is None:
            raise StaleDescriptorError(f"request {req_id} has no open reservation (never reserved, or "
                                       "committed / aborted already)")
        if not self._same_admission(res):
            self._drop(res, self._freed_why(res))
            self._unreported[req_id] = self._freed_why(res)
            raise StaleDescriptorError(self._freed_why(res))
        return res

    def _same_admission(self, res: ReserveInfo) -> bool:
        reqs = self.cache.requests
        return reqs.slots_of([res.req_id])[0] == res.slot and reqs.incarnation(res.slot) == res.born

    @staticmethod
    def _freed_why(res: ReserveInfo) -> str:
        return (f"request {res.req_id} was freed while reserved (free_request outside the receiver): "
                "its reservation is closed")

    def _drop(self, res: ReserveInfo, why: str) -> None:
        """Close a reservation whose request is gone: clear its word unless the slot's
        new occupant holds it, forget it; its blocks are not ours to touch."""
        if self._words[res.slot] == res.generation:
            self._words[res.slot] = 0
        del self._open[res.req_id]
        self._finished[res.req_id] = why

    def _drop_stale(self, failed: dict[int, str] | None = None) -> None:
        for res in [r for r in self._open.values() if not self._same_admission(r)]:
            self._drop(res, self._freed_why(res))
            (self._unreported if failed is None else failed)[res.req_id] = self._freed_why(res)

    def _abort(self, res: ReserveInfo) -> None:
        self._aborting = res.req_id
        try:
            self.cache.free_request(res.req_id)  # _on_free closes it and quarantines the blocks
        finally:
            self._aborting = None

    def _on_free(self, req_id: int, slot: int, blocks: list[int]) -> None:
        """``cache.free_listeners``: a reserved request was freed (by ``_abort`` or from
        outside): close the reservation, quarantine its blocks."""
        res = self._open.get(req_id)
        if res is None or res.slot != slot or self.cache.requests.incarnation(slot) != res.born:
            return
        if self._words[slot] == res.generation:
            self._words[slot] = 0
        del self._open[req_id]
        self.cache.pool.allocator.claim(("pd-quarantine", self.name, res.generation), list(blocks))
        self._quarantine[res.generation] = Quarantine(req_id, res.generation, list(blocks),
                                                      time.monotonic() + self.quarantine_s)
        if self._aborting != req_id:
            why = self._freed_why(res) + "; its blocks are in quarantine"
            self._finished[req_id] = why
            self._unreported[req_id] = why

    def _release(self, generation: int) -> None:
        self._quarantine.pop(generation)
        self.cache.pool.allocator.free(("pd-quarantine", self.name, generation))

    def _fail(self, req_id: int, why: str, failed: dict[int, str]) -> None:
        """Abort ``req_id``'s reservation if it is still open; report ``why``."""
        if req_id in self._open:
            try:
                self._abort(self._open[req_id])
            except Exception as e:
                why += f" (and its abort raised {type(e).__name__}: {e})"
        failed[req_id] = why
        self._finished[req_id] = why

    def _handle(self, kind: str, f: dict, committed: list[int], failed: dict[int, str]) -> None:
        rid, gen = f["request_id"], f["generation"]
        q = self._quarantine.get(gen)
        if q is not None and q.req_id == rid:  # the sender of an aborted reservation is done
            if kind == "fail" and f.get("in_flight"):
                q.in_flight = True  # its transfers may still land: the timer frees them
            else:
                self._release(gen)
            return
        res = self._open.get(rid)
        if res is None or gen != res.generation:
            self.stale_notices += 1
            return
        problem = self._notice_problem(kind, f, res)
        if problem is None:
            try:
                self.commit(rid, gen)
            except Exception as e:  # a failed commit aborted it; a refused one (rows appended) did not
                problem = str(e) if isinstance(e, PDError) else \
                    f"commit of request {rid} refused: {type(e).__name__}: {e}"
            else:
                committed.append(rid)
                self._finished[rid] = None
                return
        self._fail(rid, problem, failed)
        if gen in self._quarantine and kind in ("done", "fail"):
            if f.get("in_flight"):
                self._quarantine[gen].in_flight = True  # its transfers may still land: the timer frees them
            else:
                self._release(gen)  # the sender's transfers are over

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


__all__ = ["PDReceiver", "ReserveInfo", "Quarantine", "PollResult", "row_format_name", "QUARANTINE_S"]
