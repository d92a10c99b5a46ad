"""Triton body of the row-copy (staging) kernel: ``dst[dst_idx[i]] = src[src_idx[i]]``.

Rows are opaque bytes whose width is a multiple of 16; the launcher
(``hisparse.cache.transfer.copy_rows``) views them as int32 words so that each thread
moves 16-byte vectors (4 words: the row width in words is a multiple of 4 and is a
constexpr, so Triton's alignment analysis proves every row start is 16-byte aligned).

Either side may be pinned host memory reached over UVA (the PCIe read/write is issued
by the load/store itself), so the kernel is written to keep many rows in flight: each
program moves ``ROWS`` full rows per iteration of a persistent loop (grid sized from
the SM count), and an entry whose index is -1 or out of range costs one index load and
no data traffic.
"""

from __future__ import annotations

import triton
import triton.language as tl


# The counts vary per call: no specialisation on them (avoids recompiles).
@triton.jit(do_not_specialize=["Ns", "Nd", "N", "NPROG", "NCHUNKS"])
def copy_rows_kernel(
    src_ptr,  # int32 [Ns, WW] (rows of the uint8 source viewed as words)
    src_idx_ptr,  # int32 [N], -1 = skip
    Ns,  # rows in src
    dst_ptr,  # int32 [Nd, WW]
    dst_idx_ptr,  # int32 [N], -1 = skip
    Nd,  # rows in dst
    N,  # entries in the index lists
    NPROG,  # programs in the grid (the persistent loop's stride)
    NCHUNKS,  # cdiv(N, ROWS)
    WW: tl.constexpr,  # words (int32) per row = row_bytes / 4, a multiple of 4
    WB: tl.constexpr,  # next power of two >= WW (tile width)
    ROWS: tl.constexpr,  # rows per program per iteration (power of two)
):
    pid = tl.program_id(0)
    cols = tl.arange(0, WB)
    cmask = cols < WW
    lanes = tl.arange(0, ROWS)
    # a while loop (not range) also runs in the interpreter with numpy >= 2.4
    c = pid
    while c < NCHUNKS:
        ri = c * ROWS + lanes
        rm = ri < N
        si = tl.load(src_idx_ptr + ri, mask=rm, other=-1)
        di = tl.load(dst_idx_ptr + ri, mask=rm, other=-1)
        ok = (si >= 0) & (si < Ns) & (di >= 0) & (di < Nd)
        m2 = ok[:, None] & cmask[None, :]
        s_off = si.to(tl.int64)[:, None] * WW + cols[None, :]
        d_off = di.to(tl.int64)[:, None] * WW + cols[None, :]
        x = tl.load(src_ptr + s_off, mask=m2, other=0)
        tl.store(dst_ptr + d_off, x, mask=m2)
        c += NPROG


@triton.jit(do_not_specialize=["Ns", "Nd", "T", "K", "NPROG"])
def copy_staged_kernel(
    src_ptr,  # int32 [Ns, WW] (the layer's host rows viewed as words)
    src_idx_ptr,  # int32 [T * K]: group t's staging list at [t * K, t * K + counts[t]), host rows
    Ns,
    dst_ptr,  # int32 [Nd, WW] (the layer's hot rows viewed as words)
    dst_idx_ptr,  # int32 [T * K], parallel to src_idx
    Nd,
    counts_ptr,  # int32 [T] rows to stage of the group whose first token is t (0 = none)
    T,
    K,
    NPROG,  # programs in the grid (the persistent loop's stride)
    WW: tl.constexpr,
    WB: tl.constexpr,
    ROWS: tl.constexpr,
    TB: tl.constexpr,  # groups whose counts are read at once (power of two)
):
    """A resolve's staging: only the first ``counts[t]`` entries (at most (T - t) * K: a
    group of q tokens has q * K) of each group's list are read.

    The counts are read TB groups at a time as one vector, and a block of groups with
    nothing to stage is skipped whole: a step without misses costs each program one
    load and one sum per block. In a block with misses, each group's count is read
    again (a scalar load, one dependent round trip per group), and chunk c of group t
    goes to program (t + c) mod NPROG, so small groups spread over the programs too."""
    pid = tl.program_id(0)
    cols = tl.arange(0, WB)
    cmask = cols < WW
    lanes = tl.arange(0, ROWS)
    tb = tl.arange(0, TB)
    t0 = pid * 0
    while t0 < T:
        cv = tl.load(counts_ptr + t0 + tb, mask=t0 + tb < T, other=0)
        if tl.sum((cv > 0).to(tl.int32), axis=0) > 0:
            t = t0
            t_end = tl.minimum(t0 + TB, T)
            while t < t_end:
                m = tl.maximum(tl.minimum(tl.load(counts_ptr + t), (T - t) * K), 0)  # may span q tokens
                c = (pid - t % NPROG + NPROG) % NPROG
                while c * ROWS < m:
                    j = c * ROWS + lanes
                    jm = j < m
                    ri = t.to(tl.int64) * K + j
                    si = tl.load(src_idx_ptr + ri, mask=jm, other=-1)
                    di = tl.load(dst_idx_ptr + ri, mask=jm, other=-1)
                    ok = jm & (si >= 0) & (si < Ns) & (di >= 0) & (di < Nd)
                    m2 = ok[:, None] & cmask[None, :]
                    x = tl.load(src_ptr + si.to(tl.int64)[:, None] * WW + cols[None, :], mask=m2, other=0)
                    tl.store(dst_ptr + di.to(tl.int64)[:, None] * WW + cols[None, :], x, mask=m2)
                    c += NPROG
                t += 1
        t0 += TB
