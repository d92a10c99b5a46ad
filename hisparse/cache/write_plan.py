"""Index plan of a batched append (``HiSparseCache.write`` of a ``plan_write`` batch).

A batched append writes several requests' new rows of one layer in a fixed number of
launches. Everything per-request ``write`` decides per request on the host (which block
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
import functools
import itertools
from typing import Mapping, Sequence

import numpy as np
import torch

from .._checks import device_type
from .host_pool import block_segments

# one unit of work: (request slot r, first position p0, end position p1, first token of
# the request's rows in the batch, position in the reserved slot S before the write or -1)
Work = tuple[int, int, int, int, int]


_NAMES = ("bt_r", "bt_k", "bt_v", "hot_dst", "hot_tok", "sp_idx", "sp_pos", "sp_r", "rs_h", "rs_v",
          "unmap", "host_h", "host_tok", "len_r", "len_v")
_INT32 = ("bt_v", "sp_pos", "rs_v", "len_v")  # written into int32 state tensors
_HOST_H = _NAMES.index("host_h")  # host_tok follows it


def expand_runs(runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """int64 [sum n] CPU: each run (start, n, step) expanded to start, start + step, ... (n values)."""
    if not runs:
        return torch.empty(0, dtype=torch.int64)
    t = np.array(runs, dtype=np.int64)  # [m, 3] (numpy: a third of torch's host time for these small ops)
    n = t[:, 1]
    which = np.repeat(np.arange(len(t)), n)
    first = np.cumsum(n) - n
    offs = np.arange(int(n.sum())) - first[which]
    return torch.from_numpy(t[which, 0] + t[which, 2] * offs)


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
               resident: Resident = NO_RESIDENT, mirror: bool = True) -> tuple[torch.Tensor, list[int]]:
    """The lists of ``build_write_plan`` on the host: int64 [sum(sizes)] CPU, back to
    back in ``_NAMES`` order, and their lengths. ``mirror=False``: the host lists
    (host_h, host_tok) are left empty (rows already in the host pool: no mirror)."""
    if all(p1 == p0 + 1 for _, p0, p1, _, _ in work):
        flat, sizes = _single_row_plan(work, owned=owned, new_blocks=new_blocks, B=B, S=S, resident=resident)
        if mirror:
            return flat, sizes
        lists = without_host_lists(split_lists(flat.numpy(), sizes))
        return torch.from_numpy(np.concatenate(lists)), [len(x) for x in lists]
    return _runs_plan(work, owned=owned, new_blocks=new_blocks, B=B, S=S, resident=resident, mirror=mirror)


def _runs_plan(work: list[Work], *, owned, new_blocks, B: int, S: int,
               resident: Resident = NO_RESIDENT, mirror: bool = True) -> tuple[torch.Tensor, list[int]]:
    """The general ``build_write_plan``: runs per request, expanded in one go
    (``mirror=False``: no host lists)."""
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
        for a, b, h in block_segments(blocks, B, p0, p1) if mirror else ():  # host mirror of every row
            put("host_h", h, b - a)
            put("host_tok", t0 + a - p0, b - a)
        put("len_r", r)
        put("len_v", p1)
    sizes = [sum(n for _, n, _ in runs[name]) for name in _NAMES]
    return expand_runs([x for name in _NAMES for x in runs[name]]), sizes


def _single_row_plan(work: list[Work], *, owned, new_blocks, B: int, S: int,
                     resident: Resident = NO_RESIDENT) -> tuple[torch.Tensor, list[int]]:
    """``build_write_plan`` when every request writes one row (a decode step): the same
    lists in the same order, built directly (``single_row_lists``; no runs, no
    segments)."""
    bt: list[tuple[int, int, int]] = []
    h, h_old, res_row = [], [], []
    for r, p0, _p1, _t0, old in work:
        blocks = owned.get(r, ())
        extra = new_blocks.get(r)
        if extra:  # the row opens a new block (and any it skips, as runs do)
            bt.extend((r, len(blocks) + j, blk) for j, blk in enumerate(extra))
            blocks = list(blocks) + list(extra)
        h.append(blocks[p0 // B] * B + p0 % B)
        hot = r not in resident.pages
        h_old.append(blocks[old // B] * B + old % B if hot and p0 >= S and old >= 0 else -1)
        res_row.append(-1 if hot else resident.row(r, p0))
    w = np.array(work, dtype=np.int64).reshape(len(work), 5)
    i64 = np.int64
    lists = single_row_lists(w[:, 0], w[:, 1], w[:, 3], w[:, 4], np.array(h, dtype=i64),
                             np.array(h_old, dtype=i64), np.array(bt, dtype=i64).reshape(-1, 3).T,
                             S=S, res_row=np.array(res_row, dtype=i64))
    return torch.from_numpy(np.concatenate(lists)), [len(x) for x in lists]


def single_row_lists(r: np.ndarray, p0: np.ndarray, t0: np.ndarray, old: np.ndarray, h: np.ndarray,
                     h_old: np.ndarray, bt: np.ndarray, *, S: int,
                     res_row: np.ndarray | None, p1: np.ndarray | None = None) -> list[np.ndarray]:
    """The lists of ``build_write_plan`` when every request writes one row (a decode
    step), as array operations: one int64 numpy array per list, in ``_NAMES`` order.

    Per request written, in order (int64 [n] numpy each): r its slot, p0 the position
    written, t0 its row in ``rows``, old the reserved slot's occupant before the write
    (-1 = none), h the host row of p0, h_old the host row of ``old`` (read only where
    p0 >= S and old >= 0), res_row its page row when resident (-1: a hot request; None:
    every request is hot), p1 p0 + 1 (None: made here). bt: int64 [3, n_bt], the new
    block-table entries (slot, logical block, host block). Same decisions as
    ``_runs_plan``: a hot request's position < S goes to slot == position, a later one
    to the reserved slot S (unmapping the previous occupant); a resident request's to
    its page row, with no slot state; every row to its host row.
    """
    slot = np.minimum(p0, S)
    hot_dst = r * (S + 1) + slot
    moved = (p0 >= S) & (old >= 0)  # the newest row takes the reserved slot from an occupant
    if res_row is None:
        sp_idx, rs_h, rs_v = hot_dst, h, slot
    else:
        hot = res_row < 0
        hot_dst = np.where(hot, hot_dst, res_row)
        sp_idx = np.where(hot, hot_dst, -1)
        rs_h, rs_v = h[hot], slot[hot]
        moved &= hot
    return [bt[0], bt[1], bt[2], hot_dst, t0, sp_idx, p0, r, rs_h, rs_v, h_old[moved], h, t0, r,
            p0 + 1 if p1 is None else p1]


# the int32 copies a plan carries, host_h and host_tok first (16-byte aligned, for the
# row-copy kernel): WritePlan's int32 lists and host_h32 / host_tok32
_I32_LISTS = ("host_h", "host_tok") + _INT32
_I32_INDEX = tuple(_NAMES.index(n) for n in _I32_LISTS)
_NAME_INDEX = {n: i for i, n in enumerate(_NAMES)}
_GROUP_INDEX = tuple(tuple(_NAMES.index(n) for n in group) for group in (
    ("bt_r", "bt_k", "bt_v"), ("hot_dst", "hot_tok", "sp_idx", "sp_pos", "sp_r"), ("rs_h", "rs_v"),
    ("host_h", "host_tok"), ("len_r", "len_v")))


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """Where a plan's lists lie in one int64 buffer: every list of ``_NAMES`` back to
    back (``o64``, lengths ``caps``; the apply kernel reads them as ``flat``), then,
    from int64 word ``n64`` (even: 16-byte aligned) on, the int32 copies of
    ``_I32_LISTS`` (``o32``: int32 offsets there, each a multiple of 4). ``words``:
    int64 words in all."""

    caps: tuple[int, ...]
    o64: tuple[int, ...]
    n64: int
    o32: tuple[int, ...]
    words: int

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(caps: tuple[int, ...]) -> "PlanLayout":
        o64 = tuple(itertools.accumulate(caps, initial=0))
        n64 = -(-o64[-1] // 2) * 2
        o32, o = [], 0
        for i in _I32_INDEX:
            o32.append(o)
            o += -(-caps[i] // 4) * 4
        return PlanLayout(caps, o64[:-1], n64, tuple(o32), n64 + max(2, -(-o // 2)))  # int32 area never empty


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

    All of them are views of one device buffer ``buf`` (int64 [layout.words], laid out
    as ``layout`` says): ``flat`` (int64, every list back to back in ``_NAMES`` order:
    what the apply kernel reads), ``counts`` (n_bt, n_hot, n_rs, n_unmap, n_host, n_len)
    and ``host_h32`` / ``host_tok32`` are made with the plan; each list by name is made
    on first use (the Triton launches read none of them).
    """

    __slots__ = ("buf", "layout", "flat", "counts", "host_h32", "host_tok32", "_lists")

    def __init__(self, buf: torch.Tensor, layout: PlanLayout) -> None:
        self._lists: dict[str, torch.Tensor] | None = None
        caps = layout.caps
        self.buf, self.layout = buf, layout
        self.flat = buf[:layout.o64[-1] + caps[-1]]
        b32 = buf.view(torch.int32)
        (h, t), (oh, ot) = _I32_INDEX[:2], layout.o32[:2]
        oh, ot = oh + 2 * layout.n64, ot + 2 * layout.n64
        self.host_h32, self.host_tok32 = b32[oh:oh + caps[h]], b32[ot:ot + caps[t]]
        n = dict(zip(_NAMES, caps))
        self.counts = (n["bt_r"], n["hot_dst"], n["rs_h"], n["unmap"], n["host_h"], n["len_r"])

    def __getattr__(self, name: str) -> torch.Tensor:
        """A list by name (``plan.hot_dst`` ...): a view of ``buf``, int32 for the int32
        lists (see the class docstring)."""
        if name not in _NAME_INDEX:
            raise AttributeError(f"WritePlan has no attribute {name!r}")
        if self._lists is None:
            layout = self.layout
            lists = dict(zip(_NAMES, self.flat.split(layout.caps)))
            b32 = self.buf[layout.n64:].view(torch.int32)
            for i, o in zip(_I32_INDEX[2:], layout.o32[2:]):
                lists[_NAMES[i]] = b32[o:o + layout.caps[i]]
            self._lists = lists
        return self._lists[name]


_NEG = np.full(1024, -1, dtype=np.int64)  # padding (read only; replaced by a longer one when short)
_NEG.flags.writeable = False


def _neg(n: int) -> np.ndarray:
    """int64 [n] of -1 (a read-only view)."""
    global _NEG
    if n > len(_NEG):
        neg = np.full(2 * n, -1, dtype=np.int64)
        neg.flags.writeable = False
        _NEG = neg
    return _NEG[:n]


def pack_lists(lists: Sequence[np.ndarray], layout: PlanLayout) -> np.ndarray:
    """The 15 lists (int numpy each, ``_NAMES`` order) in ``layout``'s buffer, each
    padded with -1 to its capacity: int64 [layout.words] numpy (the caller makes sure
    none is longer than its capacity). Two copies: the int64 area, then the int32 one."""
    buf = np.empty(layout.words, dtype=np.int64)
    parts = []
    for x, c in zip(lists, layout.caps):
        parts.append(x)
        if len(x) < c:
            parts.append(_neg(c - len(x)))
    end = layout.o64[-1] + layout.caps[-1]
    if layout.n64 > end:
        parts.append(_neg(layout.n64 - end))
    if parts:
        np.concatenate(parts, out=buf[:layout.n64])
    parts = []
    for i in _I32_INDEX:  # each int32 copy padded to a multiple of 4
        x = lists[i]
        parts.append(x)
        if -(-layout.caps[i] // 4) * 4 > len(x):
            parts.append(_neg(-(-layout.caps[i] // 4) * 4 - len(x)))
    b32 = buf[layout.n64:].view(np.int32)
    used = sum(map(len, parts))
    if len(b32) > used:
        parts.append(_neg(len(b32) - used))
    np.concatenate(parts, out=b32)  # int64 -> int32 (host rows, positions and block ids fit)
    return buf


def split_lists(flat: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """The lists of a flat plan (int64 numpy, ``sizes`` in ``_NAMES`` order), one array each."""
    ends = list(itertools.accumulate(sizes))  # (slices: np.split costs several times more host time)
    return [flat[e - n:e] for e, n in zip(ends, sizes)]


def without_host_lists(lists: list[np.ndarray]) -> list[np.ndarray]:
    """The lists (int64 numpy each, ``_NAMES`` order) with host_h and host_tok emptied:
    the plan of a write whose rows are in the host pool already (no host mirror)."""
    out = list(lists)
    out[_HOST_H] = out[_HOST_H + 1] = lists[_HOST_H][:0]
    return out


def check_groups(sizes: Sequence[int]) -> None:
    """RuntimeError unless the lists written together have one length each
    (``apply_write_plan_kernel`` relies on it)."""
    for group in _GROUP_INDEX:
        for i in group:
            if sizes[i] != sizes[group[0]]:
                raise RuntimeError("write plan lists of one group differ in length: "
                                   f"{({_NAMES[i]: sizes[i] for i in group})}")


def to_device(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 buffer on ``device`` (CUDA: pinned, copied without waiting)."""
    t = torch.from_numpy(buf)
    kind = device_type(device)
    if kind == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if kind == "cpu" else t.to(device)


def packed_of(lists: Sequence[np.ndarray]) -> tuple[PlanLayout, np.ndarray]:
    """(layout, int64 [layout.words] numpy): 15 host lists (int64 numpy each, ``_NAMES``
    order) packed into one buffer, the int64 lists and their int32 copies."""
    sizes = tuple(map(len, lists))
    check_groups(sizes)
    layout = PlanLayout.of(sizes)
    return layout, pack_lists(lists, layout)


def plan_of(lists: Sequence[np.ndarray], device: torch.device) -> WritePlan:
    """The device plan of 15 host lists (int64 numpy each, ``_NAMES`` order): one copy,
    the int64 lists and their int32 copies in one buffer."""
    layout, packed = packed_of(lists)
    return WritePlan(to_device(packed, device), layout)


def _to_plan(flat: torch.Tensor, sizes: list[int], device: torch.device) -> WritePlan:
    """flat: int64 [sum(sizes)] CPU, the lists of ``_NAMES`` back to back -> the device plan."""
    return plan_of(split_lists(flat.numpy(), sizes), device)


__all__ = ["WritePlan", "Work", "Resident", "NO_RESIDENT", "PlanLayout", "build_write_plan", "expand_runs",
           "pack_lists", "packed_of", "plan_of", "single_row_lists", "split_lists", "to_device", "without_host_lists"]
