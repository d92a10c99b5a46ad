"""Exceptions raised by hisparse.

- ``CapacityError``: an expected capacity failure (host pool full, too many
  requests, hot buffer too small). Raised at admission/configuration time; the
  failed call changes no state.
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
