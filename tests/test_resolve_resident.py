"""The resident resolve path of the elastic tier (``HiSparseCache.resident_resolve``,
``kernels/resolve_resident.py`` and its torch reference), on CPU.

The one-launch resident resolve against the full resolve (``resolve_reference``) on
the same state, over randomized batches with awkward lengths, query groups, padding,
out-of-range entries, ids that are not live, repeated runs and offsets past
max_query_len, compacted or not: identical physical rows, valid counts, staging lists
and counters, and no LRU state touched (torch reference and Triton kernel under the
interpreter). Then which path a call takes (every live request resident, eagerly or
inside ``resident_capture``), the refusals, ``DecodeLayer`` on that path (serial and
split, bitwise equal), and the per-layer graphs keyed by the path over a trace whose
pool overflows.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from graph_trace import Runner, TraceShape, Truth, plan_trace, run_pair
from hisparse import HiSparseConfig
from hisparse.attention.reference import ReferenceBackend
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.resolve_ref import resolve_reference
from hisparse.cache.state import ResolveBuffers
from hisparse.decode import DecodeLayer
from hisparse.formats import RowFormat, quantize_fp8_ds_mla_reference
from invariants import check_cache, check_result

I32 = torch.int32
PB = 64


def pooled(pages: int, **kw) -> HiSparseConfig:
    base = dict(num_layers=2, host_pool_tokens=1024, row_bytes=16, top_k=8, device_buffer_size=24,
                max_num_reqs=4, max_query_len=3, host_block_size=4, max_request_id=12, device="cpu")
    base.update(kw)
    probe = HiSparseConfig(**base)
    base["device_pool_rows"] = probe.hot_rows_per_layer + pages * PB
    return HiSparseConfig(**base)


def _rows(n: int, seed: int, width: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


def _batch(rng: random.Random, c: HiSparseCache, layer: int, Q: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of groups of the live requests (each up to Q tokens; sometimes more, a
    repeated run, an id that is not live, one out of range), each token with valid
    positions, -1 padding and out-of-range entries."""
    live = c.live_requests()
    ids: list[int] = []
    for rid in rng.sample(live, len(live)):
        ids += [rid] * rng.randint(1, Q + (1 if rng.random() < 0.2 else 0))
    if rng.random() < 0.4:
        ids += [rng.choice(live)]  # a second run of a request: not resolved
    if rng.random() < 0.4:
        ids.insert(rng.randrange(len(ids) + 1), 11)  # an id that is not live
    if rng.random() < 0.2:
        ids.insert(rng.randrange(len(ids) + 1), 40)  # past max_request_id
    topk = []
    for rid in ids:
        n = c.request(rid).lengths[layer] if c.requests.is_live(rid) else 5
        row = []
        for _ in range(K):
            u = rng.random()
            row.append(-1 if u < 0.15 else (n + rng.randint(0, 9) if u < 0.22 else
                       (-rng.randint(2, 5) if u < 0.25 else rng.randrange(max(n, 1)))))
        topk.append(row)
    return torch.tensor(ids, dtype=I32), torch.tensor(topk, dtype=I32)


@pytest.mark.parametrize("kernels,seed", [("torch", 0), ("torch", 1), ("torch", 2), ("triton", 3), ("triton", 4)])
def test_resident_resolve_equals_the_full_resolve(kernels, seed):
    rng = random.Random(seed)
    c = HiSparseCache(pooled(pages=12), kernels=kernels)
    for i, rid in enumerate((3, 7, 0, 9)):
        c.add_request(rid)
        for layer in range(2):  # lengths differ per layer; across page boundaries
            n = rng.choice([1, 5, 63, 64, 65, 130]) + layer
            c.write(layer, rid, _rows(n, 100 * i + layer))
    assert c.graphs.all_resident() and c.graphs.resident_resolve()
    Q, K = c.cfg.max_query_len, c.cfg.top_k
    for it in range(6):
        layer = it % 2
        ids, topk = _batch(rng, c, layer, Q, K)
        compact = it % 3 == 2
        T = ids.numel()
        want_state = copy.deepcopy(c.state)
        want = ResolveBuffers.allocate(T, K, torch.device("cpu"))
        resolve_reference(want_state, layer, ids, topk, want, max_query_len=Q, compact=compact)
        before = copy.deepcopy(c.state)
        got = ResolveBuffers.allocate(T, K, torch.device("cpu"))
        c.kernel_set.resolve_resident(c.state, layer, ids, topk, got, max_query_len=Q, compact=compact)
        assert torch.equal(got.physical, want.physical)
        assert torch.equal(got.valid_counts, want.valid_counts)
        assert torch.equal(got.stage_src[:T * K], want.stage_src[:T * K])
        assert torch.equal(got.stage_dst[:T * K], want.stage_dst[:T * K])
        assert torch.equal(got.stage_counts[:T], want.stage_counts[:T])
        assert torch.equal(c.state.stats, want_state.stats)
        for name in ("slot_pos", "slot_stamp", "row_slot", "step", "seq_lens", "page_table", "resident"):
            assert torch.equal(getattr(c.state, name), getattr(before, name)), name
        assert int(c.state.stats[layer, 6]) > 0  # STAT_RESIDENT: the batch had resident rows
    check_cache(c)


def test_a_live_hot_request_on_the_resident_kernel_gets_no_rows_and_is_counted():
    c = HiSparseCache(pooled(pages=4), kernels="torch")
    c.add_request(1)
    c.write(0, 1, _rows(10, 0))
    c.state.resident[0] = 0  # host and device disagree (what the path's choice rules out)
    out = c._bufs[0].view(1, 8)
    inv0 = int(c.state.stats[0, 2])
    c.kernel_set.resolve_resident(c.state, 0, torch.tensor([1], dtype=I32), torch.tensor([[0, 1, -1, 2, 3, 4, 5, 6]],
                         dtype=I32), out, max_query_len=3, compact=False)
    assert out.physical.tolist() == [[-1] * 8] and out.valid_counts.tolist() == [0]
    assert int(c.state.stats[0, 2]) - inv0 == 7


def _fill(c: HiSparseCache, rid: int, n: int) -> None:
    c.add_request(rid)
    for layer in range(c.cfg.num_layers):
        c.write(layer, rid, _rows(n, rid * 10 + layer))
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_path_follows_residency(kernels, monkeypatch):
    # 3 pages: two requests of 64 rows resident; a third of 100 rows needs 2 pages, so
    # the one holding the most pages (ties: the lowest slot) is demoted
    c = HiSparseCache(pooled(pages=3), kernels=kernels)
    full = []
    real_run = c.stager.run
    monkeypatch.setattr(c.stager, "run", lambda *a, **k: full.append(a[0]) or real_run(*a, **k))
    _fill(c, 1, 64)
    _fill(c, 2, 64)
    ids, tk = torch.tensor([1, 2], dtype=I32), torch.tensor([[0, 63, 5, -1, 1, 2, 3, 4]] * 2, dtype=I32)
    res = c.resolve(0, ids, tk)
    assert res.event is None and full == []  # the resident path: no staging, no event
    check_result(c, 0, [1, 2], tk.tolist(), res)
    _fill(c, 3, 100)
    assert {r: c.residency(r) for r in (1, 2, 3)} == {1: "hot", 2: "resident", 3: "resident"}
    assert not c.graphs.all_resident() and not c.graphs.resident_resolve()
    res = c.resolve(0, torch.tensor([3, 2], dtype=I32), tk)
    assert full == [0]  # a hot request is live: the full path, even for a batch of resident ones
    check_result(c, 0, [3, 2], tk.tolist(), res)
    c.free_request(1)
    assert c.graphs.all_resident()
    res = c.resolve(1, torch.tensor([2, 3], dtype=I32), tk, compact=True)
    assert full == [0]
    check_result(c, 1, [2, 3], tk.tolist(), res, compact=True)
    check_cache(c)


def test_resident_capture_and_its_refusals():
    c = HiSparseCache(pooled(pages=1), kernels="torch")
    with c.graphs.resident_capture():  # no live request: nothing is hot
        assert c.graphs.resident_resolve()
    _fill(c, 1, 64)
    _fill(c, 2, 64)  # one page: the first is demoted
    with pytest.raises(ValueError, match=r"resident_capture: 1 live request\(s\) are hot; a resident resolve "
                                         "would give them no rows"):
        with c.graphs.resident_capture():
            pass
    assert not c.graphs._resident_capture
    nopool = HiSparseCache(HiSparseConfig(num_layers=1, host_pool_tokens=64, row_bytes=16, top_k=2,
                                          device_buffer_size=4, max_num_reqs=2, device="cpu"), kernels="torch")
    assert not nopool.graphs.all_resident() and not nopool.graphs.resident_resolve()
    with pytest.raises(ValueError, match=r"no device pool: cfg.device_pool_rows is None"):
        with nopool.graphs.resident_capture():
            pass


def _fp8_rows(n: int, seed: int) -> torch.Tensor:
    """Valid fp8_ds_mla rows (656 bytes): fp8 values and finite fp32 scales."""
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_ds_mla_reference((torch.randn((n, 576), generator=g) * 0.5).to(torch.bfloat16))


def test_decode_layer_on_the_resident_path_serial_equals_split():
    cfg = pooled(pages=6, row_bytes=656, max_query_len=2)
    c = HiSparseCache(cfg, kernels="torch")
    for rid, n in ((4, 70), (6, 130)):
        c.add_request(rid)
        c.write(0, rid, _fp8_rows(n, rid))
    assert c.graphs.resident_resolve()
    be = ReferenceBackend()
    g = torch.Generator().manual_seed(1)
    q = (torch.randn((3, 16, 576), generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.tensor([4, 4, 6], dtype=I32)
    tk = torch.tensor([[0, 69, 3, -1, 64, 65, 1, 2], [5, 6, 7, 8, 9, 10, 11, 12],
                       [129, 0, 64, 128, -1, -1, 3, 100]], dtype=I32)
    sm = 576 ** -0.5
    outs = {m: DecodeLayer(c, be, overlap=m)(0, ids, tk, q, sm_scale=sm) for m in ("serial", "split")}
    assert torch.equal(outs["serial"][0], outs["split"][0]) and torch.equal(outs["serial"][1], outs["split"][1])
    layer = DecodeLayer(c, be, overlap="split")
    launch = layer.begin(0, ids, tk, num_heads=16)
    o, lse = layer.finish(launch, q, sm_scale=sm)
    assert torch.equal(o, outs["serial"][0]) and torch.equal(lse, outs["serial"][1])
    # the same attention over the rows the full resolve gives (hot rows, after a demotion)
    ref = be.decode(q, c.hot_rows(0), c.resolve(0, ids, tk).physical, sm_scale=sm, row_format=RowFormat.FP8_DS_MLA)
    assert torch.equal(ref[0], o)
    launch = layer.begin(0, ids, tk, num_heads=16)
    c.write(0, 6, _fp8_rows(1, 9))
    with pytest.raises(ValueError, match="appended to, resolved or freed since begin"):
        layer.finish(launch, q, sm_scale=sm)


@pytest.mark.parametrize("kernels,stand_in,seed", [("torch", "recording", 11), ("triton", "kernels", 12)])
def test_layer_graphs_replay_the_graph_of_the_path(kernels, stand_in, seed):
    """Per-layer graphs over a trace whose pool overflows: the conversions replay graphs
    of both paths, and every step equals the eager run."""
    shape = TraceShape(pool_rows=128 + 2 * 64)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=10 if kernels == "triton" else 30, seed=seed)
    a = Runner(shape, "eager", "cpu", kernels, truth)
    b = Runner(shape, "padded", "cpu", kernels, truth, layer_graphs=stand_in)
    run_pair(trace, a, b)
    b.check_rows()
    keys = [k for k in b.group._layer_graphs.graphs if k[0] == "convert"]
    assert {k[6] for k in keys} == {True, False}, keys  # graphs of both paths were captured
    tot = b.group.stats()["total"]
    assert tot["resident_rows"] > 0 and tot["spills"] > 0, tot
    assert tot == a.group.stats()["total"]
