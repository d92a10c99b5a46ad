"""The engine façade's prefill calls: a prefill request's context staged from the tiers.

A prefill (or chunked-prefill) request attends to its whole context, which lives in the
host pool (and, for recent positions, the hot buffer). :class:`PrefillStaging`, which
``HiSparseIndexGroup`` calls, stages those rows for the engine's prefill attention: into a
bf16 workspace with fp8 rows dequantised (``gather_fp8_prefill``, on the group's
prefill stream, returning the event to wait on), or in the stored row format into an
engine-owned staging area (``stage_prefill_rows``, which waits itself). Both read the
rows this forward's ``write_new_rows`` of the layer appended, so they run after it.
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_tensor
from ..cache.cache import HiSparseCache
from ..formats import D_ROW
from ..staging.prefill import StageRequests, stage_prefill
from .forward import Forward


class PrefillStaging:
    """The prefill calls over one cache (``validate``: the group's checked mode;
    ``prefill_stream``: the stream staging runs on, None on CPU). The group checks the
    layer index and the metadata; these take the forward (``engine.forward``)."""

    def __init__(self, cache: HiSparseCache, *, validate: bool, prefill_stream) -> None:
        self.cache = cache
        self.config = cache.cfg
        self.device = cache.device
        self.validate = validate
        self.prefill_stream = prefill_stream

    def _prefill_rows(self, fwd: Forward, start: int, count: int, layer: int) -> list[tuple[int, int]]:
        """(request id, rows to stage) of prefill requests start .. start+count-1."""
        md = fwd.metadata
        if md.num_tokens and layer not in fwd.written:
            raise ValueError(f"layer {layer}: call write_new_rows before staging the prefill context")
        out = []
        for p in range(start, start + count):
            row = md.num_decodes + p
            out.append((md.request_ids_cpu[row], md.seq_lens_cpu[row]))
        return out

    def stage_prefill_rows(self, fwd: Forward, i: int, kv_cache: torch.Tensor):
        """``HiSparseIndexGroup.stage_prefill_rows`` of layer i (documented there)."""
        md = fwd.metadata
        flat, block_size = self._staging_view(kv_cache)
        reqs = self._prefill_rows(fwd, 0, md.num_prefills, i)
        blocks = [-(-n // block_size) for _, n in reqs]
        if sum(blocks) * block_size > flat.shape[0]:
            raise ValueError(f"kv_cache holds {flat.shape[0]} rows but the {len(reqs)} prefill requests need "
                             f"{sum(blocks)} blocks of {block_size} rows; chunk the prefill")
        starts, acc = [], 0
        max_b = max(blocks, default=0)
        table = [[-1] * max_b for _ in reqs]
        for p, nb in enumerate(blocks):
            starts.append(acc * block_size)
            table[p][:nb] = range(acc, acc + nb)
            acc += nb
        ev = self._stage(i, reqs, starts, flat)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        bt = torch.tensor(table, dtype=torch.int32, device=self.device).view(len(reqs), max_b)
        td = md.num_decode_tokens
        req_ids = md.req_id_per_token[td:] - md.num_decodes
        return flat, bt, req_ids

    def _staging_view(self, kv_cache: object) -> tuple[torch.Tensor, int]:
        rb = self.config.row_bytes
        check_tensor("kv_cache", kv_cache, dtype=torch.uint8, device=self.device)
        if kv_cache.dim() == 3 and kv_cache.shape[2] == rb and kv_cache.is_contiguous():
            return kv_cache.view(-1, rb), kv_cache.shape[1]
        if kv_cache.dim() == 2 and kv_cache.shape[1] == rb and kv_cache.is_contiguous():
            return kv_cache, 1
        raise ValueError(f"kv_cache must be a contiguous uint8 [num_blocks, block_size, {rb}] or "
                         f"[N, {rb}] tensor, got {tuple(kv_cache.shape)}")

    def gather_fp8_prefill(self, fwd: Forward, i: int, kv_cache: torch.Tensor | None, workspace: torch.Tensor,
                           block_table: torch.Tensor | None, workspace_starts: torch.Tensor, num_reqs: int,
                           req_start_idx: int):
        """``HiSparseIndexGroup.gather_fp8_prefill`` of layer i (documented there)."""
        md = fwd.metadata
        check_int("num_reqs", num_reqs, 0)
        check_int("req_start_idx", req_start_idx, 0)
        if req_start_idx + num_reqs > md.num_prefills:
            raise ValueError(f"prefill requests {req_start_idx}..{req_start_idx + num_reqs - 1} are outside the "
                             f"batch's {md.num_prefills} prefills")
        for name, t in (("kv_cache", kv_cache), ("block_table", block_table)):
            if t is not None:
                check_tensor(name, t)
        check_tensor("workspace", workspace, dtype=torch.bfloat16, shape=(None, D_ROW), device=self.device,
                     contiguous=True)
        check_tensor("workspace_starts", workspace_starts, dtype=torch.int32, shape=(num_reqs,),
                     device=self.device)
        reqs = self._prefill_rows(fwd, req_start_idx, num_reqs, i)
        starts, acc = [], 0
        for _, n in reqs:
            starts.append(acc)
            acc += n
        if acc > workspace.shape[0]:
            raise ValueError(f"the {num_reqs} prefill requests need {acc} workspace rows, the workspace "
                             f"has {workspace.shape[0]}; chunk the prefill")
        if self.validate and num_reqs:
            got = workspace_starts.tolist()
            if got != starts:
                raise ValueError(f"workspace_starts {got} differ from the prefix sums of the requests' "
                                 f"seq_lens {starts}")
        return self._stage(i, reqs, starts, workspace)

    def _stage(self, layer: int, reqs: list[tuple[int, int]], starts: list[int], dst: torch.Tensor):
        """Stage rows [0, n) of each (req id, n) at row ``starts[j]`` of ``dst``; returns the event.

        Runs ``hisparse.staging.stage_prefill`` over the cache's layer view on the
        prefill stream, after it waits on the compute stream and on the cache's host
        mirror copies (rows written by ``write_new_rows`` this forward are on host
        before they are read from there).
        """
        c = self.cache
        i32 = dict(dtype=torch.int32, device=self.device)
        requests = StageRequests(
            req_slots=torch.tensor([c.request(rid).slot for rid, _ in reqs], **i32),
            seq_lens=torch.tensor([n for _, n in reqs], **i32), starts=torch.tensor(starts, **i32),
            max_rows=max((n for _, n in reqs), default=0))
        if self.prefill_stream is not None:
            c.streams.join_backup(self.prefill_stream)
        return stage_prefill(c.layer_view(layer), requests, dst, stream=self.prefill_stream,
                             validate=self.validate, kernels=c.kernels)



__all__ = ["PrefillStaging"]
