"""A runnable mini inference engine: N layers of sparse MLA served with and without hisparse.

The model (random weights, deterministic from ``seed``):
  hidden state x fp32 [T, D]; per layer l, from rmsnorm(x):
    q   = x W_q[l]   -> bf16 [T, H, 576]           (absorbed-MLA query)
    kv  = x W_kv[l]  -> one 576-value row per token, stored as fp8_ds_mla (or bf16)
    ik  = x W_ik[l]  -> indexer key fp32 [T, d_idx], kept on the device per request
    iq  = x W_iq[l]  -> indexer query; scores = iq . ik over positions <= own position,
                        top-k per query token (-1 padded when the context is shorter)
    x  += attn(q, rows[top-k]) [T, H * 512] W_o[l]
  logits = rmsnorm(x) W_out; the argmax is recorded per token.
Token embeddings share a common direction with weight ``locality`` (0..1): a high value
makes consecutive indexer queries similar, as real indexers' are, so hot rows get reused.

Serving: requests arrive at different steps, prefill in chunks (``chunk`` tokens, a
per-step token budget), then decode ``decode_len`` steps of ``query_len`` tokens each
(teacher-forced: every input token is fixed up front, so both runs see the same inputs),
and leave. Each step is one forward over decode tokens first, then prefill chunks.

The same workload runs twice, differing only in where KV rows live:
  resident  an ordinary paged device KV cache: decode attention reads it through a block
            table (``hisparse.cache.convert``), prefill gathers context rows into a bf16
            workspace
  hisparse  ``hisparse.engine.HiSparseIndexGroup``: rows on the host pool, a hot buffer
            smaller than the contexts; decode attention reads the hot buffer through the
            resolved physical indices, prefill through ``gather_fp8_prefill``
Both use the same attention backend objects. The final hidden states must match token by
token within ``tolerance`` (the same rows are gathered, so they normally match exactly);
the report has tokens/s of both, their ratio, hisparse's hit rate and bytes moved.

``synthetic_context`` (benchmarks): the first n positions of every prompt get random
rows and indexer keys written straight into both caches instead of being prefilled,
so a 32K context costs seconds, not minutes; the rest of the prompt is prefilled.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time

import torch

from ..config import HiSparseConfig, RowFormat
from ..engine.metadata import SparseMLAMetadata

D_QK, D_V = 576, 512


@dataclasses.dataclass(frozen=True)
class MiniEngineConfig:
    """Sizes of the model, the workload and the hisparse cache (see the module docstring)."""

    num_layers: int = 2
    num_heads: int = 2
    hidden: int = 64
    indexer_dim: int = 16
    vocab: int = 97
    top_k: int = 8
    num_requests: int = 4
    min_prompt: int = 20
    max_prompt: int = 40
    min_decode: int = 3
    max_decode: int = 8
    arrival_every: int = 2  # request i arrives at step i * arrival_every
    query_len: int = 1  # decode tokens per request per step (MTP > 1)
    chunk: int = 16  # prefill chunk per request per step
    max_batch_tokens: int = 64
    device_buffer_size: int | None = None  # hot slots per (layer, request); default 2 * top_k
    host_block_size: int = 16
    max_num_reqs: int | None = None  # default num_requests
    row_format: str = "fp8_ds_mla"
    device: str = "cpu"
    seed: int = 0
    locality: float = 0.9
    synthetic_context: int = 0
    backend: str | None = None  # attention backend name (None: chooser default)
    flashmla_lib: str | None = None  # path of FlashMLA's _flashmla_C library (backend "flashmla")
    cache_kernels: str = "auto"  # HiSparseCache kernels: auto | torch | triton (interpreter on CPU)
    validate: bool = True  # checked mode for cache and attention calls
    tolerance: float = 2e-2  # max |x_resident - x_hisparse| allowed, relative to max |x|

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "hidden", "indexer_dim", "vocab", "top_k", "num_requests",
                     "min_prompt", "max_prompt", "max_decode", "arrival_every", "query_len", "chunk",
                     "max_batch_tokens", "host_block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "arrival_every" else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0 <= self.min_decode <= self.max_decode:
            raise ValueError(f"need 0 <= min_decode <= max_decode, got {self.min_decode}, {self.max_decode}")
        if self.min_prompt > self.max_prompt:
            raise ValueError(f"min_prompt {self.min_prompt} > max_prompt {self.max_prompt}")
        if not 0 <= self.synthetic_context < self.min_prompt:
            raise ValueError(f"synthetic_context must be in [0, min_prompt={self.min_prompt}), "
                             f"got {self.synthetic_context}")
        if not 0.0 <= self.locality < 1.0:
            raise ValueError(f"locality must be in [0, 1), got {self.locality}")
        RowFormat.parse(self.row_format)
        if self.max_batch_tokens < self.num_requests * self.query_len:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} cannot hold one decode step of all "
                             f"{self.num_requests} requests x query_len {self.query_len}")

    @property
    def max_context(self) -> int:
        return self.max_prompt + self.max_decode * self.query_len

    def cache_config(self) -> HiSparseConfig:
        fmt = RowFormat.parse(self.row_format)
        R = self.max_num_reqs or self.num_requests
        return HiSparseConfig(
            num_layers=self.num_layers, row_bytes=fmt.row_bytes, top_k=self.top_k,
            device_buffer_size=self.device_buffer_size, max_num_reqs=R, max_query_len=self.query_len,
            host_block_size=self.host_block_size,
            host_pool_tokens=R * (-(-self.max_context // self.host_block_size) + 1) * self.host_block_size,
            max_request_id=max(self.num_requests, 1), device=self.device)


# ---------------------------------------------------------------------- workload
@dataclasses.dataclass
class Request:
    rid: int
    arrival: int
    prompt_len: int
    decode_len: int  # decode steps
    tokens: torch.Tensor  # int64 [prompt_len + decode_len * q] teacher-forced inputs (CPU)
    done: int = 0  # positions processed
    slot: int = -1  # engine slot (indexer store, resident block table)

    @property
    def total(self) -> int:
        return self.tokens.numel()


def make_workload(cfg: MiniEngineConfig) -> list[Request]:
    g = torch.Generator().manual_seed(cfg.seed)
    reqs = []
    for i in range(cfg.num_requests):
        p = int(torch.randint(cfg.min_prompt, cfg.max_prompt + 1, (1,), generator=g))
        d = int(torch.randint(cfg.min_decode, cfg.max_decode + 1, (1,), generator=g))
        toks = torch.randint(0, cfg.vocab, (p + d * cfg.query_len,), generator=g)
        reqs.append(Request(rid=i, arrival=i * cfg.arrival_every, prompt_len=p, decode_len=d, tokens=toks))
    return reqs


# ---------------------------------------------------------------------- model
class Model:
    """Random-weight sparse-MLA stack; every tensor on ``device``."""

    def __init__(self, cfg: MiniEngineConfig, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
        D, H, L, di = cfg.hidden, cfg.num_heads, cfg.num_layers, cfg.indexer_dim

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(device)

        common = torch.randn(D, generator=g)
        common = common / common.norm() * math.sqrt(D)
        own = torch.randn(cfg.vocab, D, generator=g)
        a = cfg.locality
        self.embed = (a * common + math.sqrt(1 - a * a) * own).to(device)  # fp32 [V, D]
        self.w_q = w(L, D, H * D_QK, fan_in=D).to(torch.bfloat16)
        self.w_kv = w(L, D, D_QK, fan_in=D).to(torch.bfloat16)
        self.w_iq = w(L, D, di, fan_in=D)
        self.w_ik = w(L, D, di, fan_in=D)
        self.w_o = w(L, H * D_V, D, fan_in=H * D_V).to(torch.bfloat16)
        self.w_out = w(D, cfg.vocab, fan_in=D)
        self.H = H
        self.fmt = RowFormat.parse(cfg.row_format)
        self.sm_scale = 1.0 / math.sqrt(D_QK)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)

    def pre(self, layer: int, x: torch.Tensor, validate: bool):
        """x fp32 [T, D] -> q bf16 [T, H, 576], rows uint8 [T, row_bytes], iq/ik fp32 [T, di]."""
        from ..formats import quantize_fp8_ds_mla

        xn = self._norm(x)
        xb = xn.to(torch.bfloat16)
        q = (xb @ self.w_q[layer]).view(-1, self.H, D_QK)
        kv = xb @ self.w_kv[layer]  # bf16 [T, 576]
        if self.fmt is RowFormat.FP8_DS_MLA:
            rows = quantize_fp8_ds_mla(kv, validate=validate)
        else:
            rows = kv.contiguous().view(torch.uint8)
        return q, rows, xn @ self.w_iq[layer], xn @ self.w_ik[layer]

    def post(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, D] + attn bf16 [T, H, 512] projected back."""
        return x + (attn.reshape(attn.shape[0], -1) @ self.w_o[layer]).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) @ self.w_out


def synthetic_rows(cfg: MiniEngineConfig, rid: int, layer: int, n: int, device: torch.device):
    """Deterministic random context rows uint8 [n, row_bytes] and indexer keys fp32 [n, di]."""
    from ..formats import quantize_fp8_ds_mla

    g = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + rid * 1009 + layer)
    kv = torch.randn(n, D_QK, generator=g, device=device).to(torch.bfloat16)
    ik = torch.randn(n, cfg.indexer_dim, generator=g, device=device) / math.sqrt(cfg.indexer_dim)
    if RowFormat.parse(cfg.row_format) is RowFormat.FP8_DS_MLA:
        return quantize_fp8_ds_mla(kv, validate=False), ik
    return kv.view(torch.uint8), ik


# ---------------------------------------------------------------------- indexer
class Indexer:
    """Per-layer indexer keys on the device: fp32 [L, slots, max_context, d_idx]."""

    def __init__(self, cfg: MiniEngineConfig, slots: int, device: torch.device) -> None:
        self.keys = torch.zeros(cfg.num_layers, slots, cfg.max_context, cfg.indexer_dim, device=device)
        self.K = cfg.top_k
        self.q = cfg.query_len

    def write(self, layer: int, ik: torch.Tensor, dst: torch.Tensor) -> None:
        """ik fp32 [T, di] to flat (slot * max_context + pos) rows ``dst`` int64 [T]."""
        self.keys[layer].view(-1, self.keys.shape[-1]).index_copy_(0, dst, ik)

    def _select(self, scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """scores fp32 [n, C], pos int64 [n] (own position) -> top-k int32 [n, K], -1 padded."""
        n, C = scores.shape
        cols = torch.arange(C, device=scores.device)
        scores = scores.masked_fill(cols[None, :] > pos[:, None], float("-inf"))
        k = min(self.K, C)
        vals, idx = torch.topk(scores, k, dim=1)
        idx = torch.where(torch.isinf(vals), torch.full_like(idx, -1), idx).to(torch.int32)
        if k < self.K:
            idx = torch.cat([idx, idx.new_full((n, self.K - k), -1)], dim=1)
        return idx

    def decode_topk(self, layer: int, iq: torch.Tensor, slots: torch.Tensor, sub: torch.Tensor,
                    pos: torch.Tensor, ctx: int) -> torch.Tensor:
        """Decode tokens: iq fp32 [Td, di], their slots/sub-token index/positions int64 [Td]."""
        keys = self.keys[layer, :, :ctx]  # [slots, C, di]
        qs = iq.new_zeros(keys.shape[0], keys.shape[2], self.q)
        qs[slots, :, sub] = iq
        scores = torch.bmm(keys, qs)  # [slots, C, q]
        return self._select(scores[slots, :, sub], pos)

    def prefill_topk(self, layer: int, iq: torch.Tensor, slot: int, p0: int) -> torch.Tensor:
        """One prefill chunk: iq fp32 [n, di] at positions p0 .. p0+n-1 of ``slot``."""
        n = iq.shape[0]
        keys = self.keys[layer, slot, :p0 + n]  # [C, di]
        pos = torch.arange(p0, p0 + n, device=iq.device)
        return self._select(iq @ keys.T, pos)


# ---------------------------------------------------------------------- KV stores
class ResidentKV:
    """An ordinary paged device KV cache holding every row (the baseline)."""

    name = "resident"

    def __init__(self, cfg: MiniEngineConfig, slots: int, device: torch.device) -> None:
        self.bs = cfg.host_block_size
        self.max_blocks = -(-cfg.max_context // self.bs)
        nblocks = slots * self.max_blocks
        rb = RowFormat.parse(cfg.row_format).row_bytes
        self.rows = torch.zeros(cfg.num_layers, nblocks * self.bs, rb, dtype=torch.uint8, device=device)
        self.free = list(range(nblocks - 1, -1, -1))
        self.block_table = torch.full((slots, self.max_blocks), -1, dtype=torch.int32, device=device)
        self.owned: dict[int, list[int]] = {}
        self.device = device
        self.validate = cfg.validate
        self.fmt = RowFormat.parse(cfg.row_format)

    def admit(self, req: Request) -> None:
        n = -(-req.total // self.bs)
        blocks = [self.free.pop() for _ in range(n)]
        self.owned[req.rid] = blocks
        self.block_table[req.slot].fill_(-1)
        self.block_table[req.slot, :n] = torch.tensor(blocks, dtype=torch.int32, device=self.device)

    def release(self, req: Request) -> None:
        self.free.extend(self.owned.pop(req.rid))

    def _rows_of(self, spans: list[tuple[Request, int, int]]) -> torch.Tensor:
        """int64 [n] device: global rows of positions [p0, p1) of each (request, p0, p1), concatenated."""
        from ..cache.write_plan import expand_runs as _expand_runs

        pos = _expand_runs([(p0, p1 - p0, 1) for _, p0, p1 in spans])
        slot = _expand_runs([(r.slot, p1 - p0, 0) for r, p0, p1 in spans])
        both = torch.stack([pos, slot]).to(self.device)
        pos, slot = both[0], both[1]
        return self.block_table[slot, pos // self.bs].long() * self.bs + pos % self.bs

    def begin(self, batch: "Batch") -> None:
        self._dst = self._rows_of([(r, r.done, r.done + n) for r, n in batch.items])
        pre = batch.items[batch.md.num_decodes:]
        self._ws_src = self._rows_of([(r, 0, r.done + n) for r, n in pre])

    def write(self, layer: int, rows: torch.Tensor, batch: "Batch") -> None:
        self.rows[layer].index_copy_(0, self._dst, rows)

    def decode_rows(self, layer: int, topk: torch.Tensor, batch: "Batch"):
        from ..staging import BlockTable, convert_topk_to_physical

        phys = convert_topk_to_physical(topk, batch.dec_slots, BlockTable(self.block_table, self.bs),
                                        validate=self.validate).physical
        return self.rows[layer], phys

    def prefill_workspace(self, layer: int, ws: torch.Tensor, batch: "Batch") -> None:
        from ..formats import dequantize_fp8_ds_mla

        rows = self.rows[layer].index_select(0, self._ws_src)
        n = rows.shape[0]
        if self.fmt is RowFormat.FP8_DS_MLA:
            ws[:n] = dequantize_fp8_ds_mla(rows)
        else:
            ws[:n] = rows.view(torch.bfloat16)

    def fill(self, req: Request, layer: int, rows: torch.Tensor) -> None:
        self.rows[layer].index_copy_(0, self._rows_of([(req, 0, rows.shape[0])]), rows)

    def stats(self) -> dict:
        return {}


class HiSparseKV:
    """The same calls served by a :class:`hisparse.engine.HiSparseIndexGroup`."""

    name = "hisparse"

    def __init__(self, cfg: MiniEngineConfig, slots: int, device: torch.device) -> None:
        from ..engine import HiSparseIndexGroup

        self.group = HiSparseIndexGroup(cfg.cache_config(), validate=cfg.validate, kernels=cfg.cache_kernels)
        for _ in range(cfg.num_layers):
            self.group.register_layer(kv_cache_dtype=cfg.row_format)
        self.device = device

    def admit(self, req: Request) -> None:
        self.group.add_request(req.rid)

    def release(self, req: Request) -> None:
        self.group.free_request(req.rid)

    def begin(self, batch: "Batch") -> None:
        self.group.prepare_for_batch(batch.md)

    def write(self, layer: int, rows: torch.Tensor, batch: "Batch") -> None:
        self.group.write_new_rows(layer, rows, batch.md)

    def decode_rows(self, layer: int, topk: torch.Tensor, batch: "Batch"):
        phys = self.group.convert_decode_logical_to_physical_topk(layer, topk, batch.md,
                                                                  return_valid_counts=False)
        return self.group.physical_kv_cache(layer), phys

    def prefill_workspace(self, layer: int, ws: torch.Tensor, batch: "Batch") -> None:
        md = batch.md
        ev = self.group.gather_fp8_prefill(layer, None, ws, None, batch.ws_starts, md.num_prefills, md, 0)
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
        return self.group.stats()


# ---------------------------------------------------------------------- engine
@dataclasses.dataclass
class Batch:
    items: list[tuple[Request, int]]  # (request, tokens this step), decodes first
    md: SparseMLAMetadata
    dec_slots: torch.Tensor  # int32 [Td] engine slot per decode token
    ws_starts: torch.Tensor  # int32 [P] workspace start of each prefill request
    ws_starts_cpu: list[int]
    ws_rows: int


class MiniEngine:
    """Runs the workload through one KV store; records the final hidden state of every token."""

    def __init__(self, cfg: MiniEngineConfig, kv_kind: str) -> None:
        from ..attention.base import Phase
        from ..attention.chooser import choose_backend
        from ..device import resolve_device

        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.slots = cfg.max_num_reqs or cfg.num_requests
        self.model = Model(cfg, self.device)
        self.indexer = Indexer(cfg, self.slots, self.device)
        self.recorder = None  # a traces.TraceRecorder: decode steps' top-k go there (run(record=))
        kinds = {"resident": ResidentKV, "hisparse": HiSparseKV}
        if kv_kind not in kinds:
            raise ValueError(f"kv_kind must be one of {sorted(kinds)}, got {kv_kind!r}")
        self.kv = kinds[kv_kind](cfg, self.slots, self.device)
        fmt = RowFormat.parse(cfg.row_format)

        def pick(phase, row_format):
            be = choose_backend(device=self.device, row_format=row_format, num_heads=cfg.num_heads, phase=phase,
                                prefer=cfg.backend, flashmla_lib=cfg.flashmla_lib)
            if not cfg.validate and be.name == "triton":  # skip the host-syncing range check
                from ..attention.triton_backend import TritonBackend

                be = TritonBackend(validate=False)
            elif not cfg.validate and be.name == "flashmla":
                from ..attention.flashmla import FlashMLABackend

                be = FlashMLABackend(library_path=cfg.flashmla_lib, check_ranges=False)
            return be

        self.decode_backend = pick(Phase.DECODE, fmt)
        self.prefill_backend = pick(Phase.PREFILL, RowFormat.BF16)
        self.fmt = fmt
        self.ws = torch.zeros(self.slots * cfg.max_context, D_QK, dtype=torch.bfloat16, device=self.device)

    # ---- scheduling -------------------------------------------------------
    def _schedule(self, running: list[Request]) -> list[tuple[Request, int]]:
        cfg = self.cfg
        dec = [(r, cfg.query_len) for r in running if r.done >= r.prompt_len]
        budget = cfg.max_batch_tokens - len(dec) * cfg.query_len
        pre = []
        for r in running:
            if r.done < r.prompt_len and budget > 0:
                n = min(cfg.chunk, r.prompt_len - r.done, budget)
                pre.append((r, n))
                budget -= n
        return dec + pre

    def _batch(self, items: list[tuple[Request, int]]) -> Batch:
        nd = sum(1 for r, _ in items if r.done >= r.prompt_len)
        md = SparseMLAMetadata.build(request_ids=[r.rid for r, _ in items], query_lens=[n for _, n in items],
                                     seq_lens=[r.done + n for r, n in items], num_decodes=nd,
                                     device=self.device)
        dec_slots = [r.slot for r, n in items[:nd] for _ in range(n)]
        starts, acc = [], 0
        for r, n in items[nd:]:
            starts.append(acc)
            acc += r.done + n
        i32 = dict(dtype=torch.int32, device=self.device)
        return Batch(items, md, torch.tensor(dec_slots, **i32), torch.tensor(starts, **i32), starts, acc)

    # ---- one forward --------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        cfg, md, dev = self.cfg, batch.md, self.device
        toks, pos, slots, sub = [], [], [], []
        for r, n in batch.items:
            toks.append(r.tokens[r.done:r.done + n])
            pos += range(r.done, r.done + n)
            slots += [r.slot] * n
            sub += range(n)
        tok = torch.cat(toks).to(dev)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        sub_t = torch.tensor(sub, dtype=torch.int64, device=dev)
        flat = slot_t * cfg.max_context + pos_t
        td, nd = md.num_decode_tokens, md.num_decodes
        ctx = max((r.done + n for r, n in batch.items[:nd]), default=0)
        self.kv.begin(batch)
        x = self.model.embed[tok]
        T = x.shape[0]
        for layer in range(cfg.num_layers):
            q, rows, iq, ik = self.model.pre(layer, x, cfg.validate)
            self.kv.write(layer, rows, batch)
            self.indexer.write(layer, ik, flat)
            out = torch.zeros(T, cfg.num_heads, D_V, dtype=torch.bfloat16, device=dev)
            if td:
                topk = self.indexer.decode_topk(layer, iq[:td], slot_t[:td], sub_t[:td], pos_t[:td], ctx)
                if self.recorder is not None:
                    if layer == 0:  # one entry per decode token (q = 1): the request and its length
                        rids = [r.rid for r, n in batch.items[:nd] for _ in range(n)]
                        self.recorder.begin_step(rids, (pos_t[:td] + 1).tolist())
                    self.recorder.add_layer(layer, topk)
                kv_rows, phys = self.kv.decode_rows(layer, topk, batch)
                out[:td] = self.decode_backend.decode(q[:td], kv_rows, phys, sm_scale=self.model.sm_scale,
                                                      row_format=self.fmt)[0]
            if T > td:
                parts, t = [], td
                for j, (r, n) in enumerate(batch.items[nd:]):
                    tk = self.indexer.prefill_topk(layer, iq[t:t + n], r.slot, r.done)
                    start = batch.ws_starts_cpu[j]
                    parts.append(torch.where(tk >= 0, tk + start, tk))
                    t += n
                idx = torch.cat(parts)
                self.kv.prefill_workspace(layer, self.ws, batch)
                out[td:] = self.prefill_backend.prefill(q[td:], self.ws[:batch.ws_rows], idx,
                                                        sm_scale=self.model.sm_scale)[0]
            x = self.model.post(layer, x, out)
        return x

    # ---- serving loop ---------------------------------------------------------
    def run(self, progress=None) -> dict:
        cfg, dev = self.cfg, self.device
        reqs = make_workload(cfg)
        pending = sorted(reqs, key=lambda r: r.arrival)
        running: list[Request] = []
        free_slots = list(range(self.slots - 1, -1, -1))
        outputs = {r.rid: torch.zeros(r.total, cfg.hidden, device=dev) for r in reqs}
        argmax = {r.rid: torch.zeros(r.total, dtype=torch.int64, device=dev) for r in reqs}
        step, tokens, step_times, decode_step_times = 0, 0, [], []
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        sync()
        t_start = time.perf_counter()
        fill_time = 0.0
        while pending or running:
            while pending and pending[0].arrival <= step and free_slots:
                r = pending.pop(0)
                r.slot = free_slots.pop()
                r.done = 0
                self.kv.admit(r)
                if cfg.synthetic_context:
                    t0 = time.perf_counter()
                    self._fill(r)
                    sync()
                    fill_time += time.perf_counter() - t0
                running.append(r)
            if not running:
                step += 1
                continue
            items = self._schedule(running)
            batch = self._batch(items)
            t0 = time.perf_counter()
            x = self.forward(batch)
            t = 0
            for r, n in items:
                outputs[r.rid][r.done:r.done + n] = x[t:t + n]
                t += n
            sync()
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if batch.md.num_prefills == 0:
                decode_step_times.append(dt)
            tokens += x.shape[0]
            for r, n in items:
                r.done += n
                if r.done >= r.total:
                    running.remove(r)
                    self.kv.release(r)
                    free_slots.append(r.slot)
            step += 1
            if progress is not None:
                progress(step, len(running), len(pending))
        sync()
        total = time.perf_counter() - t_start - fill_time
        for r in reqs:
            argmax[r.rid] = self.model.logits(outputs[r.rid]).argmax(dim=-1)
        return {"outputs": outputs, "argmax": argmax, "tokens": tokens, "steps": step, "time_s": total,
                "step_times": step_times, "decode_step_times": decode_step_times, "fill_time_s": fill_time,
                "stats": self.kv.stats(), "synthetic": cfg.synthetic_context}

    def _fill(self, r: Request) -> None:
        n = self.cfg.synthetic_context
        flat = r.slot * self.cfg.max_context + torch.arange(n, device=self.device)
        for layer in range(self.cfg.num_layers):
            rows, ik = synthetic_rows(self.cfg, r.rid, layer, n, self.device)
            self.kv.fill(r, layer, rows)
            self.indexer.write(layer, ik, flat)
        r.done = n


# ---------------------------------------------------------------------- compare + report
def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"n": len(s), "min_ms": s[0] * 1e3, "median_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3}


def compare(cfg: MiniEngineConfig, a: dict, b: dict) -> dict:
    """Token-by-token comparison of two runs' final hidden states and argmax tokens."""
    max_diff, scale, mismatched, n = 0.0, 0.0, 0, 0
    s = cfg.synthetic_context
    for rid in a["outputs"]:
        xa, xb = a["outputs"][rid][s:], b["outputs"][rid][s:]
        max_diff = max(max_diff, float((xa - xb).abs().max()) if xa.numel() else 0.0)
        scale = max(scale, float(xa.abs().max()) if xa.numel() else 0.0)
        mismatched += int((a["argmax"][rid][s:] != b["argmax"][rid][s:]).sum())
        n += xa.shape[0]
    rel = max_diff / scale if scale else 0.0
    return {"tokens_compared": n, "max_abs_diff": max_diff, "max_rel_diff": rel,
            "argmax_mismatches": mismatched, "bitwise_equal": max_diff == 0.0,
            "within_tolerance": rel <= cfg.tolerance}


def run(cfg: MiniEngineConfig, *, progress: bool = False, record: str | None = None) -> dict:
    """Run the workload resident then hisparse; return the comparison and timings (no tensors).

    ``record``: write the decode steps' top-k (this model's real indexer) to a trace file
    in the format of ``hisparse.tools.traces``, which ``hisparse stress --replay`` drives
    the cache with. Needs query_len 1 (one trace entry per request and step).
    """
    recorder = None
    if record is not None:
        if cfg.query_len != 1:
            raise ValueError(f"--record needs query_len 1 (one trace entry per request and step), "
                             f"got {cfg.query_len}")
        from .traces import TraceRecorder

        recorder = TraceRecorder(num_layers=cfg.num_layers, top_k=cfg.top_k)
    results = {}
    for kind in ("resident", "hisparse"):
        # each engine starts from a collected heap: without this the second one ran next
        # to the first one's uncollected objects (GPU tensors included), and every host
        # call of the second run was slower (hisparse second: 26.7 ms per decode step,
        # first: 17.4 ms; 64 requests, 8 layers, 32K contexts on the H200)
        gc.collect()
        eng = MiniEngine(cfg, kind)
        if kind == "resident":
            eng.recorder = recorder  # the selections are the same in both runs
        cb = None
        if progress:
            def cb(step, nrun, npend, kind=kind):
                print(f"\r[{kind}] step {step} running {nrun} pending {npend}", end="", file=sys.stderr)
        res = eng.run(cb)
        if progress:
            print(file=sys.stderr)
        res["backend"] = {"decode": eng.decode_backend.name, "prefill": eng.prefill_backend.name}
        results[kind] = res
        del eng
        gc.collect()
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    cmp = compare(cfg, results["resident"], results["hisparse"])
    out = {"config": dataclasses.asdict(cfg), "compare": cmp}
    if recorder is not None:
        recorder.save(record)
        out["trace"] = {"path": str(record), "decode_steps": recorder.num_steps}
    for kind, res in results.items():
        tps = res["tokens"] / res["time_s"] if res["time_s"] > 0 else 0.0
        st_ms = _pcts(res["step_times"])
        med = st_ms.get("median_ms")
        slow = [t for t in res["step_times"] if med and t * 1e3 > 10 * med]
        out[kind] = {"tokens": res["tokens"], "steps": res["steps"], "time_s": res["time_s"],
                     "tokens_per_s": tps, "step": st_ms,
                     # steps over 10x the median (e.g. a kernel compiling for new shapes)
                     # make tokens_per_s meaningless as a comparison: reported, not hidden
                     "outlier_steps": len(slow), "outlier_s": sum(slow),
                     "decode_step": _pcts(res["decode_step_times"]), "fill_time_s": res["fill_time_s"],
                     "backend": res["backend"]}
    st = results["hisparse"]["stats"]
    tot = st.get("total", {})
    out["hisparse"]["cache"] = {k: tot.get(k) for k in ("hits", "misses", "hit_rate", "bytes_h2d",
                                                         "bytes_d2h", "invalid", "resolves")}
    r, h = out["resident"], out["hisparse"]
    out["ratio"] = {
        "tokens_per_s_hisparse_over_resident": h["tokens_per_s"] / r["tokens_per_s"] if r["tokens_per_s"] else None,
        "decode_step_median_hisparse_over_resident":
            (h["decode_step"]["median_ms"] / r["decode_step"]["median_ms"])
            if r["decode_step"].get("n") and h["decode_step"].get("n") else None,
    }
    return out


def format_report(res: dict) -> str:
    c, r, h = res["compare"], res["resident"], res["hisparse"]
    cache = h["cache"]
    lines = [
        f"backends: decode={r['backend']['decode']} prefill={r['backend']['prefill']}",
        f"{'run':<10}{'tokens':>9}{'steps':>7}{'tok/s':>12}{'step med ms':>13}{'decode med ms':>15}"
        f"{'decode p99 ms':>15}",
    ]
    for name, d in (("resident", r), ("hisparse", h)):
        ds = d["decode_step"]
        lines.append(f"{name:<10}{d['tokens']:>9}{d['steps']:>7}{d['tokens_per_s']:>12.1f}"
                     f"{d['step'].get('median_ms', float('nan')):>13.3f}"
                     f"{ds.get('median_ms', float('nan')):>15.3f}{ds.get('p99_ms', float('nan')):>15.3f}")
    for name, d in (("resident", r), ("hisparse", h)):
        if d.get("outlier_steps"):
            lines.append(f"WARNING: {name} had {d['outlier_steps']} step(s) over 10x the median "
                         f"({d['outlier_s']:.2f} s in all, e.g. kernels compiling): compare the "
                         "step medians, not tokens/s")
    ratio = res["ratio"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines += [
        f"ratio hisparse/resident: tokens/s {fmt(ratio['tokens_per_s_hisparse_over_resident'])}, "
        f"decode step median {fmt(ratio['decode_step_median_hisparse_over_resident'])}",
        f"hisparse cache: hit rate {cache['hit_rate']:.4f} (hits {cache['hits']}, misses {cache['misses']}), "
        f"bytes h2d {cache['bytes_h2d']}, bytes d2h {cache['bytes_d2h']}, invalid {cache['invalid']}",
        f"outputs: {c['tokens_compared']} tokens compared, max |diff| {c['max_abs_diff']:.3e} "
        f"(relative {c['max_rel_diff']:.3e}), argmax mismatches {c['argmax_mismatches']}, "
        f"{'bitwise equal' if c['bitwise_equal'] else 'not bitwise equal'}, "
        f"{'WITHIN' if c['within_tolerance'] else 'OUTSIDE'} tolerance",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI
PRESETS = {
    "cpu": {},
    "h200": dict(num_layers=8, num_heads=128, hidden=256, indexer_dim=64, vocab=1024, top_k=2048,
                 num_requests=64, min_prompt=30 * 1024, max_prompt=32 * 1024, min_decode=24, max_decode=32,
                 arrival_every=0, chunk=2048, max_batch_tokens=8192, host_block_size=64, device="cuda",
                 synthetic_context=28 * 1024, locality=0.98),
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="hisparse mini-engine",
        description="Serve a random-weight sparse-MLA model with a resident KV cache and with hisparse; "
                    "check the outputs match and compare speed.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="base sizes (flags override)")
    fields = {f.name: f for f in dataclasses.fields(MiniEngineConfig)}
    for name, f in fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "validate":
            p.add_argument("--unchecked", dest="validate", action="store_false", default=None,
                           help="skip host-syncing validation in the hot loop")
            continue
        ann = str(f.type)
        typ = float if "float" in ann else int if "int" in ann else str
        p.add_argument(flag, dest=name, type=typ, default=None, help=f"(default {f.default})")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--progress", action="store_true", help="print progress on stderr")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="write the decode steps' top-k (the real indexer's) to a .npz trace; "
                        "replay it with `hisparse stress --replay FILE` (needs --query-len 1)")
    return p


def config_from_args(args: argparse.Namespace) -> MiniEngineConfig:
    kw = dict(PRESETS[args.preset])
    for f in dataclasses.fields(MiniEngineConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            kw[f.name] = v
    return MiniEngineConfig(**kw)


def run_args(args: argparse.Namespace) -> int:
    """Run from parsed arguments; prints the report; exit status 1 when outputs differ."""
    cfg = config_from_args(args)
    res = run(cfg, progress=args.progress, record=args.record)
    text = format_report(res)
    print(json.dumps(res, indent=2) if args.json else text)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0 if res["compare"]["within_tolerance"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
