"""A forward's append to every layer, planned once: the device side of ``Writer.prepare_step``.

An engine's forward appends the same tokens to every layer, so everything a write
decides on the host (blocks, hot slots, host rows, reserved-slot occupants) is the same
for all layers. ``Writer.prepare_step`` decides it once per forward and hands the
result to the per-layer writes as a :class:`StepPlan`; a per-layer write is then only
its two launches (host mirror, hot-tier update) over the plan's device lists.

Two differences from a plain ``write_plan.WritePlan``:
- The block-table entries of the step's new blocks are written once, when the step is
  prepared (the block table is shared by the layers), so the per-layer lists have
  none.
- With a capacity (``StepCapacity``, a CUDA-graph batch-size bucket) every list is
  padded with -1 to a fixed length and lives in persistent device buffers of that
  bucket: the per-layer launches then have the same shapes and pointers at every step,
  and a graph captured over them replays any later step of the bucket once the step's
  lists were copied in. The kernels skip -1 entries.
"""

from __future__ import annotations

import dataclasses

import torch

from .write_plan import _INT32, _NAMES, WritePlan

_BT = ("bt_r", "bt_k", "bt_v")


@dataclasses.dataclass(frozen=True)
class StepCapacity:
    """A bucket: at most ``requests`` requests writing ``tokens`` rows in all."""

    requests: int
    tokens: int

    def caps(self) -> dict[str, int]:
        """Fixed length of every plan list. Per request, the positions below S that it
        writes plus at most one into the reserved slot: hot and row_slot lists hold at
        most tokens + requests entries; one unmap and one length per request; a host
        row per token; block-table entries are not in step plans."""
        hot = self.tokens + self.requests
        caps = dict(hot_dst=hot, hot_tok=hot, sp_idx=hot, sp_pos=hot, sp_r=hot, rs_h=hot, rs_v=hot,
                    unmap=self.requests, host_h=self.tokens, host_tok=self.tokens,
                    len_r=self.requests, len_v=self.requests)
        caps.update({n: 0 for n in _BT})
        return caps


@dataclasses.dataclass
class StepPlan:
    """The per-layer device lists of one prepared step (``Writer.prepare_step``).

    plan: the lists (no block-table entries); req_work: (request id, request slot, its
    incarnation, first position, end position, reserved occupant before the step) per
    request written; pending: layers whose write has not run yet (none when no request
    writes a row: each layer's write is then a no-op); captured: layers whose
    write was captured in a CUDA graph (it runs when the graph is replayed); rows: how
    many rows a layer's write takes (the bucket's tokens when padded, else the batch's
    total); owner: the writer of the cache that prepared it (no other cache takes it);
    buffers: the bucket's persistent buffers (padded steps), which a later step of the
    bucket takes over.
    """

    plan: WritePlan
    req_work: tuple[tuple[int, int, int, int, int, int], ...]
    pending: set[int]
    rows: int
    generation: int
    owner: object = dataclasses.field(repr=False, compare=False)
    buffers: "PaddedPlan | None" = None
    captured: set[int] = dataclasses.field(default_factory=set)
    plan_recorded: bool = False  # the plan's lists were recorded on the backup stream

    def before(self, rid: int, slot: int, incarnation: int) -> tuple[int, int] | None:
        """(length, reserved occupant) the request had before this step, when the step
        writes it: the same id, slot and admission (None otherwise)."""
        for i, r, inc, p0, _, old in self.req_work:
            if i == rid and r == slot and inc == incarnation:
                return p0, old
        return None


@dataclasses.dataclass
class PaddedPlan:
    """The persistent device buffers of one capacity: ``flat`` int64 [sum of caps] holds
    every list back to back; ``plan`` is the WritePlan the kernels read (int64 views of
    ``flat``, int32 buffers for the int32 lists and the row-copy kernel's lists);
    ``views`` the int64 view of every list; ``owner``: the step whose lists are loaded."""

    flat: torch.Tensor
    plan: WritePlan
    views: dict
    owner: object = None

    def load(self, lists: torch.Tensor) -> None:
        """Copy a step's padded lists (int64 CPU, ``pad_lists``) in, on the current
        stream, and refresh the int32 buffers from them (in place: a captured graph
        reads these addresses)."""
        src = lists.pin_memory() if self.flat.is_cuda else lists
        self.flat.copy_(src, non_blocking=True)
        p, v = self.plan, self.views
        for name in _INT32:
            getattr(p, name).copy_(v[name])
        p.host_h32.copy_(v["host_h"])
        p.host_tok32.copy_(v["host_tok"])


class StepBuffers:
    """Persistent device buffers of padded step plans, one set per capacity."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[StepCapacity, PaddedPlan] = {}

    def get(self, cap: StepCapacity) -> PaddedPlan:
        got = self._bufs.get(cap)
        if got is None:
            caps = cap.caps()
            flat = torch.full((sum(caps[n] for n in _NAMES),), -1, dtype=torch.int64, device=self.device)
            i32 = dict(dtype=torch.int32, device=self.device)
            views, fields, o = {}, {}, 0
            for name in _NAMES:
                views[name] = flat[o:o + caps[name]]
                fields[name] = torch.full((caps[name],), -1, **i32) if name in _INT32 else views[name]
                o += caps[name]
            counts = tuple(caps[n] for n in ("bt_r", "hot_dst", "rs_h", "unmap", "host_h", "len_r"))
            plan = WritePlan(**fields, host_h32=torch.full((caps["host_h"],), -1, **i32),
                             host_tok32=torch.full((caps["host_tok"],), -1, **i32), flat=flat,
                             counts=counts)  # type: ignore[arg-type]
            got = PaddedPlan(flat=flat, plan=plan, views=views)
            self._bufs[cap] = got
        return got


def split_block_entries(flat: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(block-table entries int64 [3, n_bt] CPU, the other lists int64 CPU, their sizes
    with the block-table lists at 0) of a host plan (``write_plan.plan_lists``)."""
    n_bt = sizes[0]
    bt = flat[:3 * n_bt].view(3, n_bt)
    return bt, flat[3 * n_bt:], [0, 0, 0] + list(sizes[3:])


def pad_lists(rest: torch.Tensor, sizes: list[int], cap: StepCapacity) -> torch.Tensor:
    """The lists ``rest`` (int64 CPU, ``sizes`` in ``_NAMES`` order, no block-table
    entries) each padded with -1 to its capacity: int64 [sum of caps] CPU.
    ValueError when a list is longer than its capacity."""
    caps = cap.caps()
    out = torch.full((sum(caps[n] for n in _NAMES),), -1, dtype=torch.int64)
    i = o = 0
    for name, size in zip(_NAMES, sizes):
        c = caps[name]
        if size > c:
            raise ValueError(f"the step writes {size} {name} entries, more than its bucket holds ({c}); "
                             f"bucket {cap}")
        out[o:o + size] = rest[i:i + size]
        i += size
        o += c
    return out


__all__ = ["StepCapacity", "StepPlan", "PaddedPlan", "StepBuffers", "split_block_entries", "pad_lists"]
