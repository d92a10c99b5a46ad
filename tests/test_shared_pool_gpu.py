"""GPU tests of the node-shared host pool: real pinned (cudaHostRegister'ed) shared memory.

- ``test_shared_pool_two_ranks_one_gpu`` (gpu): 2 ranks on one GPU, gloo.
- ``test_shared_pool_nccl_multigpu`` (multigpu): 2 ranks on 2 GPUs, NCCL.

Each rank maps the pool and pins it; rank 0 (the writer) writes rows device -> pool
on a side stream and publishes after its copy event; every rank then resolves on
its own device hot tier and stages the misses from the shared pool, byte-exact
against the rows every rank computes. Host memory: the node's ``Shmem`` (from
/proc/meminfo) grows by one pool, not one per rank. Each rank prints a JSON line.
Run this file as a script only through the tests (one subprocess per rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
POOL_TOKENS = 65536  # x 4 layers x 656 B = 172 MB, large enough to stand out in Shmem


def expected_rows(layer: int, req: int, p0: int, p1: int, row_bytes: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 [p1 - p0, row_bytes]: the rows every rank computes (same formula on any device)."""
    pos = torch.arange(p0, p1, dtype=torch.int64, device=device)[:, None]
    col = torch.arange(row_bytes, dtype=torch.int64, device=device)[None, :]
    return ((col * 3 + layer * 131 + req * 31 + pos * 7 + 1) % 256).to(torch.uint8)


def shmem_bytes() -> int:
    """Node-wide shared memory in use (tmpfs pages), /proc/meminfo 'Shmem'."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return -1


def run_ranks(scenario: str, world: int, timeout_s: float = 240.0) -> dict[int, dict]:
    with tempfile.TemporaryDirectory(prefix="hisparse-gpu-", dir="/dev/shm") as tmp:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs = [subprocess.Popen([sys.executable, HERE, scenario, str(r), str(world), tmp],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(world)]
        logs = {}
        try:
            deadline = time.monotonic() + timeout_s
            for r, p in enumerate(procs):
                try:
                    logs[r] = p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{scenario}: rank {r} still running after {timeout_s} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        out = {}
        for r in range(world):
            text = logs.get(r, b"").decode(errors="replace")
            print(f"--- rank {r} output ---\n{text[-4000:]}")
            f = os.path.join(tmp, f"result-{r}.json")
            out[r] = json.load(open(f)) if os.path.exists(f) else {"missing": True}
        return out


def check(res: dict[int, dict], world: int) -> None:
    for r in range(world):
        assert res[r].get("ok"), f"rank {r}: {res[r]}"
        assert res[r]["pinned"] and res[r]["is_pinned"], f"rank {r} pool not pinned"
        assert res[r]["checked_rows"] > 0
    assert len({res[r]["inode"] for r in range(world)}) == 1
    pool = res[0]["pool_bytes"]
    grew = res[0]["shmem_grew"]
    print(f"pool {pool / 2**20:.1f} MiB; node Shmem grew {grew / 2**20:.1f} MiB with {world} "
          f"ranks attached (one private pool per rank would be {world * pool / 2**20:.1f} MiB)")
    # one pool (plus noise from the rest of the machine), clearly not one per rank
    assert 0.9 * pool <= grew < 1.5 * pool


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu_alone  # two rank processes with timeouts
def test_shared_pool_two_ranks_one_gpu():
    check(run_ranks("gloo", 2), 2)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
def test_shared_pool_nccl_multigpu():
    check(run_ranks("nccl", 2), 2)


def _worker(backend: str, rank: int, world: int, tmp: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from hisparse.cache.resolve_ref import copy_rows_reference, resolve_reference
    from hisparse.cache.state import HotState, ResolveBuffers
    from hisparse.cache.transfer import copy_rows
    from hisparse.config import HiSparseConfig
    from hisparse.device import is_pinned_host
    from hisparse.cache.distributed import barrier, setup_shared_pool

    cuda = torch.cuda.is_available()  # (CPU: only for a dry run of this script by hand)
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    cfg = HiSparseConfig(num_layers=4, host_pool_tokens=POOL_TOKENS, row_bytes=656, top_k=256,
                         device_buffer_size=512, max_num_reqs=4, max_request_id=64,
                         host_block_size=64, device=str(dev))
    shm0 = shmem_bytes()
    t0 = time.perf_counter()
    pool = setup_shared_pool(cfg, timeout_s=120, pin=cuda, wait_timeout_s=60)
    setup_s = time.perf_counter() - t0
    if pool.creator:  # touch every page once, whether or not pinning populated them
        pool.buffer.tensor[::4096].fill_(0)
    barrier(pool, timeout_s=120, name="attached")  # every rank mapped + pinned
    shm_grew = shmem_bytes() - shm0
    gpu = torch.cuda.get_device_name(dev) if cuda else ""
    info = {"rank": rank, "device": str(dev), "gpu": gpu,
            "pinned": pool.pinned, "is_pinned": is_pinned_host(pool.rows),  # the rows, not the header page before them
            "inode": pool.buffer.inode, "pool_bytes": pool.nbytes, "shmem_grew": shm_grew,
            "setup_s": setup_s, "is_writer": pool.is_writer}

    # every rank admits the same requests and appends the same rows; rank 0 writes them
    lens = {7: 3000, 11: 1500}
    stream = torch.cuda.Stream(dev) if cuda else None
    for req, n in lens.items():
        pool.allocator.allocate(req, pool.blocks_needed(req, n))
        for layer in range(cfg.num_layers):
            event = None
            if pool.is_writer and not cuda:
                for ps, pe, h0 in pool.segments(req, 0, n):
                    pool.rows[layer, h0:h0 + pe - ps] = expected_rows(layer, req, ps, pe, 656)
            elif pool.is_writer:
                rows = expected_rows(layer, req, 0, n, cfg.row_bytes, dev)
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    for ps, pe, h0 in pool.segments(req, 0, n):
                        pool.rows[layer, h0:h0 + pe - ps].copy_(rows[ps:pe], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                rows.record_stream(stream)
            pool.commit_append(layer, event)

    if backend == "nccl":  # the TP group's collectives work alongside the shared pool
        x = torch.ones(1, device=dev)
        dist.all_reduce(x)
        info["nccl_all_reduce"] = float(x.item())
        if x.item() != world:
            return {**info, "ok": False, "error": f"all_reduce gave {x.item()}, want {world}"}

    # every rank: its own hot tier resolves (all misses) and stages from the shared pool
    checked = 0
    t1 = time.perf_counter()
    for req, n in lens.items():
        st = HotState.allocate(cfg, dev)
        st.id_to_slot[req] = 0
        st.seq_lens[:, 0] = n
        blocks = pool.allocator.blocks(req)
        st.block_table[0, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32, device=dev)
        g = torch.Generator().manual_seed(req)
        picks = torch.randperm(n, generator=g)[: cfg.top_k].to(torch.int32)
        for layer in range(cfg.num_layers):
            out = ResolveBuffers.allocate(1, cfg.top_k, dev)
            resolve_reference(st, layer, torch.tensor([req], dtype=torch.int32, device=dev),
                              picks[None].to(dev), out, max_query_len=1)
            hot = torch.zeros(cfg.hot_rows_per_layer, cfg.row_bytes, dtype=torch.uint8, device=dev)
            hot_ref = torch.zeros_like(hot)
            pool.wait_visible(layer, timeout_s=60)
            # the GPU reads the shared pinned pool over UVA (Triton), and the torch reference
            copy_rows(pool.rows[layer], out.stage_src, hot, out.stage_dst)
            copy_rows_reference(pool.rows[layer], out.stage_src, hot_ref, out.stage_dst)
            want = expected_rows(layer, req, 0, n, cfg.row_bytes)[picks.long()]
            for name, h in (("triton", hot), ("reference", hot_ref)):
                got = h[out.physical[0].long()].cpu()
                if not torch.equal(got, want):
                    bad = int((got != want).any(dim=1).sum())
                    return {**info, "ok": False,
                            "error": f"{name} staging, req {req} layer {layer}: {bad} rows differ"}
                checked += got.shape[0]
    pool.verify_admission(timeout_s=60)
    info["resolve_stage_s"] = time.perf_counter() - t1
    barrier(pool, timeout_s=120, name="done")
    pool.close()
    return {**info, "ok": True, "checked_rows": checked, "torch": torch.__version__}


if __name__ == "__main__":
    _backend, _rank, _world, _tmp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        _res = _worker(_backend, _rank, _world, _tmp)
    except BaseException as _e:  # report, never hang: the parent reads the file
        import traceback
        _res = {"ok": False, "error": repr(_e), "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(_res), flush=True)
    with open(os.path.join(_tmp, f"result-{_rank}.json"), "w") as _f:
        json.dump(_res, _f)
    os._exit(0)  # skip process-group teardown, which can block when a peer died
