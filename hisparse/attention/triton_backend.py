"""Triton sparse-MLA backend: decode over bf16 / fp8_ds_mla rows, prefill over a bf16 workspace.

Kernels (``hisparse.kernels``; their docstrings give the algorithms): ``mla_decode`` (the
tiled body and the split-KV combine), ``mla_decode_wide`` (the four latent tiles fused
into one) and ``mla_decode_ws`` (warp-specialised, written in Gluon; fp8_ds_mla rows on
SM 9.x). The launch shape is a ``TritonMLAConfig``; ``default_config`` picks one from
the problem size, the GPU and the installed Triton, and records in ``ws_off_reason``
why it did not pick the warp-specialised kernel; callers (benchmarks, autotuning) may
pass their own. Inputs are validated (``base``) before any launch; with
``validate=False`` the host-syncing range check is skipped and the kernels mask
out-of-range entries as padding instead (graph-capturable).
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import torch
import triton

from .._checks import check_bool, check_int, device_type, interpreter_mode, sm_count
from ..formats import BF16_ROW_BYTES, FP8_ROW_BYTES, RowFormat
from ..kernels.gluon_support import gluon_ws_problem
from .paged import PagedLookup, check_paged
from .triton_plan import DecodePlan, call_signature, output_signature
from .base import (DecodeInputs, Phase, SparseMLABackend, check_outputs, heads_reason,
                   validate_decode_inputs, validate_prefill_inputs)

MAX_SPLITS = 64
PLANS_KEPT = 1024  # distinct call signatures an unchecked backend keeps plans for; then forgotten at once
MAX_AUTO_SPLITS = 32  # partial outputs cost T * splits * H * 2 KiB of traffic

# The warp-specialised kernel (mla_decode_ws): 12 warps launched with maxnreg 168 (the
# register file's 64K over 384 threads); the producer gets ws_producer_regs per thread,
# the two consumer warpgroups share the rest equally.
WS_MAXNREG = 168
WS_PRODUCER_REGS = (40, 56, 72, 88)
WS_MAX_SHARED = 232448 - 1024  # sm90 opt-in maximum per block, less Triton's static part


@dataclasses.dataclass(frozen=True)
class TritonMLAConfig:
    """Launch shape of the sparse-MLA decode kernels.

    block_h: heads per program (power of two >= 16; fewer heads are masked)
    block_n: rows gathered per iteration (power of two >= 16)
    num_warps, num_stages: Triton launch options (with ``ws``, num_stages is the number
        of bf16 ring slots)
    num_splits: KV splits per (token, head block); None = choose from the GPU's SM count.
        With 1 and ``wave_tail``, the tokens past the last full wave may still run split
    isolate_qk: compile each q . k^T dot of the tiled body in its own one-trip loop
        region, so that Triton does not lay it out over all warps along the heads (at
        block_h 64 with 8 warps that makes both warpgroups compute the same product);
        see ``mla_decode``
    prefetch: 0, or d in 1..3 to have each iteration ask L2 for the rows d blocks ahead
        (inline PTX ``prefetch.global.L2``: CUDA only, the interpreter runs without it)
    wide: run ``mla_decode_wide`` instead: the four latent tiles fused into one
        [block_n, 512] tile, three dots per iteration instead of nine (always isolated)
    ws: run ``mla_decode_ws`` instead (fp8_ds_mla rows, SM 9.x, and a Triton whose Gluon
        offers what the kernel uses: ``kernels.gluon_support``): a warp-specialised
        kernel -- a producer warpgroup gathers rows with cp.async and dequantises them
        into a ring of num_stages bf16 slots while two consumer warpgroups run the wgmma
        dots and the softmax, each for half of the 512 output columns. Needs block_h 64
        and block_n 16 or 32 (shared memory); num_warps is fixed (4 per partition, 12 in
        all) and must be left at 4; rows must be 16-byte aligned.
    ws_raw: with ``ws``, raw cp.async slots: the producer gathers ws_raw - 1 blocks ahead
    ws_producer_regs: with ``ws``, registers per producer thread (40, 56, 72 or 88); the
        consumers get the rest of the 168 x 12 warps' budget
    wave_tail: with ``ws`` (whose programs each need a whole SM) on CUDA, when the
        launch has one KV split and its (token, head block) programs overflow the last
        full wave of SMs by at most half a wave, the tokens past that wave run as a
        second launch with KV splits (``wave_tail_plan``): at 68 tokens of 2 head blocks
        on 132 SMs the 4 overflowing programs would otherwise take as long as the whole
        first wave. Those tokens' outputs then round like a split launch's: a token's
        bits depend on its place in the batch, not only on the batch size (False: one
        launch, as before)
    ws_off_reason: set by ``default_config`` when it did not pick ``ws``: why not (None
        when it did, or for a config built by hand). Not part of the launch shape:
        ignored by ``==`` and ``hash``.
    isolate_off_reason: set by ``default_config`` when it turned the default's
        ``isolate_qk`` off because the installed Triton can't compile it (see
        ``isolate_problem``); None otherwise. Ignored by ``==`` and ``hash``.
    """

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int | None = None
    isolate_qk: bool = False
    prefetch: int = 0
    wide: bool = False
    ws: bool = False
    ws_raw: int = 3
    ws_producer_regs: int = 56
    wave_tail: bool = True
    ws_off_reason: str | None = dataclasses.field(default=None, compare=False)
    isolate_off_reason: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n", "num_warps"):
            v = check_int(name, getattr(self, name), 1)
            if v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.block_h < 16 or self.block_n < 16:
            raise ValueError(f"block_h and block_n must be >= 16 (tl.dot), got "
                             f"{self.block_h}, {self.block_n}")
        check_int("num_stages", self.num_stages, 1)
        if self.num_splits is not None:
            check_int("num_splits", self.num_splits, 1, MAX_SPLITS + 1)
        check_bool("isolate_qk", self.isolate_qk)
        check_int("prefetch", self.prefetch, 0, 4)  # 0 = off, else a distance in blocks
        check_bool("wide", self.wide)
        check_bool("ws", self.ws)
        check_bool("wave_tail", self.wave_tail)
        for name in ("ws_off_reason", "isolate_off_reason"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name} must be None or a str, got {v!r}")
        if not self.ws:
            return
        if self.wide or self.isolate_qk:
            raise ValueError("ws is its own kernel: leave wide and isolate_qk off")
        if self.block_h != 64 or self.block_n not in (16, 32) or self.num_warps != 4:
            raise ValueError(f"ws needs block_h 64, block_n 16 or 32 and num_warps 4, got "
                             f"{self.block_h}, {self.block_n}, {self.num_warps}")
        check_int("ws_raw", self.ws_raw, 2, 9)
        if self.ws_producer_regs not in WS_PRODUCER_REGS:
            raise ValueError(f"ws_producer_regs must be one of {WS_PRODUCER_REGS}, got "
                             f"{self.ws_producer_regs!r}")
        smem = ws_shared_bytes(self.block_n, self.num_stages, self.ws_raw)
        if smem > WS_MAX_SHARED:
            raise ValueError(f"ws with block_n {self.block_n}, {self.num_stages} stages and "
                             f"{self.ws_raw} raw slots needs {smem} bytes of shared memory, "
                             f"more than the {WS_MAX_SHARED} an sm90 block may have: lower "
                             f"num_stages or ws_raw")


def ws_consumer_regs(producer_regs: int) -> int:
    """Registers per consumer thread of the ws kernel for a producer budget."""
    return (WS_MAXNREG * 12 - 4 * producer_regs) // 8


def ws_shared_bytes(block_n: int, stages: int, raw: int) -> int:
    """Dynamic shared memory of mla_decode_ws: q (64 x 576 bf16), the bf16 ring (latent +
    RoPE rows per slot), the raw ring (656-byte rows per slot), barriers."""
    return (64 * BF16_ROW_BYTES + stages * block_n * BF16_ROW_BYTES
            + raw * block_n * FP8_ROW_BYTES + 4 * stages * 8)


# The tl kernels' defaults per (row format, head block): the fastest shapes of the H200
# sweeps (benchmarks/bench_triton_configs.py; BENCHMARKS.md, "Sparse-MLA decode kernel")
# among those that compile for sm90 without register spills (the launcher's
# 16-divisibility specialisation; wgmma at block_h 64).
# - block_h 64 with 8 warps: isolate_qk gives each q . k^T dot the warp layout [4, 2]
#   (Triton would lay it out [8, 1], both warpgroups computing the same product) and
#   leaves enough shared memory for block_n 64 with bf16 rows too; 4 warps spill the
#   [64, 512] float32 accumulator.
# - prefetch 1: the one-trip loops also stop Triton from software-pipelining the row
#   gathers, so each iteration L2-prefetches the next block's rows instead.
# - wide for fp8 rows at block_h 64 only: it spills with bf16 rows.
# On SM 9.x, fp8_ds_mla rows with 64-head blocks get the warp-specialised kernel
# (WS_DEFAULT) when the installed Triton can build it.
DEFAULT_CONFIGS: dict[tuple[RowFormat, int], TritonMLAConfig] = {
    (RowFormat.FP8_DS_MLA, 16): TritonMLAConfig(block_h=16, block_n=64, prefetch=1),
    (RowFormat.FP8_DS_MLA, 32): TritonMLAConfig(block_h=32, block_n=32, prefetch=1),
    (RowFormat.FP8_DS_MLA, 64): TritonMLAConfig(block_h=64, block_n=64, isolate_qk=True,
                                                prefetch=1, wide=True),
    (RowFormat.BF16, 16): TritonMLAConfig(block_h=16, block_n=64, prefetch=1),
    (RowFormat.BF16, 32): TritonMLAConfig(block_h=32, block_n=32, prefetch=1),
    (RowFormat.BF16, 64): TritonMLAConfig(block_h=64, block_n=64, isolate_qk=True, prefetch=1),
}

# The warp-specialised kernel's default ring: 32-row blocks, two bf16 slots, two raw
# slots (one block gathered ahead), 72 producer registers (the H200 sweeps;
# BENCHMARKS.md, "Sparse-MLA decode kernel").
WS_DEFAULT = dict(block_n=32, num_warps=4, num_stages=2, isolate_qk=False, prefetch=0,
                  wide=False, ws=True, ws_raw=2, ws_producer_regs=72)


# Triton 3.7 and 3.8 emit PTX for the tiled body's isolated q . k^T dots at 64-head
# blocks on which ptxas (12.8 and 12.9) crashes with SIGSEGV for sm90, both row formats
# (found compiling offline; 3.6 and 3.9 compile it, 16/32-head blocks compile everywhere).
_TRITON_MINOR = tuple(int(v) for v in triton.__version__.split(".")[:2])
_ISOLATE_CRASHES_PTXAS = ((3, 7), (3, 8))


def isolate_problem(cfg: TritonMLAConfig, device: torch.device) -> str | None:
    """Why the installed Triton can't compile ``cfg``'s isolated dots for ``device``, or
    None (the interpreter runs them under every release)."""
    if (device_type(device) == "cuda" and cfg.isolate_qk and not cfg.wide and not cfg.ws
            and cfg.block_h == 64 and _TRITON_MINOR in _ISOLATE_CRASHES_PTXAS):
        return (f"ptxas crashes on Triton {triton.__version__}'s code for the tiled body with "
                "isolate_qk at 64-head blocks (Triton 3.6 and 3.9 compile it)")
    return None


def ws_device_problem(device: torch.device) -> str | None:
    """Why ``device`` can't run the warp-specialised kernel, or None."""
    if device_type(device) != "cuda":
        return "it is a Gluon kernel for CUDA SM 9.x (Gluon has no interpreter)"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"it uses Hopper wgmma / setmaxnreg (SM 9.x), device is SM {major}.x"
    return None


def ws_rows_problem(kv_rows: torch.Tensor) -> str | None:
    """Why the warp-specialised kernel can't read these fp8_ds_mla rows, or None."""
    if kv_rows.data_ptr() % 16 or kv_rows.stride(0) % 16:
        return "its cp.async gathers need 16-byte aligned rows (data_ptr and row stride)"
    return None


def ws_unsupported(inp: DecodeInputs, dev: torch.device) -> str | None:
    """Why the warp-specialised kernel can't take these inputs here, or None."""
    if inp.row_format is not RowFormat.FP8_DS_MLA:
        return "it reads fp8_ds_mla rows only"
    return ws_device_problem(dev) or gluon_ws_problem() or ws_rows_problem(inp.kv_rows)


def default_config(T: int, H: int, K: int, device: torch.device,
                   row_format: RowFormat | str = RowFormat.FP8_DS_MLA, *,
                   allow_ws: bool = True,
                   kv_rows: torch.Tensor | None = None,
                   sms: int | None = None) -> TritonMLAConfig:
    """Heuristic launch shape: head blocks of up to 64, enough KV splits to fill the SMs.

    fp8_ds_mla rows with 64-head blocks on an SM 9.x GPU get the warp-specialised kernel
    (``ws``) when the installed Triton can build it and, with ``kv_rows`` (uint8 [N, 656])
    given, those rows are 16-byte aligned; ``allow_ws=False`` asks for the ``tl``
    kernels. Otherwise the config's ``ws_off_reason`` says why not. ``sms``: the SMs the
    launch may plan for (``auto_splits``). The answer depends on nothing but these
    arguments (of ``kv_rows``, only whether its rows are 16-byte aligned) and the
    module's tables, so it is computed once per distinct call (an eager decode asks
    every layer; a device given without an index is asked anew each time).
    """
    key = cfg = None
    if (type(T) is int and type(H) is int and type(K) is int and type(allow_ws) is bool
            and (sms is None or type(sms) is int) and isinstance(device, torch.device)
            and (device.type != "cuda" or device.index is not None)  # "cuda" alone: whichever is current
            and isinstance(row_format, (RowFormat, str)) and (kv_rows is None or isinstance(kv_rows, torch.Tensor))):
        rows_ok = None if kv_rows is None else ws_rows_problem(kv_rows) is None
        # the functions it asks (their identity: a test that replaces one asks anew)
        key = (T, H, K, device, row_format, allow_ws, rows_ok, sms, ws_device_problem, gluon_ws_problem,
               isolate_problem, auto_splits, sm_count)
        cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _default_config(T, H, K, device, row_format, allow_ws=allow_ws, kv_rows=kv_rows, sms=sms)
        if key is not None:
            if len(_CONFIGS) >= _CONFIGS_MAX:
                _CONFIGS.clear()
            _CONFIGS[key] = cfg
    return cfg


_CONFIGS: dict[tuple, "TritonMLAConfig"] = {}
_CONFIGS_MAX = 4096  # distinct (T, H, K, device, ...) calls remembered; then forgotten at once


def _default_config(T: int, H: int, K: int, device: torch.device,
                   row_format: RowFormat | str = RowFormat.FP8_DS_MLA, *,
                   allow_ws: bool = True,
                   kv_rows: torch.Tensor | None = None,
                   sms: int | None = None) -> TritonMLAConfig:
    """``default_config`` computed (every argument checked)."""
    check_int("T", T, 0)
    check_int("H", H, 1)
    check_int("K", K, 0)
    check_bool("allow_ws", allow_ws)
    fmt = RowFormat.parse(row_format)
    block_h = min(64, max(16, triton.next_power_of_2(H)))
    cfg = DEFAULT_CONFIGS[(fmt, block_h)]
    iso = isolate_problem(cfg, device)
    if iso is not None:  # slower without isolation, but it compiles
        cfg = dataclasses.replace(cfg, isolate_qk=False, isolate_off_reason=iso)
    if not allow_ws:
        why = "allow_ws=False"
    elif fmt is not RowFormat.FP8_DS_MLA:
        why = "it reads fp8_ds_mla rows only"
    elif block_h != 64:
        why = f"it computes 64-head blocks; {H} heads run in {block_h}-head blocks"
    else:
        why = (ws_device_problem(device) or gluon_ws_problem()
               or (ws_rows_problem(kv_rows) if kv_rows is not None else None))
    if why is None:
        cfg = dataclasses.replace(cfg, **WS_DEFAULT)
    else:
        cfg = dataclasses.replace(cfg, ws_off_reason=f"warp-specialised kernel off: {why}")
    return dataclasses.replace(cfg, num_splits=auto_splits(T, H, K, cfg, device, sms=sms))


def auto_splits(T: int, H: int, K: int, cfg: TritonMLAConfig, device: torch.device, *,
                sms: int | None = None) -> int:
    """KV splits so that T x head blocks x splits is about one wave of SMs.

    1 when T x head blocks already fills the SMs (or on CPU); each split keeps at least
    2 iterations of ``block_n`` rows; at most ``MAX_AUTO_SPLITS``. ``sms``: the SMs the
    launch may plan for (None: the device's; ``check_sms``).
    """
    if device_type(device) != "cuda":
        return 1
    programs = max(1, T * math.ceil(H / cfg.block_h))
    max_useful = max(1, K // (2 * cfg.block_n))
    return max(1, min(check_sms(sms, device) // programs, max_useful, MAX_AUTO_SPLITS))


def check_sms(sms: int | None, device: torch.device) -> int:
    """The SMs a launch may plan for: ``sms`` (1 .. the device's count), or the device's
    count for None. A launch given fewer sizes its waves for them, so that work running
    beside it on the other SMs (a split decode layer's staging copy) does not push its
    last programs into a wave of their own."""
    total = sm_count(device) if device_type(device) == "cuda" else None
    if sms is None:
        if total is None:
            raise ValueError("check_sms needs sms on a device without an SM count")
        return total
    check_int("sms", sms, 1, None if total is None else total + 1)
    return sms


def _ws_kernel():
    """The Gluon kernel, imported on first use: ``mla_decode_ws`` is written against an
    experimental API that changes between Triton releases, so it is imported only after
    ``gluon_ws_problem()`` found what it needs (which the callers check first)."""
    return importlib.import_module("hisparse.kernels.mla_decode_ws").sparse_mla_decode_ws_kernel


def wave_tail_plan(T: int, head_blocks: int, K: int, block_n: int, sms: int) -> tuple[int, int]:
    """(tail tokens, their KV splits) for a one-split launch of T x head_blocks programs
    on ``sms`` SMs; (0, 1) = a single launch.

    Each program needs a whole SM, so programs past the last full wave run in a wave of
    their own that takes as long as a full one. When that wave would be at most half
    full, its tokens (the last ones) are split along the KV instead: enough splits to
    fill the SMs, each split at least 2 iterations of ``block_n`` rows, at most
    ``MAX_AUTO_SPLITS``; fewer than 2 splits = no tail.
    """
    units = T * head_blocks
    rem = units % sms
    if units <= sms or rem == 0 or 2 * rem > sms:
        return 0, 1
    tail = math.ceil(rem / head_blocks)
    splits = min(sms // (tail * head_blocks), max(1, K // (2 * block_n)), MAX_AUTO_SPLITS)
    return (tail, splits) if splits >= 2 else (0, 1)


def _tail_plan(T: int, H: int, K: int, cfg: TritonMLAConfig, splits: int, dev: torch.device,
               sms: int | None) -> tuple[int, int]:
    """``wave_tail_plan`` for this launch where it applies (CUDA, the ws kernel, one
    split, wave_tail): the ``tl`` kernels were not measured with it."""
    if device_type(dev) != "cuda" or not cfg.ws or splits != 1 or not cfg.wave_tail:
        return 0, 1
    return wave_tail_plan(T, math.ceil(H / cfg.block_h), K, cfg.block_n, check_sms(sms, dev))


# the most entries of a row one program maps in its prologue where a decode maps its own
# top-k (paged_problem): up to here mapping them in the attention is faster than the
# resolve's own kernel, past it slower (BENCHMARKS.md, "The elastic tier (H100)")
PAGED_ENTRIES_MAX = 512


def _rows_per_split(K: int, splits: int, block_n: int) -> tuple[int, int]:
    """(rows per split, splits): a multiple of block_n; splits that would get no rows dropped."""
    rows = math.ceil(math.ceil(K / splits) / block_n) * block_n
    return rows, math.ceil(K / rows)


def _split_plan(T: int, H: int, K: int, cfg: "TritonMLAConfig", device: torch.device,
                sms: int | None = None) -> tuple[int, int]:
    """(rows per split, splits) of a decode's main launch under ``cfg`` (its own
    ``num_splits``, else ``auto_splits`` for ``sms`` SMs)."""
    splits = cfg.num_splits if cfg.num_splits is not None else auto_splits(T, H, K, cfg, device, sms=sms)
    return _rows_per_split(K, splits, cfg.block_n)


def run_sparse_mla(inp: DecodeInputs, cfg: TritonMLAConfig | None = None, *,
                   sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel(s) on validated inputs. Returns out bf16 [T, H, 512], lse f32 [T, H].

    cfg None: ``default_config`` for these inputs (the ``tl`` kernels for rows the
    warp-specialised kernel can't read, e.g. a view that is not 16-byte aligned).
    sms: the SMs the launch plans its KV splits and wave tail for (``check_sms``; None:
    all of the device's). Checked, then ignored, on CPU. A ``triton_plan.DecodePlan``
    made and run at once.
    """
    return DecodePlan(inp, cfg, sms).run(inp.q, inp.kv_rows, inp.indices, inp.valid_counts, inp.sm_scale)


class TritonBackend(SparseMLABackend):
    """Portable Triton backend (bf16 and fp8_ds_mla decode, bf16-workspace prefill).

    config: a fixed ``TritonMLAConfig`` (None = ``default_config`` per call); a fixed
        ``ws`` config makes ``supports`` answer for the warp-specialised kernel.
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
        self._supported: set = set()  # (device, row format, heads, phase, config, interpreter) accepted by supports()
        self._plans: dict = {}  # call_signature -> DecodePlan of unchecked decodes

    def supports(self, *, device: torch.device, row_format: RowFormat, num_heads: int,
                 phase: Phase) -> str | None:
        device = torch.device(device)
        fmt = RowFormat.parse(row_format)
        reason = heads_reason(num_heads)
        if reason is not None:
            return reason
        if phase is Phase.PREFILL and fmt is not RowFormat.BF16:
            return "prefill runs over a bf16 workspace; row_format must be bf16"
        if self.config is not None and self.config.ws:
            why = ("it reads fp8_ds_mla rows only" if fmt is not RowFormat.FP8_DS_MLA
                   else ws_device_problem(device) or gluon_ws_problem())
            if why is not None:
                return f"config has ws=True, but the warp-specialised kernel can't run: {why}"
        if device_type(device) == "cpu":
            if not self.allow_interpreter:
                return "Triton needs a CUDA device (CPU only through the interpreter, for tests)"
            if not interpreter_mode():
                return "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
            return None
        if device_type(device) != "cuda":
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
        key = (inp_device, fmt, H, phase, self.config, self.allow_interpreter)
        if key in self._supported:  # accepted before: the answer depends on nothing else
            return
        reason = self.supports(device=inp_device, row_format=fmt, num_heads=H, phase=phase)
        if reason is not None:
            raise ValueError(f"triton backend cannot run this {phase.value}: {reason}")
        self._supported.add(key)

    plans_sms = True

    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format, sms=None, paged=None,
               out=None, lse=None):
        """As ``SparseMLABackend.decode``; ``sms`` plans the launch for that many SMs
        (``run_sparse_mla``). Unchecked (``validate=False``), a call with the metadata
        of one this backend checked and planned before (``triton_plan.call_signature``)
        runs that plan without checking or planning again.

        ``out`` (bf16 [T, H, 512]) and ``lse`` (float32 [T, H]), contiguous: buffers of
        the caller's to write the results into (and return), as an engine's attention
        layer hands its backend the layer's output; None: allocated per call. Checked
        calls refuse one that shares storage with an input; unchecked, that is the
        caller's promise.

        ``paged`` (an ``attention.paged.PagedLookup``, a cache's tables): ``indices`` are
        the top-k's logical positions (int32 [T, K], -1 = padding), which the kernel maps
        to rows of ``kv_rows`` itself, writing the resident resolve's physical rows and
        counters (``kernels.paged_rows``); no valid counts; their ranges are the cache's
        to check, not this backend's. Not with ``wide`` configs."""
        sig = None
        if not self.validate:
            sig = call_signature(q, kv_rows, indices, valid_counts, sm_scale, row_format, sms)
            if sig is not None and paged is not None:
                try:  # a field that is no tensor: checked (and refused) below
                    sig = (sig, paged.signature()) if type(paged) is PagedLookup else None
                except (AttributeError, TypeError):
                    sig = None
            if sig is not None and (out is not None or lse is not None):
                osig = output_signature(out, lse)
                sig = (sig, osig) if osig is not None else None
            plan = self._plans.get(sig) if sig is not None else None
            if plan is not None and plan.config is self.config and plan.interpreter is self.allow_interpreter:
                return plan.run(q, kv_rows, indices, valid_counts, sm_scale, paged, out, lse)
        inp = validate_decode_inputs(q, kv_rows, indices, valid_counts=valid_counts,
                                     sm_scale=sm_scale, row_format=row_format,
                                     check_ranges=self.validate and paged is None)
        if paged is not None:
            if valid_counts is not None:
                raise ValueError("a paged decode takes no valid_counts: the kernel maps every entry itself")
            check_paged(paged, inp.q.shape[0], inp.indices.shape[1], inp.q.device)
        if out is not None or lse is not None:
            check_outputs(out, lse, inp.q, (q, kv_rows, indices, valid_counts)
                          + (() if paged is None else paged.tensors()))
        self._check_supported(inp.q.device, inp.row_format, inp.num_heads, Phase.DECODE)
        plan = DecodePlan(inp, self.config, sms, kv_as_bf16=inp.kv_rows is not kv_rows, paged=paged)
        if sig is not None:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            plan.interpreter = self.allow_interpreter
            self._plans[sig] = plan
        return plan.run(inp.q, kv_rows, inp.indices, inp.valid_counts, inp.sm_scale, paged, out, lse)

    def paged_problem(self, T: int, H: int, K: int, *, device, row_format, kv_rows=None) -> str | None:
        """Why a decode of this shape over ``kv_rows`` should not map its top-k itself
        (``decode(..., paged=)``) here; None: it should. The ``wide`` kernel has no paged
        prologue; on CUDA only the warp-specialised kernel's was measured; and a program
        whose share of a row is longer than ``PAGED_ENTRIES_MAX`` spends longer mapping
        it, before it attends, than the resident resolve's own kernel takes
        (BENCHMARKS.md, "The elastic tier (H100)")."""
        device = torch.device(device)
        if T == 0 or K == 0:
            return "an empty decode launches nothing"
        cfg = self.config or default_config(T, H, K, device, row_format, kv_rows=kv_rows)
        if cfg.wide:
            return "the wide kernel has no paged lookup"
        if device.type == "cuda" and not cfg.ws:  # decode(..., paged=) runs, bitwise equal, but unmeasured
            return ("measured with the warp-specialised kernel only (the tl kernel's paged variant spills 16 "
                    "bytes at 64-head blocks under Triton 3.6)")
        rows, splits = _split_plan(T, H, K, cfg, device)
        if rows > PAGED_ENTRIES_MAX:
            return (f"{rows} entries a program (K = {K} over {splits} KV splits): more than "
                    f"{PAGED_ENTRIES_MAX} to map before attending")
        return None

    def decode_programs(self, T, H, K, *, device, row_format):
        """The programs of the (first) launch of a ws-kernel decode, whose programs each
        need a whole SM: T x head blocks x KV splits; None for the ``tl`` kernels, whose
        programs share SMs, and off CUDA."""
        device = torch.device(device)
        if device_type(device) != "cuda" or T == 0 or K == 0:
            return None
        cfg = self.config or default_config(T, H, K, device, row_format)
        if not cfg.ws:
            return None
        return T * math.ceil(H / cfg.block_h) * _split_plan(T, H, K, cfg, device)[1]

    def prefill(self, q, workspace, indices, *, valid_counts=None, sm_scale):
        inp = validate_prefill_inputs(q, workspace, indices, valid_counts=valid_counts,
                                      sm_scale=sm_scale, check_ranges=self.validate)
        self._check_supported(inp.q.device, RowFormat.BF16, q.shape[1], Phase.PREFILL)
        return run_sparse_mla(inp.as_decode(), self.config)


__all__ = ["TritonBackend", "TritonMLAConfig", "default_config", "auto_splits", "run_sparse_mla",
           "check_sms",
           "wave_tail_plan",
           "DEFAULT_CONFIGS", "WS_DEFAULT", "isolate_problem", "ws_unsupported",
           "ws_device_problem",
           "ws_rows_problem", "ws_shared_bytes", "ws_consumer_regs", "WS_MAXNREG"]

