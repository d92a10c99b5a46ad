"""Miss attention: attention over each query token's *miss* entries, merged exactly with
the partial result of its *hit* entries (LSE merge). Kernels: ``hisparse.kernels.mla_miss``.

A split decode step attends over a token's hit entries (rows already in the hot
buffer) with any backend that returns a natural-log lse, while the misses are staged;
then it adds the misses' contribution:

- ``merge_lse(out, lse, part_out, part_lse)``: merge a second partial result into the
  first in place.
- ``miss_attention_merge(q, kv_rows, miss_idx, miss_counts, out, lse, ...)`` (split
  mode): the miss rows are in the hot buffer already (staged by the copy kernel);
  attend over them and merge into the hit partial in place, in one launch (two with a
  plan of several splits).

Notation: T query tokens, H heads, K miss-list capacity, N hot rows, D_ROW = 576,
D_LATENT = 512.

Semantics (those of ``hisparse.attention.base``; ``reference.sparse_mla_reference``
computes them): token t's miss entries are j < clamp(miss_counts[t], 0, K) of row t of
the index lists; an entry whose hot row is -1 or out of range is padding (never read, never written). A partial result is (out [T, H, 512], lse
float32 [T, H]) with lse natural-log, scale included, -inf = no entry: an empty side,
whose out is never read and may hold anything (NaN included). Merge: lse =
logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse), an
empty side selected away (not weighted by 0), so it contributes nothing. Per (token,
head): only the first side has entries -> the first partial kept bit for bit (nothing
written); only the second -> the second; neither -> out = 0, lse = -inf (written: a
merged result never carries what an empty side held).

Every call has a float32 torch reference (``*_reference``: the CPU path and the test
oracle) and a Triton launcher; ``kernels=`` (``hisparse._checks.Kernels``) picks one
(auto: Triton on CUDA, the reference on CPU). Launchers check dtypes, shapes, devices,
row layout from metadata only and raise before any launch; they read no
device value, allocate nothing (except a split-mode call with K = 0 or N = 0, which can
have no valid entry and zeroes the empty heads with one torch op) and use a launch shape
fixed by (T, H, plan): CUDA-graph capturable (the CPU references do allocate and, on
CUDA, sync). Index *values* need no check: out-of-range entries are padding.

Splits: with ``plan=None`` a token's misses are one work item per head block: no
scratch. ``plan_miss_attention`` (call once, outside the captured step) sizes a
``MissConfig`` for a batch size and allocates the float32 scratch that several splits
per token need.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
import triton

from .._checks import Kernels, check_bool, check_int, check_tensor, device_type, same_device, sm_count
from ..device import on_device
from ..formats import D_LATENT, RowFormat
from ..kernels.fast_launch import fast
from ..kernels.mla_miss import miss_combine_kernel, miss_merge_kernel, miss_split_kernel
from .base import DecodeInputs, validate_decode_inputs
from .reference import sparse_mla_reference

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
MERGE_BLOCK_H = 8  # heads per program of the merge and combine kernels ([8, 512] tiles)


class MissMode(enum.Enum):
    """Where the miss rows are when their attention runs."""

    SPLIT = "split"  # already staged into the hot buffer (device memory)


@dataclasses.dataclass(frozen=True)
class MissConfig:
    """Launch shape of the miss-attention kernels.

    block_h: heads per head block (power of two >= 16; fewer heads are masked)
    block_n: rows per attention iteration, and the granularity of the splits (power of
        two >= 16)
    num_warps, num_stages: Triton launch options of the attention kernels
    num_splits: programs sharing one token's miss list (each takes a contiguous slice of
        its entries, sized on the device from the token's count); > 1 needs a plan's
        scratch
    isolate_qk: each q . k^T dot in its own one-trip loop (see ``mla_decode``)
    prefetch: CUDA only: L2-prefetch the next block's rows each iteration
    """

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 1
    num_splits: int = 1
    isolate_qk: bool = True
    prefetch: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("block_h", 16), ("block_n", 16), ("num_warps", 1)):
            v = check_int(name, getattr(self, name), lo)
            if v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        check_int("num_stages", self.num_stages, 1)
        check_int("num_splits", self.num_splits, 1, MAX_SPLITS + 1)
        check_bool("isolate_qk", self.isolate_qk)
        check_bool("prefetch", self.prefetch)


def gpu_config(mode: MissMode | str, num_heads: int, *, num_splits: int = 1) -> MissConfig:
    """The CUDA launch shape for (mode, H): head blocks of up to 64 heads, 32-row
    blocks, 8 warps (4 for 16-head blocks), isolated q . k^T dots at 64 heads, L2
    prefetch, 2 stages. It compiles without spills for sm90 at every head block
    (``tests/test_miss_attention.py`` checks it offline); the timings that would pick
    between shapes are ``benchmarks.bench_miss_attention``'s.
    """
    MissMode(mode)
    block_h = min(64, max(16, triton.next_power_of_2(check_int("num_heads", num_heads, 1))))
    return MissConfig(block_h=block_h, block_n=32, num_warps=4 if block_h == 16 else 8,
                      num_stages=2, num_splits=num_splits, isolate_qk=block_h == 64,
                      prefetch=True)


def default_miss_config(mode: MissMode | str, *, num_tokens: int, num_heads: int,
                        device: torch.device, splits: bool = True) -> MissConfig:
    """A launch shape for (mode, T, H) on ``device``; ``splits=False`` keeps one split
    (the no-scratch shape ``plan=None`` uses).

    CUDA: ``gpu_config``, with splits added until T x head blocks x splits is about one
    wave of SMs (at most 4). CPU (the interpreter): 16-row blocks, 4 warps, one split.
    """
    mode = MissMode(mode)
    T = check_int("num_tokens", num_tokens, 0)
    H = check_int("num_heads", num_heads, 1)
    if device_type(device) != "cuda":
        return MissConfig(block_h=min(64, max(16, triton.next_power_of_2(H))), block_n=16,
                          num_warps=4, isolate_qk=False)
    sms = sm_count(device)
    hb = math.ceil(H / min(64, max(16, triton.next_power_of_2(H))))
    s = max(1, min(sms // max(1, T * hb), 4)) if splits else 1
    return gpu_config(mode, H, num_splits=s)


@dataclasses.dataclass(frozen=True)
class MissPlan:
    """A launch shape and its scratch for up to ``max_tokens`` tokens of ``num_heads``
    heads (from ``plan_miss_attention``; reuse it every step, capture included).

    part_out: float32 [max_tokens, num_splits, H, 512] and part_lse: float32
    [max_tokens, num_splits, H] (base-2 lse) when num_splits > 1, else None. The scratch
    serves one call at a time: calls that may overlap (two streams) need a plan each.
    """

    mode: MissMode
    config: MissConfig
    max_tokens: int
    num_heads: int
    row_format: RowFormat
    device: torch.device
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None


def plan_miss_attention(*, mode: MissMode | str, max_tokens: int, num_heads: int,
                        row_format: RowFormat | str, device: torch.device | str,
                        config: MissConfig | None = None) -> MissPlan:
    """Choose (or take) a ``MissConfig`` and allocate its scratch (this allocates: call
    it once, before capture)."""
    mode = MissMode(mode)
    T = check_int("max_tokens", max_tokens, 1)
    H = check_int("num_heads", num_heads, 1)
    fmt = RowFormat.parse(row_format)
    dev = torch.device(device)
    if device_type(dev) == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if config is None:
        config = default_miss_config(mode, num_tokens=T, num_heads=H, device=dev)
    elif not isinstance(config, MissConfig):
        raise TypeError(f"config must be a MissConfig or None, got {type(config).__name__}")
    S = config.num_splits
    part_out = part_lse = None
    if S > 1:
        part_out = torch.empty((T, S, H, D_LATENT), dtype=torch.float32, device=dev)
        part_lse = torch.empty((T, S, H), dtype=torch.float32, device=dev)
    return MissPlan(mode, config, T, H, fmt, dev, part_out, part_lse)


# ------------------------------------------------------------------ validation
def _check_partial(out_name: str, out: object, lse_name: str, lse: object, T: int, H: int,
                   device: torch.device, out_dtypes: tuple[torch.dtype, ...]) -> None:
    check_tensor(out_name, out, dtype=out_dtypes, shape=(T, H, D_LATENT), device=device,
                 contiguous=True)
    check_tensor(lse_name, lse, dtype=torch.float32, shape=(T, H), device=device,
                 contiguous=True)


def _check_list(name: str, x: object, T: int, device: torch.device) -> int:
    x = check_tensor(name, x, dtype=torch.int32, ndim=2, device=device)
    if x.shape[0] != T:
        raise ValueError(f"{name} must be int32 [T={T}, K], got shape {list(x.shape)}")
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {x.stride()}")
    return x.shape[1]


def _check_common(q: object, kv_rows: object, miss_idx: object, miss_counts: object,
                  sm_scale: object, row_format: RowFormat | str) -> DecodeInputs:
    """q, the hot rows, the miss lists and the scale; returns them as DecodeInputs
    (indices = miss_idx, valid_counts = miss_counts)."""
    q = check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T, dev = q.shape[0], q.device
    _check_list("miss_idx", miss_idx, T, dev)
    check_tensor("miss_counts", miss_counts, dtype=torch.int32, shape=(T,), device=dev,
                 contiguous=True)
    return validate_decode_inputs(q, kv_rows, miss_idx, valid_counts=miss_counts,
                                  sm_scale=sm_scale, row_format=row_format, check_ranges=False)


def _check_plan(plan: object, mode: MissMode, inp: DecodeInputs) -> MissConfig:
    """The plan's config (or the no-scratch default when plan is None), checked against
    the call."""
    T, H, dev = inp.num_tokens, inp.num_heads, inp.q.device
    if plan is None:
        return default_miss_config(mode, num_tokens=T, num_heads=H, device=dev, splits=False)
    if not isinstance(plan, MissPlan):
        raise TypeError(f"plan must be a MissPlan or None, got {type(plan).__name__}")
    if plan.mode is not mode:
        raise ValueError(f"plan was made for {plan.mode.value} mode, this call is {mode.value}")
    if plan.num_heads != H or T > plan.max_tokens:
        raise ValueError(f"plan covers {plan.max_tokens} tokens of {plan.num_heads} heads, the "
                         f"call has {T} tokens of {H} heads")
    if plan.row_format is not inp.row_format:
        raise ValueError(f"plan is for {plan.row_format.value} rows, the call has "
                         f"{inp.row_format.value}")
    if not same_device(inp.q, plan.device):
        raise ValueError(f"plan is on {plan.device}, the call on {dev}")
    return plan.config


# ------------------------------------------------------------------ merge
def _validate_merge(out, lse, part_out, part_lse) -> None:
    check_tensor("out", out, dtype=torch.bfloat16, ndim=3)
    T, H, dev = out.shape[0], out.shape[1], out.device
    _check_partial("out", out, "lse", lse, T, H, dev, (torch.bfloat16,))
    _check_partial("part_out", part_out, "part_lse", part_lse, T, H, dev,
                   (torch.float32, torch.bfloat16))


def merge_lse_reference(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                        part_lse: torch.Tensor) -> None:
    """In-place exact LSE merge (float32 math): see the module docstring.

    out: bf16 [T, H, 512], lse: float32 [T, H] (natural log, -inf = empty): first
    partial (out read where lse > -inf), overwritten with the merged result; part_out:
    float32 or bf16 [T, H, 512], part_lse: float32 [T, H]: the second partial (read
    where part_lse > -inf).
    """
    _validate_merge(out, lse, part_out, part_lse)
    _merge_reference(out, lse, part_out, part_lse)


def _merge_reference(out, lse, part_out, part_lse) -> None:
    """The merge of the module docstring, float32, in place. An empty side (lse -inf)
    is selected away before any arithmetic: its out is never multiplied, so whatever
    it holds (NaN included) cannot reach the result."""
    ninf = float("-inf")
    a, b = lse, part_lse
    has_a, has_b = a > ninf, b > ninf
    write = has_b | ~has_a  # the second side has entries, or neither side has any
    m = torch.maximum(a, b)
    m_use = torch.where(m == ninf, torch.zeros_like(m), m)
    ea, eb = torch.exp(a - m_use), torch.exp(b - m_use)  # 0 for an empty side
    tot = ea + eb  # >= 1 where either side has entries (the larger one gives exp(0))
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    wa, wb = ea / safe, eb / safe
    o_a = torch.where(has_a[..., None], out.float(), 0.0)
    o_b = torch.where(has_b[..., None], part_out.float(), 0.0)
    merged = o_a * wa[..., None] + o_b * wb[..., None]  # both empty: 0
    out.copy_(torch.where(write[..., None], merged.to(out.dtype), out))
    lse.copy_(torch.where(has_b, m_use + torch.log(safe), lse))  # both empty: -inf stays


def merge_lse(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
              part_lse: torch.Tensor, *, kernels: Kernels | str = Kernels.AUTO) -> None:
    """Merge the partial (part_out, part_lse) into (out, lse) in place (shapes as
    ``merge_lse_reference``). A (token, head) whose part_lse is -inf keeps its partial,
    or gets out = 0 where its lse is -inf too (see the module docstring)."""
    impl = Kernels.parse(kernels)
    _validate_merge(out, lse, part_out, part_lse)
    impl = impl.pick(out.device)
    if impl is Kernels.TORCH:
        _merge_reference(out, lse, part_out, part_lse)
        return
    T, H = out.shape[0], out.shape[1]
    if T == 0:
        return
    with on_device(out.device if out.device.type == "cuda" else None):
        fast(miss_merge_kernel)[(T, triton.cdiv(H, MERGE_BLOCK_H))](
            out, lse, part_out, part_lse, H, BLOCK_H=MERGE_BLOCK_H, num_warps=4)


# ------------------------------------------------------------------ split mode
def _validate_split(q, kv_rows, miss_idx, miss_counts, out, lse, sm_scale, row_format):
    inp = _check_common(q, kv_rows, miss_idx, miss_counts, sm_scale, row_format)
    _check_partial("out", out, "lse", lse, inp.num_tokens, inp.num_heads, inp.q.device,
                   (torch.bfloat16,))
    return inp


def miss_attention_merge_reference(q: torch.Tensor, kv_rows: torch.Tensor,
                                   miss_idx: torch.Tensor, miss_counts: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, *, sm_scale: float,
                                   row_format: RowFormat | str) -> None:
    """Torch reference of ``miss_attention_merge`` (same arguments, in place)."""
    inp = _validate_split(q, kv_rows, miss_idx, miss_counts, out, lse, sm_scale, row_format)
    part_out, part_lse = sparse_mla_reference(inp, out_dtype=torch.float32)
    _merge_reference(out, lse, part_out, part_lse)


def miss_attention_merge(
    q: torch.Tensor,  # bf16 [T, H, 576], last-dim stride 1
    kv_rows: torch.Tensor,  # uint8 [N, 656] fp8_ds_mla, or bf16 [N, 576] / uint8 [N, 1152]
    miss_idx: torch.Tensor,  # int32 [T, K] hot rows of the miss entries, -1 = padding
    miss_counts: torch.Tensor,  # int32 [T] entries j < count are used (clamped to [0, K])
    out: torch.Tensor,  # bf16 [T, H, 512] contiguous: hit partial in, merged result out
    lse: torch.Tensor,  # float32 [T, H] natural log, -inf = no hit entry: in and out
    *, sm_scale: float, row_format: RowFormat | str, plan: MissPlan | None = None,
    kernels: Kernels | str = Kernels.AUTO,
) -> None:
    """Attend over each token's miss entries (rows already in ``kv_rows``) and merge the
    result into the hit partial (out, lse) in place. A token with no miss costs its
    programs a count load and a load of its lse; a head without a valid miss keeps its
    partial, or gets out = 0 where its lse is -inf too (see the module docstring)."""
    impl = Kernels.parse(kernels)
    inp = _validate_split(q, kv_rows, miss_idx, miss_counts, out, lse, sm_scale, row_format)
    cfg = _check_plan(plan, MissMode.SPLIT, inp)
    impl = impl.pick(inp.q.device)
    if impl is Kernels.TORCH:
        part_out, part_lse = sparse_mla_reference(inp, out_dtype=torch.float32)
        _merge_reference(out, lse, part_out, part_lse)
        return
    q, kv, dev = inp.q, inp.kv_rows, inp.q.device
    T, H, K, N = q.shape[0], q.shape[1], miss_idx.shape[1], kv.shape[0]
    if T == 0:
        return
    if K == 0 or N == 0:  # no entry can be valid: only heads empty on both sides change
        out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
        return
    S = cfg.num_splits
    part_out, part_lse = (plan.part_out, plan.part_lse) if S > 1 else (out, lse)
    is_fp8 = inp.row_format is RowFormat.FP8_DS_MLA
    with on_device(dev if dev.type == "cuda" else None):
        fast(miss_split_kernel)[(T, triton.cdiv(H, cfg.block_h), S)](
            q, kv, miss_idx, miss_counts, out, lse, part_out, part_lse, N, K, H,
            q.stride(0), q.stride(1), kv.stride(0), miss_idx.stride(0), inp.sm_scale * LOG2E,
            IS_FP8=is_fp8, NUM_SPLITS=S, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            ISOLATE_QK=cfg.isolate_qk, PREFETCH=int(cfg.prefetch and device_type(dev) == "cuda"),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if S > 1:
            fast(miss_combine_kernel)[(T, triton.cdiv(H, MERGE_BLOCK_H))](
                part_out, part_lse, miss_counts, out, lse, K, H, NUM_SPLITS=S,
                BLOCK_N=cfg.block_n, BLOCK_H=MERGE_BLOCK_H, num_warps=4)


__all__ = ["MissMode", "MissConfig", "MissPlan", "gpu_config", "default_miss_config",
           "plan_miss_attention",
           "merge_lse", "merge_lse_reference", "miss_attention_merge",
           "miss_attention_merge_reference", "MERGE_BLOCK_H"]
