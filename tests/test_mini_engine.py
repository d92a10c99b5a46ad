"""The mini engine on CPU: resident KV vs hisparse give the same outputs token by token.

Tiny sizes (2 layers, 2 heads, top-k 8, a hot buffer of 16 slots for contexts up to 48
tokens), so misses happen; requests arrive every 2 steps, prefill in chunks of 16 and
decode 3-8 steps each.
"""

from __future__ import annotations

import json

import pytest
import torch

from hisparse import CapacityError
from hisparse_tools import mini_engine as me


def test_resident_and_hisparse_match_fp8():
    cfg = me.MiniEngineConfig()
    res = me.run(cfg)
    c = res["compare"]
    reqs = me.make_workload(cfg)
    assert c["tokens_compared"] == sum(r.total for r in reqs)
    assert c["within_tolerance"], c
    assert c["argmax_mismatches"] == 0
    # the same rows are gathered in the same order, so the outputs are identical
    assert c["bitwise_equal"], c
    cache = res["hisparse"]["cache"]
    assert cache["misses"] > 0 and 0.0 < cache["hit_rate"] < 1.0, cache
    assert cache["bytes_h2d"] == cache["misses"] * 656
    assert cache["invalid"] == 0
    assert res["resident"]["tokens"] == res["hisparse"]["tokens"] == c["tokens_compared"]
    assert res["hisparse"]["tokens_per_s"] > 0 and res["ratio"]["tokens_per_s_hisparse_over_resident"] > 0
    text = me.format_report(res)
    assert "hit rate" in text and "WITHIN" in text


def test_resident_and_hisparse_match_bf16_mixed_arrivals():
    cfg = me.MiniEngineConfig(row_format="bf16", num_requests=5, num_heads=3, arrival_every=1, chunk=7,
                              max_batch_tokens=24, min_prompt=17, max_prompt=30, seed=3, locality=0.0)
    res = me.run(cfg)
    assert res["compare"]["within_tolerance"] and res["compare"]["bitwise_equal"], res["compare"]
    assert res["hisparse"]["cache"]["misses"] > 0


def test_synthetic_context_fill():
    cfg = me.MiniEngineConfig(num_requests=3, synthetic_context=12, min_prompt=20, max_prompt=24, min_decode=2,
                              max_decode=3)
    res = me.run(cfg)
    c = res["compare"]
    assert c["within_tolerance"] and c["bitwise_equal"], c
    # positions written synthetically are not compared (no output there)
    reqs = me.make_workload(cfg)
    assert c["tokens_compared"] == sum(r.total - 12 for r in reqs)


def test_a_wrong_row_is_detected(monkeypatch):
    """The comparison can fail: shift hisparse's physical indices by one row."""
    orig = me.HiSparseKV.decode_rows

    def shifted(self, layer, topk, batch):  # CPU: no stream to wait for before reading phys
        rows, phys = orig(self, layer, topk, batch)
        return rows, torch.where(phys >= 0, (phys + 1) % rows.shape[0], phys)

    monkeypatch.setattr(me.HiSparseKV, "decode_rows", shifted)
    cfg = me.MiniEngineConfig(num_requests=2, min_prompt=20, max_prompt=24, min_decode=3, max_decode=3)
    res = me.run(cfg)
    assert not res["compare"]["bitwise_equal"]
    assert not res["compare"]["within_tolerance"]


def test_cli_main_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = me.main(["--requests", "2", "--max-prompt", "24", "--max-decode", "3", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    for key in ("config", "compare", "resident", "hisparse", "ratio"):
        assert key in d
    assert d["config"]["num_requests"] == 2
    assert "tok/s" in capsys.readouterr().out
    assert me.main(["--requests", "2", "--max-prompt", "24", "--max-decode", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compare"]["within_tolerance"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="FlashMLA is refused for want of CUDA")
def test_named_decode_backend_that_cannot_run_is_an_error_not_a_fallback(capsys):
    rc = me.main(["--requests", "2", "--max-prompt", "24", "--max-decode", "3", "--backend", "flashmla"])
    err = capsys.readouterr().err
    assert rc == 2 and "backend 'flashmla' cannot run the decode here" in err and "Traceback" not in err
    assert "needs a CUDA device" in err  # FlashMLA's own reason


@pytest.mark.parametrize("kw, msg", [
    (dict(num_layers=0), "num_layers"), (dict(min_prompt=10, max_prompt=5), "min_prompt"),
    (dict(locality=1.0), "locality"), (dict(row_format="int4"), "row format"),
    (dict(synthetic_context=30), "synthetic_context"), (dict(max_batch_tokens=2), "max_batch_tokens"),
    (dict(tolerance=-1.0), "tolerance must be >= 0"), (dict(device="tpu"), "device must be"),
    (dict(cache_kernels="cuda"), "cache_kernels"),
])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        me.MiniEngineConfig(**kw)


def test_buffer_smaller_than_a_step_is_a_capacity_error():
    """The cache's own rule (``HiSparseConfig``), checked when the config is made."""
    with pytest.raises(CapacityError, match="device_buffer_size"):
        me.MiniEngineConfig(device_buffer_size=4)


@pytest.mark.parametrize("kw", [dict(tolerance=float("nan")), dict(num_heads=2.0), dict(validate=1)])
def test_bad_config_types(kw):
    with pytest.raises(TypeError):
        me.MiniEngineConfig(**kw)


def test_memory_needed_counts_the_big_parts():
    cfg = me.MiniEngineConfig()
    host, device = me.memory_needed(cfg)
    assert device == {}  # CPU: everything is host memory
    assert host["host pool"] == cfg.cache_config().host_pool_bytes
    assert host["indexer keys"] == 2 * (4 + 1) * cfg.max_context * 16 * 4  # + the padding slot
    assert host["prefill workspace"] == 4 * cfg.max_context * 576 * 2


def test_engine_calls_go_through_the_kv_interface(monkeypatch):
    """The loop reaches rows only through KVStore.stage_decode + decode_attention /
    prefill_attention: a store that answers those calls decides what attention sees."""
    calls = {"stage": 0, "decode": 0, "prefill": 0}
    orig_s = me.KVStore.stage_decode
    orig_d, orig_p = me.KVStore.decode_attention, me.KVStore.prefill_attention

    def stage(self, layer, topk, batch):
        calls["stage"] += 1
        return orig_s(self, layer, topk, batch)

    def decode(self, layer, q, topk, batch, staged):
        calls["decode"] += 1
        out = orig_d(self, layer, q, topk, batch, staged)
        assert out.shape == (q.shape[0], q.shape[1], 512) and out.dtype == torch.bfloat16
        return out

    def prefill(self, layer, q, idx, batch):
        calls["prefill"] += 1
        return orig_p(self, layer, q, idx, batch)

    monkeypatch.setattr(me.KVStore, "stage_decode", stage)
    monkeypatch.setattr(me.KVStore, "decode_attention", decode)
    monkeypatch.setattr(me.KVStore, "prefill_attention", prefill)
    cfg = me.MiniEngineConfig(num_requests=2, min_prompt=20, max_prompt=24, min_decode=2, max_decode=2)
    res = me.run(cfg)
    assert res["compare"]["bitwise_equal"]
    assert calls["decode"] > 0 and calls["prefill"] > 0
    # both stores decode the same layers; the resident store runs KVStore.stage_decode,
    # the hisparse one its own override (serial: it calls decode_rows, not the base method)
    # but the base decode_attention through super()
    assert calls["stage"] == calls["decode"] // 2


def test_presets_parse():
    args = me.build_parser().parse_args(["--preset", "h200", "--requests", "4", "--unchecked"])
    cfg = me.config_from_args(args)
    assert cfg.num_layers == 8 and cfg.top_k == 2048 and cfg.num_requests == 4 and cfg.validate is False
    assert cfg.cache_config().device_buffer_size == 4096


def test_multi_token_decode_within_buffer():
    """q = 2 decode tokens per request per step (MTP), contexts within the hot buffer."""
    cfg = me.MiniEngineConfig(query_len=2, top_k=8, device_buffer_size=64, num_requests=3, min_prompt=20,
                              max_prompt=30, min_decode=2, max_decode=4)
    res = me.run(cfg)
    assert res["compare"]["within_tolerance"] and res["compare"]["bitwise_equal"], res["compare"]
    assert res["hisparse"]["cache"]["invalid"] == 0


def test_multi_token_decode_beyond_buffer():
    """q = 2 (MTP) with contexts beyond the hot buffer: a decode token attends to the
    other new row of its step, which sits beyond the buffer and is not the newest (host
    only), so it is staged by the resolve of the layer that just wrote it (per-layer
    lengths)."""
    cfg = me.MiniEngineConfig(query_len=2, top_k=8, device_buffer_size=16, num_requests=2, min_prompt=20,
                              max_prompt=30, min_decode=2, max_decode=4, locality=0.0)
    assert cfg.max_context > 16
    res = me.run(cfg)
    assert res["compare"]["within_tolerance"] and res["compare"]["bitwise_equal"], res["compare"]
    cache = res["hisparse"]["cache"]
    assert cache["invalid"] == 0 and cache["misses"] > 0, cache


def test_triton_cache_kernels_in_interpreter():
    """The cache's Triton resolve and row-copy kernels (interpreted on CPU) give the same outputs."""
    cfg = me.MiniEngineConfig(num_requests=2, min_prompt=20, max_prompt=26, min_decode=2, max_decode=3,
                              cache_kernels="triton")
    res = me.run(cfg)
    assert res["compare"]["bitwise_equal"], res["compare"]
    assert res["hisparse"]["cache"]["misses"] > 0


def test_report_flags_outlier_steps():
    """A step 10x over the median (a kernel compiling) is called out, since it makes the
    tokens/s comparison meaningless."""
    from hisparse_tools.mini_engine import format_report

    def run(outliers):
        step = {"n": 3, "min_ms": 1.0, "median_ms": 1.0, "p99_ms": 900.0}
        return {"tokens": 3, "steps": 3, "time_s": 0.9, "tokens_per_s": 3.3, "step": step,
                "decode_step": step, "outlier_steps": outliers, "outlier_s": 0.9 * outliers,
                "backend": {"decode": "reference", "prefill": "reference"}}

    res = {"compare": {"tokens_compared": 3, "max_abs_diff": 0.0, "max_rel_diff": 0.0,
                       "argmax_mismatches": 0, "bitwise_equal": True, "within_tolerance": True},
           "resident": run(1), "hisparse": run(0),
           "ratio": {"tokens_per_s_hisparse_over_resident": 1.0,
                     "decode_step_median_hisparse_over_resident": 1.0}}
    res["hisparse"]["cache"] = {"hit_rate": 1.0, "hits": 1, "misses": 0, "bytes_h2d": 0,
                                "bytes_d2h": 0, "invalid": 0}
    text = format_report(res)
    assert "WARNING: resident had 1 step(s) over 10x the median" in text
    assert "WARNING: hisparse" not in text


# ------------------------------------------------------------------ prefix reuse
PREFIX = dict(shared_prefix=18, prefix_groups=2, num_requests=4, min_prompt=20, max_prompt=34, min_decode=2,
              max_decode=4)


@pytest.mark.parametrize("slots", [1, None])  # one request at a time; all four at once
def test_prefix_reuse_serves_a_shared_prefix_batch_with_the_same_outputs(slots):
    """Four requests in two groups sharing an 18-token prefix (one block of 16): with
    prefix reuse hisparse computes each prompt from its cached blocks on and gives the
    outputs of the resident run (which computes everything) on every position both
    computed; the positions it skipped are the cached tokens."""
    cfg = me.MiniEngineConfig(**PREFIX, prefix_reuse=True, max_num_reqs=slots)
    res = me.run(cfg)
    c, cache = res["compare"], res["hisparse"]["cache"]
    assert c["bitwise_equal"] and c["argmax_mismatches"] == 0, c
    assert cache["prefix_hit_tokens"] > 0 and cache["prefix_hit_tokens"] % 16 == 0, cache
    assert c["tokens_skipped"] == cache["prefix_hit_tokens"]
    reqs = me.make_workload(cfg)
    assert cache["prefix_query_tokens"] == sum(r.prompt_len for r in reqs)
    assert c["tokens_compared"] == sum(r.total for r in reqs) - c["tokens_skipped"]
    assert res["hisparse"]["tokens"] == res["resident"]["tokens"] - c["tokens_skipped"]
    assert all(bool((r.tokens[:18] == reqs[r.rid % 2].tokens[:18]).all()) for r in reqs)
    assert "prefix reuse:" in me.format_report(res) and "cached ones not computed" in me.format_report(res)


def test_prefix_reuse_with_the_elastic_tier_shares_device_pages_with_the_same_outputs():
    """All four requests at once with a device pool: the second of each group joins
    resident on the first's prefix pages (a partial page, copied device to device), so
    nothing misses, and the outputs are the resident run's, bit for bit."""
    res = me.run(me.MiniEngineConfig(**PREFIX, prefix_reuse=True, device_pool_rows=2048))
    c, cache = res["compare"], res["hisparse"]["cache"]
    assert c["bitwise_equal"] and c["argmax_mismatches"] == 0, c
    assert cache["prefix_hit_tokens"] > 0 and cache["prefix_resident_joins"] == 2, cache
    assert cache["misses"] == 0 and cache["resident_rows"] > 0, cache


def test_prefix_reuse_on_and_off_give_the_same_hisparse_outputs():
    on = me.MiniEngineConfig(**PREFIX, prefix_reuse=True, max_num_reqs=1)
    a = me.run_engine(on, "hisparse")
    b = me.run_engine(me.MiniEngineConfig(**PREFIX, max_num_reqs=1), "hisparse")
    c = me.compare(on, a, b)
    assert c["bitwise_equal"] and c["tokens_skipped"] > 0, c
    assert b["stats"]["total"]["prefix_query_tokens"] == 0  # off: no token ids given


@pytest.mark.parametrize("kw, msg", [
    (dict(shared_prefix=20), "shared_prefix=20 does not fit the prompts"),
    (dict(prefix_groups=2), "prefix_groups=2 has no effect without shared_prefix"),
    (dict(prefix_reuse=True, synthetic_context=4), "prefix_reuse and synthetic_context"),
    (dict(shared_prefix=-1), "shared_prefix"),
])
def test_prefix_reuse_bad_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        me.MiniEngineConfig(**kw)


def test_prefix_reuse_counts_the_indexer_keys_it_keeps():
    host, _ = me.memory_needed(me.MiniEngineConfig(**PREFIX, prefix_reuse=True))
    assert host["indexer keys of cached prompt blocks"] == 2 * 4 * 34 * 16 * 4
    assert "indexer keys of cached prompt blocks" not in me.memory_needed(me.MiniEngineConfig(**PREFIX))[0]


def test_prefix_reuse_flags():
    args = me.build_parser().parse_args(["--prefix-reuse", "--shared-prefix", "18", "--prefix-groups", "2"])
    cfg = me.config_from_args(args)
    assert cfg.prefix_reuse and cfg.shared_prefix == 18 and cfg.prefix_groups == 2
    assert cfg.cache_config().prefix_caching and not me.MiniEngineConfig().cache_config().prefix_caching
