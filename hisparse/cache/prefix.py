"""Prefix caching: requests whose prompts share a prefix share its host blocks.

A host block of ``B`` tokens is named by the chained hash of its token ids
(``prefix_index.block_names``). The cache keeps, per live request, the names of the
whole blocks of the tokens it was given (``add_request(token_ids=...)`` then
``add_tokens``) and how many of its leading blocks are in the index.

- **Lookup** (``add_request`` with token ids): the longest run of cached blocks that
  prefix the request, at most ``(len(token_ids) - 1) // B`` blocks (one token is
  always left to compute). The request maps them under block ids
  (``BlockAllocator.map_cached``: the block's own id when no other request maps it,
  else an alias) and starts with that many tokens appended in every layer, hot (never
  resident: a hit's rows are on the host only, so it begins as a hot request whose
  first steps miss, as a request whose resident pages were spilled would).
- **Publishing**: a request's block becomes findable once every layer holds its rows
  and its tokens are known; rows a prepared step counts but has not written to every
  layer (a pending or captured layer) don't count. That is checked, for every live
  request, before each lookup, in ``stats`` and when the request is freed: the decode
  path does no prefix work at all. A block whose name is cached already (two requests with the same
  prompt admitted before either was written) stays private to its writer and is freed
  with it.
- **Eviction**: a cached block that no request references is kept, and evicted least
  recently released first only when an allocation finds no free block
  (``BlockAllocator.allocate``); admission limits count it as free.
  ``reset_prefix_cache`` drops them all. A referenced block is never evicted and never
  written (a request appends only past its cached tokens, into its own blocks).

Host-side bookkeeping only; the device sees block ids in the block table and the
``host_block`` map of aliases (``hisparse.cache.state``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..config import HiSparseConfig
from .host_pool import BlockAllocator
from .prefix_index import PrefixIndex, names_of_ids, token_array
from .requests import RequestTable


@dataclasses.dataclass
class _Tokens:
    """What the cache knows of one request's tokens."""

    salt: bytes | None
    names: list[bytes]  # names of the whole blocks of the tokens given so far
    tail: list[int]  # the given tokens past the last whole block (< B)
    done: int  # leading blocks that are in the index (mapped from it, or published)


class PrefixCache:
    """The prefix index of one cache plus each live request's block names."""

    def __init__(self, cfg: HiSparseConfig, allocator: BlockAllocator) -> None:
        self.B = cfg.host_block_size
        self.algo = cfg.prefix_hash
        self.index = PrefixIndex(cfg.num_host_blocks)
        self.allocator = allocator
        allocator.cache = self.index
        self._req: dict[int, _Tokens] = {}  # request slot -> its tokens
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- admission ----------------------------------------------------------------
    def names(self, token_ids, salt: bytes | None) -> tuple[list[bytes], list[int]]:
        """(names of the whole blocks of ``token_ids``, the ids past them) — the hashing
        of an ``add_request``, done before anything changes (ValueError: bad ids)."""
        return self._split(token_array(token_ids), salt, b"")  # token_array checks the ids

    def _split(self, ids: np.ndarray, salt: bytes | None, parent: bytes) -> tuple[list[bytes], list[int]]:
        """(names of the whole blocks of the checked ids ``ids`` (integer [n]) after
        ``parent``, the ids past them)."""
        names = names_of_ids(ids, self.B, salt=salt, parent=parent, algo=self.algo)
        return names, ids[len(names) * self.B:].tolist()

    def lookup(self, names: list[bytes], num_tokens: int) -> np.ndarray:
        """int64 [n]: cached host blocks that prefix a request of ``num_tokens`` tokens
        named ``names``, at most ``(num_tokens - 1) // B`` of them (changes nothing)."""
        return self.index.lookup_ids(names, (num_tokens - 1) // self.B)

    def admit(self, r: int, names: list[bytes], tail: list[int], salt: bytes | None,
              hits: np.ndarray, num_tokens: int) -> np.ndarray:
        """Request slot r (new, owning nothing) maps the cached blocks ``hits`` (int64
        [n]; as many as block ids allow) and records its names; returns the block ids it
        mapped (int64 [m], m <= n)."""
        ids = self.allocator.map_cached(r, hits)
        self.index.acquire(hits[:len(ids)], queried=len(names))
        self._req[r] = _Tokens(salt, list(names), list(tail), len(ids))
        self.query_tokens += num_tokens
        self.hit_tokens += len(ids) * self.B
        return ids

    def track(self, r: int, salt: bytes | None = None) -> None:
        """Request slot r was admitted without token ids (it publishes nothing until
        ``add_tokens`` gives it some; their names take ``salt``)."""
        self._req[r] = _Tokens(salt, [], [], 0)

    def add_tokens(self, r: int, token_ids) -> int:
        """Append ``token_ids`` to what request slot r's tokens are known to be (its
        decode output, a next turn's prompt); returns the tokens known now."""
        t = self._req[r]
        ids = token_array(token_ids)
        if t.tail:
            ids = np.concatenate((np.array(t.tail, dtype=np.uint32), ids.astype(np.uint32, copy=False)))
        names, t.tail = self._split(ids, t.salt, t.names[-1] if t.names else b"")
        t.names += names
        return len(t.names) * self.B + len(t.tail)

    # ---- publishing -----------------------------------------------------------------
    def publish(self, requests: RequestTable, unwritten: dict[int, int], slots: Sequence[int] | None = None) -> int:
        """Make findable every block of the request slots ``slots`` (default: all live)
        whose rows every layer holds; ``unwritten``: {slot: first position} of rows a
        prepared step counts but has not written everywhere (``Writer.unwritten_from``).
        Returns the blocks published."""
        out = 0
        B = self.B
        for r in (self._req if slots is None else slots):
            t = self._req.get(r)
            if t is None or t.done >= len(t.names):
                continue
            rows = requests.min_length(r)
            whole = min(min(rows, unwritten.get(r, rows)) // B, len(t.names))
            if whole <= t.done:
                continue
            blocks = self.allocator.host_blocks(r)
            for i in range(t.done, whole):
                if self.index.publish(t.names[i], int(blocks[i])):
                    out += 1
            t.done = whole
        return out

    def forget(self, r: int) -> None:
        """Request slot r is being freed (its references go with ``allocator.free``)."""
        self._req.pop(r, None)

    def reset(self) -> int:
        """Drop every cached block no request references; returns how many."""
        dropped = self.index.reset()
        self.allocator.give_back(dropped)
        return len(dropped)

    def stats(self) -> dict[str, int]:
        return dict(prefix_query_tokens=self.query_tokens, prefix_hit_tokens=self.hit_tokens,
                    cached_blocks=self.index.cached, shared_blocks=self.index.shared,
                    prefix_evictions=self.index.evictions)


__all__ = ["PrefixCache"]
