"""Keyword-form wrappers over ``hisparse.staging`` for tests that build raw tensors.

The tests describe a staging or conversion case as plain tensors (a host pool, a block
table, request slots, ...); these helpers build the frozen views the API takes
(``LayerView``, ``BlockTable``, ``StageRequests``, ``WorkspaceMap``) and call it, so
each test states its case once. Errors from building a view surface exactly as the
API raises them.
"""

from __future__ import annotations

from hisparse.staging import (BlockTable, LayerView, StageRequests, WorkspaceMap, convert_reference,
                              convert_topk_to_physical, stage_prefill, stage_prefill_reference)


def layer_view(*, host_pool, block_table, block_size, row_format, hot_rows=None, row_slot=None,
               slots_per_req=None) -> LayerView:
    return LayerView(host_rows=host_pool, blocks=BlockTable(block_table, block_size), row_format=row_format,
                     hot_rows=hot_rows, row_slot=row_slot,
                     slots_per_req=1 if slots_per_req is None else slots_per_req)


def _split(kw):
    view = layer_view(**{k: kw.pop(k) for k in ("host_pool", "block_table", "block_size", "row_format",
                                                 "hot_rows", "row_slot", "slots_per_req") if k in kw})
    reqs = StageRequests(req_slots=kw.pop("req_slots"), seq_lens=kw.pop("seq_lens"),
                         starts=kw.pop("workspace_starts"), max_rows=kw.pop("max_rows", None))
    if "impl" in kw:
        kw["kernels"] = kw.pop("impl")
    return view, reqs, kw


def stage(*, workspace, **kw):
    view, reqs, kw = _split(kw)
    return stage_prefill(view, reqs, workspace, **kw)


def stage_chunk(chunk, *, workspace, **kw):
    view = layer_view(**{k: kw.pop(k) for k in ("host_pool", "block_table", "block_size", "row_format",
                                                 "hot_rows", "row_slot", "slots_per_req") if k in kw})
    if "impl" in kw:
        kw["kernels"] = kw.pop("impl")
    return stage_prefill(view, chunk.stage_requests(), workspace, **kw)


def stage_ref(*, workspace, **kw):
    view, reqs, kw = _split(kw)
    return stage_prefill_reference(view, reqs, workspace)


def _conv_args(bt, kw):
    blocks = BlockTable(bt, kw.pop("block_size"), kw.pop("block_stride", None), kw.pop("seq_lens", None))
    pre, starts, lens = kw.pop("prefill_request_id", None), kw.pop("workspace_starts", None), \
        kw.pop("workspace_lens", None)
    if (pre is None) != (starts is None):
        raise ValueError("prefill_request_id and workspace_starts go together: pass both or neither")
    if lens is not None and starts is None:
        raise ValueError("workspace_lens needs workspace_starts and prefill_request_id")
    ws = None if pre is None else WorkspaceMap(pre, starts, lens)
    if "impl" in kw:
        kw["kernels"] = kw.pop("impl")
    return blocks, ws, kw


def convert(topk, req, bt, **kw):
    blocks, ws, kw = _conv_args(bt, kw)
    return convert_topk_to_physical(topk, req, blocks, workspace=ws, **kw)


def convert_ref(topk, req, bt, **kw):
    blocks, ws, kw = _conv_args(bt, kw)
    return convert_reference(topk, req, blocks, workspace=ws, **kw)
