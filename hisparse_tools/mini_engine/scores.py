"""The mini engine's indexer scores: each decode token's query against every key of its
request, masked past the token's own position, in one pass over the keys.

  scores[t, c] = iq[t] . keys[slots[t], c]   for c <= lim[t], else -inf

On CUDA one Triton launch reads the keys once and writes the scores (what a production
indexer kernel costs: the keys' bytes); the torch reference (a batched matmul over every
slot, a gather of the tokens' rows and a masked fill, three passes over [n, C]) runs on
the CPU and is what the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.device import interpreter_mode, on_device

BLOCK_C = 256  # key positions per program


@triton.jit
def indexer_scores_kernel(
    keys,  # fp32 [S, >= C, D] (strides stride_s, stride_c, 1): each slot's indexer keys
    q,  # fp32 [n, D] contiguous: the tokens' indexer queries
    slots,  # int64 [n]: the token's row of keys
    lim,  # int64 [n]: the last position the token may select (-1: none)
    out,  # fp32 [n, C] (row stride stride_o): scores, -inf past lim
    C, stride_s, stride_c, stride_o,
    D: tl.constexpr, DB: tl.constexpr,  # the key width and its next power of two
    BLOCK: tl.constexpr,  # positions per program; grid (n, cdiv(C, BLOCK))
):
    t = tl.program_id(0)
    cb = tl.program_id(1)
    s = tl.load(slots + t)
    last = tl.load(lim + t)
    offs_c = cb * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DB)
    in_c = offs_c < C
    in_d = offs_d < D
    qv = tl.load(q + t * D + offs_d, mask=in_d, other=0.0)
    kp = keys + s * stride_s + offs_c.to(tl.int64)[:, None] * stride_c + offs_d[None, :]
    k = tl.load(kp, mask=in_c[:, None] & in_d[None, :], other=0.0)
    sc = tl.sum(k * qv[None, :], axis=1)
    sc = tl.where(offs_c <= last, sc, float("-inf"))
    tl.store(out + t.to(tl.int64) * stride_o + offs_c, sc, mask=in_c)


def indexer_scores_reference(keys: torch.Tensor, iq: torch.Tensor, slots: torch.Tensor, sub: torch.Tensor,
                             lim: torch.Tensor, q: int) -> torch.Tensor:
    """keys fp32 [S, C, d] (each slot's keys, C positions), iq fp32 [n, d], slots int64
    [n] (rows of ``keys``), sub int64 [n] (index of the token among its request's q
    tokens), lim int64 [n] (the last position a token may select, -1: none) -> fp32
    [n, C]. Tokens of one (slot, sub) pair other than masked ones must not repeat."""
    qs = iq.new_zeros(keys.shape[0], keys.shape[2], q)
    qs[slots, :, sub] = iq
    scores = torch.bmm(keys, qs)[slots, :, sub]  # [n, C]
    cols = torch.arange(keys.shape[1], device=keys.device)
    return scores.masked_fill(cols[None, :] > lim[:, None], float("-inf"))


def indexer_scores_triton(keys: torch.Tensor, iq: torch.Tensor, slots: torch.Tensor,
                          lim: torch.Tensor) -> torch.Tensor:
    """What :func:`indexer_scores_reference` computes, one launch (CUDA or the
    interpreter), any number of tokens per slot. ``keys`` must be contiguous in d."""
    S, C, d = keys.shape
    n = iq.shape[0]
    if keys.stride(2) != 1 or not iq.is_contiguous():
        raise ValueError("indexer_scores_triton needs keys contiguous in d and iq contiguous")
    out = torch.empty(n, C, dtype=torch.float32, device=keys.device)
    if n == 0 or C == 0:
        return out
    grid = (n, triton.cdiv(C, BLOCK_C))
    with on_device(keys.device if keys.is_cuda else None):
        indexer_scores_kernel[grid](keys, iq, slots, lim, out, C, keys.stride(0), keys.stride(1), out.stride(0),
                                    D=d, DB=triton.next_power_of_2(d), BLOCK=BLOCK_C, num_warps=4)
    return out


def indexer_scores(keys: torch.Tensor, iq: torch.Tensor, slots: torch.Tensor, sub: torch.Tensor,
                   lim: torch.Tensor, q: int) -> torch.Tensor:
    """The kernel on CUDA, the reference on the CPU (the interpreter would be slow at
    the engine's sizes; the tests run the kernel there directly)."""
    if keys.is_cuda and not interpreter_mode():
        return indexer_scores_triton(keys, iq.contiguous(), slots, lim)
    return indexer_scores_reference(keys, iq, slots, sub, lim, q)


__all__ = ["indexer_scores", "indexer_scores_reference", "indexer_scores_triton", "indexer_scores_kernel"]
