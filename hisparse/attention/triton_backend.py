"""Triton sparse-MLA backend: decode over bf16 / fp8_ds_mla rows, prefill over a bf16 workspace.

Launches ``hisparse.kernels.mla_decode`` (see its docstring for the algorithm). The launch
shape is a ``TritonMLAConfig`` (head block, rows per iteration, warps, pipeline
stages, KV splits); ``default_config`` picks one from the problem size, and callers
(benchmarks, autotuning) may pass their own. Inputs are validated (``base``) before
any launch; with ``validate=False`` the host-syncing range check is skipped and the
kernel masks out-of-range entries as padding instead (graph-capturable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os

import torch
import triton

from ..config import RowFormat
from .base import (D_V, DecodeInputs, Phase, SparseMLABackend, empty_result, heads_reason,
                   validate_decode_inputs, validate_prefill_inputs)

MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class TritonMLAConfig:
    """Launch shape of the sparse-MLA kernel.

    block_h: heads per program (power of two >= 16; fewer heads are masked)
    block_n: rows gathered per iteration (power of two >= 16)
    num_warps, num_stages: Triton launch options
    num_splits: KV splits per (token, head block); None = choose from the GPU's SM count
    dv_parts: 1, or 2 to split the 512 output columns over two programs (each computes
        q . k^T in full and p . v for its half: half the accumulator registers)
    isolate_qk: compile each q . k^T dot in its own one-trip loop region, so that Triton
        does not lay it out over all warps along the heads (at block_h 64 with 8 warps
        that makes both warpgroups compute the same product); see ``mla_decode``
    prefetch: 0, or d >= 1 to have each iteration ask L2 for the rows d blocks ahead
        (inline PTX ``prefetch.global.L2``: CUDA only, the interpreter runs without it)
    prefetch_l1: prefetch into L1 (``prefetch.global.L1``) instead of L2
    wide: run ``mla_decode_wide`` instead: the four latent tiles fused into one
        [block_n, 512] tile, three dots per iteration instead of nine (needs dv_parts 1;
        always isolates its q . k^T dots)
    f16_mma: with ``wide`` and fp8_ds_mla rows, run the latent dots on float16 tensor
        cores: e4m3 codes become float16 in one conversion (no float32 round trip), the
        tile scales are applied as exact powers of two relative to the split's largest
        scale, q's latent part is scaled per head into float16's range (exact powers of
        two, undone on the scores); see ``mla_decode_wide``. Ignored for bf16 rows.
    reg_pipe: with ``wide``, load the next block's rows into registers while the current
        block's dots run (fp8 codes carried as int32 words)
    mma_rowsum: with ``wide``, take the softmax row sums from the tensor cores (p . a
        ones tile) instead of a cross-warp reduction of p every iteration
    ws: run ``mla_decode_ws`` instead (fp8_ds_mla rows, SM 9.x only): a warp-specialised
        Gluon kernel -- a producer warpgroup gathers rows with cp.async and dequantises
        them into a ring of num_stages bf16 slots while two consumer warpgroups run the
        wgmma dots and the softmax, each for half of the 512 output columns. Needs
        block_h 64 and block_n 16 or 32 (shared memory); num_warps is fixed (4 per
        partition, 12 in all) and must be left at 4; rows must be 16-byte aligned.
    ws_raw: with ``ws``, raw cp.async slots: the producer gathers ws_raw - 1 blocks ahead
    ws_producer_regs: with ``ws``, registers per producer thread (40, 56, 72 or 88); the
        consumers get the rest of the 168 x 12 warps' budget
    ws_split_qk: with ``ws``, the two consumers split q . k^T (latent columns [0, 256) /
        [256, 512) + RoPE) and exchange partial scores through shared memory, instead of
        both computing all of it
    """

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int | None = None
    dv_parts: int = 1
    isolate_qk: bool = False
    prefetch: int = 0
    prefetch_l1: bool = False
    wide: bool = False
    f16_mma: bool = False
    reg_pipe: bool = False
    mma_rowsum: bool = False
    ws: bool = False
    ws_raw: int = 3
    ws_producer_regs: int = 56
    ws_split_qk: bool = False

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v!r}")
        if self.block_h < 16 or self.block_n < 16:
            raise ValueError(f"block_h and block_n must be >= 16 (tl.dot), got "
                             f"{self.block_h}, {self.block_n}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) \
                or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.num_splits is not None and (
                isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int)
                or not 1 <= self.num_splits <= MAX_SPLITS):
            raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], "
                             f"got {self.num_splits!r}")
        if isinstance(self.dv_parts, bool) or self.dv_parts not in (1, 2):
            raise ValueError(f"dv_parts must be 1 or 2, got {self.dv_parts!r}")
        if not isinstance(self.isolate_qk, bool):
            raise ValueError(f"isolate_qk must be a bool, got {self.isolate_qk!r}")
        if (isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int)
                or not 0 <= self.prefetch <= 3):
            raise ValueError(f"prefetch must be 0 (off) or a distance 1..3 in blocks, "
                             f"got {self.prefetch!r}")
        if not isinstance(self.prefetch_l1, bool):
            raise ValueError(f"prefetch_l1 must be a bool, got {self.prefetch_l1!r}")
        if not isinstance(self.wide, bool):
            raise ValueError(f"wide must be a bool, got {self.wide!r}")
        if not isinstance(self.f16_mma, bool):
            raise ValueError(f"f16_mma must be a bool, got {self.f16_mma!r}")
        for name in ("reg_pipe", "mma_rowsum"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if (self.f16_mma or self.reg_pipe or self.mma_rowsum) and not self.wide:
            raise ValueError("f16_mma, reg_pipe and mma_rowsum need wide=True (the fused-tile "
                             "kernel)")
        if self.wide and self.dv_parts != 1:
            raise ValueError("wide needs dv_parts == 1 (it owns all 512 output columns)")
        if not isinstance(self.ws, bool):
            raise ValueError(f"ws must be a bool, got {self.ws!r}")
        if self.ws:
            if self.wide or self.dv_parts != 1 or self.isolate_qk:
                raise ValueError("ws is its own kernel: leave wide, dv_parts and isolate_qk off")
            if self.block_h != 64 or self.block_n not in (16, 32) or self.num_warps != 4:
                raise ValueError(f"ws needs block_h 64, block_n 16 or 32 and num_warps 4, got "
                                 f"{self.block_h}, {self.block_n}, {self.num_warps}")
            if (isinstance(self.ws_raw, bool) or not isinstance(self.ws_raw, int)
                    or not 2 <= self.ws_raw <= 8):
                raise ValueError(f"ws_raw must be an int in [2, 8], got {self.ws_raw!r}")
            if self.ws_producer_regs not in WS_PRODUCER_REGS:
                raise ValueError(f"ws_producer_regs must be one of {WS_PRODUCER_REGS}, got "
                                 f"{self.ws_producer_regs!r}")
            if not isinstance(self.ws_split_qk, bool):
                raise ValueError(f"ws_split_qk must be a bool, got {self.ws_split_qk!r}")
            smem = ws_shared_bytes(self.block_n, self.num_stages, self.ws_raw, self.ws_split_qk)
            if smem > WS_MAX_SHARED:
                raise ValueError(f"ws with block_n {self.block_n}, {self.num_stages} stages and "
                                 f"{self.ws_raw} raw slots needs {smem} bytes of shared memory, "
                                 f"more than the {WS_MAX_SHARED} an sm90 block may have: lower "
                                 f"num_stages or ws_raw")


# The warp-specialised kernel (mla_decode_ws): 12 warps launched with maxnreg 168 (the
# register file's 64K over 384 threads); the producer gets ws_producer_regs per thread,
# the two consumer warpgroups share the rest equally.
WS_MAXNREG = 168
WS_PRODUCER_REGS = (40, 56, 72, 88)
WS_MAX_SHARED = 232448 - 1024  # sm90 opt-in maximum per block, less Triton's static part


def ws_consumer_regs(producer_regs: int) -> int:
    return (WS_MAXNREG * 12 - 4 * producer_regs) // 8


def ws_shared_bytes(block_n: int, stages: int, raw: int, split_qk: bool = False) -> int:
    """Dynamic shared memory of mla_decode_ws: q (64 x 576 bf16), the bf16 ring (latent +
    RoPE + score bias per slot), the raw ring (656-byte rows + bias per slot), with
    split_qk the partial-score exchange (2 x stages x 64 x block_n float32), barriers."""
    return 64 * 576 * 2 + stages * block_n * (576 * 2 + 4) + raw * block_n * (656 + 4) \
        + (2 * stages * 64 * block_n * 4 if split_qk else 0) + 4 * stages * 8


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Per head block: (block_n, num_warps, num_stages, isolate_qk, prefetch, wide, f16_mma). From sm90
# compile statistics (Triton 3.6, the launcher's 16-divisibility specialisation: no
# register spills, wgmma at block_h = 64) and the H200 sweeps of 2026-11-29
# (benchmarks/bench_triton_configs.py, BENCHMARKS.md). At block_h = 64 with 8 warps
# Triton would lay every q . k^T dot out as warpsPerCTA [8, 1], so both warpgroups
# compute the same product; isolate_qk gives it [4, 2] (half the wgmma work, 1.42x
# faster at T = 64, H = 128 on fp8 rows, 1.38x on bf16) and frees enough shared memory
# for block_n = 64 with bf16 rows too (147 KB). 4 warps avoid the duplication as well
# but spill the [64, 512] float32 accumulator. The one-trip loops also stop Triton from
# software-pipelining the row gathers, so each iteration L2-prefetches the next block's
# rows (prefetch = 1: 173 vs 188 us in bench_decode). wide fuses the four latent tiles
# (three dots per iteration instead of nine; always isolated): 1.5-2.5% faster on fp8
# rows at T >= 64, but it spills with bf16 rows (22% slower there). Options measured and
# left off (session 4, H200, same-run sweeps at T = 64 / 256, H = 128, fp8): f16_mma (the
# loop's sm90 SASS falls from 1126 to 899 instructions a thread, yet 4-6% slower),
# reg_pipe (a few spills; 8-17% slower), mma_rowsum (12 -> 9 CTA barriers an iteration;
# 0-4% slower). Keyed by (row format, block_h). On SM 9.x, fp8_ds_mla rows at block_h 64
# run the warp-specialised kernel instead (WS_DEFAULT below; session 5: 155 vs 172 us at
# T = 64, H = 128, 0.71x FlashMLA).
DEFAULT_SHAPES: dict[tuple[RowFormat, int], tuple[int, int, int, bool, int, bool, bool]] = {
    (RowFormat.FP8_DS_MLA, 16): (64, 8, 2, False, 1, False, False),
    (RowFormat.FP8_DS_MLA, 32): (32, 8, 2, False, 1, False, False),
    (RowFormat.FP8_DS_MLA, 64): (64, 8, 2, True, 1, True, False),
    (RowFormat.BF16, 16): (64, 8, 2, False, 1, False, False),
    (RowFormat.BF16, 32): (32, 8, 2, False, 1, False, False),
    (RowFormat.BF16, 64): (64, 8, 2, True, 1, False, False),
}
# (block_h, block_n, num_warps, num_stages) tried by the config sweep benchmark and
# checked against the reference by the GPU tests.
CANDIDATE_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 2), (64, 16, 8, 3),
    (64, 32, 16, 2), (64, 16, 4, 2), (64, 32, 4, 2), (32, 32, 8, 2), (32, 16, 4, 2),
    (16, 64, 8, 2), (16, 16, 4, 2), (16, 32, 4, 2),
)
MAX_AUTO_SPLITS = 32  # partial outputs cost T * splits * H * 2 KiB of traffic


# The warp-specialised kernel's default ring (H200 sweeps, BENCHMARKS.md): 32-row blocks,
# two bf16 slots, two raw slots (one block gathered ahead), 72 producer registers.
WS_DEFAULT = dict(block_n=32, num_warps=4, num_stages=2, isolate_qk=False, prefetch=0,
                  wide=False, f16_mma=False, ws=True, ws_raw=2, ws_producer_regs=72)


def default_config(T: int, H: int, K: int, device: torch.device,
                   row_format: RowFormat | str = RowFormat.FP8_DS_MLA, *,
                   allow_ws: bool = True) -> TritonMLAConfig:
    """Heuristic launch shape: head blocks of up to 64, enough KV splits to fill the SMs.

    fp8_ds_mla rows with 64-head blocks on an SM 9.x GPU get the warp-specialised kernel
    (``ws``; allow_ws=False for the ``tl`` kernels); ``run_sparse_mla`` takes the ``tl``
    default instead for inputs that kernel cannot read (rows not 16-byte aligned)."""
    fmt = RowFormat.parse(row_format)
    block_h = min(64, max(16, triton.next_power_of_2(H)))
    block_n, num_warps, num_stages, isolate, prefetch, wide, f16 = DEFAULT_SHAPES[(fmt, block_h)]
    cfg = TritonMLAConfig(block_h=block_h, block_n=block_n, num_warps=num_warps,
                          num_stages=num_stages, isolate_qk=isolate, prefetch=prefetch, wide=wide,
                          f16_mma=f16)
    if (allow_ws and fmt is RowFormat.FP8_DS_MLA and block_h == 64 and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9):
        cfg = dataclasses.replace(cfg, **WS_DEFAULT)
    return dataclasses.replace(cfg, num_splits=auto_splits(T, H, K, cfg, device))


def auto_splits(T: int, H: int, K: int, cfg: TritonMLAConfig, device: torch.device) -> int:
    """KV splits so that T x head blocks x splits is about one wave of SMs.

    1 when T x head blocks already fills the SMs (or on CPU); each split keeps at least
    2 iterations of ``block_n`` rows; at most ``MAX_AUTO_SPLITS``.
    """
    if device.type != "cuda":
        return 1
    programs = max(1, T * math.ceil(H / cfg.block_h) * cfg.dv_parts)
    max_useful = max(1, K // (2 * cfg.block_n))
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(sms // programs, max_useful, MAX_AUTO_SPLITS))


def run_sparse_mla(inp: DecodeInputs, cfg: TritonMLAConfig | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel(s) on validated inputs. Returns out bf16 [T, H, 512], lse f32 [T, H]."""
    from ..kernels.mla_decode import sparse_mla_combine_kernel, sparse_mla_decode_kernel
    from ..kernels.mla_decode_wide import sparse_mla_decode_wide_kernel

    q, kv, idx, vc = inp.q, inp.kv_rows, inp.indices, inp.valid_counts
    T, H, _ = q.shape
    K = idx.shape[1]
    dev = q.device
    if T == 0 or K == 0:
        return empty_result(T, H, dev)
    if cfg is None:
        cfg = default_config(T, H, K, dev, inp.row_format)
        if cfg.ws and ws_unsupported(inp, dev) is not None:  # e.g. a misaligned row view
            cfg = default_config(T, H, K, dev, inp.row_format, allow_ws=False)
    splits = cfg.num_splits if cfg.num_splits is not None else auto_splits(T, H, K, cfg, dev)
    # rows per split: a multiple of block_n; drop splits that would get no rows
    rows_per_split = math.ceil(math.ceil(K / splits) / cfg.block_n) * cfg.block_n
    splits = math.ceil(K / rows_per_split)
    out = torch.empty((T, H, D_V), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    if splits > 1:
        part_out = torch.empty((T, splits, H, D_V), dtype=torch.float32, device=dev)
        part_lse = torch.empty((T, splits, H), dtype=torch.float32, device=dev)
    else:
        part_out, part_lse = out, lse  # unused by the kernel
    is_fp8 = inp.row_format is RowFormat.FP8_DS_MLA
    grid = (T, math.ceil(H / cfg.block_h) * cfg.dv_parts, splits)
    with _on_device(dev):
        args = (q, kv, idx, vc if vc is not None else idx, out, lse, part_out, part_lse,
                kv.shape[0], K, H, q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
                rows_per_split, inp.sm_scale * 1.4426950408889634)
        prefetch = cfg.prefetch if dev.type == "cuda" else 0  # a hint; no inline PTX on CPU
        if cfg.ws:
            _check_ws(inp, dev)
            from ..kernels.mla_decode_ws import sparse_mla_decode_ws_kernel
            sparse_mla_decode_ws_kernel[grid](
                *args, HAS_VC=vc is not None, NUM_SPLITS=splits, BLOCK_N=cfg.block_n,
                STAGES=cfg.num_stages, RAW=cfg.ws_raw, PRODUCER_REGS=cfg.ws_producer_regs,
                CONSUMER_REGS=ws_consumer_regs(cfg.ws_producer_regs), SPLIT_QK=cfg.ws_split_qk,
                num_warps=4, maxnreg=WS_MAXNREG)
        elif cfg.wide:
            f16 = cfg.f16_mma and is_fp8
            # float16 q blocks, one per program (see mla_decode_wide)
            q16 = (torch.empty((grid[0] * grid[1] * grid[2], cfg.block_h, 512),
                               dtype=torch.float16, device=dev) if f16 else None)
            sparse_mla_decode_wide_kernel[grid](
                *args, HAS_VC=vc is not None, IS_FP8=is_fp8, NUM_SPLITS=splits,
                BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PREFETCH=prefetch,
                PREFETCH_L1=cfg.prefetch_l1, F16_MMA=f16, q16_ptr=q16, REG_PIPE=cfg.reg_pipe,
                PTX=dev.type == "cuda", MMA_ROWSUM=cfg.mma_rowsum,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        else:
            sparse_mla_decode_kernel[grid](
                *args, HAS_VC=vc is not None, IS_FP8=is_fp8, NUM_SPLITS=splits,
                BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DV_PARTS=cfg.dv_parts,
                ISOLATE_QK=cfg.isolate_qk, PREFETCH=prefetch, PREFETCH_L1=cfg.prefetch_l1,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if splits > 1:
            sparse_mla_combine_kernel[(T, H)](part_out, part_lse, out, lse, H,
                                              NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
                                              num_warps=4)
    return out, lse


def ws_unsupported(inp: DecodeInputs, dev: torch.device) -> str | None:
    """Why the warp-specialised kernel can't take these inputs, or None."""
    if inp.row_format is not RowFormat.FP8_DS_MLA:
        return "it reads fp8_ds_mla rows only"
    if dev.type != "cuda":
        return "it is a Gluon kernel for CUDA SM 9.x (no interpreter)"
    major, _ = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"it uses Hopper wgmma / setmaxnreg (SM 9.x), device is SM {major}.x"
    kv = inp.kv_rows
    if kv.data_ptr() % 16 or kv.stride(0) % 16:
        return "its cp.async gathers need 16-byte aligned rows (data_ptr and row stride)"
    return None


def _check_ws(inp: DecodeInputs, dev: torch.device) -> None:
    reason = ws_unsupported(inp, dev)
    if reason is not None:
        raise ValueError(f"TritonMLAConfig(ws=True) cannot run here: {reason}; use ws=False")


def _on_device(dev: torch.device):
    """Triton launches on the current CUDA device: make it ``dev`` for the launch."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


class TritonBackend(SparseMLABackend):
    """Portable Triton backend (bf16 and fp8_ds_mla decode, bf16-workspace prefill).

    config: a fixed ``TritonMLAConfig`` (None = ``default_config`` per call).
    validate: run the host-syncing index range check before launch (default True).
    allow_interpreter: accept CPU tensors when ``TRITON_INTERPRET=1`` (tests; slow).
    """

    name = "triton"

    def __init__(self, *, config: TritonMLAConfig | None = None, validate: bool = True,
                 allow_interpreter: bool = False) -> None:
        if config is not None and not isinstance(config, TritonMLAConfig):
            raise TypeError(f"config must be a TritonMLAConfig or None, got {type(config).__name__}")
        self.config = config
        self.validate = bool(validate)
        self.allow_interpreter = bool(allow_interpreter)

    def supports(self, *, device: torch.device, row_format: RowFormat, num_heads: int,
                 phase: Phase) -> str | None:
        device = torch.device(device)
        fmt = RowFormat.parse(row_format)
        reason = heads_reason(num_heads)
        if reason is not None:
            return reason
        if phase is Phase.PREFILL and fmt is not RowFormat.BF16:
            return "prefill runs over a bf16 workspace; row_format must be bf16"
        if device.type == "cpu":
            if not self.allow_interpreter:
                return "Triton needs a CUDA device (CPU only through the interpreter, for tests)"
            if os.environ.get("TRITON_INTERPRET") != "1":
                return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
            return None
        if device.type != "cuda":
            return f"unsupported device type {device.type!r}"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return f"needs SM 8.0+ for bf16 tl.dot, device is SM {major}.{minor}"
        if fmt is RowFormat.FP8_DS_MLA and (major, minor) < (8, 9):
            return f"fp8_ds_mla needs SM 8.9+ (e4m3 conversion), device is SM {major}.{minor}"
        return None

    def _check_supported(self, inp_device: torch.device, fmt: RowFormat, H: int,
                         phase: Phase) -> None:
        reason = self.supports(device=inp_device, row_format=fmt, num_heads=H, phase=phase)
        if reason is not None:
            raise ValueError(f"triton backend cannot run this {phase.value}: {reason}")

    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format):
        inp = validate_decode_inputs(q, kv_rows, indices, valid_counts=valid_counts,
                                     sm_scale=sm_scale, row_format=row_format,
                                     check_ranges=self.validate)
        self._check_supported(inp.q.device, inp.row_format, inp.num_heads, Phase.DECODE)
        return run_sparse_mla(inp, self.config)

    def prefill(self, q, workspace, indices, *, valid_counts=None, sm_scale):
        inp = validate_prefill_inputs(q, workspace, indices, valid_counts=valid_counts,
                                      sm_scale=sm_scale, check_ranges=self.validate)
        self._check_supported(inp.q.device, RowFormat.BF16, q.shape[1], Phase.PREFILL)
        return run_sparse_mla(inp.as_decode(), self.config)


__all__ = ["TritonBackend", "TritonMLAConfig", "default_config", "auto_splits", "run_sparse_mla",
           "DEFAULT_SHAPES", "CANDIDATE_SHAPES", "ws_unsupported", "ws_shared_bytes", "WS_DEFAULT"]
