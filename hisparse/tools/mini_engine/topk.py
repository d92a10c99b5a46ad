"""The mini engine's indexer top-k: the K largest scores of each row, one program per row.

  out[r] = the column indices of the K largest finite scores of row r, in ascending
           index order, then -1 (fewer than K finite scores: every finite one)

Ties at the K-th value go to the smaller indices; -0.0 equals +0.0; -inf and NaN are
never selected. One program per row, as the production DSA indexers' top-k kernels
launch at these widths (vLLM's ``top_k_per_row_decode``: one block per row below 200K
columns), so the cost follows the row count up to a wave of SMs, unlike
``torch.topk``, whose multi-block radix select costs about as much for 13 rows as for
64 at 128K columns.

Program r (CUDA or the interpreter):
  1. a sample of NS scores at a stride over the row; its J-th largest, J ~ 2 K NS / C
     (a radix select in registers), is a threshold t above which about 2K scores are
     expected;
  2. one pass over the row counts the finite scores and writes the candidates (score
     >= t), in index order, to the row's scratch (at most CAP of them);
  3. if at least K and at most CAP are candidates, an exact radix select (8 passes of
     4 bits, ``tl.histogram``) over the candidates finds the K-th largest key and how
     many of its ties to take; one more pass over the candidates writes the selection.
     Otherwise (a skewed row: many ties, or a sample far from the row) the same
     radix select and output run over the whole row: slower, the same result.
Scores map to int32 keys in the same order (``_keys``): a float's bits for >= 0,
the bits with the magnitude flipped for < 0. The torch reference
(:func:`topk_rows_reference`, a stable sort) defines the result; the tests compare
the two exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._checks import interpreter_mode
from ...device import on_device

BLOCK = 4096  # scores per step of a pass over a row
NS = 2048  # sampled scores per row
CAP = 8192  # candidates a row's scratch holds
NUM_WARPS = 8
STAGES = 1  # software-pipelining stages of the row passes (1: none)
_NEG_INF_KEY = tl.constexpr(-2139095041)  # _keys(-inf): keys <= this are never selected
# how the kernel selected a row (``topk_rows_triton(..., return_paths=True)``)
PATH_ALL_CANDIDATES = 0  # at most K finite scores, all of them candidates
PATH_ALL_ROW = 1  # at most K finite scores, written from the row
PATH_CANDIDATES = 2  # radix select over the candidates (the fast path)
PATH_ROW = 3  # radix select over the whole row (the sample missed)


@triton.jit
def _keys(x):
    """fp32 -> int32 keys in the same order (-0.0 as +0.0); -inf and NaN -> _NEG_INF_KEY."""
    ok = x > float("-inf")  # false for NaN too
    b = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(ok, k, _NEG_INF_KEY)


@triton.jit
def _load_keys(src, idx_src, c0, n, FROM_SCORES: tl.constexpr, BLK: tl.constexpr):
    """(keys, column indices, in range) of entries [c0, c0 + BLK) of a row (fp32 scores,
    FROM_SCORES) or of its candidates (int32 keys and indices)."""
    offs = c0 + tl.arange(0, BLK)
    inr = offs < n
    if FROM_SCORES:
        k = _keys(tl.load(src + offs, mask=inr, other=float("-inf")))
        idx = offs
    else:
        k = tl.load(src + offs, mask=inr, other=_NEG_INF_KEY)
        idx = tl.load(idx_src + offs, mask=inr, other=-1)
    return k, idx, inr


@triton.jit
def _narrow(hist, top, kleft, p: tl.constexpr):
    """One radix pass: from the 16-bin histogram of digit p of the keys that match the
    ``top`` prefix, the next prefix and how many of its keys still belong to the K."""
    bins = tl.arange(0, 16)
    suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist  # matches with digit >= d
    dsel = tl.max(tl.where(suffix >= kleft, bins, -1), axis=0)
    kleft -= tl.sum(tl.where(bins > dsel, hist, 0), axis=0)
    if p == 0:
        top = dsel - 8
    else:
        top = (top << 4) | dsel
    return top, kleft


@triton.jit
def _digit(k, match, top, p: tl.constexpr):
    """(match, digit) of keys k in radix pass p (4 bits, most significant first; the
    first digit biased so that the signed keys' order is the digits')."""
    if p == 0:
        d = (k >> 28) + 8
    else:
        match = match & ((k >> (32 - 4 * p)) == top)
        d = (k >> (28 - 4 * p)) & 15
    return match, d


@triton.jit
def _radix_select(src, idx_src, n, K, FROM_SCORES: tl.constexpr, BLK: tl.constexpr, STAGES: tl.constexpr):
    """Of entries [0, n) with at least K selectable keys: (T, ties) -- the K-th largest
    key and how many entries equal to T the K largest include."""
    top = n * 0
    kleft = K + n * 0
    for p in tl.static_range(8):
        hist = tl.zeros([16], tl.int32)
        for c0 in tl.range(0, n, BLK, num_stages=STAGES):
            k, _i, inr = _load_keys(src, idx_src, c0, n, FROM_SCORES, BLK)
            match, d = _digit(k, inr & (k > _NEG_INF_KEY), top, p)
            hist += tl.histogram(d, 16, mask=match)
        top, kleft = _narrow(hist, top, kleft, p)
    return top, kleft


@triton.jit
def _radix_select_tile(k, valid, K):
    """The same for a tile of keys held in registers (``valid``: at least K of them)."""
    top = K * 0
    kleft = K + K * 0
    for p in tl.static_range(8):
        match, d = _digit(k, valid, top, p)
        top, kleft = _narrow(tl.histogram(d, 16, mask=match), top, kleft, p)
    return top, kleft


@triton.jit
def _write_selection(src, idx_src, n, T, ties, out_row, FROM_SCORES: tl.constexpr, BLK: tl.constexpr):
    """Write, in index order, the indices of the entries with a key > T and of the first
    ``ties`` equal to T; returns how many were written."""
    n_eq = n * 0
    n_out = n * 0
    for c0 in range(0, n, BLK):
        k, idx, inr = _load_keys(src, idx_src, c0, n, FROM_SCORES, BLK)
        sel = inr & (k > _NEG_INF_KEY)
        eq = (sel & (k == T)).to(tl.int32)
        take = sel & ((k > T) | ((eq != 0) & (tl.cumsum(eq, 0) - eq + n_eq < ties)))
        ti = take.to(tl.int32)
        tl.store(out_row + tl.cumsum(ti, 0) - ti + n_out, idx, mask=take)
        n_eq += tl.sum(eq, axis=0)
        n_out += tl.sum(ti, axis=0)
    return n_out


@triton.jit(do_not_specialize=["C", "K", "stride_s", "stride_o"])
def topk_rows_kernel(
    scores,  # fp32 [n, >= C] (row stride stride_s, unit column stride)
    out,  # int32 [n, K] (row stride stride_o), output
    cand_key,  # int32 [n, CAP_] scratch: the candidates' keys
    cand_idx,  # int32 [n, CAP_] scratch: their column indices
    paths,  # int32 [n], output: how the row was selected (PATH_* below)
    C, K, stride_s, stride_o,
    NS_: tl.constexpr,  # sampled scores (power of two)
    CAP_: tl.constexpr,  # candidates the scratch holds per row
    BLK: tl.constexpr,  # entries per step of a pass (power of two)
    STAGES: tl.constexpr,  # software-pipelining stages of the passes over the row
):
    r = tl.program_id(0).to(tl.int64)
    row = scores + r * stride_s
    out_row = out + r * stride_o
    ck = cand_key + r * CAP_
    ci = cand_idx + r * CAP_

    # 1. the threshold t: the J-th largest of a strided sample, J ~ 2 K NS / C (about
    #    2K scores expected at or above it); every finite score when the row fits the
    #    scratch or the sample has fewer than J finite scores
    j = tl.arange(0, NS_)
    samp = _keys(tl.load(row + (j.to(tl.int64) * C) // NS_))
    fin_s = samp > _NEG_INF_KEY
    J = tl.minimum((2 * K * NS_ + C - 1) // C, NS_)
    t = _NEG_INF_KEY + 1
    if (C > CAP_) & (tl.sum(fin_s.to(tl.int32), axis=0) >= J):
        t, _ties = _radix_select_tile(samp, fin_s, J)

    # 2. count the finite scores; the candidates (key >= t) go to scratch in index order
    n_fin = C * 0
    n_cand = C * 0
    for c0 in tl.range(0, C, BLK, num_stages=STAGES):
        k, idx, inr = _load_keys(row, row, c0, C, True, BLK)
        fin = k > _NEG_INF_KEY
        cand = (fin & (k >= t)).to(tl.int32)
        rank = tl.cumsum(cand, 0) - cand + n_cand
        keep = (cand != 0) & (rank < CAP_)
        tl.store(ck + rank, k, mask=keep)
        tl.store(ci + rank, idx, mask=keep)
        n_fin += tl.sum(fin.to(tl.int32), axis=0)
        n_cand += tl.sum(cand, axis=0)

    # 3. the selection, from the candidates when they hold it, else from the row
    if n_fin <= K:
        if (n_cand == n_fin) & (n_cand <= CAP_):
            n_out = _write_selection(ck, ci, n_cand, _NEG_INF_KEY, 0, out_row, False, BLK)
            path = 0
        else:
            n_out = _write_selection(row, row, C, _NEG_INF_KEY, 0, out_row, True, BLK)
            path = 1
    elif (n_cand >= K) & (n_cand <= CAP_):
        T, ties = _radix_select(ck, ci, n_cand, K, False, BLK, STAGES)
        n_out = _write_selection(ck, ci, n_cand, T, ties, out_row, False, BLK)
        path = 2
    else:
        T, ties = _radix_select(row, row, C, K, True, BLK, STAGES)
        n_out = _write_selection(row, row, C, T, ties, out_row, True, BLK)
        path = 3
    tl.store(paths + r, path)
    for c0 in range(0, K, BLK):
        offs = c0 + tl.arange(0, BLK)
        tl.store(out_row + offs, tl.full([BLK], -1, tl.int32), mask=(offs >= n_out) & (offs < K))


def topk_rows_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores fp32 [n, C] -> int32 [n, k]: what the kernel computes (module docstring),
    with a stable descending sort."""
    n, C = scores.shape
    s = torch.where(scores == 0, torch.zeros_like(scores), scores)  # -0.0 as +0.0
    fin = s > float("-inf")  # false for NaN
    s = torch.where(fin, s, torch.full_like(s, float("-inf")))
    take = min(k, C)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :take]
    n_fin = fin.sum(dim=1, keepdim=True)
    ok = torch.arange(take, device=s.device)[None, :] < n_fin
    idx = torch.sort(torch.where(ok, order, C), dim=1).values  # the selection in index order
    idx = torch.where(idx < C, idx, -1).to(torch.int32)
    if take < k:
        idx = torch.cat([idx, idx.new_full((n, k - take), -1)], dim=1)
    return idx


def topk_rows_triton(scores: torch.Tensor, k: int, *, block: int = BLOCK, sample: int = NS,
                     cap: int = CAP, num_warps: int = NUM_WARPS, stages: int = STAGES,
                     return_paths: bool = False):
    """What :func:`topk_rows_reference` computes, in one launch (CUDA or the
    interpreter). ``scores`` must have unit column stride. ``block``, ``sample`` and
    ``cap`` (powers of two) set the pass step, the sample and the candidate scratch,
    ``num_warps`` and ``stages`` the program's warps and the row passes' pipelining:
    the result does not depend on them.
    ``return_paths``: also return int32 [n], each row's ``PATH_*``."""
    for name, v in (("block", block), ("sample", sample), ("cap", cap)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if scores.dtype != torch.float32 or scores.dim() != 2 or (scores.shape[1] > 1 and scores.stride(1) != 1):
        raise ValueError(f"topk_rows_triton needs fp32 [n, C] scores with unit column stride, got "
                         f"{scores.dtype} {list(scores.shape)} stride {scores.stride()}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n, C = scores.shape
    out = torch.empty(n, k, dtype=torch.int32, device=scores.device)
    paths = torch.full((n,), PATH_ALL_ROW, dtype=torch.int32, device=scores.device)
    if n == 0 or C == 0:
        out.fill_(-1)
        return (out, paths) if return_paths else out
    cand_key = torch.empty(n, cap, dtype=torch.int32, device=scores.device)
    cand_idx = torch.empty(n, cap, dtype=torch.int32, device=scores.device)
    with on_device(scores.device if scores.is_cuda else None):
        topk_rows_kernel[(n,)](scores, out, cand_key, cand_idx, paths, C, k, scores.stride(0), out.stride(0),
                               NS_=sample, CAP_=cap, BLK=block, STAGES=stages, num_warps=num_warps)
    return (out, paths) if return_paths else out


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel on CUDA, the reference on the CPU (the interpreter would be slow at
    the engine's sizes; the tests run the kernel there directly)."""
    if scores.is_cuda and not interpreter_mode():
        return topk_rows_triton(scores, k)
    return topk_rows_reference(scores, k)


__all__ = ["topk_rows", "topk_rows_reference", "topk_rows_triton", "topk_rows_kernel", "PATH_ALL_CANDIDATES",
           "PATH_ALL_ROW", "PATH_CANDIDATES", "PATH_ROW"]
