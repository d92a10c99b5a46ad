"""hisparse: a tiered KV cache for sparse-MLA attention.

Every request's MLA latent rows live in pinned host memory; a small per-request GPU
hot buffer holds recently selected rows with exact LRU state on the GPU.
"""

from ._checks import interpreter_mode as _interpreter_mode
from .config import HiSparseConfig, RowFormat
from .errors import CapacityError, HiSparseError

if _interpreter_mode():  # CPU runs of the Triton kernels
    from .interpreter_fixes import apply as _fix_interpreter  # only needed (and only safe) here

    _fix_interpreter()

__version__ = "0.1.0"

__all__ = ["HiSparseConfig", "HiSparseCache", "RowFormat", "CapacityError", "HiSparseError", "__version__"]


def __getattr__(name):  # lazy: importing the cache pulls in triton
    if name == "HiSparseCache":
        from .cache.cache import HiSparseCache

        return HiSparseCache
    raise AttributeError(name)
