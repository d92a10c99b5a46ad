"""Input validation of the cache's public calls (raises before any launch).

Two levels, matching DESIGN.md "Checked vs unchecked":

- *Metadata* checks (type, dtype, ndim, shape, device, capacity) look only at tensor
  attributes: no host sync, no allocation. The cache runs them on every call, checked
  or not, because a wrong shape would make a kernel index outside its buffers.
- *Content* checks (live request ids, contiguous tokens per request, at most
  ``max_query_len`` tokens per request, indices in ``[-1, layer length)``) read device
  tensors, which costs a host sync. They run only in checked mode (``validate=True``,
  the default); unchecked, the resolver turns bad entries into -1 and counts them.

Caller mistakes raise ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind,
wrong value) naming what was expected and what came. Nothing here changes state.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .._checks import check_int, check_ints, check_tensor
from ..config import HiSparseConfig
from ..device import check_host_bytes
from ..errors import CapacityError


def check_device_memory(cfg: HiSparseConfig, device: torch.device) -> None:
    """CapacityError before allocating when ``device`` can't hold the cache's hot rows
    and state."""
    need = cfg.device_bytes()["total"]
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            raise CapacityError(f"the cache needs {need / 2**30:.2f} GiB ({need} bytes) on {device} "
                                f"but {free / 2**30:.2f} GiB are free; use fewer requests, layers or "
                                "hot slots (device_buffer_size)")
    else:
        check_host_bytes(need, "the cache's hot rows and state (device='cpu')",
                         "use fewer requests, layers or hot slots (device_buffer_size)")


def check_layer(cfg: HiSparseConfig, layer: object) -> int:
    return check_int("layer", layer, 0, cfg.num_layers)


def check_req_id(cfg: HiSparseConfig, req_id: object) -> int:
    return check_int("req_id", req_id, 0, cfg.max_request_id)


def check_resolve_meta(cfg: HiSparseConfig, device: torch.device, req_ids: object,
                       topk: object, max_tokens: int) -> tuple[int, int]:
    """Metadata of a resolve call; returns (T, K). No sync.

    req_ids: int32/int64 [T]; topk: int32 [T, K], rows contiguous, 1 <= K <= top_k (K = 0
    only with T = 0) and T <= max_tokens
    (the capacity of the preallocated output buffers, R x max_query_len).
    """
    req_ids = check_tensor("req_ids", req_ids, dtype=(torch.int32, torch.int64), ndim=1, device=device)
    topk = check_tensor("topk", topk, dtype=torch.int32, ndim=2, device=device)
    T, K = topk.shape
    if req_ids.shape[0] != T:
        raise ValueError(
            f"req_ids has {req_ids.shape[0]} entries but topk has {T} rows; one request id "
            "per query token is expected"
        )
    if T > 1 and req_ids.stride(0) != 1:
        raise ValueError(f"req_ids must be contiguous, got stride {req_ids.stride(0)}")
    if T and K == 0:
        raise ValueError("topk must have K >= 1 columns (use -1 entries for padding)")
    if T and K > 1 and topk.stride(1) != 1:  # no rows: nothing is read
        raise ValueError(f"topk must be contiguous in its last dimension, got strides "
                         f"{topk.stride()}")
    if K > cfg.top_k:
        raise ValueError(f"topk has K={K} columns, more than the configured top_k={cfg.top_k}")
    if T > max_tokens:
        raise ValueError(
            f"topk has T={T} query tokens, more than max_num_reqs x max_query_len = "
            f"{cfg.max_num_reqs} x {cfg.max_query_len} = {max_tokens}"
        )
    return T, K


def check_resolve_contents(cfg: HiSparseConfig, req_ids: torch.Tensor, topk: torch.Tensor,
                           slot_of: Mapping[int, int], seq_len_of: Callable[[int], int]) -> None:
    """Contents of a resolve call (one host sync). Call after :func:`check_resolve_meta`.

    slot_of: live request id -> request slot; seq_len_of(slot) -> positions readable in
    the resolved layer (rows appended to it). A padding token (request id -1, every
    entry -1: what a forward padded to a batch-size bucket passes) selects nothing and
    is accepted. Raises ValueError naming the first offending token.
    """
    T, K = topk.shape
    if T == 0:
        return
    ids_dev = req_ids.to(torch.int64)
    if K:
        lo = topk.min(dim=1).values.to(torch.int64)
        hi = topk.max(dim=1).values.to(torch.int64)
        packed = torch.stack([ids_dev, lo, hi]).cpu()  # the one host sync
    else:
        packed = ids_dev.cpu()[None]
    ids = packed[0].tolist()
    lows = packed[1].tolist() if K else [-1] * T
    highs = packed[2].tolist() if K else [-1] * T
    pad = [rid == -1 and lows[t] == -1 and highs[t] == -1 for t, rid in enumerate(ids)]
    seen: set[int] = set()
    run = 0
    for t, rid in enumerate(ids):
        if pad[t]:
            run = 0
            continue
        if rid == -1:
            raise ValueError(f"req_ids[{t}] = -1 marks a padding token (e.g. past the batch with pad_to), but "
                             f"its top-k row holds entries other than -1 (smallest {lows[t]}, largest "
                             f"{highs[t]}); a padding token's row must be all -1")
        if not 0 <= rid < cfg.max_request_id:
            raise ValueError(
                f"req_ids[{t}]={rid} is out of range [0, {cfg.max_request_id})"
            )
        if rid not in slot_of:
            raise ValueError(f"req_ids[{t}]={rid} is not a live request (add_request it first)")
        if t > 0 and ids[t - 1] == rid and not pad[t - 1]:
            run += 1
        else:
            if rid in seen:
                raise ValueError(
                    f"the tokens of request {rid} are not contiguous in req_ids (it appears "
                    f"again at token {t}); group each request's tokens together"
                )
            seen.add(rid)
            run = 1
        if run > cfg.max_query_len:
            raise ValueError(
                f"request {rid} has more than max_query_len={cfg.max_query_len} query "
                f"tokens (token {t})"
            )
    if not K:
        return
    for t, rid in enumerate(ids):
        if pad[t]:
            continue
        n = seq_len_of(slot_of[rid])
        if lows[t] < -1:
            raise ValueError(
                f"topk[{t}] holds {lows[t]}; entries must be -1 (padding) or positions in "
                f"[0, seq_len={n}) of request {rid}"
            )
        if highs[t] >= n:
            raise ValueError(
                f"topk[{t}] holds position {highs[t]} but request {rid} has seq_len={n} "
                f"(rows appended to this layer); valid range is [-1, {n})"
            )


def check_positions(positions: object, length: int) -> torch.Tensor:
    """Positions to read: a list of ints or an integer tensor [n]; each in [0, length).

    Returns int64 [n] on CPU.
    """
    if isinstance(positions, torch.Tensor):
        if positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
            raise TypeError(
                f"positions must be an int32/int64 1-D tensor, got {positions.dtype} "
                f"shape {tuple(positions.shape)}"
            )
        pos = positions.to("cpu", torch.int64)
    elif isinstance(positions, (list, tuple, range)):
        pos = torch.tensor(check_ints("positions", positions), dtype=torch.int64)
    else:
        raise TypeError(
            f"positions must be a list of ints or an integer tensor, got {type(positions).__name__}"
        )
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= length):
        raise ValueError(
            f"positions must lie in [0, {length}) (rows appended to that layer), got "
            f"min {int(pos.min())} max {int(pos.max())}"
        )
    return pos


__all__ = ["check_layer", "check_req_id", "check_resolve_meta", "check_resolve_contents",
           "check_positions"]
