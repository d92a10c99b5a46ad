"""The elastic tier's side of a write (``Writer``): apply a write's demotions and page
grants (``device_pool.apply_changes``) and, before that, record what puts them back
for a write whose launch then raises; refuse demotions of requests a prepared step
has not written yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .device_pool import PoolChanges, apply_changes

if TYPE_CHECKING:
    from .write import Writer
    from .write_step import StepPlan


def pool_undo(w: Writer, changes: PoolChanges) -> Callable[[], None]:
    """A function that puts back what ``apply_pool_changes(w, changes)`` is about to
    change (for a write whose launch then raises), from host-side records only: the
    pool's pages and counters, the page-table rows and residency flags, each demoted
    request's slot state and row maps (a resident request has none) and reserved
    occupants, and the layers' epochs. The bytes a demotion seeded stay in the slots
    it leaves unmapped again (no index points at them)."""
    dp, st, req = w.device_pool, w.state, w.requests
    free, pages = list(dp._free), {r: list(p) for r, p in dp._pages.items()}
    counters = (dp.spills, dp.seeded_rows, dp.epoch)
    epochs = list(req.epochs)
    B = w.pool.B
    seeded = {r: list(req.reserved_list(r)) for r in changes.demote}
    touched = sorted(set(changes.demote) | {r for r, want in changes.grants.items() if want})

    def undo() -> None:
        dp.restore(free, {r: list(p) for r, p in pages.items()}, counters)
        MP = st.page_table.shape[1]
        for r in touched:
            st.page_table[r] = torch.tensor(pages[r] + [-1] * (MP - len(pages[r])), dtype=torch.int32,
                                            device=w.device)
        for r, reserved in seeded.items():
            st.resident[r] = 1
            st.slot_pos[:, r] = -1
            st.slot_stamp[:, r] = -1
            # every host row of its blocks (whichever the demotion seeded): not hot
            blocks = torch.tensor(w.pool.allocator.owned(r), dtype=torch.long)
            h = (blocks[:, None] * B + torch.arange(B)).flatten().to(w.device)
            if h.numel():
                st.row_slot[:, h] = -1
            for layer, occ in enumerate(reserved):
                req.restore(r, layer, req.length(r, layer), occ)
        req.epochs[:] = epochs

    return undo


def apply_pool_changes(w: Writer, changes: PoolChanges, lengths: dict[int, list[int]]) -> None:
    """Demote and grant (``device_pool.apply_changes``) on the current stream, after
    every in-flight staging (a demotion rewrites LRU state the stage stream reads).
    ``lengths[r]``: a demoted request's rows per layer (default: the table's)."""
    if changes.demote:
        w.streams.join_staging()
    req = w.requests
    apply_changes(changes, pool=w.device_pool, state=w.state, hot=w.hot,
                  lengths=[lengths.get(r) or list(req.lengths(r)) for r in changes.demote],
                  set_reserved=lambda r, layer, occ: req.restore(r, layer, req.length(r, layer), occ),
                  last=w.last_selection)
    for layer in range(w.cfg.num_layers):
        req.touch(layer)


def check_demotions(w: Writer, changes: PoolChanges, replaces: StepPlan | None = None) -> None:
    """ValueError (nothing changed) when ``changes`` (a write of ``w``'s) would demote a
    request that a prepared step (other than ``replaces``, which is put back first) has
    not written to every layer yet: its lengths already count the step's rows but its
    pages don't hold them yet, so the demotion would seed those layers' hot buffers from
    rows not written, and the step's remaining writes would land in pages given away."""
    if not changes.demote:
        return
    req = w.requests
    for step in w.open_steps():
        if step is replaces or not step.pending:
            continue
        for rid, r, inc, *_ in step.req_work:
            if r in changes.demote and req.slot_map().get(rid) == r and req.incarnation(r) == inc:
                raise ValueError(
                    f"this write needs the device pages of resident request {rid}, whose prepared step "
                    f"has rows not written yet (layers {sorted(step.pending)}): write them (write_step) "
                    "or put them back (abandon_step, or prepare_step(..., replaces=step)) first")


__all__ = ["apply_pool_changes", "check_demotions", "pool_undo"]
