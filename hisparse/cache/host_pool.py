"""The cold tier: one pinned host buffer holding every row, and its block allocator.

The pool is a single :class:`hisparse.device.PinnedBuffer` of exactly
``L * H * row_bytes`` bytes viewed as uint8 ``[L, H, row_bytes]`` (notation in
``hisparse.cache.state``). Host memory is handed out in blocks of ``B`` tokens; a
request owns a list of blocks shared by all layers, and the row of (request r,
position p) in layer l is ``rows[l, blocks[p // B] * B + p % B]``.

Everything here is host-side bookkeeping (no device work), so it is exact and cheap
to test on CPU. Capacity failures raise :class:`hisparse.CapacityError` and change
nothing.
"""

from __future__ import annotations

import array
from typing import Hashable, Sequence

import numpy as np
import torch

from .._checks import check_int
from ..config import HiSparseConfig
from ..device import PinnedBuffer
from ..errors import CapacityError


_EMPTY: list[int] = []


def int64_array(ids: list[int]) -> np.ndarray:
    """int64 [n] of a list of block ids (ints >= 0, OverflowError for a negative one),
    through ``array("Q")``: about twice as fast as ``np.asarray`` from a list."""
    arr = array.array("Q")
    arr.fromlist(ids)
    return np.frombuffer(arr, dtype=np.int64)


def block_segments(blocks, B: int, p0: int, p1: int) -> list[tuple[int, int, int]]:
    """Positions ``[p0, p1)`` of a block list (``B`` tokens a block; a list of ints or an
    int64 numpy array) as runs contiguous in the pool: ``[(pos_start, pos_end,
    host_row_start), ...]``, consecutive blocks merged (a fresh pool gives one run per
    request). Over many blocks the runs are found with numpy."""
    if p1 <= p0:
        return []
    k0, k1 = p0 // B, (p1 - 1) // B + 1  # the blocks touched
    if p0 < 0 or k1 > len(blocks):
        raise ValueError(f"positions [{p0}, {p1}) exceed the {len(blocks)} blocks of {B} tokens given")
    if k1 - k0 > 8:
        bb = np.asarray(blocks[k0:k1], dtype=np.int64)
        cut = (np.flatnonzero(bb[1:] != bb[:-1] + 1) + 1).tolist()  # where a run starts anew
        starts, heads = [0] + cut, bb[[0] + cut].tolist()
        out = []
        for s, e, blk in zip(starts, cut + [k1 - k0], heads):
            a, b = max(p0, (k0 + s) * B), min(p1, (k0 + e) * B)
            out.append((a, b, blk * B + a - (k0 + s) * B))
        return out
    if isinstance(blocks, np.ndarray):
        blocks = blocks[:k1].tolist()
    out = []
    p = p0
    while p < p1:
        end = min(p1, (p // B + 1) * B)
        row = blocks[p // B] * B + p % B
        if out and out[-1][1] == p and out[-1][2] + (p - out[-1][0]) == row:
            out[-1] = (out[-1][0], end, out[-1][2])
        else:
            out.append((p, end, row))
        p = end
    return out


class BlockAllocator:
    """Free list of ``num_blocks`` host blocks plus the ordered block-id list of each owner.

    Blocks are handed out lowest id first and freed blocks are reused lowest id first,
    so a fresh pool gives each request consecutive blocks (fewer, larger copies).

    Block ids (``hisparse.cache.state``): an owner's list holds ids; id ``v <
    num_blocks`` is host block ``v`` and is in at most one owner's list; an alias ``v >=
    num_blocks`` (``alias_blocks`` of them) stands for the host block ``host_of[v]``.
    With a prefix index (``cache``, set by ``hisparse.cache.prefix``) a host block can be
    *cached*: owned by the index, referenced by the owners that map it (counted there),
    and evicted, least recently used first, when an allocation finds no free block; a
    cached block goes back to the index, not the free list, when its owner is freed.
    """

    def __init__(self, num_blocks: int, alias_blocks: int = 0) -> None:
        check_int("BlockAllocator num_blocks", num_blocks, lo=1, error=ValueError)
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> lowest id
        self._owned: dict[Hashable, list[int]] = {}
        # int64 [num_blocks + alias_blocks]: host block of each id (identity below num_blocks)
        self.host_of = np.arange(num_blocks + alias_blocks, dtype=np.int64) % num_blocks
        self._aliases: list[int] = list(range(num_blocks + alias_blocks - 1, num_blocks - 1, -1))
        self._mapped = np.zeros(num_blocks, dtype=bool)  # id v < num_blocks is in an owner's list
        self._reclaimed: list[int] = []  # evicted ahead of an allocation (``reclaim``), handed out in order
        self.cache = None  # a hisparse.cache.prefix_index.PrefixIndex, or None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones plus cached ones no owner references."""
        return len(self._free) + len(self._reclaimed) + (self.cache.evictable if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Host blocks owned by an owner or cached (neither free nor reclaimed)."""
        return self.num_blocks - len(self._free) - len(self._reclaimed)

    @property
    def aliases_free(self) -> int:
        return len(self._aliases)

    def owners(self) -> list[Hashable]:
        return list(self._owned)

    def blocks(self, owner: Hashable) -> list[int]:
        """The owner's block ids in logical order (a copy; empty for an unknown owner)."""
        return list(self._owned.get(owner, ()))

    def owned(self, owner: Hashable) -> list[int]:
        """The owner's block-id list itself (no copy: read it, never mutate it)."""
        return self._owned.get(owner, _EMPTY)

    def host_blocks(self, owner: Hashable) -> np.ndarray:
        """int64 [n]: the host block of each of the owner's block ids, in logical order."""
        return self.host_of[np.asarray(self._owned.get(owner, _EMPTY), dtype=np.int64)]

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """Append ``n`` fresh blocks to ``owner``'s list and return them: free blocks,
        lowest id first, then (when too few are free) cached blocks no owner references,
        evicted least recently used first.

        Raises CapacityError (nothing changed) when fewer than ``n`` can be had.
        """
        check_int("allocate n", n, lo=0, error=ValueError)
        if n > self.num_free:
            raise CapacityError(
                f"host pool exhausted: {n} more blocks needed, {self.num_free} of "
                f"{self.num_blocks} free; free requests or configure a larger host pool"
            )
        take = min(n, len(self._free))
        got = self._free[-1:-take - 1:-1] if take else []  # the lowest ids, ascending
        del self._free[len(self._free) - take:]
        if n > take:  # then reclaimed blocks, then the least recently used cached ones, in that order
            k = min(n - take, len(self._reclaimed))
            got += self._reclaimed[:k]
            del self._reclaimed[:k]
            if n > take + k:
                got += self.cache.evict(n - take - k)
        self._mapped[int64_array(got)] = True
        self._owned.setdefault(owner, []).extend(got)
        return got

    def peek(self, n: int) -> list[int]:
        """The ``n`` blocks the next allocations will hand out, in order (nothing is taken
        and nothing evicted)."""
        if n > self.num_free:
            raise CapacityError(f"host pool exhausted: {n} more blocks needed, {self.num_free} free")
        short = n - len(self._free) - len(self._reclaimed)
        if n > len(self._free):
            return (self._free[::-1] + self._reclaimed + (self.cache.peek_evict(short) if short > 0 else []))[:n]
        return self._free[-1:-n - 1:-1] if n else []

    def reclaim(self, n: int) -> int:
        """Make sure the next ``n`` blocks allocated are not cached: evict now the cached
        ones among them (``peek(n)`` is unchanged). A write does this before its launches,
        so that a launch that fails part way can't leave rows it overwrote findable.
        Returns the blocks evicted."""
        short = n - len(self._free) - len(self._reclaimed)
        if short <= 0 or self.cache is None:
            return 0
        got = self.cache.evict(short)
        self._reclaimed += got
        return len(got)

    def claim(self, owner: Hashable, blocks: list[int]) -> None:
        """Append these free ``blocks`` to ``owner``'s list (ValueError, nothing changed,
        when one is not free)."""
        free, want = set(self._free), set(blocks)
        taken = [b for b in blocks if b not in free]
        if taken or len(want) != len(blocks):
            raise ValueError(f"claim of blocks {blocks}: {taken or 'duplicates'} not free")
        self._free = [b for b in self._free if b not in want]  # stays sorted descending
        self._mapped[blocks] = True
        self._owned.setdefault(owner, []).extend(blocks)

    def map_cached(self, owner: Hashable, blocks: np.ndarray) -> np.ndarray:
        """Give ``owner`` (which must own nothing yet) an id for each cached host block
        of ``blocks`` (int64 [n]) in order: the block's own id when no owner maps it,
        else an alias; stops at the first block with no id left. Returns the ids (int64
        [m], m <= n; the caller counts the references in the prefix index)."""
        if self._owned.get(owner):
            raise ValueError(f"map_cached for {owner!r}, which owns blocks already")
        hb = np.asarray(blocks, dtype=np.int64)
        taken = self._mapped[hb]  # these need an alias
        k = int(np.count_nonzero(taken))
        if k > len(self._aliases):  # stop at the first block with no id left
            n = int(np.flatnonzero(np.cumsum(taken) > len(self._aliases))[0])
            hb, taken, k = hb[:n], taken[:n], len(self._aliases)
        ids = hb.copy()
        if k:
            alias = int64_array(self._aliases[-1:-k - 1:-1])  # lowest first
            del self._aliases[-k:]
            ids[taken] = alias
            self.host_of[alias] = hb[taken]
        self._mapped[hb[~taken] if k else hb] = True
        if len(ids):
            self._owned.setdefault(owner, []).extend(ids.tolist())
        return ids

    def free(self, owner: Hashable, extra: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Release every block id of ``owner``: a cached block loses the owner's reference
        (it stays cached), any other block returns to the free list; ``extra``: (i,
        cached block) pairs the owner also references in place of its private block i,
        released in their places. Returns the host blocks that went to the free list."""
        ids = int64_array(self._owned.pop(owner, _EMPTY))
        hb = self.host_of[ids]
        alias = ids >= self.num_blocks
        self._mapped[ids[~alias]] = False
        if alias.any():
            self._aliases.extend(ids[alias].tolist())
            self._aliases.sort(reverse=True)
        cache = self.cache
        if cache is not None:
            held = cache.holds_each(hb)
            rel = np.where(held, hb, -1)
            for i, b in extra:  # its private copy at i is not cached
                rel[i] = b
            # last block first: released together, a chain's tail is evicted before its head
            # (a cached block's parent stays cached while it is: prefix_index)
            cache.release(rel[rel >= 0][::-1])
            freed = hb[~held].tolist()
        else:
            freed = hb.tolist()
        # keep the free list sorted descending so pop() keeps giving the lowest id
        self._free.extend(freed)
        self._free.sort(reverse=True)
        return freed

    def give_back(self, blocks: Sequence[int]) -> None:
        """Host blocks that left the prefix index (reset) return to the free list."""
        self._free.extend(blocks)
        self._free.sort(reverse=True)


class HostPool:
    """Pinned host rows ``uint8 [L, H, row_bytes]`` and their :class:`BlockAllocator`.

    ``pin``: None = pin when CUDA is available (as PinnedBuffer decides).

    Hooks for pools several processes share (``SharedHostPool`` overrides them; here
    they do nothing): ``is_writer`` (whether this process writes rows), ``shared``,
    ``commit_append(layer, event)`` after an append's host copy was enqueued, and
    ``wait_visible(layer)`` before rows of ``layer`` are read.
    """

    is_writer = True
    shared = False

    def __init__(self, cfg: HiSparseConfig, *, pin: bool | None = None) -> None:
        self.cfg = cfg
        self.B = cfg.host_block_size
        self.buffer = PinnedBuffer(cfg.host_pool_bytes, pin=pin)
        # uint8 [L, H, row_bytes]; a view of exactly cfg.host_pool_bytes pinned bytes
        self.rows = self.buffer.tensor.view(cfg.num_layers, cfg.num_host_rows, cfg.row_bytes)
        self.allocator = BlockAllocator(cfg.num_host_blocks, cfg.prefix_alias_blocks)

    @property
    def pinned(self) -> bool:
        return self.buffer.pinned

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def blocks_needed(self, owner: Hashable, num_tokens: int) -> int:
        """Blocks ``owner`` still needs to hold positions ``0 .. num_tokens - 1``."""
        have = len(self.allocator.owned(owner))
        need = -(-num_tokens // self.B)
        return max(0, need - have)

    def host_rows(self, owner: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Host row (within a layer) of each position. positions: int64 [n] CPU -> int64 [n].

        Positions must lie inside the owner's blocks (checked: ValueError).
        """
        return self._rows_of(self.allocator.host_blocks(owner), positions)

    def row_keys(self, owner: Hashable, positions: torch.Tensor) -> torch.Tensor:
        """Row key (block id x B + offset: what ``row_slot`` is indexed by,
        ``hisparse.cache.state``) of each position. positions: int64 [n]
        CPU -> int64 [n]; positions must lie inside the owner's blocks (ValueError)."""
        return self._rows_of(np.asarray(self.allocator.owned(owner), dtype=np.int64), positions)

    def _rows_of(self, blocks: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        """``blocks[p // B] * B + p % B`` of each position p (blocks: int64 [m], the owner's
        blocks or ids in logical order; ValueError for a position past them)."""
        blk = torch.from_numpy(blocks)
        pos = positions.to(torch.int64)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= blk.numel() * self.B):
            raise ValueError(f"positions out of the owner's {blk.numel()} blocks of {self.B} tokens")
        return blk[pos // self.B] * self.B + pos % self.B

    def segments(self, owner: Hashable, p0: int, p1: int) -> list[tuple[int, int, int]]:
        """Positions ``[p0, p1)`` of ``owner`` split into runs contiguous in the pool:
        ``[(pos_start, pos_end, host_row_start), ...]`` (see :func:`block_segments`)."""
        blocks = self.allocator.host_blocks(owner)  # int64 [n]
        if p1 > len(blocks) * self.B or p0 < 0:
            raise ValueError(f"positions [{p0}, {p1}) exceed the owner's {len(blocks)} blocks")
        return block_segments(blocks, self.B, p0, p1)

    def commit_append(self, layer: int, event=None) -> None:
        """An append to ``layer`` was enqueued (its host copy completes with ``event``)."""

    def wait_visible(self, layer: int) -> None:
        """Return once every committed append of ``layer`` can be read from the pool."""

    def release(self) -> None:
        """Unpin the buffer now, or at the next safe point under a capture or off the main
        thread (``hisparse.device``); no device work may use it afterwards."""
        self.buffer.release()


def check_pool(host_pool: object, cfg: HiSparseConfig) -> None:
    """A pool built elsewhere (None: none) must be a HostPool of the same config."""
    if host_pool is not None and not isinstance(host_pool, HostPool):
        raise TypeError(f"host_pool must be a HostPool, got {type(host_pool).__name__}")
    if host_pool is not None and host_pool.cfg.to_dict() != cfg.to_dict():
        diff = [k for k, v in cfg.to_dict().items() if host_pool.cfg.to_dict().get(k) != v]
        raise ValueError(f"host_pool was built for another config (differs in {diff})")


__all__ = ["BlockAllocator", "HostPool", "block_segments", "check_pool", "int64_array"]
