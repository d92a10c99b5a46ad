"""Host-side bookkeeping of live requests (pure Python; no tensors, no device).

For every live request id: its request slot r, the rows appended to each layer, and
the position held by each layer's reserved newest-token slot. Plus, per layer, an
epoch that every change of that layer (append, resolve, free) moves on, so that a
result or plan built earlier can tell it is out of date without looking at the device.

Everything the cache decides without reading device memory reads it from here.
"""

from __future__ import annotations

from .._checks import check_int
from ..errors import CapacityError


class RequestTable:
    """Live request ids -> request slots, per-layer lengths and reserved occupants.

    Slots are handed out lowest first and reused lowest first.
    """

    def __init__(self, *, num_layers: int, max_num_reqs: int, max_request_id: int) -> None:
        self.num_layers = num_layers
        self.max_num_reqs = max_num_reqs
        self.max_request_id = max_request_id
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(max_num_reqs - 1, -1, -1))  # pop() -> lowest
        self._lens: dict[int, list[int]] = {}  # slot -> rows appended per layer
        self._reserved: dict[int, list[int]] = {}  # slot -> position in slot S per layer, -1 = none
        self._born: dict[int, int] = {}  # slot -> the generation its request was admitted at
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

    def live_ids(self) -> list[int]:
        return sorted(self._slot_of)

    def slot_map(self) -> dict[int, int]:
        """Live id -> slot (the table's own dict: read it, never mutate it)."""
        return self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def length(self, r: int, layer: int) -> int:
        return self._lens[r][layer]

    def lengths(self, r: int) -> list[int]:
        """Rows appended to each layer (the table's own list: read it, never mutate it)."""
        return self._lens[r]

    def reserved(self, r: int, layer: int) -> int:
        return self._reserved[r][layer]

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
        self._slot_of[rid] = r
        self._lens[r] = [0] * self.num_layers
        self._reserved[r] = [-1] * self.num_layers
        self.generation += 1
        self._born[r] = self.generation
        return r

    def remove(self, req_id: int) -> int:
        """Release a live id (checked by the caller); returns its former slot."""
        r = self._slot_of.pop(req_id)
        del self._lens[r], self._reserved[r], self._born[r]
        self._free.append(r)
        self._free.sort(reverse=True)
        self.generation += 1
        for layer in range(self.num_layers):
            self.epochs[layer] += 1
        return r

    def set_written(self, r: int, layer: int, end: int, reserved: int) -> None:
        """Layer ``layer`` of slot r now holds ``end`` rows; ``reserved`` (>= 0) is the
        new occupant of its reserved slot, -1 = unchanged."""
        self._lens[r][layer] = end
        if reserved >= 0:
            self._reserved[r][layer] = reserved

    def set_written_all(self, r: int, end: int, reserved: int) -> None:
        """``set_written`` for every layer at once (a step writes the same rows to each)."""
        lens = self._lens[r]
        lens[:] = [end] * len(lens)
        if reserved >= 0:
            res = self._reserved[r]
            res[:] = [reserved] * len(res)

    def incarnation(self, r: int) -> int:
        """Which admission the request in slot r is (distinct for every add_request, so a
        request freed and admitted again under the same id and slot is told apart)."""
        return self._born[r]

    def reserved_list(self, r: int) -> list[int]:
        """Reserved-slot occupant of each layer (the table's own list: read it only)."""
        return self._reserved[r]

    def restore(self, r: int, layer: int, end: int, reserved: int) -> None:
        """Put back a length and reserved occupant recorded before a write (-1 = none)."""
        self._lens[r][layer] = end
        self._reserved[r][layer] = reserved

    def touch(self, layer: int) -> None:
        """Something in ``layer`` changed (epoch moves on)."""
        self.epochs[layer] += 1


__all__ = ["RequestTable"]
