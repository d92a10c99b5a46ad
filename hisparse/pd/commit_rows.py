"""The rows a ``PDReceiver.commit`` hands its step write, layer by layer.

A commit writes the request's ``C`` rows to every layer through the cache's own step
write (``write_step(layer, step, rows)``, rows uint8 [C, row_bytes] on the cache
device); with ``host_written`` the write reads only the rows it puts on the device:
the positions of the commit's *spans* (``PDReceiver._device_spans``: all C of a
resident request, S + 1 of a hot one). The request's blocks are the same in every
layer, so the host row of each of those positions is worked out once per commit
(:class:`CommitRows`); a layer then costs one gather:

- a CUDA cache running the Triton kernels (pinned pool): one launch of the row-copy
  kernel (``hisparse.cache.transfer``, the miss-staging kernel) on the current stream,
  reading the pinned pool over UVA: no host gather, no staging buffer, no copy per run;
- a CPU cache whose request is one run of the pool: the layer's pool rows themselves
  (a view, no copy; the positions outside the spans hold rows too, unread);
- otherwise ``index_select`` of each span's rows (at most two spans), straight into
  ``buf`` on CPU, through a host tensor on CUDA (a pool the kernel can't read).

``buf`` (uint8 [C, row_bytes] on the cache device) is reused by every layer and its
rows outside the spans are never written: a layer's gather and its write are
enqueued in order on the current stream, so the next layer's gather runs after the
write that read it.
"""

from __future__ import annotations

import torch

from ..cache.cache import HiSparseCache
from ..cache.transfer import copy_rows_unchecked
from ..device import device_ints


def gathers_by_kernel(cache: HiSparseCache) -> bool:
    """Whether a commit gathers its rows with the row-copy kernel: a CUDA cache running
    the Triton kernels with a pinned pool (the kernel reads it over UVA)."""
    return cache.device.type == "cuda" and cache.kernels == "triton" and cache.pool.pinned


class CommitRows:
    """The rows of one commit (module docstring). ``slot``: the request's slot (its
    blocks' owner in the pool), ``num_tokens``: C, ``spans``: the position ranges
    ``[(p0, p1), ...]`` (ascending, disjoint, inside ``[0, C)``) whose rows the write
    reads."""

    def __init__(self, cache: HiSparseCache, slot: int, num_tokens: int, spans: list[tuple[int, int]]) -> None:
        C, dev, pool = num_tokens, cache.device, cache.pool
        self.C = C
        self.layers = pool.rows  # uint8 [L, H, row_bytes]: the pool's rows of every layer
        self.kernel = gathers_by_kernel(cache)
        self.view_row: int | None = None  # host row of position 0 when every layer's rows are a pool view
        self.buf: torch.Tensor | None = None  # uint8 [C, row_bytes] on dev: span rows gathered here
        runs = pool.segments(slot, 0, C)  # [(p0, p1, host row of p0)]: the same blocks in every layer
        if not self.kernel and dev.type == "cpu" and len(runs) == 1:
            self.view_row = runs[0][2]
            return
        pos = torch.cat([torch.arange(p0, p1, dtype=torch.int64) for p0, p1 in spans])  # int64 [n] CPU
        src = pool.host_rows(slot, pos)  # int64 [n] CPU: the host row of each position of pos
        self.buf = torch.empty((C, cache.cfg.row_bytes), dtype=torch.uint8, device=dev)
        if self.kernel:
            self.launch_dev = dev if dev.type == "cuda" else None  # None: the Triton interpreter
            self.src = device_ints(src.to(torch.int32).numpy(), dev)  # int32 [n] on dev: host row to read
            self.dst = device_ints(pos.to(torch.int32).numpy(), dev)  # int32 [n] on dev: row of buf written
        else:
            self.src = src
            self.pieces: list[tuple[int, int, int]] = []  # (p0, p1, k): span [p0, p1) is src[k : k + p1 - p0]
            k = 0
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
        if self.kernel:
            copy_rows_unchecked(host, self.src, buf, self.dst, self.launch_dev)
            return buf
        for p0, p1, k in self.pieces:
            idx = self.src[k:k + p1 - p0]  # int64 [p1 - p0] CPU
            if buf.is_cpu:
                torch.index_select(host, 0, idx, out=buf[p0:p1])
            else:  # CUDA, a pool the kernel can't read (torch kernels, or not pinned)
                buf[p0:p1].copy_(host.index_select(0, idx))
        return buf
