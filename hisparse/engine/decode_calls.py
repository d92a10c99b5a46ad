"""The engine façade's decode-attention calls: a layer's resolve and attention in one
call, with the miss staging hidden behind the attention (``hisparse.decode``).

:class:`DecodeAttention` serves ``HiSparseIndexGroup.decode_attention`` (resolve +
attend, "serial" / "split"), ``begin_decode_attention`` (a split layer's resolve
launched as soon as the top-k exists, attended by the next ``decode_attention`` of the
layer) and ``prefetch`` (a predicted selection staged ahead of the layer's resolve).
Each counts as, or comes before, the layer's one resolve of the forward. The group
checks the layer index and the metadata; these take the forward (``engine.forward``).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..cache.cache import HiSparseCache
from ..decode.layer import DecodeLayer, Overlap
from .forward import Forward, Resolved, topk_key


class DecodeAttention:
    """The decode-attention calls over one cache. ``validate``: the group's checked mode;
    ``resolves_per_layer``: the group's lifetime count, one per resolve; ``refuse_input``:
    ``(topk, call)`` raising for a tensor the calls reading it after they return must not
    take (the per-layer graphs' input buffer)."""

    def __init__(self, cache: HiSparseCache, *, validate: bool, resolves_per_layer: list[int],
                 refuse_input: Callable[[torch.Tensor, str], None]) -> None:
        self.cache = cache
        self.validate = validate
        self.resolves_per_layer = resolves_per_layer
        self.refuse_input = refuse_input
        self.layers: dict[Overlap, DecodeLayer] = {}  # per mode, for the last backend object

    def attend(self, fwd: Forward, i: int, q: torch.Tensor, topk_indices: torch.Tensor, *, backend,
               sm_scale: float, overlap: Overlap | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``HiSparseIndexGroup.decode_attention`` of layer i."""
        mode = Overlap.parse(overlap)
        begun = fwd.begun.get(i)
        if begun is not None:  # begin_decode_attention resolved it: attend
            layer, sp = begun
            if mode is Overlap.SERIAL or layer.backend is not backend or fwd.resolved[i].key != topk_key(topk_indices):
                raise ValueError(f"layer {i} was begun with begin_decode_attention: finish it with overlap "
                                 "'split' (or 'auto'), the same backend and the same topk_indices tensor")
            out = layer.finish(sp, q, sm_scale=sm_scale)
            del fwd.begun[i]
            fwd.resolved[i] = fwd.resolved[i]._replace(how="attended")
            return out
        layer = self._layer(fwd, i, topk_indices, backend, mode)
        out = layer(i, fwd.decode_ids, topk_indices, q, sm_scale=sm_scale)
        fwd.resolved[i] = Resolved("attended", topk_key(topk_indices))
        self.resolves_per_layer[i] += 1
        return out

    def begin(self, fwd: Forward, i: int, topk_indices: torch.Tensor, *, backend, num_heads: int) -> None:
        """``HiSparseIndexGroup.begin_decode_attention`` of layer i."""
        layer = self._layer(fwd, i, topk_indices, backend, Overlap.SPLIT)
        launch = layer.begin(i, fwd.decode_ids, topk_indices, num_heads=num_heads)
        fwd.resolved[i] = Resolved("begun", topk_key(topk_indices))
        fwd.begun[i] = (layer, launch)
        self.resolves_per_layer[i] += 1

    def _layer(self, fwd: Forward, i: int, topk_indices, backend, mode: Overlap) -> DecodeLayer:
        """Checks of a decode attention of layer i; its DecodeLayer (the mode's, made once,
        moved to ``backend`` with its scratch when another backend object comes)."""
        fwd.check_decode_topk(topk_indices, self.cache.device)
        if i in fwd.resolved:
            raise ValueError(f"layer {i} was already resolved in this forward (or by a graph replay)")
        fwd.written_before(i, "decode attention")
        layer = self.layers.get(mode)
        if layer is None:
            layer = DecodeLayer(self.cache, backend, overlap=mode, validate=self.validate)
        elif layer.backend is not backend:  # another backend object: the scratch carries over
            layer = layer.with_backend(backend)
        self.layers[mode] = layer  # one per mode: the last backend object's
        return layer

    def prefetch(self, fwd: Forward, i: int, topk_indices: torch.Tensor) -> None:
        """``HiSparseIndexGroup.prefetch`` of layer i."""
        fwd.check_decode_topk(topk_indices, self.cache.device)
        if i in fwd.resolved:
            raise ValueError(f"layer {i} was already resolved in this forward: prefetch it before")
        self.refuse_input(topk_indices, "prefetch")
        if fwd.decode_tokens:
            self.cache.prefetch(i, fwd.decode_ids, topk_indices)


__all__ = ["DecodeAttention"]
