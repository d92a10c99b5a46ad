"""One forward of an engine's batch: what ``HiSparseIndexGroup.prepare_for_batch`` checked
and planned, and what its per-layer calls have done since.

``prepare_forward`` makes it: the batch's checks (every request live, holding its
context before the forward in every layer), the cache's step of every layer's write
(``HiSparseCache.prepare_step``: blocks allocated, lists built, padded to a bucket for
CUDA graphs), the decode tokens' request ids. A call that raises changes nothing.

``Forward`` then holds, for the group's per-layer calls: the metadata they must be given,
the token counts they take (the bucket's when padded), the step, the layers written,
each layer's one resolve of the forward (``Resolved``: how, with which top-k tensor, and
what a conversion handed out) and what is left to wait for (conversions with
``wait=False`` not yet waited on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from .._checks import check_bool, check_int, check_tensor, device_type
from ..cache.cache import HiSparseCache
from ..cache.write_step import StepCapacity, StepPlan
from ..config import HiSparseConfig
from .decode_ids import DecodeIds
from .metadata import SparseMLAMetadata

__all__ = ["Forward", "Resolved", "prepare_forward", "topk_key"]


def topk_key(t: torch.Tensor) -> tuple:
    """What identifies a top-k tensor between a layer's calls: its memory and layout."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class Resolved(NamedTuple):
    """A layer's resolve in a forward. ``how``: "converted" (physical int32 [Td, K] and
    counts int32 [Td] handed out), "attended" (``decode_attention``: no indices kept),
    "begun" (``begin_decode_attention``, attended by the next split ``decode_attention``)
    or "replayed" (a captured forward's replay resolved it). ``key``: the top-k tensor's
    ``topk_key`` (None for a replay)."""

    how: str
    key: tuple | None = None
    physical: torch.Tensor | None = None
    counts: torch.Tensor | None = None


@dataclasses.dataclass(eq=False)
class Forward:
    """One prepared forward (module docstring). ``tokens``: rows a layer's write takes;
    ``decode_tokens``: the decode tokens a layer's resolve takes (both the bucket's with
    ``pad_to``); ``decode_ids``: int32 [decode_tokens], each decode token's request id
    (-1 padding)."""

    metadata: SparseMLAMetadata
    step: StepPlan
    tokens: int
    decode_tokens: int
    decode_ids: torch.Tensor
    written: set[int] = dataclasses.field(default_factory=set)
    resolved: dict[int, Resolved] = dataclasses.field(default_factory=dict)
    begun: dict[int, tuple] = dataclasses.field(default_factory=dict)  # layer -> (DecodeLayer, SplitLaunch)
    # layers converted with wait=False and not waited for yet -> whether that conversion
    # ran inside a CUDA graph capture (its wait must run on the same side); the next
    # forward is refused while one is left
    unwaited: dict[int, bool] = dataclasses.field(default_factory=dict)

    def check_decode_topk(self, topk_indices: object, device: torch.device) -> None:
        """A decode top-k of this forward: int32 [decode_tokens, K] on ``device``."""
        td = self.decode_tokens
        t = check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2, device=device)
        if t.shape[0] != td:
            raise ValueError(f"topk_indices must be [num_decode_tokens={td}, K] (padded to the bucket with "
                             f"pad_to), got {list(t.shape)}")

    def written_before(self, layer: int, what: str) -> None:
        """ValueError when this forward's rows of ``layer`` are not written yet (decode
        tokens attend to their own rows)."""
        if self.decode_tokens and layer not in self.written:
            raise ValueError(f"layer {layer}: write_new_rows must run before {what}")


def prepare_forward(cache: HiSparseCache, config: HiSparseConfig, ids: DecodeIds, metadata: SparseMLAMetadata,
                    *, last: StepPlan | None, pad_to: int | None, replay: bool, device: torch.device) -> Forward:
    """The checks and the host work of a forward (``HiSparseIndexGroup.prepare_for_batch``
    documents them); ``last``: the last forward's step, whose unwritten layers are put
    back. Nothing changes when it raises."""
    cfg = config
    q = metadata.decode_max_query_len
    if metadata.num_decodes and q > cfg.max_query_len:
        raise ValueError(f"decode query length {q} exceeds the config's max_query_len={cfg.max_query_len}")
    td = metadata.num_decode_tokens
    capacity = None
    if check_bool("replay", replay) and pad_to is None:
        raise ValueError("replay=True needs pad_to (a graph is captured per batch-size bucket)")
    if pad_to is not None:
        check_int("pad_to", pad_to, 1, cfg.max_num_reqs + 1)
        if metadata.num_prefills:
            raise ValueError("pad_to is for decode-only batches (graph replay); this batch has "
                             f"{metadata.num_prefills} prefill requests")
        if pad_to < metadata.num_decodes:
            raise ValueError(f"pad_to={pad_to} is smaller than the batch's {metadata.num_decodes} decodes")
        q = max(q, 1)
        capacity = StepCapacity(requests=pad_to, tokens=pad_to * q)
    rids = metadata.request_ids_cpu
    # every row's query length (all the decode one in a decode-only batch)
    qlens = (metadata.decode_max_query_len,) * len(rids) if not metadata.num_prefills else metadata.query_lens()
    # the rows each request holds are checked first: where a later check fails, that
    # check runs then (nothing changed) and raises when it finds a request amiss
    try:
        write_batch = cache.plan_write(rids, qlens)
    except Exception as e:  # noqa: BLE001 -- reported after the length check
        failed: Exception | None = e
    else:
        failed = None
    if failed is not None:
        check_lengths(cache, metadata, qlens, last)
        raise failed
    if capacity is not None and device_type(device) == "cuda":
        # the persistent buffers are rewritten below: in-flight staging of the last
        # forward (which reads the decode ids) finishes first
        cache.streams.join_staging()
    # changes state last; puts back the layers the last forward did not write
    try:
        step = cache.prepare_step(write_batch, capacity=capacity, replaces=last, ends=metadata.seq_lens_cpu)
    except Exception as e:  # noqa: BLE001 -- reported after the length check
        failed = e
    if failed is not None:
        check_lengths(cache, metadata, qlens, last)
        raise failed
    ndt = capacity.tokens if capacity is not None else td
    decode_ids = (ids.of(metadata, ndt, padded=capacity is not None) if ndt
                  else torch.empty(0, dtype=torch.int32, device=device))
    fwd = Forward(metadata=metadata, step=step, tokens=capacity.tokens if capacity is not None else metadata.num_tokens,
                  decode_tokens=ndt, decode_ids=decode_ids)
    if replay:  # the graph's replay runs every layer's write and resolve
        cache.graphs.note_replay(tokens=ndt)
        step.pending.clear()
        fwd.written = set(range(cfg.num_layers))
        fwd.resolved = {i: Resolved("replayed") for i in range(cfg.num_layers)}
    return fwd


def check_lengths(cache: HiSparseCache, metadata: SparseMLAMetadata, qlens: Sequence[int],
                  step: StepPlan | None) -> None:
    """ValueError for the first batch row whose request is not live or holds other rows
    in some layer than ``seq_len - query_len`` (``qlens``: each row's query length),
    a layer ``step`` (the last forward's) did not write counted as before it."""
    ids = metadata.request_ids_cpu
    slots, same, len0 = cache.batch_lengths(ids, step)
    starts = np.array([s - q for s, q in zip(metadata.seq_lens_cpu, qlens)])
    dead = None in slots
    bad = ~same | (len0 != starts)
    if dead or bad.any():  # the first row that is not live or holds other lengths
        row = int((bad | np.array([s is None for s in slots], dtype=bool)).argmax())
        rid = ids[row]
        if slots[row] is None:
            raise ValueError(f"batch row {row}: request {rid} is not live (add_request first)")
        lens = list(cache.request(rid, step).lengths)
        raise ValueError(f"batch row {row}: request {rid} holds {lens} rows per layer but the "
                         f"metadata says its context before this forward is {metadata.context_start(row)} "
                         f"(seq_len {metadata.seq_lens_cpu[row]} - query_len {qlens[row]})")
