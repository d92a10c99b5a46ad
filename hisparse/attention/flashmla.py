"""FlashMLA backend: DeepSeek's sparse-MLA kernels (SM90 / SM100) behind our interface.

Where the ops come from (``load_flashmla_ops``), first found wins:
  1. ``library_path`` given by the caller (e.g. ``.gpu-deps/vllm/_flashmla_C.abi3.so``,
     taken from a ``--flashmla-lib`` flag or ``HISPARSE_FLASHMLA_LIB`` at the CLI edge):
     ``torch.ops.load_library(path)``, ops in ``torch.ops._flashmla_C``;
  2. an installed vllm: ``import vllm._flashmla_C`` -> ``torch.ops._flashmla_C``;
  3. an installed sgl_kernel: ``from sgl_kernel import flashmla_ops`` ->
     ``torch.ops.sgl_kernel``.
The op schemas are read (``op.default._schema``) and the calls are made by argument
name, so a build whose arguments we don't recognise is reported as unsupported
(with its schema) instead of being called wrongly.

Facts the wrapper relies on (vllm 0.30 ``_flashmla_C``; FlashMLA's own reference):
- decode ``sparse_decode_fwd(q [b, s_q, h_q, 576] bf16, kv [blocks, block, 1, 656]
  uint8, indices [b, s_q, topk] int32 = block * block_size + offset, topk_length [b]
  int32?, attn_sink?, tile_scheduler_metadata?, num_splits?, extra_*?, d_v=512,
  sm_scale, out_?) -> (out [b, s_q, h_q, 512], lse, sched_meta, num_splits)``.
  fp8_ds_mla rows only; ``kv.stride(1) == 656``; h_q must be 64 or 128; only index
  -1 is masked (any other out-of-range index is an illegal memory access).
  Passing ``None`` metadata makes the op compute its tile schedule and return it.
- prefill ``sparse_prefill_fwd(q [s_q, h_q, 576] bf16, kv [s_kv, 1, 576] bf16,
  indices [s_q, 1, topk] int32, sm_scale, d_v, attn_sink?, topk_length [s_q]?, ...)
  -> [out [s_q, h_q, 512], max_logits [s_q, h_q], lse [s_q, h_q]]``; h_q 64 or 128.
- LSE is in natural log; a query with no valid index gets out = 0 and lse = +inf,
  which we turn into the interface's -inf.

Our mapping: decode treats each query token as a batch entry (b = T, s_q = 1).

``valid_counts [T]``: decode masks the entries past each count to -1 (the SM90 decode
kernel rejects ``topk_length``); prefill passes them as ``topk_length [s_q]``. Heads are processed in
groups of at most 128, each zero-padded to 64 or 128 and sliced back. K is padded
with -1 to a multiple of 64 (the kernels' top-k tile; the SM90 kernel asserts it).
The flat row view ``uint8 [N, 656]`` is viewed as ``[N / 64, 64, 1, 656]``: the SM90
kernel splits an index into (index // 64, index % 64) with a page size of 64 fixed at
compile time (in the FlashMLA source we read), so a flat row number is a valid index
only with 64-row pages, and N must be a multiple of 64 (else ValueError, before launch).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from ..formats import FP8_ROW_BYTES, RowFormat
from .base import (
    D_QK,
    D_V,
    DecodeInputs,
    Phase,
    SparseMLABackend,
    empty_result,
    heads_reason,
    validate_decode_inputs,
    validate_prefill_inputs,
)

_DECODE_ARGS = ("q", "kv", "indices", "topk_length", "attn_sink", "tile_scheduler_metadata",
                "num_splits", "extra_kv", "extra_indices", "extra_topk_length", "d_v",
                "sm_scale")
_PREFILL_ARGS = ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length")
_HEAD_GROUP = 128  # most heads one launch takes
_TOPK_TILE = 64  # K is padded with -1 to a multiple of this
_BLOCK = 64  # page block size of the flat-row view (the SM90 kernel's PAGE_BLOCK_SIZE)


@dataclasses.dataclass(frozen=True)
class FlashMLAOps:
    """The loaded FlashMLA ops and where they came from.

    ``decode_fill`` / ``prefill_fill``: extra schema arguments (beyond the ones we
    pass) that have no default but are optional; they are passed as None.
    """

    source: str
    decode: object  # torch op overload packet: sparse_decode_fwd
    prefill: object | None  # sparse_prefill_fwd, None when the build lacks it
    decode_fill: tuple[str, ...]
    prefill_fill: tuple[str, ...]


_LOCK = threading.Lock()
_CACHE: dict[str | None, tuple[FlashMLAOps | None, str | None]] = {}


def _namespace_op(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>`` or None (looking it up never launches anything)."""
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def _fill_for(op, wanted: tuple[str, ...]) -> tuple[tuple[str, ...] | None, str]:
    """Check ``op``'s schema: every name in ``wanted`` present, every other argument
    either defaulted or optional. Returns (names to pass as None, schema text)."""
    schema = op.default._schema
    args = list(schema.arguments)
    names = [a.name for a in args]
    if any(w not in names for w in wanted):
        return None, str(schema)
    fill = []
    for a in args:
        if a.name in wanted or a.has_default_value():
            continue
        if isinstance(a.type, torch._C.OptionalType):
            fill.append(a.name)
        else:
            return None, str(schema)
    return tuple(fill), str(schema)


def _ops_from_namespace(namespace: str, source: str) -> tuple[FlashMLAOps | None, str | None]:
    dec = _namespace_op(namespace, "sparse_decode_fwd")
    if dec is None:
        return None, f"{source} loaded but torch.ops.{namespace}.sparse_decode_fwd is missing"
    dfill, dschema = _fill_for(dec, _DECODE_ARGS)
    if dfill is None:
        return None, (f"{source}: sparse_decode_fwd has a schema this wrapper does not know: "
                      f"{dschema} (expected arguments {list(_DECODE_ARGS)})")
    pre = _namespace_op(namespace, "sparse_prefill_fwd")
    pfill: tuple[str, ...] = ()
    if pre is not None:
        pf, _ = _fill_for(pre, _PREFILL_ARGS)
        if pf is None:
            pre = None
        else:
            pfill = pf
    return FlashMLAOps(source, dec, pre, dfill, pfill), None


def _load(library_path: str | None) -> tuple[FlashMLAOps | None, str | None]:
    if library_path is not None:
        if not os.path.isfile(library_path):
            return None, f"FlashMLA library {library_path!r} does not exist"
        if _namespace_op("_flashmla_C", "sparse_decode_fwd") is not None:
            # a copy is registered already (vllm imported, or this path loaded before);
            # loading a second copy would clash, so use the registered one
            return _ops_from_namespace("_flashmla_C", "torch.ops._flashmla_C (already loaded)")
        try:
            torch.ops.load_library(library_path)
        except (OSError, RuntimeError) as e:  # missing CUDA libs, ABI mismatch
            return None, f"loading FlashMLA library {library_path!r} failed: {e}"
        return _ops_from_namespace("_flashmla_C", f"library {library_path}")
    reasons = []
    # vllm and sgl_kernel are optional dependencies, imported only here: each import
    # registers its FlashMLA ops with torch (and pulls in a large CUDA library)
    try:
        import vllm._flashmla_C  # noqa: F401  (registers torch.ops._flashmla_C)

        return _ops_from_namespace("_flashmla_C", "vllm._flashmla_C")
    except ImportError as e:
        reasons.append(f"vllm._flashmla_C: {e}")
    except Exception as e:  # a broken third-party install: report it, don't crash supports()
        reasons.append(f"vllm._flashmla_C failed to load: {type(e).__name__}: {e}")
    try:
        from sgl_kernel import flashmla_ops  # noqa: F401  (registers torch.ops.sgl_kernel)

        return _ops_from_namespace("sgl_kernel", "sgl_kernel.flashmla_ops")
    except ImportError as e:
        reasons.append(f"sgl_kernel.flashmla_ops: {e}")
    except Exception as e:  # a broken third-party install: report it, don't crash supports()
        reasons.append(f"sgl_kernel.flashmla_ops failed to load: {type(e).__name__}: {e}")
    return None, ("FlashMLA ops not found (no library_path given; "
                  + "; ".join(reasons)
                  + "). Install vllm or sgl_kernel, or pass the path of _flashmla_C.abi3.so "
                  "(CLI: --flashmla-lib / HISPARSE_FLASHMLA_LIB)")


def load_flashmla_ops(library_path: str | None = None) -> tuple[FlashMLAOps | None, str | None]:
    """Find the FlashMLA ops (see the module docstring); cached per ``library_path``.

    Returns ``(ops, None)`` or ``(None, reason)``; never raises for a missing or
    broken installation. Loading needs CUDA-enabled torch (the library links CUDA).
    """
    key = None if library_path is None else str(library_path)
    with _LOCK:
        if key not in _CACHE:
            if not torch.cuda.is_available():
                # the library links the CUDA runtime; don't even try on a CPU-only torch
                _CACHE[key] = (None, "FlashMLA ops need CUDA, and torch.cuda.is_available() "
                                     f"is False (torch {torch.__version__})")
            else:
                _CACHE[key] = _load(key)
        return _CACHE[key]


def _sm_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashMLA needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "FlashMLA needs CUDA, which is not available here"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return (f"FlashMLA sparse kernels run on SM90 (Hopper) and SM100 (Blackwell DC) only; "
                f"this GPU is SM{major}{minor}")
    return None


def pad_topk(indices: torch.Tensor) -> torch.Tensor:
    """Pad top-k indices to FlashMLA's top-k tile: int32 [T, K] -> int32 [T, K'] with K'
    the next multiple of 64 (the SM90 kernels require it), the new entries -1 (padding).
    Returns ``indices`` itself when K already is a multiple of 64."""
    K = indices.shape[1]
    pad = (-K) % _TOPK_TILE
    if pad == 0:
        return indices
    return torch.nn.functional.pad(indices, (0, pad), value=-1)


def _head_groups(H: int):
    """(start, count, padded) per launch: groups of <= 128 heads padded to 64 or 128."""
    for h0 in range(0, H, _HEAD_GROUP):
        hc = min(_HEAD_GROUP, H - h0)
        yield h0, hc, (64 if hc <= 64 else 128)


def _padded_q(q: torch.Tensor, h0: int, hc: int, hp: int) -> torch.Tensor:
    """bf16 [T, H, 576] -> bf16 [T, hp, 576]: heads h0..h0+hc then zeros."""
    qc = q[:, h0:h0 + hc]
    if hc == hp:
        return qc
    qp = q.new_zeros((q.shape[0], hp, D_QK))
    qp[:, :hc] = qc
    return qp


def _fix_lonely(lse: torch.Tensor) -> torch.Tensor:
    """FlashMLA marks a query with no valid index with lse = +inf; ours is -inf."""
    return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


class FlashMLABackend(SparseMLABackend):
    """Sparse decode on fp8_ds_mla rows and sparse prefill on a bf16 workspace via FlashMLA.

    ``library_path``: a ``_flashmla_C`` shared library to load (else vllm/sgl_kernel).
    ``check_ranges``: validate index ranges before launch (a host sync). With False
    (the graph-capturable path) out-of-range indices are replaced by -1 on the GPU
    before the launch, since FlashMLA would read out of bounds for them.
    """

    name = "flashmla"
    persistent_grid = True

    def __init__(self, *, library_path: str | None = None, check_ranges: bool = True) -> None:
        self.library_path = library_path
        self.check_ranges = bool(check_ranges)
        self._sched: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- capability
    def ops(self) -> tuple[FlashMLAOps | None, str | None]:
        return load_flashmla_ops(self.library_path)

    def supports(self, *, device: torch.device, row_format: RowFormat, num_heads: int,
                 phase: Phase) -> str | None:
        device = torch.device(device)
        fmt = RowFormat.parse(row_format)
        reason = heads_reason(num_heads)
        if reason is not None:
            return reason
        if phase is Phase.DECODE and fmt is not RowFormat.FP8_DS_MLA:
            return ("FlashMLA sparse decode reads fp8_ds_mla rows only (656 bytes); "
                    f"{fmt.value} rows are not supported")
        reason = _sm_reason(device)
        if reason is not None:
            return reason
        ops, reason = self.ops()
        if ops is None:
            return reason
        if phase is Phase.PREFILL and ops.prefill is None:
            return f"{ops.source} has no usable sparse_prefill_fwd op"
        return None

    def _require(self, device: torch.device, fmt: RowFormat, H: int, phase: Phase) -> FlashMLAOps:
        reason = self.supports(device=device, row_format=fmt, num_heads=H, phase=phase)
        if reason is not None:
            raise ValueError(f"FlashMLA backend cannot run this {phase.value}: {reason}")
        ops, _ = self.ops()
        assert ops is not None  # supports() found them
        return ops

    # ---------------------------------------------------------------- helpers
    def _sanitize(self, idx: torch.Tensor, vc: torch.Tensor | None, N: int):
        """Unchecked path: out-of-range entries -> -1, counts clamped to [0, K] (GPU only)."""
        if self.check_ranges:
            return idx, vc
        bad = (idx < -1) | (idx >= N)
        idx = torch.where(bad, torch.full_like(idx, -1), idx)
        if vc is not None:
            vc = vc.clamp(0, idx.shape[1])
        return idx, vc

    def _blocked_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """uint8 [N, 656] -> uint8 [N / 64, 64, 1, 656] (a view; rows must be packed)."""
        N = kv.shape[0]
        if N > 1 and kv.stride(0) != FP8_ROW_BYTES:
            raise ValueError(
                f"FlashMLA needs densely packed fp8_ds_mla rows (kv_rows.stride(0) == "
                f"{FP8_ROW_BYTES}), got stride {kv.stride(0)}")
        if N % _BLOCK != 0:
            raise ValueError(
                f"FlashMLA's sparse decode addresses rows in pages of {_BLOCK} (index // "
                f"{_BLOCK}, index % {_BLOCK}), so the flat row view must hold a multiple of "
                f"{_BLOCK} rows; got N = {N}. Allocate the rows rounded up to {_BLOCK}, "
                "or use the triton backend")
        return kv.as_strided((N // _BLOCK, _BLOCK, 1, FP8_ROW_BYTES),
                             (_BLOCK * FP8_ROW_BYTES, FP8_ROW_BYTES, FP8_ROW_BYTES, 1))

    # ---------------------------------------------------------------- decode
    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format):
        inp = validate_decode_inputs(q, kv_rows, indices, valid_counts=valid_counts,
                                     sm_scale=sm_scale, row_format=row_format,
                                     check_ranges=self.check_ranges)
        ops = self._require(inp.q.device, inp.row_format, inp.num_heads, Phase.DECODE)
        return self._decode(ops, inp)

    def _decode(self, ops: FlashMLAOps, inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv = inp.q, inp.kv_rows
        T, H = q.shape[0], q.shape[1]
        N, K = kv.shape[0], inp.indices.shape[1]
        if T == 0 or K == 0 or N == 0:  # nothing can be valid (ranges were checked/sanitized)
            return empty_result(T, H, q.device)
        idx, vc = self._sanitize(inp.indices, inp.valid_counts, N)
        if vc is not None:
            # The SM90 sparse decode kernel has no dynamic top-k length (it asserts
            # topk_length == nullptr: "V3.2 does not support dynamic topk length", seen on
            # the H200), so entries past each token's valid count become -1 instead.
            k = torch.arange(idx.shape[1], device=idx.device, dtype=torch.int32)
            idx = torch.where(k[None, :] < vc[:, None], idx, torch.full_like(idx, -1))
            vc = None
        idx3 = pad_topk(idx).unsqueeze(1)  # int32 [T, 1, K']
        kv4 = self._blocked_kv(kv)
        groups = list(_head_groups(H))
        direct = len(groups) == 1 and groups[0][1] == groups[0][2]  # H is 64 or 128
        if not direct:
            out = torch.empty((T, H, D_V), dtype=torch.bfloat16, device=q.device)
            lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        for h0, hc, hp in groups:
            q4 = _padded_q(q, h0, hc, hp).unsqueeze(1)  # bf16 [T, 1, hp, 576]
            key = (q.device, T, hp, idx3.shape[2], tuple(kv4.shape[:2]))
            meta, splits = (None, None) if vc is not None else self._sched.get(key, (None, None))
            args = dict(q=q4, kv=kv4, indices=idx3, topk_length=vc, attn_sink=None,
                        tile_scheduler_metadata=meta, num_splits=splits, extra_kv=None,
                        extra_indices=None, extra_topk_length=None, d_v=D_V,
                        sm_scale=inp.sm_scale)
            for name in ops.decode_fill:
                args[name] = None
            res = ops.decode(**args)
            o4, l4 = res[0], res[1]
            if vc is None and meta is None and len(res) >= 4 and res[2] is not None:
                self._sched[key] = (res[2], res[3])  # schedule depends on shapes only
            l2 = l4.reshape(T, hp)  # [b, s_q, h_q] or [b, h_q, s_q] with s_q = 1
            if direct:
                out = o4.view(T, H, D_V)
                lse = l2
            else:
                out[:, h0:h0 + hc] = o4[:, 0, :hc]
                lse[:, h0:h0 + hc] = l2[:, :hc]
        return out, _fix_lonely(lse)

    # ---------------------------------------------------------------- prefill
    def prefill(self, q, workspace, indices, *, valid_counts=None, sm_scale):
        inp = validate_prefill_inputs(q, workspace, indices, valid_counts=valid_counts,
                                      sm_scale=sm_scale, check_ranges=self.check_ranges)
        ops = self._require(inp.q.device, RowFormat.BF16, inp.q.shape[1], Phase.PREFILL)
        q, ws = inp.q, inp.workspace
        T, H = q.shape[0], q.shape[1]
        W, K = ws.shape[0], inp.indices.shape[1]
        if T == 0 or K == 0 or W == 0:
            return empty_result(T, H, q.device)
        idx, vc = self._sanitize(inp.indices, inp.valid_counts, W)
        idx3 = pad_topk(idx).unsqueeze(1)  # int32 [T, 1, K']
        if vc is not None and not vc.is_contiguous():
            vc = vc.contiguous()
        kv3 = ws.unsqueeze(1)  # bf16 [W, 1, 576]
        out = torch.empty((T, H, D_V), dtype=torch.bfloat16, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        for h0, hc, hp in _head_groups(H):
            qp = _padded_q(q, h0, hc, hp).contiguous()  # bf16 [T, hp, 576]
            args = dict(q=qp, kv=kv3, indices=idx3, sm_scale=inp.sm_scale, d_v=D_V,
                        attn_sink=None, topk_length=vc)
            for name in ops.prefill_fill:
                args[name] = None
            res = ops.prefill(**args)
            out[:, h0:h0 + hc] = res[0][:, :hc]
            lse[:, h0:h0 + hc] = res[2].reshape(T, hp)[:, :hc]
        return out, _fix_lonely(lse)


__all__ = ["FlashMLABackend", "FlashMLAOps", "load_flashmla_ops", "pad_topk"]
