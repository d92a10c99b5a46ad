"""Pick a sparse-MLA attention backend by asking each one ``supports(...)``.

Never by try/except around a launch: a backend that can't run a combination says why
(a reason string), and the chooser either moves on to the next one or, when none
fits, raises a ``ValueError`` listing every backend and its reason.

Registry (name -> class), default order of preference:
  CUDA: triton (ours: every format, head count and row count), flashmla (fp8 decode
        and prefill; needs the row view in 64-row pages), flashinfer (bf16), reference
  (``prefer="flashmla"`` puts FlashMLA first where its library is available)
  CPU:  reference (torch), triton (runs only under TRITON_INTERPRET=1; slow)
Prefill always reads the staged bf16 workspace, so for ``Phase.PREFILL`` the backends
are asked about bf16 whatever row format the cache holds.
Backend objects are created once per (name, options) and reused: FlashInfer keeps a
workspace and a planned wrapper, FlashMLA a cached tile schedule.
"""

from __future__ import annotations

import importlib
import threading
from typing import Iterable, Sequence

import torch

from .._checks import check_int
from ..formats import RowFormat
from .base import Phase, SparseMLABackend

# name -> (module, class); modules are imported only when the backend is asked for
_REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("hisparse.attention.reference", "ReferenceBackend"),
    "triton": ("hisparse.attention.triton_backend", "TritonBackend"),
    "flashmla": ("hisparse.attention.flashmla", "FlashMLABackend"),
    "flashinfer": ("hisparse.attention.flashinfer", "FlashInferBackend"),
}
_ORDER_CUDA = ("triton", "flashmla", "flashinfer", "reference")
_ORDER_CPU = ("reference", "triton")

_LOCK = threading.Lock()
_INSTANCES: dict[tuple, SparseMLABackend] = {}


def backend_names() -> list[str]:
    """Every registered backend name."""
    return list(_REGISTRY)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; valid names: {backend_names()}")
    return name


class _Unloadable(SparseMLABackend):
    """Stands in for a backend whose module can't be imported; supports() says why."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self._reason = reason

    def supports(self, *, device, row_format, num_heads, phase):
        return self._reason

    def decode(self, q, kv_rows, indices, *, valid_counts=None, sm_scale, row_format):
        raise ValueError(f"attention backend {self.name!r} is unavailable: {self._reason}")

    def prefill(self, q, workspace, indices, *, valid_counts=None, sm_scale):
        raise ValueError(f"attention backend {self.name!r} is unavailable: {self._reason}")


def _options(name: str, flashmla_lib: str | None) -> dict:
    """Constructor options per backend."""
    if name == "flashmla":
        return {"library_path": flashmla_lib}
    if name == "triton":
        # CPU tensors only ever run when TRITON_INTERPRET=1 (the backend checks that)
        return {"allow_interpreter": True}
    return {}


def get_backend(name: str, *, flashmla_lib: str | None = None) -> SparseMLABackend:
    """The (shared) backend object called ``name``.

    ``flashmla_lib``: path of a FlashMLA ``_flashmla_C`` library (used by "flashmla"
    only; None = look for an installed vllm / sgl_kernel).
    """
    name = _check_name(name)
    key = (name, flashmla_lib if name == "flashmla" else None)
    with _LOCK:
        be = _INSTANCES.get(key)
        if be is None:
            module, cls_name = _REGISTRY[name]
            try:
                cls = getattr(importlib.import_module(module), cls_name)
            except (ImportError, AttributeError) as e:
                be = _Unloadable(name, f"cannot load {module}.{cls_name}: {e}")
            else:
                be = cls(**_options(name, flashmla_lib))
            _INSTANCES[key] = be
        return be


def _order(device: torch.device, prefer: str | Sequence[str] | None) -> list[str]:
    base = list(_ORDER_CUDA if device.type == "cuda" else _ORDER_CPU)
    if prefer is None:
        return base
    wanted = [prefer] if isinstance(prefer, str) else list(prefer)
    for n in wanted:
        _check_name(n)
    return list(dict.fromkeys(wanted + base))


def _parse(device: object, row_format: object, num_heads: object,
           phase: object) -> tuple[torch.device, RowFormat, int, Phase]:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    fmt = RowFormat.parse(row_format)
    check_int("num_heads", num_heads, 1)
    if isinstance(phase, str):
        try:
            phase = Phase(phase)
        except ValueError:
            raise ValueError(f"unknown phase {phase!r}; expected one of "
                             f"{[p.value for p in Phase]}") from None
    if not isinstance(phase, Phase):
        raise TypeError(f"phase must be a Phase or str, got {type(phase).__name__}")
    return dev, fmt, num_heads, phase


def available_backends(device: torch.device | str, *, row_format: RowFormat | str | None = None,
                       num_heads: int = 128, phase: Phase | str | None = None,
                       flashmla_lib: str | None = None) -> list[tuple[str, str | None]]:
    """``[(name, None | reason)]`` for every registered backend on ``device``.

    With ``row_format`` / ``phase`` given, the answer is for that combination; left
    None, a backend counts as available when it runs at least one combination
    (decode fp8_ds_mla, decode bf16, prefill), and the reason lists why it runs none.
    """
    fmts = [RowFormat.parse(row_format)] if row_format is not None else list(RowFormat)
    if phase is None:
        phases = list(Phase)
    else:
        phases = [_parse("cpu", RowFormat.BF16, 1, phase)[3]]
    dev = _parse(device, fmts[0], num_heads, phases[0])[0]
    # prefill reads the staged bf16 workspace, whatever the cache's row format
    combos = [(ph, fmt) for ph in phases
              for fmt in (fmts if ph is Phase.DECODE else [RowFormat.BF16])]
    out = []
    for name in backend_names():
        be = get_backend(name, flashmla_lib=flashmla_lib)
        reasons: list[str] | None = []
        for ph, fmt in combos:
            r = be.supports(device=dev, row_format=fmt, num_heads=num_heads, phase=ph)
            if r is None:
                reasons = None
                break
            reasons.append(r)
        out.append((name, None if reasons is None else "; ".join(dict.fromkeys(reasons))))
    return out


def choose_backend(*, device: torch.device | str, row_format: RowFormat | str, num_heads: int,
                   phase: Phase | str, prefer: str | Sequence[str] | None = None,
                   flashmla_lib: str | None = None) -> SparseMLABackend:
    """The first backend (``prefer`` first, then the default order) that supports the
    combination. Raises ``ValueError`` listing each backend's reason when none does."""
    dev, fmt, H, ph = _parse(device, row_format, num_heads, phase)
    if ph is Phase.PREFILL:
        fmt = RowFormat.BF16  # prefill reads the staged bf16 workspace, whatever the cache holds
    reasons: list[tuple[str, str]] = []
    for name in _order(dev, prefer):
        be = get_backend(name, flashmla_lib=flashmla_lib)
        r = be.supports(device=dev, row_format=fmt, num_heads=H, phase=ph)
        if r is None:
            return be
        reasons.append((name, r))
    tried = {n for n, _ in reasons}
    skipped = [n for n in backend_names() if n not in tried]
    lines = "\n".join(f"  {n}: {r}" for n, r in reasons)
    extra = f"\n  (not tried on {dev.type}: {skipped})" if skipped else ""
    raise ValueError(
        f"no attention backend supports {ph.value} with {fmt.value} rows, {H} heads on {dev}; "
        f"valid names: {backend_names()}; reasons:\n{lines}{extra}")


def describe(pairs: Iterable[tuple[str, str | None]]) -> str:
    """One line per backend: 'name: available' or 'name: <reason>'."""
    return "\n".join(f"{n}: {'available' if r is None else r}" for n, r in pairs)


__all__ = ["available_backends", "backend_names", "choose_backend", "describe", "get_backend"]
