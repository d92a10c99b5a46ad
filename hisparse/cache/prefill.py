"""Prefill staging: chunk planning and gathering context rows into a workspace.

A prefill (or chunked-prefill) step attends, for each new query token, to top-k rows
of the request's whole context. In hisparse that context lives in the host pool (and,
for recently selected rows, in the layer's hot rows), so before the prefill attention
kernel runs, each request's rows ``[0, seq_len)`` are gathered into one contiguous
workspace: ``bf16 [W, 576]`` (fp8_ds_mla rows dequantised exactly like
``hisparse.formats.dequantize_fp8_ds_mla_reference``, bf16 rows copied) or, for kernels
that read fp8 directly, ``uint8 [W, row_bytes]`` rows in their stored format.

Notation as in ``state`` (R request slots, S + 1 = SP hot rows per request, H host
rows, B block size, NB blocks) plus P prefill requests and W workspace rows.

Flow of one prefill step (per layer):
1. ``plan_prefill_chunks`` (host side, once per step): split the prefill requests into
   chunks whose rows fit the workspace. Each chunk carries its request slice, token
   slice, block-table / request-slot slices, workspace starts rebased to the chunk,
   the rows to stage and its total rows.
2. ``stage_prefill`` (device, on a prefill stream): gather the rows; returns an event
   the compute stream waits on (``None`` on CPU).
3. ``hisparse.cache.convert.convert_topk_to_physical(..., prefill_request_id=
   chunk.prefill_request_id, workspace_starts=chunk.workspace_starts)``: top-k
   positions -> workspace rows.
4. Attention over the workspace; afterwards the new rows are appended through the
   cache's write path (``HiSparseCache.append_rows``).

A request longer than the workspace raises ``CapacityError`` naming W and the
request's length. Staging it in pieces was not done: a query token's top-k may
reference any of its context rows, so its attention needs all of them addressable at
once; pieces would need split attention with an LSE merge across pieces in every
backend (or a sparse workspace holding only the union of the selected rows), which
is a larger change than staging. Size W for the longest prefill context.

Hot rows: a host row with ``row_slot[h] >= 0`` is read from the hot buffer (HBM
instead of PCIe). The cache keeps hot rows byte-identical to their host rows, so the
result is the same; the caller must not run a resolve of the same (layer, request)
concurrently with staging (a resolve may remap slots).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch
import triton

from ..config import RowFormat
from ..device import is_pinned_host
from ..errors import CapacityError

D_ROW = 576  # bf16 values per workspace row
_IMPLS = ("auto", "triton", "torch")


# ---------------------------------------------------------------------------
# chunk planning (control plane, host side)
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One chunk of prefill requests whose rows fit the workspace together.

    Request i of the chunk is prefill request ``requests.start + i`` of the batch.
    """

    requests: slice  # prefill requests of the batch in this chunk
    token_slice: slice  # query tokens of these requests in the batch (token_offset applied)
    seq_lens: torch.Tensor  # int32 [n] context rows to stage per request
    workspace_starts: torch.Tensor  # int32 [n] first workspace row of each request (chunk-local, first = 0)
    workspace_lens: torch.Tensor  # int32 [n] workspace rows reserved per request (>= seq_lens)
    prefill_request_id: torch.Tensor  # int32 [len(token_slice)] request of each token (0..n-1)
    total_rows: int  # workspace rows the chunk uses (sum of workspace_lens)
    max_rows: int  # largest seq_len of the chunk (sizes the staging grid without a host sync)
    req_slots: torch.Tensor | None  # int32 [n] request slots (rows of the cache's block table), if given
    block_table: torch.Tensor | None  # int32 [n, NB] per-batch block-table rows of the chunk, if given

    @property
    def num_requests(self) -> int:
        return self.requests.stop - self.requests.start


def _as_int_list(name: str, v) -> list[int]:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got "
                            f"{v.dtype} shape {tuple(v.shape)}")
        return [int(x) for x in v.tolist()]
    try:
        out = list(v)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(v).__name__}") from None
    for x in out:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints, got {type(x).__name__} ({x!r})")
    return out


def plan_prefill_chunks(
    context_lens: Sequence[int] | torch.Tensor,  # [P] rows of each prefill request to stage
    query_lens: Sequence[int] | torch.Tensor,  # [P] query tokens of each prefill request in the batch
    workspace_rows: int,
    *,
    reserve_query_rows: bool = False,
    token_offset: int = 0,
    req_slots: torch.Tensor | None = None,  # int32 [P] request slots, sliced into the chunks
    block_table: torch.Tensor | None = None,  # int32 [P, NB] per-batch block table, sliced into the chunks
    device: torch.device | str | None = None,
) -> list[PrefillChunk]:
    """Split P prefill requests, in order, into chunks that fit ``workspace_rows`` rows.

    Request i needs ``context_lens[i]`` rows, plus ``query_lens[i]`` more with
    ``reserve_query_rows`` (room after the staged context for the new tokens' rows,
    written by the caller). Chunks are filled greedily: a chunk takes requests while
    their total fits, so every chunk but the last is as full as the order allows.
    ``token_offset``: index of the first prefill token in the batch (decode tokens come
    first in a mixed batch). Host-side planning: no device sync; the chunk tensors are
    created on ``device`` (default: that of ``req_slots`` / ``block_table``, else CPU).
    Raises ``CapacityError`` if one request alone needs more than ``workspace_rows``.
    """
    ctx = _as_int_list("context_lens", context_lens)
    ql = _as_int_list("query_lens", query_lens)
    if len(ctx) != len(ql):
        raise ValueError(f"context_lens has {len(ctx)} entries, query_lens {len(ql)}")
    if isinstance(workspace_rows, bool) or not isinstance(workspace_rows, int):
        raise TypeError(f"workspace_rows must be an int, got {type(workspace_rows).__name__}")
    if workspace_rows < 1:
        raise ValueError(f"workspace_rows must be >= 1, got {workspace_rows}")
    if isinstance(token_offset, bool) or not isinstance(token_offset, int) or token_offset < 0:
        raise ValueError(f"token_offset must be an int >= 0, got {token_offset!r}")
    for name, vals in (("context_lens", ctx), ("query_lens", ql)):
        for i, v in enumerate(vals):
            if v < 0:
                raise ValueError(f"{name}[{i}] = {v} must be >= 0")
    P = len(ctx)
    for name, t in (("req_slots", req_slots), ("block_table", block_table)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dim() != (1 if name == "req_slots" else 2) or t.shape[0] != P:
            raise ValueError(f"{name} must have {P} rows (one per prefill request), got shape {tuple(t.shape)}")
    if device is None:
        device = (req_slots.device if req_slots is not None else
                  block_table.device if block_table is not None else torch.device("cpu"))
    need = [c + (q if reserve_query_rows else 0) for c, q in zip(ctx, ql)]
    for i, n in enumerate(need):
        if n > workspace_rows:
            what = (f"{ctx[i]} context rows + {ql[i]} query rows" if reserve_query_rows
                    else f"{ctx[i]} context rows")
            raise CapacityError(
                f"prefill request {i} needs {n} workspace rows ({what}) but the workspace holds "
                f"W={workspace_rows} rows; a request is never split across chunks (see "
                f"hisparse.cache.prefill): use a workspace of at least {n} rows")

    q_start = [0]
    for q in ql:
        q_start.append(q_start[-1] + q)
    chunks: list[PrefillChunk] = []
    i = 0
    while i < P:
        j, total = i, 0
        while j < P and total + need[j] <= workspace_rows:
            total += need[j]
            j += 1
        starts, acc = [], 0
        for k in range(i, j):
            starts.append(acc)
            acc += need[k]
        pre_ids = [k - i for k in range(i, j) for _ in range(ql[k])]
        i32 = dict(dtype=torch.int32, device=device)
        chunks.append(PrefillChunk(
            requests=slice(i, j),
            token_slice=slice(token_offset + q_start[i], token_offset + q_start[j]),
            seq_lens=torch.tensor(ctx[i:j], **i32),
            workspace_starts=torch.tensor(starts, **i32),
            workspace_lens=torch.tensor(need[i:j], **i32),
            prefill_request_id=torch.tensor(pre_ids, **i32),
            total_rows=total,
            max_rows=max(ctx[i:j]),
            req_slots=None if req_slots is None else req_slots[i:j],
            block_table=None if block_table is None else block_table[i:j],
        ))
        i = j
    return chunks


# ---------------------------------------------------------------------------
# staging: validation
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Mode:
    dequant: bool  # fp8_ds_mla -> bf16 workspace
    row_bytes: int


def _check_tensor(name: str, x, dtype: torch.dtype, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _validate_structure(*, host_pool, block_table, req_slots, seq_lens, workspace_starts, workspace,
                        block_size, row_format, hot_rows, row_slot, slots_per_req, max_rows,
                        rows_per_program, impl) -> _Mode:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    fmt = RowFormat.parse(row_format)
    _check_tensor("host_pool", host_pool, torch.uint8, 2)
    if host_pool.shape[1] != fmt.row_bytes:
        raise ValueError(f"host_pool rows are {host_pool.shape[1]} bytes but row_format {fmt.value} "
                         f"rows are {fmt.row_bytes}")
    _check_tensor("block_table", block_table, torch.int32, 2)
    for name, t in (("req_slots", req_slots), ("seq_lens", seq_lens), ("workspace_starts", workspace_starts)):
        _check_tensor(name, t, torch.int32, 1)
    P = req_slots.shape[0]
    if seq_lens.shape[0] != P or workspace_starts.shape[0] != P:
        raise ValueError(f"req_slots, seq_lens and workspace_starts need one entry per prefill request: "
                         f"got {P}, {seq_lens.shape[0]}, {workspace_starts.shape[0]}")
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
    if workspace.dtype == torch.bfloat16:
        if workspace.dim() != 2 or workspace.shape[1] != D_ROW:
            raise ValueError(f"a bf16 workspace must be [W, {D_ROW}], got shape {tuple(workspace.shape)}")
        mode = _Mode(dequant=fmt is RowFormat.FP8_DS_MLA, row_bytes=fmt.row_bytes)
    elif workspace.dtype == torch.uint8:
        if workspace.dim() != 2 or workspace.shape[1] != fmt.row_bytes:
            raise ValueError(f"a stored-format workspace must be uint8 [W, {fmt.row_bytes}] for "
                             f"{fmt.value} rows, got shape {tuple(workspace.shape)}")
        mode = _Mode(dequant=False, row_bytes=fmt.row_bytes)
    else:
        raise TypeError(f"workspace must be bfloat16 [W, {D_ROW}] or uint8 [W, row_bytes], got {workspace.dtype}")
    if not workspace.is_contiguous():
        raise ValueError("workspace must be contiguous")
    for name, v, lo in (("block_size", block_size, 1), ("rows_per_program", rows_per_program, 1)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise ValueError(f"max_rows must be None or an int >= 0, got {max_rows!r}")
    hot_args = (hot_rows is None, row_slot is None, slots_per_req is None)
    if len(set(hot_args)) != 1:
        raise ValueError("hot_rows, row_slot and slots_per_req go together: pass all three or none")
    dev = workspace.device
    if hot_rows is not None:
        _check_tensor("hot_rows", hot_rows, torch.uint8, 2)
        _check_tensor("row_slot", row_slot, torch.int32, 1)
        if hot_rows.shape[1] != fmt.row_bytes:
            raise ValueError(f"hot_rows are {hot_rows.shape[1]} bytes per row, expected {fmt.row_bytes}")
        if row_slot.shape[0] != host_pool.shape[0]:
            raise ValueError(f"row_slot has {row_slot.shape[0]} entries, host_pool has H={host_pool.shape[0]} rows")
        if isinstance(slots_per_req, bool) or not isinstance(slots_per_req, int) or slots_per_req < 1:
            raise ValueError(f"slots_per_req must be an int >= 1, got {slots_per_req!r}")
        if not hot_rows.is_contiguous():
            raise ValueError("hot_rows must be contiguous")
        for name, t in (("hot_rows", hot_rows), ("row_slot", row_slot)):
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device} but the workspace is on {dev}")
    for name, t in (("block_table", block_table), ("req_slots", req_slots), ("seq_lens", seq_lens),
                    ("workspace_starts", workspace_starts)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but the workspace is on {dev}")
    if not host_pool.is_contiguous():
        raise ValueError("host_pool must be contiguous")
    if host_pool.device != dev:
        if not (host_pool.device.type == "cpu" and dev.type == "cuda"):
            raise ValueError(f"host_pool is on {host_pool.device}, the workspace on {dev}: the pool must be "
                             "on the workspace's device or in pinned host memory")
        # is_pinned() asks the driver about the pointer: skipped during graph capture
        if not torch.cuda.is_current_stream_capturing() and not is_pinned_host(host_pool):
            raise ValueError("host_pool is a CPU tensor that is not pinned: the GPU kernel reads it over UVA, "
                             "which needs page-locked memory (use hisparse.device.PinnedBuffer)")
    return mode


def _validate_values(*, host_pool, block_table, req_slots, seq_lens, workspace_starts, workspace,
                     block_size, row_slot, slots_per_req, hot_rows, max_rows) -> None:
    """Index ranges (host sync). Raises ValueError naming the offending request."""
    P = req_slots.shape[0]
    if P == 0:
        return
    R, NB = block_table.shape
    H, W = host_pool.shape[0], workspace.shape[0]
    slots = req_slots.long().cpu()
    lens = seq_lens.long().cpu()
    starts = workspace_starts.long().cpu()
    for i in range(P):
        r, n, w0 = int(slots[i]), int(lens[i]), int(starts[i])
        if not 0 <= r < R:
            raise ValueError(f"req_slots[{i}] = {r} is outside [0, {R}) (block_table has {R} rows)")
        if n < 0:
            raise ValueError(f"seq_lens[{i}] = {n} must be >= 0")
        if n > NB * block_size:
            raise ValueError(f"seq_lens[{i}] = {n} exceeds the block table's {NB} blocks x {block_size}")
        if w0 < 0 or w0 + n > W:
            raise ValueError(f"prefill request {i}: workspace rows [{w0}, {w0 + n}) are outside the "
                             f"workspace of W={W} rows")
    if max_rows is not None and int(lens.max()) > max_rows:
        raise ValueError(f"max_rows={max_rows} is smaller than the longest seq_len {int(lens.max())}")
    order = torch.argsort(starts)
    for a, b in zip(order[:-1].tolist(), order[1:].tolist()):
        if lens[a] > 0 and lens[b] > 0 and starts[a] + lens[a] > starts[b]:
            raise ValueError(f"workspace regions of prefill requests {a} and {b} overlap "
                             f"([{int(starts[a])}, {int(starts[a] + lens[a])}) and starts[{b}] = {int(starts[b])})")
    bt = block_table.long().cpu()
    for i in range(P):
        r, n = int(slots[i]), int(lens[i])
        if n == 0:
            continue
        nb = -(-n // block_size)
        blocks = bt[r, :nb]
        if bool((blocks < 0).any()):
            k = int(torch.nonzero(blocks < 0)[0])
            raise ValueError(f"prefill request {i} (slot {r}) has no block for logical block {k} "
                             f"(block_table[{r}, {k}] = -1) but seq_len = {n}")
        last = (blocks * block_size + block_size - 1)
        last[-1] = blocks[-1] * block_size + (n - 1) % block_size
        if bool((last >= H).any()):
            k = int(torch.nonzero(last >= H)[0])
            raise ValueError(f"prefill request {i}: block_table[{r}, {k}] = {int(blocks[k])} points past "
                             f"the host pool of H={H} rows")
    if row_slot is not None:
        rs = row_slot
        if bool(((rs < -1) | (rs >= slots_per_req)).any()):
            raise ValueError(f"row_slot holds values outside [-1, {slots_per_req})")
        if hot_rows.shape[0] < R * slots_per_req:
            raise ValueError(f"hot_rows has {hot_rows.shape[0]} rows, fewer than R x slots_per_req = "
                             f"{R} x {slots_per_req}")


# ---------------------------------------------------------------------------
# staging: reference and launcher
# ---------------------------------------------------------------------------

def _source_rows(host_pool, block_table, r: int, n: int, block_size: int, hot_rows, row_slot,
                 slots_per_req) -> torch.Tensor:
    """uint8 [n, row_bytes] stored rows of request slot r, positions [0, n) (hot rows preferred)."""
    dev = block_table.device
    p = torch.arange(n, dtype=torch.long, device=dev)
    h = block_table[r].long()[p // block_size] * block_size + p % block_size
    rows = host_pool[h.to(host_pool.device)].to(dev)
    if row_slot is not None:
        s = row_slot[h].long()
        hot = s >= 0
        if bool(hot.any()):
            rows[hot] = hot_rows[r * slots_per_req + s[hot]]
    return rows


def stage_prefill_reference(*, host_pool, block_table, req_slots, seq_lens, workspace_starts, workspace,
                            block_size: int, row_format, hot_rows=None, row_slot=None,
                            slots_per_req: int | None = None) -> None:
    """Pure-torch staging (the oracle and CPU path); arguments as ``stage_prefill``, no checks."""
    from ..formats import dequantize_fp8_ds_mla_reference

    fmt = RowFormat.parse(row_format)
    for i in range(req_slots.shape[0]):
        r, n, w0 = int(req_slots[i]), int(seq_lens[i]), int(workspace_starts[i])
        if n == 0:
            continue
        rows = _source_rows(host_pool, block_table, r, n, block_size, hot_rows, row_slot, slots_per_req)
        if workspace.dtype == torch.uint8:
            workspace[w0:w0 + n] = rows
        elif fmt is RowFormat.FP8_DS_MLA:
            workspace[w0:w0 + n] = dequantize_fp8_ds_mla_reference(rows)
        else:
            workspace[w0:w0 + n] = rows.view(torch.bfloat16)


def stage_prefill(
    *,
    host_pool: torch.Tensor,  # uint8 [H, row_bytes] one layer's host rows (pinned CPU, or on the device)
    block_table: torch.Tensor,  # int32 [R, NB] host block of each logical block, per request slot
    req_slots: torch.Tensor,  # int32 [P] request slot of each prefill request
    seq_lens: torch.Tensor,  # int32 [P] rows [0, seq_len) to stage per request
    workspace_starts: torch.Tensor,  # int32 [P] first workspace row of each request
    workspace: torch.Tensor,  # bf16 [W, 576] (dequantised) or uint8 [W, row_bytes] (stored format)
    block_size: int,
    row_format: RowFormat | str,
    hot_rows: torch.Tensor | None = None,  # uint8 [R * SP, row_bytes] the layer's flat hot view
    row_slot: torch.Tensor | None = None,  # int32 [H] hot slot of each host row of the layer, -1 = not hot
    slots_per_req: int | None = None,  # SP = S + 1
    max_rows: int | None = None,  # >= max(seq_lens): sizes the grid without a host sync
    stream: "torch.cuda.Stream | None" = None,
    validate: bool = True,
    impl: str = "auto",
    rows_per_program: int = 8,
    num_warps: int = 4,
):
    """Gather each prefill request's rows [0, seq_len) into ``workspace`` (see module docstring).

    Workspace dtype selects the mode: bf16 -> fp8_ds_mla rows dequantised (bf16 rows
    copied); uint8 -> rows copied in their stored format. ``workspace_starts[i] + p``
    receives position p of request i. On CUDA the kernel runs on ``stream`` (default:
    the current stream) after that stream waits on the current stream; returns a
    ``torch.cuda.Event`` recorded after the kernel, for the compute stream to wait on.
    Returns None on CPU. ``validate=True`` checks every index range (a host sync)
    before launching; ``validate=False`` with ``max_rows`` given is sync-free and
    allocation-free (rows that cannot be located are skipped, never read out of bounds).
    The caller keeps every tensor alive until the event has completed (nothing here
    calls ``record_stream``), and runs no resolve of these requests meanwhile.
    """
    mode = _validate_structure(
        host_pool=host_pool, block_table=block_table, req_slots=req_slots, seq_lens=seq_lens,
        workspace_starts=workspace_starts, workspace=workspace, block_size=block_size,
        row_format=row_format, hot_rows=hot_rows, row_slot=row_slot, slots_per_req=slots_per_req,
        max_rows=max_rows, rows_per_program=rows_per_program, impl=impl)
    if validate:
        _validate_values(host_pool=host_pool, block_table=block_table, req_slots=req_slots, seq_lens=seq_lens,
                         workspace_starts=workspace_starts, workspace=workspace, block_size=block_size,
                         row_slot=row_slot, slots_per_req=slots_per_req, hot_rows=hot_rows, max_rows=max_rows)
    dev = workspace.device
    cuda = dev.type == "cuda"
    use_triton = impl == "triton" or (impl == "auto" and cuda)
    if stream is not None and not cuda:
        raise ValueError("stream is only meaningful for a CUDA workspace")
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    event = None
    if cuda:
        cur = torch.cuda.current_stream(dev)
        run_on = stream if stream is not None else cur
        if run_on != cur:
            run_on.wait_stream(cur)
        ctx = torch.cuda.stream(run_on)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        P = req_slots.shape[0]
        if not use_triton:
            stage_prefill_reference(host_pool=host_pool, block_table=block_table, req_slots=req_slots,
                                    seq_lens=seq_lens, workspace_starts=workspace_starts, workspace=workspace,
                                    block_size=block_size, row_format=row_format, hot_rows=hot_rows,
                                    row_slot=row_slot, slots_per_req=slots_per_req)
        else:
            if max_rows is None:
                max_rows = int(seq_lens.max()) if P else 0  # host sync
            if P and max_rows:
                _launch(mode, host_pool=host_pool, block_table=block_table, req_slots=req_slots,
                        seq_lens=seq_lens, workspace_starts=workspace_starts, workspace=workspace,
                        block_size=block_size, hot_rows=hot_rows, row_slot=row_slot,
                        slots_per_req=slots_per_req, max_rows=max_rows, rows=rows_per_program,
                        num_warps=num_warps)
        if cuda:
            event = torch.cuda.Event()
            event.record()
    return event


def _launch(mode: _Mode, *, host_pool, block_table, req_slots, seq_lens, workspace_starts, workspace,
            block_size, hot_rows, row_slot, slots_per_req, max_rows, rows, num_warps) -> None:
    from ..kernels.stage_prefill import stage_copy_kernel, stage_dequant_kernel

    P = req_slots.shape[0]
    R, NB = block_table.shape
    H, W = host_pool.shape[0], workspace.shape[0]
    has_hot = hot_rows is not None
    hot_n = hot_rows.shape[0] if has_hot else 0
    sp = slots_per_req if has_hot else 1
    bt = block_table if block_table.numel() and block_table.stride(1) == 1 else block_table.contiguous()
    stride_bt = bt.stride(0) if NB else 1
    grid = (-(-max_rows // rows), P)
    if mode.dequant:
        host_w = host_pool.view(torch.int32)
        stage_dequant_kernel[grid](
            host_w, hot_rows.view(torch.int32) if has_hot else host_w, row_slot if has_hot else req_slots,
            bt if bt.numel() else req_slots, req_slots, seq_lens, workspace_starts,
            workspace.view(torch.int32), R, NB, H, W, hot_n, sp, stride_bt,
            BLOCK_SIZE=block_size, ROWS=rows, HAS_HOT=has_hot, num_warps=num_warps)
    else:
        words = mode.row_bytes // 4
        host_w = host_pool.view(torch.int32)
        stage_copy_kernel[grid](
            host_w, hot_rows.view(torch.int32) if has_hot else host_w, row_slot if has_hot else req_slots,
            bt if bt.numel() else req_slots, req_slots, seq_lens, workspace_starts,
            workspace.view(torch.int32).view(W, words),
            R, NB, H, W, hot_n, sp, stride_bt,
            BLOCK_SIZE=block_size, ROWS=rows, WORDS=words, WORDS_P2=triton.next_power_of_2(words),
            HAS_HOT=has_hot, num_warps=num_warps)


def stage_prefill_chunk(chunk: PrefillChunk, *, workspace: torch.Tensor, **kwargs):
    """``stage_prefill`` for one planned chunk: its request slots, rows and rebased starts.

    kwargs: host_pool, block_table (the cache's [R, NB]), block_size, row_format and the
    optional ones of ``stage_prefill``. The chunk must carry ``req_slots``.
    """
    if chunk.req_slots is None:
        raise ValueError("the chunk carries no req_slots: plan with plan_prefill_chunks(..., req_slots=...)")
    kwargs.setdefault("max_rows", chunk.max_rows)
    return stage_prefill(req_slots=chunk.req_slots, seq_lens=chunk.seq_lens,
                         workspace_starts=chunk.workspace_starts, workspace=workspace, **kwargs)


__all__ = ["PrefillChunk", "plan_prefill_chunks", "stage_prefill", "stage_prefill_chunk",
           "stage_prefill_reference"]
