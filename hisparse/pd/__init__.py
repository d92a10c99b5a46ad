"""Prefill/decode disaggregation: a prefill engine's KV rows land in a decode engine's
pinned host pool through NIXL (one-sided WRITEs between registered buffers).

- ``PDReceiver(cache)`` (decode side): registers the cache's host pool with a NIXL agent
  once; ``reserve(req_id, num_tokens)`` admits a request, gives it host blocks and
  returns a ``PDDescriptor``; ``commit`` / ``abort`` / ``poll`` / ``wait``
  (``receiver``).
- ``PDSender`` (prefill side, no cache needed): ``send(descriptor, rows)`` posts the
  WRITEs of every layer's rows and notifies the decode side (``sender``).
- ``PDDescriptor``: what the decode side publishes, as bytes (``descriptor``).
- Errors: ``PDError``, ``StaleDescriptorError``, ``TransferError``, ``TransferTimeout``,
  ``NixlUnavailable`` (``errors``).

NIXL is optional (``pip install hisparse[pd]``): importing this package loads neither
NIXL nor any of its modules; a call that needs NIXL without it raises
``NixlUnavailable`` naming the extra.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "PDReceiver": ".receiver", "ReserveInfo": ".receiver", "PollResult": ".receiver",
    "PDSender": ".sender", "SendReport": ".sender",
    "PDDescriptor": ".descriptor",
    "PDError": ".errors", "StaleDescriptorError": ".errors", "TransferError": ".errors",
    "TransferTimeout": ".errors", "NixlUnavailable": ".errors",
    "nixl_available": ".nixl_api",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
