"""Index plan of a batched append (``HiSparseCache.append_rows_batch``).

A batched append writes several requests' new rows of one layer in a fixed number of
launches. Everything ``append_rows`` decides per request on the host (which block
table entries are new, which hot row / slot each position takes, which host row
mirrors it, which reserved-slot occupant is unmapped) is turned here into flat device
index lists, built as runs ``(start, length, step)`` on the host, expanded in one go
and moved to the device with one copy.

The plan depends only on the request slots, the positions written, the token offsets
in ``rows``, the previous reserved-slot occupants and the requests' host blocks, which
are the same for every layer of one forward; so the write path reuses a plan across
layers (``hisparse.cache.write``). Building a plan changes nothing: the blocks a write
still needs are passed in (``new_blocks``, what the allocator will hand out), and the
write path allocates them once its launches are enqueued.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

from .._checks import device_type
from .host_pool import block_segments

# one unit of work: (request slot r, first position p0, end position p1, first token of
# the request's rows in the batch, position in the reserved slot S before the write or -1)
Work = tuple[int, int, int, int, int]


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """Device index lists of one batched append (int64 unless noted; N* = list length).

    bt_r, bt_k: new block-table entries (request slot, logical block); bt_v int32 host block
    hot_dst: flat device rows written; hot_tok: token (row of ``rows``) written there
    sp_idx: flat index into slot_pos/slot_stamp [R * (S + 1)] of the layer (= hot_dst),
      -1 for a resident request's row (a pool page row: no slot state);
      sp_pos int32: position stored there; sp_r: request slot (for its step -> stamp)
    rs_h, rs_v int32: host rows mapped in row_slot and their slot
    unmap: host rows of previous reserved-slot occupants (row_slot -> -1)
    host_h, host_tok: host row of every written token and the token (+ int32 copies
      ``host_h32``, ``host_tok32`` for the row-copy kernel)
    len_r, len_v int32: request slot and its new length in the layer (seq_lens[layer])
    """

    bt_r: torch.Tensor
    bt_k: torch.Tensor
    bt_v: torch.Tensor
    hot_dst: torch.Tensor
    hot_tok: torch.Tensor
    sp_idx: torch.Tensor
    sp_pos: torch.Tensor
    sp_r: torch.Tensor
    rs_h: torch.Tensor
    rs_v: torch.Tensor
    unmap: torch.Tensor
    host_h: torch.Tensor
    host_tok: torch.Tensor
    host_h32: torch.Tensor
    host_tok32: torch.Tensor
    len_r: torch.Tensor
    len_v: torch.Tensor
    flat: torch.Tensor  # int64: every list above back to back, in _NAMES order
    counts: tuple[int, int, int, int, int, int]  # n_bt, n_hot, n_rs, n_unmap, n_host, n_len


_NAMES = ("bt_r", "bt_k", "bt_v", "hot_dst", "hot_tok", "sp_idx", "sp_pos", "sp_r", "rs_h", "rs_v",
          "unmap", "host_h", "host_tok", "len_r", "len_v")
_INT32 = ("bt_v", "sp_pos", "rs_v", "len_v")  # written into int32 state tensors


def expand_runs(runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """int64 [sum n] CPU: each run (start, n, step) expanded to start, start + step, ... (n values)."""
    if not runs:
        return torch.empty(0, dtype=torch.int64)
    t = torch.tensor(runs, dtype=torch.int64)  # [m, 3]
    n = t[:, 1]
    which = torch.repeat_interleave(torch.arange(t.shape[0]), n)
    first = torch.cumsum(n, 0) - n
    offs = torch.arange(int(n.sum())) - first[which]
    return t[which, 0] + t[which, 2] * offs


@dataclasses.dataclass(frozen=True)
class Resident:
    """The resident requests of a write (the elastic tier): ``pages[r]`` every pool
    page of request slot r after the write's grants; ``base`` the first pool row of a
    layer's flat view; ``PB`` rows per page."""

    pages: Mapping[int, Sequence[int]]
    base: int
    PB: int

    def row(self, r: int, p: int) -> int:
        return self.base + self.pages[r][p // self.PB] * self.PB + p % self.PB


NO_RESIDENT = Resident({}, 0, 1)


def build_write_plan(work: list[Work], *, owned: Mapping[int, Sequence[int]],
                     new_blocks: Mapping[int, Sequence[int]], B: int, S: int,
                     device: torch.device, resident: Resident = NO_RESIDENT) -> WritePlan:
    """The device index lists of ``work``.

    owned[r]: the host blocks request slot r holds now; new_blocks[r]: the blocks it
    gets for this write (appended after ``owned[r]``; absent = none). Same decisions as
    one request at a time: positions < S go to slot == position; the last position,
    if >= S, to the reserved slot S (unmapping the previous occupant); every position
    to its host row. A resident request (``resident.pages``) writes every position to
    its page row instead, with no slot state.
    """
    flat, sizes = plan_lists(work, owned=owned, new_blocks=new_blocks, B=B, S=S, resident=resident)
    return _to_plan(flat, sizes, device)


def plan_lists(work: list[Work], *, owned: Mapping[int, Sequence[int]],
               new_blocks: Mapping[int, Sequence[int]], B: int, S: int,
               resident: Resident = NO_RESIDENT) -> tuple[torch.Tensor, list[int]]:
    """The lists of ``build_write_plan`` on the host: int64 [sum(sizes)] CPU, back to
    back in ``_NAMES`` order, and their lengths."""
    if all(p1 == p0 + 1 for _, p0, p1, _, _ in work):
        return _single_row_plan(work, owned=owned, new_blocks=new_blocks, B=B, S=S, resident=resident)
    return _runs_plan(work, owned=owned, new_blocks=new_blocks, B=B, S=S, resident=resident)


def _runs_plan(work: list[Work], *, owned, new_blocks, B: int, S: int,
               resident: Resident = NO_RESIDENT) -> tuple[torch.Tensor, list[int]]:
    """The general ``build_write_plan``: runs per request, expanded in one go."""
    SP = S + 1
    PB = resident.PB
    runs: dict[str, list[tuple[int, int, int]]] = {n: [] for n in _NAMES}

    def put(name: str, start: int, n: int = 1, step: int = 1) -> None:
        runs[name].append((start, n, step))

    for r, p0, p1, t0, old in work:
        have = list(owned.get(r, ()))
        for k, blk in enumerate(new_blocks.get(r, ())):
            put("bt_r", r)
            put("bt_k", len(have) + k)
            put("bt_v", blk)
        blocks = have + list(new_blocks.get(r, ()))
        if r in resident.pages:  # every position to its page row, no slot state
            p = p0
            while p < p1:
                end = min(p1, (p // PB + 1) * PB)
                n = end - p
                put("hot_dst", resident.row(r, p), n)
                put("hot_tok", t0 + p - p0, n)
                put("sp_idx", -1, n, 0)
                put("sp_pos", p, n)
                put("sp_r", r, n, 0)
                p = end
        fit_end = min(p1, S) if r not in resident.pages else p0
        if p0 < fit_end:  # fits phase: position p -> slot p
            n = fit_end - p0
            put("hot_dst", r * SP + p0, n)
            put("hot_tok", t0, n)
            put("sp_idx", r * SP + p0, n)
            put("sp_pos", p0, n)
            put("sp_r", r, n, 0)
            for a, b, h in block_segments(blocks, B, p0, fit_end):
                put("rs_h", h, b - a)
                put("rs_v", a, b - a)
        last = p1 - 1
        if last >= S and r not in resident.pages:  # the newest row takes the reserved slot S
            if old >= 0:
                put("unmap", blocks[old // B] * B + old % B)
            put("hot_dst", r * SP + S)
            put("hot_tok", t0 + last - p0)
            put("sp_idx", r * SP + S)
            put("sp_pos", last)
            put("sp_r", r)
            put("rs_h", blocks[last // B] * B + last % B)
            put("rs_v", S)
        for a, b, h in block_segments(blocks, B, p0, p1):  # host mirror of every row
            put("host_h", h, b - a)
            put("host_tok", t0 + a - p0, b - a)
        put("len_r", r)
        put("len_v", p1)
    sizes = [sum(n for _, n, _ in runs[name]) for name in _NAMES]
    return expand_runs([x for name in _NAMES for x in runs[name]]), sizes


def _single_row_plan(work: list[Work], *, owned, new_blocks, B: int, S: int,
                     resident: Resident = NO_RESIDENT) -> tuple[torch.Tensor, list[int]]:
    """``build_write_plan`` when every request writes one row (a decode step): the same
    lists in the same order, built directly (no runs, no segments)."""
    SP = S + 1
    lists: dict[str, list[int]] = {n: [] for n in _NAMES}
    bt_r, bt_k, bt_v = lists["bt_r"], lists["bt_k"], lists["bt_v"]
    hot_dst, hot_tok, sp_idx = lists["hot_dst"], lists["hot_tok"], lists["sp_idx"]
    sp_pos, sp_r, rs_h, rs_v = lists["sp_pos"], lists["sp_r"], lists["rs_h"], lists["rs_v"]
    unmap, host_h, host_tok = lists["unmap"], lists["host_h"], lists["host_tok"]
    for r, p0, _p1, t0, old in work:
        blocks = owned.get(r, ())
        extra = new_blocks.get(r)
        if extra:  # the row opens a new block (and any it skips, as runs do)
            have = len(blocks)
            for j, blk in enumerate(extra):
                bt_r.append(r)
                bt_k.append(have + j)
                bt_v.append(blk)
            blocks = list(blocks) + list(extra)
        k = p0 // B
        h = blocks[k] * B + p0 % B
        if r in resident.pages:  # the row goes to its page row, no slot state
            hot_dst.append(resident.row(r, p0))
            hot_tok.append(t0)
            sp_idx.append(-1)
            sp_pos.append(p0)
            sp_r.append(r)
            host_h.append(h)
            host_tok.append(t0)
            lists["len_r"].append(r)
            lists["len_v"].append(p0 + 1)
            continue
        slot = p0 if p0 < S else S
        if p0 >= S and old >= 0:
            unmap.append(blocks[old // B] * B + old % B)
        hot_dst.append(r * SP + slot)
        hot_tok.append(t0)
        sp_idx.append(r * SP + slot)
        sp_pos.append(p0)
        sp_r.append(r)
        rs_h.append(h)
        rs_v.append(slot)
        host_h.append(h)
        host_tok.append(t0)
        lists["len_r"].append(r)
        lists["len_v"].append(p0 + 1)
    sizes = [len(lists[name]) for name in _NAMES]
    return torch.tensor([v for name in _NAMES for v in lists[name]], dtype=torch.int64), sizes


def _to_plan(flat: torch.Tensor, sizes: list[int], device: torch.device) -> WritePlan:
    """flat: int64 [sum(sizes)] CPU, the lists of ``_NAMES`` back to back -> the device plan."""
    if device_type(device) == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    views: dict[str, torch.Tensor] = {}
    o = 0
    for name, size in zip(_NAMES, sizes):
        v = flat[o:o + size]
        views[name] = v.to(torch.int32) if name in _INT32 else v
        o += size
    n = dict(zip(_NAMES, sizes))
    # the groups written together have one length each (apply_write_plan_kernel relies on it)
    for group in (("bt_r", "bt_k", "bt_v"), ("hot_dst", "hot_tok", "sp_idx", "sp_pos", "sp_r"),
                  ("rs_h", "rs_v"), ("host_h", "host_tok"), ("len_r", "len_v")):
        if len({n[g] for g in group}) != 1:
            raise RuntimeError(f"write plan lists of one group differ in length: {({g: n[g] for g in group})}")
    counts = (n["bt_r"], n["hot_dst"], n["rs_h"], n["unmap"], n["host_h"], n["len_r"])
    return WritePlan(**views, host_h32=views["host_h"].to(torch.int32),
                     host_tok32=views["host_tok"].to(torch.int32), flat=flat, counts=counts)


__all__ = ["WritePlan", "Work", "Resident", "NO_RESIDENT", "build_write_plan", "expand_runs"]
