"""Device-side bookkeeping tensors of the hot tier (the "slot/LRU state").

Notation (used in every shape comment of the cache):
  L  layers                    R  request slots (max_num_reqs)
  S  LRU slots per (layer, request) = device_buffer_size; slot S is the reserved
     newest-token slot, so each (layer, request) owns S + 1 hot rows
  H  host rows per layer (num_host_blocks x host_block_size)
  B  host block size (tokens per block)      NB  host blocks
  NV block ids (num_virtual_blocks: NB, then the prefix-cache aliases)   HV = NV x B
  T  query tokens in a step    K  top-k entries per query token

Layout of one layer's flat hot view ``hot[l]`` (uint8 [R * (S + 1), row_bytes]):
  physical row = r * (S + 1) + slot
Layout of the host pool (uint8 [L, H, row_bytes]): the row of (request r, position p)
in layer l is ``pool[l, host_block[v] * B + p % B]`` with ``v = block_table[r, p // B]``.

Block ids: a request's block table holds *block ids* ``v``, each held by one request
at a time, so ``v * B + p % B`` (the request's *row key*) names one (request,
position): ``row_slot`` is indexed by it and stays exact per request even when several
requests share a host block (prefix caching, ``hisparse.cache.prefix``). Id ``v < NB``
stands for host block ``v`` (``host_block[v] = v``, always); an alias ``v >= NB`` for
the cached host block ``host_block[v]`` that a second request maps. Without prefix
caching there are no aliases and every row key is the host row.

Resident requests (the elastic tier, ``hisparse.cache.device_pool``): a request whose
``resident[r]`` is 1 holds its whole context in pages of PB rows past the hot buffers;
the row of position p in layer l is ``hot[l, pool_base + page_table[r, p // PB] * PB +
p % PB]``. It has no LRU state (its slots are empty, none of its host rows is in
``row_slot``) and never misses.

Exact LRU: each slot carries a stamp (the step of its last use, int64, so a
(layer, request) can be resolved any number of times without the counter wrapping) and
the position it holds. A resolve of (layer l, request r) increments ``step[l, r]``, stamps every hit
with the new step, and takes victims among slots ``0..S-1`` whose stamp is older than
the new step, in ascending order of the key

  key(empty slot s)    = s - (S + 1)                  (negative: empties first, by slot)
  key(occupied slot s) = (stamp << 32) | position     (older first; ties by position)

so the policy is defined on rows, not on slot numbers: which victim slot a given miss
lands in does not change any later hit or eviction. (The resolve pairs the misses, in
ascending position, with the victims in ascending slot order.)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..config import DEVICE_PAGE_ROWS, HiSparseConfig

# indices into HotState.stats[l]
STAT_HITS = 0  # unique (request, position) hits per resolve, summed
STAT_MISSES = 1  # unique misses (rows staged host -> device)
STAT_INVALID = 2  # top-k entries treated as padding because they were invalid
STAT_D2H_ROWS = 3  # rows written to the host pool
STAT_RESOLVES = 4  # (layer, request) resolves
STAT_PREFETCH = 5  # rows staged by prefetch resolves (predicted selections)
STAT_RESIDENT = 6  # valid top-k entries resolved to resident rows (entries, not unique rows)
NUM_STATS = 7


class LayerState(NamedTuple):
    """Views of one layer's rows of the per-layer ``HotState`` tensors."""

    seq_lens: torch.Tensor  # int32 [R]
    slot_pos: torch.Tensor  # int32 [R, S + 1]
    slot_stamp: torch.Tensor  # int64 [R, S + 1]
    row_slot: torch.Tensor  # int32 [HV], by row key
    step: torch.Tensor  # int64 [R]
    stats: torch.Tensor  # int64 [NUM_STATS]


@dataclasses.dataclass(frozen=True)
class HotState:
    """All device tensors of the hot tier's bookkeeping. Created once, never resized,
    never reassigned (frozen: the per-layer views of ``layer`` stay valid)."""

    id_to_slot: torch.Tensor  # int32 [max_request_id], request slot of a live id, -1 = none
    seq_lens: torch.Tensor  # int32 [L, R], rows appended to layer l for the request slot (0 = free)
    block_table: torch.Tensor  # int32 [R, NB], block id (< NV) of each logical block, -1 = none
    slot_pos: torch.Tensor  # int32 [L, R, S + 1], position held by a slot, -1 = empty
    slot_stamp: torch.Tensor  # int64 [L, R, S + 1], step of last use, -1 = empty
    row_slot: torch.Tensor  # int32 [L, HV], slot (0..S) holding the row of row key h, -1 = not hot
    host_block: torch.Tensor  # int32 [NV], host block of each block id (identity below NB)
    step: torch.Tensor  # int64 [L, R], resolves done for (layer, request slot)
    stats: torch.Tensor  # int64 [L, NUM_STATS], see STAT_*
    resident: torch.Tensor  # int32 [R], 1 = the request slot is resident (pages), 0 = hot
    page_table: torch.Tensor  # int32 [R, MP], pool page of each logical page, -1 = none
    S: int  # LRU slots per (layer, request); slot S is the reserved newest slot
    B: int  # host block size
    pool_base: int = 0  # first row of the pool pages in a layer's flat view
    PB: int = 64  # rows per pool page
    pool_pages: int = 0  # pages of the pool (0: no elastic tier; no request is resident)

    @classmethod
    def allocate(cls, cfg: HiSparseConfig, device: torch.device) -> "HotState":
        L, R, S = cfg.num_layers, cfg.max_num_reqs, cfg.device_buffer_size
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            id_to_slot=torch.full((cfg.max_request_id,), -1, **i32),
            seq_lens=torch.zeros((L, R), **i32),
            block_table=torch.full((R, cfg.num_host_blocks), -1, **i32),
            slot_pos=torch.full((L, R, S + 1), -1, **i32),
            slot_stamp=torch.full((L, R, S + 1), -1, **i64),
            row_slot=torch.full((L, cfg.num_virtual_rows), -1, **i32),
            host_block=torch.arange(cfg.num_virtual_blocks, **i32) % cfg.num_host_blocks,
            step=torch.zeros((L, R), **i64),
            stats=torch.zeros((L, NUM_STATS), dtype=torch.int64, device=device),
            resident=torch.zeros((R,), **i32),
            page_table=torch.full((R, max(1, cfg.max_pages_per_request)), -1, **i32),
            S=S,
            B=cfg.host_block_size,
            pool_base=cfg.hot_rows_per_layer,
            PB=DEVICE_PAGE_ROWS,
            pool_pages=cfg.pool_pages,
        )

    @property
    def aliased(self) -> bool:
        """Whether block ids past the NB host blocks exist (prefix-cache aliases): then
        a row key is not always its host row."""
        return self.host_block.shape[0] > self.block_table.shape[1]

    def layer(self, layer: int) -> LayerState:
        """Layer ``layer``'s views (made once per layer: launchers ask every call)."""
        views = self.__dict__.setdefault("_layer_views", {})
        v = views.get(layer)
        if v is None:
            v = views[layer] = LayerState(self.seq_lens[layer], self.slot_pos[layer], self.slot_stamp[layer],
                                          self.row_slot[layer], self.step[layer], self.stats[layer])
        return v

    @property
    def slots_per_req(self) -> int:
        return self.S + 1

    def clone(self) -> "HotState":
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).clone()
                     for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        )


@dataclasses.dataclass
class ResolveBuffers:
    """Outputs of one resolve, allocated once per (T, K) capacity and reused.

    physical:     int32 [T, K]   row in the layer's flat hot view, -1 = padding
    valid_counts: int32 [T]      non-padding entries per query token
    stage_src:    int32 [T * K]  host row to stage (within the layer: the miss's row key
                  through host_block), -1 = nothing
    stage_dst:    int32 [T * K]  flat hot row it goes to, -1 = nothing
    stage_counts: int32 [T]      m at a group's first token t0, 0 elsewhere: the misses of
                  that group occupy stage_*[t0*K : t0*K + m]

    Undo log (read only to roll a resolve back when a later launch of the same call
    fails; see ``cache.rollback``):
    undo_hit:     int64 [T * K]  entry t*K + k: the stamp its hit slot had before this
                  resolve (s_new for a repeated hit of the same slot), -2 = not a hit
    undo_vpos:    int32 [T * K]  entry t0*K + i: the position victim i held, -1 = empty
    undo_vstamp:  int64 [T * K]  entry t0*K + i: the stamp victim i had
    """

    physical: torch.Tensor
    valid_counts: torch.Tensor
    stage_src: torch.Tensor
    stage_dst: torch.Tensor
    stage_counts: torch.Tensor
    undo_hit: torch.Tensor
    undo_vpos: torch.Tensor
    undo_vstamp: torch.Tensor

    @classmethod
    def allocate(cls, T: int, K: int, device: torch.device,
                 undo_of: "ResolveBuffers | None" = None) -> "ResolveBuffers":
        """Buffers of capacity [T, K]; the undo log is ``undo_of``'s when given (one log
        serves every layer: it is read only inside the call that wrote it)."""
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        if undo_of is not None:
            undo = (undo_of.undo_hit, undo_of.undo_vpos, undo_of.undo_vstamp)
        else:
            undo = (torch.empty((T * K,), **i64), torch.empty((T * K,), **i32), torch.empty((T * K,), **i64))
        return cls(
            physical=torch.empty((T, K), **i32),
            valid_counts=torch.empty((T,), **i32),
            stage_src=torch.empty((T * K,), **i32),
            stage_dst=torch.empty((T * K,), **i32),
            stage_counts=torch.empty((T,), **i32),
            undo_hit=undo[0], undo_vpos=undo[1], undo_vstamp=undo[2],
        )

    def view(self, T: int, K: int) -> "ResolveBuffers":
        """The first [T, K] of these buffers (contiguous views, no copy; made once per
        shape: a decode step asks for the same one every layer)."""
        cache = self.__dict__.setdefault("_views", {})
        v = cache.get((T, K))
        if v is None:
            v = cache[(T, K)] = self._make_view(T, K)
        return v

    def _make_view(self, T: int, K: int) -> "ResolveBuffers":
        n = T * K
        return ResolveBuffers(
            physical=self.physical.view(-1)[:n].view(T, K), valid_counts=self.valid_counts[:T],
            stage_src=self.stage_src[:n], stage_dst=self.stage_dst[:n], stage_counts=self.stage_counts[:T],
            undo_hit=self.undo_hit[:n],
            undo_vpos=self.undo_vpos[:n], undo_vstamp=self.undo_vstamp[:n])
