"""The mini engine's model (random weights) and its top-k indexer.

Per layer l, from rmsnorm(x), x fp32 [T, D]:
  q   = x W_q[l]   -> bf16 [T, H, D_ROW]          (absorbed-MLA query)
  kv  = x W_kv[l]  -> one D_ROW-value row per token, stored as fp8_ds_mla (or bf16)
  ik  = x W_ik[l]  -> indexer key fp32 [T, d_idx], kept on the device per request
  iq  = x W_iq[l]  -> indexer query; scores = iq . ik over positions <= own position,
                      top-k per query token (-1 padded when the context is shorter)
  (ik, iq and the top-k only in Full layers, l % index_share == 0; a Shared layer reuses
  the top-k of the Full layer before it, as IndexCache's models do, arXiv 2603.12201)
  x  += attn(q, rows[top-k]) [T, H * D_LATENT] W_o[l]
logits = rmsnorm(x) W_out. Token embeddings share a common direction with weight
``locality`` (0..1): a high value makes consecutive indexer queries similar, as real
indexers' are, so hot rows get reused. ``index_correlation`` a (0..1) does the same
across layers: every Full layer's W_iq, W_ik and synthetic indexer keys are
a * (a part common to all layers) + sqrt(1 - a^2) * (the layer's own), so adjacent
layers select overlapping positions, as trained indexers do (IndexCache measured 70-100%).
"""

from __future__ import annotations

import math

import torch

from hisparse.config import RowFormat
from hisparse.formats import D_LATENT, D_ROW, quantize_fp8_ds_mla
from .config import MiniEngineConfig
from .ffn import FFN
from .scores import indexer_scores


class Model:
    """Random-weight sparse-MLA stack; every tensor on ``device``."""

    def __init__(self, cfg: MiniEngineConfig, device: torch.device) -> None:
        # drawn on the device: a wide model's weights would take seconds on the host
        g = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        D, H, L, di = cfg.hidden, cfg.num_heads, cfg.num_layers, cfg.indexer_dim
        F = cfg.index_layers

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=device) / math.sqrt(fan_in)

        common = torch.randn(D, generator=g, device=device)
        common = common / common.norm() * math.sqrt(D)
        own = torch.randn(cfg.vocab, D, generator=g, device=device)
        a = cfg.locality
        self.embed = a * common + math.sqrt(1 - a * a) * own  # fp32 [V, D]
        self.w_q = w(L, D, H * D_ROW, fan_in=D).to(torch.bfloat16)
        self.w_kv = w(L, D, D_ROW, fan_in=D).to(torch.bfloat16)
        self.w_iq = w(F, D, di, fan_in=D)  # Full layer l's at l // index_share
        self.w_ik = w(F, D, di, fan_in=D)
        self.share = cfg.index_share
        self.w_o = w(L, H * D_LATENT, D, fan_in=H * D_LATENT).to(torch.bfloat16)
        self.w_out = w(D, cfg.vocab, fan_in=D)
        if cfg.index_correlation:  # its own generator: every other weight stays as without it
            gc = torch.Generator(device=device).manual_seed(cfg.seed + 2)
            a = cfg.index_correlation
            b = math.sqrt(1 - a * a)
            self.w_iq = a * torch.randn(D, di, generator=gc, device=device) / math.sqrt(D) + b * self.w_iq
            self.w_ik = a * torch.randn(D, di, generator=gc, device=device) / math.sqrt(D) + b * self.w_ik
        self.H = H
        self.fmt = cfg.row_format
        self.sm_scale = 1.0 / math.sqrt(D_ROW)
        self.ffn = FFN(kind=cfg.ffn, num_layers=L, hidden=D, intermediate=cfg.ffn_intermediate,
                       experts=cfg.ffn_experts, active=cfg.ffn_active, shared=cfg.ffn_shared, seed=cfg.seed,
                       device=device, routing=cfg.ffn_routing)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)

    def pre(self, layer: int, x: torch.Tensor, validate: bool):
        """x fp32 [T, D] -> xb bf16 [T, D] (the normed input of :meth:`q_proj`), rows uint8
        [T, row_bytes], iq/ik fp32 [T, di] (None in a Shared layer). The query comes
        later (``q_proj``): the indexer and the rows do not need it, so a cache can stage
        rows meanwhile."""
        xn = self._norm(x)
        xb = xn.to(torch.bfloat16)
        kv = xb @ self.w_kv[layer]  # bf16 [T, D_ROW]
        if self.fmt is RowFormat.FP8_DS_MLA:
            rows = quantize_fp8_ds_mla(kv, validate=validate)
        else:
            rows = kv.contiguous().view(torch.uint8)
        if layer % self.share:
            return xb, rows, None, None
        f = layer // self.share
        return xb, rows, xn @ self.w_iq[f], xn @ self.w_ik[f]

    def q_proj(self, layer: int, xb: torch.Tensor) -> torch.Tensor:
        """xb bf16 [T, D] (from :meth:`pre`) -> q bf16 [T, H, D_ROW]."""
        return (xb @ self.w_q[layer]).view(-1, self.H, D_ROW)

    def post(self, layer: int, x: torch.Tensor, attn: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, D] + attn bf16 [T, H, D_LATENT] projected back, then the rest of
        the layer (the ffn stand-in, :mod:`.ffn`); x0 fp32 [T, D]: the tokens' input
        embeddings (what "token" routing routes by)."""
        return self.ffn(layer, x + (attn.reshape(attn.shape[0], -1) @ self.w_o[layer]).float(), route_x=x0)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) @ self.w_out


def synthetic_rows(cfg: MiniEngineConfig, rid: int, layer: int, n: int, device: torch.device):
    """Deterministic random context rows uint8 [n, row_bytes] and indexer keys fp32 [n, di]
    (drawn in every layer, so a row does not depend on ``index_share``)."""
    g = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + rid * 1009 + layer)
    kv = torch.randn(n, D_ROW, generator=g, device=device).to(torch.bfloat16)
    ik = torch.randn(n, cfg.indexer_dim, generator=g, device=device) / math.sqrt(cfg.indexer_dim)
    if cfg.index_correlation:  # the request's part common to all layers (index_correlation)
        gc = torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + rid * 1009) | (1 << 62))
        a = cfg.index_correlation
        common = torch.randn(n, cfg.indexer_dim, generator=gc, device=device) / math.sqrt(cfg.indexer_dim)
        ik = a * common + math.sqrt(1 - a * a) * ik
    if cfg.row_format is RowFormat.FP8_DS_MLA:
        return quantize_fp8_ds_mla(kv, validate=False), ik
    return kv.view(torch.uint8), ik


class Indexer:
    """The Full layers' indexer keys on the device: fp32 [F, slots + 1, max_context, d_idx]
    (F = ceil(L / index_share), Full layer l at l // index_share); the last slot is the
    scratch slot padding tokens of a bucketed decode step write to. Every method takes
    a Full layer's index and refuses a Shared one."""

    def __init__(self, cfg: MiniEngineConfig, slots: int, device: torch.device) -> None:
        self.keys = torch.zeros(cfg.index_layers, slots + 1, cfg.max_context, cfg.indexer_dim, device=device)
        self.slots = slots
        self.K = cfg.top_k
        self.q = cfg.query_len
        self.share = cfg.index_share

    def _keys(self, layer: int) -> torch.Tensor:
        if layer % self.share:
            raise ValueError(f"layer {layer} is a Shared layer (index_share={self.share}): it has no indexer")
        return self.keys[layer // self.share]

    def write(self, layer: int, ik: torch.Tensor, dst: torch.Tensor) -> None:
        """ik fp32 [T, di] to flat (slot * max_context + pos) rows ``dst`` int64 [T]."""
        self._keys(layer).view(-1, self.keys.shape[-1]).index_copy_(0, dst, ik)

    def _select(self, scores: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """scores fp32 [n, C], pos int64 [n] (own position; None: scores already masked
        past it) -> top-k int32 [n, K], -1 padded."""
        n, C = scores.shape
        if pos is not None:
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
        keys = self._keys(layer)[:self.slots, :ctx]  # [slots, C, di]
        return self._select(indexer_scores(keys, iq, slots, sub, pos, self.q), None)

    def decode_topk_fixed(self, layer: int, iq: torch.Tensor, slots: torch.Tensor, sub: torch.Tensor,
                          lim: torch.Tensor) -> torch.Tensor:
        """Decode top-k with shapes fixed by the token count (CUDA-graph capturable): iq fp32
        [n, di]; slots / sub int64 [n]; lim int64 [n], the last position a token may
        select (its own; -1 selects nothing: a padding token). Scores cover every slot's
        whole max context, masked past ``lim`` -> int32 [n, K], -1 padded."""
        keys = self._keys(layer)  # [slots + 1, C, di]
        return self._select(indexer_scores(keys, iq, slots, sub, lim, self.q), None)

    def prefill_topk(self, layer: int, iq: torch.Tensor, slot: int, p0: int) -> torch.Tensor:
        """One prefill chunk: iq fp32 [n, di] at positions p0 .. p0+n-1 of ``slot``."""
        n = iq.shape[0]
        keys = self._keys(layer)[slot, :p0 + n]  # [C, di]
        pos = torch.arange(p0, p0 + n, device=iq.device)
        return self._select(iq @ keys.T, pos)


__all__ = ["Model", "synthetic_rows", "Indexer"]
