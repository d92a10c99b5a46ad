"""The rest of a transformer layer, as a stand-in: a dense MLP or a grouped-GEMM MoE.

Without it a mini-engine decode step is all attention and indexer; with it a step also
reads a layer's worth of feed-forward weights, which is what makes a larger decode
batch cheaper per token on a real model. Random bf16 weights from the seed (drawn on
the device), applied after attention on the residual stream of width ``hidden``:

  none   x unchanged
  mlp    x += W_down (silu(xn W_gate) * (xn W_up))                 intermediate I
  moe    router: top-``ffn_active`` of ``ffn_experts`` experts per token (softmax over
         the chosen logits), each expert a gated MLP of intermediate I, run as two
         grouped GEMMs (``torch._grouped_mm``) over the token-expert pairs sorted by
         expert; plus ``ffn_shared`` shared experts (one gated MLP of intermediate
         ``ffn_shared * I``) on every token

xn = rmsnorm(x) in bf16. Routing "content" (the default) chooses a token's experts from
xn, as a real router does; "token" chooses them from the normed embedding of the
token's input (the same logits and top-k, another input), so that differences at the
rounding level in the hidden state can't send a token to other experts. Under
"content", two runs whose attention rounds differently (a split decode layer against a
serial one, or two batch sizes' GEMMs) see some tokens routed differently, and those
tokens' outputs differ by far more than the rounding; "token" keeps the step's cost
and lets an output comparison see the rest. Every shape is fixed by the token count (T tokens give
T * active pairs; expert boundaries are a device cumsum), no host sync, so the MoE is
CUDA-graph capturable; the combine is a gather + weighted sum (deterministic, unlike an
atomic index_add).

``V32_EP8_SHARE``: one H200's share of a DeepSeek-V3.2 MoE layer served with data-
parallel attention and 8-way expert parallelism. The model has hidden 7168, 256 routed
experts of intermediate 2048 with 8 active per token, and 1 shared expert of
intermediate 2048 (first 3 of its 61 layers are dense instead). With the 256 experts
split over 8 GPUs, each GPU holds 32; with every GPU serving its own decode batch of T
tokens and balanced routing, the token-expert pairs a GPU receives number 8 T (8 T
tokens x 8 choices / 8 GPUs), i.e. the same work as its own T tokens each choosing 8 of
its 32 local experts, which is what the stand-in computes. The shared expert runs on
every GPU for its own tokens. Weights: 32 x 3 x 7168 x 2048 = 1.41 G parameters per
layer, 2.82 GB in bf16 (the real model stores them in fp8 with block scales: half the
bytes; the stand-in reads twice what the real layer reads). The dispatch/combine
all-to-all between GPUs is not modelled.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F

from hisparse.config import parse_enum

V32_EP8_SHARE = dict(hidden=7168, ffn="moe", ffn_intermediate=2048, ffn_experts=32, ffn_active=8,
                     ffn_shared=1)
V32_HIDDEN = 7168


def v32_share_at(hidden: int) -> dict:
    """``V32_EP8_SHARE`` at a narrower residual width ``hidden``: the intermediate size
    scaled by 7168 / hidden (rounded to a multiple of 8), so each expert's weights (3 x
    hidden x I) and the FLOPs per token-expert pair stay those of the real layer. The
    mini model's own attention projections (hidden x heads x (576 + 512)) are then
    187 M parameters at hidden 1344 and 128 heads, about DeepSeek-V3.2's per-layer
    attention weights (q_a, q_b, kv_a, the absorbed k/v up-projections and o_proj:
    ~187 M), so a step reads about a real layer's weights."""
    inter = max(8, round(2048 * V32_HIDDEN / hidden / 8) * 8)
    return dict(V32_EP8_SHARE, hidden=hidden, ffn_intermediate=inter)


class FFNKind(enum.Enum):
    NONE = "none"
    MLP = "mlp"
    MOE = "moe"

    @classmethod
    def parse(cls, v: "FFNKind | str") -> "FFNKind":
        return parse_enum(cls, v, "ffn")


class FFNRouting(enum.Enum):
    """How the MoE stand-in picks a token's experts: from its hidden state (CONTENT) or
    from its input embedding (TOKEN)."""

    CONTENT = "content"
    TOKEN = "token"

    @classmethod
    def parse(cls, v: "FFNRouting | str", name: str = "ffn_routing") -> "FFNRouting":
        return parse_enum(cls, v, name)


def ffn_weight_bytes(*, kind: FFNKind | str, num_layers: int, hidden: int, intermediate: int, experts: int,
                     shared: int) -> int:
    """Bytes of the stand-in's weights (bf16 matrices, fp32 router)."""
    kind = FFNKind.parse(kind)
    D, I = hidden, intermediate
    if kind is FFNKind.NONE:
        return 0
    if kind is FFNKind.MLP:
        return num_layers * 3 * D * I * 2
    return num_layers * ((experts + shared) * 3 * D * I * 2 + D * experts * 4)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a bf16 [M, Kd] rows sorted by group, b bf16 [E, Kd, N], offs int32 [E] end row of
    each group (cumsum of the group sizes) -> bf16 [M, N]; row m uses b[group of m]."""
    return torch._grouped_mm(a, b, offs=offs)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The same product, one matmul per group (host loop; the test oracle)."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[e]
        start = end
    return out


class FFN:
    """The stand-in of one model: per-layer weights on ``device`` (see the module docstring)."""

    def __init__(self, *, kind: FFNKind | str, num_layers: int, hidden: int, intermediate: int, experts: int,
                 active: int, shared: int, seed: int, device: torch.device,
                 routing: FFNRouting | str = FFNRouting.CONTENT) -> None:
        self.kind = FFNKind.parse(kind)
        self.routing = FFNRouting.parse(routing, "routing")
        if self.kind is FFNKind.MOE:
            if not 1 <= active <= experts:
                raise ValueError(f"ffn_active must be in [1, ffn_experts={experts}], got {active}")
            if not hasattr(torch, "_grouped_mm"):
                raise RuntimeError(f"the MoE stand-in needs torch._grouped_mm (torch >= 2.8), this is "
                                   f"torch {torch.__version__}; use --ffn mlp")
        if self.kind is not FFNKind.NONE and (hidden % 8 or intermediate % 8):
            raise ValueError(f"the stand-in needs hidden and ffn_intermediate multiples of 8 (16-byte rows "
                             f"for the GEMMs), got {hidden} and {intermediate}")
        self.E, self.A = experts, active
        g = torch.Generator(device=device).manual_seed(seed * 7919 + 17)
        D, I, L = hidden, intermediate, num_layers

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            t = torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)
            return t.mul_(1.0 / math.sqrt(fan_in))

        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(L if self.kind is not FFNKind.NONE else 0):
            p: dict[str, torch.Tensor] = {}
            if self.kind is FFNKind.MLP:
                p["gate_up"] = w(D, 2 * I, fan_in=D)  # bf16 [D, 2I]
                p["down"] = w(I, D, fan_in=I)  # bf16 [I, D]
            else:
                p["router"] = w(D, experts, fan_in=D).float()  # fp32 [D, E]
                p["gate_up"] = w(experts, D, 2 * I, fan_in=D)  # bf16 [E, D, 2I]
                p["down"] = w(experts, I, D, fan_in=I)  # bf16 [E, I, D]
                if shared:
                    p["shared_gate_up"] = w(D, 2 * shared * I, fan_in=D)
                    p["shared_down"] = w(shared * I, D, fan_in=shared * I)
            self.layers.append(p)

    @staticmethod
    def _mlp(xb: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = (xb @ gate_up).chunk(2, dim=-1)
        return (F.silu(g) * u) @ down

    def route(self, layer: int, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xb bf16 [T, D] -> experts int64 [T, A], weights fp32 [T, A] (softmax over the chosen)."""
        logits = xb.float() @ self.layers[layer]["router"]
        val, idx = torch.topk(logits, self.A, dim=1)
        return idx, torch.softmax(val, dim=1)

    @staticmethod
    def _normed(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    def __call__(self, layer: int, x: torch.Tensor, *, route_x: torch.Tensor | None = None,
                 reference: bool = False) -> torch.Tensor:
        """x fp32 [T, D] -> x + ffn(rmsnorm(x)), fp32 [T, D]. ``route_x`` fp32 [T, D]: the
        tokens' input embeddings, which "token" routing chooses the experts from (needed
        then). ``reference``: the MoE's grouped GEMMs as one matmul per expert (a host
        loop; for tests)."""
        if self.kind is FFNKind.NONE:
            return x
        p = self.layers[layer]
        xb = self._normed(x)
        if self.kind is FFNKind.MLP:
            return x + self._mlp(xb, p["gate_up"], p["down"]).float()
        T = xb.shape[0]
        if self.routing is FFNRouting.TOKEN:
            if route_x is None or route_x.shape != x.shape:
                raise ValueError(f"token routing needs route_x of x's shape {list(x.shape)}, got "
                                 f"{None if route_x is None else list(route_x.shape)}")
            idx, wts = self.route(layer, self._normed(route_x))
        else:
            idx, wts = self.route(layer, xb)
        flat = idx.reshape(-1)  # [T * A], pair j = (token j // A, choice j % A)
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert
        counts = torch.zeros(self.E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = xb.index_select(0, order // self.A)  # bf16 [T * A, D]
        mm = grouped_mm_reference if reference else grouped_mm
        g, u = mm(xs, p["gate_up"], offs).chunk(2, dim=-1)
        ys = mm((F.silu(g) * u).contiguous(), p["down"], offs)  # bf16 [T * A, D], sorted order
        y = torch.empty_like(ys)
        y[order] = ys  # back to pair order (a permutation: no duplicate writes)
        out = (y.view(T, self.A, -1).float() * wts[:, :, None]).sum(dim=1)
        if "shared_gate_up" in p:
            out = out + self._mlp(xb, p["shared_gate_up"], p["shared_down"]).float()
        return x + out


__all__ = ["FFN", "FFNKind", "FFNRouting", "V32_EP8_SHARE", "v32_share_at", "ffn_weight_bytes", "grouped_mm", "grouped_mm_reference"]
