"""Setting up one shared host pool for the tensor-parallel ranks of a node.

:func:`setup_shared_pool` runs on every rank of a process group (NCCL on GPU, gloo on
CPU; any backend works, only the group's key-value store is used):

1. group rank 0 creates the pool file (``SharedHostPool.create``) and posts its path,
   sizes, config fingerprint and writer rank to the store (or its error);
2. every rank waits for that post (with a timeout), attaches, checks the creator's
   config against its own (all fields but ``device``), its writer rank and its host
   name, and posts a verdict;
3. every rank waits for all verdicts (with a timeout). Any mismatch raises
   :class:`ConfigMismatchError` on *every* rank, naming each bad rank and field; a
   rank that never answers raises :class:`RankFailureError` on every rank that waits,
   naming it (and saying whether its process is dead);
4. the creator unlinks the file name, so the memory goes away with the last mapping
   even if ranks crash.

Why the store and not collectives: a store wait takes an explicit timeout on every
backend, whereas an NCCL collective with a dead peer hangs until the watchdog fires
(minutes) and cannot name the missing rank. :func:`barrier` uses the same mechanism
later (e.g. before reusing blocks outside TP lockstep, or to check the group).

Memory accounting: :func:`shared_pool_bytes_per_node` is the host memory the pools of
one node take, counted once per node when sharing is on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._checks import check_int
from ..config import HiSparseConfig
from .shared_pool import (ConfigMismatchError, RankFailureError, SharedHostPool, config_diff, layout,
                          pid_alive)

_setup_counts: dict[str, int] = {}


@dataclasses.dataclass
class PoolGroup:
    """Control-plane handle kept on ``pool.group`` by :func:`setup_shared_pool`."""

    store: Any  # torch.distributed.Store shared by the group
    prefix: str  # key namespace of this pool
    rank: int  # rank within the group
    world_size: int
    timeout_s: float
    barriers: int = 0


def _default_store() -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:  # pragma: no cover - every torch 2.x has it
        raise RuntimeError("this torch has no default store; pass store= to setup_shared_pool")
    return get()


def _wait(store: Any, keys: list[str], timeout_s: float) -> list[str]:
    """Wait for ``keys``; returns the keys still missing after ``timeout_s`` (empty = all)."""
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return []
    except RuntimeError as e:  # DistStoreError (timeout) and network errors derive from it
        try:
            return [k for k in keys if not store.check([k])]
        except RuntimeError:
            raise RankFailureError(
                f"the distributed store is unreachable ({e}); the rank hosting it (usually "
                "global rank 0) may be dead") from e


def _known_pids(store: Any, prefix: str, world: int) -> dict[int, int]:
    """pid of every rank that reached setup_shared_pool (posted at its start)."""
    out = {}
    for r in range(world):
        key = f"{prefix}/pid/{r}"
        try:
            if store.check([key]):
                out[r] = int(store.get(key))
        except RuntimeError:
            break
    return out


def _describe_missing(ranks: list[int], pids: dict[int, int]) -> str:
    parts = []
    for r in ranks:
        pid = pids.get(r, 0)
        if pid > 0:
            parts.append(f"rank {r} (pid {pid}, {'alive but stuck' if pid_alive(pid) else 'dead'})")
        else:
            parts.append(f"rank {r}")
    return ", ".join(parts)


def setup_shared_pool(cfg: HiSparseConfig, *, group: Any = None, store: Any = None,
                      writer_rank: int = 0, timeout_s: float = 60.0, shm_dir: str = "/dev/shm",
                      pin: bool | None = None, unlink_after_attach: bool = True,
                      wait_timeout_s: float = 60.0) -> SharedHostPool:
    """Create (group rank 0) or attach (others) the node's shared pool; call on every rank.

    ``group``: the TP process group whose ranks share the pool (default: the world);
    all its ranks must be on this node. ``store``: its key-value store (default: the
    default group's). ``timeout_s`` bounds every wait of the setup; ``wait_timeout_s``
    becomes the pool's default for :meth:`SharedHostPool.wait_visible`.
    Raises ConfigMismatchError / RankFailureError on every rank (see module doc).
    """
    if not isinstance(cfg, HiSparseConfig):
        raise TypeError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("setup_shared_pool needs torch.distributed initialised "
                         "(dist.init_process_group) on every rank of the group")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    check_int("writer_rank", writer_rank, 0, world, error=ValueError)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    tag = "-".join(map(str, members))
    n = _setup_counts.get(tag, 0)
    _setup_counts[tag] = n + 1
    prefix = f"hisparse/shared_pool/{tag}/{n}"
    store = store if store is not None else _default_store()
    host = socket.gethostname()
    store.set(f"{prefix}/pid/{rank}", str(os.getpid()))

    # 1. creator posts the pool (or its failure)
    pool: SharedHostPool | None = None
    create_key = f"{prefix}/create"
    if rank == 0:
        try:
            pool = SharedHostPool.create(cfg, world_size=world, writer_rank=writer_rank, rank=0,
                                         shm_dir=shm_dir, pin=pin, wait_timeout_s=wait_timeout_s)
        except Exception as e:
            store.set(create_key, json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
            raise
        header_bytes, data_bytes = layout(cfg)
        store.set(create_key, json.dumps({
            "ok": True, "path": pool.path, "header_bytes": header_bytes, "data_bytes": data_bytes,
            "writer_rank": writer_rank, "host": host, "config": cfg.to_dict()}))
    if _wait(store, [create_key], timeout_s):
        raise RankFailureError(
            f"rank {rank}: group rank 0 (global rank {members[0]}) did not create the shared pool "
            f"within {timeout_s:.1f} s: it is dead, stuck, or not calling setup_shared_pool")
    info = json.loads(store.get(create_key))
    if not info["ok"]:
        raise RuntimeError(f"rank {rank}: rank 0 failed to create the shared pool: {info['error']}")

    # 2. attach and verify
    problems: list[str] = []
    if info["writer_rank"] != writer_rank:
        problems.append(f"writer_rank: {info['writer_rank']!r} != {writer_rank!r}")
    diff = config_diff(info["config"], cfg.to_dict())
    problems += diff
    if info["host"] != host:
        problems.append(f"host: rank 0 is on {info['host']!r}, this rank on {host!r} "
                        "(a shared pool needs every rank of the group on one node)")
    if rank != 0 and not problems:
        try:
            pool = SharedHostPool.attach(info["path"], cfg, rank=rank, pin=pin,
                                         wait_timeout_s=wait_timeout_s)
        except (OSError, ValueError, RuntimeError) as e:
            problems.append(f"attach failed: {type(e).__name__}: {e}")
    verdict = {"ok": not problems, "problems": problems, "pid": os.getpid(),
               "config_mismatch": bool(diff) or info["writer_rank"] != writer_rank}
    store.set(f"{prefix}/verdict/{rank}", json.dumps(verdict))

    # 3. everyone hears everyone
    keys = [f"{prefix}/verdict/{r}" for r in range(world)]
    missing = _wait(store, keys, timeout_s)
    if missing:
        bad = [int(k.rsplit("/", 1)[1]) for k in missing]
        if pool is not None:
            pool.close()
        raise RankFailureError(
            f"rank {rank}: no setup verdict within {timeout_s:.1f} s from "
            f"{_describe_missing(bad, _known_pids(store, prefix, world))}")
    verdicts = [json.loads(store.get(k)) for k in keys]
    bad = [(r, v) for r, v in enumerate(verdicts) if not v["ok"]]
    if bad:
        if pool is not None:
            pool.close()
        msg = "; ".join(f"rank {r}: {', '.join(v['problems'])}" for r, v in bad)
        cls = ConfigMismatchError if any(v["config_mismatch"] for _, v in bad) else RuntimeError
        raise cls(f"rank {rank}: shared pool setup failed, ranks disagree with rank 0's pool "
                  f"({info['path']}): {msg}")
    if pool is None:
        raise RuntimeError(f"rank {rank}: every verdict is ok but this rank has no pool (bug)")
    # 4. every rank has mapped the file: its name is no longer needed
    if rank == 0 and unlink_after_attach:
        pool.unlink()
    pool.group = PoolGroup(store=store, prefix=prefix, rank=rank, world_size=world,
                           timeout_s=float(timeout_s))
    return pool


def barrier(pool: SharedHostPool, *, timeout_s: float | None = None, name: str = "") -> None:
    """Block until every rank of the pool's group reaches this barrier.

    Raises RankFailureError naming the ranks that did not arrive within ``timeout_s``
    (default: the setup timeout) and whether their processes are dead.
    """
    g = getattr(pool, "group", None)
    if not isinstance(g, PoolGroup):
        raise ValueError("barrier needs a pool built by setup_shared_pool")
    timeout = g.timeout_s if timeout_s is None else float(timeout_s)
    n = g.barriers
    g.barriers += 1
    base = f"{g.prefix}/barrier/{n}"
    g.store.set(f"{base}/{g.rank}", "1")
    keys = [f"{base}/{r}" for r in range(g.world_size)]
    t0 = time.monotonic()
    missing = _wait(g.store, keys, timeout)
    if missing:
        bad = [int(k.rsplit("/", 1)[1]) for k in missing]
        raise RankFailureError(
            f"rank {g.rank}: barrier {name or n} timed out after {time.monotonic() - t0:.1f} s "
            f"waiting for {_describe_missing(bad, _known_pids(g.store, g.prefix, g.world_size))}; "
            f"dead ranks: {pool.dead_ranks()}")


def shared_pool_bytes_per_node(cfg: HiSparseConfig, *, tp_ranks_per_node: int,
                               tp_share: bool) -> int:
    """Host bytes the pools of one node take: one shared pool (header + rows) when
    ``tp_share``, else one private ``cfg.host_pool_bytes`` pool per TP rank on the node."""
    check_int("tp_ranks_per_node", tp_ranks_per_node, lo=1, error=ValueError)
    if tp_share:
        header_bytes, data_bytes = layout(cfg)
        return header_bytes + data_bytes
    return tp_ranks_per_node * cfg.host_pool_bytes


__all__ = ["PoolGroup", "barrier", "setup_shared_pool", "shared_pool_bytes_per_node"]
