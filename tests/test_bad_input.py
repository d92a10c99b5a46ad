"""Every bad input of the cache's public API: a clear TypeError / ValueError /
CapacityError before anything runs, and no state change at all (snapshot compared).
Unchecked resolves (validate=False) turn bad entries into -1 and count them instead.
"""

import pytest
import torch

from hisparse import CapacityError, HiSparseConfig
from hisparse.cache.cache import HiSparseCache

from invariants import assert_same, check_cache, snapshot

I32 = torch.int32


def cfg(**kw):
    base = dict(num_layers=2, host_pool_tokens=12, row_bytes=16, top_k=2, device_buffer_size=4,
                max_num_reqs=2, max_query_len=2, host_block_size=2, max_request_id=8, device="cpu")
    base.update(kw)
    return HiSparseConfig(**base)


@pytest.fixture
def cache():
    """Request 1 (slot 0) with 5 rows in both layers, request 6 (slot 1) with 1 row."""
    c = HiSparseCache(cfg())
    c.add_request(1)
    c.add_request(6)
    for layer in range(2):
        c.write(layer, 1, torch.full((5, 16), 3 + layer, dtype=torch.uint8))
        c.write(layer, 6, torch.full((1, 16), 9, dtype=torch.uint8))
    c.resolve(0, torch.tensor([1], dtype=I32), torch.tensor([[4, 0]], dtype=I32))
    return c


def rejects(c, exc, match, fn, *args, **kw):
    before = snapshot(c)
    with pytest.raises(exc, match=match):
        fn(*args, **kw)
    assert_same(before, snapshot(c))
    check_cache(c)


# ---- construction -----------------------------------------------------------------
def test_constructor_rejects_bad_arguments():
    with pytest.raises(TypeError, match="HiSparseConfig"):
        HiSparseCache({"num_layers": 1})
    with pytest.raises(ValueError, match="kernels must be one of"):
        HiSparseCache(cfg(), kernels="cuda")
    with pytest.raises(ValueError, match="kernels must be one of"):
        HiSparseCache(cfg(), kernels=None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch.cuda.is_available"):
            HiSparseCache(cfg(device="cuda"))


# ---- add_request / free_request -------------------------------------------------------
@pytest.mark.parametrize("bad", [1.0, "2", True, None, torch.tensor(2)])
def test_request_ids_must_be_ints(cache, bad):
    rejects(cache, TypeError, "req_id must be an int", cache.add_request, bad)
    rejects(cache, TypeError, "req_id must be an int", cache.free_request, bad)


@pytest.mark.parametrize("bad", [-1, 8, 2**40])
def test_request_ids_must_be_in_range(cache, bad):
    rejects(cache, ValueError, r"out of range \[0, 8\)", cache.add_request, bad)
    rejects(cache, ValueError, r"out of range \[0, 8\)", cache.free_request, bad)


def test_add_live_free_dead_and_full(cache):
    rejects(cache, ValueError, "already live", cache.add_request, 6)
    rejects(cache, CapacityError, "request slots are taken", cache.add_request, 3)
    rejects(cache, ValueError, "not live", cache.free_request, 3)
    cache.free_request(6)
    rejects(cache, ValueError, "not live", cache.free_request, 6)
    rejects(cache, ValueError, "not live", cache.write, 0, 6, torch.zeros((1, 16), dtype=torch.uint8))


# ---- write of one request----------------------------------------------------------------
@pytest.mark.parametrize("layer,exc", [(2, ValueError), (-1, ValueError), (0.0, TypeError),
                                       (True, TypeError), ("0", TypeError)])
def test_append_bad_layer(cache, layer, exc):
    rejects(cache, exc, "layer", cache.write, layer, 1, torch.zeros((1, 16), dtype=torch.uint8))


@pytest.mark.parametrize("rows,exc,match", [
    ([[0] * 16], TypeError, "torch.Tensor"),
    (torch.zeros((1, 16), dtype=torch.float32), TypeError, "uint8"),
    (torch.zeros((1, 16), dtype=torch.int8), TypeError, "uint8"),
    (torch.zeros(16, dtype=torch.uint8), ValueError, "2-D"),
    (torch.zeros((1, 1, 16), dtype=torch.uint8), ValueError, "2-D"),
    (torch.zeros((1, 32), dtype=torch.uint8), ValueError, "row_bytes=16"),
    (torch.zeros((1, 16), dtype=torch.uint8, device="meta"), ValueError, "expected cpu"),
])
def test_append_bad_rows(cache, rows, exc, match):
    rejects(cache, exc, match, cache.write, 0, 1, rows)


def test_append_past_the_pool_is_a_capacity_error_in_any_layer(cache):
    # 6 blocks: request 1 holds 3 (5 rows), request 6 holds 1; 2 free: request 1 may grow
    # to 9 rows, request 6 to 6
    rows = torch.zeros((6, 16), dtype=torch.uint8)
    rejects(cache, CapacityError, "host pool (exhausted|full)", cache.write, 1, 6, rows)
    rejects(cache, CapacityError, "host pool (exhausted|full)", cache.write, 0, 1, rows)
    assert cache.write(0, 1, rows[:4])[0] == 5  # exactly the 2 free blocks
    assert cache.request(1).lengths[0] == 9 and cache.stats()["host_pool"]["blocks_used"] == 6
    rejects(cache, CapacityError, "host pool (exhausted|full)", cache.write, 1, 6, rows[:2])


# ---- resolve: metadata (checked in both modes) ------------------------------------------
def ids(*v, dtype=I32):
    return torch.tensor(v, dtype=dtype)


def topk(*rows):
    return torch.tensor(rows, dtype=I32)


META_CASES = [
    ([1], [[0, 1]], "layer", 5, ValueError),
    ([[1]], [[0, 1]], "req_ids must be 1-D", 0, ValueError),
    (torch.tensor([1.0]), [[0, 1]], "req_ids must have dtype", 0, TypeError),
    (torch.tensor([1], dtype=torch.int16), [[0, 1]], "req_ids must have dtype", 0, TypeError),
    ([1], torch.tensor([[0, 1]], dtype=torch.int64), "topk must have dtype int32", 0, TypeError),
    ([1], torch.tensor([0, 1], dtype=I32), "topk must be 2-D", 0, ValueError),
    ([1], torch.zeros((1, 2, 1), dtype=I32), "topk must be 2-D", 0, ValueError),
    ([1, 1], [[0, 1]], "one request id per query token", 0, ValueError),
    ([1], [[0, 1, 2]], "more than the configured top_k=2", 0, ValueError),
    ([1], torch.zeros((1, 0), dtype=I32), "K >= 1", 0, ValueError),
    ([1, 1, 6, 6, 6], torch.zeros((5, 2), dtype=I32), "more than max_num_reqs x max_query_len", 0,
     ValueError),
    ([1, 6], torch.zeros((2, 2), dtype=I32).t().contiguous().t(), "contiguous in its last", 0,
     ValueError),
    ([1], torch.zeros((1, 2), dtype=I32, device="meta"), "topk is on meta", 0, ValueError),
    (torch.zeros(1, dtype=I32, device="meta"), [[0, 1]], "req_ids is on meta", 0, ValueError),
    ("1", [[0, 1]], "req_ids must be a torch.Tensor", 0, TypeError),
    (torch.tensor([1, 0, 6, 0], dtype=I32)[::2], [[0, 1], [0, -1]], "req_ids must be contiguous",
     0, ValueError),
    ([1], [[0, 1]], "layer must be an int", 1.0, TypeError),
]


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("rid,tk,match,layer,exc", META_CASES)
def test_resolve_metadata_errors_in_both_modes(cache, validate, rid, tk, match, layer, exc):
    r = rid if not isinstance(rid, list) else torch.tensor(rid, dtype=I32)
    t = tk if not isinstance(tk, list) else torch.tensor(tk, dtype=I32)
    rejects(cache, exc, match, cache.resolve, layer, r, t, validate=validate)


@pytest.mark.parametrize("rid,tk,match,layer,exc", META_CASES)
def test_prefetch_metadata_errors(cache, rid, tk, match, layer, exc):
    """A prefetch makes the unchecked resolve's metadata checks (top_k among them)."""
    r = rid if not isinstance(rid, list) else torch.tensor(rid, dtype=I32)
    t = tk if not isinstance(tk, list) else torch.tensor(tk, dtype=I32)
    rejects(cache, exc, match, cache.prefetch, layer, r, t)


# ---- resolve: contents (checked mode raises; unchecked counts) ------------------------------
CONTENT_CASES = [
    # (req_ids, topk, message, invalid entries counted when unchecked)
    ([-1], [[0, -1]], r"req_ids\[0\] = -1 marks a padding token", 1),
    ([8], [[0, 1]], r"req_ids\[0\]=8 is out of range", 2),
    ([3], [[0, 1]], r"req_ids\[0\]=3 is not a live request", 2),
    # unchecked, the second run of request 1 is not resolved: its entry counts invalid
    ([1, 6, 1], [[0, -1], [0, -1], [1, -1]], "not contiguous", 1),
    ([1, 1, 1], [[0, 1], [2, -1], [3, 4]], "more than max_query_len=2", 2),
    ([1], [[-2, 0]], r"topk\[0\] holds -2", 1),
    ([6, 1], [[0, -1], [5, 0]], r"position 5 but request 1 has seq_len=5", 1),
    ([6], [[1, 0]], r"request 6 has seq_len=1", 1),
]


@pytest.mark.parametrize("rid,tk,match,n_invalid", CONTENT_CASES)
def test_resolve_content_errors_checked(cache, rid, tk, match, n_invalid):
    rejects(cache, ValueError, match, cache.resolve, 0, torch.tensor(rid, dtype=I32),
            torch.tensor(tk, dtype=I32))
    # int64 ids take the same checks
    rejects(cache, ValueError, match, cache.resolve, 0, torch.tensor(rid, dtype=torch.int64),
            torch.tensor(tk, dtype=I32))


@pytest.mark.parametrize("rid,tk,match,n_invalid", CONTENT_CASES)
def test_resolve_content_errors_unchecked_become_padding(cache, rid, tk, match, n_invalid):
    before = cache.stats()["layers"][0]["invalid"]
    res = cache.resolve(0, torch.tensor(rid, dtype=I32), torch.tensor(tk, dtype=I32),
                        validate=False)
    assert cache.stats()["layers"][0]["invalid"] - before == n_invalid
    phys = res.physical.tolist()
    first_run = True
    for t, row in enumerate(tk):
        if t == 0 or rid[t - 1] != rid[t]:
            first_run = rid[t] not in rid[:t]
        for k, p in enumerate(row):
            live = rid[t] in (1, 6) and first_run
            if p == -1 or not live or not 0 <= p < cache.request(rid[t]).seq_len:
                assert phys[t][k] == -1, (t, k, phys)
    check_cache(cache)


def test_unchecked_resolve_takes_only_int32_ids(cache):
    """The hot path neither converts nor allocates: int64 ids are refused unchecked (no
    state change) and accepted, range-checked, in checked mode."""
    rejects(cache, TypeError, "unchecked resolve.*int32 req_ids", cache.resolve, 0,
            torch.tensor([1], dtype=torch.int64), topk([0, 1]), validate=False)
    rejects(cache, ValueError, r"req_ids\[0\]=4294967297 is out of range", cache.resolve, 0,
            torch.tensor([2**32 + 1], dtype=torch.int64), topk([0, 1]))
    res = cache.resolve(0, torch.tensor([1], dtype=torch.int64), topk([0, 1]))
    assert res.valid_counts.tolist() == [2]


# ---- reads and views ---------------------------------------------------------------
@pytest.mark.parametrize("positions,exc,match", [
    ([5], ValueError, r"\[0, 5\)"),
    ([-1], ValueError, r"\[0, 5\)"),
    (torch.tensor([0, 7]), ValueError, r"\[0, 5\)"),
    (torch.tensor([0.0]), TypeError, "int32/int64"),
    (torch.tensor([[0]]), TypeError, "1-D"),
    ([0.5], TypeError, r"positions\[0\] must be an int"),
    (3, TypeError, "list of ints"),
])
def test_read_host_rows_bad_positions(cache, positions, exc, match):
    rejects(cache, exc, match, cache.read_host_rows, 0, 1, positions)


def test_reads_and_views_bad_layer_or_request(cache):
    rejects(cache, ValueError, "layer", cache.read_host_rows, 2, 1, [0])
    rejects(cache, ValueError, "not live", cache.read_host_rows, 0, 3, [0])
    rejects(cache, ValueError, "layer", cache.hot_rows, -1)
    rejects(cache, TypeError, "layer", cache.hot_rows, None)
    assert cache.hot_rows(1).shape == (64, 16)  # 2 x 5 rows, rounded up to 64 (FlashMLA pages)
    assert torch.equal(cache.read_host_rows(1, 1, torch.tensor([4], dtype=I32)),
                       torch.full((1, 16), 4, dtype=torch.uint8))
