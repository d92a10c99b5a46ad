"""NIXL, loaded on first use: the one place ``hisparse.pd`` imports it.

The wheels name their module after the CUDA major they were built for (``nixl_cu12``,
``nixl_cu13``); a source build installs ``nixl``. ``load_nixl()`` returns the first
that imports, the wheel of torch's CUDA major tried first (a wheel of another major
imports, but its UCX cannot load its CUDA transports and so cannot register GPU memory),
or raises ``NixlUnavailable`` naming the extra and every import error.
"""

from __future__ import annotations

import importlib
import os
import socket
import uuid
from types import ModuleType

import torch

from .errors import NixlUnavailable

MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
_loaded: ModuleType | None = None


def _torch_wheel() -> str | None:
    """``nixl_cu<major>`` for the CUDA torch was built with (None for a CPU torch)."""
    cuda = getattr(torch.version, "cuda", None)
    return f"nixl_cu{cuda.split('.')[0]}" if cuda else None


def module_order() -> tuple[str, ...]:
    """The modules ``load_nixl`` tries, in order: torch's CUDA major's wheel first."""
    first = _torch_wheel()
    return (first,) + tuple(m for m in MODULES if m != first) if first in MODULES else MODULES


def cuda_mismatch() -> str | None:
    """A hint when the loaded NIXL wheel was built for another CUDA major than torch
    (its UCX then cannot register GPU memory), else None."""
    want = _torch_wheel()
    if _loaded is None or want not in MODULES[:2] or _loaded.__name__ not in MODULES[:2] or _loaded.__name__ == want:
        return None  # no wheel for torch's CUDA, or not a wheel loaded, or the right one
    return (f"NIXL's {_loaded.__name__} is not built for torch's CUDA {torch.version.cuda}: "
            f"install {want.replace('_', '-')} for GPU rows")


def load_nixl() -> ModuleType:
    """The NIXL Python module (its ``nixl_agent``, ``nixl_agent_config``)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    problems = []
    for name in module_order():
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            problems.append(f"{name}: {e}")
            continue
        if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
            _loaded = mod
            return mod
        problems.append(f"{name}: no nixl_agent in it")
    raise NixlUnavailable("prefill/decode transfers need NIXL: pip install 'hisparse[pd]' (or nixl-cu12 / "
                          "nixl-cu13 for your CUDA); tried " + "; ".join(problems))


def nixl_available() -> str | None:
    """None when NIXL loads here, else the reason it does not."""
    try:
        load_nixl()
    except NixlUnavailable as e:
        return str(e)
    return None


def default_agent_name(role: str) -> str:
    """An agent name no other agent shares: ``hisparse-<role>-<host>-<pid>-<8 hex>``."""
    return f"hisparse-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def make_agent(name: str, backends: tuple[str, ...], *, progress_thread: bool):
    """A NIXL agent with ``backends`` (each must instantiate: NixlUnavailable otherwise).
    ``progress_thread``: NIXL's own thread progresses the backends (a target of
    one-sided transfers needs one when its transports need target-side progress, as
    UCX over TCP does); without it they progress inside this agent's calls."""
    nixl = load_nixl()
    try:
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends)))
    except Exception as e:  # NIXL raises bare RuntimeErrors (no plugin, backend start failure)
        raise NixlUnavailable(f"NIXL agent {name!r} could not start: {type(e).__name__}: {e}") from e
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise NixlUnavailable(f"NIXL agent {name!r}: backend(s) {missing} did not instantiate "
                              f"(plugins here: {agent.get_plugin_list()})")
    return agent


__all__ = ["load_nixl", "nixl_available", "make_agent", "default_agent_name", "MODULES"]
