"""The rows a ``PDReceiver.commit`` hands its step write, layer by layer.

A commit writes the request's ``C`` rows to every layer through the cache's own step
write (``write_step(layer, step, rows)``, rows uint8 [C, row_bytes] on the cache
device); with ``host_written`` the write reads only the rows it puts on the device:
the positions of the commit's *spans* (``PDReceiver._device_spans``: all C of a
resident request, S + 1 of a hot one). The request's blocks are the same in every
layer, so which host row each of those positions sits in is worked out once per commit
(:class:`CommitRows`); a layer then costs one gather:

- CPU cache, the request's positions one run of the pool: the layer's pool rows
  themselves (a view, no copy).
- CUDA cache with the Triton kernels and a pinned pool: one launch of the row-copy
  kernel (``hisparse.cache.transfer``, the miss-staging kernel) on the current stream,
  which reads the pinned pool over UVA: no host gather, no staging buffer.
- otherwise: ``index_select`` of the span rows into ``buf`` (per span; on CPU straight
  into ``buf``).

The positions outside the spans are left unwritten in ``buf``. ``buf`` is reused by
every layer: a layer's gather and its write are enqueued in order on the current
stream, so the next layer's gather runs after the write that read it.
"""

from __future__ import annotations

import torch

from ..cache.cache import HiSparseCache
from ..cache.transfer import _launch_copy_rows
from ..device import device_ints


class CommitRows:
    """The rows of one commit (module docstring). ``slot``: the request's slot (its
    blocks' owner in the pool), ``num_tokens``: C, ``spans``: the position ranges
    ``[(p0, p1), ...]`` (ascending, disjoint) whose rows the write reads."""

    def __init__(self, cache: HiSparseCache, slot: int, num_tokens: int, spans: list[tuple[int, int]]) -> None:
        C, rb = num_tokens, cache.cfg.row_bytes
        self.C = C
        pool = cache.pool
        self.layers = pool.rows  # uint8 [L, H, row_bytes], the pool's rows of every layer
        self.dev = cache.device
        runs = pool.segments(slot, 0, C)  # [(p0, p1, host row of p0)]: the same blocks in every layer
        self.view_row = runs[0][2] if self.dev.type == "cpu" and len(runs) == 1 else None
        self.uva = self.dev.type == "cuda" and cache.kernels == "triton" and pool.pinned
        self.buf: torch.Tensor | None = None
        if self.view_row is not None:
            return
        pos = torch.cat([torch.arange(p0, p1, dtype=torch.int64) for p0, p1 in spans])  # int64 [n] CPU
        src = pool.host_rows(slot, pos)  # int64 [n] CPU: the host row of each position in pos
        self.buf = torch.empty((C, rb), dtype=torch.uint8, device=self.dev)  # uint8 [C, row_bytes]
        if self.uva:
            # int32 [n] each on the device, one copy each, made once for every layer
            self.src = device_ints(src.to(torch.int32).numpy(), self.dev)  # host row to read
            self.dst = device_ints(pos.to(torch.int32).numpy(), self.dev)  # row of buf to write
        else:
            self.src = src  # int64 [n] CPU
            # (p0, p1, k0): span [p0, p1) takes src[k0 : k0 + p1 - p0]
            self.pieces, k = [], 0
            for p0, p1 in spans:
                self.pieces.append((p0, p1, k))
                k += p1 - p0

    def rows(self, layer: int) -> torch.Tensor:
        """uint8 [C, row_bytes] on the cache device: the request's rows of ``layer`` at
        the spans' positions (a view of the pool, or ``buf``)."""
        host = self.layers[layer]  # uint8 [H, row_bytes]
        if self.view_row is not None:
            return host[self.view_row:self.view_row + self.C]
        buf = self.buf
        assert buf is not None
        if self.uva:
            _launch_copy_rows(host, self.src, buf, self.dst, self.dev)
            return buf
        for p0, p1, k in self.pieces:
            idx = self.src[k:k + p1 - p0]  # int64 [p1 - p0] CPU
            if buf.is_cpu:
                torch.index_select(host, 0, idx, out=buf[p0:p1])
            else:  # a pool the kernel can't read (not pinned, or torch kernels)
                buf[p0:p1].copy_(host.index_select(0, idx))
        return buf
