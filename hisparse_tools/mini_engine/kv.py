"""The mini engine's two KV stores behind one interface, and the batch they serve.

:class:`KVStore` is what the engine loop calls, per forward and per layer:

  begin(batch)                          once per forward, before layer 0
  prepare_padded(batch, n, replay=) / begin_padded(batch, static)
                                        the same for a decode-only step padded to bucket
                                        n (``.graphs``): host work outside a captured
                                        graph, device work (static shapes) inside it
  write(layer, rows, batch)             the forward's new rows (every token) of a layer
  stage_decode(layer, topk, batch) -> staged
                                        start getting the decode tokens' top-k rows ready
                                        (the lookup; hisparse, serial: the resolve and the
                                        misses' copy, which a captured forward leaves on the
                                        side stream), before the loop computes the query
  decode_attention(layer, q, topk, batch, staged) -> bf16 [Td, H, D_LATENT]
                                        sparse attention of the decode tokens over their
                                        top-k rows (after the staging landed)
  prefill_attention(layer, q, idx, batch) -> bf16 [Tp, H, D_LATENT]
                                        gather the prefill requests' rows into the bf16
                                        workspace, then attention over ``idx``
  admit(req) -> cached / release / fill / stats
                                        request lifecycle (admit: the leading prompt tokens
                                        whose KV the store holds already, 0 but with
                                        prefix reuse), synthetic context, counters
  layer_graphs()                        hisparse with layer_graphs: the per-layer graphs' counts

The attention calls take the query and the top-k and return the attention output, so
a store decides how rows reach the kernel: the resident store reads its own paged rows;
the hisparse store resolves the top-k into hot-buffer slots (staging misses) first.
Decode takes two calls, ``stage_decode`` as soon as the top-k exists and
``decode_attention`` once the loop computed the query, so that a store's staging can
overlap the query projection (in captured forwards: the serial conversion, or a split
layer's resolve); the rest of the overlap modes (split's hit attention beside the copy,
prefetch) lives inside the store's calls without the loop knowing.
Both stores share one :class:`Attention` (the backends, softmax scale, workspace).

- :class:`ResidentKV`  an ordinary paged device KV cache holding every row (the
  baseline); decode reads it through a block table (``convert_topk_to_physical``).
- :class:`HiSparseKV`  ``hisparse.engine.HiSparseIndexGroup``: rows in the host pool, a
  hot buffer smaller than the contexts; decode reads the hot buffer through the
  resolved physical indices, prefill through ``gather_fp8_prefill``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch

from hisparse.attention import SparseMLABackend
from hisparse.cache import expand_runs
from hisparse.staging import BlockTable, convert_topk_to_physical
from hisparse.config import DEVICE_PAGE_ROWS, RowFormat, ceil_div
from hisparse.decode import Overlap
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.formats import dequantize_fp8_ds_mla
from .config import MiniEngineConfig, Request

if TYPE_CHECKING:
    from .graphs import StaticInputs


@dataclasses.dataclass
class Batch:
    """One forward: the scheduled requests and the tensors every layer reuses."""

    items: list[tuple[Request, int]]  # (request, tokens this step), decodes first
    md: SparseMLAMetadata
    dec_slots: torch.Tensor  # int32 [Td] engine slot per decode token
    ws_starts: torch.Tensor  # int32 [P] workspace start of each prefill request
    ws_starts_cpu: list[int]
    ws_rows: int  # workspace rows the prefill requests use


@dataclasses.dataclass(frozen=True)
class Attention:
    """What both stores attend with: the backends and the prefill workspace."""

    decode: SparseMLABackend  # reads rows of ``row_format`` through physical indices
    prefill: SparseMLABackend  # reads the bf16 workspace
    sm_scale: float
    row_format: RowFormat
    workspace: torch.Tensor  # bf16 [slots * max_context, D_ROW]


class KVStore:
    """The interface the engine loop calls (see the module docstring)."""

    name = "base"

    def __init__(self, attn: Attention) -> None:
        self.attn = attn

    def admit(self, req: Request) -> int:
        """Take ``req`` (its slot set); returns how many leading prompt tokens' KV rows the
        store holds already (hisparse with ``prefix_reuse``; else 0): the engine computes
        from there."""
        raise NotImplementedError

    def release(self, req: Request) -> None:
        raise NotImplementedError

    def begin(self, batch: Batch) -> None:
        """Per-forward set-up, before the first layer."""

    def prepare_padded(self, batch: Batch, n: int, *, replay: bool) -> None:
        """Host work of a decode-only step padded to bucket ``n`` (outside a graph);
        ``replay``: the step's forward runs as a replay of the bucket's graph."""

    def begin_padded(self, batch: Batch, st: "StaticInputs") -> None:
        """Device work before layer 0 of a padded decode step, from the bucket's static
        inputs only (captured with the forward)."""

    def abandon_forward(self) -> None:
        """The prepared forward's capture failed: undo its host bookkeeping."""

    def graph_variant(self, batch: Batch) -> object:
        """Which kind of decode graph decode-only ``batch`` (prepared next) captures or
        replays: a store whose calls take another path in some states (hisparse's
        resident resolve) keeps a graph per variant. None: one kind."""
        return None

    def capture_variant(self, variant: object):
        """The context a decode graph of ``variant`` is captured in."""
        return contextlib.nullcontext()

    def variant_holds(self, variant: object) -> bool:
        """Whether a graph of ``variant`` still serves the step just prepared."""
        return True

    def write(self, layer: int, rows: torch.Tensor, batch: Batch) -> None:
        """rows: uint8 [T, row_bytes], the forward's tokens in batch order."""
        raise NotImplementedError

    def decode_rows(self, layer: int, topk: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """topk: int32 [Td, K] logical, -1 = padding -> (rows uint8 [N, row_bytes], the rows
        the decode kernel reads; physical int32 [Td, K], -1 = padding). The hisparse
        store's result may still be staging inside a captured forward: only
        ``decode_attention``, which waits first, may read it."""
        raise NotImplementedError

    def stage_decode(self, layer: int, topk: torch.Tensor, batch: Batch):
        """topk int32 [Td, K] -> what :meth:`decode_attention` takes as ``staged``: here
        ``decode_rows``' (rows, physical)."""
        return self.decode_rows(layer, topk, batch)

    def decode_attention(self, layer: int, q: torch.Tensor, topk: torch.Tensor, batch: Batch,
                         staged) -> torch.Tensor:
        """q bf16 [Td, H, D_ROW], topk int32 [Td, K], ``staged`` from :meth:`stage_decode`
        (same layer and top-k) -> bf16 [Td, H, D_LATENT]."""
        rows, phys = staged
        a = self.attn
        return a.decode.decode(q, rows, phys, sm_scale=a.sm_scale, row_format=a.row_format)[0]

    def prefill_workspace(self, layer: int, batch: Batch) -> None:
        """Write each prefill request's rows 0 .. done + n as bf16 into the workspace at
        its ``ws_starts`` offset."""
        raise NotImplementedError

    def prefill_attention(self, layer: int, q: torch.Tensor, idx: torch.Tensor, batch: Batch) -> torch.Tensor:
        """q bf16 [Tp, H, D_ROW], idx int32 [Tp, K] workspace rows (-1 = padding) ->
        bf16 [Tp, H, D_LATENT]."""
        self.prefill_workspace(layer, batch)
        a = self.attn
        return a.prefill.prefill(q, a.workspace[:batch.ws_rows], idx, sm_scale=a.sm_scale)[0]

    def fill(self, req: Request, layer: int, rows: torch.Tensor) -> None:
        """Write rows 0 .. n-1 of a request straight in (synthetic context), uint8 [n, row_bytes]."""
        raise NotImplementedError

    def stats(self) -> dict:
        return {}

    def layer_graphs(self) -> dict | None:
        """The per-layer graphs' counts (``HiSparseIndexGroup.layer_graphs``), or None."""
        return None


class ResidentKV(KVStore):
    """An ordinary paged device KV cache holding every row (the baseline)."""

    name = "resident"

    def __init__(self, cfg: MiniEngineConfig, slots: int, device: torch.device, attn: Attention) -> None:
        super().__init__(attn)
        self.bs = cfg.host_block_size
        self.max_blocks = ceil_div(cfg.max_context, self.bs)
        nblocks = slots * self.max_blocks
        self.fmt = cfg.row_format
        # one more block: the scratch slot's (row ``slots`` of the block table), which the
        # padding tokens of a bucketed decode step write to and nothing reads
        self.rows = torch.zeros(cfg.num_layers, (nblocks + 1) * self.bs, self.fmt.row_bytes, dtype=torch.uint8,
                                device=device)
        self.free = list(range(nblocks - 1, -1, -1))
        self.block_table = torch.full((slots + 1, self.max_blocks), -1, dtype=torch.int32, device=device)
        self.block_table[slots, 0] = nblocks
        self.owned: dict[int, list[int]] = {}
        self.device = device
        self.validate = cfg.validate

    def admit(self, req: Request) -> int:
        n = ceil_div(req.total, self.bs)
        blocks = [self.free.pop() for _ in range(n)]
        self.owned[req.rid] = blocks
        self.block_table[req.slot].fill_(-1)
        self.block_table[req.slot, :n] = torch.tensor(blocks, dtype=torch.int32, device=self.device)
        return 0

    def release(self, req: Request) -> None:
        self.free.extend(self.owned.pop(req.rid))

    def _rows_of(self, spans: list[tuple[Request, int, int]]) -> torch.Tensor:
        """int64 [n] device: global rows of positions [p0, p1) of each (request, p0, p1), concatenated."""
        pos = expand_runs([(p0, p1 - p0, 1) for _, p0, p1 in spans])
        slot = expand_runs([(r.slot, p1 - p0, 0) for r, p0, p1 in spans])
        both = torch.stack([pos, slot]).to(self.device)
        pos, slot = both[0], both[1]
        return self.block_table[slot, pos // self.bs].long() * self.bs + pos % self.bs

    def begin(self, batch: Batch) -> None:
        self._dst = self._rows_of([(r, r.done, r.done + n) for r, n in batch.items])
        pre = batch.items[batch.md.num_decodes:]
        self._ws_src = self._rows_of([(r, 0, r.done + n) for r, n in pre])

    def begin_padded(self, batch: Batch, st: "StaticInputs") -> None:
        self._dst = self.block_table[st.slot, st.pos // self.bs].long() * self.bs + st.pos % self.bs

    def write(self, layer: int, rows: torch.Tensor, batch: Batch) -> None:
        self.rows[layer].index_copy_(0, self._dst, rows)

    def decode_rows(self, layer: int, topk: torch.Tensor, batch: Batch):
        phys = convert_topk_to_physical(topk, batch.dec_slots, BlockTable(self.block_table, self.bs),
                                        validate=self.validate).physical
        return self.rows[layer], phys

    def prefill_workspace(self, layer: int, batch: Batch) -> None:
        ws = self.attn.workspace
        rows = self.rows[layer].index_select(0, self._ws_src)
        n = rows.shape[0]
        if self.fmt is RowFormat.FP8_DS_MLA:
            ws[:n] = dequantize_fp8_ds_mla(rows)
        else:
            ws[:n] = rows.view(torch.bfloat16)

    def fill(self, req: Request, layer: int, rows: torch.Tensor) -> None:
        self.rows[layer].index_copy_(0, self._rows_of([(req, 0, rows.shape[0])]), rows)


class HiSparseKV(KVStore):
    """The same calls served by a :class:`hisparse.engine.HiSparseIndexGroup`."""

    name = "hisparse"

    def __init__(self, cfg: MiniEngineConfig, slots: int, device: torch.device, attn: Attention) -> None:
        super().__init__(attn)
        self.group = HiSparseIndexGroup(cfg.cache_config(), validate=cfg.validate, kernels=cfg.cache_kernels,
                                        layer_graphs=cfg.layer_graphs)
        for _ in range(cfg.num_layers):
            self.group.register_layer(kv_cache_dtype=cfg.row_format.value)
        self.device = device
        self.overlap = cfg.overlap
        self.cfg = cfg
        # requests by their tier when they finished (the elastic tier: resident, or hot
        # after a demotion; host bookkeeping only, no sync): a run whose requests all
        # finish together says here how many stayed resident to the end
        self.finished = {"resident": 0, "hot": 0}

    def stage_decode(self, layer: int, topk: torch.Tensor, batch: Batch):
        """Serial: the conversion; split: the split layer's resolve
        (``begin_decode_attention``). Either way the misses stage while the loop
        computes q."""
        if self.overlap is Overlap.SERIAL:
            return self.decode_rows(layer, topk, batch)
        self.group.begin_decode_attention(layer, topk, batch.md, backend=self.attn.decode,
                                          num_heads=self.cfg.num_heads)
        return None

    def decode_attention(self, layer: int, q: torch.Tensor, topk: torch.Tensor, batch: Batch,
                         staged) -> torch.Tensor:
        """Serial: wait for the conversion's staging if it was deferred, then attend;
        split: ``HiSparseIndexGroup.decode_attention`` (the hits attended while the misses
        stage). With prefetch, this layer's top-k is then staged into the next layer
        (:meth:`prefetch_targets`) while the rest of this layer computes."""
        if self.overlap is Overlap.SERIAL:
            self.group.wait_for_staging(layer)  # a no-op after a waiting conversion
            out = super().decode_attention(layer, q, topk, batch, staged)
        else:
            a = self.attn
            out = self.group.decode_attention(layer, q, topk, batch.md, backend=a.decode, sm_scale=a.sm_scale,
                                              overlap=self.overlap)[0]
        if self.prefetch_targets(layer):
            self.group.prefetch(layer + 1, topk, batch.md)
        return out

    def prefetch_targets(self, layer: int) -> bool:
        """Whether this layer's top-k is staged into layer + 1 (``cfg.prefetches_into``)."""
        return self.cfg.prefetches_into(layer + 1)

    def admit(self, req: Request) -> int:
        """With ``prefix_reuse`` the prompt's token ids go along: the cache maps the
        longest cached run of its whole blocks (``hisparse.cache.prefix``)."""
        if not self.cfg.prefix_reuse:
            self.group.add_request(req.rid)
            return 0
        return self.group.add_request(req.rid, token_ids=req.tokens[:req.prompt_len].tolist())

    def release(self, req: Request) -> None:
        self.finished[self.group.hisparse_cache.residency(req.rid)] += 1
        self.group.free_request(req.rid)

    def begin(self, batch: Batch) -> None:
        self.group.prepare_for_batch(batch.md)

    def prepare_padded(self, batch: Batch, n: int, *, replay: bool) -> None:
        """``prepare_for_batch(md, pad_to=n, replay=replay)``: the group's capturable
        decode contract (all host work of the step here; the per-layer calls then launch
        bucket shapes, or run as the replay of the bucket's graph)."""
        self.group.prepare_for_batch(batch.md, pad_to=n, replay=replay)

    def abandon_forward(self) -> None:
        self.group.abandon_forward()

    def graph_variant(self, batch: Batch) -> bool:
        """Whether every live request is resident (the elastic tier) and stays so through
        ``batch``'s writes (the pool has a free page for each page boundary they may
        cross, so none demotes a request): the conversions then take the cache's resident
        path, and a graph captured so is replayed only then (``variant_holds`` checks
        it after the step's host work)."""
        c = self.group.hisparse_cache
        md = batch.md
        need = md.num_decodes * -(-md.decode_max_query_len // DEVICE_PAGE_ROWS)
        return c.graphs.all_resident() and c.pool_usage().pages_free >= need

    def capture_variant(self, variant: object):
        return self.group.hisparse_cache.graphs.resident_capture() if variant else contextlib.nullcontext()

    def variant_holds(self, variant: object) -> bool:
        return not variant or self.group.hisparse_cache.graphs.all_resident()

    def write(self, layer: int, rows: torch.Tensor, batch: Batch) -> None:
        self.group.write_new_rows(layer, rows, batch.md)

    def decode_rows(self, layer: int, topk: torch.Tensor, batch: Batch):
        """The conversion. Inside a captured forward (``--graphs``) with ``wait=False``:
        the misses stage while the loop computes the query, and ``decode_attention``
        waits for them. Otherwise it waits (on the stream, not the host): eager steps
        measured slower with the deferred wait (BENCHMARKS.md, "Measured slower and removed"), and with
        layer graphs a waiting conversion is the one that replays the layer's graph."""
        deferred = torch.device(self.device).type == "cuda" and torch.cuda.is_current_stream_capturing()
        phys = self.group.convert_decode_logical_to_physical_topk(layer, topk, batch.md, return_valid_counts=False,
                                                                  wait=not deferred)
        return self.group.physical_kv_cache(layer), phys

    def prefill_workspace(self, layer: int, batch: Batch) -> None:
        md = batch.md
        ev = self.group.gather_fp8_prefill(layer, None, self.attn.workspace, None, batch.ws_starts,
                                           md.num_prefills, md, 0)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def fill(self, req: Request, layer: int, rows: torch.Tensor) -> None:
        # a write-only forward of n prompt tokens (no attention): the façade's write path
        n = rows.shape[0]
        if layer == 0:
            self._fill_md = SparseMLAMetadata.build(request_ids=[req.rid], query_lens=[n], seq_lens=[n],
                                                    num_decodes=0, device=self.device)
            self.group.prepare_for_batch(self._fill_md)
        self.group.write_new_rows(layer, rows, self._fill_md)

    def stats(self) -> dict:
        s = self.group.stats()
        s["total"].update(finished_resident=self.finished["resident"], finished_hot=self.finished["hot"])
        return s

    def layer_graphs(self) -> dict | None:
        return self.group.layer_graphs()


KV_STORES = {"resident": ResidentKV, "hisparse": HiSparseKV}

__all__ = ["Batch", "Attention", "KVStore", "ResidentKV", "HiSparseKV", "KV_STORES"]
