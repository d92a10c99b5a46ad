"""``PDDescriptor``: where a reserved request's rows go, as the decode side publishes it.

A request's host blocks are the same in every layer (``hisparse.cache.host_pool``), so
the descriptor names them once, as runs of positions contiguous in the pool
(``runs``: ``(pos_start, pos_end, host_row_start)``), plus the address of host row 0 of
each layer (``layer_addrs``). Row p of layer l, for p in a run, is at
``layer_addrs[l] + (host_row_start + p - pos_start) * row_bytes``; ``layer_regions(l)``
lists those regions.

``generation`` identifies the reservation: the decode side keeps it in a registered
word (``generation_addr``, int64 little-endian) while the reservation is open and
clears it at commit or abort, so a sender reading another value there holds a stale
descriptor. ``to_bytes`` / ``from_bytes``: JSON, the agent metadata base64-coded.
"""

from __future__ import annotations

import base64
import dataclasses
import json

VERSION = 1


@dataclasses.dataclass(frozen=True)
class PDDescriptor:
    agent_name: str                  # the decode side's NIXL agent
    agent_metadata: bytes            # its get_agent_metadata(), for add_remote_agent
    request_id: int
    generation: int                  # > 0; the reservation's
    generation_addr: int             # address of the decode side's int64 generation word
    row_format: str                  # "fp8_ds_mla", "bf16" or "raw<row_bytes>"
    row_bytes: int
    block_size: int                  # host block size (tokens)
    num_tokens: int                  # C: rows per layer the prefill side sends
    num_layers: int                  # L
    runs: tuple[tuple[int, int, int], ...]  # (pos_start, pos_end, host_row_start), covering [0, C)
    layer_addrs: tuple[int, ...]     # [L] address of host row 0 of each layer

    @property
    def nbytes(self) -> int:
        """Bytes the transfer writes: L x C x row_bytes."""
        return self.num_layers * self.num_tokens * self.row_bytes

    def layer_regions(self, layer: int) -> list[tuple[int, int, int, int]]:
        """``[(addr, nbytes, pos_start, pos_end), ...]`` of ``layer``'s rows."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of [0, {self.num_layers})")
        base, rb = self.layer_addrs[layer], self.row_bytes
        return [(base + h * rb, (b - a) * rb, a, b) for a, b, h in self.runs]

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode("ascii")
        d["version"] = VERSION
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "PDDescriptor":
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"a descriptor is bytes (PDDescriptor.to_bytes), got {type(data).__name__}")
        try:
            d = json.loads(bytes(data))
            version = d.pop("version")
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"not a hisparse P/D descriptor: {e}") from e
        if version != VERSION:
            raise ValueError(f"descriptor version {version}, this hisparse reads version {VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ValueError(f"descriptor fields differ: missing {sorted(names - set(d))}, "
                             f"unknown {sorted(set(d) - names)}")
        d["agent_metadata"] = base64.b64decode(d["agent_metadata"])
        d["runs"] = tuple(tuple(int(x) for x in r) for r in d["runs"])
        d["layer_addrs"] = tuple(int(a) for a in d["layer_addrs"])
        desc = cls(**d)
        desc.check()
        return desc

    def check(self) -> None:
        """ValueError when the fields do not describe C rows of L layers."""
        if self.generation <= 0 or self.num_tokens <= 0 or self.row_bytes <= 0 or self.block_size <= 0:
            raise ValueError(f"descriptor of request {self.request_id}: generation, num_tokens, row_bytes and "
                             "block_size must be positive")
        if len(self.layer_addrs) != self.num_layers:
            raise ValueError(f"descriptor: {len(self.layer_addrs)} layer addresses for {self.num_layers} layers")
        p = 0
        for a, b, _h in self.runs:
            if a != p or b <= a:
                raise ValueError(f"descriptor runs {self.runs} do not cover [0, {self.num_tokens}) in order")
            p = b
        if p != self.num_tokens:
            raise ValueError(f"descriptor runs cover {p} positions, num_tokens is {self.num_tokens}")


def notice(kind: str, *, request_id: int, generation: int, **fields) -> bytes:
    """A notification the sender attaches to its transfer (``kind`` "done") or sends on
    its own ("fail"): ``hisparse-pd/1 <kind> <json>``."""
    body = dict(request_id=request_id, generation=generation, **fields)
    return f"hisparse-pd/{VERSION} {kind} ".encode() + json.dumps(body, separators=(",", ":")).encode()


def parse_notice(msg: bytes) -> tuple[str, dict] | None:
    """(kind, fields) of a notice; None for a message that is not one (another prefix,
    a body that is not a JSON object, ``request_id`` or ``generation`` not an int)."""
    prefix = f"hisparse-pd/{VERSION} ".encode()
    if not msg.startswith(prefix):
        return None
    kind, _, body = msg[len(prefix):].partition(b" ")
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    if not isinstance(fields, dict) or not all(type(fields.get(k)) is int for k in ("request_id", "generation")):
        return None  # request_id and generation must be ints (not bools, lists, strings)
    return kind.decode(errors="replace"), fields


__all__ = ["PDDescriptor", "notice", "parse_notice", "VERSION"]
