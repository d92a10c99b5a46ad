"""The engine façade's decode-attention calls: a layer's resolve and attention in one
call, with the miss staging hidden behind the attention (``hisparse.decode``).

:class:`DecodeAttentionCalls`, a base of ``HiSparseIndexGroup``: ``decode_attention``
(resolve + attend, "serial" / "split"), ``begin_decode_attention`` (a split
layer's resolve launched as soon as the top-k exists, attended by the next
``decode_attention`` of the layer) and ``prefetch`` (a predicted selection staged ahead
of the layer's resolve). Each counts as, or comes before, the layer's one resolve of
the forward.
"""

from __future__ import annotations

import torch

from .._checks import check_tensor
from ..decode.layer import DecodeLayer, Overlap
from .metadata import SparseMLAMetadata


def topk_key(t: torch.Tensor) -> tuple:
    """What identifies a top-k tensor between a layer's calls: its memory and layout."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class DecodeAttentionCalls:
    """The decode-attention calls of ``HiSparseIndexGroup`` (which provides ``device``,
    ``validate``, ``_cache``, ``_layer``, ``_check_batch``, ``_decode_ids``,
    ``_decode_tokens``, ``_converted``, ``_written``, ``_begun``, ``_decode_layers``,
    ``resolves_per_layer`` and ``_refuse_input_buffer``)."""

    def _check_decode_topk(self, topk_indices: object) -> None:
        """A decode top-k of this forward: int32 [num_decode_tokens, K] on the group's device."""
        td = self._decode_tokens
        check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2, device=self.device)
        if topk_indices.shape[0] != td:
            raise ValueError(f"topk_indices must be [num_decode_tokens={td}, K] (padded to the bucket with "
                             f"pad_to), got {list(topk_indices.shape)}")

    def decode_attention(self, layer_index: int, q: torch.Tensor, topk_indices: torch.Tensor,
                         metadata: SparseMLAMetadata, *, backend, sm_scale: float,
                         overlap: Overlap | str = "split") -> tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of layer ``layer_index`` with the miss staging hidden behind
        it (``hisparse.decode``): resolves the decode tokens' top-k (int32 [Td, K]) and
        attends ``q`` (bf16 [Td, H, 576]) with ``backend`` over the hits while the misses
        stage ("split"; "serial" = convert + attend). Returns out bf16
        [Td, H, 512], lse float32 [Td, H]. Counts as the layer's one resolve of the
        forward (a later conversion of the same layer is refused).
        """
        i = self._layer(layer_index)
        self._check_batch(metadata)
        mode = Overlap.parse(overlap)
        begun = self._begun.get(i)
        if begun is not None:  # begin_decode_attention resolved it: attend
            layer, sp = begun
            if mode is not Overlap.SPLIT or layer.backend is not backend or self._converted[i][0] != topk_key(topk_indices):
                raise ValueError(f"layer {i} was begun with begin_decode_attention: finish it with overlap "
                                 "'split', the same backend and the same topk_indices tensor")
            out = layer.finish(sp, q, sm_scale=sm_scale)
            del self._begun[i]
            return out
        layer = self._split_layer(i, topk_indices, backend, mode)
        out = layer(i, self._decode_ids, topk_indices, q, sm_scale=sm_scale)
        self._converted[i] = (topk_key(topk_indices), (None, None))
        self.resolves_per_layer[i] += 1
        return out

    def begin_decode_attention(self, layer_index: int, topk_indices: torch.Tensor,
                               metadata: SparseMLAMetadata, *, backend, num_heads: int) -> None:
        """The resolve of a split ``decode_attention`` (``DecodeLayer.begin``), launched
        as soon as the top-k (int32 [Td, K]) exists, so that it runs beside the query
        projection; ``decode_attention(..., overlap="split")`` of the layer, with the
        same backend, ``topk_indices`` tensor and a query of ``num_heads`` heads, then
        attends. Counts as the layer's resolve of the forward. A head count the backend
        refuses is refused before the resolve (nothing changed: the layer can still be
        converted or attended)."""
        i = self._layer(layer_index)
        self._check_batch(metadata)
        layer = self._split_layer(i, topk_indices, backend, "split")
        launch = layer.begin(i, self._decode_ids, topk_indices, num_heads=num_heads)
        self._converted[i] = (topk_key(topk_indices), (None, None))
        self._begun[i] = (layer, launch)
        self.resolves_per_layer[i] += 1

    def _split_layer(self, i: int, topk_indices, backend, overlap: Overlap | str) -> DecodeLayer:
        """Checks of a decode attention of layer i; its DecodeLayer (the mode's, made once,
        moved to ``backend`` with its scratch when another backend object comes)."""
        self._check_decode_topk(topk_indices)
        if i in self._converted:
            raise ValueError(f"layer {i} was already resolved in this forward (or by a graph replay)")
        if self._decode_tokens and i not in self._written:
            raise ValueError(f"layer {i}: write_new_rows must run before decode attention")
        mode = Overlap.parse(overlap)
        layer = self._decode_layers.get(mode)
        if layer is None:
            layer = DecodeLayer(self._cache, backend, overlap=mode, validate=self.validate)
        elif layer.backend is not backend:  # another backend object: the scratch carries over
            layer = layer.with_backend(backend)
        self._decode_layers[mode] = layer  # one per mode: the last backend object's
        return layer

    def prefetch(self, layer_index: int, topk_indices: torch.Tensor, metadata: SparseMLAMetadata) -> None:
        """Stage a predicted selection (int32 [Td, K], e.g. the previous layer's top-k) of
        layer ``layer_index`` ahead of its resolve in this forward (``HiSparseCache.prefetch``)."""
        i = self._layer(layer_index)
        self._check_batch(metadata)
        self._check_decode_topk(topk_indices)
        if i in self._converted:
            raise ValueError(f"layer {i} was already resolved in this forward: prefetch it before")
        self._refuse_input_buffer(topk_indices, "prefetch")
        if self._decode_tokens:
            self._cache.prefetch(i, self._decode_ids, topk_indices)


__all__ = ["DecodeAttentionCalls", "topk_key"]
