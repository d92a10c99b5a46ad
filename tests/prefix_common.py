"""Helpers shared by the focused prefix-cache tests (test_prefix_cache.py,
test_prefix_cache_eviction.py, test_prefix_cache_api.py): a small prefix-caching
cache (``make``), a request with its tokens and rows (``Req``, rows from
``prefix_model.Rows``) and token ranges (``toks``).
"""

from __future__ import annotations

import torch

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache

from prefix_model import Rows

B = 4


def make(kernels="torch", **kw) -> HiSparseCache:
    base = dict(num_layers=2, row_bytes=64, top_k=4, device_buffer_size=8, host_block_size=B,
                max_num_reqs=4, host_pool_tokens=B * 20, max_request_id=12, device="cpu",
                prefix_caching=True)
    base.update(kw)
    return HiSparseCache(HiSparseConfig(**base), kernels=kernels)


class Req:
    """A request of the focused tests: its tokens and rows (``prefix_model.Rows``)."""

    def __init__(self, cache, rid, tokens, salt=None, given=True):
        self.cache, self.rid, self.salt = cache, rid, salt
        self.rows = Rows(salt, cache.cfg.num_layers, cache.cfg.row_bytes)
        self.rows.extend(tokens)
        self.cached = cache.add_request(rid, list(tokens), salt) if given else cache.add_request(rid)

    @property
    def tokens(self):
        return self.rows.tokens

    def write(self, layers=None, end=None):
        """Write the rows each layer lacks up to ``end`` (default: every token)."""
        c = self.cache
        end = len(self.tokens) if end is None else end
        for l in (range(c.cfg.num_layers) if layers is None else layers):
            p0 = c.request(self.rid).lengths[l]
            if p0 < end:
                assert c.write(l, self.rid, self.rows.get(l, p0, end))[0] == p0

    def decode(self, tokens, give=True):
        for t in tokens:
            self.rows.extend([t])
            self.write()
        if give:
            self.cache.add_tokens(self.rid, list(tokens))

    def resolve(self, layer, positions):
        """Resolve ``positions`` (padded to top_k) and check every row byte-exact;
        returns the physical rows."""
        c = self.cache
        K = c.cfg.top_k
        row = list(positions) + [-1] * (K - len(positions))
        res = c.resolve(layer, torch.tensor([self.rid], dtype=torch.int32), torch.tensor([row], dtype=torch.int32))
        phys = res.physical[0].tolist()[:len(positions)]
        for p, x in zip(positions, phys):
            assert torch.equal(c.hot[layer, x], self.rows.get(layer, p, p + 1)[0]), (self.rid, layer, p, x)
        return phys


def toks(n, start=100):
    return list(range(start, start + n))
