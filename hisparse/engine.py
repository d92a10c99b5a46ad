"""The engine façade: hisparse as the KV-cache manager of a sparse-MLA attention backend.

An inference engine's sparse-MLA backend talks to one :class:`HiSparseIndexGroup` per
model (the layers whose attention consumes top-k indexer results). The calls, in the
order an engine makes them (``docs/ENGINE.md`` walks through them):

  at start-up      group = HiSparseIndexGroup(config); i = group.register_layer(...)
                   per layer; group.cache(i).runtime.max_num_reqs etc. size the backend
  per request      group.add_request(req_id) on admission, group.free_request(req_id)
                   when it finishes or is preempted
  per forward      group.prepare_for_batch(metadata)                      (once)
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
- Decode tokens come first in the batch (see ``engine_metadata``); only they are
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
"""

from __future__ import annotations

import dataclasses

import torch

from .config import HiSparseConfig, RowFormat
from .engine_metadata import SparseMLAMetadata
from .errors import CapacityError

D_QK = 576  # 512 latent + 64 RoPE
_KV_DTYPES = {"fp8_ds_mla": RowFormat.FP8_DS_MLA, "bf16": RowFormat.BF16, "auto": RowFormat.BF16,
              "bfloat16": RowFormat.BF16}


@dataclasses.dataclass(frozen=True)
class HotView:
    """What an attention backend needs to know about one layer's hot buffer.

    attention_cache: uint8 [R * (S + 1), row_bytes], the flat row view physical
    indices point into (``physical_kv_cache``). block_size = S + 1: viewed as blocks,
    block r is request slot r and ``physical = r * block_size + slot``.
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


class HiSparseIndexGroup:
    """Per-layer hisparse caches behind the calls a sparse-MLA backend makes.

    ``config.num_layers`` is the number of layers that will be registered. ``kernels``
    is passed to :class:`hisparse.HiSparseCache` ("auto" | "torch" | "triton").
    """

    def __init__(self, config: HiSparseConfig, *, validate: bool = True, kernels: str = "auto",
                 batched_writes: bool = True) -> None:
        if not isinstance(config, HiSparseConfig):
            raise TypeError(f"config must be a HiSparseConfig, got {type(config).__name__}")
        from .cache.cache import HiSparseCache

        self.config = config
        self.row_format = _row_format_of(config)
        self.validate = bool(validate)
        self.batched_writes = bool(batched_writes)
        self._cache = HiSparseCache(config, kernels=kernels)
        self.device = self._hot_rows(0).device
        self._layers: list[LayerCache] = []
        self._lens: dict[int, list[int]] = {}  # req id -> rows stored per layer (host mirror)
        self._batch: SparseMLAMetadata | None = None
        self._decode_ids = torch.empty(0, dtype=torch.int32, device=self.device)
        self._converted: dict[int, tuple[tuple, object]] = {}
        self._written: set[int] = set()
        self._counts: tuple[int, ...] | None = None
        self.resolves_per_layer = [0] * config.num_layers  # lifetime count, for tests/metrics
        cuda = self.device.type == "cuda"
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

    def register_layer(self, *, head_size: int = D_QK, kv_cache_dtype: str = "fp8_ds_mla") -> int:
        """Register the next layer; returns its index in the group (0, 1, ...).

        head_size: the MLA head size of the KV rows (576 = 512 latent + 64 RoPE).
        kv_cache_dtype: "fp8_ds_mla" or "bf16" ("auto"/"bfloat16" accepted); must match
        the config's row format.
        """
        if head_size != D_QK:
            raise ValueError(f"head_size must be {D_QK} (512 latent + 64 RoPE), got {head_size!r}")
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
        if isinstance(layer_index, bool) or not isinstance(layer_index, int):
            raise TypeError(f"layer_index must be an int, got {type(layer_index).__name__}")
        if not 0 <= layer_index < len(self._layers):
            raise ValueError(f"layer_index {layer_index} is not registered (have {len(self._layers)} layers)")
        return layer_index

    def cache(self, layer_index: int) -> LayerCache:
        return self._layers[self._layer(layer_index)]

    def physical_kv_cache(self, layer_index: int) -> torch.Tensor:
        """uint8 [R * (S + 1), row_bytes]: the rows decode attention reads for this layer."""
        return self._layers[self._layer(layer_index)].runtime.hot.attention_cache

    # ------------------------------------------------------------- requests
    def add_request(self, req_id: int) -> None:
        """Admit a request (CapacityError when every request slot is taken)."""
        self._cache.add_request(req_id)
        self._lens[req_id] = [0] * self.config.num_layers

    def free_request(self, req_id: int) -> None:
        """Release every block and slot of a finished or preempted request."""
        if req_id not in self._lens:
            raise ValueError(f"request {req_id!r} is not live")
        self._cache.free_request(req_id)
        del self._lens[req_id]

    def has_request(self, req_id: int) -> bool:
        return req_id in self._lens

    def request_length(self, req_id: int, layer_index: int) -> int:
        """Rows stored for ``req_id`` in layer ``layer_index``."""
        if req_id not in self._lens:
            raise ValueError(f"request {req_id!r} is not live")
        return self._lens[req_id][self._layer(layer_index)]

    def stats(self) -> dict:
        return self._cache.stats()

    # ------------------------------------------------------------ per batch
    def prepare_for_batch(self, metadata: SparseMLAMetadata) -> None:
        """Start a forward: check the batch against the cache and set up the per-step state.

        Every request must be live and hold exactly ``seq_len - query_len`` rows in every
        layer (its context before this forward). Launches one small gather (decode
        tokens' request ids) and nothing else; no host sync.
        """
        if not isinstance(metadata, SparseMLAMetadata):
            raise TypeError(f"metadata must be a SparseMLAMetadata, got {type(metadata).__name__}")
        if len(self._layers) != self.config.num_layers:
            raise ValueError(f"{len(self._layers)} of {self.config.num_layers} layers registered; "
                             "register every layer before the first forward")
        if metadata.device != self.device:
            raise ValueError(f"metadata tensors are on {metadata.device}, the cache on {self.device}")
        cfg = self.config
        q = metadata.decode_max_query_len
        if metadata.num_decodes and q > cfg.max_query_len:
            raise ValueError(f"decode query length {q} exceeds the config's max_query_len={cfg.max_query_len}")
        for row, rid in enumerate(metadata.request_ids_cpu):
            lens = self._lens.get(rid)
            if lens is None:
                raise ValueError(f"batch row {row}: request {rid} is not live (add_request first)")
            start = metadata.context_start(row)
            if any(n != start for n in lens):
                raise ValueError(f"batch row {row}: request {rid} holds {lens} rows per layer but the "
                                 f"metadata says its context before this forward is {start} "
                                 f"(seq_len {metadata.seq_lens_cpu[row]} - query_len {metadata.query_len(row)})")
        td = metadata.num_decode_tokens
        rows = metadata.req_id_per_token[:td].long()
        self._decode_ids = metadata.request_ids[rows] if td else metadata.request_ids[:0]
        self._batch = metadata
        self._converted = {}
        self._written: set[int] = set()  # layers whose rows this forward wrote
        self._counts: tuple[int, ...] | None = None  # rows per batch row (built on first write)

    def _check_batch(self, metadata: object) -> SparseMLAMetadata:
        if self._batch is None or metadata is not self._batch:
            raise ValueError("metadata is not the batch given to the last prepare_for_batch(); "
                             "call prepare_for_batch(metadata) once per forward first")
        return self._batch

    def write_new_rows(self, layer_index: int, rows: torch.Tensor, metadata: SparseMLAMetadata) -> None:
        """Append this forward's KV rows of layer ``layer_index`` (every token, batch order).

        rows: uint8 [T, row_bytes] (a bf16 [T, 576] tensor is accepted for bf16 rows), on
        the cache device. Token t's row becomes position ``context_start + offset`` of its
        request. Call before attention of that layer (a token attends to itself).
        """
        i = self._layer(layer_index)
        md = self._check_batch(metadata)
        rows = self._as_row_bytes(rows, md.num_tokens, "rows")
        # prepare_for_batch checked every layer's lengths against the batch, and only
        # this method changes them: a layer not written yet in this forward is in order
        if i in self._written:
            raise ValueError(f"layer {i}: this forward's rows were already written")
        qsl = md.query_start_loc_cpu
        if self.batched_writes:  # one plan for the whole batch, a fixed number of launches
            ids = md.request_ids_cpu
            if self._counts is None:  # one tuple per forward: the cache validates it once
                self._counts = tuple(qsl[row + 1] - qsl[row] for row in range(len(ids)))
            firsts = self._cache.append_rows_batch(i, ids, rows, self._counts)
            for row, rid in enumerate(ids):
                if firsts[row] != self._lens[rid][i]:
                    raise RuntimeError(f"cache appended request {rid} layer {i} at position {firsts[row]}, "
                                       f"the group expected {self._lens[rid][i]}")
                self._lens[rid][i] = md.seq_lens_cpu[row]
            self._written.add(i)
            return
        for row, rid in enumerate(md.request_ids_cpu):
            if self._lens[rid][i] != md.context_start(row):  # a partly failed earlier call
                raise ValueError(f"layer {i}: rows of request {rid} were already written in this forward")
        for row, rid in enumerate(md.request_ids_cpu):
            n = qsl[row + 1] - qsl[row]
            if n == 0:
                continue
            first = self._cache.append_rows(i, rid, rows[qsl[row]:qsl[row + 1]])
            if first != self._lens[rid][i]:
                raise RuntimeError(f"cache appended request {rid} layer {i} at position {first}, "
                                   f"the group expected {self._lens[rid][i]}")
            self._lens[rid][i] += n
        self._written.add(i)

    def _as_row_bytes(self, rows: object, n: int, name: str) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(rows).__name__}")
        rb = self.config.row_bytes
        if rows.dtype == torch.bfloat16 and self.row_format is RowFormat.BF16:
            if rows.dim() != 2 or rows.shape[1] != D_QK:
                raise ValueError(f"{name} as bf16 must be [T, {D_QK}], got {tuple(rows.shape)}")
            rows = rows.contiguous().view(torch.uint8)
        if rows.dtype != torch.uint8:
            raise TypeError(f"{name} must be uint8 [T, {rb}], got dtype {rows.dtype}")
        if rows.dim() != 2 or rows.shape != (n, rb):
            raise ValueError(f"{name} must be [T={n}, {rb}], got {tuple(rows.shape)}")
        if rows.device != self.device:
            raise ValueError(f"{name} is on {rows.device}, the cache on {self.device}")
        return rows

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
    ):
        """Resolve the decode tokens' logical top-k into rows of ``physical_kv_cache(i)``.

        Returns physical int32 [Td, K] (-1 kept for padding), plus valid counts int32
        [Td] when ``return_valid_counts``. Misses are staged from host before the
        compute stream can run the next kernel. A second call for the same layer in
        the same forward returns the first result (same top-k tensor required).
        """
        i = self._layer(layer_index)
        md = self._check_batch(metadata)
        nd = md.num_decodes if num_decodes is None else num_decodes
        q = md.decode_max_query_len if decode_query_len is None else decode_query_len
        if nd != md.num_decodes or (nd and q != md.decode_max_query_len):
            raise ValueError(f"num_decodes={nd}, decode_query_len={q} disagree with the batch "
                             f"({md.num_decodes} decodes of {md.decode_max_query_len} tokens)")
        if not isinstance(topk_indices, torch.Tensor):
            raise TypeError(f"topk_indices must be a torch.Tensor, got {type(topk_indices).__name__}")
        if topk_indices.dtype != torch.int32:
            raise TypeError(f"topk_indices must be int32 [Td, K], got {topk_indices.dtype}")
        td = md.num_decode_tokens
        if topk_indices.dim() != 2 or topk_indices.shape[0] != td:
            raise ValueError(f"topk_indices must be [num_decode_tokens={td}, K], got {tuple(topk_indices.shape)}")
        if topk_indices.shape[1] > self.config.top_k:
            raise ValueError(f"topk_indices has K={topk_indices.shape[1]} > config top_k={self.config.top_k}")
        if topk_indices.device != self.device:
            raise ValueError(f"topk_indices is on {topk_indices.device}, the cache on {self.device}")
        key = (topk_indices.data_ptr(), tuple(topk_indices.shape), tuple(topk_indices.stride()))
        done = self._converted.get(i)
        if done is not None:
            if done[0] != key:
                raise ValueError(f"layer {i} was already converted in this forward with another top-k "
                                 "tensor; each layer is resolved once per forward")
            phys, counts = done[1]
        else:
            if nd and i not in self._written:  # this forward's rows of layer i are not in yet
                rid = md.request_ids_cpu[0]
                raise ValueError(f"layer {i}: write_new_rows must run before the conversion "
                                 f"(request {rid} holds {self._lens[rid][i]} of "
                                 f"{md.seq_lens_cpu[0]} rows)")
            if td:
                phys, counts = self._resolve_decode(i, topk_indices)
                self.resolves_per_layer[i] += 1
            else:
                phys = torch.empty((0, topk_indices.shape[1]), dtype=torch.int32, device=self.device)
                counts = torch.empty((0,), dtype=torch.int32, device=self.device)
            self._converted[i] = (key, (phys, counts))
        return (phys, counts) if return_valid_counts else phys

    def _resolve_decode(self, layer: int, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve decode top-k through the cache.

        Lengths are per layer in the cache, and ``write_new_rows`` of this layer ran
        first, so a token's own position and the other new positions of this forward
        (multi-token decode) resolve like any other row: positions < S are hot in slot
        == position, the newest row is hot in the reserved slot S, and new positions
        >= S other than the newest are staged from the host mirror.
        """
        res = self._cache.resolve(layer, self._decode_ids, topk, validate=self.validate)
        return res.physical, res.valid_counts

    # ---------------------------------------------------------------- prefill
    def _prefill_rows(self, md: SparseMLAMetadata, start: int, count: int, layer: int) -> list[tuple[int, int]]:
        """(request id, rows to stage) of prefill requests start .. start+count-1."""
        out = []
        for p in range(start, start + count):
            row = md.num_decodes + p
            rid = md.request_ids_cpu[row]
            n = md.seq_lens_cpu[row]
            if self._lens[rid][layer] != n:
                raise ValueError(f"layer {layer}: prefill request {rid} holds {self._lens[rid][layer]} of "
                                 f"{n} rows; call write_new_rows before staging its context")
            out.append((rid, n))
        return out

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
        from .cache import prefill as pf

        i = self._layer(layer_index)
        md = self._check_batch(metadata)
        flat, block_size = self._staging_view(kv_cache)
        reqs = self._prefill_rows(md, 0, md.num_prefills, i)
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
        ev = self._stage(i, reqs, starts, flat, pf, stored=True)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        bt = torch.tensor(table, dtype=torch.int32, device=self.device).view(len(reqs), max_b)
        td = md.num_decode_tokens
        req_ids = md.req_id_per_token[td:] - md.num_decodes
        return flat, bt, req_ids

    def _staging_view(self, kv_cache: object) -> tuple[torch.Tensor, int]:
        rb = self.config.row_bytes
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dtype != torch.uint8:
            raise TypeError(f"kv_cache must be uint8 [..., {rb}], got {kv_cache.dtype}")
        if kv_cache.device != self.device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, the cache on {self.device}")
        if kv_cache.dim() == 3 and kv_cache.shape[2] == rb and kv_cache.is_contiguous():
            return kv_cache.view(-1, rb), kv_cache.shape[1]
        if kv_cache.dim() == 2 and kv_cache.shape[1] == rb and kv_cache.is_contiguous():
            return kv_cache, 1
        raise ValueError(f"kv_cache must be a contiguous uint8 [num_blocks, block_size, {rb}] or "
                         f"[N, {rb}] tensor, got {tuple(kv_cache.shape)}")

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
        from .cache import prefill as pf

        i = self._layer(layer_index)
        md = self._check_batch(metadata)
        for name, v in (("num_reqs", num_reqs), ("req_start_idx", req_start_idx)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"{name} must be an int >= 0, got {v!r}")
        if req_start_idx + num_reqs > md.num_prefills:
            raise ValueError(f"prefill requests {req_start_idx}..{req_start_idx + num_reqs - 1} are outside the "
                             f"batch's {md.num_prefills} prefills")
        for name, t in (("kv_cache", kv_cache), ("block_table", block_table)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.bfloat16:
            raise TypeError(f"workspace must be a bfloat16 [W, {D_QK}] tensor")
        if workspace.dim() != 2 or workspace.shape[1] != D_QK or not workspace.is_contiguous():
            raise ValueError(f"workspace must be contiguous [W, {D_QK}], got {tuple(workspace.shape)}")
        if workspace.device != self.device:
            raise ValueError(f"workspace is on {workspace.device}, the cache on {self.device}")
        if not isinstance(workspace_starts, torch.Tensor) or workspace_starts.dtype != torch.int32:
            raise TypeError("workspace_starts must be an int32 [num_reqs] tensor")
        if tuple(workspace_starts.shape) != (num_reqs,) or workspace_starts.device != self.device:
            raise ValueError(f"workspace_starts must be [num_reqs={num_reqs}] on {self.device}, got "
                             f"{tuple(workspace_starts.shape)} on {workspace_starts.device}")
        reqs = self._prefill_rows(md, req_start_idx, num_reqs, i)
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
        return self._stage(i, reqs, starts, workspace, pf, stored=False)

    def _stage(self, layer: int, reqs: list[tuple[int, int]], starts: list[int], dst: torch.Tensor,
               pf, *, stored: bool):
        """Stage rows [0, n) of each (req id, n) at row ``starts[j]`` of ``dst``; returns the event.

        Runs ``hisparse.cache.prefill.stage_prefill`` on the prefill stream after it waits
        on the compute stream and on the cache's host-mirror copies (so rows written by
        ``write_new_rows`` this forward are on host before they are read from there).
        """
        c = self._cache
        i32 = dict(dtype=torch.int32, device=self.device)
        slots = torch.tensor([c.request_slot(rid) for rid, _ in reqs], **i32)
        lens = torch.tensor([n for _, n in reqs], **i32)
        st = torch.tensor(starts, **i32)
        if self.prefill_stream is not None:
            c.join_backup(self.prefill_stream)
        if stored and dst.dtype != torch.uint8:
            raise RuntimeError("stored-format staging needs a uint8 destination")
        return pf.stage_prefill(
            host_pool=c.pool.rows[layer], block_table=c.state.block_table, req_slots=slots, seq_lens=lens,
            workspace_starts=st, workspace=dst, block_size=self.config.host_block_size,
            row_format=self.row_format, hot_rows=c.hot[layer], row_slot=c.state.row_slot[layer],
            slots_per_req=self.config.slots_per_req, max_rows=max((n for _, n in reqs), default=0),
            stream=self.prefill_stream, validate=self.validate)


__all__ = ["HiSparseIndexGroup", "SparseMLAMetadata", "LayerCache", "LayerRuntime", "HotView",
           "CapacityError"]
