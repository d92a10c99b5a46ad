"""The sparse-MLA attention backend interface and its shared input validator.

Notation (see ``hisparse/cache/state.py`` for the cache side):
  T   query tokens                     H   query heads (any count >= 1)
  K   selected rows per query token    N   rows in the flat row view (decode)
  W   rows in the bf16 prefill workspace
  D_QK = 576 (512 latent "NoPE" + 64 RoPE), D_V = 512 (latent; MLA absorbed form)

Semantics every backend implements (the torch reference in ``reference.py`` is the
oracle): for query token t and head h, the scores are ``s_k = sm_scale * q[t, h] .
row[idx[t, k]]`` over all 576 dims, for the *valid* entries k of token t: entries with
``idx[t, k] == -1`` are padding, and with ``valid_counts`` given, entries
``k >= valid_counts[t]`` are ignored as well. ``p = softmax(s)`` over the valid
entries; ``out[t, h] = sum_k p_k * row[idx[t, k]][:512]``; ``lse[t, h] = log(sum_k
exp(s_k))`` (natural log, the scale included). Duplicated indices count once per
entry. A token with no valid entry gets ``out = 0`` and ``lse = -inf``.

Validation (``validate_decode_inputs`` / ``validate_prefill_inputs``) runs before any
launch and raises ``TypeError`` (wrong type/dtype) or ``ValueError`` (shape, device,
range) naming what was expected and what came. The index range check needs a host
sync; ``check_ranges=False`` skips it (the graph-capturable path) and kernels then
treat an out-of-range entry as padding instead of reading out of bounds.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math

import torch

from .._checks import check_int, check_tensor
from ..formats import BF16_ROW_BYTES, D_LATENT, D_ROW, FP8_ROW_BYTES, RowFormat

D_QK = D_ROW  # query/key dims in the attention notation: 512 latent + 64 RoPE
D_V = D_LATENT  # value dims (the latent)


class Phase(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """Validated, normalised decode inputs.

    q:            bf16 [T, H, 576]
    kv_rows:      uint8 [N, 656] (FP8_DS_MLA) or bf16 [N, 576] (BF16; a uint8
                  [N, 1152] input is viewed as bf16 here); last-dim stride 1
    indices:      int32 [T, K], -1 = padding
    valid_counts: int32 [T] or None
    """

    q: torch.Tensor
    kv_rows: torch.Tensor
    indices: torch.Tensor
    valid_counts: torch.Tensor | None
    sm_scale: float
    row_format: RowFormat

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]


@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """Validated prefill inputs: ``workspace`` bf16 [W, 576]; other fields as decode."""

    q: torch.Tensor
    workspace: torch.Tensor
    indices: torch.Tensor
    valid_counts: torch.Tensor | None
    sm_scale: float

    def as_decode(self) -> DecodeInputs:
        """The same computation phrased as decode over bf16 rows."""
        return DecodeInputs(self.q, self.workspace, self.indices, self.valid_counts,
                            self.sm_scale, RowFormat.BF16)


class SparseMLABackend(abc.ABC):
    """One way to run sparse-MLA attention. Subclasses set ``name``.

    Ask ``supports(...)`` before use (None = supported, else the reason); never pick
    a backend by try/except around a launch.
    """

    name: str = "abstract"
    # whether ``decode(..., sms=)`` plans its grid for fewer SMs than the device has
    plans_sms: bool = False
    # whether ``decode`` runs a persistent grid that holds every SM until its last piece
    # of work is done (its programs are not counted by ``decode_programs``)
    persistent_grid: bool = False

    @abc.abstractmethod
    def supports(self, *, device: torch.device, row_format: RowFormat, num_heads: int,
                 phase: Phase) -> str | None:
        """None if this backend can run the combination, else a human-readable reason."""

    @abc.abstractmethod
    def decode(self, q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, *,
               valid_counts: torch.Tensor | None = None, sm_scale: float,
               row_format: RowFormat | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse decode attention.

        q: bf16 [T, H, 576]; kv_rows: uint8 [N, 656] (fp8_ds_mla) or bf16 [N, 576]
        (or uint8 [N, 1152]); indices: int32 [T, K] rows of kv_rows, -1 = padding;
        valid_counts: int32 [T] | None. Returns out bf16 [T, H, 512] and lse float32
        [T, H] (natural log); no valid index -> out = 0, lse = -inf.
        """

    @abc.abstractmethod
    def prefill(self, q: torch.Tensor, workspace: torch.Tensor, indices: torch.Tensor, *,
                valid_counts: torch.Tensor | None = None,
                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse prefill attention over a staged bf16 workspace [W, 576]; as decode."""

    def decode_programs(self, T: int, H: int, K: int, *, device: torch.device,
                        row_format: RowFormat | str) -> int | None:
        """Programs a ``decode`` of T tokens, H heads and K entries would launch, each
        taking a whole SM (None: not known, e.g. a persistent grid over every SM). A
        split decode layer asks it to size its staging copy beside the attention."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


# ---------------------------------------------------------------- validation
def heads_reason(num_heads: object) -> str | None:
    """The common first check of every ``supports``: None, or why the head count is bad."""
    try:
        check_int("num_heads", num_heads, 1)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _check_scale(sm_scale: object) -> float:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float, got {type(sm_scale).__name__} ({sm_scale!r})")
    s = float(sm_scale)
    if not math.isfinite(s) or s <= 0.0:
        raise ValueError(f"sm_scale must be finite and > 0, got {sm_scale!r}")
    return s


def _check_q(q: object) -> torch.Tensor:
    q = check_tensor("q", q)
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16 [T, H, {D_QK}], got dtype {q.dtype}")
    if q.dim() != 3 or q.shape[2] != D_QK or q.shape[1] < 1:
        raise ValueError(f"q must be [T, H >= 1, {D_QK}], got shape {tuple(q.shape)}")
    if q.stride(2) != 1:
        raise ValueError("q must have a contiguous last dimension (stride(2) == 1)")
    return q


def _check_indices(indices: object, valid_counts: object, T: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    indices = check_tensor("indices", indices)
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32 [T, K], got dtype {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"indices must be [T={T}, K], got shape {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"indices is on {indices.device}, q on {device}")
    if indices.numel() > 0 and indices.stride(1) != 1:
        raise ValueError("indices must have a contiguous last dimension (stride(1) == 1)")
    if valid_counts is None:
        return indices, None
    vc = check_tensor("valid_counts", valid_counts)
    if vc.dtype != torch.int32:
        raise TypeError(f"valid_counts must be int32 [T], got dtype {vc.dtype}")
    if vc.dim() != 1 or vc.shape[0] != T:
        raise ValueError(f"valid_counts must be [T={T}], got shape {tuple(vc.shape)}")
    if vc.device != device:
        raise ValueError(f"valid_counts is on {vc.device}, q on {device}")
    return indices, vc


def _check_ranges(indices: torch.Tensor, valid_counts: torch.Tensor | None, N: int,
                  what: str) -> None:
    """Host-syncing content check: indices in [-1, N), valid_counts in [0, K]."""
    if indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= N:
            raise ValueError(
                f"indices must lie in [-1, {N}) ({what} has {N} rows; -1 = padding), "
                f"got values in [{lo}, {hi}]")
    if valid_counts is not None and valid_counts.numel() > 0:
        K = indices.shape[1]
        lo, hi = int(valid_counts.min()), int(valid_counts.max())
        if lo < 0 or hi > K:
            raise ValueError(f"valid_counts must lie in [0, K={K}], got values in [{lo}, {hi}]")


def check_decode_call(backend: "SparseMLABackend", q: object, sm_scale: object, *,
                      device: torch.device, row_format: RowFormat, supported: set | None = None) -> None:
    """The checks of a decode call that need neither rows nor indices: ``q`` (bf16 [T,
    H, 576] on ``device``, the rows' device, index included), ``sm_scale`` and whether
    ``backend`` supports the call. For a
    caller that resolves the indices first (``hisparse.decode``), so that a call the
    backend would refuse is refused before the resolve changes the cache. ``supported``:
    (device, row format, heads) combinations the backend already accepted, which are
    not asked again (the caller's set; accepted ones are added)."""
    q = _check_q(q)
    if q.device != device:
        raise ValueError(f"q is on {q.device}, the cache's rows on {device}; move it there first")
    _check_scale(sm_scale)
    key = (q.device, row_format, q.shape[1])
    if supported is not None and key in supported:
        return
    reason = backend.supports(device=q.device, row_format=row_format, num_heads=q.shape[1], phase=Phase.DECODE)
    if reason is not None:
        raise ValueError(f"{backend.name} backend cannot run this decode: {reason}")
    if supported is not None:
        supported.add(key)


def normalize_kv_rows(kv_rows: object, row_format: RowFormat | str) -> torch.Tensor:
    """Check ``kv_rows`` against ``row_format``; return uint8 [N, 656] or bf16 [N, 576].

    A uint8 [N, 1152] view of bf16 rows is reinterpreted (no copy) as bf16 [N, 576].
    """
    fmt = RowFormat.parse(row_format)
    kv = check_tensor("kv_rows", kv_rows)
    if kv.dim() != 2:
        raise ValueError(f"kv_rows must be 2-D [N, row], got shape {tuple(kv.shape)}")
    if kv.shape[0] > 0 and kv.stride(1) != 1:
        raise ValueError("kv_rows must have a contiguous last dimension (stride(1) == 1)")
    if fmt is RowFormat.FP8_DS_MLA:
        if kv.dtype != torch.uint8:
            raise TypeError(f"fp8_ds_mla kv_rows must be uint8 [N, {FP8_ROW_BYTES}], got {kv.dtype}")
        if kv.shape[1] != FP8_ROW_BYTES:
            raise ValueError(f"fp8_ds_mla kv_rows must be [N, {FP8_ROW_BYTES}], got {tuple(kv.shape)}")
        if (kv.shape[0] > 1 and kv.stride(0) % 4 != 0) or kv.data_ptr() % 4 != 0:
            raise ValueError("fp8_ds_mla kv_rows must be 4-byte aligned (row stride and start "
                             "multiples of 4: the float32 scales are read with 4-byte loads)")
        return kv
    if kv.dtype == torch.uint8:
        if kv.shape[1] != BF16_ROW_BYTES:
            raise ValueError(f"bf16 kv_rows as bytes must be uint8 [N, {BF16_ROW_BYTES}], "
                             f"got {tuple(kv.shape)}")
        if (kv.shape[0] > 1 and kv.stride(0) % 2 != 0) or kv.storage_offset() % 2 != 0:
            raise ValueError("bf16 kv_rows as bytes must be 2-byte aligned (even row stride/offset)")
        return kv.view(torch.bfloat16)
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"bf16 kv_rows must be bfloat16 [N, {D_QK}] (or uint8 [N, "
                        f"{BF16_ROW_BYTES}]), got {kv.dtype}")
    if kv.shape[1] != D_QK:
        raise ValueError(f"bf16 kv_rows must be [N, {D_QK}], got {tuple(kv.shape)}")
    return kv


def validate_decode_inputs(q: object, kv_rows: object, indices: object, *,
                           valid_counts: object = None, sm_scale: object,
                           row_format: RowFormat | str,
                           check_ranges: bool = True) -> DecodeInputs:
    """Validate decode inputs (raises before any launch); see the module docstring."""
    fmt = RowFormat.parse(row_format)
    q = _check_q(q)
    kv = normalize_kv_rows(kv_rows, fmt)
    if kv.device != q.device:
        raise ValueError(f"kv_rows is on {kv.device}, q on {q.device}")
    idx, vc = _check_indices(indices, valid_counts, q.shape[0], q.device)
    scale = _check_scale(sm_scale)
    if check_ranges:
        _check_ranges(idx, vc, kv.shape[0], "kv_rows")
    return DecodeInputs(q, kv, idx, vc, scale, fmt)


def validate_prefill_inputs(q: object, workspace: object, indices: object, *,
                            valid_counts: object = None, sm_scale: object,
                            check_ranges: bool = True) -> PrefillInputs:
    """Validate prefill inputs: ``workspace`` bf16 [W, 576]; otherwise as decode."""
    q = _check_q(q)
    ws = check_tensor("workspace", workspace)
    if ws.dtype != torch.bfloat16:
        raise TypeError(f"workspace must be bfloat16 [W, {D_QK}], got dtype {ws.dtype}")
    if ws.dim() != 2 or ws.shape[1] != D_QK:
        raise ValueError(f"workspace must be [W, {D_QK}], got shape {tuple(ws.shape)}")
    if ws.shape[0] > 0 and ws.stride(1) != 1:
        raise ValueError("workspace must have a contiguous last dimension (stride(1) == 1)")
    if ws.device != q.device:
        raise ValueError(f"workspace is on {ws.device}, q on {q.device}")
    idx, vc = _check_indices(indices, valid_counts, q.shape[0], q.device)
    scale = _check_scale(sm_scale)
    if check_ranges:
        _check_ranges(idx, vc, ws.shape[0], "workspace")
    return PrefillInputs(q, ws, idx, vc, scale)


def check_outputs(out: object, lse: object, q: torch.Tensor, inputs: tuple) -> None:
    """A decode's caller-given outputs, before any launch: ``out`` bf16 [T, H, 512] and
    ``lse`` float32 [T, H] (either may be None), contiguous, on ``q``'s device, sharing
    no storage with each other or any of ``inputs`` (the call's input tensors)."""
    T, H = q.shape[0], q.shape[1]
    given = []
    for name, t, dtype, shape in (("out", out, torch.bfloat16, (T, H, D_V)), ("lse", lse, torch.float32, (T, H))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {list(shape)} for q of T={T}, H={H}; got {t.dtype} "
                             f"{list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
        given.append((name, t))
    for i, (name, t) in enumerate(given):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and any(x is not None and x.numel() and x.untyped_storage().data_ptr() == ptr
                             for x in inputs + tuple(o for _, o in given[:i])):
            raise ValueError(f"{name} shares storage with another tensor of the call: give it a buffer of its own")


def empty_result(T: int, H: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The answer when no token has a valid entry: out bf16 [T, H, 512] = 0, lse = -inf."""
    out = torch.zeros((T, H, D_V), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=device)
    return out, lse


__all__ = [
    "check_outputs",
    "D_QK", "D_V", "Phase", "DecodeInputs",
    "PrefillInputs", "SparseMLABackend", "normalize_kv_rows", "validate_decode_inputs",
    "validate_prefill_inputs", "empty_result", "heads_reason", "check_decode_call",
]
