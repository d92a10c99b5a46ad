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
  into a workspace at ``workspace_starts[p]`` (see ``hisparse.staging.prefill``)::

      physical[t, k] = workspace_starts[p] + pos

* ``pos == -1`` stays -1. An entry that cannot be converted (request row outside
  ``[0, R)``, ``pos // B >= NB``, a block-table entry < 0, ``pos >= seq_lens[req]`` when
  ``seq_lens`` is given, prefill request outside ``[0, P)``, ``pos >= workspace_lens[p]``
  when given) is an error in checked mode (``validate=True``: ValueError before any
  launch) and becomes -1 with ``validate=False`` (the kernel never reads out of bounds).
  So does an entry whose row would not fit int32 (``>= 2**31``).
* ``valid_counts[t]`` = entries of row t that are not -1 in the output.
* ``compact=True`` moves the valid entries of each row to its front, in their original
  order, and fills the rest with -1.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch
import triton

from .._checks import Kernels, check_tensor
from ..kernels.fast_launch import fast
from ..kernels.convert import convert_topk_kernel
from .view import BlockTable

_ROW_LIMIT = 2**31  # rows are int32: a conversion at or above this is invalid


class ConvertResult(NamedTuple):
    physical: torch.Tensor  # int32 [T, K], -1 = padding
    valid_counts: torch.Tensor | None  # int32 [T] (None unless asked for)


@dataclasses.dataclass(frozen=True)
class WorkspaceMap:
    """Where prefill tokens' contexts were staged (``hisparse.staging.prefill``).

    prefill_request_id: int32 [T] prefill request of each token, -1 = decode token
    starts:             int32 [P] workspace row where each prefill request starts
    lens:               int32 [P] | None, rows staged per request (positions beyond are invalid)
    """

    prefill_request_id: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("prefill_request_id", self.prefill_request_id, dtype=torch.int32, ndim=1)
        check_tensor("workspace_starts", self.starts, dtype=torch.int32, ndim=1,
                     device=self.prefill_request_id.device)
        if self.lens is not None:
            check_tensor("workspace_lens", self.lens, dtype=torch.int32, shape=tuple(self.starts.shape),
                         device=self.prefill_request_id.device)


# ---------------------------------------------------------------------------
# validation (caller mistakes -> TypeError/ValueError, before any launch)
# ---------------------------------------------------------------------------

def _validate_structure(topk, req_id_per_token, blocks: BlockTable, workspace: WorkspaceMap | None,
                        out, valid_counts_out) -> None:
    """Dtypes, shapes, devices of the per-call tensors. No device reads."""
    if not isinstance(blocks, BlockTable):
        raise TypeError(f"blocks must be a hisparse.staging.BlockTable, got {type(blocks).__name__}")
    if workspace is not None and not isinstance(workspace, WorkspaceMap):
        raise TypeError(f"workspace must be a hisparse.staging.WorkspaceMap or None, got "
                        f"{type(workspace).__name__}")
    check_tensor("topk", topk, dtype=torch.int32, ndim=2)
    dev = topk.device
    T = topk.shape[0]
    check_tensor("req_id_per_token", req_id_per_token, dtype=torch.int32, shape=(T,), device=dev)
    if blocks.device != dev:
        raise ValueError(f"the block table is on {blocks.device} but topk is on {dev}")
    if workspace is not None:
        if workspace.prefill_request_id.shape[0] != T:
            raise ValueError(f"prefill_request_id has {workspace.prefill_request_id.shape[0]} entries, "
                             f"topk has T={T} rows")
        if workspace.prefill_request_id.device != dev:
            raise ValueError(f"the workspace map is on {workspace.prefill_request_id.device} but topk "
                             f"is on {dev}")
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=tuple(topk.shape), device=dev)
        if out.numel() and out.stride(1) != 1:
            raise ValueError("out must have unit stride along K")
    if valid_counts_out is not None:
        check_tensor("valid_counts_out", valid_counts_out, dtype=torch.int32, shape=(T,), device=dev)


def _validate_values(topk, req_id_per_token, blocks: BlockTable, workspace: WorkspaceMap | None) -> None:
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
    if workspace is not None:
        pre = workspace.prefill_request_id.long()
        is_pre = pre >= 0
        P = workspace.starts.shape[0]
        bad_p = is_pre & (pre >= P)
        if bool(bad_p.any()):
            t = int(torch.nonzero(bad_p)[0])
            raise ValueError(f"prefill_request_id[{t}] = {int(pre[t])} is outside [-1, {P}) "
                             f"(workspace_starts has {P} entries)")
        if P and bool((workspace.starts < 0).any()):
            raise ValueError("workspace_starts must be >= 0")
        if workspace.lens is not None and P:
            lens = workspace.lens.long()[torch.where(is_pre, pre, 0)]
            bad_w = is_pre[:, None] & nonneg & (pos >= lens[:, None])
            if bool(bad_w.any()):
                t, k = (int(v) for v in torch.nonzero(bad_w)[0])
                raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} is beyond the {int(lens[t])} rows "
                                 f"staged for prefill request {int(pre[t])}")
        if P:
            ends = workspace.starts.long()[torch.where(is_pre, pre, 0)][:, None] + pos
            big = is_pre[:, None] & nonneg & (ends >= _ROW_LIMIT)
            if bool(big.any()):
                raise ValueError("a workspace offset exceeds int32")
    else:
        is_pre = torch.zeros(T, dtype=torch.bool, device=pos.device)
    dec = (~is_pre)[:, None] & nonneg
    if not bool(dec.any()):
        return
    table, B = blocks.table, blocks.block_size
    R, NB = table.shape
    req = req_id_per_token.long()
    dec_tok = dec.any(dim=1)
    bad_r = dec_tok & ((req < 0) | (req >= R))
    if bool(bad_r.any()):
        t = int(torch.nonzero(bad_r)[0])
        raise ValueError(f"req_id_per_token[{t}] = {int(req[t])} is outside [0, {R}) "
                         f"(the block table has {R} rows)")
    blk = pos // B
    bad_b = dec & (blk >= NB)
    if bool(bad_b.any()):
        t, k = (int(v) for v in torch.nonzero(bad_b)[0])
        raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} needs logical block {int(blk[t, k])} but "
                         f"the block table has {NB} blocks per row (block_size={B})")
    if blocks.seq_lens is not None:
        lim = blocks.seq_lens.long()[req.clamp(0, max(R - 1, 0))]
        bad_s = dec & (pos >= lim[:, None])
        if bool(bad_s.any()):
            t, k = (int(v) for v in torch.nonzero(bad_s)[0])
            raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} is >= seq_lens[{int(req[t])}] = {int(lim[t])}")
    rs = torch.where(dec_tok, req, 0)
    pblk = table.long()[rs[:, None], torch.where(dec, blk, 0)]
    bad_e = dec & (pblk < 0)
    if bool(bad_e.any()):
        t, k = (int(v) for v in torch.nonzero(bad_e)[0])
        raise ValueError(f"topk[{t}, {k}] = {int(pos[t, k])} maps to block_table[{int(req[t])}, "
                         f"{int(blk[t, k])}] = {int(pblk[t, k])} (no block allocated)")
    phys = pblk * blocks.block_stride + pos % B
    if bool((dec & (phys >= _ROW_LIMIT)).any()):
        raise ValueError("a physical row exceeds int32 (block_table entry x block_stride too large)")


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------

def convert_reference(topk: torch.Tensor, req_id_per_token: torch.Tensor, blocks: BlockTable, *,
                      workspace: WorkspaceMap | None = None, compact: bool = False) -> ConvertResult:
    """Pure-torch conversion (the oracle and CPU path); invalid entries become -1.

    topk: int32 [T, K]; req_id_per_token: int32 [T]. Arguments as
    ``convert_topk_to_physical``; no validation. Always returns the counts.
    """
    T, K = topk.shape
    dev = topk.device
    pos = topk.long()
    nonneg = pos >= 0
    table, B = blocks.table, blocks.block_size
    R, NB = table.shape
    req = req_id_per_token.long()
    req_ok = (req >= 0) & (req < R)
    blk = torch.div(pos, B, rounding_mode="floor")
    dec_ok = nonneg & req_ok[:, None] & (blk < NB)
    if blocks.seq_lens is not None and R:
        lim = blocks.seq_lens.long()[torch.where(req_ok, req, 0)]
        dec_ok &= pos < torch.where(req_ok, lim, 0)[:, None]
    if R and NB:
        pblk = table.long()[torch.where(req_ok, req, 0)[:, None], torch.where(dec_ok, blk, 0)]
    else:
        pblk = torch.full_like(pos, -1)
    dec_ok &= pblk >= 0
    val = pblk * blocks.block_stride + pos % B
    dec_ok &= val < _ROW_LIMIT
    ok = dec_ok
    if workspace is not None:
        pre = workspace.prefill_request_id.long()
        P = workspace.starts.shape[0]
        is_pre = pre >= 0
        pre_ok = is_pre & (pre < P)
        ps = torch.where(pre_ok, pre, 0)
        start = workspace.starts.long()[ps] if P else torch.zeros(T, dtype=torch.long, device=dev)
        ok_pre = nonneg & pre_ok[:, None]
        if workspace.lens is not None and P:
            ok_pre &= pos < workspace.lens.long()[ps][:, None]
        val = torch.where(is_pre[:, None], start[:, None] + pos, val)
        ok_pre &= val < _ROW_LIMIT
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
    req_id_per_token: torch.Tensor,  # int32 [T] row of the block table of each token
    blocks: BlockTable,
    *,
    workspace: WorkspaceMap | None = None,
    compact: bool = False,
    return_valid_counts: bool = False,
    out: torch.Tensor | None = None,  # int32 [T, K] | None, preallocated output (graph capture)
    valid_counts_out: torch.Tensor | None = None,  # int32 [T] | None, preallocated counts
    validate: bool = True,
    kernels: Kernels | str = "auto",
) -> ConvertResult:
    """Convert request-local top-k positions into physical rows (see the module docstring).

    ``blocks`` maps decode tokens' positions; ``workspace`` (optional) maps prefill
    tokens' positions to the rows where their contexts were staged. ``validate=True``
    checks every index range (a host sync) and raises before launching;
    ``validate=False`` checks only what needs no device read, so the call stays free of
    host syncs (with ``out`` and, if counts are wanted, ``valid_counts_out`` given, it
    allocates nothing and can be CUDA-graph captured). ``kernels``: see
    ``hisparse._checks.Kernels``. Returns ``ConvertResult(physical, valid_counts)``;
    counts are None unless ``return_valid_counts`` or ``valid_counts_out`` is given.
    """
    impl = Kernels.parse(kernels).pick(topk.device if isinstance(topk, torch.Tensor) else torch.device("cpu"))
    _validate_structure(topk, req_id_per_token, blocks, workspace, out, valid_counts_out)
    if validate:
        _validate_values(topk, req_id_per_token, blocks, workspace)
    want_counts = return_valid_counts or valid_counts_out is not None
    T, K = topk.shape
    if out is None:
        out = torch.empty((T, K), dtype=torch.int32, device=topk.device)
    counts = None
    if want_counts:
        counts = valid_counts_out if valid_counts_out is not None else torch.empty(
            (T,), dtype=torch.int32, device=topk.device)
    if impl is Kernels.TORCH:
        ref = convert_reference(topk, req_id_per_token, blocks, workspace=workspace, compact=compact)
        out.copy_(ref.physical)
        if counts is not None:
            counts.copy_(ref.valid_counts)
        return ConvertResult(out, counts)
    if T == 0:
        return ConvertResult(out, counts)
    table = blocks.table
    if topk.numel() and topk.stride(1) != 1:
        topk = topk.contiguous()
    if table.numel() and table.stride(1) != 1:
        table = table.contiguous()
    dummy = req_id_per_token
    R, NB = table.shape
    block_n = min(max(triton.next_power_of_2(K), 16), 256)
    ws = workspace
    with torch.cuda.device(topk.device) if topk.is_cuda else contextlib.nullcontext():
        fast(convert_topk_kernel)[(T,)](
            topk, req_id_per_token, table if table.numel() else dummy, out,
            counts if counts is not None else dummy,
            ws.prefill_request_id if ws is not None else dummy,
            ws.starts if ws is not None and ws.starts.numel() else dummy,
            ws.lens if ws is not None and ws.lens is not None and ws.lens.numel() else dummy,
            blocks.seq_lens if blocks.seq_lens is not None and blocks.seq_lens.numel() else dummy,
            K, R, NB, ws.starts.shape[0] if ws is not None else 0, blocks.block_stride,
            topk.stride(0) if K else 1, out.stride(0) if K else 1, table.stride(0) if NB else 1,
            BLOCK_SIZE=blocks.block_size, BLOCK_N=block_n,
            NUM_TILES=-(-K // block_n), HAS_PREFILL=ws is not None,
            HAS_WS_LENS=ws is not None and ws.lens is not None, HAS_SEQ_LENS=blocks.seq_lens is not None,
            COMPACT=compact, WRITE_COUNTS=counts is not None, num_warps=4,
        )
    return ConvertResult(out, counts)


__all__ = ["ConvertResult", "WorkspaceMap", "convert_reference", "convert_topk_to_physical"]
