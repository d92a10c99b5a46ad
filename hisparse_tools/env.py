"""What this machine offers hisparse: GPU, driver, library versions, pinned memory,
and which attention backends can run here (and, when one can't, why).

``collect_env()`` returns a JSON-able dict (fields below); ``format_env(d)`` renders it
as a plain-text table. The ``hisparse env`` subcommand (tools/cli.py) calls both.

Fields of ``collect_env()``:
  python, platform                      str
  torch, triton, cupy, numpy, flashinfer  version str or None (not importable)
  cuda_available                        bool
  torch_cuda                            str | None (CUDA version torch was built with)
  driver                                str | None (from nvidia-smi, if present)
  nvcc                                  str | None (path of nvcc on PATH; FlashInfer JIT needs it)
  gpus                                  list of {index, name, sm, sm_count, memory_gib}
  device                                str (the device the checks below ran on)
  pinned                                {ok, nbytes, registered, is_pinned, error}
  flashmla_lib                          str | None (the library path that was tried)
  backends                              list of {name, decode_fp8_ds_mla, decode_bf16,
                                        prefill}: each None (runs) or the reason it can't
  triton_decode                         {kernel, ws_off_reason, gluon_ws, config}: the Triton
                                        decode kernel default_config picks on ``device`` for
                                        fp8_ds_mla rows, 128 heads ("ws" warp-specialised,
                                        "wide" fused-tile or "tiled"), why not ws (None: it
                                        is ws), whether this Triton's Gluon can build the ws
                                        kernel (None: yes, else what it lacks), the config
  triton_interpret                      bool (TRITON_INTERPRET=1, CPU interpreter mode)
  direct_launch                         str | None: None when compiled Triton kernels are
                                        launched directly (``hisparse.kernels.fast_launch``),
                                        else why each launch goes through Triton's JIT
  interpreter_fixes                     list of str: the fixes hisparse applied to this
                                        Triton's interpreter (empty outside interpreter mode)
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

import torch

from hisparse.config import RowFormat
from hisparse.device import PinnedBuffer, interpreter_mode

FLASHMLA_LIB_ENV = "HISPARSE_FLASHMLA_LIB"
_PIN_BYTES = 1 << 20
_HEADS_CHECKED = 128


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except (ImportError, OSError, RuntimeError):
        return None
    return str(getattr(mod, "__version__", "unknown"))


def _driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = res.stdout.strip().splitlines()
    return first[0].strip() if res.returncode == 0 and first else None


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({
            "index": i,
            "name": p.name,
            "sm": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 2),
        })
    return out


def _pinned_check() -> dict[str, Any]:
    """Register a 1 MiB PinnedBuffer and ask torch whether the memory is pinned."""
    res: dict[str, Any] = {"ok": False, "nbytes": _PIN_BYTES, "registered": False,
                           "is_pinned": False, "error": None}
    try:
        buf = PinnedBuffer(_PIN_BYTES)
    except (RuntimeError, ValueError) as e:
        res["error"] = str(e)
        return res
    try:
        res["registered"] = bool(buf.pinned)
        res["is_pinned"] = bool(buf.tensor.is_pinned()) if torch.cuda.is_available() else False
        # on CPU "not pinned" is the expected, working state (plain memory stands in)
        res["ok"] = res["is_pinned"] if torch.cuda.is_available() else True
        if torch.cuda.is_available() and not res["is_pinned"]:
            res["error"] = "cudaHostRegister returned success but tensor.is_pinned() is False"
    finally:
        buf.release()
    return res


def backend_matrix(device: torch.device | str, *, flashmla_lib: str | None = None,
                   num_heads: int = _HEADS_CHECKED) -> list[dict[str, Any]]:
    """Per backend: None (runs) or the reason, for decode fp8 / decode bf16 / prefill."""
    from hisparse.attention import Phase, backend_names, get_backend

    dev = torch.device(device)
    rows = []
    for name in backend_names():
        be = get_backend(name, flashmla_lib=flashmla_lib)
        rows.append({
            "name": name,
            "decode_fp8_ds_mla": be.supports(device=dev, row_format=RowFormat.FP8_DS_MLA,
                                             num_heads=num_heads, phase=Phase.DECODE),
            "decode_bf16": be.supports(device=dev, row_format=RowFormat.BF16,
                                       num_heads=num_heads, phase=Phase.DECODE),
            "prefill": be.supports(device=dev, row_format=RowFormat.BF16,
                                   num_heads=num_heads, phase=Phase.PREFILL),
        })
    return rows


def triton_decode_choice(device: torch.device | str, *,
                         num_heads: int = _HEADS_CHECKED) -> dict[str, Any]:
    """The Triton decode kernel ``default_config`` picks on ``device`` for fp8_ds_mla rows
    (T = 64, K = 2048) and, when it is not the warp-specialised one, why not."""
    try:  # the Triton backend needs Triton, a Linux-only dependency
        from hisparse.attention import default_config, gluon_ws_problem
    except ImportError as e:
        return {"kernel": None, "ws_off_reason": f"the Triton backend does not import: {e}",
                "gluon_ws": None, "config": None}
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return {"kernel": None, "ws_off_reason": "no CUDA device is available", "gluon_ws": None, "config": None}
    cfg = default_config(64, num_heads, 2048, dev, RowFormat.FP8_DS_MLA)
    return {"kernel": "ws" if cfg.ws else "wide" if cfg.wide else "tiled",
            "ws_off_reason": cfg.ws_off_reason, "gluon_ws": gluon_ws_problem(),
            "config": dataclasses.asdict(cfg)}


def collect_env(*, device: str | None = None, flashmla_lib: str | None = None,
                read_env_var: bool = True) -> dict[str, Any]:
    """Gather the environment report (see the module docstring for the fields).

    ``flashmla_lib``: a FlashMLA library path to try; when None and ``read_env_var``,
    ``$HISPARSE_FLASHMLA_LIB`` is read here (this is the CLI edge).
    """
    if flashmla_lib is None and read_env_var:
        flashmla_lib = os.environ.get(FLASHMLA_LIB_ENV) or None
    cuda = torch.cuda.is_available()
    dev = torch.device(device) if device is not None else torch.device("cuda" if cuda else "cpu")
    from hisparse import interpreter_fixes  # loads Triton's interpreter: only when asked
    from hisparse.attention import flashinfer_version

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cupy": _version("cupy"),
        "numpy": _version("numpy"),
        "flashinfer": flashinfer_version(),
        "cuda_available": cuda,
        "torch_cuda": torch.version.cuda,
        "driver": _driver(),
        "nvcc": shutil.which("nvcc"),
        "gpus": _gpus(),
        "device": str(dev),
        "pinned": _pinned_check(),
        "flashmla_lib": flashmla_lib,
        "backends": backend_matrix(dev, flashmla_lib=flashmla_lib),
        "triton_decode": triton_decode_choice(dev),
        "triton_interpret": interpreter_mode(),
        "direct_launch": _direct_launch(),
        "interpreter_fixes": interpreter_fixes.applied(),
    }


def _direct_launch() -> str | None:
    try:  # Triton is a Linux-only dependency
        from hisparse.kernels import fast_launch_problem
    except ImportError as e:
        return f"Triton does not import: {e}"
    return fast_launch_problem()


def _cell(reason: str | None) -> str:
    return "yes" if reason is None else "no"


def format_env(d: dict[str, Any]) -> str:
    """Render ``collect_env()``'s dict as a plain-text report (reasons listed below the table)."""
    lines = []
    kv = [
        ("python", d.get("python")), ("platform", d.get("platform")),
        ("torch", d.get("torch")), ("torch CUDA", d.get("torch_cuda")),
        ("triton", d.get("triton")), ("cupy", d.get("cupy")), ("numpy", d.get("numpy")),
        ("flashinfer", d.get("flashinfer")), ("driver", d.get("driver")),
        ("nvcc", d.get("nvcc")), ("CUDA available", d.get("cuda_available")),
        ("TRITON_INTERPRET", d.get("triton_interpret")), ("device", d.get("device")),
        ("FlashMLA library", d.get("flashmla_lib")),
    ]
    w = max(len(k) for k, _ in kv)
    for k, v in kv:
        lines.append(f"{k:<{w}}  {'-' if v is None else v}")
    gpus = d.get("gpus") or []
    lines.append("")
    if gpus:
        lines.append("GPUs:")
        for g in gpus:
            lines.append(f"  [{g['index']}] {g['name']}  SM {g['sm']}  {g['sm_count']} SMs  "
                         f"{g['memory_gib']} GiB")
    else:
        lines.append("GPUs: none")
    p = d.get("pinned") or {}
    state = "ok" if p.get("ok") else "FAILED"
    lines.append(f"pinned memory: {state} (registered={p.get('registered')}, "
                 f"is_pinned={p.get('is_pinned')}, {p.get('nbytes')} bytes)"
                 + (f": {p['error']}" if p.get("error") else ""))
    lines.append("")
    cols = [("decode_fp8_ds_mla", "decode fp8"), ("decode_bf16", "decode bf16"),
            ("prefill", "prefill")]
    backends = d.get("backends") or []
    nw = max([len("backend")] + [len(b["name"]) for b in backends])
    lines.append(f"{'backend':<{nw}}  " + "  ".join(f"{h:<11}" for _, h in cols))
    for b in backends:
        lines.append(f"{b['name']:<{nw}}  " + "  ".join(f"{_cell(b[c]):<11}" for c, _ in cols))
    why = [(b["name"], h, b[c]) for b in backends for c, h in cols if b[c] is not None]
    if why:
        lines.append("")
        lines.append("why not:")
        seen = set()
        for name, h, reason in why:
            key = (name, reason)
            if key in seen:  # the same reason for several columns: say it once
                continue
            seen.add(key)
            hs = ", ".join(h2 for n2, h2, r2 in why if n2 == name and r2 == reason)
            lines.append(f"  {name} ({hs}): {reason}")
    td = d.get("triton_decode") or {}
    if td:
        names = {"ws": "warp-specialised Gluon kernel", "wide": "tl fused-tile kernel",
                 "tiled": "tl tiled kernel"}
        lines.append("")
        lines.append(f"triton decode, fp8_ds_mla, {_HEADS_CHECKED} heads: "
                     f"{names.get(td.get('kernel'), 'none')}"
                     + (f" ({td['ws_off_reason']})" if td.get("ws_off_reason") else ""))
        gl = td.get("gluon_ws")
        lines.append("Gluon (warp-specialised kernel): "
                     + ("this Triton offers what it uses" if gl is None else f"not usable: {gl}"))
    if "direct_launch" in d:
        dl = d["direct_launch"]
        lines.append("compiled Triton kernels: " + ("launched directly" if dl is None
                                                    else f"launched through Triton's JIT ({dl})"))
    if d.get("interpreter_fixes"):
        lines.append(f"Triton interpreter fixes applied: {', '.join(d['interpreter_fixes'])}")
    return "\n".join(lines)


__all__ = ["FLASHMLA_LIB_ENV", "backend_matrix", "collect_env", "format_env"]
