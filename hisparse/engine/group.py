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

import torch

from .._checks import Kernels, check_bool, check_int, check_tensor, device_type
from ..cache.cache import HiSparseCache
from ..device import capturing
from ..config import HiSparseConfig
from ..decode.layer import Overlap
from ..device import release_deferred_pins, resolve_device
from ..errors import CapacityError
from ..formats import D_ROW, RowFormat
from .decode_calls import DecodeAttention
from .decode_ids import DecodeIds
from .forward import Forward, Resolved, prepare_forward, topk_key
from .handles import KV_DTYPES, HotView, LayerCache, LayerRuntime, row_format_of
from .layer_graphs import CudaGraphBackend, LayerGraphs
from .metadata import SparseMLAMetadata
from .pd_calls import PDCalls, PDConnector
from .prefill_calls import PrefillStaging


class HiSparseIndexGroup:
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
        self.row_format = row_format_of(config)
        self.validate = bool(validate)
        if layer_graphs:
            if self.validate:
                raise ValueError("layer_graphs=True needs validate=False (a checked call syncs with the host, "
                                 "which a graph can't hold)")
            if Kernels.parse(kernels) is Kernels.TORCH:  # refused before the pool is allocated and pinned
                raise ValueError(f"layer_graphs=True needs the Triton kernels (kernels='triton' or 'auto'); "
                                 f"got {kernels!r}")
            if resolve_device(config.device).type != "cuda":
                raise ValueError(f"layer_graphs=True needs a CUDA device (CUDA graphs); config.device is "
                                 f"{config.device!r}")
        self._cache = HiSparseCache(config, kernels=kernels)
        self.device = self._hot_rows(0).device
        self._layer_graphs: LayerGraphs | None = None
        if layer_graphs:
            if self._cache.kernels != "triton":
                raise ValueError(f"layer_graphs=True needs the Triton kernels (kernels='triton' or 'auto'); "
                                 f"got {self._cache.kernels!r}")
            self._layer_graphs = LayerGraphs(self._cache, CudaGraphBackend(self.device))
        self._layers: list[LayerCache] = []
        self._fwd: Forward | None = None  # the forward prepared last (None once abandoned)
        self._step = None  # its cache StepPlan, kept after an abandon (the next forward's replaces=)
        self._ids = DecodeIds(self.device)  # the decode tokens' request ids, per forward
        self.resolves_per_layer = [0] * config.num_layers  # lifetime count, for tests/metrics
        cuda = device_type(self.device) == "cuda"
        self.prefill_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self._decode = DecodeAttention(self._cache, validate=self.validate, resolves_per_layer=self.resolves_per_layer,
                                       refuse_input=self._refuse_input_buffer)
        self._prefill = PrefillStaging(self._cache, validate=self.validate, prefill_stream=self.prefill_stream)
        self._pd = PDCalls(self._cache, self._refuse_mid_forward)

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
        if kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_DTYPES)}, got {kv_cache_dtype!r}")
        fmt = KV_DTYPES[kv_cache_dtype]
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
        i = check_int("layer_index", layer_index)
        if not 0 <= i < len(self._layers):
            raise ValueError(f"layer_index {i} is not registered (have {len(self._layers)} layers)")
        return i

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
        fwd = self._fwd
        step = self._step
        if fwd is not None and step.pending and fwd.written and not step.stale:
            raise ValueError(f"{what} part-way through a forward: layers {sorted(fwd.written)} of it are "
                             f"written and {sorted(step.pending)} are not; write the remaining layers "
                             "first, or call abandon_forward() if the forward was cut short (then free "
                             "its requests: their written layers hold a row more than the others)")

    def has_request(self, req_id: int) -> bool:
        return self._cache.requests.is_live(req_id)  # a dict lookup: any id that hashes as a live one (numpy ints too)

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
                          replay: bool = False) -> Forward:
        """Start a forward: check the batch and do the host work of every layer's write;
        returns the forward (``engine.forward.Forward``: its sizes, step and what its
        per-layer calls have done; the per-layer calls take its metadata).

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
        unwaited = {} if self._fwd is None else self._fwd.unwaited
        if unwaited:
            raise ValueError(f"layer(s) {sorted(unwaited)} of the last forward were converted with "
                             "wait=False and never passed to wait_for_staging(): their attention may have "
                             "read rows before they landed. Call wait_for_staging(layer) on the stream "
                             "that reads the rows, before it reads them")
        if len(self._layers) != self.config.num_layers:
            raise ValueError(f"{len(self._layers)} of {self.config.num_layers} layers registered; "
                             "register every layer before the first forward")
        if metadata.device != self.device:
            raise ValueError(f"metadata tensors are on {metadata.device}, the cache on {self.device}")
        fwd = prepare_forward(self._cache, self.config, self._ids, metadata, last=self._step, pad_to=pad_to,
                              replay=replay, device=self.device)
        self._fwd, self._step = fwd, fwd.step
        if replay and fwd.decode_tokens:
            for i in range(self.config.num_layers):
                self.resolves_per_layer[i] += 1
        return fwd

    def abandon_forward(self) -> None:
        """The forward prepared last will not run to its end: put back every layer it did
        not write, including those whose calls were captured in a graph. Call it when a
        capture raised (a captured forward that is replayed must not be abandoned), or
        when an error cut the forward short; in the latter case the requests whose rows
        it wrote in some layers hold a row more there than in the others, and can only
        be freed."""
        if self._step is not None:
            self._step.abandon(captured=True)
        self._fwd = None

    def _forward(self, metadata: object) -> Forward:
        """The forward prepared last, when ``metadata`` is its batch."""
        fwd = self._fwd
        if fwd is None or metadata is not fwd.metadata:
            raise ValueError("metadata is not the batch given to the last prepare_for_batch(); "
                             "call prepare_for_batch(metadata) once per forward first")
        return fwd

    def write_new_rows(self, layer_index: int, rows: torch.Tensor, metadata: SparseMLAMetadata) -> None:
        """Append this forward's KV rows of layer ``layer_index`` (every token, batch order).

        rows: uint8 [T, row_bytes] (a bf16 [T, 576] tensor is accepted for bf16 rows), on
        the cache device; T = the batch's tokens, or the bucket's with ``pad_to`` (rows
        past the batch's are not read). Token t's row becomes position
        ``context_start + offset`` of its request. Call before attention of that layer
        (a token attends to itself). Launches two kernels and nothing else.
        """
        i = self._layer(layer_index)
        fwd = self._forward(metadata)
        rows = self._as_row_bytes(rows, fwd.tokens, "rows")
        if i in fwd.written:
            raise ValueError(f"layer {i}: this forward's rows were already written (or are, by a graph "
                             "replay)")
        if fwd.step.pending:
            lg = self._layer_graphs
            if lg is not None and lg.applies(fwd.step):
                lg.write(i, fwd.step, rows)
            else:
                self._cache.write_step(i, fwd.step, rows)  # a launch that raises leaves it pending
        fwd.written.add(i)

    def _as_row_bytes(self, rows: object, n: int, name: str) -> torch.Tensor:
        """uint8 [n, row_bytes] (bf16 [n, 576] accepted for bf16 rows; any strides)."""
        rb = self.config.row_bytes
        t = check_tensor(name, rows, ndim=2, device=self.device)
        if t.dtype != torch.uint8:
            if t.dtype == torch.bfloat16 and self.row_format is RowFormat.BF16:
                if t.shape[1] != D_ROW:
                    raise ValueError(f"{name} as bf16 must be [T, {D_ROW}], got {tuple(t.shape)}")
                t = t.contiguous().view(torch.uint8)
            check_tensor(name, t, dtype=torch.uint8)
        if tuple(t.shape) != (n, rb):
            raise ValueError(f"{name} must be [T={n}, {rb}] (one row per token of the batch), got "
                             f"{list(t.shape)}")
        return t

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
        fwd = self._forward(metadata)
        md = fwd.metadata
        nd = md.num_decodes if num_decodes is None else num_decodes
        q = md.decode_max_query_len if decode_query_len is None else decode_query_len
        if nd != md.num_decodes or (nd and q != md.decode_max_query_len):
            raise ValueError(f"num_decodes={nd}, decode_query_len={q} disagree with the batch "
                             f"({md.num_decodes} decodes of {md.decode_max_query_len} tokens)")
        td = fwd.decode_tokens
        fwd.check_decode_topk(topk_indices, self.device)
        shape = tuple(topk_indices.shape)
        if shape[1] > self.config.top_k:
            raise ValueError(f"topk_indices has K={shape[1]} > config top_k={self.config.top_k}")
        key = topk_key(topk_indices)
        done = fwd.resolved.get(i)
        if done is not None:
            if done.how == "replayed":
                raise ValueError(f"layer {i} is resolved by the graph replay of this forward")
            if done.key != key:
                raise ValueError(f"layer {i} was already converted in this forward with another top-k "
                                 "tensor; each layer is resolved once per forward")
            if done.how != "converted":  # decode_attention keeps no indices to hand out
                how = ("begun by begin_decode_attention: attend it with decode_attention(..., overlap='split')"
                       if done.how == "begun" else "resolved by decode_attention, which returns no indices")
                raise ValueError(f"layer {i} was {how} in this forward")
            phys, counts = done.physical, done.counts
        else:
            if nd and i not in fwd.written:  # this forward's rows of layer i are not in yet
                raise ValueError(f"layer {i}: write_new_rows must run before the conversion (the "
                                 "decode tokens attend to their own rows)")
            if td:
                lg = self._layer_graphs
                if lg is not None and wait and lg.applies(fwd.step):
                    res = lg.convert(i, fwd.decode_ids, topk_indices)
                else:
                    if not wait:
                        self._refuse_input_buffer(topk_indices, "a conversion with wait=False")
                    res = self._cache.resolve(i, fwd.decode_ids, topk_indices, validate=self.validate, wait=wait)
                phys, counts = res.physical, res.valid_counts
                self.resolves_per_layer[i] += 1
                if not wait:
                    fwd.unwaited[i] = self._capturing()
            else:
                phys = torch.empty((0, topk_indices.shape[1]), dtype=torch.int32, device=self.device)
                counts = torch.empty((0,), dtype=torch.int32, device=self.device)
            fwd.resolved[i] = Resolved("converted", key, phys, counts)
        if wait and i in fwd.unwaited:
            self.wait_for_staging(i)
        return (phys, counts) if return_valid_counts else phys

    def wait_for_staging(self, layer_index: int, stream=None) -> None:
        """``stream`` (default: the current one) waits until the misses of the layer's
        conversion with ``wait=False`` landed in its hot rows (an event wait, no host
        sync; captured along inside a CUDA graph). A no-op after a waiting conversion."""
        i = self._layer(layer_index)
        if self._fwd is None or i not in self._fwd.resolved:
            raise ValueError(f"layer {i} was not converted in this forward: nothing to wait for")
        unwaited = self._fwd.unwaited
        if i in unwaited:
            if unwaited[i] != self._capturing():
                where = ("inside a CUDA graph capture", "outside it") if unwaited[i] else \
                        ("outside a CUDA graph capture", "inside one")
                raise ValueError(f"layer {i} was converted {where[0]} and is waited for {where[1]}: a "
                                 "stream cannot wait across a capture boundary; wait on the same side")
            self._cache.streams.wait_staging(i, stream)
            del unwaited[i]

    def decode_attention(self, layer_index: int, q: torch.Tensor, topk_indices: torch.Tensor,
                         metadata: SparseMLAMetadata, *, backend, sm_scale: float,
                         overlap: Overlap | str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of layer ``layer_index`` with the miss staging hidden behind
        it (``hisparse.decode``): resolves the decode tokens' top-k (int32 [Td, K]) and
        attends ``q`` (bf16 [Td, H, 576]) with ``backend`` over the hits while the misses
        stage ("split"; "serial" = convert + attend; "auto", the default: whichever of the
        two this layer and batch size measured faster, ``hisparse.decode.auto``). Returns out bf16
        [Td, H, 512], lse float32 [Td, H]. Counts as the layer's one resolve of the
        forward (a later conversion of the same layer is refused).
        """
        i = self._layer(layer_index)
        return self._decode.attend(self._forward(metadata), i, q, topk_indices, backend=backend, sm_scale=sm_scale,
                                   overlap=overlap)

    def begin_decode_attention(self, layer_index: int, topk_indices: torch.Tensor,
                               metadata: SparseMLAMetadata, *, backend, num_heads: int) -> None:
        """The resolve of a split ``decode_attention`` (``DecodeLayer.begin``), launched
        as soon as the top-k (int32 [Td, K]) exists, so that it runs beside the query
        projection; ``decode_attention(..., overlap="split")`` of the layer, with the
        same backend, ``topk_indices`` tensor and a query of ``num_heads`` heads, then
        attends. Counts as the layer's resolve of the forward. A head count the backend
        refuses is refused before the resolve (nothing changed: the layer can still be
        converted or attended)."""
        i = self._layer(layer_index)
        self._decode.begin(self._forward(metadata), i, topk_indices, backend=backend, num_heads=num_heads)

    def prefetch(self, layer_index: int, topk_indices: torch.Tensor, metadata: SparseMLAMetadata) -> None:
        """Stage a predicted selection (int32 [Td, K], e.g. the previous layer's top-k) of
        layer ``layer_index`` ahead of its resolve in this forward (``HiSparseCache.prefetch``)."""
        i = self._layer(layer_index)
        self._decode.prefetch(self._forward(metadata), i, topk_indices)

    def _capturing(self) -> bool:
        return capturing(self.device)

    # ---------------------------------------------------------------- prefill
    def stage_prefill_rows(self, layer_index: int, kv_cache: torch.Tensor, metadata: SparseMLAMetadata):
        """Stage every prefill request's context rows, in the stored row format, into ``kv_cache``.

        kv_cache: uint8 [num_blocks, block_size, row_bytes] or [N, row_bytes], an
        engine-owned staging area (contents overwritten). Prefill request p (p-th
        prefill of the batch) gets rows [0, seq_len) at consecutive blocks.
        Returns ``(staged, block_table, req_id_per_token)``: staged = ``kv_cache`` as a
        flat uint8 [N, row_bytes] view; block_table int32 [P, max_blocks] (-1 = unused);
        req_id_per_token int32 [num_prefill_tokens], the prefill index of each prefill
        token -- what the engine's own conversion needs to turn logical top-k into rows
        of ``staged``. The compute stream waits for the staging inside this call.
        """
        i = self._layer(layer_index)
        return self._prefill.stage_prefill_rows(self._forward(metadata), i, kv_cache)

    def gather_fp8_prefill(self, layer_index: int, kv_cache: torch.Tensor | None, workspace: torch.Tensor,
                           block_table: torch.Tensor | None, workspace_starts: torch.Tensor, num_reqs: int,
                           metadata: SparseMLAMetadata, req_start_idx: int):
        """Gather prefill requests' context rows into a bf16 workspace (fp8 dequantised).

        Prefill requests ``req_start_idx .. req_start_idx + num_reqs - 1`` (indices among
        the batch's prefills) have rows [0, seq_len) written to ``workspace`` bf16 [W, 576]
        at ``workspace_starts`` int32 [num_reqs] (device; must equal the exclusive prefix
        sum of those seq_lens, which is how engines lay out the workspace). ``kv_cache``
        and ``block_table`` are the engine's own paged cache arguments of its non-hisparse
        path; hisparse reads its own tiers and ignores them (None is fine).
        Returns the event (None on CPU) the compute stream must wait on before reading
        ``workspace``; the staging runs on ``prefill_stream``.
        """
        i = self._layer(layer_index)
        return self._prefill.gather_fp8_prefill(self._forward(metadata), i, kv_cache, workspace, block_table,
                                                workspace_starts, num_reqs, req_start_idx)

    # ---------------------------------------------------------- per-layer graphs
    def layer_graphs(self) -> dict | None:
        """With ``layer_graphs=True``: {graphs, eager, captures, replays, copies,
        in_place_graphs, write_replays, convert_replays}, the per-layer calls that ran
        eagerly (a bucket's warm-up), captured and replayed, the replayed calls that
        copied their input into a static buffer, the graphs captured to read an engine's
        tensor where it is, and the replays of each call; else None."""
        return None if self._layer_graphs is None else self._layer_graphs.report()

    def layer_input_buffers(self, metadata: SparseMLAMetadata, top_k: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's static inputs of the per-layer graphs (``layer_graphs=True``, a
        forward prepared with ``pad_to``): rows uint8 [tokens, row_bytes] and top-k
        int32 [decode tokens, top_k] (the config's top_k unless given; None when the
        forward has no decode tokens).

        The graphs read their inputs from these buffers; ``write_new_rows`` and the
        conversion copy a tensor they are given into them first. An engine that writes
        a layer's rows and top-k into these very tensors (on the current stream, before
        the layer's call) and passes them saves both copies. The buffers are the same
        for every layer and forward of the bucket: a call's graph has read them before
        anything the current stream runs after the call. ``prefetch`` and conversions with
        ``wait=False`` refuse the top-k buffer: they read it on the staging stream after
        they return, while the engine writes the next layer's top-k into it.
        """
        fwd = self._forward(metadata)
        lg = self._layer_graphs
        if lg is None or not lg.applies(fwd.step):
            why = ("layer_graphs=True was not given" if lg is None else
                   "this forward was not prepared with pad_to (or the current stream is being captured)")
            raise ValueError(f"layer_input_buffers: {why}; the buffers are the per-layer graphs' inputs")
        k = self.config.top_k if top_k is None else check_int("top_k", top_k, 1, self.config.top_k + 1)
        rows = lg.rows_buffer(fwd.tokens)
        topk = lg.topk_buffer(fwd.decode_tokens, k) if fwd.decode_tokens else None
        return rows, topk

    def _refuse_input_buffer(self, topk: torch.Tensor, call: str) -> None:
        if self._layer_graphs is not None:
            self._layer_graphs.refuse_input_buffer(topk, call)

    # ---------------------------------------------------------- prefill/decode disaggregation
    def pd_receiver(self, *, name: str | None = None, backends: tuple[str, ...] = ("UCX",),
                    quarantine_s: float | None = None):
        """The group's receiver, made on the first call (NixlUnavailable without NIXL): its
        agent starts and registers the host pool then. ``name`` (default: unique per
        host, process and call, ``nixl_api.default_agent_name``), ``backends`` and
        ``quarantine_s`` (None: ``receiver.QUARANTINE_S``) take effect on that first
        call only."""
        return self._pd.pd_receiver(name=name, backends=backends, quarantine_s=quarantine_s)

    def pd_reserve(self, req_id: int, num_tokens: int, *, timeout_s: float | None = None,
                   salt: bytes | None = None):
        """Admit ``req_id`` with host blocks for ``num_tokens`` rows a prefill engine will
        write (``PDReceiver.reserve``); its descriptor goes to the prefill side. With
        prefix caching, ``salt`` keys its block names; give its prompt with
        ``add_tokens`` for its blocks to be shared once committed."""
        return self._pd.pd_reserve(req_id, num_tokens, timeout_s=timeout_s, salt=salt)

    def pd_commit(self, req_id: int, generation: int) -> None:
        """The reserved rows count as appended in every layer (``PDReceiver.commit``)."""
        self._pd.pd_commit(req_id, generation)

    def pd_abort(self, req_id: int) -> None:
        """Return every block of a reservation (``PDReceiver.abort``)."""
        self._pd.pd_abort(req_id)

    def pd_connector(self, *, timeout_s: float | None = 60.0) -> PDConnector:
        """A scheduler-side connector over this group (module docstring); ``timeout_s``:
        the deadline of each reservation it makes (None: none). Makes the group's
        receiver now (``pd_receiver``), so the agent's start and the host pool's
        registration happen here, not in the first reserve."""
        return self._pd.pd_connector(timeout_s=timeout_s)


__all__ = ["HiSparseIndexGroup", "SparseMLAMetadata", "LayerCache", "LayerRuntime", "HotView",
           "CapacityError"]
