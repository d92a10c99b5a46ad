"""A checked batch of appends (``Writer.prepare``; ``HiSparseCache.plan_write``).

``make_batch(requests, req_ids, counts, ...)`` checks the ids and counts once and
returns a :class:`WriteBatch`: the ids' request slots, the row counts and their offsets
in the rows a write takes, as tuples and as numpy arrays. The same ids and counts as
the last batch, with no request added or freed since, give that batch again: an
engine's decode steps keep their batch for many forwards, so a forward checks it at
the cost of a few tuple comparisons. ``check_ends`` says which request of a prepared
step does not hold the rows a caller expects.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from .._checks import check_int, plain_ints
from .requests import RequestTable

_INT = {int}


@dataclasses.dataclass(frozen=True)
class WriteBatch:
    """A checked batch of appends (``Writer.prepare``): request i gets ``counts[i]``
    rows, ``rows[offsets[i] : offsets[i] + counts[i]]`` of the rows passed to a write.

    Valid until the next add_request / free_request (``generation``), and only for the
    cache that made it (``owner``: its writer). ``arrays``: req_ids, slots, counts and
    offsets as int64 [n] numpy arrays (read only), in that order; ``all_write``: no
    count is 0; ``single_rows``: every count is 0 or 1.
    """

    req_ids: tuple[int, ...]
    slots: tuple[int, ...]
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    generation: int
    owner: object = dataclasses.field(repr=False, compare=False)
    arrays: tuple[np.ndarray, ...] = dataclasses.field(default=(), repr=False, compare=False)
    all_write: bool = False
    single_rows: bool = False


def make_batch(requests: RequestTable, req_ids: Sequence[int], counts: Sequence[int], *, owner: object,
                last: WriteBatch | None) -> WriteBatch:
    """The batch of ``req_ids`` (distinct live ids) and ``counts`` (one int >= 0 each)
    for ``owner`` (TypeError, ValueError otherwise). ``last``: the batch made last for
    ``owner``, handed back when these are its ids and counts (equal values of plain-int
    types: every check passes as it did) and no request was added or freed since."""
    if not isinstance(req_ids, (list, tuple, range)) or not isinstance(counts, (list, tuple, range)):
        raise TypeError("req_ids and counts must be sequences of ints")
    req = requests
    ids, cl = tuple(req_ids), tuple(counts)
    if (last is not None and last.generation == req.generation and ids == last.req_ids
            and cl == last.counts and (not ids or set(map(type, ids + cl)) == _INT)):
        return last
    if not plain_ints(ids, 0, req.max_request_id):  # the per-id check says what is wrong
        ids = tuple(req.check_id(i) for i in ids)
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"req_ids must be distinct (one entry per request, its rows counted in counts); "
                         f"request {twice} appears {ids.count(twice)} times")
    if not plain_ints(cl, 0, None):
        cl = tuple(check_int("counts entry", c, 0) for c in cl)
    if len(cl) != len(ids):
        raise ValueError(f"{len(ids)} request ids but {len(cl)} counts: give one count per request id")
    slots = req.slots_of(ids)
    if None in slots:
        req.slot(ids[slots.index(None)])  # raises: not live
    offsets = tuple(itertools.accumulate(cl[:-1], initial=0)) if cl else ()
    arrays = tuple(np.array(x, dtype=np.int64).reshape(len(ids)) for x in (ids, slots, cl, offsets))
    for a in arrays:
        a.flags.writeable = False
    return WriteBatch(req_ids=ids, slots=tuple(slots), counts=cl, offsets=offsets, total=sum(cl),
                      generation=req.generation, owner=owner, arrays=arrays, all_write=0 not in cl,
                      single_rows=cl.count(0) + cl.count(1) == len(cl))


def check_ends(batch: WriteBatch, p0: np.ndarray, ends: Sequence[int]) -> None:
    """ValueError for the first request of ``batch`` whose rows ``p0`` (int64 [n], as
    in every layer) plus its count are not ``ends`` (one entry per request)."""
    if len(ends) != len(p0):
        raise ValueError(f"ends has {len(ends)} entries for the batch's {len(p0)} requests")
    for i, (p, c, e) in enumerate(zip(p0.tolist(), batch.counts, ends)):
        if p + c != e:
            raise ValueError(f"request {batch.req_ids[i]} holds {p} rows in every layer: with its {c} new "
                             f"rows that makes {p + c}, not ends[{i}] = {e!r}")


__all__ = ["WriteBatch", "check_ends", "make_batch"]
