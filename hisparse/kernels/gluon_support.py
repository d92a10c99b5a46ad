"""Whether the installed Triton offers what the warp-specialised Gluon decode kernel
(``mla_decode_ws``) is written against, checked without compiling anything.

Gluon (``triton.experimental.gluon``) is Triton's experimental explicit-layout dialect;
its API moves between releases. ``gluon_ws_problem()`` returns None when every module,
name and keyword the kernel uses is there and ``mla_decode_ws`` imports, else one line
saying what is missing. The launcher takes the ``tl`` kernels instead and says why
(``triton_backend.default_config`` records the reason; ``hisparse env`` shows it).
The kernel was written for and measured with Triton 3.6; newer releases that pass this
check are compile-tested for sm90 offline (tests/test_attention_ws_compile.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import triton

_GL = "triton.experimental.gluon.language"
_HOPPER = "triton.experimental.gluon.language.nvidia.hopper"

# module -> the attributes the kernel uses (dotted: nested; "a|b": either name will do)
_NAMES: dict[str, tuple[str, ...]] = {
    "triton.experimental.gluon": ("jit",),
    _GL: ("BlockedLayout", "DotOperandLayout", "NVMMADistributedLayout", "NVMMASharedLayout",
          "NVMMASharedLayout.get_default_for", "SliceLayout", "SwizzledSharedLayout",
          "allocate_shared_memory", "arange", "atomic_add", "bfloat16", "constexpr", "convert_layout",
          "exp2", "float32", "float8e4nv", "full", "int64", "load", "log2", "max", "maximum",
          "minimum", "multiple_of", "num_programs", "pointer_type", "program_id", "static_range", "store",
          "sum", "thread_barrier|barrier", "uint8", "warp_specialize", "where", "zeros"),
    _HOPPER: ("async_copy.async_load|async_copy.async_copy_global_to_shared",
              "async_copy.commit_group", "async_copy.wait_group", "fence_async_shared",
              "mbarrier.MBarrierLayout", "mbarrier.arrive", "mbarrier.init", "mbarrier.wait",
              "warpgroup_mma", "warpgroup_mma_wait"),
}
# (module, callable, parameters the kernel passes by name, or whose position it relies on).
# warp_specialize's list-of-(function, args) form is the one that changed shape before.
_PARAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (_GL, "warp_specialize", ("functions_and_args", "worker_num_warps", "worker_num_regs")),
    (_GL, "NVMMADistributedLayout", ("version", "warps_per_cta", "instr_shape")),
    (_GL, "DotOperandLayout", ("operand_index", "parent", "k_width")),
    (_HOPPER, "warpgroup_mma", ("use_acc", "is_async")),
    (_HOPPER, "warpgroup_mma_wait", ("num_outstanding", "deps")),
    (_HOPPER, "mbarrier.arrive", ("count",)),
)


def _resolve(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _has(obj: object, dotted: str) -> bool:
    try:
        _resolve(obj, dotted)
    except AttributeError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def gluon_ws_problem() -> str | None:
    """None when this Triton can build ``mla_decode_ws``; else what it lacks (one line)."""
    where = f"Triton {triton.__version__}"
    modules = {}
    for mod in dict.fromkeys([*_NAMES, *(m for m, _, _ in _PARAMS)]):
        try:
            modules[mod] = importlib.import_module(mod)
        except ImportError as e:
            return f"{where} has no {mod} ({e})"
    for mod, names in _NAMES.items():
        for name in names:
            if not any(_has(modules[mod], alt) for alt in name.split("|")):
                return f"{where}: Gluon lacks {mod}.{' / '.join(name.split('|'))}"
    for mod, name, params in _PARAMS:
        try:
            have = inspect.signature(_resolve(modules[mod], name)).parameters
        except AttributeError:
            return f"{where}: Gluon lacks {mod}.{name}"
        except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
            continue
        missing = [p for p in params if p not in have]
        if missing:
            return (f"{where}: Gluon's {name} has parameters {list(have)}, the kernel passes "
                    f"{missing}")
    try:
        importlib.import_module("hisparse.kernels.mla_decode_ws")
    except (ImportError, AttributeError, TypeError) as e:
        return f"{where}: hisparse.kernels.mla_decode_ws does not import ({type(e).__name__}: {e})"
    return None


__all__ = ["gluon_ws_problem"]
