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
2. ``stage_prefill(view, chunk.stage_requests(), workspace)`` (device, on a prefill
   stream): gather the rows of a cache layer (``HiSparseCache.layer_view(layer)``);
   returns an event the compute stream waits on (``None`` on CPU).
3. ``hisparse.staging.convert_topk_to_physical(..., workspace=chunk.workspace_map())``:
   top-k positions -> workspace rows.
4. Attention over the workspace; afterwards the new rows are appended through the
   cache's write path (``HiSparseCache.write``).

A request longer than the workspace raises ``CapacityError`` naming W and the
request's length. Staging it in pieces was not done: a query token's top-k may
reference any of its context rows, so its attention needs all of them addressable at
once; pieces would need split attention with an LSE merge across pieces in every
backend (or a sparse workspace holding only the union of the selected rows), which
is a larger change than staging. Size W for the longest prefill context.

Where a row is read from (the same bytes either way):
- a *resident* request (the elastic tier, ``view.resident[r] != 0``): every position
  from its device page, ``hot[pool_base + page_table[r, p // PB] * PB + p % PB]``,
  device to device; its host rows and block table are not read. The cache writes
  each appended row to its page and to the host pool alike.
- a hot request: a row whose row key h (``state``) has ``row_slot[h] >= 0`` from its
  hot slot (HBM instead of PCIe), the others from the host pool over PCIe, at the host
  row of h (through ``view.host_block`` where the view has one, prefix caching). The
  cache keeps hot rows byte-identical to their host rows.
The caller must not run, concurrently with staging, a resolve of the same (layer,
request) (a resolve may remap slots) nor a write or free that changes residency (a
demotion or free returns a request's pages, which a later write may refill).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch
import triton

from .._checks import Kernels, check_int, check_ints, check_tensor, device_type
from ..errors import CapacityError
from ..formats import D_ROW, RowFormat, dequantize_fp8_ds_mla_reference
from ..kernels.fast_launch import fast
from ..kernels.stage_prefill import stage_copy_kernel, stage_dequant_kernel
from .convert import WorkspaceMap
from .view import LayerView


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

    def stage_requests(self) -> "StageRequests":
        """What ``stage_prefill`` needs of this chunk (needs ``req_slots``)."""
        if self.req_slots is None:
            raise ValueError("the chunk carries no req_slots: plan with plan_prefill_chunks(..., req_slots=...)")
        return StageRequests(req_slots=self.req_slots, seq_lens=self.seq_lens,
                             starts=self.workspace_starts, max_rows=self.max_rows)

    def workspace_map(self) -> WorkspaceMap:
        """The chunk's tokens -> workspace rows, for ``convert_topk_to_physical``."""
        return WorkspaceMap(prefill_request_id=self.prefill_request_id, starts=self.workspace_starts,
                            lens=self.workspace_lens)


@dataclasses.dataclass(frozen=True)
class StageRequests:
    """The requests one ``stage_prefill`` call gathers (P of them).

    req_slots: int32 [P] request slot of each (a row of the view's block table)
    seq_lens:  int32 [P] rows [0, seq_len) to stage per request
    starts:    int32 [P] first workspace row of each request
    max_rows:  >= max(seq_lens), or None (then read from seq_lens: a host sync); sizes
               the launch grid
    """

    req_slots: torch.Tensor
    seq_lens: torch.Tensor
    starts: torch.Tensor
    max_rows: int | None = None

    def __post_init__(self) -> None:
        check_tensor("req_slots", self.req_slots, dtype=torch.int32, ndim=1)
        P = self.req_slots.shape[0]
        dev = self.req_slots.device
        check_tensor("seq_lens", self.seq_lens, dtype=torch.int32, shape=(P,), device=dev)
        check_tensor("workspace_starts", self.starts, dtype=torch.int32, shape=(P,), device=dev)
        if self.max_rows is not None:
            check_int("max_rows", self.max_rows, 0)

    @property
    def num_requests(self) -> int:
        return int(self.req_slots.shape[0])


def _as_int_list(name: str, v) -> list[int]:
    """A 1-D integer tensor or a sequence of ints -> list of ints (each >= 0)."""
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got "
                            f"{v.dtype} shape {tuple(v.shape)}")
        v = v.tolist()
    if not isinstance(v, (list, tuple, range)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(v).__name__}")
    return check_ints(name, v, 0)


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
    check_int("workspace_rows", workspace_rows, 1)
    check_int("token_offset", token_offset, 0)
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
                f"hisparse.staging.prefill): use a workspace of at least {n} rows")

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


def _validate_structure(view: LayerView, reqs: StageRequests, workspace: object,
                        rows_per_program: int, num_warps: int) -> _Mode:
    """Types, dtypes, shapes and devices of one call (the view was checked when built)."""
    if not isinstance(view, LayerView):
        raise TypeError(f"view must be a hisparse.staging.LayerView, got {type(view).__name__}")
    if not isinstance(reqs, StageRequests):
        raise TypeError(f"requests must be a hisparse.staging.StageRequests, got {type(reqs).__name__}")
    fmt = view.row_format
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
    check_int("rows_per_program", rows_per_program, 1)
    check_int("num_warps", num_warps, 1)
    for name, v in (("rows_per_program", rows_per_program), ("num_warps", num_warps)):
        if v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    dev = view.device
    if workspace.device != dev:
        raise ValueError(f"workspace is on {workspace.device} but the layer view on {dev}")
    if reqs.req_slots.device != dev:
        raise ValueError(f"the request tensors are on {reqs.req_slots.device} but the layer view on {dev}")
    return mode


def _validate_values(view: LayerView, reqs: StageRequests, workspace: torch.Tensor) -> None:
    """Index ranges (host sync). Raises ValueError naming the offending request."""
    P = reqs.num_requests
    if P == 0:
        return
    block_size = view.blocks.block_size
    R, NB = view.blocks.table.shape
    H, HV, W = view.num_host_rows, view.num_row_keys, workspace.shape[0]
    slots = reqs.req_slots.long().cpu()
    lens = reqs.seq_lens.long().cpu()
    starts = reqs.starts.long().cpu()
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
    if reqs.max_rows is not None and int(lens.max()) > reqs.max_rows:
        raise ValueError(f"max_rows={reqs.max_rows} is smaller than the longest seq_len {int(lens.max())}")
    order = torch.argsort(starts)
    for a, b in zip(order[:-1].tolist(), order[1:].tolist()):
        if lens[a] > 0 and lens[b] > 0 and starts[a] + lens[a] > starts[b]:
            raise ValueError(f"workspace regions of prefill requests {a} and {b} overlap "
                             f"([{int(starts[a])}, {int(starts[a] + lens[a])}) and starts[{b}] = {int(starts[b])})")
    bt = view.blocks.table.long().cpu()
    hb = view.host_block.long().cpu() if view.host_block is not None else None
    resident = view.resident.cpu() if view.has_pool else None
    for i in range(P):
        r, n = int(slots[i]), int(lens[i])
        if n == 0:
            continue
        if resident is not None and int(resident[r]) != 0:
            _validate_pages(view, i, r, n)
            continue
        nb = -(-n // block_size)
        blocks = bt[r, :nb]
        if bool((blocks < 0).any()):
            k = int(torch.nonzero(blocks < 0)[0])
            raise ValueError(f"prefill request {i} (slot {r}) has no block for logical block {k} "
                             f"(block_table[{r}, {k}] = -1) but seq_len = {n}")
        _validate_blocks(i, r, n, blocks, block_size, HV, H, hb)
    if view.row_slot is not None:
        rs = view.row_slot
        if bool(((rs < -1) | (rs >= view.slots_per_req)).any()):
            raise ValueError(f"row_slot holds values outside [-1, {view.slots_per_req})")


def _validate_blocks(i: int, r: int, n: int, blocks: torch.Tensor, B: int, HV: int, H: int,
                     hb: torch.Tensor | None) -> None:
    """Block ids ``blocks`` (int64 [nb] >= 0, CPU) of prefill request i (slot r, n rows):
    every row key < HV and, through ``hb`` (int64 [NV] CPU, or None: the identity),
    every host row < H."""
    last = blocks * B + B - 1
    last[-1] = blocks[-1] * B + (n - 1) % B
    if bool((last >= HV).any()):
        k = int(torch.nonzero(last >= HV)[0])
        what = f"the {HV // B} block ids" if hb is not None else f"the host pool of H={H} rows"
        raise ValueError(f"prefill request {i}: block_table[{r}, {k}] = {int(blocks[k])} points past {what}")
    if hb is None:
        return
    host = hb[blocks]
    last = host * B + B - 1
    last[-1] = host[-1] * B + (n - 1) % B
    bad = (host < 0) | (last >= H)
    if bool(bad.any()):
        k = int(torch.nonzero(bad)[0])
        raise ValueError(f"prefill request {i}: block id {int(blocks[k])} (block_table[{r}, {k}]) maps to "
                         f"host block {int(host[k])}, outside the host pool of H={H} rows")


def _validate_pages(view: LayerView, i: int, r: int, n: int) -> None:
    """Resident request slot r of prefill request i: a mapped page inside the device
    view for every position [0, n)."""
    PB = view.page_rows
    pt = view.page_table[r].long().cpu()
    MP = pt.numel()
    npg = -(-n // PB)
    if npg > MP:
        raise ValueError(f"prefill request {i} (resident slot {r}) has seq_len = {n}, more than its "
                         f"page table's {MP} pages x {PB} rows")
    pages = pt[:npg]
    if bool((pages < 0).any()):
        k = int(torch.nonzero(pages < 0)[0])
        raise ValueError(f"prefill request {i} (resident slot {r}) has no device page for logical page "
                         f"{k} (page_table[{r}, {k}] = -1) but seq_len = {n}")
    last = view.pool_base + pages * PB + PB - 1
    last[-1] = view.pool_base + pages[-1] * PB + (n - 1) % PB
    N = view.hot_rows.shape[0]
    if bool((last >= N).any()):
        k = int(torch.nonzero(last >= N)[0])
        raise ValueError(f"prefill request {i} (resident slot {r}): page_table[{r}, {k}] = {int(pages[k])} "
                         f"points past the device view of {N} rows")


# ---------------------------------------------------------------------------
# staging: reference and launcher
# ---------------------------------------------------------------------------

def _source_rows(view: LayerView, r: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(positions, rows): uint8 [m, row_bytes] stored rows of request slot r at
    ``positions`` (int64 [m]; None = all of [0, n), m = n). A resident request's rows
    come from its device pages (positions whose page is unmapped or past the view are
    left out); others from the host pool, hot rows preferred."""
    bt = view.blocks.table
    p = torch.arange(n, dtype=torch.long, device=bt.device)
    if view.has_pool and int(view.resident[r]) != 0:
        PB = view.page_rows
        pt = view.page_table[r].long()
        pg = p // PB
        okp = pg < pt.numel()
        page = torch.full_like(pg, -1)
        page[okp] = pt[pg[okp]]
        row = view.pool_base + page * PB + p % PB
        good = okp & (page >= 0) & (row < view.hot_rows.shape[0])
        return p[good], view.hot_rows[row[good]]
    B = view.blocks.block_size
    h = bt[r].long()[p // B] * B + p % B  # row keys
    hr = h if view.host_block is None else view.host_block.long()[h // B] * B + h % B
    rows = view.host_rows[hr.to(view.host_rows.device)].to(bt.device)
    if view.row_slot is not None:
        s = view.row_slot[h].long()
        hot = s >= 0
        if bool(hot.any()):
            rows[hot] = view.hot_rows[r * view.slots_per_req + s[hot]]
    return None, rows


def stage_prefill_reference(view: LayerView, requests: StageRequests, workspace: torch.Tensor) -> None:
    """Pure-torch staging (the oracle and CPU path); arguments as ``stage_prefill``, no checks."""
    fmt = view.row_format
    for i in range(requests.num_requests):
        r, n, w0 = int(requests.req_slots[i]), int(requests.seq_lens[i]), int(requests.starts[i])
        if n == 0:
            continue
        pos, rows = _source_rows(view, r, n)
        if workspace.dtype == torch.uint8:
            out = rows
        elif fmt is RowFormat.FP8_DS_MLA:
            out = dequantize_fp8_ds_mla_reference(rows)
        else:
            out = rows.view(torch.bfloat16)
        if pos is None:
            workspace[w0:w0 + n] = out
        else:
            workspace[w0 + pos] = out


def stage_prefill(
    view: LayerView,
    requests: StageRequests,
    workspace: torch.Tensor,  # bf16 [W, 576] (dequantised) or uint8 [W, row_bytes] (stored format)
    *,
    stream: "torch.cuda.Stream | None" = None,
    validate: bool = True,
    kernels: Kernels | str = "auto",
    rows_per_program: int = 8,
    num_warps: int = 4,
):
    """Gather each request's rows [0, seq_len) of ``view`` into ``workspace`` (module docstring).

    Workspace dtype selects the mode: bf16 -> fp8_ds_mla rows dequantised (bf16 rows
    copied); uint8 -> rows copied in their stored format. ``requests.starts[i] + p``
    receives position p of request i. On CUDA the kernel runs on ``stream`` (default:
    the current stream) after that stream waits on the current stream; returns a
    ``torch.cuda.Event`` recorded after the kernel, for the compute stream to wait on.
    Returns None on CPU. ``validate=True`` checks every index range (a host sync)
    before launching; ``validate=False`` with ``requests.max_rows`` given is sync-free
    and allocation-free (rows that cannot be located are skipped, never read out of
    bounds; a resident request's position whose page is unmapped too). Resident
    requests (a view with the elastic tier) are read from their device pages. The
    caller keeps every tensor alive until the event has completed (nothing here calls
    ``record_stream``), and runs no resolve of these requests meanwhile, nor a write
    or free that demotes or releases one of them. ``rows_per_program`` /
    ``num_warps`` tune the launch.
    """
    mode = _validate_structure(view, requests, workspace, rows_per_program, num_warps)
    impl = Kernels.parse(kernels).pick(view.device)
    if validate:
        _validate_values(view, requests, workspace)
    dev = workspace.device
    cuda = device_type(dev) == "cuda"
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
        if impl is Kernels.TORCH:
            stage_prefill_reference(view, requests, workspace)
        else:
            max_rows = requests.max_rows
            if max_rows is None:
                max_rows = int(requests.seq_lens.max()) if requests.num_requests else 0  # host sync
            if requests.num_requests and max_rows:
                _launch(mode, view, requests, workspace, max_rows, rows_per_program, num_warps)
        if cuda:
            event = torch.cuda.Event()
            event.record()
    return event


def _launch(mode: _Mode, view: LayerView, reqs: StageRequests, workspace: torch.Tensor,
            max_rows: int, rows: int, num_warps: int) -> None:
    P = reqs.num_requests
    block_table = view.blocks.table
    R, NB = block_table.shape
    H, HV, W = view.num_host_rows, view.num_row_keys, workspace.shape[0]
    has_hot = view.hot_rows is not None
    has_pool = view.has_pool  # implies has_hot (LayerView)
    hot_rows, row_slot = view.hot_rows, view.row_slot
    hot_n = hot_rows.shape[0] if has_hot else 0
    sp = view.slots_per_req if has_hot else 1
    bt = block_table if block_table.numel() and block_table.stride(1) == 1 else block_table.contiguous()
    stride_bt = bt.stride(0) if NB else 1
    if has_pool:
        pt = view.page_table  # last dimension packed (LayerView)
        MP, stride_pt = pt.shape[1], (pt.stride(0) if pt.shape[1] else 1)
        pool = (view.resident, pt if pt.numel() else reqs.req_slots)
        pool_args = (MP, stride_pt, view.pool_base)
    else:
        pool = (reqs.req_slots, reqs.req_slots)
        pool_args = (0, 1, 0)
    grid = (-(-max_rows // rows), P)
    host_w = view.host_rows.view(torch.int32)
    hot_w = hot_rows.view(torch.int32) if has_hot else host_w
    aliased = view.host_block is not None
    hb = view.host_block if aliased else reqs.req_slots
    common = (host_w, hot_w, row_slot if has_hot else reqs.req_slots, *pool, hb,
              bt if bt.numel() else reqs.req_slots, reqs.req_slots, reqs.seq_lens, reqs.starts)
    flags = dict(BLOCK_SIZE=view.blocks.block_size, ROWS=rows, HAS_HOT=has_hot, HAS_POOL=has_pool,
                 PAGE_ROWS=view.page_rows if has_pool else 1, ALIASED=aliased, num_warps=num_warps)
    with torch.cuda.device(workspace.device) if workspace.is_cuda else contextlib.nullcontext():
        if mode.dequant:
            fast(stage_dequant_kernel)[grid](
                *common, workspace.view(torch.int32), R, NB, H, HV, W, hot_n, sp, stride_bt, *pool_args, **flags)
        else:
            words = mode.row_bytes // 4
            fast(stage_copy_kernel)[grid](
                *common, workspace.view(torch.int32).view(W, words), R, NB, H, HV, W, hot_n, sp, stride_bt,
                *pool_args, WORDS=words, WORDS_P2=triton.next_power_of_2(words), **flags)


__all__ = ["PrefillChunk", "StageRequests", "plan_prefill_chunks", "stage_prefill",
           "stage_prefill_reference"]
