"""The decode tokens' request ids a forward's per-layer calls take (``HiSparseIndexGroup``):
int32 [tokens] on the cache device, each decode token's request id, padded with -1.

:class:`DecodeIds` builds them once per batch: an engine's decode steps keep their
batch for many forwards, so a forward of the last one's ids reuses the last host array
(and on a CPU cache its tensor), and a bucket's persistent buffer (CUDA graphs read it)
is written only when the ids it holds are not these.
"""

from __future__ import annotations

import numpy as np
import torch

from .._checks import device_type
from .metadata import SparseMLAMetadata, device_ints


class DecodeIds:
    """The decode ids of a group's forwards on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = device_type(device) == "cpu"
        self.bufs: dict[int, torch.Tensor] = {}  # padded decode ids per bucket size (persistent)
        # the last forward's ids (int32 [tokens]) and what they follow from: (request ids,
        # decode requests, decode query length, tokens), and their tensor on a CPU cache
        self._last: tuple[tuple, np.ndarray, torch.Tensor | None] | None = None
        self._loaded: dict[int, tuple] = {}  # bucket size -> the key of the ids its buffer holds

    def of(self, metadata: SparseMLAMetadata, tokens: int, *, padded: bool) -> torch.Tensor:
        """int32 [tokens]: ``metadata``'s decode-token request ids padded with -1 (live ids,
        < max_request_id < 2**31); ``padded``: in the bucket's persistent buffer of
        ``tokens`` (a captured graph reads it), written without waiting."""
        key = (metadata.request_ids_cpu, metadata.num_decodes, metadata.decode_max_query_len, tokens)
        if self._last is None or self._last[0] != key:
            tok = np.array(metadata.decode_token_request_ids(tokens), dtype=np.int32)
            self._last = (key, tok, torch.from_numpy(tok) if self.cpu else None)
        _, ids, on_cpu = self._last
        if not padded:
            return on_cpu if on_cpu is not None else device_ints(ids, self.device)
        buf = self.bufs.get(tokens)
        if buf is None:
            buf = self.bufs[tokens] = torch.empty(tokens, dtype=torch.int32, device=self.device)
            self._loaded.pop(tokens, None)
        if self._loaded.get(tokens) != key:  # (only written here: the same ids stay)
            host = torch.from_numpy(ids)
            buf.copy_(host if self.cpu else host.pin_memory(), non_blocking=True)
            self._loaded[tokens] = key
        return buf


__all__ = ["DecodeIds"]
