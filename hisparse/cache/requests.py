"""Host-side bookkeeping of live requests (host memory only; no tensors, no device).

For every live request id: its request slot r, the rows appended to each layer, and
the position held by each layer's reserved newest-token slot. Plus, per layer, an
epoch that every change of that layer (append, resolve, free) moves on, so that a
result or plan built earlier can tell it is out of date without looking at the device.

An engine's forward appends the same rows to every layer, so a slot's layers nearly
always agree: the table keeps such a slot *uniform* (one length and one occupant for
all layers, ``len0`` / ``res0``) and spells out the per-layer values only for a slot
whose layers differ (after a per-layer write or an undo). A step's checks and updates
are then array operations over the batch's slots, whatever the number of layers.

Everything the cache decides without reading device memory reads it from here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .._checks import check_int
from ..errors import CapacityError


class RequestTable:
    """Live request ids -> request slots, per-layer lengths and reserved occupants.

    Slots are handed out lowest first and reused lowest first. Per slot (numpy arrays
    over ``max_num_reqs``; a free slot's entries mean nothing): ``uniform`` (bool)
    whether every layer holds ``len0`` rows with ``res0`` in its reserved slot (int64,
    -1 = none); otherwise the per-layer values are ``_rows[r, 0]`` (rows) and
    ``_rows[r, 1]`` (occupants), int64 [max_num_reqs, 2, num_layers]. ``born`` (int64):
    the generation the slot's request was admitted at. Read them through the queries
    and change them through the methods below.
    """

    def __init__(self, *, num_layers: int, max_num_reqs: int, max_request_id: int) -> None:
        self.num_layers = num_layers
        self.max_num_reqs = max_num_reqs
        self.max_request_id = max_request_id
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(max_num_reqs - 1, -1, -1))  # pop() -> lowest
        self.uniform = np.ones(max_num_reqs, dtype=bool)
        self.len0 = np.zeros(max_num_reqs, dtype=np.int64)
        self.res0 = np.full(max_num_reqs, -1, dtype=np.int64)
        self._rows = np.zeros((max_num_reqs, 2, num_layers), dtype=np.int64)
        self.born = np.zeros(max_num_reqs, dtype=np.int64)
        self._version = 0  # moves on with every change of lengths or occupants (``summary``'s memo)
        self._memo: tuple | None = None
        self.generation = 0  # moves on with every add / remove
        self.epochs = [0] * num_layers  # per layer: moves on with every change of the layer

    # ---- queries ---------------------------------------------------------------
    def check_id(self, req_id: object) -> int:
        return check_int("req_id", req_id, 0, self.max_request_id)

    def slot(self, req_id: object) -> int:
        """Request slot of a live id (TypeError/ValueError otherwise)."""
        rid = self.check_id(req_id)
        r = self._slot_of.get(rid)
        if r is None:
            raise ValueError(f"request {rid} is not live (add_request it first)")
        return r

    def is_live(self, req_id: int) -> bool:
        return req_id in self._slot_of

    def slots_of(self, req_ids: Sequence[int]) -> list[int | None]:
        """The slot of each id, None for an id that is not live (ids are not checked)."""
        return list(map(self._slot_of.get, req_ids))

    def live_ids(self) -> list[int]:
        return sorted(self._slot_of)

    def slot_map(self) -> dict[int, int]:
        """Live id -> slot (the table's own dict: read it, never mutate it)."""
        return self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def length(self, r: int, layer: int) -> int:
        return int(self.len0[r] if self.uniform[r] else self._rows[r, 0, layer])

    def lengths(self, r: int) -> list[int]:
        """Rows appended to each layer (a new list)."""
        return self.rows_of(np.array([r]))[0, 0].tolist()

    def min_length(self, r: int) -> int:
        """Rows appended to the layer of slot r that holds the fewest."""
        return int(self.len0[r]) if self.uniform[r] else int(self._rows[r, 0].min())

    def reserved(self, r: int, layer: int) -> int:
        return int(self.res0[r] if self.uniform[r] else self._rows[r, 1, layer])

    def reserved_list(self, r: int) -> list[int]:
        """Reserved-slot occupant of each layer (a new list)."""
        return self.rows_of(np.array([r]))[0, 1].tolist()

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """int64 [n, 2, L], a new array: rows per layer (``[:, 0]``) and reserved
        occupant per layer (``[:, 1]``) of each slot of ``slots`` (int64 [n])."""
        out = self._rows[slots]
        u = self.uniform[slots]
        if u.any():
            out[u, 0] = self.len0[slots[u]][:, None]
            out[u, 1] = self.res0[slots[u]][:, None]
        return out

    def summary(self, slots: tuple[int, ...] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(same bool [n]: whether every layer of the slot holds the same rows and the
        same occupant; len0, res0 int64 [n]: those, meaningful where ``same``; read
        only) of each slot of ``slots`` (a tuple of ints or int64 [n]). A slot spelled
        out per layer whose layers agree again is made uniform on the way. Asked again
        for the same tuple, or the same read-only array that owns its data (a
        ``WriteBatch``'s), with nothing changed in between, it hands back the same
        arrays (a forward's checks ask twice)."""
        memo = self._memo
        if memo is not None and memo[0] == self._version and (
                memo[1] is slots or (type(slots) is tuple and type(memo[1]) is tuple and memo[1] == slots)):
            return memo[2]
        # a tuple, or an array that no one writes (read-only, its own data): its values are the key
        key = slots if type(slots) is tuple or (slots.base is None and not slots.flags.writeable) else None
        if type(slots) is tuple:
            slots = np.array(slots, dtype=np.int64)
        u = self.uniform[slots]
        if np.count_nonzero(u) < len(u):  # (count_nonzero: no reduction machinery, for small batches)
            s = slots[~u]
            rows = self._rows[s]
            same = (rows == rows[:, :, :1]).all(axis=(1, 2))
            s = s[same]
            self.len0[s], self.res0[s] = rows[same, 0, 0], rows[same, 1, 0]
            self.uniform[s] = True
            u = self.uniform[slots]
        got = (u, self.len0[slots], self.res0[slots])
        for a in got:
            a.flags.writeable = False
        if key is not None:
            self._memo = (self._version, key, got)
        return got

    # ---- changes ---------------------------------------------------------------
    def add(self, req_id: object) -> int:
        """Admit ``req_id``; returns its slot. CapacityError when all slots are taken."""
        rid = self.check_id(req_id)
        if rid in self._slot_of:
            raise ValueError(f"request {rid} is already live")
        if not self._free:
            raise CapacityError(f"all max_num_reqs={self.max_num_reqs} request slots are taken; "
                                "free a request first")
        r = self._free.pop()
        self._version += 1
        self._slot_of[rid] = r
        self.uniform[r], self.len0[r], self.res0[r] = True, 0, -1
        self.generation += 1
        self.born[r] = self.generation
        return r

    def remove(self, req_id: int) -> int:
        """Release a live id (checked by the caller); returns its former slot."""
        r = self._slot_of.pop(req_id)
        self._version += 1
        self._free.append(r)
        self._free.sort(reverse=True)
        self.generation += 1
        self.touch_all()
        return r

    def layer_rows(self, slots: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, reserved occupant), int64 [n] each, of each slot of ``slots`` (int64
        [n]) in ``layer``."""
        u = self.uniform[slots]
        return (np.where(u, self.len0[slots], self._rows[slots, 0, layer]),
                np.where(u, self.res0[slots], self._rows[slots, 1, layer]))

    def _spell_out(self, slots: np.ndarray) -> None:
        """Give each uniform slot of ``slots`` (int64 [n]) its per-layer values."""
        s = slots[self.uniform[slots]]
        if len(s):
            self._rows[s, 0] = self.len0[s][:, None]
            self._rows[s, 1] = self.res0[s][:, None]
            self.uniform[s] = False

    def set_written(self, r: int, layer: int, end: int, reserved: int) -> None:
        """Layer ``layer`` of slot r now holds ``end`` rows; ``reserved`` (>= 0) is the
        new occupant of its reserved slot, -1 = unchanged."""
        self.set_written_layer(np.array([r]), layer, np.array([end]), np.array([reserved]))

    def set_written_layer(self, slots: np.ndarray, layer: int, ends: np.ndarray, reserved: np.ndarray) -> None:
        """``set_written`` of one layer for several slots (slots, ends, reserved int64 [n])."""
        self._version += 1
        self._spell_out(slots)
        self._rows[slots, 0, layer] = ends
        new = reserved >= 0
        self._rows[slots[new], 1, layer] = reserved[new]

    def set_written_rows(self, slots: np.ndarray, ends: np.ndarray, reserved: np.ndarray) -> None:
        """``set_written`` for every layer of several slots at once (a step writes the
        same rows to each layer): slots, ends, reserved int64 [n], reserved -1 =
        unchanged."""
        self._version += 1
        same = reserved < 0  # occupants unchanged: a slot spelled out stays so
        if np.count_nonzero(same):
            spelled = same & ~self.uniform[slots]
            if spelled.any():
                self._rows[slots[spelled], 0] = ends[spelled][:, None]
                rest = ~spelled
                slots, ends, reserved, same = slots[rest], ends[rest], reserved[rest], same[rest]
            reserved = np.where(same, self.res0[slots], reserved)
        self.len0[slots] = ends
        self.res0[slots] = reserved
        self.uniform[slots] = True

    def set_uniform(self, r: int, rows: int, reserved: int = -1) -> None:
        """Every layer of slot r holds ``rows`` rows, with ``reserved`` (-1 = none) in its
        reserved slot."""
        self._version += 1
        self.uniform[r], self.len0[r], self.res0[r] = True, rows, reserved

    def set_uniform_rows(self, slots: np.ndarray, ends: np.ndarray, reserved: np.ndarray) -> None:
        """``set_written_rows`` of slots that are uniform (every layer holds the same rows
        and occupant: the caller knows it) and all get a new occupant (``reserved`` >= 0):
        slots, ends, reserved int64 [n]."""
        self._version += 1
        self.len0[slots] = ends
        self.res0[slots] = reserved

    def incarnation(self, r: int) -> int:
        """Which admission the request in slot r is (distinct for every add_request, so a
        request freed and admitted again under the same id and slot is told apart)."""
        return int(self.born[r])

    def restore(self, r: int, layer: int, end: int, reserved: int) -> None:
        """Put back a length and reserved occupant recorded before a write (-1 = none)."""
        self._version += 1
        self._spell_out(np.array([r]))
        self._rows[r, 0, layer] = end
        self._rows[r, 1, layer] = reserved

    def restore_rows(self, slots: np.ndarray, layers: np.ndarray, ends: np.ndarray,
                     reserved: np.ndarray) -> None:
        """``restore`` of ``layers`` (int64 [m]) for several slots (slots, ends, reserved
        int64 [n]: each slot's length and occupant in every one of those layers)."""
        self._version += 1
        self._spell_out(slots)
        idx = np.ix_(slots, layers)
        self._rows[:, 0][idx] = ends[:, None]
        self._rows[:, 1][idx] = reserved[:, None]

    def touch(self, layer: int) -> None:
        """Something in ``layer`` changed (epoch moves on)."""
        self.epochs[layer] += 1

    def touch_all(self) -> None:
        """Something in every layer changed (the same list object: results hold it)."""
        self.epochs[:] = [e + 1 for e in self.epochs]


__all__ = ["RequestTable"]
