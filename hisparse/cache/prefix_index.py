"""Content-addressed host blocks for prefix reuse: the index, host-side only.

A host block holds ``B`` consecutive tokens of a request (every layer's rows). Two
requests whose token ids agree on a whole block *and on everything before it* hold the
same rows there (the KV of a token depends on the tokens before it), so a block is named
by a chained hash: ``h_i = H(h_{i-1} || H(salt) || token ids of block i)`` (16 bytes;
``h_{-1}`` is empty, and so is the salt's part without a salt). ``H`` is SHA-256
(``hashlib``, truncated to 16 bytes) by default: with tenants that don't trust each
other a name must not be forgeable, or a crafted prompt could read another tenant's
rows. ``algo="xxh3_128"`` (the ``xxhash`` package), where every prompt is trusted,
computes the names in about a quarter of SHA-256's time (``benchmarks.bench_prefix``). The salt keys what else changes the KV (model,
adapter, ...). Only complete blocks are named.

``PrefixIndex`` maps names to host block ids and keeps, per cached block, how many
requests reference it:

- ``lookup(names)``: the longest run of cached blocks that prefix ``names`` (changes
  nothing);
- ``acquire(blocks)`` / ``release(blocks)``: a request starts / stops referencing
  cached blocks; a block no request references stays cached and becomes *evictable*,
  least recently released first;
- ``publish(name, block)``: a block whose rows are written in every layer becomes
  findable (a name already cached keeps its first block: the caller frees the copy);
- ``evict(n)``: the ``n`` least recently released evictable blocks leave the index and
  are returned for the allocator to reuse; a referenced block is never evicted;
- ``reset()``: every evictable block leaves.

``hisparse.cache.prefix`` wires it into the cache (block ids, publishing, eviction).
"""

from __future__ import annotations

import array
import collections
import hashlib
import sys
from typing import Iterable, Sequence

import numpy as np

NAME_BYTES = 16  # bytes of a block name (a truncated digest)


HASHES = ("sha256", "xxh3_128")


def _hash_fn(algo: str):
    """bytes -> NAME_BYTES-byte digest of ``algo`` (ValueError: unknown, or xxhash missing)."""
    if algo == "sha256":
        sha = hashlib.sha256
        return lambda b: sha(b).digest()[:NAME_BYTES]
    if algo == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise ValueError("algo='xxh3_128' needs the xxhash package (pip install xxhash)") from None
        return xxhash.xxh3_128_digest
    raise ValueError(f"algo must be one of {HASHES}, got {algo!r}")


def block_names(token_ids: Sequence[int] | np.ndarray, block_size: int, *, salt: bytes | None = None,
                parent: bytes = b"", algo: str = "sha256") -> list[bytes]:
    """Chained names of the complete blocks of ``token_ids`` (int, any sequence; the
    trailing partial block has none). ``parent``: the name of the block before the
    first (a follow-up turn's tokens after a cached prefix), empty at position 0.
    ``algo``: ``HASHES`` (see the module docstring); names of one index must all use one."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if salt is not None and not isinstance(salt, (bytes, bytearray)):
        raise TypeError(f"salt must be bytes or None, got {type(salt).__name__}")
    return names_of_bytes(_token_bytes(token_ids), block_size, salt=salt, parent=parent, algo=algo)


def names_of_bytes(raw: bytes, block_size: int, *, salt: bytes | None = None, parent: bytes = b"",
                   algo: str = "sha256") -> list[bytes]:
    """``block_names`` of token ids already packed as little-endian uint32 bytes."""
    H = _hash_fn(algo)
    step = 4 * block_size
    salted = H(bytes(salt)) if salt else b""
    names: list[bytes] = []
    append = names.append
    h = bytes(parent)
    for i in range(0, len(raw) - step + 1, step):
        h = H(h + salted + raw[i:i + step])
        append(h)
    return names


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (ValueError: not 1-D ints in [0, 2**32)).
    A list or tuple goes through ``array`` (about 3x faster than numpy from a list)."""
    if isinstance(token_ids, (list, tuple)):
        try:
            arr = array.array("I", token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token_ids must be a 1-D sequence of ints in [0, 2**32)") from None
        if arr.itemsize != 4:  # "I" is 4 bytes on every platform numpy wheels exist for
            return np.asarray(arr, dtype="<u4").tobytes()
        if sys.byteorder == "big":
            arr.byteswap()
        return arr.tobytes()
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError("token_ids must be a 1-D sequence of ints in [0, 2**32)")
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token_ids must be a 1-D sequence of ints in [0, 2**32)")
    return ids.astype("<u4", copy=False).tobytes()


class PrefixIndex:
    """Cached host blocks by name, with reference counts and an LRU of the evictable
    ones (see the module docstring). Host-side bookkeeping only."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, oldest first
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
        return len(self._lru)

    @property
    def shared(self) -> int:
        """Cached blocks referenced by more than one request."""
        return sum(1 for n in self._refs.values() if n > 1)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def holds(self, block: int) -> bool:
        """Whether ``block`` is cached (in the index, referenced or not)."""
        return block in self._name_of

    def referenced(self) -> int:
        """References summed over cached blocks."""
        return sum(self._refs.values())

    def peek_evict(self, n: int) -> list[int]:
        """The blocks ``evict(n)`` would drop, in that order (nothing changes)."""
        out = []
        for b in self._lru:
            if len(out) >= n:
                break
            out.append(b)
        return out

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of ``names`` from the first that are cached."""
        out: list[int] = []
        for name in names:
            b = self._block_of.get(name)
            if b is None:
                break
            out.append(b)
        return out

    # ---- changes -----------------------------------------------------------------
    def acquire(self, blocks: Iterable[int], *, queried: int | None = None) -> None:
        """A request references ``blocks`` (cached ones, e.g. a ``lookup``); ``queried``:
        the blocks its lookup asked for (counted with the hits)."""
        blocks = list(blocks)
        name_of = self._name_of
        missing = [b for b in blocks if b not in name_of]
        if missing:
            raise KeyError(f"blocks {missing[:8]} are not cached")
        refs, lru = self._refs, self._lru
        for b in blocks:
            n = refs.get(b, 0)
            refs[b] = n + 1
            if not n:
                lru.pop(b, None)
        if queried is not None:
            self.query_blocks += queried
            self.hit_blocks += len(blocks)

    def release(self, blocks: Iterable[int]) -> None:
        """A request stops referencing ``blocks``; one no request references becomes
        evictable (most recently released last)."""
        blocks = list(blocks)
        refs, lru = self._refs, self._lru
        missing = [b for b in blocks if refs.get(b, 0) < 1]
        if missing:
            raise KeyError(f"blocks {missing[:8]} are not referenced")
        for b in blocks:
            n = refs[b] - 1
            if n:
                refs[b] = n
            else:
                del refs[b]
                lru[b] = None

    def publish(self, name: bytes, block: int, *, referenced: bool = True) -> bool:
        """Make ``block`` findable as ``name`` (its rows are written in every layer);
        ``referenced``: its writer still references it. False (nothing changed) when
        the name is cached already, by another block."""
        if name in self._block_of:
            return False
        if block in self._name_of:
            raise ValueError(f"block {block} is cached already, under another name")
        self._block_of[name] = block
        self._name_of[block] = name
        if referenced:
            self._refs[block] = 1
        else:
            self._lru[block] = None
        return True

    def evict(self, n: int) -> list[int]:
        """Drop the ``n`` least recently released evictable blocks (fewer if there are
        fewer) and return them (counted in ``evictions``)."""
        out = self._drop(n)
        self.evictions += len(out)
        return out

    def reset(self) -> list[int]:
        """Drop every evictable block; returns them (not counted as evictions)."""
        return self._drop(len(self._lru))

    def _drop(self, n: int) -> list[int]:
        out = []
        while n > 0 and self._lru:
            b, _ = self._lru.popitem(last=False)
            del self._block_of[self._name_of.pop(b)]
            out.append(b)
            n -= 1
        return out


__all__ = ["HASHES", "NAME_BYTES", "PrefixIndex", "block_names", "names_of_bytes"]
