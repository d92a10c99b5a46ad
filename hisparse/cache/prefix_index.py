"""Content-addressed host blocks for prefix reuse: the index, host-side only.

A host block holds ``B`` consecutive tokens of a request (every layer's rows). Two
requests whose token ids agree on a whole block *and on everything before it* hold the
same rows there (the KV of a token depends on the tokens before it), so a block is named
by a chained hash: ``h_i = H(h_{i-1} || H(salt) || token ids of block i)`` (16 bytes;
``h_{-1}`` is 16 zero bytes, and so is the salt's part without a salt: every input has the
same layout, so no salt can make a salted block's input equal another block's). ``H`` is SHA-256
(``hashlib``, truncated to 16 bytes) by default: with tenants that don't trust each
other a name must not be forgeable, or a crafted prompt could read another tenant's
rows. ``algo="xxh3_128"`` (the ``xxhash`` package), where every prompt is trusted,
computes the names in about a quarter of SHA-256's time (``benchmarks.bench_prefix``). The salt keys what else changes the KV (model,
adapter, ...). Only complete blocks are named.

``PrefixIndex`` maps names to host block ids and keeps, per cached block, how many
requests reference it:

- ``lookup(names)``: the longest run of cached blocks that prefix ``names`` (changes
  nothing; ``lookup_ids``: the same as an array, of at most ``limit`` names);
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
import hashlib
from itertools import repeat
from typing import Iterable, Sequence

import numpy as np

NAME_BYTES = 16  # bytes of a block name (a truncated digest)
_ZERO = bytes(NAME_BYTES)  # the parent of a first block, the salt part without a salt


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
    return names_of_ids(token_array(token_ids), block_size, salt=salt, parent=parent, algo=algo)


def names_of_bytes(raw: bytes, block_size: int, *, salt: bytes | None = None, parent: bytes = b"",
                   algo: str = "sha256") -> list[bytes]:
    """``block_names`` of token ids already packed as little-endian uint32 bytes."""
    return names_of_ids(np.frombuffer(raw, dtype="<u4", count=len(raw) // 4), block_size, salt=salt,
                        parent=parent, algo=algo)


_ROWS_FROM = 16  # blocks from which the hash inputs are laid out with numpy, not sliced one by one


def names_of_ids(ids: np.ndarray, block_size: int, *, salt: bytes | None = None, parent: bytes = b"",
                 algo: str = "sha256") -> list[bytes]:
    """``block_names`` of token ids already checked (``token_array``). ids: any integer
    dtype [n], every value in [0, 2**32).

    Block i's input past its parent's name, ``salt part || its ids as little-endian
    uint32``, is one row of a uint8 array built at once (from ``_ROWS_FROM`` blocks);
    the chain then costs one concatenation and one hash call per block."""
    H = _hash_fn(algo)
    salted = H(bytes(salt)) if salt is not None else _ZERO
    h = bytes(parent) or _ZERO
    nb = len(ids) // block_size
    if nb < _ROWS_FROM:
        raw = ids[:nb * block_size].astype("<u4", copy=False).tobytes()
        step = 4 * block_size
        inputs = [salted + raw[i:i + step] for i in range(0, len(raw), step)]
    else:
        rows = np.empty((nb, NAME_BYTES + 4 * block_size), dtype=np.uint8)
        rows[:, :NAME_BYTES] = np.frombuffer(salted, dtype=np.uint8)
        rows[:, NAME_BYTES:].view("<u4")[...] = ids[:nb * block_size].reshape(nb, block_size)
        inputs = rows.view(f"V{rows.shape[1]}")[:, 0].tolist()  # bytes of each row
    if algo == "sha256":  # the same names, without a call per block through H
        sha = hashlib.sha256
        return [h := sha(h + x).digest()[:NAME_BYTES] for x in inputs]
    return [h := H(h + x) for x in inputs]


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
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self._block_of: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._refs = np.zeros(num_blocks, dtype=np.int64)  # references per block
        self._cached = np.zeros(num_blocks, dtype=bool)
        self._stamp = np.zeros(num_blocks, dtype=np.int64)  # release order (evictable blocks)
        self._seen = np.zeros(num_blocks, dtype=np.int64)  # scratch of the distinctness check
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

    def publish(self, name: bytes, block: int, *, referenced: bool = True) -> bool:
        """Make ``block`` findable as ``name`` (its rows are written in every layer);
        ``referenced``: its writer still references it. False (nothing changed) when
        the name is cached already, by another block."""
        if name in self._block_of:
            return False
        if self._cached[block]:
            raise ValueError(f"block {block} is cached already, under another name")
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
        self._cached[blocks] = False
        self._evictable -= len(blocks)
        return blocks


__all__ = ["HASHES", "NAME_BYTES", "PrefixIndex", "block_names", "names_of_bytes", "names_of_ids", "token_array"]
