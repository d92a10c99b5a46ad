"""Content-addressed host blocks for prefix reuse: the index, host-side only.

A host block holds ``B`` consecutive tokens of a request (every layer's rows). Two
requests whose token ids agree on a whole block *and on everything before it* hold the
same rows there (the KV of a token depends on the tokens before it), so a block is named
by a chained hash: block i's name is ``H(s || the ids of blocks 0..i)`` truncated to 16
bytes, the ids as little-endian uint32, ``s`` = ``H(salt)`` (16 bytes) or 16 zero bytes
without a salt (every input has the same layout, so no salt can make a salted block's
input equal another block's). The chain is the hash's own: SHA-256 (and XXH3) carry
their state from one input block to the next, so block i's name is the parent's chaining
state advanced over block i's ids, and a name costs only its block's bytes
(``NameChain`` keeps the running state). Two names agree only if the whole prefixes
agree (or the hash collides). This also lets a lookup name any block without naming
the ones before it: a full hit hashes the prompt once and looks up one name
(``hisparse.cache.prefix``). ``H`` is SHA-256 (``hashlib``) by default: with tenants
that don't trust each other a name must not be forgeable, or a crafted prompt could read
another tenant's rows. ``algo="xxh3_128"`` (the ``xxhash`` package) is for where every
prompt is trusted. The salt keys what else changes the KV (model, adapter, ...). Only
complete blocks are named.

``PrefixIndex`` maps names to host block ids and keeps, per cached block, how many
requests reference it and its *parent* (the cached block of the name before it):

- ``block_of(name)`` / ``chain(block)``: a cached block, and the blocks from the first
  of its prompt to it (following parents); ``lookup(names)``: the longest run of cached
  blocks that prefix ``names`` (changes nothing);
- ``acquire(blocks)`` / ``release(blocks)``: a request starts / stops referencing
  cached blocks; a block no request references stays cached and becomes *evictable*,
  least recently released first;
- ``publish(name, block, parent)``: a block whose rows are written in every layer becomes
  findable (a name already cached keeps its first block);
- ``evict(n)``: the ``n`` least recently released evictable blocks leave the index and
  are returned for the allocator to reuse; a referenced block is never evicted;
- ``reset()``: every evictable block leaves.

A cached block's parent is cached for as long as it is: the cache references a block's
parent whenever it references the block, and releases a request's blocks last first
(``hisparse.cache.prefix``), so a parent is released after its children and evicted
after them. ``check()`` verifies it.

``hisparse.cache.prefix`` wires it into the cache (block ids, publishing, eviction).
"""

from __future__ import annotations

import array
import hashlib
from itertools import repeat
from typing import Iterable, Sequence

import numpy as np

from .._checks import check_int

NAME_BYTES = 16  # bytes of a block name (a truncated digest)
_ZERO = bytes(NAME_BYTES)  # the salt part without a salt


HASHES = ("sha256", "xxh3_128")


def _hasher(algo: str):
    """A fresh streaming hasher of ``algo`` (ValueError: unknown, or xxhash missing)."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise ValueError("algo='xxh3_128' needs the xxhash package (pip install xxhash)") from None
        return xxhash.xxh3_128()
    raise ValueError(f"algo must be one of {HASHES}, got {algo!r}")


class NameChain:
    """The running hash of one request's token ids: the names of its whole blocks as
    the ids arrive (see the module docstring). ``blocks``: whole blocks hashed so far;
    ``tail``: the ids given past them (fewer than ``B``)."""

    __slots__ = ("B", "algo", "_h", "blocks", "tail")

    def __init__(self, block_size: int, *, salt: bytes | None = None, algo: str = "sha256") -> None:
        check_int("block_size", block_size, lo=1, error=ValueError)
        if salt is not None and not isinstance(salt, (bytes, bytearray)):
            raise TypeError(f"salt must be bytes or None, got {type(salt).__name__}")
        self.B, self.algo = block_size, algo
        self._h = _hasher(algo)
        if salt is not None:
            s = _hasher(algo)
            s.update(bytes(salt))
            self._h.update(s.digest()[:NAME_BYTES])
        else:
            self._h.update(_ZERO)
        self.blocks = 0
        self.tail = np.zeros(0, dtype=np.uint32)

    def copy(self) -> "NameChain":
        c = NameChain.__new__(NameChain)
        c.B, c.algo, c._h, c.blocks, c.tail = self.B, self.algo, self._h.copy(), self.blocks, self.tail
        return c

    @property
    def name(self) -> bytes:
        """The name of the last whole block hashed (meaningless before the first)."""
        return self._h.digest()[:NAME_BYTES]

    def _raw(self, ids: np.ndarray) -> tuple[memoryview, int]:
        """(the tail then ``ids`` as little-endian uint32 bytes, whole blocks in them);
        the ids past the whole blocks become the tail."""
        if len(self.tail):
            ids = np.concatenate((self.tail, ids.astype(np.uint32, copy=False)))
        nb = len(ids) // self.B
        raw = np.ascontiguousarray(ids[:nb * self.B], dtype="<u4")
        self.tail = ids[nb * self.B:].astype(np.uint32)
        return memoryview(raw).cast("B"), nb

    def extend(self, ids: np.ndarray) -> list[bytes]:
        """Append ``ids`` (checked, ``token_array``: integer [n]); returns the names of
        the blocks they complete."""
        mv, nb = self._raw(ids)
        step, update, digest = 4 * self.B, self._h.update, self._h.digest
        out: list[bytes] = []
        put = out.append
        for o in range(0, nb * step, step):
            update(mv[o:o + step])
            put(digest()[:NAME_BYTES])
        self.blocks += nb
        return out

    def skip(self, ids: np.ndarray) -> None:
        """``extend`` without naming the blocks (one hash call for all of them)."""
        mv, nb = self._raw(ids)
        self._h.update(mv)
        self.blocks += nb


def block_names(token_ids: Sequence[int] | np.ndarray, block_size: int, *, salt: bytes | None = None,
                algo: str = "sha256") -> list[bytes]:
    """Chained names of the complete blocks of ``token_ids`` (int, any sequence; the
    trailing partial block has none). ``algo``: ``HASHES`` (see the module docstring);
    names of one index must all use one."""
    chain = NameChain(block_size, salt=salt, algo=algo)
    return chain.extend(token_array(token_ids))


def names_of_bytes(raw: bytes, block_size: int, *, salt: bytes | None = None, algo: str = "sha256") -> list[bytes]:
    """``block_names`` of token ids already packed as little-endian uint32 bytes."""
    return NameChain(block_size, salt=salt, algo=algo).extend(np.frombuffer(raw, dtype="<u4", count=len(raw) // 4))


def token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D integer array, every value in [0, 2**32) (ValueError otherwise):
    a list or tuple as uint32 through ``array`` (about 3x faster than numpy from a
    list; a list through ``fromlist``, faster again than the constructor), an array as
    it is (not copied)."""
    if isinstance(token_ids, (list, tuple)):
        try:
            if isinstance(token_ids, list):
                arr = array.array("I")
                arr.fromlist(token_ids)
            else:
                arr = array.array("I", token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token_ids must be a 1-D sequence of ints in [0, 2**32)") from None
        return np.frombuffer(arr, dtype=f"=u{arr.itemsize}")  # "I" holds values below 2**32
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError("token_ids must be a 1-D sequence of ints in [0, 2**32)")
    # all in [0, 2**32) iff their bitwise or is (a negative one sets the sign bit): one pass
    if ids.size and not 0 <= int(np.bitwise_or.reduce(ids)) < 2**32:
        raise ValueError("token_ids must be a 1-D sequence of ints in [0, 2**32)")
    return ids


class PrefixIndex:
    """Cached host blocks by name, with reference counts and an LRU of the evictable
    ones (see the module docstring), over host blocks ``0 .. num_blocks - 1``.
    Host-side bookkeeping only: per-block arrays (reference count, whether cached, the
    release stamp that orders the evictable ones), so that a request's thousands of
    blocks are acquired and released with array operations."""

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, lo=1, error=ValueError)
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._refs = np.zeros(num_blocks, dtype=np.int64)  # references per block
        self._cached = np.zeros(num_blocks, dtype=bool)
        self._stamp = np.zeros(num_blocks, dtype=np.int64)  # release order (evictable blocks)
        self._seen = np.zeros(num_blocks, dtype=np.int64)  # scratch of the distinctness check
        self._parent = np.full(num_blocks, -1, dtype=np.int64)  # cached block of the name before (-1: first)
        self._depth = np.zeros(num_blocks, dtype=np.int64)  # blocks before it in its prompt
        # per cached block: an int64 array whose first depth + 1 entries are its chain (its
        # publisher's running chain, shared by the blocks it published: entries are only
        # ever appended to it)
        self._path: list[np.ndarray | None] = [None] * num_blocks
        self._clock = 0
        self._evictable = 0
        self.query_blocks = 0
        self.hit_blocks = 0
        self.evictions = 0

    # ---- queries -----------------------------------------------------------------
    @property
    def cached(self) -> int:
        """Blocks in the index."""
        return len(self._name_of)

    @property
    def evictable(self) -> int:
        """Cached blocks no request references."""
        return self._evictable

    @property
    def shared(self) -> int:
        """Cached blocks referenced by more than one request."""
        return int((self._refs > 1).sum())

    def refs(self, block: int) -> int:
        return int(self._refs[block])

    def ref_counts(self) -> dict[int, int]:
        """{block: references} of every referenced block."""
        idx = np.flatnonzero(self._refs)
        return dict(zip(idx.tolist(), self._refs[idx].tolist()))

    def holds(self, block: int) -> bool:
        """Whether ``block`` is cached (in the index, referenced or not)."""
        return bool(self._cached[block])

    def holds_each(self, blocks: np.ndarray) -> np.ndarray:
        """bool [n]: whether each block of ``blocks`` (int64 [n]) is cached."""
        return self._cached[blocks]

    def referenced(self) -> int:
        """References summed over cached blocks."""
        return int(self._refs.sum())

    def evictable_order(self) -> list[int]:
        """Every evictable block, least recently released first (the eviction order)."""
        return self.peek_evict(self._evictable)

    def peek_evict(self, n: int) -> list[int]:
        """The blocks ``evict(n)`` would drop, in that order (nothing changes)."""
        n = min(n, self._evictable)
        if n <= 0:
            return []
        cand = np.flatnonzero(self._cached & (self._refs == 0))
        st = self._stamp[cand]
        if n < len(cand):
            part = np.argpartition(st, n - 1)[:n]
            cand, st = cand[part], st[part]
        return cand[np.argsort(st, kind="stable")].tolist()

    def block_of(self, name: bytes) -> int:
        """The cached block named ``name``, -1 when none is."""
        return self._block_of.get(name, -1)

    def chain(self, block: int) -> np.ndarray:
        """int64 [depth + 1]: the cached blocks from the first of ``block``'s prompt to
        ``block`` itself, each the parent of the next (RuntimeError if they are not,
        which ``check`` rules out). One copy of the block's stored chain, checked with
        array operations: no walk from block to block."""
        path = self._path[block]
        n = int(self._depth[block]) + 1
        if path is None or not self._cached[block] or len(path) < n:
            raise RuntimeError(f"prefix index: block {block} is not cached")
        ids = path[:n].copy()
        if (ids[-1] != block or self._parent[ids[0]] != -1 or not self._cached[ids].all()
                or (self._parent[ids[1:]] != ids[:-1]).any()):
            raise RuntimeError(f"prefix index: the parents of block {block} are broken")
        return ids

    def check(self) -> None:
        """AssertionError unless names and blocks are one to one and every cached
        block's parent is cached, one block shallower."""
        assert len(self._block_of) == len(self._name_of) == int(self._cached.sum())
        assert all(self._name_of[b] == n for n, b in self._block_of.items())
        c = np.flatnonzero(self._cached)
        par = self._parent[c]
        root = par < 0
        assert (self._depth[c[root]] == 0).all(), "a first block with a depth"
        assert self._cached[par[~root]].all(), f"cached blocks {c[~root][~self._cached[par[~root]]][:8].tolist()} have an evicted parent"
        assert (self._depth[c[~root]] == self._depth[par[~root]] + 1).all(), "a depth not its parent's + 1"
        kid, up = c[~root], par[~root]
        assert ((self._refs[kid] == 0) | (self._refs[up] > 0)).all(), "a referenced block's parent is not referenced"

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of ``names`` from the first that are cached."""
        return self.lookup_ids(names).tolist()

    def lookup_ids(self, names: Sequence[bytes], limit: int | None = None) -> np.ndarray:
        """int64 [n]: ``lookup`` of the first ``limit`` names (default: all)."""
        n = len(names) if limit is None else max(0, min(limit, len(names)))
        if n == 0 or names[0] not in self._block_of:  # a cold prompt asks one name
            return np.zeros(0, dtype=np.int64)
        got = np.fromiter(map(self._block_of.get, names, repeat(-1, n)), dtype=np.int64, count=n)
        miss = np.flatnonzero(got < 0)
        return got[:miss[0]] if len(miss) else got

    # ---- changes -----------------------------------------------------------------
    def _blocks(self, blocks: Iterable[int]) -> np.ndarray:
        b = np.asarray(blocks if isinstance(blocks, (list, tuple, np.ndarray)) else list(blocks), dtype=np.int64)
        if b.ndim != 1 or (b.size and (b.min() < 0 or b.max() >= len(self._refs))):
            raise KeyError(f"blocks must be ids in [0, {len(self._refs)})")
        if b.size > 1:  # distinct: each position writes its index, a repeat keeps only one
            seen, at = self._seen, np.arange(b.size)
            seen[b] = at
            if (seen[b] != at).any():
                raise ValueError("a block appears twice")
        return b

    def acquire(self, blocks: Iterable[int], *, queried: int | None = None) -> None:
        """A request references ``blocks`` (distinct cached ones, e.g. a ``lookup``);
        ``queried``: the blocks its lookup asked for (counted with the hits)."""
        b = self._blocks(blocks)
        if not self._cached[b].all():
            raise KeyError(f"blocks {b[~self._cached[b]][:8].tolist()} are not cached")
        refs = self._refs[b]
        self._evictable -= int(np.count_nonzero(refs == 0))
        self._refs[b] = refs + 1
        if queried is not None:
            self.query_blocks += queried
            self.hit_blocks += len(b)

    def release(self, blocks: Iterable[int]) -> None:
        """A request stops referencing ``blocks`` (distinct); one no request references
        becomes evictable (most recently released last, in the order given)."""
        b = self._blocks(blocks)
        refs = self._refs[b] - 1
        if (refs < 0).any():
            raise KeyError(f"blocks {b[refs < 0][:8].tolist()} are not referenced")
        self._refs[b] = refs
        z = b[refs == 0]
        self._stamp[z] = self._clock + np.arange(len(z))
        self._clock += len(z)
        self._evictable += len(z)

    def publish(self, name: bytes, block: int, parent: int = -1, *, path: np.ndarray | None = None,
                referenced: bool = True) -> bool:
        """Make ``block`` findable as ``name`` (its rows are written in every layer);
        ``parent``: the cached block of the name before (-1: the prompt's first block);
        ``path``: int64 array whose first depth + 1 entries are the chain to ``block``
        (the publisher's running chain, kept by reference and never changed there;
        built from the parent's when None); ``referenced``: its writer still references
        it (and so ``parent``). False (nothing changed) when the name is cached already,
        by another block."""
        if name in self._block_of:
            return False
        if self._cached[block]:
            raise ValueError(f"block {block} is cached already, under another name")
        if parent >= 0 and not self._cached[parent]:
            raise ValueError(f"parent block {parent} of block {block} is not cached")
        d = int(self._depth[parent]) + 1 if parent >= 0 else 0
        if path is None:
            path = np.append(self._path[parent][:d] if parent >= 0 else np.zeros(0, dtype=np.int64), block)
        elif len(path) <= d or path[d] != block or (d and path[d - 1] != parent):
            raise ValueError(f"path does not end with parent {parent}, block {block} at depth {d}")
        self._parent[block] = parent
        self._depth[block] = d
        self._path[block] = path
        self._block_of[name] = block
        self._name_of[block] = name
        self._cached[block] = True
        if referenced:
            self._refs[block] = 1
        else:
            self._stamp[block] = self._clock
            self._clock += 1
            self._evictable += 1
        return True

    def evict(self, n: int) -> list[int]:
        """Drop the ``n`` least recently released evictable blocks (fewer if there are
        fewer) and return them (counted in ``evictions``)."""
        out = self._drop(self.peek_evict(n))
        self.evictions += len(out)
        return out

    def reset(self) -> list[int]:
        """Drop every evictable block; returns them (not counted as evictions)."""
        return self._drop(self.evictable_order())

    def _drop(self, blocks: list[int]) -> list[int]:
        for b in blocks:
            del self._block_of[self._name_of.pop(b)]
            self._path[b] = None
        self._cached[blocks] = False
        self._evictable -= len(blocks)
        return blocks


__all__ = ["HASHES", "NAME_BYTES", "NameChain", "PrefixIndex", "block_names", "names_of_bytes", "token_array"]
