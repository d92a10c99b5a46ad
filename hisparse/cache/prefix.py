"""Prefix caching: requests whose prompts share a prefix share its host blocks.

A host block of ``B`` tokens is named by the chained hash of its token ids
(``prefix_index``). The cache keeps, per live request, the running hash of the tokens
it was given (``add_request(token_ids=...)`` then ``add_tokens``), the names of its
blocks not yet in the index and how many of its leading blocks are.

- **Lookup** (``add_request`` with token ids): the longest run of cached blocks that
  prefix the request, at most ``(len(token_ids) - 1) // B`` blocks (one token is
  always left to compute), found with a few names (``PrefixCache.lookup``), not one
  per block. The request maps them under block ids
  (``BlockAllocator.map_cached``: the block's own id when no other request maps it,
  else an alias) and starts with that many tokens appended in every layer. With the
  elastic tier it joins resident on the device pages of a resident request that holds
  the same blocks (``PrefixCache.holder``; ``device_pool`` shares them), else hot (its
  rows are on the host only, so its first steps miss, as a request whose resident
  pages were spilled would).
- **Publishing**: a request's block becomes findable once every layer holds its rows
  and its tokens are known; rows a prepared step counts but has not written to every
  layer (a pending or captured layer) don't count. That is checked, for every live
  request, before each lookup, in ``stats`` and when the request is freed: the decode
  path does no prefix work at all. A block whose name is cached already (two requests with the same
  prompt admitted before either was written) stays private to its writer and is freed
  with it; the writer references the cached block instead while it lives, so that every
  block it publishes after has a cached parent.
- **Eviction**: a cached block that no request references is kept, and evicted least
  recently released first only when an allocation finds no free block
  (``BlockAllocator.allocate``); admission limits count it as free.
  ``reset_prefix_cache`` drops them all. A referenced block is never evicted and never
  written (a request appends only past its cached tokens, into its own blocks). A
  request's blocks are released last first, so a block is evicted before its parent.

Host-side bookkeeping only; the device sees block ids in the block table and the
``host_block`` map of aliases (``hisparse.cache.state``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..config import HiSparseConfig
from .host_pool import BlockAllocator
from .prefix_index import NameChain, PrefixIndex, token_array
from .requests import RequestTable


@dataclasses.dataclass
class _Tokens:
    """What the cache knows of one request's tokens."""

    salt: bytes | None
    chain: NameChain  # the running hash of the tokens given so far (their tail included)
    names: list[bytes]  # names of blocks done, done + 1, ... (those not yet in the index)
    done: int  # leading blocks whose names are in the index (mapped from it, published, or held)
    path: np.ndarray  # int64 [>= done]: the cached block of each of those names (its chain)
    extra: list[tuple[int, int]]  # (block, cached block of its name) held for a private copy


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
    @staticmethod
    def check_ids(token_ids) -> np.ndarray:
        """``token_ids`` as a checked integer array [n] (ValueError: bad ids), before
        anything changes."""
        return token_array(token_ids)

    def lookup(self, ids: np.ndarray, salt: bytes | None) -> tuple[np.ndarray, NameChain]:
        """(int64 [n]: the cached blocks that prefix a request of token ids ``ids``, at
        most ``(len(ids) - 1) // B`` of them; the name chain after those n blocks).
        Changes nothing.

        A cached block's parent is cached (``PrefixIndex.check``), so the cached blocks
        of a prompt are a prefix of its blocks: the first block's name is asked (a cold
        prompt stops there), then the last one's (a full hit: the prompt hashed once),
        else a binary search; the hit blocks are the last one's stored chain."""
        B, ix = self.B, self.index
        L = max(0, (len(ids) - 1) // B)
        chain = NameChain(B, salt=salt, algo=self.algo)
        none = np.zeros(0, dtype=np.int64)
        if L == 0:
            return none, chain
        lo_chain = chain.copy()
        top = ix.block_of(lo_chain.extend(ids[:B])[0])
        if top < 0:
            return none, chain
        lo, hi = 1, L + 1  # block lo - 1's name is cached; block hi - 1's is not (hi = L + 1: not asked)
        while hi - lo > 1:
            mid = L if hi > L else (lo + hi) // 2  # the last block first, then halves: lo < mid < hi
            probe = lo_chain.copy()
            probe.skip(ids[lo * B:mid * B])
            b = ix.block_of(probe.name)
            if b >= 0:
                lo, lo_chain, top = mid, probe, b
            else:
                hi = mid
        blocks = ix.chain(top)
        if len(blocks) != lo:
            raise RuntimeError(f"prefix index: a block named for {lo} blocks has {len(blocks)} in its chain")
        return blocks, lo_chain

    def admit(self, r: int, ids: np.ndarray, salt: bytes | None, hits: np.ndarray, chain: NameChain) -> np.ndarray:
        """Request slot r (new, owning nothing) maps the cached blocks ``hits`` (int64
        [n], a ``lookup`` of ``ids`` whose chain is ``chain``; as many as block ids
        allow) and names the rest of its blocks; returns the block ids it mapped (int64
        [m], m <= n)."""
        B = self.B
        mapped = self.allocator.map_cached(r, hits)
        m = len(mapped)
        self.index.acquire(hits[:m], queried=len(ids) // B)
        if m < len(hits):  # out of block ids: name from block m again
            chain = NameChain(B, salt=salt, algo=self.algo)
            chain.skip(ids[:m * B])
        names = chain.extend(ids[m * B:])
        path = np.empty(max(16, 2 * len(ids) // B), dtype=np.int64)
        path[:m] = hits[:m]
        self._req[r] = _Tokens(salt, chain, names, m, path, [])
        self.query_tokens += len(ids)
        self.hit_tokens += m * B
        return mapped

    def track(self, r: int, salt: bytes | None = None) -> None:
        """Request slot r was admitted without token ids (it publishes nothing until
        ``add_tokens`` gives it some; their names take ``salt``)."""
        self._req[r] = _Tokens(salt, NameChain(self.B, salt=salt, algo=self.algo), [], 0,
                               np.empty(16, dtype=np.int64), [])

    def add_tokens(self, r: int, token_ids) -> int:
        """Append ``token_ids`` to what request slot r's tokens are known to be (its
        decode output, a next turn's prompt); returns the tokens known now."""
        t = self._req[r]
        ids = token_array(token_ids)
        t.names += t.chain.extend(ids)
        return t.chain.blocks * self.B + len(t.chain.tail)

    # ---- publishing -----------------------------------------------------------------
    def publish(self, requests: RequestTable, unwritten: dict[int, int], slots: Sequence[int] | None = None) -> int:
        """Make findable every block of the request slots ``slots`` (default: all live)
        whose rows every layer holds; ``unwritten``: {slot: first position} of rows a
        prepared step counts but has not written everywhere (``Writer.unwritten_from``).
        A block whose name is cached already stays private to its writer, which
        references the cached one instead (the parent of its next block). Returns the
        blocks published."""
        out = 0
        B, ix = self.B, self.index
        for r in (self._req if slots is None else slots):
            t = self._req.get(r)
            if t is None or t.done >= t.chain.blocks:
                continue
            rows = requests.min_length(r)
            whole = min(min(rows, unwritten.get(r, rows)) // B, t.chain.blocks)
            if whole <= t.done:
                continue
            blocks = self.allocator.host_blocks(r)
            if len(t.path) < whole:  # a new array: the published blocks keep the old one
                path = np.empty(2 * whole, dtype=np.int64)
                path[:t.done] = t.path[:t.done]
                t.path = path
            path = t.path
            for i in range(t.done, whole):
                name, own = t.names[i - t.done], int(blocks[i])
                parent = int(path[i - 1]) if i else -1
                path[i] = own
                if ix.publish(name, own, parent, path=path):
                    out += 1
                else:
                    path[i] = held = ix.block_of(name)
                    ix.acquire([held])
                    t.extra.append((i, held))
            del t.names[:whole - t.done]
            t.done = whole
        return out

    def holder(self, blocks: np.ndarray, slots) -> int | None:
        """The lowest request slot of ``slots`` whose leading published blocks are
        ``blocks`` (int64 [n], cached blocks: its first n blocks are named by them, so
        its rows of those positions are theirs in every layer); None if none is."""
        n = len(blocks)
        for r in sorted(slots):
            t = self._req.get(r)
            # the last block names its whole chain (a cached block's parent is fixed)
            if t is not None and t.done >= n and t.path[n - 1] == blocks[n - 1] and np.array_equal(t.path[:n], blocks):
                return r
        return None

    def forget(self, r: int) -> list[tuple[int, int]]:
        """Request slot r is being freed: returns the (block, cached block) pairs it held
        for its private copies, which ``allocator.free`` releases with its own."""
        t = self._req.pop(r, None)
        return t.extra if t is not None else []

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
