"""HiSparseCache on CUDA: the random traces byte-exact, CUDA-graph capture + replay
of an unchecked resolve equal to eager, results with wait=False, and a host pool that
is really pinned and exactly the asked size. Needs a CUDA GPU (skipped without one).
"""

import random

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.cache.cache import HiSparseCache

from invariants import check_cache, check_result
from trace_runner import TraceRunner, long_trace

pytestmark = pytest.mark.gpu

SMALL = dict(num_layers=2, host_pool_tokens=48, row_bytes=16, top_k=2, device_buffer_size=4,
             max_num_reqs=3, max_query_len=2, host_block_size=2, max_request_id=6)
FP8ROWS = dict(num_layers=2, host_pool_tokens=1000, row_bytes=656, top_k=8, device_buffer_size=16,
               max_num_reqs=3, max_query_len=2, host_block_size=16, max_request_id=9)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("shape,n_big", [(SMALL, 9), (FP8ROWS, 40)])
def test_random_traces_byte_exact_on_cuda(kernels, shape, n_big):
    cache = HiSparseCache(HiSparseConfig(device="cuda", **shape), kernels=kernels)
    print(f"kernels={kernels} -> {cache.kernels}, pool pinned={cache.pool.pinned}")
    if kernels == "auto":
        assert cache.kernels == "triton", cache.kernels
    for seed in range(2):
        runner = TraceRunner(cache if seed == 0 else
                             HiSparseCache(HiSparseConfig(device="cuda", **shape), kernels=kernels),
                             seed=seed)
        long_trace(runner, random.Random(seed), 150, n_big=n_big, token_appends=False)
        tot = runner.cache.stats()["total"]
        print(f"seed {seed}: {tot} capacity_errors={runner.capacity_errors}")
        assert tot["misses"] > 0 and tot["hits"] > 0


def test_host_pool_is_pinned_and_exact_size():
    cfg = HiSparseConfig(device="cuda", **FP8ROWS)  # 2 x 992 x 656 bytes: no power of two
    cache = HiSparseCache(cfg)
    pool = cache.pool
    assert pool.pinned is True
    assert pool.rows.is_pinned() and pool.buffer.tensor.is_pinned()
    assert pool.rows.shape == (2, cfg.num_host_rows, 656)
    assert pool.nbytes == cfg.host_pool_bytes == 2 * 992 * 656
    assert pool.buffer.tensor.untyped_storage().nbytes() == cfg.host_pool_bytes
    assert cache.stats()["host_pool"]["pinned"] is True


def test_a_released_pool_is_refused_before_any_launch():
    """The Triton kernels reach the pool over UVA: once it is released (unpinned), a
    resolve and a write raise ValueError and change nothing."""
    cfg = HiSparseConfig(device="cuda", **FP8ROWS)
    cache = _build(cfg, [40, 7])
    ids = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    topk = torch.full((2, cfg.top_k), -1, dtype=torch.int32, device="cuda")
    topk[0, :3] = torch.tensor([39, 0, 5])
    topk[1, :2] = torch.tensor([6, 1])
    cache.resolve(0, ids, topk)
    torch.cuda.synchronize()
    cache.pool.release()
    before, lens = _state(cache), [cache.request(r).lengths[0] for r in (0, 1)]
    with pytest.raises(ValueError, match="not pinned"):
        cache.resolve(0, ids, topk)
    with pytest.raises(ValueError, match="not pinned"):
        cache.resolve(1, ids, topk, validate=False)
    with pytest.raises(ValueError, match="not pinned"):
        cache.write(0, 1, torch.zeros((1, cfg.row_bytes), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    after = _state(cache)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert [cache.request(r).lengths[0] for r in (0, 1)] == lens


def _build(cfg, lens, seed=0):
    """A cache with requests 0..len(lens)-1 holding ``lens[i]`` random rows per layer."""
    cache = HiSparseCache(cfg)
    g = torch.Generator().manual_seed(seed)
    for rid, n in enumerate(lens):
        cache.add_request(rid)
        for layer in range(cfg.num_layers):
            rows = torch.randint(0, 256, (n, cfg.row_bytes), dtype=torch.uint8, generator=g)
            cache.write(layer, rid, rows.cuda())
    return cache


def _steps(ids, lens, K, n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = []
        for rid in ids:
            rows.append([rng.randrange(lens[rid]) if rng.random() > 0.15 else -1 for _ in range(K)])
        out.append(rows)
    return out


def _state(cache):
    st = cache.state
    return {k: getattr(st, k).clone() for k in
            ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot",
             "step", "stats")}


def test_graph_replay_of_unchecked_resolve_equals_eager():
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=4096, row_bytes=656, top_k=64,
                         device_buffer_size=128, max_num_reqs=4, max_query_len=2,
                         host_block_size=16, max_request_id=64, device="cuda")
    lens = [300, 100, 50]  # request 2 fits the hot buffer (never misses)
    ids = [0, 0, 1, 2, 2]
    steps = _steps(ids, lens, cfg.top_k, 6, seed=5)
    eager, graphed, warm = _build(cfg, lens), _build(cfg, lens), _build(cfg, lens)
    assert graphed.kernels == "triton"
    ids_t = torch.tensor(ids, dtype=torch.int32, device="cuda")
    static_topk = torch.tensor(steps[0], dtype=torch.int32, device="cuda")
    # compile the kernels outside capture, on a third cache with the same shapes
    warm.resolve(0, ids_t, static_topk, validate=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res_g = graphed.resolve(0, ids_t, static_topk, validate=False)
    torch.cuda.synchronize()
    assert graphed.stats()["total"]["resolves"] == 0  # capture ran nothing
    for i, step in enumerate(steps):
        if i == 3:  # an eager append between replays: both caches, then join the backup
            rows = torch.randint(0, 256, (3, cfg.row_bytes), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(i)).cuda()
            for c in (eager, graphed):
                c.write(0, 1, rows)
            graphed.streams.join_backup()
        static_topk.copy_(torch.tensor(step, dtype=torch.int32))
        graph.replay()
        res_e = eager.resolve(0, ids_t, torch.tensor(step, dtype=torch.int32, device="cuda"),
                              validate=False)
        torch.cuda.synchronize()
        assert torch.equal(res_g.physical, res_e.physical), f"step {i}"
        assert torch.equal(res_g.valid_counts, res_e.valid_counts), f"step {i}"
        se, sg = _state(eager), _state(graphed)
        for k in se:
            assert torch.equal(se[k], sg[k]), f"step {i}: state {k} differs"
        assert torch.equal(eager.hot, graphed.hot), f"step {i}: hot rows differ"
        check_result(graphed, 0, ids, step, res_g)
        check_cache(graphed)
    tot = graphed.stats()["total"]
    print(f"graph replay: {tot}")
    assert tot["resolves"] == 3 * len(steps) and tot["misses"] > 0


def test_wait_false_results_of_two_layers_stay_valid():
    cfg = HiSparseConfig(device="cuda", **FP8ROWS)
    lens = [70, 20]
    cache = _build(cfg, lens, seed=1)
    ids = [0, 1, 1]
    s0, s1 = _steps(ids, lens, cfg.top_k, 2, seed=9)
    ids_t = torch.tensor(ids, dtype=torch.int64, device="cuda")  # int64 ids accepted
    r0 = cache.resolve(0, ids_t, torch.tensor(s0, dtype=torch.int32, device="cuda"), wait=False)
    r1 = cache.resolve(1, ids_t, torch.tensor(s1, dtype=torch.int32, device="cuda"), wait=False)
    assert r0.event is not None and r1.event is not None
    r0.wait()
    r1.wait(torch.cuda.current_stream())
    torch.cuda.synchronize()
    check_result(cache, 0, ids, s0, r0)
    check_result(cache, 1, ids, s1, r1)
    check_cache(cache)


def test_split_runs_on_cuda_equal_reference():
    """Unchecked batches where requests appear in several runs, on CUDA where the
    programs of one launch run concurrently: the Triton kernel must equal the reference
    (only the first run of a request is resolved, so there is nothing to race on)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # any pytest import mode
    from resolve_common import assert_same, make_state, new_buffers

    from hisparse.cache.resolve_ref import resolve_reference
    from hisparse.cache.resolve_launch import resolve_triton

    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=16 * 700, row_bytes=16, top_k=8,
                         device_buffer_size=24, max_num_reqs=40, max_query_len=2, host_block_size=16,
                         max_request_id=64, device="cuda")
    rng = random.Random(7)
    seqs = {rid: rng.choice([5, 24, 25, 90, 200]) for rid in range(1, 41)}
    tri = make_state(cfg, seqs, torch.device("cuda"), rng, holes=0.2)
    ref = tri.clone()
    for step in range(20):
        req, rows = [], []
        for _ in range(rng.randint(1, 300)):  # many short runs of few ids: lots of repeats
            rid = rng.choice(list(seqs)[:rng.choice([3, 40])])
            for _ in range(rng.randint(1, 3)):
                req.append(rid)
                rows.append([rng.randrange(seqs[rid]) if rng.random() > 0.1 else -1 for _ in range(8)])
        req_t = torch.tensor(req, dtype=torch.int32, device="cuda")
        topk_t = torch.tensor(rows, dtype=torch.int32, device="cuda")
        layer = step % 2
        oa, ob = new_buffers(len(req), 8, torch.device("cuda")), new_buffers(len(req), 8, torch.device("cuda"))
        resolve_triton(tri, layer, req_t, topk_t, ob, max_query_len=2, compact=step % 3 == 0)
        resolve_reference(ref, layer, req_t, topk_t, oa, max_query_len=2, compact=step % 3 == 0)
        torch.cuda.synchronize()
        assert_same(ref, tri, oa, ob, msg=f"split runs step {step} T={len(req)}")
    print(f"split runs on cuda: stats {tri.stats.sum(0).tolist()}")


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_batched_write_equals_per_request_writes_on_cuda(kernels):
    """The batched write path (row-copy kernel to pinned host over UVA) leaves the same
    state, hot rows and host rows as per-request writes."""
    cfg = HiSparseConfig(device="cuda", **FP8ROWS)
    a, b = HiSparseCache(cfg, kernels=kernels), HiSparseCache(cfg, kernels=kernels)
    g = torch.Generator().manual_seed(3)
    for c in (a, b):
        for rid in (1, 4, 7):
            c.add_request(rid)
    for step, counts in enumerate([[10, 3, 0], [1, 1, 1], [9, 2, 30], [1, 0, 1], [2, 2, 2]]):
        for layer in range(cfg.num_layers):
            rows = torch.randint(0, 256, (sum(counts), cfg.row_bytes), dtype=torch.uint8, generator=g).cuda()
            firsts = a.write(layer, a.plan_write([1, 4, 7], counts), rows)
            t0, want = 0, []
            for rid, n in zip((1, 4, 7), counts):
                want.append(b.write(layer, rid, rows[t0:t0 + n])[0])
                t0 += n
            assert firsts == want, (step, layer)
    torch.cuda.synchronize()
    sa, sb = _state(a), _state(b)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"state {k} differs"
    assert torch.equal(a.hot, b.hot)
    for rid in (1, 4, 7):
        for layer in range(cfg.num_layers):
            n = a.request(rid).lengths[layer]
            assert torch.equal(a.read_host_rows(layer, rid, list(range(n))),
                               b.read_host_rows(layer, rid, list(range(n))))
    check_cache(a)
    print(f"a planned batch's write on cuda ({a.kernels}): equal to per-request writes")
