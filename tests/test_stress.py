"""The stress tool: trace sources, the trace file, row contents, verification.

CPU runs are tiny; the GPU-marked tests at the end run a large size on the H200.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from hisparse import CapacityError, HiSparseCache
from hisparse_tools import preflight
from hisparse_tools.stress import StressOptions, StressRun, row_content, run_stress
from hisparse_tools.stress_report import format_stress
from hisparse_tools.sources import CorrelatedSource, IndexerSource, UniformSource, sample_distinct
from hisparse_tools.traces import ReplaySource, TraceRecorder, load_trace

TINY = dict(num_requests=3, context=300, num_layers=2, top_k=16, buffer_size=32, steps=10,
            churn=0.2, progress=False, device="cpu", block_size=16)


def _check_topk(tk, lens, K):
    assert tk.dtype == torch.int32 and tk.shape == (len(lens), K)
    for row, n in zip(tk.tolist(), lens):
        valid = [p for p in row if p >= 0]
        assert len(valid) == min(K, n), (row, n)
        assert len(set(valid)) == len(valid)
        assert all(0 <= p < n for p in valid)
        assert row[len(valid):] == [-1] * (K - len(valid))  # padding at the end


def test_sample_distinct_excludes_and_pads():
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([0, 1, 5, 100])
    out = sample_distinct(lens, 8, g)
    _check_topk(out, [0, 1, 5, 100], 8)
    ex = torch.tensor([[-1, -1], [0, -1], [0, 1], [3, 4]], dtype=torch.int32)
    out = sample_distinct(lens, 8, g, exclude=ex)
    assert out[1].tolist() == [-1] * 8
    assert sorted(p for p in out[2].tolist() if p >= 0) == [2, 3, 4]
    assert not ({3, 4} & set(out[3].tolist()))
    assert sample_distinct(torch.zeros(0, dtype=torch.int64), 4, g).shape == (0, 4)


@pytest.mark.parametrize("src", ["uniform", "correlated", "indexer"])
def test_sources_valid(src):
    K = 8
    mk = {"uniform": lambda: UniformSource(top_k=K, seed=1),
          "correlated": lambda: CorrelatedSource(top_k=K, drift=0.25, seed=1),
          "indexer": lambda: IndexerSource(top_k=K, max_context=64, drift=0.25, seed=1)}[src]
    s = mk()
    ids = torch.tensor([0, 5, 9])
    for step, lens in enumerate([[3, 20, 8], [4, 21, 9], [5, 22, 10]]):
        tk = s.select(0, ids, torch.tensor(lens), step)
        _check_topk(tk, lens, K)


def test_correlated_drift_controls_overlap():
    def overlap(drift):
        s = CorrelatedSource(top_k=64, drift=drift, seed=3)
        ids, lens = torch.tensor([0]), torch.tensor([4096])
        a = set(s.select(0, ids, lens, 0)[0].tolist())
        b = set(s.select(0, ids, lens + 1, 1)[0].tolist())
        return len(a & b) / 64

    assert overlap(0.0) == 1.0
    assert 0.75 <= overlap(0.1) < 1.0
    assert overlap(1.0) < 0.2
    with pytest.raises(ValueError, match="drift"):
        CorrelatedSource(top_k=4, drift=1.5)


def test_correlated_refills_padding_and_forgets_dropped():
    s = CorrelatedSource(top_k=4, drift=0.0, seed=0)
    ids = torch.tensor([1])
    a = s.select(0, ids, torch.tensor([2]), 0)
    assert sorted(a[0].tolist()) == [-1, -1, 0, 1]
    b = s.select(0, ids, torch.tensor([10]), 1)
    assert set(a[0].tolist()) - {-1} <= set(b[0].tolist()) and -1 not in b[0].tolist()
    s.drop(1)
    assert not s._prev


def test_replay_of_traces_with_empty_steps(tmp_path):
    """A recorder writes steps with no request (e.g. an engine's idle step): a replay
    runs through them, and a trace with no request at all is refused by name."""
    rec = TraceRecorder(num_layers=1, top_k=4)
    rec.begin_step([], [])
    rec.add_layer(0, np.zeros((0, 4), dtype=np.int32))
    rec.begin_step([0], [30])
    rec.add_layer(0, [[0, 1, 2, 29]])
    p = tmp_path / "first_empty.npz"
    rec.save(p)
    r = run_stress(StressOptions(trace="replay", replay=str(p), device="cpu", kernels="torch", progress=False))
    assert r["ok"] and r["overall"]["misses"] == 0  # a 30-row context fits the buffer
    empty = TraceRecorder(num_layers=1, top_k=4)
    empty.begin_step([], [])
    empty.add_layer(0, np.zeros((0, 4), dtype=np.int32))
    q = tmp_path / "empty.npz"
    empty.save(q)
    with pytest.raises(ValueError, match="no request in any"):
        run_stress(StressOptions(trace="replay", replay=str(q), device="cpu", kernels="torch", progress=False))


def test_trace_file_roundtrip_and_validation(tmp_path):
    rec = TraceRecorder(num_layers=2, top_k=3)
    rec.begin_step([4, 7], [5, 9])
    rec.add_layer(0, np.array([[0, 1, -1], [8, 2, 3]]))
    rec.add_layer(1, torch.tensor([[4, -1, -1], [0, 1, 2]], dtype=torch.int32))
    rec.begin_step([7], [10])
    rec.add_layer(0, [[9, 8, 7]])
    rec.add_layer(1, [[1, 2, 3]])
    p = tmp_path / "t.npz"
    rec.save(p)
    meta, steps = load_trace(p)
    assert meta == {"format": "hisparse-trace", "version": 1, "num_layers": 2, "top_k": 3,
                    "num_steps": 2}
    assert steps[0].req_ids.tolist() == [4, 7] and steps[1].seq_lens.tolist() == [10]
    assert steps[0].topk[1, 0].tolist() == [8, 2, 3]
    src = ReplaySource(p)
    assert src.select(1, torch.tensor([7]), torch.tensor([10]), 1).tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="differs"):
        src.select(0, torch.tensor([4]), torch.tensor([10]), 1)
    with pytest.raises(ValueError, match="shape"):
        rec.add_layer(0, [[1, 2]])
    # malformed files
    bad = tmp_path / "bad.npz"
    np.savez(bad, meta=np.array('{"format": "other", "version": 1}'), step_offsets=np.zeros(1),
             req_ids=np.zeros(0), seq_lens=np.zeros(0), topk=np.zeros((0, 1, 1)))
    with pytest.raises(ValueError, match="format"):
        load_trace(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.npz")
    z = dict(np.load(p))
    z["topk"] = z["topk"].copy()
    z["topk"][0, 0, 0] = 99  # >= seq_len 5
    np.savez(tmp_path / "oob.npz", **z)
    with pytest.raises(ValueError, match="outside"):
        load_trace(tmp_path / "oob.npz")


def _good_trace(path):
    rec = TraceRecorder(num_layers=1, top_k=2)
    rec.begin_step([0], [3])
    rec.add_layer(0, [[0, 2]])
    rec.save(path)
    return dict(np.load(path))


def test_trace_saved_under_exactly_the_given_name(tmp_path):
    _good_trace(tmp_path / "trace.bin")
    assert (tmp_path / "trace.bin").exists() and not (tmp_path / "trace.bin.npz").exists()
    assert load_trace(tmp_path / "trace.bin")[0]["num_steps"] == 1


@pytest.mark.parametrize("write, msg", [
    (lambda p: p.write_text('{"format": "hisparse-trace"}'), r"is not a \.npz trace: it is not a zip archive"),
    (lambda p: p.write_text("step,req\n0,1\n"), r"is not a \.npz trace: it is not a zip archive"),
    (lambda p: p.write_bytes(b""), "it is an empty file"),
    (lambda p: np.save(open(p, "wb"), np.zeros(3)), "a single .npy array"),
])
def test_trace_file_that_is_not_an_npz(tmp_path, write, msg):
    p = tmp_path / "t.npz"
    write(p)
    with pytest.raises(ValueError, match=msg) as e:
        load_trace(p)
    assert "pickled" not in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize("change, msg", [
    (dict(meta=np.array("{not json")), r"key 'meta' is not valid JSON"),
    (dict(meta=np.array('["a list"]')), r"key 'meta' must be a JSON object"),
    (dict(meta=np.array('{"format": "hisparse-trace", "version": 1, "num_layers": 1, "num_steps": 1}')),
     r"meta lacks 'top_k'"),
    (dict(meta=np.array('{"format": "hisparse-trace", "version": 1, "num_layers": "1", "top_k": 2, '
                        '"num_steps": 1}')), r"meta 'num_layers' must be an int, got str"),
    (dict(meta=np.array(3)), r"key 'meta' must be a 0-d string"),
    (dict(topk=np.array([[[0.0, 2.0]]])), r"key 'topk' has dtype float64; expected integers"),
    (dict(seq_lens=np.array([3.0])), r"key 'seq_lens' has dtype float64"),
    (dict(topk=np.zeros((1, 1, 3), np.int32)), r"key 'topk' has shape \(1, 1, 3\), expected"),
    (dict(step_offsets=np.array([0, 2])), r"key 'step_offsets' must rise from 0 to 1"),
    (dict(req_ids=np.array([-1])), r"key 'req_ids' has ids outside"),
    (dict(meta=np.array([object()], dtype=object)), r"key 'meta' holds pickled Python objects"),
])
def test_trace_file_messages_name_the_file_and_key(tmp_path, change, msg):
    z = _good_trace(tmp_path / "good.npz")
    z.update(change)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **z)
    with pytest.raises(ValueError, match=msg) as e:
        load_trace(bad)
    assert str(bad) in str(e.value)


def test_row_content_deterministic_and_distinct():
    pos = torch.arange(6)
    inst = torch.tensor([0, 0, 0, 1, 1, 1])
    a = row_content(0, 0, inst, pos, 32)
    assert a.dtype == torch.uint8 and a.shape == (6, 32)
    assert torch.equal(a, row_content(0, 0, inst, pos, 32))
    assert len({bytes(r.tolist()) for r in a}) == 6
    assert not torch.equal(a, row_content(0, 1, inst, pos, 32))  # layer matters
    assert not torch.equal(a, row_content(1, 0, inst, pos, 32))  # seed matters
    # bytes look random: every byte value range is used
    big = row_content(0, 0, torch.zeros(64, dtype=torch.int64), torch.arange(64), 656)
    assert big.unique().numel() > 250


def _result_fields(r):
    assert set(r) >= {"ok", "failures", "device", "config", "workload", "overall", "per_layer",
                      "per_step"}
    assert set(r["overall"]) >= {"hit_rate", "optimal_hit_rate", "bytes_h2d", "h2d_GBps",
                                 "step_ms_p50", "step_ms_p99", "host_pool_bytes",
                                 "host_rss_peak_bytes", "gpu_peak_bytes", "rows_verified"}


def test_small_run_passes_and_optimum_bounds_lru():
    r = run_stress(StressOptions(**TINY))
    _result_fields(r)
    assert r["ok"], r["failures"]
    ov = r["overall"]
    assert ov["rows_verified"] > 0
    assert ov["hits"] + ov["misses"] > 0 and ov["misses"] > 0
    assert ov["optimal_hit_rate"] >= ov["hit_rate"]
    for d in r["per_layer"]:
        assert d["optimal_hit_rate"] >= d["hit_rate"]
    assert r["workload"]["joined"] > 3 and r["workload"]["left"] > 0  # churn happened
    assert len(r["per_step"]["step_ms"]) == 10
    assert "RESULT: PASS" in format_stress(r)


def test_the_result_records_every_option_that_shapes_the_run():
    """Two runs that differ in any option (--unchecked and --context-min among them) are
    told apart by their result: JSON and text."""
    o = StressOptions(**{**TINY, "context_min": 100, "checked": False, "optimal": False,
                         "prefill_chunk": 64, "steps": 3, "verify": "all", "kernels": "torch"})
    r = run_stress(o)
    assert r["ok"]
    fields = {f.name for f in dataclasses.fields(StressOptions)} - {"progress"}  # progress: output only
    assert set(r["options"]) == fields
    assert StressOptions(**r["options"], progress=False) == o  # the run can be repeated from its result
    json.dumps(r["options"])  # and it is plain JSON
    w = r["workload"]
    assert w["context_min"] == 100 and w["checked"] is False
    text = format_stress(r)
    for part in ("context=100..300", "resolve=unchecked", "verify=all", "prefill_chunk=64",
                 "belady=off", f"seed={o.seed}", f"churn={o.churn}"):
        assert part in text, (part, text)
    default = run_stress(StressOptions(**{**TINY, "steps": 3}))
    assert default["workload"]["context_min"] == TINY["context"] // 2 and default["workload"]["checked"]
    assert "resolve=checked" in format_stress(default) and "belady=on" in format_stress(default)


def test_context_that_fits_never_misses():
    r = run_stress(StressOptions(**{**TINY, "context": 20, "steps": 5}))
    assert r["ok"] and r["overall"]["misses"] == 0
    assert r["overall"]["hit_rate"] == 1.0 == r["overall"]["optimal_hit_rate"]


def corrupt_after_resolve(monkeypatch, *, at_resolve: int, layer: int = 0):
    """Make the ``at_resolve``-th resolve of ``layer`` (0-based, counted over the run) leave
    a wrong byte in the hot row of its first valid entry, through public calls only
    (``resolve``'s result and ``hot_rows``): a stand-in for a resolve/staging bug."""
    orig = HiSparseCache.resolve
    seen = {"n": 0, "hit": None}

    def resolve(self, lyr, req_ids, topk, **kw):
        res = orig(self, lyr, req_ids, topk, **kw)
        if lyr == layer:
            if seen["n"] == at_resolve:
                valid = (res.physical >= 0).nonzero()
                if valid.shape[0]:
                    p = int(res.physical[valid[0, 0], valid[0, 1]])
                    self.hot_rows(lyr)[p, 0] ^= 0xFF
                    seen["hit"] = p
            seen["n"] += 1
        return res

    monkeypatch.setattr(HiSparseCache, "resolve", resolve)
    return seen


@pytest.mark.parametrize("verify", ["all", 64])
def test_corrupted_row_fails_the_run(monkeypatch, verify):
    seen = corrupt_after_resolve(monkeypatch, at_resolve=2)
    kw = {**TINY, "verify": verify, "churn": 0.0}
    if verify != "all":
        kw["top_k"] = 4  # 3 requests x 4 entries <= 64: every entry sampled
    r = run_stress(StressOptions(**kw))
    assert seen["hit"] is not None
    assert not r["ok"]
    assert "differs from the expected bytes" in r["failures"][0]
    assert f"hot row {seen['hit']} " in r["failures"][0]
    assert r["workload"]["steps_run"] == 3  # stopped at the failing step
    assert "RESULT: FAIL" in format_stress(r)


def test_verify_none_cannot_see_corruption(monkeypatch):
    # documents what --verify none means: the same corruption passes unseen
    seen = corrupt_after_resolve(monkeypatch, at_resolve=2)
    r = run_stress(StressOptions(**{**TINY, "verify": "none"}))
    assert seen["hit"] is not None
    assert r["ok"] and r["overall"]["rows_verified"] == 0


def test_wrong_host_copy_fails_the_run(monkeypatch):
    """A host copy that differs (read_host_rows returning a flipped byte) is caught too."""
    orig = HiSparseCache.read_host_rows

    def read_host_rows(self, layer, req_id, positions):
        out = orig(self, layer, req_id, positions).clone()
        out[0, 5] ^= 0x01
        return out

    monkeypatch.setattr(HiSparseCache, "read_host_rows", read_host_rows)
    r = run_stress(StressOptions(**{**TINY, "verify": "all"}))
    assert not r["ok"] and "host copy" in r["failures"][0]
    assert r["workload"]["steps_run"] == 1


def test_on_step_sees_every_step_and_the_cache_stats():
    seen = []
    run = StressRun(StressOptions(**{**TINY, "steps": 4}))
    r = run.run(lambda done, stats: seen.append((done, stats["total"]["hits"] + stats["total"]["misses"])))
    assert [d for d, _ in seen] == [1, 2, 3, 4]
    assert seen[-1][1] == r["overall"]["hits"] + r["overall"]["misses"]


def test_memory_too_large_is_a_capacity_error_before_allocation(monkeypatch):
    # a hot buffer of 1 TB (K = 1e8, S = 2K): refused up front, whatever the machine
    with pytest.raises(CapacityError, match=r"needs \d+ bytes .*hot buffers and slot state \d+\.\d\d GiB"):
        StressRun(StressOptions(**{**TINY, "top_k": 100_000_000, "buffer_size": None}))
    monkeypatch.setattr(preflight, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(CapacityError, match=r"needs \d+ bytes .* of host memory \(host pool .* "
                                            r"but 1048576 bytes"):
        StressRun(StressOptions(**TINY))


def test_replay_file_and_a_generated_trace_conflict(tmp_path):
    with pytest.raises(ValueError, match="conflict"):
        StressOptions(**{**TINY, "trace": "uniform", "replay": str(tmp_path / "t.npz")})


def test_record_then_replay_is_identical(tmp_path):
    path = str(tmp_path / "trace.npz")
    a = run_stress(StressOptions(**{**TINY, "trace": "uniform", "record": path}))
    b = run_stress(StressOptions(**{**TINY, "trace": "replay", "replay": path, "seed": 5}))
    assert a["ok"] and b["ok"]
    for k in ("hits", "misses", "optimal_hit_rate"):
        assert a["overall"][k] == b["overall"][k]
    assert a["workload"]["joined"] == b["workload"]["joined"]


def test_indexer_and_bf16_run():
    r = run_stress(StressOptions(**{**TINY, "trace": "indexer", "row_format": "bf16", "steps": 4}))
    assert r["ok"] and r["config"]["row_bytes"] == 1152


@pytest.mark.parametrize("kw, msg", [
    (dict(num_requests=0), "num_requests"),
    (dict(trace="zipf"), "trace"),
    (dict(trace="replay"), "replay"),
    (dict(verify="some"), "verify"),
    (dict(churn=2.0), "churn"),
    (dict(context_min=500), "context_min"),
    (dict(row_format="fp4"), "row format"),
    (dict(trace="uniform", drift=0.2), "drift does not apply"),  # not silently ignored
])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        run_stress(StressOptions(**{**TINY, **kw}))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.gpu_alone  # checks the host's and the GPU's free memory before it allocates
def test_gpu_stress_large():
    """16 requests x 32K context x 2 layers, K = 2048, S = 4096 on the GPU, sampled verify."""
    r = run_stress(StressOptions(num_requests=16, context=32 * 1024, num_layers=2, top_k=2048,
                                 buffer_size=4096, steps=20, verify=512, device="cuda",
                                 progress=False))
    print(format_stress(r))
    assert r["ok"], r["failures"]
    assert r["kernels"] == "triton"
    assert 0 < r["overall"]["hit_rate"] <= r["overall"]["optimal_hit_rate"]


@pytest.mark.gpu
def test_gpu_corruption_detected(monkeypatch):
    seen = corrupt_after_resolve(monkeypatch, at_resolve=1)
    r = run_stress(StressOptions(**{**TINY, "device": "cuda", "verify": "all"}))
    assert seen["hit"] is not None and not r["ok"]


def test_replay_of_the_mini_engine_indexer_reproduces_its_cache_counters(tmp_path):
    """Stress driven by the mini engine's real indexer (recorded with ``--record``): the
    replay passes byte verification and sees exactly the hits and misses the engine's
    own hisparse run saw (same trace, buffer and LRU rules)."""
    from hisparse_tools import mini_engine as me

    path = str(tmp_path / "engine.npz")
    res = me.run(me.MiniEngineConfig(), record=path)
    assert res["trace"]["decode_steps"] > 3 and res["compare"]["bitwise_equal"]
    engine = res["hisparse"]["cache"]
    r = run_stress(StressOptions(replay=path, trace="replay", device="cpu", top_k=8,
                                 block_size=me.MiniEngineConfig().host_block_size))
    assert r["ok"], r
    tot = r["overall"]
    assert (tot["hits"], tot["misses"]) == (engine["hits"], engine["misses"]), (tot, engine)
    assert engine["misses"] > 0  # the trace really overflows the hot buffer


def _shared_trace(tmp_path):
    """A recorded uniform trace rewritten so that layer 1 selects what layer 0 does."""
    src = str(tmp_path / "uniform.npz")
    assert run_stress(StressOptions(**{**TINY, "trace": "uniform", "record": src}))["ok"]
    meta, steps = load_trace(src)
    rec = TraceRecorder(num_layers=meta["num_layers"], top_k=meta["top_k"])
    for st in steps:
        rec.begin_step(st.req_ids, st.seq_lens)
        for layer in range(meta["num_layers"]):
            rec.add_layer(layer, st.topk[:, 0])
    path = str(tmp_path / "shared.npz")
    rec.save(path)
    return path


def test_prefetch_of_a_shared_selection_is_exact(tmp_path):
    path = _shared_trace(tmp_path)
    plain = run_stress(StressOptions(**{**TINY, "trace": "replay", "replay": path}))
    r = run_stress(StressOptions(**{**TINY, "trace": "replay", "replay": path, "prefetch": True}))
    assert plain["ok"] and r["ok"] and "prefetch" not in plain
    q, l1 = r["prefetch"], r["per_layer"][1]
    assert l1["misses"] == 0 and plain["per_layer"][1]["misses"] > 0  # appends ran before: nothing left
    assert q["rows_staged"] == q["useful_rows"] == q["net_rows_saved"] == plain["per_layer"][1]["misses"] > 0
    assert q["precision"] == q["recall"] == 1.0 and q["wasted_bytes"] == 0 and q["misses_added"] == 0
    rb = r["config"]["row_bytes"]
    assert l1["bytes_h2d"] == q["rows_staged"] * rb and l1["prefetch_rows"] == q["rows_staged"]
    assert r["overall"]["bytes_h2d"] == plain["overall"]["bytes_h2d"]  # the same rows, staged earlier
    assert r["overall"]["step_ms_p50_with_prefetch"] > 0
    text = format_stress(r)
    assert "precision 1.0000" in text and "prefetched rows" in text


def test_prefetch_of_an_independent_selection_is_mostly_wasted():
    """Three layers of independent uniform selections: every layer after the first gets a
    prefetch; few of its rows are selected, and some it evicts are then missed."""
    r = run_stress(StressOptions(**{**TINY, "num_layers": 3, "trace": "uniform", "prefetch": True}))
    q = r["prefetch"]
    assert r["ok"] and q["rows_staged"] > 0 and q["precision"] < 0.2 and q["recall"] < 0.2
    assert [d["layer"] for d in q["per_layer"]] == [1, 2] and all(d["rows_staged"] > 0 for d in q["per_layer"])
    assert q["misses_added"] > 0 and q["net_rows_saved"] == q["useful_rows"] - q["misses_added"]
    assert q["wasted_bytes"] == (q["rows_staged"] - q["useful_rows"]) * r["config"]["row_bytes"] > 0
    assert sum(d["prefetch_rows"] for d in r["per_layer"]) == q["rows_staged"]
    with pytest.raises(TypeError, match="prefetch"):
        StressOptions(**{**TINY, "prefetch": 1})
