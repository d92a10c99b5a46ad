"""The engine façade: hisparse as the KV-cache manager of a sparse-MLA attention backend.

An inference engine's sparse-MLA backend talks to one :class:`HiSparseIndexGroup` per
model (the layers whose attention consumes top-k indexer results). The calls, in the
order an engine makes them (``docs/ENGINE.md`` walks through them):

  at start-up      group = HiSparseIndexGroup(config); i = group.register_layer(...)
                   per layer; group.cache(i).runtime.max_num_reqs etc. size the backend
  per request      group.add_request(req_id[, token_ids]) on admission, group.free_request(req_id)
                   when it finishes or is preempted
  per forward      group.prepare_for_batch(metadata)        (once: checks, write batch)
  per layer        group.write_new_rows(i, rows, metadata)       (this forward's KV rows)
    decode part    phys = group.convert_decode_logical_to_physical_topk(i, topk[:Td], ...)
                   backend.decode(q[:Td], group.physical_kv_cache(i), phys, ...)
    prefill part   ev = group.gather_fp8_prefill(i, kv_cache, workspace, block_table,
                   workspace_starts, num_reqs, metadata, req_start_idx); compute stream
                   waits on ev; backend.prefill(q[Td:], workspace, converted indices)
                   -- or group.stage_prefill_rows(i, staging, metadata) for kernels that
                   read the stored row format directly.

Semantics fixed here:
- Layer i of the group is layer i of one :class:`hisparse.HiSparseCache` (one host pool,
  per-layer hot buffers and LRU state); layers are registered in order.
- Each layer's decode indices are resolved exactly once per forward: resolving moves
  LRU state, so a second call for the same layer in the same forward returns the first
  result again (same top-k tensor required) instead of resolving twice.
- Decode tokens come first in the batch (see ``engine.metadata``); only they are
  resolved. Prefill requests read their context through a staged workspace.
- Ordering on CUDA: ``convert_decode...`` returns after the compute stream was made to
  wait for the miss staging (the cache does that), so the attention kernel launched next
  reads finished rows. ``gather_fp8_prefill`` stages on the group's prefill stream and
  returns the event; the caller makes its compute stream wait on it (so the staging can
  overlap the decode attention). ``stage_prefill_rows`` waits itself.
- Checked mode (``validate=True``, default) validates every call before launching
  (host syncs allowed); ``validate=False`` skips the device-reading checks for the hot
  loop. Host-side bookkeeping (request lengths per layer) is always checked: it costs
  no sync.
- A call either completes or raises before it changes anything (the cache's write
  path and resolve are atomic, and the group updates its own per-forward state only
  after they returned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from .._checks import check_bool, check_int, check_tensor, device_type
from ..cache.cache import HiSparseCache
from ..cache.stager import capturing
from ..cache.write_step import StepCapacity
from ..config import HiSparseConfig
from ..decode.layer import DecodeLayer, Overlap
from ..device import release_deferred_pins, resolve_device
from ..errors import CapacityError
from ..formats import D_ROW, RowFormat
from .decode_calls import DecodeAttentionCalls, topk_key
from .decode_ids import DecodeIds
from .layer_graphs import CudaGraphBackend, LayerGraphCalls, LayerGraphs
from .metadata import SparseMLAMetadata
from .pd_calls import PDCalls
from .prefill_calls import PrefillCalls

_REPLAYED = ("replayed",)  # the conversion key of layers a graph replay resolves


_KV_DTYPES = {"fp8_ds_mla": RowFormat.FP8_DS_MLA, "bf16": RowFormat.BF16, "auto": RowFormat.BF16,
              "bfloat16": RowFormat.BF16}


@dataclasses.dataclass(frozen=True)
class HotView:
    """What an attention backend needs to know about one layer's hot buffer.

    attention_cache: uint8 [device_rows_per_layer, row_bytes], the flat row view
    physical indices point into (``physical_kv_cache``): R * (S + 1) hot rows (rounded
    up to 64), then the elastic pool's pages when the config has ``device_pool_rows``.
    block_size = S + 1: viewed as blocks, block r is request slot r and a hot
    request's ``physical = r * block_size + slot`` (a resident request's rows lie in
    the pages past the hot buffers).
    """

    attention_cache: torch.Tensor
    block_size: int
    num_rows: int
    row_bytes: int


@dataclasses.dataclass(frozen=True)
class LayerRuntime:
    """``cache(i).runtime``: sizes and the hot view of layer ``layer``."""

    layer: int
    max_num_reqs: int
    top_k: int
    max_query_len: int
    row_format: RowFormat
    hot: HotView


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """The handle ``cache(i)`` returns for one registered layer."""

    layer_index: int
    head_size: int
    kv_cache_dtype: str
    runtime: LayerRuntime


def _row_format_of(config: HiSparseConfig) -> RowFormat:
    if config.row_bytes == RowFormat.FP8_DS_MLA.row_bytes:
        return RowFormat.FP8_DS_MLA
    if config.row_bytes == RowFormat.BF16.row_bytes:
        return RowFormat.BF16
    raise ValueError(f"an engine index group needs attention rows: row_bytes must be 656 "
                     f"(fp8_ds_mla) or 1152 (bf16), got {config.row_bytes}")


class HiSparseIndexGroup(PrefillCalls, LayerGraphCalls, DecodeAttentionCalls, PDCalls):
    """Per-layer hisparse caches behind the calls a sparse-MLA backend makes.

    ``config.num_layers`` is the number of layers that will be registered. ``kernels``
    is passed to :class:`hisparse.HiSparseCache` ("auto" | "torch" | "triton").
    ``layer_graphs`` (CUDA, Triton kernels, ``validate=False``): the per-layer calls of
    padded forwards replay one small CUDA graph per call, layer and bucket, for engines
    that run their decode forward eagerly (``hisparse.engine.layer_graphs``).
    """

    def __init__(self, config: HiSparseConfig, *, validate: bool = True, kernels: str = "auto",
                 layer_graphs: bool = False) -> None:
        if not isinstance(config, HiSparseConfig):
            raise TypeError(f"config must be a HiSparseConfig, got {type(config).__name__}")
        check_bool("layer_graphs", layer_graphs)
        self.config = config
        self.row_format = _row_format_of(config)
        self.validate = bool(validate)
        if layer_graphs:
            if self.validate:
                raise ValueError("layer_graphs=True needs validate=False (a checked call syncs with the host, "
                                 "which a graph can't hold)")
            if resolve_device(config.device).type != "cuda":
                raise ValueError(f"layer_graphs=True needs a CUDA device (CUDA graphs); config.device is "
                                 f"{config.device!r}")
            if kernels not in ("auto", "triton"):  # refused before the pool is allocated and pinned
                raise ValueError(f"layer_graphs=True needs the Triton kernels (kernels='triton' or 'auto'); "
                                 f"got {kernels!r}")
        self._cache = HiSparseCache(config, kernels=kernels)
        self.device = self._hot_rows(0).device
        self._layer_graphs: LayerGraphs | None = None
        if layer_graphs:
            if self._cache.kernels != "triton":
                raise ValueError(f"layer_graphs=True needs the Triton kernels (kernels='triton' or 'auto'); "
                                 f"got {self._cache.kernels!r}")
            self._layer_graphs = LayerGraphs(self._cache, CudaGraphBackend(self.device))
        self._layers: list[LayerCache] = []
        self._batch: SparseMLAMetadata | None = None
        self._decode_ids = torch.empty(0, dtype=torch.int32, device=self.device)
        self._converted: dict[int, tuple[tuple, object]] = {}
        self._begun: dict[int, tuple] = {}  # layer -> (DecodeLayer, SplitLaunch) of begin_decode_attention
        self._written: set[int] = set()
        # layers converted with wait=False and not waited for yet -> whether that
        # conversion ran inside a CUDA graph capture (its wait must run on the same side)
        self._unwaited: dict[int, bool] = {}
        self._step = None  # the forward's cache StepPlan (prepare_for_batch)
        self._tokens = 0  # tokens the per-layer calls take (the bucket's with pad_to)
        self._decode_tokens = 0  # decode tokens they resolve (padded likewise)
        self._ids = DecodeIds(self.device)  # the decode tokens' request ids, per forward
        self._decode_layers: dict[Overlap, DecodeLayer] = {}  # per mode, for the last backend object
        self.resolves_per_layer = [0] * config.num_layers  # lifetime count, for tests/metrics
        cuda = device_type(self.device) == "cuda"
        self.prefill_stream = torch.cuda.Stream(device=self.device) if cuda else None

    # ------------------------------------------------------------------ set-up
    @property
    def hisparse_cache(self):
        """The underlying :class:`hisparse.HiSparseCache` (stats, host reads)."""
        return self._cache

    @property
    def num_layers(self) -> int:
        """Layers registered so far."""
        return len(self._layers)

    def _hot_rows(self, layer: int) -> torch.Tensor:
        return self._cache.hot_rows(layer)

    def register_layer(self, *, head_size: int = D_ROW, kv_cache_dtype: str = "fp8_ds_mla") -> int:
        """Register the next layer; returns its index in the group (0, 1, ...).

        head_size: the MLA head size of the KV rows (576 = 512 latent + 64 RoPE).
        kv_cache_dtype: "fp8_ds_mla" or "bf16" ("auto"/"bfloat16" accepted); must match
        the config's row format.
        """
        if head_size != D_ROW:
            raise ValueError(f"head_size must be {D_ROW} (512 latent + 64 RoPE), got {head_size!r}")
        if kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV_DTYPES)}, got {kv_cache_dtype!r}")
        fmt = _KV_DTYPES[kv_cache_dtype]
        if fmt is not self.row_format:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs {fmt.row_bytes}-byte rows but the "
                             f"config has row_bytes={self.config.row_bytes} ({self.row_format.value})")
        i = len(self._layers)
        if i >= self.config.num_layers:
            raise ValueError(f"all {self.config.num_layers} layers of the config are registered already; "
                             "make the config with num_layers = the number of sparse-MLA layers")
        cfg = self.config
        hot = self._hot_rows(i)
        view = HotView(attention_cache=hot, block_size=cfg.slots_per_req, num_rows=hot.shape[0],
                       row_bytes=cfg.row_bytes)
        rt = LayerRuntime(layer=i, max_num_reqs=cfg.max_num_reqs, top_k=cfg.top_k,
                          max_query_len=cfg.max_query_len, row_format=self.row_format, hot=view)
        self._layers.append(LayerCache(layer_index=i, head_size=head_size, kv_cache_dtype=kv_cache_dtype,
                                       runtime=rt))
        return i

    def _layer(self, layer_index: object) -> int:
        check_int("layer_index", layer_index)
        if not 0 <= layer_index < len(self._layers):  # type: ignore[operator]
            raise ValueError(f"layer_index {layer_index} is not registered (have {len(self._layers)} layers)")
        return layer_index  # type: ignore[return-value]

    def cache(self, layer_index: int) -> LayerCache:
        return self._layers[self._layer(layer_index)]

    def physical_kv_cache(self, layer_index: int) -> torch.Tensor:
        """uint8 [R * (S + 1), row_bytes]: the rows decode attention reads for this layer."""
        return self._layers[self._layer(layer_index)].runtime.hot.attention_cache

    # ------------------------------------------------------------- requests
    def add_request(self, req_id: int, token_ids=None, salt: bytes | None = None) -> int:
        """Admit a request (CapacityError when every request slot is taken). Not while a
        forward is part-way through its layers' writes (see :meth:`free_request`).

        With prefix caching (``HiSparseConfig(prefix_caching=True)``) pass its prompt as
        ``token_ids``: the return value is how many leading tokens are cached already
        (a multiple of the host block size, at most ``len(token_ids) - 1``). Those
        positions count as written in every layer: compute and write only the tokens
        from there on. 0 without ``token_ids``. ``salt``: bytes keying whatever else
        changes the KV (model, LoRA adapter)."""
        self._refuse_mid_forward("add_request")
        return self._cache.add_request(req_id, token_ids, salt)

    def add_tokens(self, req_id: int, token_ids) -> int:
        """Prefix caching: the request's next tokens (sampled output, or the next turn's
        prompt when a conversation continues in the same request), so that the blocks
        they fill become findable once written in every layer; returns the tokens known."""
        return self._cache.add_tokens(req_id, token_ids)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block no live request uses; returns how many."""
        self._refuse_mid_forward("reset_prefix_cache")
        return self._cache.reset_prefix_cache()

    def free_request(self, req_id: int) -> None:
        """Release every block and slot of a finished or preempted request. Between
        forwards, or after ``prepare_for_batch`` before any ``write_new_rows`` (the
        prepared forward is then out of date: prepare it again); refused while a forward
        has written some layers but not all (those it wrote would hold a row more than
        the others, and the request could not be batched again). After a forward cut
        short, ``abandon_forward()`` first, then free the batch's requests."""
        self._refuse_mid_forward("free_request")
        self._cache.free_request(req_id)

    def _refuse_mid_forward(self, what: str) -> None:
        step = self._step
        if step is not None and step.pending and self._written and not step.stale:
            raise ValueError(f"{what} part-way through a forward: layers {sorted(self._written)} of it are "
                             f"written and {sorted(step.pending)} are not; write the remaining layers "
                             "first, or call abandon_forward() if the forward was cut short (then free "
                             "its requests: their written layers hold a row more than the others)")

    def has_request(self, req_id: int) -> bool:
        try:
            self._cache.request(req_id)
        except (ValueError, TypeError):
            return False
        return True

    def request_length(self, req_id: int, layer_index: int) -> int:
        """Rows stored for ``req_id`` in layer ``layer_index`` (this forward's rows count
        once the layer's ``write_new_rows`` ran)."""
        i = self._layer(layer_index)
        return self._visible_lengths(req_id)[i]  # checks the id

    def _visible_lengths(self, req_id: int) -> list[int]:
        """Rows per layer of a live request, a layer this forward has not written yet
        counted as before the forward."""
        return list(self._cache.request(req_id, self._step).lengths)

    def stats(self) -> dict:
        return self._cache.stats()

    # ------------------------------------------------------------ per batch
    def prepare_for_batch(self, metadata: SparseMLAMetadata, *, pad_to: int | None = None,
                          replay: bool = False) -> None:
        """Start a forward: check the batch and do the host work of every layer's write.

        Every request must be live and hold exactly ``seq_len - query_len`` rows in every
        layer (its context before this forward). The forward's blocks are allocated
        here (CapacityError, nothing changed, when the pool can't supply them) and every
        layer's lengths count the forward's rows from here on; a layer whose
        ``write_new_rows`` does not run in this forward is put back when the next
        forward is prepared. No host sync.

        ``pad_to`` (CUDA graphs): a decode-only batch padded to ``pad_to`` decode
        requests (a batch-size bucket). The per-layer calls then take ``pad_to *
        decode_query_len`` tokens (rows and top-k past the batch's are padding: top-k
        rows of -1, rows not read) and launch fixed shapes from persistent buffers of
        the bucket, so a forward captured once per bucket (``torch.cuda.graph`` around
        the per-layer calls, with unchecked backends and ``validate=False``) replays
        any later batch of the bucket after its ``prepare_for_batch(md, pad_to=...,
        replay=True)``. ``replay``: this forward's per-layer calls run as a replay of such
        a graph, not from Python: the group counts every layer as written and resolved
        (an eager per-layer call in the same forward is refused).
        """
        if not isinstance(metadata, SparseMLAMetadata):
            raise TypeError(f"metadata must be a SparseMLAMetadata, got {type(metadata).__name__}")
        release_deferred_pins()  # host pools freed during a capture: their page-locks go now
        if self._unwaited:
            raise ValueError(f"layer(s) {sorted(self._unwaited)} of the last forward were converted with "
                             "wait=False and never passed to wait_for_staging(): their attention may have "
                             "read rows before they landed. Call wait_for_staging(layer) on the stream "
                             "that reads the rows, before it reads them")
        if len(self._layers) != self.config.num_layers:
            raise ValueError(f"{len(self._layers)} of {self.config.num_layers} layers registered; "
                             "register every layer before the first forward")
        if metadata.device != self.device:
            raise ValueError(f"metadata tensors are on {metadata.device}, the cache on {self.device}")
        cfg = self.config
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
        cache = self._cache
        ids = metadata.request_ids_cpu
        # every row's query length (all the decode one in a decode-only batch)
        qlens = (metadata.decode_max_query_len,) * len(ids) if not metadata.num_prefills else metadata.query_lens()
        # the rows each request holds are checked first: where a later check fails, that
        # check runs then (nothing changed) and raises when it finds a request amiss
        try:
            write_batch = cache.plan_write(ids, qlens)
        except Exception as e:  # noqa: BLE001 -- reported after the length check
            failed: Exception | None = e
        else:
            failed = None
        if failed is not None:
            self._check_lengths(metadata, qlens)
            raise failed
        if capacity is not None and device_type(self.device) == "cuda":
            # the persistent buffers are rewritten below: in-flight staging of the last
            # forward (which reads the decode ids) finishes first
            cache.streams.join_staging()
        # changes state last; puts back the layers the last forward did not write
        try:
            step = cache.prepare_step(write_batch, capacity=capacity, replaces=self._step,
                                      ends=metadata.seq_lens_cpu)
        except Exception as e:  # noqa: BLE001 -- reported after the length check
            failed = e
        if failed is not None:
            self._check_lengths(metadata, qlens)
            raise failed
        # ---- the forward's state ----
        self._tokens = capacity.tokens if capacity is not None else metadata.num_tokens
        ndt = capacity.tokens if capacity is not None else td
        if ndt:
            self._decode_ids = self._ids.of(metadata, ndt, padded=capacity is not None)
        else:
            self._decode_ids = torch.empty(0, dtype=torch.int32, device=self.device)
        self._decode_tokens = ndt
        self._batch = metadata
        self._step = step
        self._converted = {}
        self._begun = {}
        self._written = set()  # layers whose rows this forward wrote
        if replay:  # the graph's replay runs every layer's write and resolve
            cache.graphs.note_replay(tokens=ndt)
            step.pending.clear()
            self._written = set(range(cfg.num_layers))
            for i in range(cfg.num_layers):
                self._converted[i] = (_REPLAYED, (None, None))
                self.resolves_per_layer[i] += 1 if ndt else 0

    def _check_lengths(self, metadata: SparseMLAMetadata, qlens: Sequence[int]) -> None:
        """ValueError for the first batch row whose request is not live or holds other rows
        in some layer than ``seq_len - query_len`` (``qlens``: each row's query length),
        a layer the last forward did not write counted as before it."""
        ids = metadata.request_ids_cpu
        slots, same, len0 = self._cache.batch_lengths(ids, self._step)
        starts = np.array([s - q for s, q in zip(metadata.seq_lens_cpu, qlens)])
        dead = None in slots
        bad = ~same | (len0 != starts)
        if dead or bad.any():  # the first row that is not live or holds other lengths
            row = int((bad | np.array([s is None for s in slots], dtype=bool)).argmax())
            rid = ids[row]
            if slots[row] is None:
                raise ValueError(f"batch row {row}: request {rid} is not live (add_request first)")
            lens = self._visible_lengths(rid)
            raise ValueError(f"batch row {row}: request {rid} holds {lens} rows per layer but the "
                             f"metadata says its context before this forward is {metadata.context_start(row)} "
                             f"(seq_len {metadata.seq_lens_cpu[row]} - query_len {qlens[row]})")

    def abandon_forward(self) -> None:
        """The forward prepared last will not run to its end: put back every layer it did
        not write, including those whose calls were captured in a graph. Call it when a
        capture raised (a captured forward that is replayed must not be abandoned), or
        when an error cut the forward short; in the latter case the requests whose rows
        it wrote in some layers hold a row more there than in the others, and can only
        be freed."""
        if self._step is not None:
            self._step.abandon(captured=True)
        self._batch = None
        self._written = set()
        self._converted = {}
        self._begun = {}
        self._unwaited = {}

    def _check_batch(self, metadata: object) -> SparseMLAMetadata:
        if self._batch is None or metadata is not self._batch:
            raise ValueError("metadata is not the batch given to the last prepare_for_batch(); "
                             "call prepare_for_batch(metadata) once per forward first")
        return self._batch

    def write_new_rows(self, layer_index: int, rows: torch.Tensor, metadata: SparseMLAMetadata) -> None:
        """Append this forward's KV rows of layer ``layer_index`` (every token, batch order).

        rows: uint8 [T, row_bytes] (a bf16 [T, 576] tensor is accepted for bf16 rows), on
        the cache device; T = the batch's tokens, or the bucket's with ``pad_to`` (rows
        past the batch's are not read). Token t's row becomes position
        ``context_start + offset`` of its request. Call before attention of that layer
        (a token attends to itself). Launches two kernels and nothing else.
        """
        i = self._layer(layer_index)
        self._check_batch(metadata)
        rows = self._as_row_bytes(rows, self._tokens, "rows")
        if i in self._written:
            raise ValueError(f"layer {i}: this forward's rows were already written (or are, by a graph "
                             "replay)")
        if self._step.pending:
            lg = self._layer_graphs
            if lg is not None and lg.applies(self._step):
                lg.write(i, self._step, rows)
            else:
                self._cache.write_step(i, self._step, rows)  # a launch that raises leaves it pending
        self._written.add(i)

    def _as_row_bytes(self, rows: object, n: int, name: str) -> torch.Tensor:
        """uint8 [n, row_bytes] (bf16 [n, 576] accepted for bf16 rows; any strides)."""
        rb = self.config.row_bytes
        check_tensor(name, rows, ndim=2, device=self.device)
        if rows.dtype != torch.uint8:  # type: ignore[union-attr]
            if rows.dtype == torch.bfloat16 and self.row_format is RowFormat.BF16:  # type: ignore[union-attr]
                if rows.shape[1] != D_ROW:  # type: ignore[union-attr]
                    raise ValueError(f"{name} as bf16 must be [T, {D_ROW}], got {tuple(rows.shape)}")  # type: ignore[union-attr]
                rows = rows.contiguous().view(torch.uint8)  # type: ignore[union-attr]
            check_tensor(name, rows, dtype=torch.uint8)
        if tuple(rows.shape) != (n, rb):  # type: ignore[union-attr]
            raise ValueError(f"{name} must be [T={n}, {rb}] (one row per token of the batch), got "
                             f"{list(rows.shape)}")  # type: ignore[union-attr]
        return rows  # type: ignore[return-value]

    # ---------------------------------------------------------------- decode
    def convert_decode_logical_to_physical_topk(
        self,
        layer_index: int,
        topk_indices: torch.Tensor,  # int32 [Td, K], request-local positions, -1 = padding
        metadata: SparseMLAMetadata,
        *,
        return_valid_counts: bool = False,
        num_decodes: int | None = None,
        decode_query_len: int | None = None,
        wait: bool = True,
    ):
        """Resolve the decode tokens' logical top-k into rows of ``physical_kv_cache(i)``.

        Returns physical int32 [Td, K] (-1 kept for padding), plus valid counts int32
        [Td] when ``return_valid_counts``. Misses are staged from host before the
        compute stream can run the next kernel, or with ``wait=False`` on the side
        stream while the compute stream goes on (e.g. with the layer's q projection):
        then call :meth:`wait_for_staging` before anything reads the rows or the
        returned indices (the resolve writes those on the side stream too) and before
        ``topk_indices`` is overwritten (the side stream reads it); the next
        ``prepare_for_batch`` refuses to start while a layer was not waited for. A
        second call for the same layer in the same forward returns the first result
        (same top-k tensor required; with ``wait`` it waits).
        """
        check_bool("wait", wait)
        i = self._layer(layer_index)
        md = self._check_batch(metadata)
        nd = md.num_decodes if num_decodes is None else num_decodes
        q = md.decode_max_query_len if decode_query_len is None else decode_query_len
        if nd != md.num_decodes or (nd and q != md.decode_max_query_len):
            raise ValueError(f"num_decodes={nd}, decode_query_len={q} disagree with the batch "
                             f"({md.num_decodes} decodes of {md.decode_max_query_len} tokens)")
        td = self._decode_tokens
        self._check_decode_topk(topk_indices)
        shape = tuple(topk_indices.shape)
        if shape[1] > self.config.top_k:
            raise ValueError(f"topk_indices has K={shape[1]} > config top_k={self.config.top_k}")
        key = topk_key(topk_indices)
        done = self._converted.get(i)
        if done is not None:
            if done[0] is _REPLAYED:
                raise ValueError(f"layer {i} is resolved by the graph replay of this forward")
            if done[0] != key:
                raise ValueError(f"layer {i} was already converted in this forward with another top-k "
                                 "tensor; each layer is resolved once per forward")
            phys, counts = done[1]
            if phys is None:  # decode_attention keeps no indices to hand out
                how = ("begun by begin_decode_attention: attend it with decode_attention(..., overlap='split')"
                       if i in self._begun else "resolved by decode_attention, which returns no indices")
                raise ValueError(f"layer {i} was {how} in this forward")
        else:
            if nd and i not in self._written:  # this forward's rows of layer i are not in yet
                raise ValueError(f"layer {i}: write_new_rows must run before the conversion (the "
                                 "decode tokens attend to their own rows)")
            if td:
                lg = self._layer_graphs
                if lg is not None and wait and lg.applies(self._step):
                    res = lg.convert(i, self._decode_ids, topk_indices)
                    phys, counts = res.physical, res.valid_counts
                else:
                    if not wait:
                        self._refuse_input_buffer(topk_indices, "a conversion with wait=False")
                    phys, counts = self._resolve_decode(i, topk_indices, wait)
                self.resolves_per_layer[i] += 1
                if not wait:
                    self._unwaited[i] = self._capturing()
            else:
                phys = torch.empty((0, topk_indices.shape[1]), dtype=torch.int32, device=self.device)
                counts = torch.empty((0,), dtype=torch.int32, device=self.device)
            self._converted[i] = (key, (phys, counts))
        if wait and i in self._unwaited:
            self.wait_for_staging(i)
        return (phys, counts) if return_valid_counts else phys

    def wait_for_staging(self, layer_index: int, stream=None) -> None:
        """``stream`` (default: the current one) waits until the misses of the layer's
        conversion with ``wait=False`` landed in its hot rows (an event wait, no host
        sync; captured along inside a CUDA graph). A no-op after a waiting conversion."""
        i = self._layer(layer_index)
        if i not in self._converted:
            raise ValueError(f"layer {i} was not converted in this forward: nothing to wait for")
        if i in self._unwaited:
            if self._unwaited[i] != self._capturing():
                where = ("inside a CUDA graph capture", "outside it") if self._unwaited[i] else \
                        ("outside a CUDA graph capture", "inside one")
                raise ValueError(f"layer {i} was converted {where[0]} and is waited for {where[1]}: a "
                                 "stream cannot wait across a capture boundary; wait on the same side")
            self._cache.streams.wait_staging(i, stream)
            del self._unwaited[i]

    def _capturing(self) -> bool:
        return capturing(self.device)

    def _resolve_decode(self, layer: int, topk: torch.Tensor, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve decode top-k through the cache.

        Lengths are per layer in the cache, and ``write_new_rows`` of this layer ran
        first, so a token's own position and the other new positions of this forward
        (multi-token decode) resolve like any other row: positions < S are hot in slot
        == position, the newest row is hot in the reserved slot S, and new positions
        >= S other than the newest are staged from the host mirror.
        """
        res = self._cache.resolve(layer, self._decode_ids, topk, validate=self.validate, wait=wait)
        return res.physical, res.valid_counts


__all__ = ["HiSparseIndexGroup", "SparseMLAMetadata", "LayerCache", "LayerRuntime", "HotView",
           "CapacityError"]
