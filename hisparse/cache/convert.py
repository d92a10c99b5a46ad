"""Logical top-k -> physical rows through a block table (and prefill-workspace offsets).

This is the index conversion a sparse-MLA engine runs between its indexer and its
attention kernel. Notation as in ``state``: T query tokens, K top-k entries, R
block-table rows, NB blocks per row, B positions per block, P prefill requests.

Semantics of ``convert_topk_to_physical`` (and of the Triton kernel in
``hisparse.kernels.convert``): for query token t and entry k, with
``pos = topk[t, k]``:

* Decode token (``prefill_request_id`` absent, or ``prefill_request_id[t] == -1``),
  ``req = req_id_per_token[t]``::

      physical[t, k] = block_table[req, pos // B] * block_stride + pos % B

  ``block_stride`` (rows between physical blocks, default B) may exceed B, e.g. a
  paged cache whose blocks carry padding rows.
* Prefill token (``p = prefill_request_id[t] >= 0``): the request's context was staged
  into a workspace at ``workspace_starts[p]`` (see ``hisparse.cache.prefill``)::

      physical[t, k] = workspace_starts[p] + pos

* ``pos == -1`` stays -1. An entry that cannot be converted (request row outside
  ``[0, R)``, ``pos // B >= NB``, a block-table entry < 0, ``pos >= seq_lens[req]`` when
  ``seq_lens`` is given, prefill request outside ``[0, P)``, ``pos >= workspace_lens[p]``
  when given) is an error in checked mode (``validate=True``: ValueError before any
  launch) and becomes -1 with ``validate=False`` (the kernel never reads out of bounds).
* ``valid_counts[t]`` = entries of row t that are not -1 in the output.
* ``compact=True`` moves the valid entries of each row to its front, in their original
  order, and fills the rest with -1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

_IMPLS = ("auto", "triton", "torch")


class ConvertResult(NamedTuple):
    physical: torch.Tensor  # int32 [T, K], -1 = padding
    valid_counts: torch.Tensor | None  # int32 [T] (None unless asked for)


# ---------------------------------------------------------------------------
# validation (caller mistakes -> TypeError/ValueError, before any launch)
# ---------------------------------------------------------------------------

def _check_int32(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_int_arg(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _validate_structure(topk, req_id_per_token, block_table, *, block_size, block_stride,
                        seq_lens, prefill_request_id, workspace_starts, workspace_lens,
                        out, valid_counts_out, impl) -> int:
    """Dtypes, shapes, devices, scalar arguments. No device reads. Returns block_stride."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    _check_int32("topk", topk, 2)
    _check_int32("req_id_per_token", req_id_per_token, 1)
    _check_int32("block_table", block_table, 2)
    T, _ = topk.shape
    if req_id_per_token.shape[0] != T:
        raise ValueError(f"req_id_per_token has {req_id_per_token.shape[0]} entries, topk has T={T} rows")
    _check_int_arg("block_size", block_size, 1)
    stride = block_size if block_stride is None else _check_int_arg("block_stride", block_stride, 1)
    if stride < block_size:
        raise ValueError(f"block_stride={stride} must be >= block_size={block_size}")
    dev = topk.device
    tensors = {"req_id_per_token": req_id_per_token, "block_table": block_table}
    if seq_lens is not None:
        _check_int32("seq_lens", seq_lens, 1)
        if seq_lens.shape[0] != block_table.shape[0]:
            raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, block_table has "
                             f"R={block_table.shape[0]} rows")
        tensors["seq_lens"] = seq_lens
    if (prefill_request_id is None) != (workspace_starts is None):
        raise ValueError("prefill_request_id and workspace_starts go together: pass both or neither")
    if workspace_lens is not None and workspace_starts is None:
        raise ValueError("workspace_lens needs workspace_starts and prefill_request_id")
    if prefill_request_id is not None:
        _check_int32("prefill_request_id", prefill_request_id, 1)
        _check_int32("workspace_starts", workspace_starts, 1)
        if prefill_request_id.shape[0] != T:
            raise ValueError(f"prefill_request_id has {prefill_request_id.shape[0]} entries, topk has T={T} rows")
        tensors["prefill_request_id"] = prefill_request_id
        tensors["workspace_starts"] = workspace_starts
        if workspace_lens is not None:
            _check_int32("workspace_lens", workspace_lens, 1)
            if workspace_lens.shape != workspace_starts.shape:
                raise ValueError(f"workspace_lens shape {tuple(workspace_lens.shape)} != workspace_starts "
                                 f"shape {tuple(workspace_starts.shape)}")
            tensors["workspace_lens"] = workspace_lens
    if out is not None:
        _check_int32("out", out, 2)
        if out.shape != topk.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != topk shape {tuple(topk.shape)}")
        if out.numel() and out.stride(1) != 1:
            raise ValueError("out must have unit stride along K")
        tensors["out"] = out
    if valid_counts_out is not None:
        _check_int32("valid_counts_out", valid_counts_out, 1)
        if valid_counts_out.shape[0] != T:
            raise ValueError(f"valid_counts_out has {valid_counts_out.shape[0]} entries, need T={T}")
        tensors["valid_counts_out"] = valid_counts_out
    for name, x in tensors.items():
        if x.device != dev:
            raise ValueError(f"{name} is on {x.device} but topk is on {dev}: all tensors must share a device")
    return stride


def _validate_values(topk, req_id_per_token, block_table, *, block_size, block_stride, seq_lens,
                     prefill_request_id, workspace_starts, workspace_lens) -> None:
    """Index ranges (reads device values: a host sync). Raises ValueError naming the entry."""
    if topk.numel() == 0:
        return
    pos = topk.long()
    bad = pos < -1
    if bool(bad.any()):
        t, k = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])}: positions must be >= 0 or -1 (padding)")
    nonneg = pos >= 0
    T = pos.shape[0]
    if prefill_request_id is not None:
        pre = prefill_request_id.long()
        is_pre = pre >= 0
        P = workspace_starts.shape[0]
        bad_p = is_pre & (pre >= P)
        if bool(bad_p.any()):
            t = int(torch.nonzero(bad_p)[0])
            raise ValueError(f"prefill_request_id[{t}] = {int(pre[t])} is outside [-1, {P}) "
                             f"(workspace_starts has {P} entries)")
        if P and bool((workspace_starts < 0).any()):
            raise ValueError("workspace_starts must be >= 0")
        if workspace_lens is not None and P:
            lens = workspace_lens.long()[torch.where(is_pre, pre, 0)]
            bad_w = is_pre[:, None] & nonneg & (pos >= lens[:, None])
            if bool(bad_w.any()):
                t, k = (int(v) for v in torch.nonzero(bad_w)[0])
                raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} is beyond the {int(lens[t])} rows "
                                 f"staged for prefill request {int(pre[t])}")
        if P:
            ends = workspace_starts.long()[torch.where(is_pre, pre, 0)][:, None] + pos
            big = is_pre[:, None] & nonneg & (ends >= 2**31)
            if bool(big.any()):
                raise ValueError("a workspace offset exceeds int32")
    else:
        is_pre = torch.zeros(T, dtype=torch.bool, device=pos.device)
    dec = (~is_pre)[:, None] & nonneg
    if not bool(dec.any()):
        return
    R, NB = block_table.shape
    req = req_id_per_token.long()
    dec_tok = dec.any(dim=1)
    bad_r = dec_tok & ((req < 0) | (req >= R))
    if bool(bad_r.any()):
        t = int(torch.nonzero(bad_r)[0])
        raise ValueError(f"req_id_per_token[{t}] = {int(req[t])} is outside [0, {R}) "
                         f"(block_table has {R} rows)")
    blk = pos // block_size
    bad_b = dec & (blk >= NB)
    if bool(bad_b.any()):
        t, k = (int(v) for v in torch.nonzero(bad_b)[0])
        raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} needs logical block {int(blk[t, k])} but "
                         f"block_table has {NB} blocks per row (block_size={block_size})")
    if seq_lens is not None:
        lim = seq_lens.long()[req.clamp(0, max(R - 1, 0))]
        bad_s = dec & (pos >= lim[:, None])
        if bool(bad_s.any()):
            t, k = (int(v) for v in torch.nonzero(bad_s)[0])
            raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} is >= seq_lens[{int(req[t])}] = {int(lim[t])}")
    rs = torch.where(dec_tok, req, 0)
    pblk = block_table.long()[rs[:, None], torch.where(dec, blk, 0)]
    bad_e = dec & (pblk < 0)
    if bool(bad_e.any()):
        t, k = (int(v) for v in torch.nonzero(bad_e)[0])
        raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} maps to block_table[{int(req[t])}, "
                         f"{int(blk[t, k])}] = {int(pblk[t, k])} (no block allocated)")
    phys = pblk * block_stride + pos % block_size
    if bool((dec & (phys >= 2**31)).any()):
        raise ValueError("a physical row exceeds int32 (block_table entry x block_stride too large)")


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------

def convert_reference(topk: torch.Tensor, req_id_per_token: torch.Tensor, block_table: torch.Tensor, *,
                      block_size: int, block_stride: int | None = None,
                      seq_lens: torch.Tensor | None = None,
                      prefill_request_id: torch.Tensor | None = None,
                      workspace_starts: torch.Tensor | None = None,
                      workspace_lens: torch.Tensor | None = None,
                      compact: bool = False) -> ConvertResult:
    """Pure-torch conversion (the oracle and CPU path); invalid entries become -1.

    Arguments as ``convert_topk_to_physical``; no validation. Always returns the counts.
    """
    stride = block_size if block_stride is None else block_stride
    T, K = topk.shape
    dev = topk.device
    pos = topk.long()
    nonneg = pos >= 0
    R, NB = block_table.shape
    req = req_id_per_token.long()
    req_ok = (req >= 0) & (req < R)
    blk = torch.div(pos, block_size, rounding_mode="floor")
    dec_ok = nonneg & req_ok[:, None] & (blk < NB)
    if seq_lens is not None and R:
        lim = seq_lens.long()[torch.where(req_ok, req, 0)]
        dec_ok &= pos < torch.where(req_ok, lim, 0)[:, None]
    if R and NB:
        pblk = block_table.long()[torch.where(req_ok, req, 0)[:, None], torch.where(dec_ok, blk, 0)]
    else:
        pblk = torch.full_like(pos, -1)
    dec_ok &= pblk >= 0
    val = pblk * stride + pos % block_size
    ok = dec_ok
    if prefill_request_id is not None:
        pre = prefill_request_id.long()
        P = workspace_starts.shape[0]
        is_pre = pre >= 0
        pre_ok = is_pre & (pre < P)
        ps = torch.where(pre_ok, pre, 0)
        start = workspace_starts.long()[ps] if P else torch.zeros(T, dtype=torch.long, device=dev)
        ok_pre = nonneg & pre_ok[:, None]
        if workspace_lens is not None and P:
            ok_pre &= pos < workspace_lens.long()[ps][:, None]
        val = torch.where(is_pre[:, None], start[:, None] + pos, val)
        ok = torch.where(is_pre[:, None], ok_pre, dec_ok & ~is_pre[:, None])
    phys = torch.where(ok, val, torch.full_like(val, -1))
    counts = ok.sum(dim=1).to(torch.int32)
    if compact and K:
        order = torch.argsort((~ok).to(torch.int8), dim=1, stable=True)
        phys = torch.gather(phys, 1, order)
    return ConvertResult(phys.to(torch.int32), counts)


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------

def convert_topk_to_physical(
    topk: torch.Tensor,  # int32 [T, K] request-local positions, -1 = padding
    req_id_per_token: torch.Tensor,  # int32 [T] row of block_table of each token
    block_table: torch.Tensor,  # int32 [R, NB] physical block of each logical block
    *,
    block_size: int,
    block_stride: int | None = None,
    seq_lens: torch.Tensor | None = None,  # int32 [R] | None, positions >= seq_len are invalid
    prefill_request_id: torch.Tensor | None = None,  # int32 [T], -1 = decode token
    workspace_starts: torch.Tensor | None = None,  # int32 [P], workspace row of each prefill request
    workspace_lens: torch.Tensor | None = None,  # int32 [P] | None, rows staged per prefill request
    compact: bool = False,
    return_valid_counts: bool = False,
    out: torch.Tensor | None = None,  # int32 [T, K] | None, preallocated output (graph capture)
    valid_counts_out: torch.Tensor | None = None,  # int32 [T] | None, preallocated counts
    validate: bool = True,
    impl: str = "auto",
) -> ConvertResult:
    """Convert request-local top-k positions into physical rows (see the module docstring).

    ``validate=True`` checks dtypes/shapes/devices and every index range (a host sync)
    and raises before launching; ``validate=False`` checks only what needs no device
    read, so the call stays free of host syncs (with ``out`` and, if counts are wanted,
    ``valid_counts_out`` given, it allocates nothing and can be CUDA-graph captured).
    ``impl``: "auto" (Triton for CUDA tensors, torch otherwise), "triton" (also on CPU
    under TRITON_INTERPRET=1), "torch" (the reference).
    Returns ``ConvertResult(physical, valid_counts)``; counts are None unless
    ``return_valid_counts`` or ``valid_counts_out`` is given.
    """
    stride = _validate_structure(
        topk, req_id_per_token, block_table, block_size=block_size, block_stride=block_stride,
        seq_lens=seq_lens, prefill_request_id=prefill_request_id, workspace_starts=workspace_starts,
        workspace_lens=workspace_lens, out=out, valid_counts_out=valid_counts_out, impl=impl)
    if validate:
        _validate_values(topk, req_id_per_token, block_table, block_size=block_size, block_stride=stride,
                         seq_lens=seq_lens, prefill_request_id=prefill_request_id,
                         workspace_starts=workspace_starts, workspace_lens=workspace_lens)
    want_counts = return_valid_counts or valid_counts_out is not None
    T, K = topk.shape
    if out is None:
        out = torch.empty((T, K), dtype=torch.int32, device=topk.device)
    counts = None
    if want_counts:
        counts = valid_counts_out if valid_counts_out is not None else torch.empty(
            (T,), dtype=torch.int32, device=topk.device)
    use_triton = impl == "triton" or (impl == "auto" and topk.is_cuda)
    if not use_triton:
        ref = convert_reference(topk, req_id_per_token, block_table, block_size=block_size,
                                block_stride=stride, seq_lens=seq_lens,
                                prefill_request_id=prefill_request_id,
                                workspace_starts=workspace_starts, workspace_lens=workspace_lens,
                                compact=compact)
        out.copy_(ref.physical)
        if counts is not None:
            counts.copy_(ref.valid_counts)
        return ConvertResult(out, counts)
    if T == 0:
        return ConvertResult(out, counts)
    from ..kernels.convert import convert_topk_kernel

    if topk.numel() and topk.stride(1) != 1:
        topk = topk.contiguous()
    if block_table.numel() and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    has_pre = prefill_request_id is not None
    dummy = req_id_per_token
    R, NB = block_table.shape
    block_n = min(max(triton.next_power_of_2(K), 16), 256)
    convert_topk_kernel[(T,)](
        topk, req_id_per_token, block_table if block_table.numel() else dummy, out,
        counts if counts is not None else dummy,
        prefill_request_id if has_pre else dummy,
        workspace_starts if has_pre and workspace_starts.numel() else dummy,
        workspace_lens if workspace_lens is not None and workspace_lens.numel() else dummy,
        seq_lens if seq_lens is not None and seq_lens.numel() else dummy,
        K, R, NB, workspace_starts.shape[0] if has_pre else 0, stride,
        topk.stride(0) if K else 1, out.stride(0) if K else 1, block_table.stride(0) if NB else 1,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_TILES=-(-K // block_n), HAS_PREFILL=has_pre,
        HAS_WS_LENS=workspace_lens is not None, HAS_SEQ_LENS=seq_lens is not None,
        COMPACT=compact, WRITE_COUNTS=counts is not None, num_warps=4,
    )
    return ConvertResult(out, counts)


__all__ = ["ConvertResult", "convert_reference", "convert_topk_to_physical"]
