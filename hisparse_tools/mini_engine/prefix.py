"""Prefix reuse in the mini engine (``MiniEngineConfig.prefix_reuse``, ``--prefix-reuse``).

The hisparse store admits a request with its prompt's token ids
(``HiSparseIndexGroup.add_request(rid, token_ids=...)``); the cache answers how many
leading tokens' KV rows it holds already (whole host blocks that an earlier request
wrote), and the engine starts the request there: it computes and writes only the
rest. The rows are not all an engine keeps per token: the indexer's keys of the cached
positions are needed too, and hisparse does not hold them. :class:`IndexerPrefix` is the
engine's own cache of them, by chained names of the blocks' token ids (as the cache
names its blocks, :func:`block_names`): after
each forward it keeps the keys of every prompt block the forward completed, and a
request that starts at a cached position gets its keys copied into its indexer slot.
It never drops a block, so every block the cache can return has its keys here.

The workload (``shared_prefix`` > 0): request i's prompt starts with the
``shared_prefix`` tokens of group i % ``prefix_groups``. The resident store computes
everything, so the comparison of the two runs checks that the reused rows give the
outputs of computed ones; positions a request skipped have no output and are left out
of it (``compare``'s ``tokens_skipped``).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .config import MiniEngineConfig, Request
from .model import Indexer


def block_names(tokens: torch.Tensor, B: int) -> list[bytes]:
    """Chained names of the whole blocks of ``tokens`` (int, CPU): block i's name hashes
    block i - 1's name and block i's token ids, so equal names mean equal prefixes."""
    raw = np.ascontiguousarray(tokens.numpy().astype("<u4")).tobytes()
    names, h = [], b""
    for i in range(len(raw) // (4 * B)):
        h = hashlib.sha256(h + raw[4 * B * i:4 * B * (i + 1)]).digest()
        names.append(h)
    return names


class IndexerPrefix:
    """Indexer keys of the prompt blocks computed so far, by block name (see the module
    docstring)."""

    def __init__(self, cfg: MiniEngineConfig, indexer: Indexer) -> None:
        self.B = cfg.host_block_size
        self.indexer = indexer
        self.store: dict[bytes, torch.Tensor] = {}  # block name -> fp32 [F, B, d_idx]
        self.names: dict[int, list[bytes]] = {}  # rid -> its prompt's block names

    def admit(self, r: Request, cached: int) -> None:
        """Request ``r`` (its slot set) starts at position ``cached``: copy the keys of its
        cached blocks into its slot."""
        names = self.names[r.rid] = block_names(r.tokens[:r.prompt_len], self.B)
        keys = self.indexer.keys
        for i in range(cached // self.B):
            keys[:, r.slot, i * self.B:(i + 1) * self.B] = self.store[names[i]]

    def save(self, r: Request, p0: int, p1: int) -> None:
        """A forward computed positions [p0, p1) of ``r``: keep the keys of each prompt
        block it completed (not kept yet)."""
        names, B = self.names.get(r.rid, ()), self.B
        for i in range(p0 // B, min(p1 // B, len(names))):  # the blocks ending in (p0, p1]
            if names[i] not in self.store:
                self.store[names[i]] = self.indexer.keys[:, r.slot, i * B:(i + 1) * B].clone()

    def release(self, r: Request) -> None:
        self.names.pop(r.rid, None)


__all__ = ["IndexerPrefix", "block_names"]
