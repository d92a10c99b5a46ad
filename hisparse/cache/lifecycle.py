"""Admitting and freeing requests: ``HiSparseCache.add_request`` / ``free_request``.

Both run on the current stream after every in-flight resolve and staging
(``CacheStreams.join_staging``) and decide from host-side bookkeeping; the device
tables they change (id map, block table, lengths, LRU state, residency) are written
with small copies on the current stream. Every check runs before the first change,
so a refused call changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import CapacityError
from .host_pool import int64_array

if TYPE_CHECKING:
    from .cache import HiSparseCache


def admit(cache: "HiSparseCache", req_id: int, token_ids=None, salt: bytes | None = None) -> int:
    """``add_request``: admit ``req_id``; with ``token_ids`` (prefix caching) map the
    longest cached prefix and return its tokens (0 otherwise)."""
    req, prefix = cache.requests, cache.prefix
    rid = req.check_id(req_id)
    if req.is_live(rid):
        raise ValueError(f"request {rid} is already live")
    if len(req) >= req.max_num_reqs:
        raise CapacityError(f"all max_num_reqs={req.max_num_reqs} request slots are taken; free a request first")
    if token_ids is not None or salt is not None:
        if prefix is None:
            raise ValueError("token_ids / salt need a cache configured with prefix_caching=True")
        if salt is not None and not isinstance(salt, (bytes, bytearray)):
            raise TypeError(f"salt must be bytes or None, got {type(salt).__name__}")
    salt = None if salt is None else bytes(salt)
    if token_ids is not None:
        ids = prefix.check_ids(token_ids)  # ValueError on bad ids, before any change
    cache.streams.join_staging()
    if token_ids is not None:
        if len(ids) > 1:
            prefix.publish(req, cache.writer.unwritten_from())  # blocks every layer holds become findable
        hits, chain = prefix.lookup(ids, salt)
    r = req.add(rid)
    st = cache.state
    st.id_to_slot[rid] = r
    cached = 0
    if prefix is None:
        if cache.dpool.admit(r):
            st.resident[r] = 1
        return 0
    if token_ids is None:
        prefix.track(r, salt)
    else:
        mapped = prefix.admit(r, ids, salt, hits, chain)
        cached = len(mapped) * cache.pool.B
    if cached:
        _map_blocks(cache, r, mapped, cached)
        _join_shared(cache, r, hits[:len(mapped)], cached)
    elif cache.dpool.admit(r):
        st.resident[r] = 1
    return cached


def _join_shared(cache: "HiSparseCache", r: int, hits: np.ndarray, cached: int) -> None:
    """Request slot r (new, ``cached`` tokens in the cached blocks ``hits``, int64 [n])
    joins resident on the pages of a resident request that holds the same blocks (the
    lowest such slot), when the tier shares prefix pages; else it stays hot. The copy
    of a partial last page runs on the current stream, after the holder's writes."""
    dp = cache.dpool
    if not (dp.enabled and cache.cfg.share_prefix_pages):
        return
    holder = cache.prefix.holder(hits, dp.resident_slots())
    if holder is None:
        return
    got = dp.holder_pages(holder, cached)
    if got is None:
        return
    pages, src = got
    dp.admit(r)
    own = dp.share(r, pages, src >= 0)
    st = cache.state
    k = int(dp.npages[r])
    st.page_table[r, :k].copy_(torch.from_numpy(dp.page_of[r, :k].astype(np.int32)))
    if own >= 0:  # the rows of the holder's page past the whole pages, in every layer
        PB, base = dp.PB, st.pool_base
        rem = cached - len(pages) * PB
        cache.hot[:, base + own * PB:base + own * PB + rem] = cache.hot[:, base + src * PB:base + src * PB + rem]
    st.resident[r] = 1


def _map_blocks(cache: "HiSparseCache", r: int, ids: np.ndarray, cached: int) -> None:
    """Request slot r (new) starts with ``cached`` tokens in every layer, held in the
    cached host blocks it mapped under block ids ``ids`` (int64 [n]; no reserved-slot
    occupant). The block table, and the alias map when the alias ids are one run, take one
    copy from the host each."""
    st, dev, w = cache.state, cache.device, cache.writer
    NB = cache.pool.allocator.num_blocks
    n = len(ids)
    v = ids.astype(np.int32)
    st.block_table[r, :n].copy_(torch.from_numpy(v))
    alias = ids[ids >= NB]  # ascending and distinct (aliases are handed out lowest first)
    if len(alias):
        hb = torch.from_numpy(cache.pool.allocator.host_of[alias].astype(np.int32))
        a0 = int(alias[0])
        if int(alias[-1]) - a0 == len(alias) - 1:  # one run of ids
            st.host_block[a0:a0 + len(alias)].copy_(hb)
        else:
            st.host_block.index_copy_(0, torch.from_numpy(alias).to(dev), hb.to(dev))
    st.seq_lens[:, r] = cached
    w.host_blocks[r, :n] = v
    w.num_blocks[r] = n
    cache.requests.set_uniform(r, cached)
    cache.requests.touch_all()


def release(cache: "HiSparseCache", req_id: int) -> list[int]:
    """``free_request``: return every block (a cached one loses this request's
    reference), clear every slot mapping of every layer, release the id. Returns the
    host blocks that went back to the free list."""
    r = cache.requests.slot(req_id)
    cache.streams.join_staging()
    st, B = cache.state, cache.pool.B
    if cache.prefix is not None:
        cache.prefix.publish(cache.requests, cache.writer.unwritten_from(), (r,))  # its written blocks stay cached
    ids = int64_array(cache.pool.allocator.owned(r))
    if len(ids):  # clear row_slot run by run of consecutive block ids
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        for a, b in zip(ids[np.concatenate(([0], cut))].tolist(), ids[np.append(cut - 1, len(ids) - 1)].tolist()):
            st.row_slot[:, a * B:(b + 1) * B] = -1
    st.slot_pos[:, r] = -1
    st.slot_stamp[:, r] = -1
    st.step[:, r] = 0
    st.seq_lens[:, r] = 0
    st.block_table[r] = -1
    st.id_to_slot[req_id] = -1
    st.resident[r] = 0
    st.page_table[r] = -1
    cache.dpool.release(r)
    extra = cache.prefix.forget(r) if cache.prefix is not None else []
    freed = cache.pool.allocator.free(r, extra)
    cache.writer.release(r)
    cache.requests.remove(req_id)
    return freed


__all__ = ["admit", "release"]
