"""The per-forward batch metadata an engine hands to :class:`hisparse.engine.HiSparseIndexGroup`.

It carries what inference engines already keep in their sparse-MLA attention metadata
(vLLM's ``FlashMLASparseMetadata``, SGLang's forward batch), named the same way:

  num_reqs      requests in the batch (N)      T   query tokens in the batch
  num_decodes   decode requests (first in the batch), D of them
  num_prefills  prefill requests (after the decodes), P = N - D

Token order: the tokens of one request are contiguous and requests come in batch order,
decode requests first, then prefill requests (the order engines use). A decode request
contributes ``decode_max_query_len`` tokens (1 normally; q > 1 for MTP/speculative
decoding: every decode request then has exactly q tokens).

Device tensors (what kernels read) and their host copies (what planning reads, so no
host sync is ever needed) are both kept; :meth:`SparseMLAMetadata.build` makes both from
host lists, which is how engines build theirs too.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_int, check_ints, check_tensor
from ..device import device_ints  # re-exported: the engine's one non-blocking int copy


def _check_i32(name: str, x: object, shape: tuple[int, ...], device: torch.device | None) -> None:
    check_tensor(name, x, dtype=torch.int32, shape=shape, device=device)


@dataclasses.dataclass(frozen=True)
class SparseMLAMetadata:
    """One forward's batch description (validated on construction; never mutated).

    Device tensors:
      req_id_per_token  int32 [T]          batch row (0..N-1) of each query token
      request_ids       int32 [N]          hisparse request id of each batch row
      seq_lens          int32 [N]          context length of each request *after* this
                                           forward's tokens are appended
      query_start_loc   int32 [N + 1]      first token of each request; [-1] = T
      block_table       int32 [N, NB] | None  the engine's own paged block table, passed
                                           through untouched (hisparse keeps its own)
    On CUDA, ``build`` copies them without waiting (``device_ints``): they are ready for
    work on the stream that was current at ``build``, in order after it; another stream
    must wait on that one before it reads them.
    Host copies (tuples of int): request_ids_cpu, seq_lens_cpu, query_start_loc_cpu.
    Scalars: num_decodes, num_decode_tokens, num_prefills, block_size (the engine's
    paged-cache block size; only passed through), decode_max_query_len.
    """

    req_id_per_token: torch.Tensor
    request_ids: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor | None
    request_ids_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    query_start_loc_cpu: tuple[int, ...]
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    block_size: int
    decode_max_query_len: int

    # ---- derived -------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.request_ids_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def device(self) -> torch.device:
        return self.req_id_per_token.device

    def query_len(self, row: int) -> int:
        """Query tokens of batch row ``row`` in this forward."""
        return self.query_start_loc_cpu[row + 1] - self.query_start_loc_cpu[row]

    def context_start(self, row: int) -> int:
        """Position of the first query token of batch row ``row`` (tokens before it are context)."""
        return self.seq_lens_cpu[row] - self.query_len(row)

    def query_lens(self) -> list[int]:
        """Query tokens of every batch row."""
        qsl = self.query_start_loc_cpu
        return [qsl[row + 1] - qsl[row] for row in range(self.num_reqs)]

    def decode_token_request_ids(self, tokens: int) -> list[int]:
        """The request id of each decode token, padded with -1 to ``tokens`` entries."""
        q = self.decode_max_query_len  # every decode request's query length
        dec = self.request_ids_cpu[:self.num_decodes]
        ids = list(dec) if q == 1 else [rid for rid in dec for _ in range(q)]
        return ids + [-1] * (tokens - len(ids))

    # ---- construction --------------------------------------------------
    @classmethod
    def build(cls, *, request_ids: list[int], query_lens: list[int], seq_lens: list[int],
              num_decodes: int, device: torch.device | str = "cpu", block_size: int = 64,
              block_table: torch.Tensor | None = None) -> "SparseMLAMetadata":
        """Build from host lists: request ids, query tokens and context lengths per batch row.

        The first ``num_decodes`` rows are decode requests and must all have the same
        query length (1, or q for multi-token decode).
        """
        dev = torch.device(device)
        for name, lst in (("request_ids", request_ids), ("query_lens", query_lens),
                          ("seq_lens", seq_lens)):
            check_ints(name, lst, 0)
        n = len(request_ids)
        if len(query_lens) != n or len(seq_lens) != n:
            raise ValueError(f"request_ids ({n}), query_lens ({len(query_lens)}) and seq_lens "
                             f"({len(seq_lens)}) must have one entry per batch row")
        check_int("num_decodes", num_decodes, 0)
        if num_decodes > n:
            raise ValueError(f"num_decodes={num_decodes} exceeds the {n} requests in the batch")
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        q_dec = query_lens[0] if num_decodes else 0
        tokens = [row for row, q in enumerate(query_lens) for _ in range(q)]
        t, nq = len(tokens), len(qsl)
        flat = device_ints(tokens + list(request_ids) + list(seq_lens) + qsl, dev)
        return cls(
            req_id_per_token=flat[:t],
            request_ids=flat[t:t + n],
            seq_lens=flat[t + n:t + 2 * n],
            query_start_loc=flat[t + 2 * n:t + 2 * n + nq],
            block_table=block_table,
            request_ids_cpu=tuple(request_ids),
            seq_lens_cpu=tuple(seq_lens),
            query_start_loc_cpu=tuple(qsl),
            num_decodes=num_decodes,
            num_decode_tokens=qsl[num_decodes],
            num_prefills=n - num_decodes,
            block_size=block_size,
            decode_max_query_len=q_dec,
        )

    def __post_init__(self) -> None:
        n = len(self.request_ids_cpu)
        qsl = self.query_start_loc_cpu
        if len(qsl) != n + 1 or len(self.seq_lens_cpu) != n:
            raise ValueError(f"query_start_loc_cpu needs {n + 1} entries and seq_lens_cpu {n}, got "
                             f"{len(qsl)} and {len(self.seq_lens_cpu)}")
        if qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])):
            raise ValueError(f"query_start_loc must start at 0 and not decrease, got {list(qsl)}")
        if len(set(self.request_ids_cpu)) != n:
            raise ValueError(f"request ids must be distinct within a batch, got {list(self.request_ids_cpu)}")
        for row in range(n):
            if self.query_len(row) > self.seq_lens_cpu[row]:
                raise ValueError(f"batch row {row}: query length {self.query_len(row)} exceeds its "
                                 f"seq_len {self.seq_lens_cpu[row]} (seq_len includes this forward's tokens)")
        check_int("num_decodes", self.num_decodes, 0)
        check_int("num_prefills", self.num_prefills, 0)
        check_int("block_size", self.block_size, 1)
        if self.num_decodes + self.num_prefills != n:
            raise ValueError(f"num_decodes ({self.num_decodes}) + num_prefills ({self.num_prefills}) "
                             f"!= {n} requests")
        if self.num_decode_tokens != qsl[self.num_decodes]:
            raise ValueError(f"num_decode_tokens={self.num_decode_tokens} but the decode rows hold "
                             f"{qsl[self.num_decodes]} tokens (query_start_loc[num_decodes])")
        q = self.decode_max_query_len
        if self.num_decodes:
            lens = {self.query_len(r) for r in range(self.num_decodes)}
            if lens != {q} or q < 1:
                raise ValueError(f"every decode request must have decode_max_query_len={q} >= 1 tokens, "
                                 f"got query lengths {sorted(lens)}")
        T = qsl[-1]
        dev = self.req_id_per_token.device
        _check_i32("req_id_per_token", self.req_id_per_token, (T,), dev)
        _check_i32("request_ids", self.request_ids, (n,), dev)
        _check_i32("seq_lens", self.seq_lens, (n,), dev)
        _check_i32("query_start_loc", self.query_start_loc, (n + 1,), dev)
        if self.block_table is not None:
            bt = self.block_table
            if not isinstance(bt, torch.Tensor) or bt.dtype != torch.int32 or bt.dim() != 2:
                raise TypeError("block_table must be an int32 [num_reqs, max_blocks] tensor or None")
            if bt.shape[0] != n:
                raise ValueError(f"block_table has {bt.shape[0]} rows, the batch {n} requests")


__all__ = ["SparseMLAMetadata"]
