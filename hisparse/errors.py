"""Exceptions raised by hisparse.

- ``CapacityError``: an expected capacity failure, raised at admission or
  configuration time; the failed call changes no state:
    host pool full (a write needs more blocks than are free),
    all request slots taken (``add_request``),
    a host pool or cache larger than the free host / device memory (building it),
    a hot buffer smaller than one decode step can reference
    (``HiSparseConfig`` with device_buffer_size < max_query_len x top_k),
    a prefill request larger than the staging workspace (``plan_prefill_chunks``).
  The CLI reports it as exit status 3 ("capacity").
- Caller mistakes raise ``ValueError`` / ``TypeError`` naming what was expected
  and what came.
- A broken internal invariant raises ``RuntimeError`` with the state.
"""


class HiSparseError(Exception):
    """Base class of hisparse-specific errors."""


class CapacityError(HiSparseError):
    """A capacity limit was reached (host pool, request slots, hot buffer).

    The call that raised it changed no state; free requests or configure a
    larger pool/buffer and retry.
    """


__all__ = ["HiSparseError", "CapacityError"]
