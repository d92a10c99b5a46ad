"""Autotune: budget arithmetic, the batch search, CPU timing, and the stale-key check."""

import json

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse_tools.autotune import (AutotuneOptions, _make_cfg, candidates, device_key, format_autotune,
                                     gpu_bytes, load_tuned_config, max_fit, pool_fit, run_autotune, save_result)

TINY = dict(num_layers=2, top_k=8, context=40, num_heads=2, steps=2, warmup=1, max_candidates=3,
            block_size=16, max_request_id=64, progress=False, device="cpu")


def test_gpu_bytes_hand_computed():
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=64, row_bytes=16, top_k=4,
                         device_buffer_size=8, max_num_reqs=3, host_block_size=16,
                         max_request_id=10, device="cpu")
    g = gpu_bytes(cfg, num_heads=2, reserve_frac=0.5)
    assert g["hot_rows"] == 2 * 64 * 16  # 3 x 9 rows per layer, rounded up to 64
    # slot_pos (int32) + slot_stamp (int64), step (int64), seq_lens, block_table (3 x 4 blocks),
    # row_slot (2 x 64), the block-id map (4 ids), id_to_slot, stats (7 counters), residency
    # flags (3) and a page table of one column (no pool)
    assert g["slot_state"] == (2 * 3 * 9 * 12 + 2 * 3 * 8 + 2 * 3 * 4 + 3 * 4 * 4 + 2 * 64 * 4 + 4 * 4 + 10 * 4
                               + 2 * 7 * 8 + 3 * 4 + 3 * 1 * 4)
    # per layer and once more for prefetches: physical + stage src/dst (T x K x 12) + counts,
    # plus the one undo log (T x K x 20)
    assert g["resolve_buffers"] == 3 * (3 * 4 * 12 + 3 * 4) + 3 * 4 * 20
    assert g["attention_io"] == 3 * 2 * (1152 + 1024 + 4)
    raw = g["hot_rows"] + g["slot_state"] + g["resolve_buffers"] + g["attention_io"]
    assert g["reserve"] == raw // 2 and g["total"] == raw + raw // 2


@pytest.mark.parametrize("pool_rows", [None, 64 + 3 * 64])
def test_gpu_bytes_matches_the_real_cache_allocation(pool_rows):
    """The formula's cache part equals the bytes of the tensors HiSparseCache allocates
    (every tensor of its state; with and without an elastic pool)."""
    import dataclasses

    from hisparse import HiSparseCache

    cfg = HiSparseConfig(num_layers=3, host_pool_tokens=256, row_bytes=32, top_k=4,
                         device_buffer_size=8, max_num_reqs=5, host_block_size=16,
                         max_request_id=40, device="cpu", device_pool_rows=pool_rows)
    c = HiSparseCache(cfg, kernels="torch")
    st = c.state
    tensors = [getattr(st, f.name) for f in dataclasses.fields(st)]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    seen, bufs = set(), 0
    for b in c._bufs + [c._prefetch_out]:
        for t in (b.physical, b.valid_counts, b.stage_src, b.stage_dst, b.undo_hit, b.undo_vpos, b.undo_vstamp):
            if t.data_ptr() not in seen:  # the undo log is shared
                seen.add(t.data_ptr())
                bufs += t.numel() * t.element_size()
    g = gpu_bytes(cfg, num_heads=1)
    assert g["hot_rows"] == c.hot.numel()
    assert g["slot_state"] == state_bytes
    assert g["resolve_buffers"] == bufs


def test_max_fit_is_the_exact_boundary():
    o = AutotuneOptions(**TINY)
    need = {R: gpu_bytes(_make_cfg(o, R, "cpu"), num_heads=2, reserve_frac=o.reserve_frac)["total"]
            for R in (1, 6, 7)}
    assert max_fit(o, need[6], "cpu") == 6
    assert max_fit(o, need[7] - 1, "cpu") == 6
    assert max_fit(o, need[7], "cpu") == 7
    assert max_fit(o, need[1] - 1, "cpu") == 0
    assert max_fit(o, 1 << 40, "cpu") == 64  # capped by request ids (max_request_id=64)
    big = AutotuneOptions(**{**TINY, "max_request_id": 1 << 16})
    assert max_fit(big, 1 << 40, "cpu") == 1024  # the default cap (max_reqs)


def test_host_budget_and_cap_bound_the_search():
    o = AutotuneOptions(**TINY)
    pool = {R: _make_cfg(o, R, "cpu").host_pool_bytes for R in (3, 4)}
    assert max_fit(o, 1 << 40, "cpu", host_budget=pool[3]) == 3
    assert max_fit(o, 1 << 40, "cpu", host_budget=pool[4] - 1) == 3
    assert max_fit(AutotuneOptions(**{**TINY, "max_reqs": 5}), 1 << 40, "cpu") == 5
    r = run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": 1 << 30, "host_memory": pool[3]}))
    assert r["max_fit_reqs"] == 3 and r["budget"]["max_fit_bound"] == "host_memory"


def test_multi_token_decode_runs():
    o = AutotuneOptions(**{**TINY, "max_query_len": 2, "max_reqs": 2, "gpu_memory": 1 << 30})
    r = run_autotune(o)
    assert r["budget"]["max_fit_bound"] == "max_reqs" and r["max_fit_reqs"] == 2
    assert r["config"]["max_query_len"] == 2


def test_candidates():
    assert candidates(1, 4) == [1]
    assert candidates(6, 10) == [1, 2, 4, 6]
    c = candidates(100, 3)
    assert c[0] == 1 and c[-1] == 100 and len(c) == 3


def test_cpu_run_and_roundtrip(tmp_path):
    o = AutotuneOptions(**TINY)
    budget = gpu_bytes(_make_cfg(o, 5, "cpu"), num_heads=2, reserve_frac=o.reserve_frac)["total"]
    r = run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": budget}))
    assert r["max_fit_reqs"] == 5
    assert [m["num_reqs"] for m in r["measurements"]] == [1, 4, 5]
    assert r["max_num_reqs"] in (1, 4, 5)
    assert r["timings_are"].startswith("CPU timings")
    assert r["backend"] == "reference"
    assert r["key"] == device_key("cpu")
    for m in r["measurements"]:
        assert 0 < m["step_ms_min"] <= m["step_ms_p50"] <= m["step_ms_p99"]
        assert m["tokens_per_s"] > 0
    best = max(r["measurements"], key=lambda m: m["tokens_per_s"])
    assert r["max_num_reqs"] == best["num_reqs"]
    path = tmp_path / "tuned.json"
    save_result(r, path)
    cfg = load_tuned_config(path)
    assert cfg.max_num_reqs == r["max_num_reqs"] and cfg.top_k == 8 and cfg.device == "cpu"


def test_latency_limit_filters():
    o = AutotuneOptions(**TINY)
    budget = gpu_bytes(_make_cfg(o, 2, "cpu"), num_heads=2, reserve_frac=o.reserve_frac)["total"]
    with pytest.raises(CapacityError, match="latency"):
        run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": budget, "latency_ms": 1e-6}))
    r = run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": budget, "latency_ms": 1e6}))
    assert all(m["within_latency"] for m in r["measurements"])


def test_budget_too_small_and_missing_budget():
    with pytest.raises(CapacityError, match="not even one request"):
        run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": 1000}))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--gpu-memory"):
            run_autotune(AutotuneOptions(**TINY))


def _write(path, **changes):
    o = AutotuneOptions(**TINY)
    d = {"format": "hisparse-autotune", "version": 1, "key": device_key("cpu"),
         "config": _make_cfg(o, 2, "cpu").to_dict()}
    d.update(changes)
    path.write_text(json.dumps(d))
    return path


def test_stale_key_rejected(tmp_path):
    ok = _write(tmp_path / "ok.json")
    assert load_tuned_config(ok, expect_gpu="cpu").max_num_reqs == 2
    with pytest.raises(ValueError, match="stale.*device_name: tuned with 'cpu', here 'NVIDIA H200'"):
        load_tuned_config(ok, expect_gpu="NVIDIA H200")
    old = _write(tmp_path / "old.json", key={**device_key("cpu"), "torch": "1.0"})
    with pytest.raises(ValueError, match="stale.*torch: tuned with '1.0'"):
        load_tuned_config(old, expect_gpu="cpu")
    with pytest.raises(ValueError, match="not a hisparse-autotune"):
        load_tuned_config(_write(tmp_path / "x.json", format="other"))
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_tuned_config(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_tuned_config(tmp_path / "none.json")


@pytest.mark.parametrize("kw, msg", [
    (dict(num_layers=0), "num_layers"), (dict(reserve_frac=1.0), "reserve_frac"),
    (dict(latency_ms=-1.0), "latency_ms"), (dict(gpu_memory=-5), "gpu_memory"),
    (dict(row_format="x"), "row format"), (dict(warmup=-1), "warmup"),
])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": 1 << 16, **kw}))


@pytest.mark.gpu
@pytest.mark.gpu_alone  # sized against the GPU's free memory
def test_gpu_autotune_small_budget(tmp_path):
    o = AutotuneOptions(num_layers=2, top_k=2048, context=8192, num_heads=128, steps=5, warmup=2,
                        max_candidates=3, gpu_memory=2 << 30, progress=False, device="cuda")
    r = run_autotune(o)
    print(json.dumps({k: r[k] for k in ("max_num_reqs", "max_fit_reqs", "backend", "measurements")},
                     indent=1))
    assert r["timings_are"].startswith("GPU")
    assert r["max_fit_reqs"] >= 1
    save_result(r, tmp_path / "t.json")
    assert load_tuned_config(tmp_path / "t.json").max_num_reqs == r["max_num_reqs"]


def test_progress_names_the_batch_being_timed_before_it_finishes(monkeypatch, capsys):
    """The first candidate can take minutes on a CPU: the progress line names it before
    its timing starts, not only once it is done."""
    import hisparse_tools.autotune as at

    seen = []
    real = at.time_batch

    def spy(o, R, device):
        seen.append(capsys.readouterr().err)  # what stderr showed when the timing began
        return real(o, R, device)

    monkeypatch.setattr(at, "time_batch", spy)
    o = AutotuneOptions(**TINY)
    budget = gpu_bytes(_make_cfg(o, 5, "cpu"), num_heads=2, reserve_frac=o.reserve_frac)["total"]
    run_autotune(AutotuneOptions(**{**TINY, "gpu_memory": budget, "progress": True}))
    assert "timing R=1 (1 of 3)" in seen[0], seen


def test_status_on_a_terminal_clears_the_longer_line_it_replaces():
    """The plain bar redraws in place: a status line shorter than the bar before it must
    not leave the bar's tail on screen."""
    import io

    from hisparse_tools.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    p = Progress(3, "autotune", stream=out)
    p._rich = None  # the plain bar, whether or not rich is installed
    p.update(1, note="R=1 p50 12.34 ms")
    p.status("timing R=2")
    last = out.getvalue().split("\r")[-1]
    assert last.startswith("autotune 1/3 timing R=2") and last.endswith("\x1b[K"), repr(last)


# ------------------------------------------------------------------ the device pool
def test_pool_fit_is_the_exact_boundary():
    """The largest pool at R requests: R's hot buffers (rounded up to 64) plus whole pages
    of 64 rows, the most whose cache still fits the budget."""
    o = AutotuneOptions(**TINY)  # S = 16: 17 rows a request; 3 requests -> 64 hot-buffer rows

    def need(rows):
        return gpu_bytes(_make_cfg(o, 3, "cpu", rows), num_heads=2, reserve_frac=o.reserve_frac)["total"]

    assert pool_fit(o, 3, need(64 + 5 * 64), "cpu") == 64 + 5 * 64
    assert pool_fit(o, 3, need(64 + 6 * 64) - 1, "cpu") == 64 + 5 * 64
    assert pool_fit(o, 3, need(64 + 64) - 1, "cpu") is None  # not even one page
    assert need(64 + 5 * 64) - gpu_bytes(_make_cfg(o, 3, "cpu"), num_heads=2, reserve_frac=0.05)["total"] > 0


def test_autotune_reports_the_pool_and_auto_puts_it_in_the_config(tmp_path):
    o = AutotuneOptions(**{**TINY, "max_reqs": 2, "max_candidates": 1})
    budget = gpu_bytes(_make_cfg(o, 2, "cpu", 64 + 10 * 64), num_heads=2, reserve_frac=o.reserve_frac)["total"]
    plain = run_autotune(AutotuneOptions(**{**TINY, "max_reqs": 2, "max_candidates": 1, "gpu_memory": budget}))
    p = plain["pool"]
    assert p["asked"] is None and p["rows"] is None and plain["config"]["device_pool_rows"] is None
    assert p["fit_rows"] == 64 + 10 * 64 and p["fit_pages"] == 10 and p["timed"] is False
    assert "room for a device pool of 704 rows per layer" in format_autotune(plain)
    assert "`--pool-rows auto` puts it in the config" in format_autotune(plain)
    auto = run_autotune(AutotuneOptions(**{**TINY, "max_reqs": 2, "max_candidates": 1, "gpu_memory": budget,
                                           "pool_rows": "auto"}))
    a = auto["pool"]
    assert a["rows"] == a["fit_rows"] == auto["config"]["device_pool_rows"] == 704 and a["pages"] == 10
    assert auto["budget"]["at_chosen"]["total"] <= budget < auto["budget"]["at_chosen"]["total"] + 2 * 64 * 656
    text = format_autotune(auto)
    assert "device_pool_rows=704" in text and "the timed steps ran without the pool" in text
    save_result(auto, tmp_path / "t.json")
    assert load_tuned_config(tmp_path / "t.json").device_pool_rows == 704


def test_a_fixed_pool_bounds_the_batch():
    """--pool-rows N: the cache has N rows per layer and the search leaves the pool a page:
    with 17 hot rows a request, 11 requests' hot buffers (187 -> 192 rows) leave a 256-row
    pool one page, 12 (204 -> 256) none."""
    o = AutotuneOptions(**{**TINY, "pool_rows": 256})
    assert max_fit(o, 1 << 30, "cpu") == 11
    r = run_autotune(AutotuneOptions(**{**TINY, "pool_rows": 256, "gpu_memory": 1 << 30, "max_candidates": 1}))
    assert r["max_fit_reqs"] == 11 and r["budget"]["max_fit_bound"] == "pool_rows"
    assert r["config"]["device_pool_rows"] == 256 and r["pool"]["rows"] == 256 and r["pool"]["pages"] == 1
    with pytest.raises(ValueError, match=r"pool_rows=100 leaves no page past one request's hot buffer .* at least 128"):
        AutotuneOptions(**{**TINY, "pool_rows": 100})
    with pytest.raises(CapacityError, match="--pool-rows"):
        run_autotune(AutotuneOptions(**{**TINY, "pool_rows": 1 << 20, "gpu_memory": 1 << 20}))
