"""Capacity planner: hand-computed cases, unit parsing, bad input."""

import pytest

from hisparse_tools.plan import PlanInputs, format_plan, plan
from hisparse_tools.units import parse_bytes, parse_tokens


def _case(**kw):
    base = dict(num_layers=2, context_len=1000, gpu_bytes=10_000_000, host_bytes=20_000_000,
                row_format="fp8_ds_mla", top_k=4, indexer_bytes=100, hot_rows=8, max_seqs=100,
                block_size=64)
    base.update(kw)
    return plan(PlanInputs(**base))


def test_hand_computed_host_bound():
    p = _case(target_requests=30)
    b = p["per_request_bytes"]
    # resident: C * L * (row + I) = 1000 * 2 * (656 + 100)
    assert b["resident_gpu"] == 1_512_000
    gb = b["hisparse_gpu_breakdown"]
    assert gb["hot_rows_and_slot_state"] == 2 * 9 * (656 + 8) == 11_952
    assert gb["indexer_keys"] == 1000 * 2 * 100
    assert gb["row_to_slot_map"] == 1024 * 2 * 4  # Cb = 16 blocks x 64
    assert gb["tables"] == 4 * 16 + 8 * 2 + 4
    assert b["hisparse_gpu"] == 11_952 + 200_000 + 8192 + 84 == 220_228
    assert b["hisparse_host"] == 1024 * 2 * 656 == 1_343_488
    c = p["concurrency"]
    assert c["resident"] == 6  # 10e6 // 1.512e6
    assert c["hisparse_gpu_limit"] == 45  # 10e6 // 220228
    assert c["hisparse_host_limit"] == 14  # 20e6 // 1343488
    assert c["hisparse"] == 14 and p["binding"] == "host"
    assert p["gain"] == pytest.approx(14 / 6)
    assert p["host_pool_for_hisparse_bytes"] == 14 * 1_343_488
    t = p["target"]
    assert t["host_pool_bytes"] == 30 * 1_343_488
    assert t["gpu_bytes"] == 30 * 220_228 and t["fits_gpu"] is True


def test_gpu_bound_and_max_seqs_bound():
    p = _case(host_bytes=10**12)
    assert p["binding"] == "gpu" and p["concurrency"]["hisparse"] == 45
    p = _case(host_bytes=10**12, max_seqs=7)
    assert p["binding"] == "max_seqs" and p["concurrency"]["hisparse"] == 7
    assert p["concurrency"]["resident"] == 6


def test_bf16_and_default_hot_rows():
    p = plan(PlanInputs(num_layers=1, context_len=64, gpu_bytes=1, host_bytes=1,
                        row_format="bf16", top_k=16, indexer_bytes=0, block_size=64))
    assert p["inputs"]["hot_rows"] == 32 and p["inputs"]["row_bytes"] == 1152
    assert p["per_request_bytes"]["resident_gpu"] == 64 * 1152
    assert p["per_request_bytes"]["hisparse_gpu"] == 33 * (1152 + 8) + 64 * 4 + 4 + 8 + 4
    assert p["concurrency"]["resident"] == 0 and p["gain"] is None
    assert p["concurrency"]["hisparse"] == 0  # the CLI turns this into exit 3
    assert "binding resource" in format_plan(p)


def test_parse_units():
    assert parse_bytes("80GiB") == 80 << 30
    assert parse_bytes("80G") == 80 << 30
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    assert parse_bytes("4096") == 4096
    assert parse_tokens("128K") == 131072
    assert parse_tokens("1M") == 1 << 20
    assert parse_tokens(7) == 7
    for bad in ("12XB", "", "-1", "GiB"):
        with pytest.raises(ValueError, match="cannot parse"):
            parse_bytes(bad)


@pytest.mark.parametrize("kw, msg", [
    (dict(num_layers=0), "num_layers"),
    (dict(hot_rows=3), "hot_rows"),
    (dict(row_format="fp4"), "row format"),
    (dict(gpu_bytes=-1), "gpu_bytes"),
    (dict(gpu_bytes=0), "gpu_bytes"),
    (dict(host_bytes=0), "host_bytes"),
    (dict(target_requests=0), "target_requests"),
    (dict(context_len=10**12), "int32"),
])
def test_bad_inputs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _case(**kw)


@pytest.mark.parametrize("kw, msg", [(dict(context_len=1.5), "context_len"),
                                     (dict(tp_share=1), "tp_share")])
def test_wrong_types(kw, msg):
    with pytest.raises(TypeError, match=msg):
        _case(**kw)


def test_int32_index_limit_binds():
    """One cache indexes at most 2**31 - 1 host rows per layer: at a 2**30-token context
    only one request fits, however large the budgets (the limit stress and the cache
    config enforce)."""
    p = _case(context_len=2**30, gpu_bytes=10**18, host_bytes=10**18, max_seqs=100)
    assert p["concurrency"]["hisparse_index_limit"] == 1
    assert p["concurrency"]["hisparse"] == 1 and p["binding"] == "int32_indices"
    assert "int32 indices 1" in format_plan(p)


def test_format_mentions_target_and_binding():
    text = format_plan(_case(target_requests=100))
    assert "binding resource: host" in text
    assert "does NOT fit" in text  # 100 x 220228 > 10e6


def test_tensor_parallel_pool_counted_once_per_node_when_shared():
    # host bytes per request (one copy) = Cb * L * row = 1024 * 2 * 656 = 1_343_488
    one = _case()
    assert one["per_request_bytes"]["hisparse_host"] == 1_343_488
    assert one["concurrency"]["hisparse_host_limit"] == 20_000_000 // 1_343_488 == 14
    # 4 TP ranks, each with its own pool: 4 copies per node
    sep = _case(tp_ranks=4)
    assert sep["host_pool_copies_per_node"] == 4
    assert sep["concurrency"]["hisparse_host_limit"] == 20_000_000 // (4 * 1_343_488) == 3
    assert sep["host_pool_for_hisparse_bytes"] == 3 * 4 * 1_343_488
    # shared: one copy per node, the same concurrency as a single rank
    shr = _case(tp_ranks=4, tp_share=True, target_requests=10)
    assert shr["host_pool_copies_per_node"] == 1
    assert shr["concurrency"]["hisparse"] == 14
    assert shr["target"]["host_pool_bytes"] == 10 * 1_343_488
    with pytest.raises(ValueError, match="tp_ranks"):
        _case(tp_ranks=0)


def test_device_pool_auto_hand_computed():
    """--pool-rows auto for the 14 requests hisparse reaches (host-bound): every GPU byte
    they leave, in rows of L x row bytes, on top of their hot buffers."""
    p = _case(pool_rows="auto")
    d = p["device_pool"]
    assert d["requests"] == 14 and d["requests_from"] == "hisparse"
    left = 10_000_000 - 14 * 220_228  # 6_916_808
    assert d["pool_rows"] == 14 * 9 + left // (2 * 656) == 126 + 5271 == 5397
    assert d["hot_rows"] == 128 and d["pages"] == (5397 - 128) // 64 == 82 and d["page_rows"] == 64
    assert d["device_bytes"] == 2 * 5397 * 656
    assert d["gpu_bytes_at_requests"] == 14 * 220_228 + 2 * 5271 * 656 <= 10_000_000 and d["fits_gpu"]
    assert d["pages_per_request"] == 16 and d["resident_requests"] == 82 // 16 == 5
    assert d["rows_all_resident"] == 128 + 14 * 16 * 64 == 14_464
    assert d["device_bytes_all_resident"] == 2 * 14_464 * 656
    assert d["gpu_bytes_all_resident"] == 14 * 220_228 + 2 * (14_464 - 126) * 656
    assert d["all_resident_fits_gpu"] is False
    text = format_plan(p)
    assert "device pool (auto: every GPU byte the requests leave): 5397 rows per layer for 14 requests" in text
    assert "5 of 14 requests; all 14 resident needs --pool-rows 14464" in text


def test_device_pool_given_for_a_target():
    d = _case(pool_rows=1000, target_requests=30)["device_pool"]
    assert d["requests"] == 30 and d["requests_from"] == "target" and d["pool_rows_from"] == "given"
    assert d["hot_rows"] == 320 and d["pages"] == 10 and d["resident_requests"] == 0  # 16 pages a request
    d = _case(pool_rows=128 + 3 * 16 * 64, target_requests=3)  # 3 x 9 = 27 hot rows -> 64
    assert d["device_pool"]["resident_requests"] == 3 == d["device_pool"]["requests"]
    assert d["device_pool"]["rows_all_resident"] == 64 + 3 * 16 * 64
    assert "device_pool" not in _case()  # no pool asked for: none reported


@pytest.mark.parametrize("kw, msg", [
    (dict(pool_rows=100), r"pool_rows=100 is smaller than the hot buffers it includes: 14 requests \(the hisparse "
                          r"concurrency\) x \(hot_rows \+ 1\) = 14 x 9 = 126 rows per layer; give at least 126"),
    (dict(pool_rows=0), "pool_rows"),
    (dict(pool_rows=2**31), "int32"),
])
def test_device_pool_bad_sizes(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _case(**kw)


# ------------------------------------------------------------------ prefix sharing
def _shared(**kw):
    base = dict(num_layers=61, context_len=36 * 1024, gpu_bytes=80 << 30, host_bytes=1 << 40,
                shared_prefix=32 * 1024, prefix_groups=8, target_requests=64)
    return plan(PlanInputs(**{**base, **kw}))


def test_prefix_sharing_host_rows_of_64_requests_in_8_groups():
    """64 requests in 8 groups sharing 32K + 4K own: 8 x 32K + 64 x 4K host rows per layer
    rather than 64 x 36K; the alias ids every sharer needs cost what cfg.device_bytes()
    counts for prefix_alias_blocks."""
    from hisparse import HiSparseConfig

    p = _shared()
    x, K = p["prefix"], 1024
    assert x["requests"] == 64 and x["requests_from"] == "target" and x["groups"] == 8
    assert x["shared_rows_per_group"] == 32 * K and x["own_rows_per_request"] == 4 * K
    assert x["host_rows_shared"] == 8 * 32 * K + 64 * 4 * K and x["host_rows_unshared"] == 64 * 36 * K
    assert x["host_rows_saved"] == 64 * 36 * K - (8 * 32 * K + 64 * 4 * K)
    assert x["host_bytes_shared"] == x["host_rows_shared"] * 61 * 656
    assert x["host_bytes_unshared"] == p["target"]["host_pool_bytes"]
    assert x["alias_ids"] == (64 - 8) * 32 * K // 64 == 28672
    cfg = lambda aliases: HiSparseConfig(num_layers=61, host_pool_tokens=x["host_rows_shared"], top_k=64,
                                         prefix_caching=True, prefix_alias_blocks=aliases, device="cpu")
    extra = cfg(x["alias_ids"]).device_bytes()["total"] - cfg(0).device_bytes()["total"]
    assert extra == x["alias_device_bytes"] == x["alias_ids"] * (4 * 61 * 64 + 4)
    assert x["default_alias_ids"] == cfg(None).prefix_alias_blocks == x["host_rows_shared"] // 64
    assert x["gpu_bytes_shared"] == p["target"]["gpu_bytes"] + 4 * x["alias_ids"]
    assert x["row_map_bytes_saved"] == x["host_rows_saved"] * 61 * 4
    text = format_plan(p)
    for part in ("in 8 groups sharing 32768 tokens", "8 x 32768 + 64 x 4096 = 524288 (vs 64 x 36864 = 2359296",
                 "alias ids for every sharer (prefix_alias_blocks): 28672", "concurrency with sharing"):
        assert part in text, (part, text)


def test_prefix_sharing_with_a_device_pool_counts_each_groups_prefix_pages_once():
    """64 requests in 8 groups of 32K shared + 4K own: resident sharers reference their
    group's 512 prefix pages, so all 64 resident need hot rows + (8 x 576 + 56 x 64) pages
    (not 64 x 576); a pool of 8 x 576 + 10 x 64 pages holds the 8 first requests and 10
    sharers."""
    p = _shared(pool_rows="auto")
    d = p["device_pool"]
    assert d["requests"] == 64 and d["pages_per_request"] == 576 and d["shared_pages_per_group"] == 512
    assert d["rows_all_resident_shared"] == d["hot_rows"] + (8 * 576 + 56 * 64) * 64
    assert d["rows_all_resident"] == d["hot_rows"] + 64 * 576 * 64
    assert d["resident_requests_shared"] == 64 > d["resident_requests"]
    assert "shared_pages_per_group" not in _shared(pool_rows=None)["prefix"]
    assert "shared_pages_per_group" not in _case(pool_rows="auto")["device_pool"]  # no shared prefix
    q = _shared(pool_rows=d["hot_rows"] + (8 * 576 + 10 * 64) * 64 + 63)
    assert q["device_pool"]["pages"] == 8 * 576 + 10 * 64 and q["device_pool"]["resident_requests_shared"] == 18
    assert "with shared prefix pages (512 pages per group): 18 of 64 requests resident" in format_plan(q)
    # without a target the device pool's requests (the unshared concurrency) are the ones counted
    r = _shared(target_requests=None, host_bytes=200 << 30, pool_rows="auto")["device_pool"]
    assert r["requests"] != _shared(target_requests=None, host_bytes=200 << 30)["prefix"]["requests"]
    first = min(r["requests"], 8)
    need = first * 576 + (r["requests"] - first) * 64
    assert r["rows_all_resident_shared"] == r["hot_rows"] + need * 64


def test_prefix_sharing_raises_the_host_bound_concurrency():
    """Host-bound (the _case budgets): 14 requests unshared; sharing 512 of 1000 tokens in
    2 groups leaves (20e6 - 2 x 512 x 2 x 656) // (512 x 2 x 656) = 27 requests."""
    p = _case(shared_prefix=512, prefix_groups=2)
    x = p["prefix"]
    assert p["concurrency"]["hisparse"] == 14 and x["host_limit_shared"] == 27
    assert x["concurrency_shared"] == 27 and x["binding_shared"] == "host" and x["requests"] == 27
    assert x["own_rows_per_request"] == 1024 - 512 and x["shared_rows_per_group"] == 512
    one = _case(shared_prefix=100)  # one group; only whole blocks are shared (64 of the 100 tokens)
    assert one["prefix"]["groups"] == 1 and one["prefix"]["shared_rows_per_group"] == 64
    assert "prefix" not in _case()


@pytest.mark.parametrize("kw, msg", [
    (dict(shared_prefix=0), "shared_prefix must be >= 1"),
    (dict(shared_prefix=1000), r"shared_prefix=1000 does not fit the context: a request's context_len=1000"),
    (dict(shared_prefix=32), r"shared_prefix=32 is shorter than one host block \(block_size=64\)"),
    (dict(shared_prefix=128, prefix_groups=0), "prefix_groups must be >= 1"),
    (dict(prefix_groups=2), "prefix_groups needs shared_prefix"),
])
def test_prefix_sharing_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _case(**kw)
