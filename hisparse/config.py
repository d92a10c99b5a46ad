"""Frozen, validated configuration of a hisparse cache.

Parsed and validated once at construction; nothing deeper in the code reads
environment variables or re-validates.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# re-exported: the kernel choice (``kernels=``) and the checks configs are built with, for
# callers that check options of their own (the tools) the same way
from ._checks import Kernels, check_bool, check_int, parse_enum
from .errors import CapacityError
from .formats import FP8_ROW_BYTES, RowFormat  # RowFormat re-exported: row formats live in formats

HOT_ROW_ALIGN = 64  # rows; see HiSparseConfig.hot_rows_per_layer
DEVICE_PAGE_ROWS = 64  # rows per page of the elastic device pool (a FlashMLA page)


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
    """Configuration of a :class:`hisparse.HiSparseCache`.

    Sizes:
      num_layers          layers whose rows the cache holds
      row_bytes           bytes per row (656 = fp8_ds_mla, 1152 = bf16; opaque bytes otherwise)
      top_k               indexer top-k (K) per query token
      device_buffer_size  LRU hot slots per (layer, request), S; default 2 * top_k;
                          must be >= max_query_len * top_k (CapacityError otherwise: one
                          step may reference that many rows). One more reserved slot per
                          (layer, request) holds the newest token.
      max_num_reqs        live requests at once (request slots R)
      max_query_len       query tokens per request per decode step (q; MTP/speculative > 1)
      host_pool_tokens    host pool capacity in tokens (each token: one row per layer)
      host_block_size     tokens per host block (allocation granularity)
      max_request_id      request ids are ints in [0, max_request_id)
      device              "cuda" (or "cuda:N") or "cpu"
      device_pool_rows    device rows per layer shared by all requests, hot buffers
                          included (the elastic tier, ``hisparse.cache.device_pool``):
                          the rows beyond the hot buffers are pages of DEVICE_PAGE_ROWS
                          rows that hold whole contexts of *resident* requests. None
                          (default): exactly the hot buffers, no resident request.
                          Must be >= max_num_reqs x (device_buffer_size + 1).
      prefix_caching      share host blocks of common prompt prefixes between requests
                          (``hisparse.cache.prefix``): ``add_request(req_id, token_ids=...)``
                          maps the longest cached run of whole blocks. Off by default.
      prefix_alias_blocks extra block ids (prefix caching only) for a request that maps a
                          cached block another live request maps too: each id costs
                          host_block_size x num_layers x 4 bytes of device memory (the
                          hot tier's per-request row index). None: num_host_blocks with
                          prefix caching (every block can be shared by two requests, a
                          block by many as long as ids last), 0 without.
      prefix_hash         block name hash, "sha256" (default; names can't be forged
                          across tenants) or "xxh3_128" (faster; needs ``xxhash``)
      share_prefix_pages  with prefix caching and a device pool: a request whose cached
                          prefix a resident request holds joins resident on that
                          request's device pages (``hisparse.cache.device_pool``);
                          False: a prefix hit joins hot. On by default.
    """

    num_layers: int
    host_pool_tokens: int
    row_bytes: int = FP8_ROW_BYTES
    top_k: int = 2048
    device_buffer_size: int | None = None
    max_num_reqs: int = 64
    max_query_len: int = 1
    host_block_size: int = 64
    max_request_id: int = 1 << 16
    device: str = "cuda"
    device_pool_rows: int | None = None
    prefix_caching: bool = False
    prefix_alias_blocks: int | None = None
    prefix_hash: str = "sha256"
    share_prefix_pages: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "host_pool_tokens", "row_bytes", "top_k",
                     "max_num_reqs", "max_query_len", "host_block_size", "max_request_id"):
            check_int(name, getattr(self, name), lo=1)
        if self.device_buffer_size is None:
            object.__setattr__(self, "device_buffer_size", 2 * self.top_k)
        check_int("device_buffer_size", self.device_buffer_size, lo=1)
        need = self.max_query_len * self.top_k
        if self.device_buffer_size < need:  # a capacity failure, found at configuration
            raise CapacityError(
                f"device_buffer_size={self.device_buffer_size} is smaller than "
                f"max_query_len x top_k = {self.max_query_len} x {self.top_k} = {need}: "
                "one decode step of one request may reference that many distinct rows; "
                f"set device_buffer_size >= {need}"
            )
        if self.row_bytes % 16 != 0:
            raise ValueError(
                f"row_bytes={self.row_bytes} must be a multiple of 16 (16-byte loads); "
                "656 (fp8_ds_mla) and 1152 (bf16) are"
            )
        if self.host_pool_tokens < self.host_block_size:
            raise ValueError(
                f"host_pool_tokens={self.host_pool_tokens} is smaller than one block "
                f"(host_block_size={self.host_block_size})"
            )
        if self.max_request_id >= 2**31:
            raise ValueError(f"max_request_id must be < 2**31, got {self.max_request_id}")
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.num_host_rows >= 2**31:
            raise ValueError(
                f"host pool of {self.num_host_rows} rows per layer exceeds int32 row indices"
            )
        if self.slots_per_req * self.max_num_reqs >= 2**31:
            raise ValueError("max_num_reqs x (device_buffer_size + 1) exceeds int32 indices")
        if self.device_pool_rows is not None:
            check_int("device_pool_rows", self.device_pool_rows, lo=1)
            floor = self.max_num_reqs * self.slots_per_req
            if self.device_pool_rows < floor:
                raise ValueError(
                    f"device_pool_rows={self.device_pool_rows} is smaller than the hot buffers it "
                    f"includes: max_num_reqs x (device_buffer_size + 1) = {self.max_num_reqs} x "
                    f"{self.slots_per_req} = {floor}; give at least {floor} (or None for no resident pages)")
            if self.device_rows_per_layer >= 2**31:
                raise ValueError(f"device_pool_rows={self.device_pool_rows} exceeds int32 row indices")
        check_bool("prefix_caching", self.prefix_caching)
        check_bool("share_prefix_pages", self.share_prefix_pages)
        if self.prefix_alias_blocks is None:
            object.__setattr__(self, "prefix_alias_blocks", self.num_host_blocks if self.prefix_caching else 0)
        check_int("prefix_alias_blocks", self.prefix_alias_blocks, 0)
        if self.prefix_alias_blocks and not self.prefix_caching:
            raise ValueError(f"prefix_alias_blocks={self.prefix_alias_blocks} needs prefix_caching=True")
        if self.prefix_hash not in ("sha256", "xxh3_128"):
            raise ValueError(f"prefix_hash must be 'sha256' or 'xxh3_128', got {self.prefix_hash!r}")
        if self.num_virtual_rows >= 2**31:
            raise ValueError(f"host pool plus prefix_alias_blocks: {self.num_virtual_rows} rows per layer "
                             "exceed int32 row indices; give fewer prefix_alias_blocks")

    # ---- derived sizes -------------------------------------------------
    @property
    def num_host_blocks(self) -> int:
        """Blocks in the host pool (host_pool_tokens rounded down to whole blocks)."""
        return self.host_pool_tokens // self.host_block_size

    @property
    def num_host_rows(self) -> int:
        """Rows per layer in the host pool (H)."""
        return self.num_host_blocks * self.host_block_size

    @property
    def num_virtual_blocks(self) -> int:
        """Block ids a block table may hold: the host blocks (id = host block) then
        ``prefix_alias_blocks`` aliases, each standing for a cached host block that
        another request maps under its own id (``hisparse.cache.prefix``)."""
        return self.num_host_blocks + self.prefix_alias_blocks  # type: ignore[operator]

    @property
    def num_virtual_rows(self) -> int:
        """Rows per layer of the hot tier's row index ``row_slot`` (one per row of each
        block id)."""
        return self.num_virtual_blocks * self.host_block_size

    @property
    def slots_per_req(self) -> int:
        """Hot slots per (layer, request): S LRU slots + 1 reserved newest-token slot."""
        return self.device_buffer_size + 1  # type: ignore[operator]

    @property
    def hot_rows_per_layer(self) -> int:
        """Rows in one layer's flat hot view: R x (S + 1) rounded up to a multiple of
        64 (FlashMLA's decode kernel reads the view as pages of 64 rows). Physical
        indices only ever point below R x (S + 1); the padding rows stay zero."""
        return ceil_div(self.max_num_reqs * self.slots_per_req, HOT_ROW_ALIGN) * HOT_ROW_ALIGN

    @property
    def pool_pages(self) -> int:
        """Pages of DEVICE_PAGE_ROWS rows per layer beyond the hot buffers (0 without a pool)."""
        if self.device_pool_rows is None:
            return 0
        return max(0, self.device_pool_rows - self.hot_rows_per_layer) // DEVICE_PAGE_ROWS

    @property
    def device_rows_per_layer(self) -> int:
        """Rows of one layer's flat device view: the hot buffers (``hot_rows_per_layer``)
        then ``pool_pages`` pages; physical indices of resident rows point past the hot
        buffers."""
        return self.hot_rows_per_layer + self.pool_pages * DEVICE_PAGE_ROWS

    @property
    def max_pages_per_request(self) -> int:
        """Columns of the device page table: the pages one request can hold at most
        (its whole host capacity, bounded by the pool)."""
        return min(ceil_div(self.num_host_rows, DEVICE_PAGE_ROWS), self.pool_pages)

    @property
    def host_pool_bytes(self) -> int:
        return self.num_layers * self.num_host_rows * self.row_bytes

    @property
    def hot_buffer_bytes(self) -> int:
        """Bytes of the device rows of every layer (hot buffers and pool pages)."""
        return self.num_layers * self.device_rows_per_layer * self.row_bytes

    @property
    def max_tokens(self) -> int:
        """Query tokens one resolve takes at most: max_num_reqs x max_query_len."""
        return self.max_num_reqs * self.max_query_len

    def device_bytes(self) -> dict[str, int]:
        """Bytes of every device tensor a cache with this config allocates, by part.

        hot rows (and pool pages); slot/LRU state (id_to_slot, seq_lens, block_table,
        slot_pos int32 and slot_stamp int64 per slot, row_slot and the block-id map, step, stats, residency
        flags and the device page table); resolve buffers (physical,
        valid counts, staging lists per layer, plus one set for prefetches with the
        undo log all share). A layer's first split resolve adds ``split_buffers_per_layer``.
        """
        L, R, SP = self.num_layers, self.max_num_reqs, self.slots_per_req
        T = self.max_tokens
        TK = T * self.top_k
        state = (4 * self.max_request_id + 4 * L * R + 4 * R * self.num_host_blocks + 12 * L * R * SP
                 + 4 * L * self.num_virtual_rows + 4 * self.num_virtual_blocks + 8 * L * R + 8 * L * 7
                 + 4 * R * (1 + max(1, self.max_pages_per_request)))
        resolve = (L + 1) * (12 * TK + 4 * T) + 20 * TK
        return {"hot_rows": self.hot_buffer_bytes, "state": state, "resolve_buffers": resolve,
                "split_buffers_per_layer": 12 * TK + 4 * T,
                "total": self.hot_buffer_bytes + state + resolve}

    @classmethod
    def from_pool_bytes(cls, *, num_layers: int, host_pool_bytes: int, row_bytes: int = FP8_ROW_BYTES,
                        **kwargs: Any) -> "HiSparseConfig":
        """Build a config whose host pool holds at most ``host_pool_bytes``."""
        check_int("host_pool_bytes", host_pool_bytes, lo=1)
        tokens = host_pool_bytes // (num_layers * row_bytes)
        return cls(num_layers=num_layers, host_pool_tokens=tokens, row_bytes=row_bytes, **kwargs)

    def replace(self, **changes: Any) -> "HiSparseConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HiSparseConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown HiSparseConfig fields {sorted(unknown)}; valid: {sorted(fields)}")
        return cls(**d)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["HiSparseConfig", "DEVICE_PAGE_ROWS", "RowFormat", "Kernels", "ceil_div", "check_int", "check_bool", "parse_enum"]
