"""Errors of the prefill/decode transfer (``hisparse.pd``).

A failed decode-side call leaves the cache as it was before the reservation (the
reservation aborted: request released, its blocks in quarantine until no WRITE of it
can land, ``hisparse.pd.receiver``) where the error says so, or as it was before the
call otherwise.
"""

from __future__ import annotations

from ..errors import HiSparseError


class PDError(HiSparseError):
    """A prefill/decode transfer failed."""


class StaleDescriptorError(PDError, ValueError):
    """A descriptor whose reservation was committed or aborted (its generation is no
    longer the live one): refused before any byte moves."""


class TransferError(PDError):
    """NIXL reported a failed transfer, or the peer reported one."""


class TransferTimeout(PDError, TimeoutError):
    """The transfer did not complete in time (the decode side aborts the reservation)."""


class NixlUnavailable(PDError, ImportError):
    """NIXL is not installed (``pip install hisparse[pd]``) or can't start here."""


__all__ = ["PDError", "StaleDescriptorError", "TransferError", "TransferTimeout", "NixlUnavailable"]
