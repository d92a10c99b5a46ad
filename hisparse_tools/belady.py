"""Hot-buffer simulation: the cache's exact LRU and the offline optimum (Belady).

Each (layer, request) owns its hot buffer, so a run decomposes into independent
*streams*, one per (layer, request instance). One layer's streams form a
:class:`LayerTrace`: per decode step, the streams that resolve in it, their lengths and
their selections. A stream lives from its first step to its last; a step it is absent
from leaves its buffer untouched.

Rules shared with the cache (docs/DESIGN.md "Write path", cache/state.py,
cache/resolve_ref.py), with S = LRU slots per (layer, request):

- appended position p < S is placed in slot p at append time (stamp = resolves done so
  far), so a request whose context fits the buffer never misses;
- the last appended position, if >= S, sits in the reserved newest-token slot (a hit
  while it stays there); the next append displaces it (it remains on host only);
  other appended positions >= S go to host only;
- every unique valid position of a resolve is a hit (in an LRU slot or in the reserved
  slot) or a miss, which is placed in an LRU slot, evicting a row that this resolve
  does not use; counts are unique positions per resolve (STAT_HITS / STAT_MISSES).

Policies (:class:`Policy`):

- ``LRU`` is the cache's own: victims are the slots not used by this resolve with the
  smallest key, ``slot - (S + 1)`` for an empty slot, ``(stamp << 32) | position``
  otherwise; the i-th miss (ascending position) takes the i-th victim (ascending slot).
  Tests check hits and misses against the real cache, resolve by resolve.
- ``BELADY`` evicts the rows whose next use is farthest in the future (empty slots
  first): Belady's MIN, optimal for demand paging. Serving a step's positions together
  with the step's other positions protected is the same as serving them one by one,
  so it is optimal here too: no online policy beats it on the same trace.

How it runs: :func:`simulate` advances every stream of a step at once with torch tensor
ops over ``[T, K]`` selections and ``[T, S]`` slot states (T streams in the step), no
per-entry Python. Per stream it keeps slot -> position, slot -> stamp (LRU) or next use
(Belady), and position -> slot (``[lanes, P]`` int16, P = longest stream + 2). Belady's
next-use times come from one backward pass over the trace (:func:`next_uses`).
:func:`lru_stream` / :func:`belady_stream` run one stream given as events;
:class:`OptimalTracker` collects a stress run's streams and computes the bound.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Sequence

import numpy as np
import torch

Event = tuple  # ("append", int) | ("resolve", array of positions)
NEVER = 2**31 - 1  # next-use time of a row never used again (int32 max)
_EMPTY = NEVER + 1  # Belady score of an empty slot: evicted before any row
_BIG = 2**62  # sort key of padding / of a slot that may not be evicted
_I64 = torch.int64


class Policy(enum.Enum):
    """Eviction policy of a simulated hot buffer."""

    LRU = "lru"  # the cache's exact LRU
    BELADY = "belady"  # offline optimum (needs the future: next_uses)


def _check_S(S: object) -> int:
    if isinstance(S, bool) or not isinstance(S, (int, np.integer)) or S <= 0:
        raise ValueError(f"buffer size S must be a positive int, got {S!r}")
    return int(S)


def canonical_rows(topk: torch.Tensor) -> torch.Tensor:
    """Unique valid positions of each row, ascending, then -1 padding.

    topk: int [T, K], -1 = padding (other negatives are padding too). Returns int64 [T, K].
    """
    x = topk.to(_I64)
    x = torch.sort(torch.where(x >= 0, x, torch.full_like(x, _BIG)), dim=1).values
    if x.shape[1] > 1:
        dup = torch.zeros_like(x, dtype=torch.bool)
        dup[:, 1:] = x[:, 1:] == x[:, :-1]
        if bool(dup.any()):
            x = torch.sort(x.masked_fill_(dup, _BIG), dim=1).values
    return x.masked_fill_(x == _BIG, -1)


def row_membership(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[t, k]`` occurs in ``rows[t]``: bool [T, K] (False for padding).

    values: int64 [T, K]; rows: canonical int64 [T, K2] (ascending, -1 padding at the end).
    """
    if rows.shape[1] == 0 or values.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    srt = torch.where(rows >= 0, rows, torch.full_like(rows, _BIG)).contiguous()
    idx = torch.searchsorted(srt, values.contiguous()).clamp(max=rows.shape[1] - 1)
    return (values >= 0) & (torch.gather(srt, 1, idx) == values)


def _tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


@dataclasses.dataclass(frozen=True)
class LayerTrace:
    """One layer's streams, step by step.

    inst[s]: int64 [T_s] stream ids (distinct within a step); lens[s]: int64 [T_s] length
    of each stream after the step's appends; topk[s]: canonical int64 [T_s, K]
    (see :func:`canonical_rows`). All on one device.
    """

    inst: list[torch.Tensor]
    lens: list[torch.Tensor]
    topk: list[torch.Tensor]

    @classmethod
    def build(cls, inst: Sequence, lens: Sequence, topk: Sequence) -> "LayerTrace":
        """From per-step arrays (numpy, lists or tensors); topk rows are canonicalised."""
        if not len(inst) == len(lens) == len(topk):
            raise ValueError(f"inst, lens and topk need one entry per step, got "
                             f"{len(inst)}, {len(lens)}, {len(topk)}")
        I, N, Tk = [], [], []
        for s, (i, n, t) in enumerate(zip(inst, lens, topk)):
            i, n, t = _tensor(i).to(_I64).reshape(-1), _tensor(n).to(_I64).reshape(-1), _tensor(t)
            if t.dim() != 2 or t.shape[0] != i.numel() or n.numel() != i.numel():
                raise ValueError(f"step {s}: topk must be [T, K] with T = {i.numel()} streams, "
                                 f"got shape {tuple(t.shape)} and {n.numel()} lengths")
            if torch.unique(i).numel() != i.numel():
                raise ValueError(f"step {s} lists a stream twice")
            I.append(i)
            N.append(n)
            Tk.append(canonical_rows(t))
        return cls(I, N, Tk)

    @property
    def num_steps(self) -> int:
        return len(self.inst)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Lane (state row) of every stream entry, and what each step appends.

    lanes[s]: int64 [T_s]; old[s]: int64 [T_s] stream length before step s;
    age[s]: int64 [T_s] resolves the stream did before step s;
    release[s]: lanes freed after step s (their streams end there);
    app_row[s], app_pos[s]: int64 [A_s] rows / positions placed in slots by the step's
    appends for buffers up to ``s_max`` (positions [old, min(len, s_max)));
    num_lanes, max_len: lanes used at once, longest stream.
    """

    lanes: list[torch.Tensor]
    old: list[torch.Tensor]
    age: list[torch.Tensor]
    release: list[list[int]]
    app_row: list[torch.Tensor]
    app_pos: list[torch.Tensor]
    num_lanes: int
    max_len: int
    s_max: int


def make_plan(tr: LayerTrace, s_max: int) -> Plan:
    """Assign lanes (lowest free first), check lengths only grow and positions lie below
    them (ValueError), expand the appends."""
    s_max = _check_S(s_max)
    last: dict[int, int] = {}
    for s, i in enumerate(tr.inst):
        for v in i.tolist():
            last[v] = s
    lane_of: dict[int, int] = {}
    length: dict[int, int] = {}
    done: dict[int, int] = {}
    free: list[int] = []
    n_lanes = 0
    lanes, olds, ages, rel, arow, apos = [], [], [], [], [], []
    max_len = 0
    dev = tr.inst[0].device if tr.inst else torch.device("cpu")
    for s, (i, n, U) in enumerate(zip(tr.inst, tr.lens, tr.topk)):
        bad = (U >= 0) & (U >= n[:, None])
        if bool(bad.any()):
            t, k = bad.nonzero()[0].tolist()
            raise ValueError(f"step {s}: stream {int(i[t])} selects position {int(U[t, k])} "
                             f">= its length {int(n[t])}")
        ln, old, age = [], [], []
        for v, nv in zip(i.tolist(), n.tolist()):
            if v not in lane_of:
                if free:
                    lane_of[v] = free.pop(free.index(min(free)))
                else:
                    lane_of[v] = n_lanes
                    n_lanes += 1
                length[v], done[v] = 0, 0
            if nv < length[v]:
                raise ValueError(f"step {s}: stream {v} has length {nv} after length "
                                 f"{length[v]}; lengths only grow")
            ln.append(lane_of[v])
            old.append(length[v])
            age.append(done[v])
            length[v] = nv
            done[v] += 1
            max_len = max(max_len, nv)
        old_t = torch.tensor(old, dtype=_I64, device=dev)
        c = (torch.clamp(n, max=s_max) - old_t).clamp(min=0)
        rows = torch.repeat_interleave(torch.arange(c.numel(), device=dev), c)
        start = torch.cumsum(c, 0) - c
        pos = old_t[rows] + torch.arange(rows.numel(), device=dev) - start[rows]
        lanes.append(torch.tensor(ln, dtype=_I64, device=dev))
        olds.append(old_t)
        ages.append(torch.tensor(age, dtype=_I64, device=dev))
        arow.append(rows)
        apos.append(pos)
        gone = [v for v in i.tolist() if last[v] == s]
        rel.append([lane_of[v] for v in gone])
        for v in gone:
            free.append(lane_of.pop(v))
    return Plan(lanes, olds, ages, rel, arow, apos, n_lanes, max_len, s_max)


@dataclasses.dataclass(frozen=True)
class NextUse:
    """Belady's future: resolve[s] int32 [T_s, K] step of the entry's next use (NEVER =
    none); append[s] int32 [A_s] first use of each position the step appends (Plan)."""

    resolve: list[torch.Tensor]
    append: list[torch.Tensor]


def next_uses(tr: LayerTrace, plan: Plan) -> NextUse:
    """One backward pass over the trace with a [lanes, P] table of the next use."""
    P = plan.max_len + 1
    dev = tr.inst[0].device if tr.inst else torch.device("cpu")
    table = torch.full((max(plan.num_lanes, 1), P), NEVER, dtype=torch.int32, device=dev)
    res: list[torch.Tensor] = [None] * tr.num_steps  # type: ignore[list-item]
    app: list[torch.Tensor] = [None] * tr.num_steps  # type: ignore[list-item]
    for s in range(tr.num_steps - 1, -1, -1):
        ln, U = plan.lanes[s], tr.topk[s]
        valid = U >= 0
        lane2 = ln[:, None].expand_as(U)
        nu = table[lane2, U.clamp(min=0)]
        res[s] = torch.where(valid, nu, torch.full_like(nu, NEVER))
        table[lane2[valid], U[valid]] = s
        app[s] = table[ln[plan.app_row[s]], plan.app_pos[s]]
        first = plan.age[s] == 0
        if bool(first.any()):  # earlier streams on these lanes must not see this one's uses
            table[ln[first]] = NEVER
    return NextUse(res, app)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One simulated step: hits, misses int64 [T] (unique positions per row) and the
    miss mask bool [T, K] over the canonical selection."""

    hits: torch.Tensor
    misses: torch.Tensor
    miss: torch.Tensor


def simulate(tr: LayerTrace, *, S: int, policy: Policy, plan: Plan | None = None,
             nu: NextUse | None = None,
             on_step: Callable[[int, StepResult], None] | None = None) -> tuple[list, list]:
    """Run one layer's streams through S-slot buffers under ``policy``.

    Returns (hits, misses): per step an int64 [T_s] tensor per stream row. ``plan``
    (``make_plan(tr, s_max >= S)``) and, for Belady, ``nu`` (``next_uses(tr, plan)``)
    may be passed to share them between runs. ``on_step(s, result)`` sees every step.
    ValueError if a position is >= its stream's length or a resolve needs more free
    slots than S allows.
    """
    S = _check_S(S)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {policy!r}")
    plan = plan if plan is not None else make_plan(tr, S)
    if plan.s_max < S:
        raise ValueError(f"plan covers buffers up to {plan.s_max}, not S={S}")
    belady = policy is Policy.BELADY
    if belady and nu is None:
        nu = next_uses(tr, plan)
    dev = tr.inst[0].device if tr.inst else torch.device("cpu")
    R, P = max(plan.num_lanes, 1), plan.max_len + 2  # column P - 1 of slot_of: a write sink
    SP = S + 1  # column S of the slot arrays: a write sink for entries that write nothing
    # Eviction key of each slot; a resolve evicts the slots with the smallest keys.
    #   LRU:    (stamp << 32) | position, empty slot s: s - (S + 1)   (the cache's key)
    #   Belady: -(step of next use), empty: -_EMPTY; slots this resolve uses: _BIG while
    #           it picks victims
    empty = (torch.arange(SP, device=dev) - (S + 1)) if not belady else torch.full((SP,), -_EMPTY, device=dev)
    key = empty.repeat(R, 1)
    slot_pos = torch.full((R, SP), -1, dtype=_I64, device=dev)
    sdt = torch.int16 if S < 2**15 else torch.int32  # small table: fewer cache misses
    slot_of = torch.full((R, P), -1, dtype=sdt, device=dev)
    reserved = torch.full((R,), -2, dtype=_I64, device=dev)  # -2: never equals padding
    nres = torch.zeros(R, dtype=_I64, device=dev)
    hits_out, miss_out = [], []
    for s in range(tr.num_steps):
        ln, n, U = plan.lanes[s], tr.lens[s], tr.topk[s]
        T, K = U.shape
        # ---- appends: positions < S go to slot == position; the newest >= S is reserved
        keep = plan.app_pos[s] < S
        if bool(keep.any()):
            ar, ap = plan.app_row[s][keep], plan.app_pos[s][keep]
            al = ln[ar]
            slot_pos[al, ap] = ap
            slot_of[al, ap] = ap.to(sdt)
            key[al, ap] = -nu.append[s][keep].to(_I64) if belady else (nres[al] << 32) | ap
        grown = n > plan.old[s]
        reserved[ln] = torch.where(grown & (n - 1 >= S), n - 1, reserved[ln])
        # ---- resolve: hits, misses, touch the hits
        valid = U >= 0
        sl = torch.take(slot_of, (ln * P)[:, None] + U.clamp(min=0)).to(_I64)
        in_lru = valid & (sl >= 0)
        miss = valid & ~(in_lru | (U == reserved[ln][:, None]))
        m = miss.sum(1)
        nres[ln] += 1
        sd = nres[ln]
        dst = ((ln * SP)[:, None] + torch.where(in_lru, sl, S)).view(-1)
        if belady:
            key.view(-1)[dst] = _BIG
        else:
            key.view(-1)[dst] = ((sd[:, None] << 32) | U).view(-1)
        rows = (m > 0).nonzero().flatten()
        if rows.numel():
            lr, mr = ln[rows], m[rows]
            kmax = min(int(mr.max()), S)
            vals, idx = torch.topk(key[lr, :S], kmax, dim=1, largest=False, sorted=True)
            last = vals.gather(1, (mr.clamp(max=S) - 1)[:, None]).flatten()
            short = (mr > S) | (last >= (_BIG if belady else sd[rows] << 32))  # a used slot
            if bool(short.any()):
                j = int(short.nonzero()[0])
                raise ValueError(f"step {s}: stream {int(tr.inst[s][int(rows[j])])} needs "
                                 f"{int(mr[j])} free slots; S={S} is too small")
            isv = torch.arange(kmax, device=dev)[None, :] < mr[:, None]
            vs = torch.sort(torch.where(isv, idx, S), dim=1).values
            vmask = vs < S
            vl, vslot = lr[:, None].expand_as(vs)[vmask], vs[vmask]
            old = slot_pos[vl, vslot]
            slot_of[vl, torch.where(old >= 0, old, P - 1)] = -1
            mm = miss[rows]
            mpos = U[rows][mm]  # row-major, ascending per row: pairs with vs in slot order
            slot_pos[vl, vslot] = mpos
            slot_of[vl, mpos] = vslot.to(sdt)
            if belady:
                key[vl, vslot] = -nu.resolve[s][rows][mm].to(_I64)
            else:
                key[vl, vslot] = (torch.repeat_interleave(sd[rows], mr) << 32) | mpos
        if belady:  # the used slots get their rows' next use
            key.view(-1)[dst] = -nu.resolve[s].reshape(-1).to(_I64)
        h = valid.sum(1) - m
        hits_out.append(h)
        miss_out.append(m)
        if on_step is not None:
            on_step(s, StepResult(h, m, miss))
        # ---- streams that end here free their lane
        for lane in plan.release[s]:
            held = slot_pos[lane, :S]
            slot_of[lane, held[held >= 0]] = -1
            slot_pos[lane] = -1
            key[lane] = empty
            reserved[lane] = -2
            nres[lane] = 0
    return hits_out, miss_out


# ------------------------------------------------------------------ one stream as events
def _events_trace(events: Sequence[Event]) -> LayerTrace:
    length, lens, rows = 0, [], []
    for ev in events:
        if ev[0] == "append":
            n = int(ev[1])
            if n < length:
                raise ValueError(f"append to length {n} after length {length}: lengths only grow")
            length = n
        elif ev[0] == "resolve":
            lens.append(length)
            rows.append(np.asarray(ev[1], dtype=np.int64).reshape(-1))
        else:
            raise ValueError(f"unknown event kind {ev[0]!r}; expected 'append' or 'resolve'")
    K = max([r.size for r in rows] + [1])
    topk = [np.concatenate([r, np.full(K - r.size, -1, np.int64)])[None, :] for r in rows]
    return LayerTrace.build([[0]] * len(rows), [[n] for n in lens], topk)


def _run_stream(events: Sequence[Event], S: int, policy: Policy) -> tuple[np.ndarray, np.ndarray]:
    S = _check_S(S)
    tr = _events_trace(events)
    if tr.num_steps == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    h, m = simulate(tr, S=S, policy=policy)
    return (torch.cat(h).numpy().astype(np.int64), torch.cat(m).numpy().astype(np.int64))


def belady_stream(events: Sequence[Event], S: int) -> tuple[np.ndarray, np.ndarray]:
    """Optimal hits and misses per resolve of one stream: (int64 [n], int64 [n])."""
    return _run_stream(events, S, Policy.BELADY)


def lru_stream(events: Sequence[Event], S: int) -> tuple[np.ndarray, np.ndarray]:
    """The cache's exact-LRU hits and misses per resolve of one stream."""
    return _run_stream(events, S, Policy.LRU)


class OptimalTracker:
    """Records the streams of a run and computes the Belady bound per layer and step.

    ``instance`` identifies one life of a request (ids are reused after free).
    """

    def __init__(self, *, num_layers: int, buffer_size: int) -> None:
        self.S = _check_S(buffer_size)
        self.L = int(num_layers)
        self._len: dict[tuple[int, int], int] = {}
        self._rec: list[dict[int, list]] = [dict() for _ in range(self.L)]  # step -> entries

    def append(self, layer: int, instance: int, new_len: int) -> None:
        self._len[(layer, instance)] = int(new_len)

    def resolve(self, layer: int, instance: int, step: int, positions: np.ndarray) -> None:
        n = self._len.get((layer, instance), 0)
        self._rec[layer].setdefault(int(step), []).append(
            (int(instance), n, np.asarray(positions, dtype=np.int64).reshape(-1)))

    def compute(self, num_steps: int) -> dict:
        """{'hits': int64 [L, num_steps], 'misses': int64 [L, num_steps]} of the optimum."""
        hits = np.zeros((self.L, num_steps), dtype=np.int64)
        misses = np.zeros((self.L, num_steps), dtype=np.int64)
        for layer, rec in enumerate(self._rec):
            steps = sorted(s for s in rec if s < num_steps)
            if not steps:
                continue
            inst, lens, topk = [], [], []
            for s in steps:
                ent = rec[s]
                K = max([p.size for _, _, p in ent] + [1])
                inst.append([e[0] for e in ent])
                lens.append([e[1] for e in ent])
                topk.append(np.stack([np.concatenate([p, np.full(K - p.size, -1, np.int64)])
                                      for _, _, p in ent]))
            h, m = simulate(LayerTrace.build(inst, lens, topk), S=self.S, policy=Policy.BELADY)
            for j, s in enumerate(steps):
                hits[layer, s] = int(h[j].sum())
                misses[layer, s] = int(m[j].sum())
        return {"hits": hits, "misses": misses}


def hit_rate(hits, misses) -> float:
    """hits / (hits + misses), 1.0 when there was nothing to look up."""
    h, m = int(np.sum(hits)), int(np.sum(misses))
    return 1.0 if h + m == 0 else h / (h + m)
