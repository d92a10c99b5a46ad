"""A plain model of prefix caching and the rows a model would write (used by
``prefix_trace.PrefixTrace`` and the focused prefix-cache tests).

Rows are what a model would write: the row of (layer l, position p) of a request is a
deterministic function of l, the request's salt and its token ids ``0..p``
(``shake_128`` of a chained digest of them), so two requests that agree on a prefix
hold byte-identical rows there and a shared block has well-defined content.

:class:`PrefixModel` is written from the docstrings of ``hisparse.cache.prefix`` /
``host_pool.BlockAllocator`` / ``state``, not from their code:

- a block is named by (salt, every token id up to its end) — a plain tuple here;
- lookup: the longest run of cached names that prefix the prompt, at most
  ``(len - 1) // B`` blocks, mapped under the block's own id when no live request holds
  that id, else under the lowest free alias id, stopping at the first block with no id;
- publishing: a live request's block is cached once every layer holds its rows and its
  tokens are known (given with the prompt or ``add_tokens``), checked for every live
  request (admission order) before a lookup of a prompt of >= 2 tokens, in ``stats``,
  and for the request itself when it is freed; a name cached already stays private, and
  the request references the cached block of that name instead until it is freed;
- allocation: free blocks lowest id first; when too few are free, the least recently
  released unreferenced cached blocks are evicted (counted) and handed out in that
  order; a write that needs more than free + evictable blocks raises CapacityError;
- free: a cached block loses the request's reference (unreferenced: evictable, newest
  last, last block first, a cached block held for a private copy in that copy's place),
  any other block goes back to the free list;
- ``reset_prefix_cache``: every evictable block back to the free list (not counted).
"""

from __future__ import annotations

import collections
import hashlib

import torch


# ----------------------------------------------------------------------- rows
def _chain(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(prev + int(token).to_bytes(4, "little"), digest_size=16).digest()


def _root(salt: bytes | None) -> bytes:
    return hashlib.blake2b(b"root:" + (salt or b""), digest_size=16).digest()


class Rows:
    """The rows of one token sequence (per layer, growing): row (l, p) =
    shake_128(digest of salt and tokens 0..p, l)."""

    def __init__(self, salt: bytes | None, L: int, row_bytes: int) -> None:
        self.salt, self.L, self.rb = salt, L, row_bytes
        self.tokens: list[int] = []
        self.keys: list[bytes] = []
        self._t = [torch.empty((0, row_bytes), dtype=torch.uint8) for _ in range(L)]
        self._n = 0

    def extend(self, tokens) -> None:
        prev = self.keys[-1] if self.keys else _root(self.salt)
        for t in tokens:
            prev = _chain(prev, t)
            self.tokens.append(int(t))
            self.keys.append(prev)

    def pop(self) -> None:
        self.tokens.pop()
        self.keys.pop()
        self._n = min(self._n, len(self.keys))

    def get(self, layer: int, p0: int, p1: int) -> torch.Tensor:
        """uint8 [p1 - p0, row_bytes] (CPU)."""
        if p1 > self._n:
            n_old = self._n
            if p1 > self._t[0].shape[0]:
                cap = max(p1, 2 * self._t[0].shape[0], 16)
                for l in range(self.L):
                    new = torch.empty((cap, self.rb), dtype=torch.uint8)
                    new[:n_old] = self._t[l][:n_old]
                    self._t[l] = new
            for l in range(self.L):
                raw = b"".join(content(k, l, self.rb) for k in self.keys[n_old:p1])
                self._t[l][n_old:p1] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, self.rb)
            self._n = p1
        return self._t[layer][p0:p1]


def content(key: bytes, layer: int, row_bytes: int) -> bytes:
    return hashlib.shake_128(key + bytes([layer])).digest(row_bytes)


# ---------------------------------------------------------------------- model
class MReq:
    def __init__(self, rid: int, slot: int, salt: bytes | None, L: int, rb: int, order: int) -> None:
        self.rid, self.slot, self.salt, self.order = rid, slot, salt, order
        self.rows = Rows(salt, L, rb)  # every token of the request (rows are their content)
        self.given = 0  # leading tokens the cache was told
        self.ids: list[int] = []  # block ids
        self.lens = [0] * L  # rows written per layer
        self.done = 0  # leading blocks that are in the index
        self.held: dict[int, int] = {}  # block i -> the cached block it references for its private copy

    @property
    def tokens(self) -> list[int]:
        return self.rows.tokens


class PrefixModel:
    """See the module docstring."""

    def __init__(self, cfg) -> None:
        self.B, self.NB, self.L = cfg.host_block_size, cfg.num_host_blocks, cfg.num_layers
        self.A, self.rb, self.R = cfg.prefix_alias_blocks, cfg.row_bytes, cfg.max_num_reqs
        self.free: set[int] = set(range(self.NB))
        self.aliases: set[int] = set(range(self.NB, self.NB + self.A))
        self.alias_host: dict[int, int] = {}
        self.mapped: set[int] = set()  # host blocks held under their own id
        self.index: dict[tuple, int] = {}  # name -> host block
        self.name_of: dict[int, tuple] = {}
        self.keys_of: dict[int, list[bytes]] = {}  # cached block -> its positions' row keys
        self.refs: dict[int, int] = {}
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.short = 0
        self.reqs: dict[int, MReq] = {}
        self._order = 0

    # ---- helpers ----------------------------------------------------------------
    def host(self, v: int) -> int:
        return v if v < self.NB else self.alias_host[v]

    def name(self, salt, tokens, i: int) -> tuple:
        return (salt, tuple(tokens[:(i + 1) * self.B]))

    def names(self, q: MReq) -> int:
        """Whole blocks of the tokens the cache was told."""
        return q.given // self.B

    def lookup(self, tokens, salt) -> list[int]:
        cap = max(0, (len(tokens) - 1) // self.B)
        out = []
        for i in range(min(cap, len(tokens) // self.B)):
            b = self.index.get(self.name(salt, tokens, i))
            if b is None:
                break
            out.append(b)
        return out

    # ---- operations ---------------------------------------------------------------
    def publish(self, q: MReq) -> None:
        n = self.names(q)
        if q.done >= n:
            return
        whole = min(min(q.lens) // self.B, n)
        for i in range(q.done, whole):
            key = self.name(q.salt, q.tokens, i)
            if key in self.index:  # private copy: reference the cached one
                b = self.index[key]
                q.held[i] = b
                self.refs[b] = self.refs.get(b, 0) + 1
                self.lru.pop(b, None)
                continue
            b = self.host(q.ids[i])
            assert b not in self.name_of, "model: a fresh block is cached already"
            self.index[key] = b
            self.name_of[b] = key
            self.keys_of[b] = q.rows.keys[i * self.B:(i + 1) * self.B]
            self.refs[b] = 1
        q.done = max(q.done, whole)

    def publish_all(self) -> None:
        for q in sorted(self.reqs.values(), key=lambda q: q.order):
            self.publish(q)

    def add(self, rid: int, slot: int, tokens, salt, given: bool) -> int:
        """Admit; ``tokens``: the request's prompt (told to the cache when ``given``)."""
        if given and len(tokens) > 1:
            self.publish_all()
        q = MReq(rid, slot, salt if given else None, self.L, self.rb, self._order)
        self._order += 1
        q.rows.extend(tokens)
        if given:
            q.given = len(tokens)
            hits = self.lookup(tokens, salt) if len(tokens) > 1 else []
            for b in hits:
                if b not in self.mapped:
                    self.mapped.add(b)
                    q.ids.append(b)
                elif self.aliases:
                    v = min(self.aliases)
                    self.aliases.discard(v)
                    self.alias_host[v] = b
                    q.ids.append(v)
                else:
                    break
                self.refs[b] = self.refs.get(b, 0) + 1
                self.lru.pop(b, None)
            self.short = len(hits) - len(q.ids)  # cached blocks left unmapped (no id left)
            self.query_tokens += len(tokens)
            self.hit_tokens += len(q.ids) * self.B
            q.done = len(q.ids)
            q.lens = [len(q.ids) * self.B] * self.L
        self.reqs[rid] = q
        return len(q.ids) * self.B

    def need(self, q: MReq, end: int) -> int:
        return max(0, -(-end // self.B) - len(q.ids))

    def can_write(self, items: list[tuple[int, int]]) -> bool:
        """items: (rid, rows end)."""
        total = sum(self.need(self.reqs[rid], end) for rid, end in items)
        return total <= len(self.free) + len(self.lru)

    def write(self, layers, items: list[tuple[int, int]]) -> None:
        """items: (rid, rows) appended to each of ``layers`` (allocation on the first)."""
        layers = list(layers)
        for rid, n in items:
            q = self.reqs[rid]
            k = self.need(q, q.lens[layers[0]] + n)
            got = sorted(self.free)[:k]
            self.free.difference_update(got)
            while len(got) < k:
                b, _ = self.lru.popitem(last=False)
                del self.index[self.name_of.pop(b)]
                del self.keys_of[b]
                self.evictions += 1
                got.append(b)
            self.mapped.update(got)
            q.ids += got
            for l in layers:
                q.lens[l] += n

    def give(self, rid: int, n: int) -> int:
        q = self.reqs[rid]
        q.given += n
        assert q.given <= len(q.tokens)
        return q.given

    def free_req(self, rid: int) -> None:
        q = self.reqs[rid]
        self.publish(q)
        del self.reqs[rid]
        for i in reversed(range(len(q.ids))):  # the last block first: a chain's tail is evicted before its head
            v = q.ids[i]
            b = self.host(v)
            if v >= self.NB:
                self.aliases.add(v)
                del self.alias_host[v]
            else:
                self.mapped.discard(v)
            if i in q.held:
                self.free.add(b)
                h = q.held[i]
                self.refs[h] -= 1
                if self.refs[h] == 0:
                    del self.refs[h]
                    self.lru[h] = None
            elif b in self.name_of:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    del self.refs[b]
                    self.lru[b] = None
            else:
                self.free.add(b)

    def reset(self) -> int:
        n = len(self.lru)
        for b in list(self.lru):
            del self.index[self.name_of.pop(b)]
            del self.keys_of[b]
            self.free.add(b)
        self.lru.clear()
        return n

    def stats(self) -> dict[str, int]:
        return dict(prefix_query_tokens=self.query_tokens, prefix_hit_tokens=self.hit_tokens,
                    cached_blocks=len(self.index), shared_blocks=sum(1 for n in self.refs.values() if n > 1),
                    prefix_evictions=self.evictions)


__all__ = ["MReq", "PrefixModel", "Rows", "content"]
