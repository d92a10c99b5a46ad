"""The write path: new rows of several requests into one layer, as plan then commit.

``Writer.prepare(req_ids, counts)`` checks a batch once and returns a
:class:`WriteBatch` (the ids' slots, the row counts, their offsets in ``rows``);
``Writer.write(layer, batch, rows)`` appends the batch's rows to one layer. One batch
serves every layer of a forward: it is checked once, and the device index plan
(``write_plan``) built for the first layer is reused by the others.

A write is atomic: every check (rows' dtype, shape, device and layout, lengths,
capacity of the host pool) happens before anything changes; the launches follow, the
state-changing one last (host mirror on the backup stream, then the hot-tier update
on the compute stream); the host-side bookkeeping (block allocation, lengths,
reserved-slot occupants) is committed only after both launches were enqueued. A launch
that raises leaves every block, length, slot and counter as it was (a host mirror
that ran before the failure wrote only rows beyond the request's length, which no
call can read), the elastic tier's demotions and page grants included (put back from
host-side records; only the bytes a demotion seeded stay, in slots nothing maps).

Rows whose layout a kernel can't read as packed words (a row stride other than
``row_bytes``, a start not 16-byte aligned) are copied to a packed tensor first.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Sequence

import numpy as np
import torch

from .._checks import check_tensor, device_type, pack_rows
from ..config import HiSparseConfig
from ..errors import CapacityError
from .device_pool import NO_CHANGES, DevicePool, PoolChanges, seeded_reserved
from .host_pool import HostPool, int64_array
from .kernel_set import CacheKernels
from .requests import RequestTable
from .stager import CacheStreams
from .state import STAT_D2H_ROWS, HotState
from .write_batch import WriteBatch, check_ends, make_batch
from .write_pool import apply_pool_changes, check_demotions, pool_undo
from .write_carry import CarriedPlan
from .write_pooled import check_host_written, host_written_plans
from .write_plan import (NO_RESIDENT, Resident, WritePlan, Work, build_write_plan, packed_of, plan_lists, split_lists,
                         to_device)
from .write_step import (NO_BLOCK_ENTRIES, NO_WORK, DecodeCarry, StepBuffers, StepCapacity, StepPlan, StepWork,
                         pad_lists, single_row_hosts, single_row_step_lists, split_block_entries, step_rows,
                         step_summary)


class Writer:
    """Appends rows to a cache's layers (see the module docstring). kernel_set: the launches
    (``hisparse.cache.kernel_set``): ``apply_write`` (a plan's hot-tier update), ``mirror``."""

    def __init__(self, cfg: HiSparseConfig, *, requests: RequestTable, pool: HostPool,
                 state: HotState, hot: torch.Tensor, streams: CacheStreams,
                 kernel_set: CacheKernels, device: torch.device,
                 device_pool: DevicePool | None = None) -> None:
        self.cfg = cfg
        self.device_pool = device_pool if device_pool is not None else DevicePool(cfg)
        self.requests = requests
        self.pool = pool
        self.state = state
        self.hot = hot
        self.streams = streams
        self.kernel_set = kernel_set
        self.device = device
        self._plan: tuple[tuple, WritePlan] | None = None  # last committed plan and its key
        self._batch: WriteBatch | None = None  # the last batch ``prepare`` made
        self._carry: DecodeCarry | None = None  # what the last step left for the next, when a decode step
        self.hot_layers = list(hot)  # uint8 [N, row_bytes] per layer (views, made once)
        self.host_layers = list(pool.rows)  # uint8 [H, row_bytes] per layer
        self.step_buffers = StepBuffers(device)
        # host copy of state.block_table (int32 [R, NB], -1 = none) and each slot's block
        # count (int64 [R]): what the allocator handed each request slot, as arrays
        self.host_blocks = np.full((cfg.max_num_reqs, cfg.num_host_blocks), -1, dtype=np.int32)
        self.num_blocks = np.zeros(cfg.max_num_reqs, dtype=np.int64)
        # per layer, the flat int32 physical rows of its last resolve (set by the cache):
        # a demotion seeds the hot buffer with the rows they select first
        self.last_selection: list[torch.Tensor] | None = None
        # the steps prepared here that may still be pending, by id (weakly: a dropped step's
        # reference goes dead, and is dropped when the next step is added)
        self._open_steps: dict[int, weakref.ref] = {}

    # ---- checks ------------------------------------------------------------------
    def prepare(self, req_ids: Sequence[int], counts: Sequence[int]) -> WriteBatch:
        """Check a batch: distinct live ids, one count (int >= 0) each. The same ids
        and counts as the last batch, with no request added or freed since, give that
        batch again (its checks passed and its slots still hold)."""
        self._batch = make_batch(self.requests, req_ids, counts, owner=self, last=self._batch)
        return self._batch

    def check_batch(self, batch: object) -> WriteBatch:
        """``batch`` as a WriteBatch this writer made and still valid (TypeError, ValueError)."""
        if not isinstance(batch, WriteBatch):
            raise TypeError(f"batch must be a WriteBatch (Writer.prepare), got {type(batch).__name__}")
        if batch.owner is not self:
            raise ValueError("the write batch was planned by another cache (its request slots are that "
                             "cache's); plan it with this cache's plan_write")
        if batch.generation != self.requests.generation:
            raise ValueError("the write batch is out of date: requests were added or freed since "
                             "it was prepared; prepare it again")
        return batch

    def check_own_step(self, step: object) -> StepPlan:
        """``step`` as a StepPlan this writer prepared (TypeError, ValueError)."""
        if not isinstance(step, StepPlan):
            raise TypeError(f"step must be a StepPlan (prepare_step), got {type(step).__name__}")
        if step.owner is not self:
            raise ValueError("the step was prepared by another cache (its plan and request slots are that "
                             "cache's); prepare it with this cache's prepare_step")
        return step

    def check_rows(self, rows: object, n: int) -> torch.Tensor:
        """rows: uint8 [n, row_bytes] on the cache device -> packed rows."""
        rb = self.cfg.row_bytes
        rows = check_tensor("rows", rows, dtype=torch.uint8, ndim=2, device=self.device)
        if rows.shape[1] != rb:
            raise ValueError(f"rows must be uint8 [n, row_bytes={rb}], got shape {tuple(rows.shape)}")
        if rows.shape[0] != n:
            raise ValueError(f"the batch's counts sum to {n} but rows has {rows.shape[0]} rows")
        return pack_rows(rows, rb)

    # ---- the write -----------------------------------------------------------------
    def write(self, layer: int, batch: WriteBatch, rows: torch.Tensor) -> list[int]:
        """Append the batch's rows to ``layer`` (checked by the caller). Returns the first
        position written for each request. CapacityError (nothing changed) when the host
        pool can't supply the blocks."""
        self.check_batch(batch)
        rows = self.check_rows(rows, batch.total)
        req = self.requests
        lens, res = req.layer_rows(np.array(batch.slots, dtype=np.int64), layer)
        firsts = lens.tolist()
        work = [(r, p0, p0 + n, t0, old)
                for r, p0, n, t0, old in zip(batch.slots, firsts, batch.counts, batch.offsets, res.tolist()) if n]
        if not work:
            return firsts
        dp = self.device_pool
        key = (req.generation, dp.epoch, tuple(work))
        cached = self._plan is not None and self._plan[0] == key
        changes = NO_CHANGES
        if cached:
            plan, new_blocks = self._plan[1], {}  # type: ignore[index]
        else:
            new_blocks = self._new_blocks(work)
            changes = dp.plan([(r, p1) for r, _, p1, _, _ in work])
            check_demotions(self, changes)
            work = self._after_demotion(work, changes, {r: p0 for r, p0, *_ in work})
            alloc = self.pool.allocator
            plan = build_write_plan(work, owned={r: alloc.owned(r) for r, *_ in work},
                                    new_blocks=new_blocks, B=self.pool.B, S=self.cfg.device_buffer_size,
                                    device=self.device, resident=self._resident(changes))  # type: ignore[arg-type]
        undo = pool_undo(self, changes) if not changes.empty else None
        if new_blocks:  # cached blocks the write takes leave the prefix index before any launch
            self.pool.allocator.reclaim(sum(len(b) for b in new_blocks.values()))
        try:
            if undo is not None:
                apply_pool_changes(self, changes, {})
                key = (req.generation, dp.epoch, tuple(work))
            self._launch(layer, plan, rows)
        except BaseException:
            if undo is not None:  # the write changes nothing when a launch raises
                undo()
            raise
        # ---- commit the host-side bookkeeping (nothing here can fail for the caller) ----
        self._allocate(new_blocks)
        ws = np.array([w[0] for w in work], dtype=np.int64)
        p1 = np.array([w[2] for w in work], dtype=np.int64)
        keep = p1 - 1 >= self.cfg.device_buffer_size
        if dp.enabled:  # a resident request keeps no reserved occupant
            keep &= ~dp.resident_mask(ws)
        req.set_written_layer(ws, layer, p1, np.where(keep, p1 - 1, -1))
        req.touch(layer)
        self._plan = (key, plan)
        ev = self.streams.backup.event if (self.pool.is_writer and self.streams.cuda) else None
        self.pool.commit_append(layer, ev)
        return firsts

    # ---- a forward's write to every layer, planned once ------------------------------
    def prepare_step(self, batch: WriteBatch, *, capacity: StepCapacity | None = None,
                     replaces: StepPlan | None = None, host_written: bool = False,
                     ends: Sequence[int] | None = None) -> StepPlan:
        """Plan ``batch``'s append to every layer at once (``write_step`` per layer then
        only launches). Allocates the step's blocks, writes their block-table entries
        on the current stream and commits every layer's lengths and reserved-slot
        occupants: between this and a layer's ``write_step``, that layer's host lengths
        already count the step's rows (resolve a layer only after its write, as the
        engine façade enforces). ``replaces``: the previous step, whose layers that were not written
        are put back first (``abandon_step``; the checks here see those layers as put
        back). ``capacity``: pad the lists into the bucket's persistent buffers (fixed
        shapes and addresses, for CUDA graphs). Every layer must hold the same rows of
        each request (ValueError otherwise). A CapacityError or ValueError changes
        nothing (``replaces`` included). The host work is array operations over the
        batch (no loop over requests x layers). ``host_written`` (not with ``capacity``): the
        rows are in the host pool already (a transfer's), in blocks the requests hold (a
        step that would open one is refused: ValueError): no host mirror, and
        ``write_pooled`` writes every layer from the pool in one launch.
        ``ends``: the rows each request of the batch must hold after the step (ValueError,
        nothing changed, where its rows now plus its count differ)."""
        self.check_batch(batch)
        if replaces is not None:
            self.check_own_step(replaces)
        if capacity is not None and self.pool.shared:
            raise ValueError("padded (graph) steps need a private host pool: a shared pool publishes "
                             "every append from the host")
        if capacity is not None and host_written:  # a bucket's graph replays other steps, mirrored
            raise ValueError("host_written steps can't be padded (a bucket's graph replays other steps)")
        if capacity is not None and (len(batch.req_ids) > capacity.requests or batch.total > capacity.tokens):
            raise ValueError(f"the batch has {len(batch.req_ids)} requests and {batch.total} rows; the "
                             f"bucket holds {capacity.requests} and {capacity.tokens}")
        req, dp = self.requests, self.device_pool
        L, S, B = self.cfg.num_layers, self.cfg.device_buffer_size, self.pool.B
        rids, slots, counts, t0 = batch.arrays  # int64 [n] each, read only
        carry = self._carry  # the last decode step of this batch, the table as it left it: no summary
        if not (carry is not None and carry.batch is batch and carry.version == req._version
                and (replaces is None or not replaces.pending) and not host_written and not dp.enabled):
            carry = None
        # the lists of a step that follows a carried one of the same layout: from the last step's
        follow = carry.follow if carry is not None and carry.follow is not None and carry.follow.capacity == capacity \
            else None
        new = cross = None
        if carry is not None:
            p0, old = carry.p1, carry.last
            if follow is not None:  # (p1 is among those lists)
                new, p1, cross = follow.advance(B)
        else:
            same, p0, old = self.visible_summary(replaces, batch.req_ids, slots)  # [n] each, read only
            if np.count_nonzero(same) < len(same):  # the first request whose layers differ
                i = int((~same).argmax())
                rid = batch.req_ids[i]
                raise ValueError(f"request {rid} holds {self.visible(replaces, rid, batch.slots[i])[0]} rows per "
                                 "layer: a step writes the same positions to every layer")
        if new is None:
            p1 = p0 + counts  # int64 [n]: the rows of each request after the step
        if ends is not None and p1.tolist() != list(ends):
            check_ends(batch, p0, ends)
        ws = slots
        if not batch.all_write:  # some requests write no row
            w = np.flatnonzero(counts)  # the requests that write
            ws, rids, t0, p0, p1, old, counts = slots[w], rids[w], t0[w], p0[w], p1[w], old[w], counts[w]
        inc = carry.inc if carry is not None else req.born[ws]
        work = StepWork(rid=rids, slot=ws, inc=inc, p0=p0, p1=p1, old=old) if len(ws) else NO_WORK
        single = bool(len(work)) and batch.single_rows  # a decode step: one row each
        if carry is not None:  # each row's host row, a block it opens allocated as by _opened_blocks
            new_blocks, bt_new = {}, NO_BLOCK_ENTRIES
            if new is None:
                new_blocks, bt_new, host_row = single_row_hosts(ws, p0, p1, self.num_blocks, self.host_blocks, B,
                                                                self._new_blocks_of)
            elif cross is not None:  # following the last step's lists: only the rows that start a block
                new_blocks, bt_new, h = single_row_hosts(ws[cross], p0[cross], p1[cross], self.num_blocks,
                                                         self.host_blocks, B, self._new_blocks_of)
                follow.set_host_rows(new, cross, h)
        else:
            if host_written:  # (before the allocator's own check: this is the caller's mistake)
                check_host_written(work, self.num_blocks, B)
            new_blocks, need = self._opened_blocks(work) if single else self._new_blocks_of(work.slot, work.p1)
        changes = NO_CHANGES
        if len(work) and dp.enabled and (not single or dp.needs_pages(work.slot, work.p1)):
            changes = dp.plan(list(zip(work.slot.tolist(), work.p1.tolist())))
        if changes.demote:
            check_demotions(self, changes, replaces)
        if changes.demote:  # rows per layer of each demoted request, as this step sees them
            ids = {r: rid for rid, r in req.slot_map().items()}
            demoted = {r: self.visible(replaces, ids[r], r)[0] for r in changes.demote}
            fixed = self._after_demotion([(r, 0, 0, 0, o) for r, o in zip(work.slot.tolist(), work.old.tolist())],
                                         changes, {r: demoted[r][0] for r in changes.demote})
            work = dataclasses.replace(work, old=np.array([x[4] for x in fixed], dtype=np.int64))
        if new is not None:
            lists = None
        elif not len(work):
            lists = [np.zeros(0, dtype=np.int64)] * 15
        elif carry is not None:
            lists = carry.lists(work, t0, host_row, bt_new)
        elif single:  # (changes made only when pages are needed: page rows from the pool's arrays)
            res_row = dp.page_rows(work.slot, work.p0, changes) if dp.enabled else None
            lists = single_row_step_lists(work, t0, need, new_blocks, host_blocks=self.host_blocks,
                                          num_blocks=self.num_blocks, B=self.pool.B, S=S, res_row=res_row)
        else:
            resident = self._resident(changes)
            alloc = self.pool.allocator
            tuples = list(zip(work.slot.tolist(), work.p0.tolist(), work.p1.tolist(), t0.tolist(),
                              work.old.tolist()))
            flat, sizes = plan_lists(tuples, owned={r: alloc.owned(r) for r, *_ in tuples}, new_blocks=new_blocks,
                                     B=self.pool.B, S=S, resident=resident, mirror=not host_written)
            lists = split_lists(flat.numpy(), sizes)
        if new is not None:
            bt, packed, layout = bt_new, new, follow.layout
        else:  # host_written: no mirror, no host lists
            bt, lists = split_block_entries(lists, host=not host_written)
            layout, packed = (capacity.layout(), pad_lists(lists, capacity)) if capacity is not None else packed_of(lists)
        if capacity is not None:
            padded = self.step_buffers.get(capacity)
            self.streams.join_backup()  # a mirror still reading the buffers of an eager step
            padded.load(packed)
            plan, rows = padded.plan, capacity.tokens
        else:
            padded, rows = None, batch.total
            taken = follow.host.take(follow.steps % 2, new) if new is not None and follow.host is not None else None
            if host_written and len(work):  # with the plan each hot row of which is read from the pool
                plan, pooled = host_written_plans(self, packed, layout, lists, work, t0)
            else:
                plan = taken if taken is not None else WritePlan(to_device(packed, self.device), layout)
        if bt.size:
            btt = torch.from_numpy(bt)
            btd = btt.pin_memory().to(self.device, non_blocking=True) if self.streams.cuda else btt
            self.state.block_table[btd[0], btd[1]] = btd[2].to(torch.int32)
        # ---- commit the host-side bookkeeping of every layer ----
        if replaces is not None:
            self.abandon_step(replaces)
        if not changes.empty:
            undo = pool_undo(self, changes)
            try:
                apply_pool_changes(self, changes, demoted if changes.demote else {})
            except BaseException:
                undo()  # the pool, page table, residency and slot state as they were
                if bt.size:  # and the new blocks' block-table entries (-1 before)
                    self.state.block_table[btd[0], btd[1]] = -1
                raise
        if new_blocks:
            self._allocate(new_blocks)
        self._carry = None
        if len(work):
            last = work.p0 if single else work.p1 - 1  # each request's newest row
            kept = carry is not None  # (a carried step's rows are past S: each takes the reserved slot)
            if not kept:
                keep = last >= S
                if dp.enabled:  # a resident request keeps no reserved occupant
                    keep &= ~dp.resident_mask(work.slot)
                kept = np.count_nonzero(keep) == len(keep)
            if carry is not None:  # uniform since the carried step, each row the new occupant
                req.set_uniform_rows(work.slot, work.p1, last)
            else:
                req.set_written_rows(work.slot, work.p1, last if kept else np.where(keep, last, -1))
            if kept and single and batch.all_write and not host_written and not dp.enabled:
                # a carried step's packed lists are those the next carried step's follow from
                nxt = None if carry is None else follow.following(new, cross) if new is not None else \
                    CarriedPlan.start(packed, layout, capacity, work.p1, B, device_type(self.device) == "cpu")
                self._carry = DecodeCarry(batch=batch, version=req._version, p1=work.p1, last=last,
                                          h=lists[11] if new is None else nxt.host_rows(), inc=work.inc,
                                          hot_dst=lists[3] if new is None else carry.hot_dst,
                                          slot=lists[9] if new is None else carry.slot, follow=nxt)
        req.touch_all()
        self._plan = None
        step = StepPlan(plan=plan, work=work, pending=set(range(L)) if len(work) else set(),
                        rows=rows, generation=batch.generation, owner=self, buffers=padded,
                        host_written=bool(host_written), host_rows=int(counts.sum()) if host_written else 0,
                        pooled=pooled if host_written and len(work) else None)
        if padded is not None:
            padded.owner = step
        elif taken is not None:
            follow.host.own(follow.steps % 2, step)
        if step.pending:
            self._track(step)
        return step

    def _track(self, step: StepPlan) -> None:
        """Keep a weak reference to ``step`` among the open steps (the dead ones dropped)."""
        opened = self._open_steps
        for k in [k for k, ref in opened.items() if ref() is None]:
            del opened[k]
        opened[id(step)] = weakref.ref(step)

    def open_steps(self) -> list[StepPlan]:
        """The steps prepared here that are still referenced, in the order they were prepared."""
        return [s for s in (ref() for ref in list(self._open_steps.values())) if s is not None]

    def visible_rows(self, step: StepPlan | None, req_ids: Sequence[int],
                     slots: tuple[int, ...] | np.ndarray) -> np.ndarray:
        """int64 [n, 2, L]: rows per layer (``[:, 0]``) and reserved occupant per layer
        (``[:, 1]``) of live requests ``req_ids`` in ``slots`` (ints or int64 [n]),
        counting a layer that ``step`` has not written yet as it was before the step."""
        if step is not None:
            self.check_own_step(step)
        return step_rows(self.requests, step, req_ids, slots)

    def visible_summary(self, step: StepPlan | None, req_ids: Sequence[int],
                        slots: tuple[int, ...] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``visible_rows`` summed up (``write_step.step_summary``): (same bool [n],
        len0, res0 int64 [n], read only)."""
        if step is not None:
            self.check_own_step(step)
        return step_summary(self.requests, step, req_ids, slots)

    def visible(self, step: StepPlan | None, rid: int, slot: int) -> tuple[list[int], list[int]]:
        """(rows per layer, reserved occupant per layer) of live request ``rid`` in
        ``slot``, a layer that ``step`` has not written yet counted as before the step."""
        rows = self.visible_rows(step, (rid,), np.array([slot], dtype=np.int64))
        return rows[0, 0].tolist(), rows[0, 1].tolist()

    def write_step(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """Launch ``step``'s write of ``layer`` (rows uint8 [step.rows, row_bytes]; when
        padded, rows past the batch's are not read). A launch that raises leaves the
        layer pending (a retry runs it again). A step of zero rows launches nothing, as
        ``write`` of its batch."""
        self.check_step(layer, step)
        rows = self.check_rows(rows, step.rows)
        if not len(step.work):
            return
        # a padded plan's buffers persist; an eager one's lists (read on the backup stream) are recorded once
        record_plan = not (step.buffers is not None or step.plan_recorded)
        if self._launch(layer, step.plan, rows, record_plan=record_plan, mirror=not step.host_written,
                        counted=step.host_rows) and record_plan:
            step.plan_recorded = True
        self._finish_step(layer, step)

    def run_step(self, layer: int, step: StepPlan, launch: Callable[[], None]) -> None:
        """``write_step`` of a padded step whose launches ``launch()`` enqueues (a replay
        of a graph captured over :meth:`enqueue_step`): the same checks first, the same
        bookkeeping after. A ``launch`` that raises leaves the layer pending; zero rows: nothing."""
        self.check_step(layer, step)
        if step.buffers is None:
            raise ValueError("only a padded step's write (persistent lists) can be replayed")
        if not len(step.work):
            return
        launch()
        self._finish_step(layer, step, capturing=False)

    def enqueue_step(self, layer: int, step: StepPlan, rows: torch.Tensor) -> None:
        """The launches of ``write_step`` alone (rows checked by the caller, packed), for
        a graph capture: no bookkeeping. The current stream then waits for the host
        mirror, so that a graph captured over this call joins every stream it used."""
        self.check_own_step(step)
        self._launch(layer, step.plan, rows, record_plan=False)  # padded: never host_written
        self.streams.join_backup()

    def check_step(self, layer: int, step: StepPlan) -> None:
        """ValueError when ``layer`` of ``step`` can't be written now (stale step, bucket
        buffers taken over by a later step, layer already written; a step of another
        cache)."""
        self.check_own_step(step)
        if step.generation != self.requests.generation:
            raise ValueError("the step is out of date: requests were added or freed since it was prepared; "
                             "prepare the forward again (prepare_for_batch)")
        if step.buffers is not None and step.buffers.owner is not step:
            raise ValueError("the step's bucket buffers hold a later step's lists: prepare it again")
        if layer not in step.pending and len(step.work):  # a step of zero rows has nothing pending
            raise ValueError(f"layer {layer}: this step's rows were already written")

    def _finish_step(self, layer: int | range, step: StepPlan, capturing: bool | None = None) -> None:
        """The host side of a layer's write, once its launches were enqueued
        (``capturing``: whether they were captured, when the caller knows)."""
        layers = range(layer, layer + 1) if isinstance(layer, int) else layer  # or a range of them
        step.pending.difference_update(layers)
        if capturing if capturing is not None else self.streams.capturing():
            step.captured.update(layers)  # runs when the graph is replayed
        ev = self.streams.backup.event if (self.pool.is_writer and self.streams.cuda) else None
        for lay in layers:
            self.requests.touch(lay)  # results held from before the write are stale
            self.pool.commit_append(lay, ev)

    def abandon_step(self, step: StepPlan, *, captured: bool = False) -> None:
        """Put back the lengths and reserved-slot occupants of the layers whose write did
        not run (with ``captured``: also those captured in a graph, for a capture that
        failed and will never replay), for every request of the step still live in the
        same admission (their positions are free again; the step's blocks stay with
        their requests, block-table entries included). Requests freed since hold
        nothing to put back."""
        self.check_own_step(step)
        if not (step.pending or (captured and step.captured)):
            return
        layers = step.pending | (step.captured if captured else set())
        req, w = self.requests, step.work
        if len(w):  # the step's requests still live in the same admission
            now = [-1 if s is None else s for s in req.slots_of(w.rid.tolist())]
            same = (np.array(now, dtype=np.int64) == w.slot) & (req.born[w.slot] == w.inc)
            req.restore_rows(w.slot[same], np.array(sorted(layers), dtype=np.int64), w.p0[same], w.old[same])
        for layer in sorted(layers):
            req.touch(layer)
        step.pending.clear()
        if captured:
            step.captured.clear()

    # ---- the elastic tier ---------------------------------------------------------
    def _resident(self, changes: PoolChanges) -> Resident:
        if not changes.pages:
            return NO_RESIDENT
        dp = self.device_pool
        return Resident(changes.pages, dp.base, dp.PB)

    def _after_demotion(self, work: list[Work], changes: PoolChanges, lens: dict[int, int]) -> list[Work]:
        """``work`` with each demoted request's reserved occupant as the demotion seeds it
        (``lens[r]``: its rows in the layer(s) written)."""
        if not changes.demote:
            return work
        S = self.cfg.device_buffer_size
        return [(r, p0, p1, t0, seeded_reserved(lens[r], S) if r in changes.demote else old)
                for r, p0, p1, t0, old in work]

    def unwritten_from(self) -> dict[int, int]:
        """{request slot: first position} of the rows that a prepared step counts in the
        slot's lengths but has not written to every layer yet (a layer pending, or captured
        and so written only when its graph replays): prefix caching publishes no block
        past it."""
        out: dict[int, int] = {}
        req = self.requests
        for step in self.open_steps():
            if not (step.pending or step.captured):
                continue
            for rid, r, inc, p0, *_ in step.req_work:
                if req.slot_map().get(rid) == r and req.incarnation(r) == inc:
                    out[r] = min(out.get(r, p0), p0)
        return out

    def _new_blocks(self, work: list[Work]) -> dict[int, list[int]]:
        """Blocks each request of ``work`` needs, as the allocator will hand them out
        (CapacityError, nothing changed, when they are not all free)."""
        return self._new_blocks_of(np.array([w[0] for w in work], dtype=np.int64),
                                   np.array([w[2] for w in work], dtype=np.int64))[0]

    def _opened_blocks(self, work: StepWork) -> tuple[dict[int, list[int]], np.ndarray | None]:
        """``_new_blocks_of(work.slot, work.p1)`` of a step whose every request writes one
        row; ({}, None) when none of them opens a block (the row past its blocks)."""
        if not np.count_nonzero(work.p0 // self.pool.B >= self.num_blocks[work.slot]):
            return {}, None
        return self._new_blocks_of(work.slot, work.p1)

    def _new_blocks_of(self, slots: np.ndarray, ends: np.ndarray) -> tuple[dict[int, list[int]], np.ndarray]:
        """(blocks each request slot of ``slots`` (int64 [n]) needs to hold ``ends``
        (int64 [n]) rows, as the allocator will hand them out (absent: none), and how
        many, int64 [n]). CapacityError, nothing changed, when they are not all free."""
        need = np.maximum(0, -(-ends // self.pool.B) - self.num_blocks[slots])
        total = int(need.sum())
        alloc = self.pool.allocator
        if total > alloc.num_free:
            raise CapacityError(
                f"host pool full: {total} more blocks needed, {alloc.num_free} free of {alloc.num_blocks}; "
                "free requests or configure a larger pool")
        out, o = {}, 0
        if total:
            upcoming = alloc.peek(total)
            for i in np.flatnonzero(need).tolist():
                n = int(need[i])
                out[int(slots[i])] = upcoming[o:o + n]
                o += n
        return out, need

    def _allocate(self, new_blocks: dict[int, list[int]]) -> None:
        alloc = self.pool.allocator
        for r, want in new_blocks.items():
            got = alloc.allocate(r, len(want))
            if got != want:
                raise RuntimeError(f"the allocator handed request slot {r} blocks {got}, the write "
                                   f"planned with {want}")
            k = int(self.num_blocks[r])
            self.host_blocks[r, k:k + len(got)] = int64_array(got)
            self.num_blocks[r] = k + len(got)

    def allocate_for(self, r: int, num_tokens: int) -> list[int]:
        """Give request slot r the host blocks that hold positions ``0 .. num_tokens - 1``
        (block-table entries written on the current stream) without writing a row: the
        rows arrive some other way and a write of them follows (``hisparse.pd``).
        Returns the new blocks. CapacityError, nothing changed, when they are not free."""
        new_blocks, _ = self._new_blocks_of(np.array([r], dtype=np.int64), np.array([num_tokens], dtype=np.int64))
        got = new_blocks.get(r, [])
        if got:
            k = int(self.num_blocks[r])
            self.state.block_table[r, k:k + len(got)] = torch.from_numpy(
                int64_array(got).astype(np.int32)).to(self.device)
            self._allocate(new_blocks)
        return got

    def release(self, r: int) -> None:
        """Request slot r's blocks went back to the pool (``free_request``)."""
        self.host_blocks[r, :self.num_blocks[r]] = -1
        self.num_blocks[r] = 0

    def _launch(self, layer: int, plan: WritePlan, rows: torch.Tensor, *, record_plan: bool = True,
                mirror: bool = True, counted: int = 0) -> bool:
        """Host mirror on the backup stream, then the hot-tier update on the compute stream.

        The caching allocator is told that ``rows`` (and with ``record_plan`` the plan's
        row-copy lists) are read on the backup stream; returns whether it was (CUDA,
        outside a graph capture). ``counted``: host rows not in the plan, added to the D2H counter."""
        cs = self.streams
        cur, cap = cs.before_write(layer)
        if plan.counts[3]:  # unmap entries
            # the old occupants must be on host before their hot rows are overwritten
            cs.backup.wait_by(cur, cap)
        backup = cs.streams.backup
        if backup is not None:
            cs.follow(backup, cur)
        with cs.streams.on(backup):
            if self.pool.is_writer and mirror:
                self.kernel_set.mirror(rows, plan, self.host_layers[layer])
            cs.backup.record(backup, cap)
        recorded = backup is not None and not cap
        if recorded:  # read on the backup stream
            rows.record_stream(backup)
            if record_plan:
                plan.host_tok32.record_stream(backup)
                plan.host_h32.record_stream(backup)
        self.kernel_set.apply_write(self.state, self.hot_layers[layer], rows, plan, layer)
        if counted:
            self.state.stats[layer, STAT_D2H_ROWS].add_(counted)
        return recorded


__all__ = ["WriteBatch", "Writer", "pack_rows", "StepCapacity", "StepPlan"]
