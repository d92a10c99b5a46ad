"""CUDA graphs whose kernels keep the priority of the stream they were captured on.

An executable graph instantiated the default way (``torch.cuda.CUDAGraph``'s) runs
every kernel at the priority of the stream it is launched into. The cache's stage
stream is a high-priority stream so that the miss copy's blocks are scheduled ahead of
a large grid on the compute stream (the next group's indexer, the hit attention);
inside such a graph that priority is gone, and the copy waits until the other grid's
last blocks have been scheduled. CUDA copies each captured kernel's stream priority
into the kernel node; instantiated with ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``
the graph runs each node at that priority.

:class:`PriorityGraph` captures with torch (``keep_graph=True``: torch keeps the
``cudaGraph_t`` and does not instantiate it), instantiates through the driver API with
that flag, and launches the executable graph on the current stream. What torch's
``replay`` does besides the launch is not done: a graph that draws random numbers
from torch's generators would replay the same numbers each time.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY

_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is None:
        lib = ctypes.CDLL("libcuda.so.1")
        p = ctypes.c_void_p
        for name, args in (("cuGraphInstantiateWithFlags", [ctypes.POINTER(p), p, ctypes.c_ulonglong]),
                           ("cuGraphLaunch", [p, p]), ("cuGraphExecDestroy", [p])):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
        _DRIVER = lib
    return _DRIVER


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUDA driver error {err}")


class PriorityGraph:
    """A CUDA graph captured with ``with torch.cuda.graph(pg.graph, pool=...)`` (as a
    ``torch.cuda.CUDAGraph``) and replayed with node priorities (:meth:`replay`)."""

    def __init__(self) -> None:
        try:
            self.graph = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError as e:  # torch before keep_graph
            raise RuntimeError(f"torch {torch.__version__} cannot keep a captured graph (CUDAGraph("
                               "keep_graph=True)), which node priorities need") from e
        self._exec = None
        self._finalizer = None

    def instantiate(self) -> None:
        """Instantiate the captured graph (after the capture; :meth:`replay` does it once)."""
        lib = _driver()
        exe = ctypes.c_void_p()
        _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), ctypes.c_void_p(self.graph.raw_cuda_graph()),
                                               USE_NODE_PRIORITY), "cuGraphInstantiateWithFlags")
        self._exec = exe
        self._finalizer = weakref.finalize(self, lib.cuGraphExecDestroy, exe)

    def replay(self) -> None:
        """Launch the graph on the current stream."""
        if self._exec is None:
            self.instantiate()
        stream = torch.cuda.current_stream().cuda_stream
        _check(_driver().cuGraphLaunch(self._exec, ctypes.c_void_p(stream)), "cuGraphLaunch")


__all__ = ["PriorityGraph", "USE_NODE_PRIORITY"]
