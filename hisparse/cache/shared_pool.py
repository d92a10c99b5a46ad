"""One host pool per node, shared by the tensor-parallel ranks of that node.

Why: MLA's latent KV row of a token is identical on every TP rank, so eight TP
ranks holding eight copies of a pool of hundreds of GiB wastes seven of them.
``SharedHostPool`` is a drop-in :class:`hisparse.cache.host_pool.HostPool` whose
rows live in one shared-memory file that every rank maps (``MAP_SHARED``) and, on
CUDA, registers as pinned memory with ``cudaHostRegister`` (no copy per rank). Hot
buffers and slot/LRU state stay per rank (each rank owns its own ``HotState``).

File layout (a file in ``/dev/shm``, page-aligned regions)::

    [0, 4096)               fixed header: int64 fields (_F_*), sha256 config
                            fingerprint, pid of every rank, creator's config JSON
    [4096, 4096 + 8 L)      published: int64 [L], appends whose rows are on host
    [.., + 8 NB)            journal:   int64 [NB], (alloc seq << 32) | owner tag
    [header_bytes, +data)   rows: uint8 [L, H, row_bytes]   (header_bytes % 4096 == 0)

Who writes rows: one *writer rank* (default rank 0) writes every host row; the
others skip the host copy. Every rank computes identical rows, so "each rank writes
its own requests" would buy nothing (TP ranks serve the *same* requests) while one
writer means one PCIe D2H stream per node instead of TP of them, and a single
writer per counter needs no cross-process atomics (a plain aligned 8-byte store).

Ordering of writes vs other ranks' reads: a per-layer *published append count*.
Every rank calls :meth:`SharedHostPool.commit_append` after each per-request ``write`` of
a layer (all TP ranks make the same calls, so they count alike). The writer stores
its count into ``published[layer]`` only after its rows are on host (CPU: the copy
has returned; CUDA: after the copy's event has completed). Before staging misses
of a layer a reader calls :meth:`wait_visible`, which waits until
``published[layer]`` reaches the reader's own count; the row of a miss was written
by an earlier append of that layer, so it is on host. The counter is global per
layer (not per request) because a reader may only ever need rows of appends it has
itself already made; it costs L int64s and one load per resolve. Data stores precede
the counter store in program order; x86-64 (TSO) keeps that order for other cores.

Admission: block allocation is deterministic (the same :class:`BlockAllocator` fed
the same calls on every rank gives the same blocks), so no rank waits on another
to admit. To catch ranks that diverged, the writer journals each allocation
(sequence number + owner tag per block) and readers check their own decisions
against the journal (:meth:`verify_admission`; checked automatically, without
waiting, in ``wait_visible``, i.e. before any read of the rows): a mismatch raises
:class:`AdmissionMismatchError` instead of silently reading another request's rows.

Reuse of freed blocks is safe under TP lockstep: a reader's staging of step t
precedes its all-reduces of step t, which the writer must pass before it admits
and writes new requests at step t + 1. Callers outside lockstep must add a
:func:`hisparse.cache.distributed.barrier` before reusing blocks.

Liveness: every rank stores its pid in the header; :meth:`dead_ranks` finds ranks
whose process is gone (or a zombie), and :meth:`wait_visible` raises
:class:`RankFailureError` quickly when the writer died instead of hanging.

Lifetime: the creator unlinks the file once every rank has attached (see
``hisparse.cache.distributed``), so the memory is freed when the last rank unmaps it even
after a crash; :meth:`close` unlinks too if that has not happened yet.

Limits (known, not yet done): on CUDA the writer's ``commit_append(layer, event)``
synchronises the host with its backup copy, and a reader's ``wait_visible`` is a
host wait, so neither belongs inside a captured CUDA graph; a device-side wait on
the published counter (``cuStreamWaitValue64`` on the registered header) or an
inter-process CUDA event would remove both. On weakly ordered CPUs (aarch64) the
data-before-counter order needs a store fence that Python does not expose.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
import weakref
import zlib
from typing import Any, Hashable

import numpy as np
import torch

from .._checks import check_int
from ..config import HiSparseConfig
from ..device import pin_host_range, unpin_host_range
from .host_pool import BlockAllocator, HostPool

MAGIC = int.from_bytes(b"HISPPOOL", "little")
VERSION = 1
PAGE = 4096
MAX_RANKS = 256

# int64 field indices of the fixed header
_F_MAGIC, _F_VERSION, _F_HEADER_BYTES, _F_DATA_BYTES = 0, 1, 2, 3
_F_L, _F_H, _F_ROW_BYTES, _F_B, _F_NB = 4, 5, 6, 7, 8
_F_STATE, _F_CREATOR_PID, _F_WRITER, _F_WORLD, _F_ALLOC_SEQ = 9, 10, 11, 12, 13
_F_CFG_LEN = 14
_F_FP = 16  # 4 int64 = 32 bytes of sha256
_F_PIDS = 64  # MAX_RANKS int64, 0 = not attached
_CFG_OFF = (_F_PIDS + MAX_RANKS) * 8  # config JSON bytes follow the pid table
_CFG_MAX = PAGE - _CFG_OFF

STATE_INIT, STATE_READY, STATE_CLOSED = 1, 2, 3


class RankFailureError(RuntimeError):
    """A rank died or stopped responding (named in the message)."""


class ConfigMismatchError(ValueError):
    """Ranks were given different cache configs (the differing fields are named)."""


class AdmissionMismatchError(RuntimeError):
    """A reader's block allocation differs from the writer's: the ranks diverged."""


def config_fingerprint(cfg: HiSparseConfig) -> bytes:
    """sha256 (32 bytes) of every config field except ``device`` (per rank by nature)."""
    d = cfg.to_dict()
    d.pop("device", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).digest()


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``['field: a != b', ...]`` for every differing field but ``device``."""
    keys = sorted((set(a) | set(b)) - {"device"})
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def owner_tag(owner: Hashable) -> int:
    """31-bit tag of an allocation owner, equal on every process (no salted hash)."""
    return zlib.crc32(repr(owner).encode()) & 0x7FFFFFFF


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def layout(cfg: HiSparseConfig) -> tuple[int, int]:
    """``(header_bytes, data_bytes)`` of the shared file for ``cfg``."""
    meta = PAGE + 8 * cfg.num_layers + 8 * cfg.num_host_blocks
    return _round_up(meta, PAGE), cfg.host_pool_bytes


def pid_alive(pid: int) -> bool:
    """True when process ``pid`` exists and is not a zombie (same PID namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


class SharedBuffer:
    """Mapping of one shared pool file; duck-types :class:`hisparse.device.PinnedBuffer`.

    ``tensor``: uint8 [data_bytes], CPU, the rows region (page-aligned; registered
    with cudaHostRegister when ``pinned``). ``header``: int64 numpy view of the
    fixed header; ``published``: int64 [L]; ``journal``: int64 [NB] (numpy views).
    """

    def __init__(self, path: str, header_bytes: int, data_bytes: int, num_layers: int,
                 num_blocks: int, *, pin: bool | None) -> None:
        self.path = path
        self.header_bytes = header_bytes
        self.nbytes = data_bytes
        total = header_bytes + data_bytes
        size = os.stat(path).st_size
        if size != total:
            raise ValueError(f"shared pool file {path} has {size} bytes, expected {total}")
        self.inode = os.stat(path).st_ino
        # MAP_SHARED mapping owned by the tensor's storage (unmapped when it dies)
        self._file = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        meta = self._file[:header_bytes].view(torch.int64).numpy()
        self.header = meta[: PAGE // 8]
        self.published = meta[PAGE // 8: PAGE // 8 + num_layers]
        self.journal = meta[PAGE // 8 + num_layers: PAGE // 8 + num_layers + num_blocks]
        self.config_bytes = self._file[_CFG_OFF:PAGE].numpy()
        self.tensor = self._file[header_bytes:]
        want = torch.cuda.is_available() if pin is None else pin
        self.pinned = False
        if want:
            if not torch.cuda.is_available():
                raise ValueError("pin=True needs CUDA, which is not available here")
            ptr = self.tensor.data_ptr()
            try:
                pin_host_range(ptr, data_bytes)  # recorded, so is_pinned_host knows the rows
            except RuntimeError as e:
                raise RuntimeError(f"pinning the shared pool ({data_bytes} bytes of {path}) "
                                   f"failed: {e}") from e
            self.pinned = True
            # the file mapping lives as long as self._file's storage, which self holds
            self._finalizer = weakref.finalize(self, unpin_host_range, ptr, self._file)

    def release(self) -> None:
        """Unregister now, or at the next safe point under a capture or off the main thread
        (``hisparse.device``); the GPU must not use the rows afterwards."""
        if self.pinned:
            self._finalizer()
            self.pinned = False


class JournaledAllocator(BlockAllocator):
    """A :class:`BlockAllocator` that journals (writer) or checks (reader) its decisions.

    Allocation number k (counting calls with n > 0) records, on the writer, the word
    ``(k << 32) | owner_tag`` for each block it hands out and then publishes
    ``alloc_seq = k``; a reader keeps its own decisions until the writer's
    ``alloc_seq`` reaches k and then compares them block by block.
    """

    def __init__(self, num_blocks: int, buf: SharedBuffer, *, is_writer: bool) -> None:
        super().__init__(num_blocks)
        self._buf = buf
        self.is_writer = is_writer
        self.seq = 0
        self._pending: list[tuple[int, int, list[int]]] = []  # (seq, tag, blocks), readers

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        got = super().allocate(owner, n)
        if got:
            self.seq += 1
            word = (self.seq << 32) | owner_tag(owner)
            if self.is_writer:
                self._buf.journal[got] = word
                self._buf.header[_F_ALLOC_SEQ] = self.seq  # after the journal stores
            else:
                self._pending.append((self.seq, owner_tag(owner), got))
        return got

    def check_pending(self) -> int:
        """Compare every pending decision the writer has published; returns how many
        remain unpublished. Raises AdmissionMismatchError on a difference."""
        if not self._pending:
            return 0
        done = int(self._buf.header[_F_ALLOC_SEQ])
        keep = []
        for seq, tag, blocks in self._pending:
            if seq > done:
                keep.append((seq, tag, blocks))
                continue
            words = self._buf.journal[blocks]
            for b, w in zip(blocks, words.tolist()):
                wseq = w >> 32
                if wseq > seq:
                    continue  # the writer already freed and reused it: cannot check
                if w != (seq << 32) | tag:
                    raise AdmissionMismatchError(
                        f"allocation #{seq} (owner tag {tag}) got block {b} on this rank, but "
                        f"the writer's journal says block {b} went to allocation #{wseq} (owner "
                        f"tag {w & 0x7FFFFFFF}): the TP ranks made different admission calls"
                    )
        self._pending = keep
        return len(keep)


class SharedHostPool(HostPool):
    """Drop-in :class:`HostPool` whose rows live in a shared-memory file.

    Same attributes as HostPool (``cfg``, ``B``, ``buffer``, ``rows`` uint8
    ``[L, H, row_bytes]``, ``allocator``, ``pinned``, ``nbytes``) plus the sharing
    protocol: ``rank``, ``is_writer``, :meth:`commit_append`, :meth:`wait_visible`,
    :meth:`verify_admission`, :meth:`dead_ranks`, :meth:`close`.
    Build it with :meth:`create` / :meth:`attach` or, across ranks,
    :func:`hisparse.cache.distributed.setup_shared_pool`.
    """

    shared = True

    def __init__(self, cfg: HiSparseConfig, buf: SharedBuffer, *, rank: int, creator: bool,
                 wait_timeout_s: float = 60.0) -> None:
        # no super().__init__: that would allocate a private PinnedBuffer
        self.cfg = cfg
        self.B = cfg.host_block_size
        self.buffer = buf
        self.rows = buf.tensor.view(cfg.num_layers, cfg.num_host_rows, cfg.row_bytes)
        self.rank = rank
        self.writer_rank = int(buf.header[_F_WRITER])
        self.world_size = int(buf.header[_F_WORLD])
        self.is_writer = rank == self.writer_rank
        self.creator = creator
        self.path = buf.path
        self.wait_timeout_s = float(wait_timeout_s)
        self.allocator = JournaledAllocator(cfg.num_host_blocks, buf, is_writer=self.is_writer)
        self.appends = np.zeros(cfg.num_layers, dtype=np.int64)  # this rank's count per layer
        self.linked = True
        self.closed = False
        self.group: Any = None  # hisparse.cache.distributed.PoolGroup when set up across ranks
        buf.header[_F_PIDS + rank] = os.getpid()

    # ---- construction ------------------------------------------------------
    @classmethod
    def create(cls, cfg: HiSparseConfig, *, world_size: int, writer_rank: int = 0, rank: int = 0,
               shm_dir: str = "/dev/shm", name: str | None = None, pin: bool | None = None,
               wait_timeout_s: float = 60.0) -> "SharedHostPool":
        """Create the file (exactly header + pool bytes, zero-filled) and map it."""
        if not isinstance(cfg, HiSparseConfig):
            raise TypeError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")
        check_int("world_size", world_size, 1, MAX_RANKS + 1)
        check_int("writer_rank", writer_rank, 0, world_size)
        check_int("rank", rank, 0, world_size)
        cfg_json = json.dumps({k: v for k, v in cfg.to_dict().items() if k != "device"},
                              sort_keys=True).encode()
        if len(cfg_json) > _CFG_MAX:
            raise ValueError(
                f"config JSON of {len(cfg_json)} bytes exceeds the header's {_CFG_MAX}")
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory")
        header_bytes, data_bytes = layout(cfg)
        path = os.path.join(shm_dir, name or f"hisparse-pool-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.ftruncate(fd, header_bytes + data_bytes)
            finally:
                os.close(fd)
            buf = SharedBuffer(path, header_bytes, data_bytes, cfg.num_layers,
                               cfg.num_host_blocks, pin=pin)
        except BaseException:
            os.unlink(path)
            raise
        h = buf.header
        h[_F_STATE] = STATE_INIT
        h[_F_VERSION], h[_F_HEADER_BYTES], h[_F_DATA_BYTES] = VERSION, header_bytes, data_bytes
        h[_F_L], h[_F_H], h[_F_ROW_BYTES] = cfg.num_layers, cfg.num_host_rows, cfg.row_bytes
        h[_F_B], h[_F_NB] = cfg.host_block_size, cfg.num_host_blocks
        h[_F_CREATOR_PID], h[_F_WRITER], h[_F_WORLD] = os.getpid(), writer_rank, world_size
        h[_F_FP:_F_FP + 4] = np.frombuffer(config_fingerprint(cfg), dtype=np.int64)
        h[_F_CFG_LEN] = len(cfg_json)
        buf.config_bytes[: len(cfg_json)] = np.frombuffer(cfg_json, dtype=np.uint8)
        h[_F_MAGIC] = MAGIC
        h[_F_STATE] = STATE_READY
        return cls(cfg, buf, rank=rank, creator=True, wait_timeout_s=wait_timeout_s)

    @classmethod
    def attach(cls, path: str, cfg: HiSparseConfig, *, rank: int, pin: bool | None = None,
               wait_timeout_s: float = 60.0) -> "SharedHostPool":
        """Map an existing pool file after checking it was made for ``cfg``.

        Raises ConfigMismatchError naming the differing fields, ValueError for a file
        that is not a ready hisparse pool, FileNotFoundError when it is not on this node.
        """
        if not isinstance(cfg, HiSparseConfig):
            raise TypeError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")
        with open(path, "rb") as f:
            raw = np.frombuffer(f.read(PAGE), dtype=np.int64)
        if raw.size < PAGE // 8 or int(raw[_F_MAGIC]) != MAGIC:
            raise ValueError(f"{path} is not a hisparse shared pool (bad magic)")
        if int(raw[_F_VERSION]) != VERSION or int(raw[_F_STATE]) != STATE_READY:
            raise ValueError(f"{path}: version {int(raw[_F_VERSION])} (want {VERSION}), "
                             f"state {int(raw[_F_STATE])} (want ready={STATE_READY})")
        if raw[_F_FP:_F_FP + 4].tobytes() != config_fingerprint(cfg):
            n = int(raw[_F_CFG_LEN])
            theirs = json.loads(raw.view(np.uint8)[_CFG_OFF:_CFG_OFF + n].tobytes())
            diff = config_diff(theirs, cfg.to_dict())
            raise ConfigMismatchError(
                f"shared pool {path} was created for a different config (creator's != this "
                f"rank's): {'; '.join(diff) or 'fingerprint differs'}")
        check_int("rank", rank, 0, int(raw[_F_WORLD]))
        header_bytes, data_bytes = layout(cfg)
        buf = SharedBuffer(path, header_bytes, data_bytes, cfg.num_layers, cfg.num_host_blocks,
                           pin=pin)
        return cls(cfg, buf, rank=rank, creator=False, wait_timeout_s=wait_timeout_s)

    # ---- write/read ordering -------------------------------------------------
    def published(self, layer: int) -> int:
        """Appends of ``layer`` whose rows the writer has put on host."""
        return int(self.buffer.published[layer])

    def commit_append(self, layer: int, event: Any = None) -> None:
        """Count one per-request ``write`` of ``layer`` (call on every rank, after the host copy
        was issued). The writer publishes the count; with a CUDA ``event`` recorded after
        its copy it first waits for that event (a host sync of the backup stream)."""
        self._check_layer(layer)
        self.appends[layer] += 1
        if self.is_writer:
            if event is not None:
                event.synchronize()
            self.buffer.published[layer] = self.appends[layer]

    def wait_visible(self, layer: int, *, timeout_s: float | None = None) -> None:
        """Return once every row this rank has appended to ``layer`` is on host.

        Raises RankFailureError when the writer is dead or the wait exceeds the timeout.
        """
        self._check_layer(layer)
        self.allocator.check_pending()
        if self.is_writer:
            return
        need = int(self.appends[layer])
        pub = self.buffer.published
        if int(pub[layer]) >= need:
            return
        timeout = self.wait_timeout_s if timeout_s is None else float(timeout_s)
        t0 = time.monotonic()
        sleep, next_check = 1e-5, t0 + 0.05
        while int(pub[layer]) < need:
            now = time.monotonic()
            if now >= next_check:
                self._raise_if_writer_dead(f"waiting for layer {layer} append #{need}")
                next_check = now + 0.05
            if now - t0 > timeout:
                raise RankFailureError(
                    f"rank {self.rank}: writer rank {self.writer_rank} published {int(pub[layer])} "
                    f"appends of layer {layer}, this rank has made {need}; waited {timeout:.1f} s "
                    "(the writer is stuck, or the ranks made different append calls)")
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def verify_admission(self, *, timeout_s: float | None = None) -> None:
        """Wait until the writer has journaled every allocation this rank made and check
        them all (AdmissionMismatchError on a difference; RankFailureError on timeout)."""
        timeout = self.wait_timeout_s if timeout_s is None else float(timeout_s)
        t0 = time.monotonic()
        while self.allocator.check_pending():
            self._raise_if_writer_dead("waiting for the writer's allocation journal")
            if time.monotonic() - t0 > timeout:
                raise RankFailureError(
                    f"rank {self.rank}: writer rank {self.writer_rank} journaled "
                    f"{int(self.buffer.header[_F_ALLOC_SEQ])} allocations, this rank made "
                    f"{self.allocator.seq}; waited {timeout:.1f} s")
            time.sleep(1e-3)

    # ---- liveness ----------------------------------------------------------
    def rank_pids(self) -> list[int]:
        return [int(p) for p in self.buffer.header[_F_PIDS:_F_PIDS + self.world_size]]

    def dead_ranks(self) -> list[int]:
        """Ranks that attached and whose process is gone (or a zombie)."""
        return [r for r, p in enumerate(self.rank_pids()) if p > 0 and not pid_alive(p)]

    def _raise_if_writer_dead(self, what: str) -> None:
        pid = self.rank_pids()[self.writer_rank]
        if pid > 0 and not pid_alive(pid):
            raise RankFailureError(
                f"rank {self.rank}: writer rank {self.writer_rank} (pid {pid}) is dead while "
                f"{what}; dead ranks: {self.dead_ranks()}")

    def _check_layer(self, layer: int) -> None:
        check_int("layer", layer, 0, self.cfg.num_layers, error=ValueError)

    # ---- lifetime ----------------------------------------------------------
    def unlink(self) -> None:
        """Remove the file name (creator only); mappings stay valid until unmapped."""
        if self.creator and self.linked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.linked = False

    def close(self) -> None:
        """Unpin, mark this rank detached and (creator) unlink. ``rows`` must not be
        used afterwards; the mapping goes when the last tensor view is dropped."""
        if self.closed:
            return
        self.buffer.release()
        self.buffer.header[_F_PIDS + self.rank] = 0
        if self.creator:
            self.unlink()
        self.closed = True

    def __enter__(self) -> "SharedHostPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["AdmissionMismatchError", "ConfigMismatchError", "JournaledAllocator",
           "RankFailureError", "SharedBuffer", "SharedHostPool", "config_diff",
           "config_fingerprint", "layout", "owner_tag", "pid_alive"]
