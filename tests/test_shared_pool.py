"""CPU tests of the node-shared host pool (hisparse.cache.shared_pool, hisparse.cache.distributed).

Single-process tests map one file twice (writer and reader objects); multi-process
tests run this file as a script, one gloo rank per subprocess (file:// store), and
the parent kills every child at the end or on timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from hisparse.cache.shared_pool import (_F_PIDS, AdmissionMismatchError, ConfigMismatchError,
                                        RankFailureError, SharedHostPool, layout)
from hisparse.config import HiSparseConfig
from hisparse.cache.distributed import shared_pool_bytes_per_node

# L=2 layers, 8 blocks of 4 tokens (H = 32 rows), 32-byte rows, K = S = 8
CFG = dict(num_layers=2, host_pool_tokens=32, host_block_size=4, row_bytes=32, top_k=8,
           device_buffer_size=8, max_num_reqs=2, max_request_id=16, device="cpu")


def make_cfg(**kw) -> HiSparseConfig:
    return HiSparseConfig(**{**CFG, **kw})


def expected_row(layer: int, req: int, pos: int, row_bytes: int) -> torch.Tensor:
    """uint8 [row_bytes]: the row every rank computes for (layer, request, position)."""
    x = torch.arange(row_bytes, dtype=torch.int64) * 3 + layer * 131 + req * 31 + pos * 7 + 1
    return (x % 256).to(torch.uint8)


def expected_rows(layer: int, req: int, p0: int, p1: int, row_bytes: int) -> torch.Tensor:
    return torch.stack([expected_row(layer, req, p, row_bytes) for p in range(p0, p1)])


# ---------------------------------------------------------------- single process
@pytest.fixture
def pair(tmp_path):
    cfg = make_cfg()
    w = SharedHostPool.create(cfg, world_size=2, writer_rank=0, rank=0, shm_dir=str(tmp_path),
                              pin=False, wait_timeout_s=5)
    r = SharedHostPool.attach(w.path, cfg, rank=1, pin=False, wait_timeout_s=5)
    yield cfg, w, r
    r.close()
    w.close()


def test_layout_and_drop_in(pair):
    cfg, w, r = pair
    hb, db = layout(cfg)
    assert hb % 4096 == 0 and db == cfg.host_pool_bytes
    assert os.path.getsize(w.path) == hb + db  # exactly header + pool bytes
    for p in (w, r):
        assert p.rows.shape == (2, 32, 32) and p.rows.dtype == torch.uint8
        assert p.rows.data_ptr() % 4096 == 0 and not p.pinned
        assert p.nbytes == cfg.host_pool_bytes and p.allocator.num_blocks == 8
    assert w.is_writer and not r.is_writer
    assert w.rank_pids() == [os.getpid(), os.getpid()]
    # one memory: a write through one mapping is seen through the other
    w.rows[1, 5] = 77
    assert torch.equal(r.rows[1, 5], torch.full((32,), 77, dtype=torch.uint8))
    assert w.rows.data_ptr() != r.rows.data_ptr()  # two mappings of the same pages


def test_publish_and_wait(pair):
    cfg, w, r = pair
    for p in (w, r):
        assert p.allocator.allocate(3, 2) == [0, 1]
    rows = w.host_rows(3, torch.arange(6))
    w.rows[0, rows] = expected_rows(0, 3, 0, 6, 32)
    r.commit_append(0)
    t0 = time.monotonic()
    with pytest.raises(RankFailureError, match="published 0 appends of layer 0"):
        r.wait_visible(0, timeout_s=0.2)  # writer alive but has not published
    assert time.monotonic() - t0 < 2
    w.commit_append(0)
    assert w.published(0) == 1 and w.published(1) == 0
    r.wait_visible(0)
    r.wait_visible(1)  # nothing appended to layer 1 by the reader: nothing to wait for
    r.verify_admission(timeout_s=1)
    assert torch.equal(r.rows[0, r.host_rows(3, torch.arange(6))], expected_rows(0, 3, 0, 6, 32))


def test_admission_mismatch_detected(pair):
    cfg, w, r = pair
    w.allocator.allocate(3, 2)  # writer: request 3 gets blocks 0, 1
    r.allocator.allocate(5, 2)  # reader diverged: request 5 gets blocks 0, 1
    with pytest.raises(AdmissionMismatchError, match="different admission calls"):
        r.verify_admission(timeout_s=1)


def test_admission_after_reuse(pair):
    cfg, w, r = pair
    for p in (w, r):
        p.allocator.allocate(3, 3)
        p.allocator.allocate(4, 1)
        p.allocator.free(3)
        assert p.allocator.allocate(6, 2) == [0, 1]
    r.verify_admission(timeout_s=1)
    assert r.allocator.check_pending() == 0


def test_dead_writer_detected(tmp_path):
    cfg = make_cfg()
    w = SharedHostPool.create(cfg, world_size=2, rank=0, shm_dir=str(tmp_path), pin=False)
    r = SharedHostPool.attach(w.path, cfg, rank=1, pin=False)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    w.buffer.header[_F_PIDS + 0] = child.pid  # the writer's process is gone
    assert r.dead_ranks() == [0]
    r.commit_append(1)
    t0 = time.monotonic()
    with pytest.raises(RankFailureError, match=r"writer rank 0 \(pid \d+\) is dead"):
        r.wait_visible(1, timeout_s=30)
    assert time.monotonic() - t0 < 2
    r.close()
    w.close()


def test_attach_mismatch_names_field(tmp_path):
    cfg = make_cfg()
    with SharedHostPool.create(cfg, world_size=2, shm_dir=str(tmp_path), pin=False) as w:
        with pytest.raises(ConfigMismatchError, match="host_block_size: 4 != 8"):
            SharedHostPool.attach(w.path, make_cfg(host_block_size=8), rank=1, pin=False)
        with pytest.raises(ValueError, match=r"rank=2 is out of range \[0, 2\)"):
            SharedHostPool.attach(w.path, cfg, rank=2, pin=False)
        # device differs per rank by nature and is not part of the identity
        SharedHostPool.attach(w.path, cfg.replace(device="cuda:1"), rank=1, pin=False).close()
    assert not os.path.exists(w.path)  # creator's close unlinked


def test_bad_inputs(tmp_path):
    cfg = make_cfg()
    with pytest.raises(TypeError):
        SharedHostPool.create({"num_layers": 2}, world_size=1, shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match="writer_rank"):
        SharedHostPool.create(cfg, world_size=2, writer_rank=2, shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        SharedHostPool.create(cfg, world_size=1, shm_dir=str(tmp_path / "nope"))
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"\0" * 8192)
    with pytest.raises(ValueError, match="bad magic"):
        SharedHostPool.attach(str(bogus), cfg, rank=0)
    assert os.listdir(tmp_path) == ["bogus"]  # failed creates left nothing behind
    with SharedHostPool.create(cfg, world_size=1, shm_dir=str(tmp_path), pin=False) as p:
        with pytest.raises(ValueError, match=r"layer=2 is out of range \[0, 2\)"):
            p.commit_append(2)
        with pytest.raises(ValueError, match=r"layer=-1 is out of range \[0, 2\)"):
            p.wait_visible(-1)
        assert p.published(0) == 0  # no state change
    with pytest.raises(ValueError, match="tp_ranks_per_node"):
        shared_pool_bytes_per_node(cfg, tp_ranks_per_node=0, tp_share=True)


def test_bytes_per_node():
    cfg = make_cfg()
    hb, db = layout(cfg)
    assert shared_pool_bytes_per_node(cfg, tp_ranks_per_node=8, tp_share=True) == hb + db
    assert shared_pool_bytes_per_node(cfg, tp_ranks_per_node=8, tp_share=False) == 8 * db
    assert shared_pool_bytes_per_node(cfg, tp_ranks_per_node=1, tp_share=False) == db


def resolve_and_stage(pool: SharedHostPool, layer: int, req_id: int, positions: list[int],
                      seq_len: int) -> torch.Tensor:
    """A fresh per-rank hot tier resolves ``positions`` of ``req_id`` (all misses) and
    stages them from the shared pool with the reference paths; returns the staged rows
    uint8 [len(positions), row_bytes] read back through the physical indices."""
    from hisparse.cache.resolve_ref import copy_rows_reference, resolve_reference
    from hisparse.cache.state import HotState, ResolveBuffers

    cfg = pool.cfg
    st = HotState.allocate(cfg, torch.device("cpu"))
    st.id_to_slot[req_id] = 0
    st.seq_lens[:, 0] = seq_len
    blocks = pool.allocator.blocks(req_id)
    st.block_table[0, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    K = cfg.top_k
    topk = torch.full((1, K), -1, dtype=torch.int32)
    topk[0, : len(positions)] = torch.tensor(positions, dtype=torch.int32)
    out = ResolveBuffers.allocate(1, K, torch.device("cpu"))
    resolve_reference(st, layer, torch.tensor([req_id], dtype=torch.int32), topk, out,
                      max_query_len=cfg.max_query_len)
    hot = torch.zeros(cfg.hot_rows_per_layer, cfg.row_bytes, dtype=torch.uint8)
    pool.wait_visible(layer)
    copy_rows_reference(pool.rows[layer], out.stage_src, hot, out.stage_dst)
    phys = out.physical[0, : len(positions)].long()
    return hot[phys]


def test_reference_resolve_reads_shared_rows(pair):
    cfg, w, r = pair
    for p in (w, r):
        p.allocator.allocate(7, 3)
    w.rows[1, w.host_rows(7, torch.arange(10))] = expected_rows(1, 7, 0, 10, 32)
    w.commit_append(1)
    r.commit_append(1)
    got = resolve_and_stage(r, 1, 7, [9, 0, 4, 5], seq_len=10)
    want = torch.stack([expected_row(1, 7, p, 32) for p in (9, 0, 4, 5)])
    assert torch.equal(got, want)


def test_drop_in_for_hisparse_cache(pair):
    """Two HiSparseCache instances (ranks) use the two mappings in place of HostPool;
    the reader's misses are staged from rows the writer put in the shared pool."""
    from hisparse.cache.cache import HiSparseCache

    cfg, w, r = pair
    caches = []
    for pool in (w, r):
        caches.append(HiSparseCache(cfg, kernels="torch", host_pool=pool))
    n = 20  # > S = 8: most positions live on host only
    for c, pool in zip(caches, (w, r)):
        c.add_request(5)
        for layer in range(cfg.num_layers):
            c.write(layer, 5, expected_rows(layer, 5, 0, n, 32))[0]  # commits the append
    r.wait_visible(0)
    r.verify_admission(timeout_s=1)
    assert all(int(v) == 1 for v in w.buffer.published)  # one append per layer published
    picks = [19, 0, 9, 10, 17, 3, 12, 1]
    for layer in range(cfg.num_layers):
        res = caches[1].resolve(layer, torch.tensor([5], dtype=torch.int32),
                                torch.tensor([picks], dtype=torch.int32))
        got = caches[1].hot_rows(layer)[res.physical[0].long()]
        assert torch.equal(got, expected_rows(layer, 5, 0, n, 32)[picks])
    assert caches[1].stats()["host_pool"]["bytes"] == cfg.host_pool_bytes
    with pytest.raises(ValueError, match="another config"):
        HiSparseCache(cfg.replace(top_k=4, device_buffer_size=8), kernels="torch", host_pool=w)


def test_batched_append_uses_the_shared_pool_hooks(pair):
    """a planned batch's write on both ranks: only the writer stores rows, each call commits
    one append per layer, and the reader stages the writer's rows."""
    from hisparse.cache.cache import HiSparseCache

    cfg, w, r = pair
    caches = [HiSparseCache(cfg, kernels="torch", host_pool=pool) for pool in (w, r)]
    lens = {5: 20, 6: 3}
    for c in caches:
        for rid in lens:
            c.add_request(rid)
        for layer in range(cfg.num_layers):
            rows = torch.cat([expected_rows(layer, rid, 0, n, 32) for rid, n in lens.items()])
            if c is caches[1]:  # rows that stay host-only: a reader store would show up
                rows[8:19] = 0
            assert c.write(layer, c.plan_write(list(lens), list(lens.values())), rows) == [0, 0]
    r.wait_visible(0)
    r.verify_admission(timeout_s=1)
    assert all(int(v) == 1 for v in w.buffer.published)  # one batched append per layer
    assert [int(v) for v in r.appends] == [1] * cfg.num_layers
    picks = [19, 0, 9, 10, 17, 3, 12, 1]
    for layer in range(cfg.num_layers):
        res = caches[1].resolve(layer, torch.tensor([5, 6], dtype=torch.int32),
                                torch.tensor([picks, [2, 0, 1] + [-1] * 5], dtype=torch.int32))
        got = caches[1].hot_rows(layer)[res.physical[0].long()]
        assert torch.equal(got, expected_rows(layer, 5, 0, 20, 32)[picks])
        got6 = caches[1].hot_rows(layer)[res.physical[1, :3].long()]
        assert torch.equal(got6, expected_rows(layer, 6, 0, 3, 32)[[2, 0, 1]])


def test_setup_single_rank_and_bad_inputs(tmp_path):
    """setup_shared_pool in a world of one (in this process): checks before any store
    traffic, a creation failure surfaces, and a good setup unlinks the name."""
    from datetime import timedelta

    import torch.distributed as dist

    from hisparse.cache.distributed import barrier, setup_shared_pool

    cfg = make_cfg()
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        setup_shared_pool(cfg)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=20))
    try:
        with pytest.raises(TypeError):
            setup_shared_pool(cfg.to_dict())
        with pytest.raises(ValueError, match="writer_rank"):
            setup_shared_pool(cfg, writer_rank=1)
        with pytest.raises(ValueError, match="not a directory"):
            setup_shared_pool(cfg, shm_dir=str(tmp_path / "missing"))
        with SharedHostPool.create(cfg, world_size=1, shm_dir=str(tmp_path), pin=False) as p:
            with pytest.raises(ValueError, match="setup_shared_pool"):
                barrier(p)
        pool = setup_shared_pool(cfg, shm_dir=str(tmp_path), pin=False, timeout_s=5)
        assert pool.is_writer and pool.world_size == 1 and not os.path.exists(pool.path)
        barrier(pool, timeout_s=5)
        pool.close()
        assert os.listdir(tmp_path) == ["store"]  # nothing left in the shm dir
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- multi-process
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_ranks(scenario: str, world: int, tmp: str, timeout_s: float = 45.0) -> dict[int, dict]:
    """Run ``world`` ranks of ``scenario``; returns each rank's result dict (by rank).
    Every child is killed at the end, whatever happened."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, HERE, scenario, str(r), str(world), tmp], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = {}
    try:
        deadline = time.monotonic() + timeout_s
        for r, p in enumerate(procs):
            try:
                logs[r] = p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"{scenario}: rank {r} still running after {timeout_s} s (a hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = {}
    for r in range(world):
        f = os.path.join(tmp, f"result-{r}.json")
        if os.path.exists(f):
            with open(f) as fh:
                results[r] = json.load(fh)
        else:
            results[r] = {"missing": True, "log": logs.get(r, b"").decode(errors="replace")[-3000:]}
    return results


@pytest.fixture
def shm_tmp():
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="hisparse-shared-pool-", dir=where) as d:
        yield d


def test_mp_share_byte_exact_and_consistent(shm_tmp):
    res = run_ranks("share", 3, shm_tmp)
    for r in range(3):
        assert res[r].get("ok"), f"rank {r}: {res[r]}"
    assert len({res[r]["inode"] for r in range(3)}) == 1  # one file, mapped by every rank
    assert len({res[r]["path"] for r in range(3)}) == 1
    assert all(res[r]["unlinked"] for r in range(3))  # name removed after every rank attached
    assert [res[r]["blocks"] for r in range(3)] == [res[0]["blocks"]] * 3
    assert res[0]["is_writer"] and not res[1]["is_writer"] and not res[2]["is_writer"]
    assert not os.path.exists(res[0]["path"])


def test_mp_config_mismatch_fails_every_rank(shm_tmp):
    res = run_ranks("mismatch", 2, shm_tmp)
    for r in range(2):
        assert res[r].get("error_type") == "ConfigMismatchError", f"rank {r}: {res[r]}"
        assert "rank 1: host_block_size: 4 != 8" in res[r]["error"]


def test_mp_killed_rank_detected(shm_tmp):
    res = run_ranks("kill", 3, shm_tmp)
    assert res[2].get("missing")  # it was SIGKILLed before writing anything
    for r in (0, 1):
        assert res[r].get("error_type") == "RankFailureError", f"rank {r}: {res[r]}"
        assert "rank 2 (pid" in res[r]["error"] and "dead" in res[r]["error"]
        assert 2 in res[r]["dead_ranks"]  # (a survivor that already exited may show too)
        assert res[r]["seconds"] < 8  # 2 s barrier timeout + store polling, on a loaded box


def test_mp_dead_writer_and_missing_rank_at_setup(shm_tmp):
    res = run_ranks("kill_writer", 2, shm_tmp)
    assert res[0].get("missing")
    assert res[1].get("error_type") == "RankFailureError", res[1]
    assert "writer rank 0" in res[1]["error"] and "is dead" in res[1]["error"]
    assert res[1]["seconds"] < 3


def test_mp_rank_never_sets_up(shm_tmp):
    res = run_ranks("no_setup", 2, shm_tmp)
    assert res[0].get("error_type") == "RankFailureError", res[0]
    assert "no setup verdict" in res[0]["error"] and "rank 1" in res[0]["error"]
    assert 1.5 <= res[0]["seconds"] < 10


# ---------------------------------------------------------------- worker side
def _worker(scenario: str, rank: int, world: int, tmp: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from hisparse.cache.distributed import barrier, setup_shared_pool

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    cfg = make_cfg()
    if scenario == "mismatch":
        if rank == 1:
            cfg = make_cfg(host_block_size=8)
        try:
            setup_shared_pool(cfg, timeout_s=20, shm_dir=tmp, pin=False)
        except Exception as e:
            return {"error_type": type(e).__name__, "error": str(e)}
        return {"error_type": None}
    if scenario == "no_setup":
        if rank == 1:
            time.sleep(2.5)  # alive, but never calls setup_shared_pool
            return {}
        t0 = time.monotonic()
        try:
            setup_shared_pool(cfg, timeout_s=2, shm_dir=tmp, pin=False)
        except Exception as e:
            return {"error_type": type(e).__name__, "error": str(e),
                    "seconds": time.monotonic() - t0}
        return {"error_type": None}

    pool = setup_shared_pool(cfg, timeout_s=20, shm_dir=tmp, pin=False, wait_timeout_s=20)
    if scenario == "kill":
        barrier(pool, timeout_s=20)
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            barrier(pool, timeout_s=2, name="after-kill")
        except RankFailureError as e:
            return {"error_type": type(e).__name__, "error": str(e),
                    "dead_ranks": pool.dead_ranks(), "seconds": time.monotonic() - t0}
        return {"error_type": None}
    if scenario == "kill_writer":
        barrier(pool, timeout_s=20)
        pool.allocator.allocate(1, 1)
        if rank == 0:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)  # dies before publishing its append
        pool.commit_append(0)
        t0 = time.monotonic()
        try:
            pool.wait_visible(0, timeout_s=20)
        except RankFailureError as e:
            return {"error_type": type(e).__name__, "error": str(e),
                    "seconds": time.monotonic() - t0}
        return {"error_type": None}

    # "share": two rounds of admissions (with a free and block reuse between them);
    # only rank 0 writes rows, late on purpose, so readers must wait for them.
    row_bytes = cfg.row_bytes
    checked = 0
    blocks_log = []
    lens = {3: 0, 5: 0}
    for rnd in range(2):
        if rnd == 1:
            barrier(pool, timeout_s=20)  # everyone done reading request 3 (not lockstep here)
            pool.allocator.free(3)
            del lens[3]
            lens[9] = 0
        for step in range(3):
            for req in list(lens):
                n = 5 if step == 0 else 1  # a prefill of 5 rows, then decode rows
                p0 = lens[req]
                need = pool.blocks_needed(req, p0 + n)
                if need:
                    blocks_log.append((req, pool.allocator.allocate(req, need)))
                for layer in range(cfg.num_layers):
                    if pool.is_writer:
                        time.sleep(0.02)
                        rows = pool.host_rows(req, torch.arange(p0, p0 + n))
                        pool.rows[layer, rows] = expected_rows(layer, req, p0, p0 + n, row_bytes)
                    pool.commit_append(layer)
                lens[req] = p0 + n
        for req, n in lens.items():
            picks = list(range(n - 1, -1, -2))[: cfg.top_k]
            for layer in range(cfg.num_layers):
                got = resolve_and_stage(pool, layer, req, picks, seq_len=n)
                want = expected_rows(layer, req, 0, n, row_bytes)[picks]
                if not torch.equal(got, want):
                    return {"ok": False, "error": f"round {rnd} layer {layer} req {req} differs"}
                checked += got.shape[0]
        pool.verify_admission(timeout_s=20)
    barrier(pool, timeout_s=20)
    out = {"ok": checked > 0, "checked": checked, "inode": pool.buffer.inode, "path": pool.path,
           "unlinked": not os.path.exists(pool.path), "blocks": blocks_log,
           "is_writer": pool.is_writer}
    pool.close()
    return out


if __name__ == "__main__":
    _scenario, _rank, _world, _tmp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        _res = _worker(_scenario, _rank, _world, _tmp)
    except BaseException as _e:  # report, never hang: the parent reads the file
        import traceback
        _res = {"ok": False, "error_type": type(_e).__name__, "error": repr(_e),
                "traceback": traceback.format_exc()[-2000:]}
    with open(os.path.join(_tmp, f"result-{_rank}.json"), "w") as _f:
        json.dump(_res, _f)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown, which can block when a peer died
