"""Index conversion: Triton kernel (interpreter on CPU) vs the torch reference vs a
plain-Python loop of the documented formula; workspace mode; compaction; bad input."""

from __future__ import annotations

import pytest
import torch
from staging_helpers import convert, convert_ref, stage, stage_chunk, stage_ref  # noqa: F401


IMPLS = ["torch", "triton"]


def naive(topk, req, bt, B, stride, *, seq_lens=None, pre=None, ws=None, wl=None, compact=False):
    """The formula of the module docstring, one entry at a time (independent of both impls)."""
    T, K = topk.shape
    R, NB = bt.shape
    out, counts = [], []
    for t in range(T):
        row = []
        for k in range(K):
            p = int(topk[t, k])
            v = -1
            if p >= 0:
                if pre is not None and int(pre[t]) >= 0:
                    i = int(pre[t])
                    if i < ws.numel() and (wl is None or p < int(wl[i])):
                        v = int(ws[i]) + p
                else:
                    r = int(req[t])
                    if 0 <= r < R and p // B < NB and (seq_lens is None or p < int(seq_lens[r])):
                        b = int(bt[r, p // B])
                        if b >= 0:
                            v = b * stride + p % B
            row.append(v)
        counts.append(sum(v >= 0 for v in row))
        if compact:
            row = [v for v in row if v >= 0] + [-1] * (K - counts[-1])
        out.append(row)
    return (torch.tensor(out, dtype=torch.int32).view(T, K), torch.tensor(counts, dtype=torch.int32))


def make_case(g, T, K, R, NB, B, *, pad_frac=0.3, holes=False):
    nblocks = R * NB + 3
    bt = torch.randperm(nblocks, generator=g)[: R * NB].view(R, NB).to(torch.int32)
    if holes and R * NB:
        bt.view(-1)[torch.rand(R * NB, generator=g) < 0.2] = -1
    topk = torch.randint(0, max(NB * B, 1), (T, K), generator=g).to(torch.int32)
    topk[torch.rand(T, K, generator=g) < pad_frac] = -1
    req = torch.randint(0, max(R, 1), (T,), generator=g).to(torch.int32)
    return topk, req, bt


def test_hand_traced():
    # B = 4, stride 6: request 0 owns physical blocks 2 then 0, request 1 block 1
    bt = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    topk = torch.tensor([[0, 5, -1, 3], [-1, 2, -1, 1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    want = torch.tensor([[12, 1, -1, 15], [-1, 8, -1, 7]], dtype=torch.int32)
    want_c = torch.tensor([[12, 1, 15, -1], [8, 7, -1, -1]], dtype=torch.int32)
    for impl in IMPLS:
        r = convert(topk, req, bt, block_size=4, block_stride=6,
                                     return_valid_counts=True, impl=impl)
        assert torch.equal(r.physical, want), impl
        assert r.valid_counts.tolist() == [3, 2]
        r = convert(topk, req, bt, block_size=4, block_stride=6, compact=True, impl=impl)
        assert torch.equal(r.physical, want_c), impl
        assert r.valid_counts is None


@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("extra_stride", [0, 5])
@pytest.mark.parametrize("compact", [False, True])
def test_sweep_vs_reference(B, extra_stride, compact):
    g = torch.Generator().manual_seed(B * 100 + extra_stride * 10 + compact)
    stride = B + extra_stride
    for T, K, R, NB in [(0, 4, 2, 3), (1, 1, 1, 1), (5, 7, 3, 4), (3, 300, 2, 6)]:
        topk, req, bt = make_case(g, T, K, R, NB, B)
        want, want_n = naive(topk, req, bt, B, stride, compact=compact)
        ref = convert_ref(topk, req, bt, block_size=B, block_stride=stride, compact=compact)
        assert torch.equal(ref.physical, want) and torch.equal(ref.valid_counts, want_n)
        got = convert(topk, req, bt, block_size=B, block_stride=stride, compact=compact,
                                       return_valid_counts=True, impl="triton")
        assert torch.equal(got.physical, want), (T, K, R, NB)
        assert torch.equal(got.valid_counts, want_n)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_padding_and_duplicates(impl):
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    topk = torch.tensor([[-1, -1, -1], [1, 1, 1]], dtype=torch.int32)
    req = torch.zeros(2, dtype=torch.int32)
    r = convert(topk, req, bt, block_size=2, compact=True, return_valid_counts=True, impl=impl)
    assert r.physical.tolist() == [[-1, -1, -1], [7, 7, 7]]
    assert r.valid_counts.tolist() == [0, 3]


@pytest.mark.parametrize("compact", [False, True])
def test_workspace_mode_mixed(compact):
    """Decode tokens first (block table), then prefill tokens (workspace offsets), one call."""
    g = torch.Generator().manual_seed(7)
    B, R, NB = 16, 3, 4
    T_dec, T_pre, K = 4, 6, 20
    topk, req, bt = make_case(g, T_dec + T_pre, K, R, NB, B)
    pre = torch.tensor([-1] * T_dec + [0, 0, 1, 1, 1, 2], dtype=torch.int32)
    ws = torch.tensor([0, 40, 70], dtype=torch.int32)
    wl = torch.tensor([40, 30, 64], dtype=torch.int32)
    # prefill positions within each request's staged rows
    for t in range(T_dec, T_dec + T_pre):
        n = int(wl[int(pre[t])])
        topk[t] = torch.where(topk[t] >= 0, topk[t] % n, topk[t])
    for lens in (None, wl):
        want, want_n = naive(topk, req, bt, B, B, pre=pre, ws=ws, wl=lens, compact=compact)
        for impl in IMPLS:
            got = convert(topk, req, bt, block_size=B, prefill_request_id=pre,
                                           workspace_starts=ws, workspace_lens=lens, compact=compact,
                                           return_valid_counts=True, impl=impl)
            assert torch.equal(got.physical, want), impl
            assert torch.equal(got.valid_counts, want_n), impl
    assert bool((want[T_dec:] < 134).all())  # inside the workspace of 70 + 64 rows


@pytest.mark.parametrize("impl", IMPLS)
def test_unchecked_invalid_entries_become_padding(impl):
    """validate=False: every kind of invalid entry becomes -1, never an out-of-bounds read."""
    B = 4
    bt = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)  # request 0 block 1 unallocated
    seq = torch.tensor([8, 6], dtype=torch.int32)
    topk = torch.tensor([
        [0, 5, 9, 1000],  # block 1 unallocated, block 2 and 250 beyond NB=2
        [5, 6, 7, -1],  # request 1: positions 6, 7 >= seq_len 6
        [0, 1, 2, 3],  # request id 5: out of range
        [0, 1, 2, 3],  # request id -3
        [0, 3, 4, 9],  # prefill request 7: out of range
        [0, 3, 4, 9],  # prefill request 0: 4 and 9 >= workspace_lens 4
    ], dtype=torch.int32)
    req = torch.tensor([0, 1, 5, -3, 0, 0], dtype=torch.int32)
    pre = torch.tensor([-1, -1, -1, -1, 7, 0], dtype=torch.int32)
    ws = torch.tensor([100], dtype=torch.int32)
    wl = torch.tensor([4], dtype=torch.int32)
    want = [[0, -1, -1, -1], [13, -1, -1, -1], [-1] * 4, [-1] * 4, [-1] * 4, [100, 103, -1, -1]]
    got = convert(topk, req, bt, block_size=B, seq_lens=seq, prefill_request_id=pre,
                                   workspace_starts=ws, workspace_lens=wl, return_valid_counts=True,
                                   validate=False, impl=impl)
    assert got.physical.tolist() == want
    assert got.valid_counts.tolist() == [1, 1, 0, 0, 0, 2]


@pytest.mark.parametrize("impl", IMPLS)
def test_preallocated_outputs(impl):
    g = torch.Generator().manual_seed(3)
    topk, req, bt = make_case(g, 4, 9, 2, 3, 16)
    out = torch.full((4, 9), 77, dtype=torch.int32)
    cnt = torch.full((4,), 77, dtype=torch.int32)
    r = convert(topk, req, bt, block_size=16, compact=True, out=out,
                                 valid_counts_out=cnt, validate=False, impl=impl)
    assert r.physical is out and r.valid_counts is cnt
    want, want_n = naive(topk, req, bt, 16, 16, compact=True)
    assert torch.equal(out, want) and torch.equal(cnt, want_n)


def _base():
    bt = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    topk = torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    return topk, req, bt


@pytest.mark.parametrize("case, exc, msg", [
    (dict(topk=lambda a: a.long()), TypeError, "topk must have dtype int32"),
    (dict(topk=lambda a: a[0]), ValueError, "topk must be 2-D"),
    (dict(req=lambda a: a.long()), TypeError, "req_id_per_token must have dtype int32"),
    (dict(req=lambda a: a[:1]), ValueError, "req_id_per_token must have shape [2]"),
    (dict(bt=lambda a: a.float()), TypeError, "block_table must have dtype int32"),
    (dict(kw=dict(block_size=0)), ValueError, "block_size must be >= 1"),
    (dict(kw=dict(block_size=2.0)), TypeError, "block_size must be an int"),
    (dict(kw=dict(block_size=4, block_stride=3)), ValueError, "block_stride must be >= 4, got 3"),
    (dict(kw=dict(block_size=4, impl="cuda")), ValueError, "kernels must be one of"),
    (dict(topk=lambda a: a - 2), ValueError, "must be >= 0 or -1"),
    (dict(req=lambda a: a + 1), ValueError, "req_id_per_token[1] = 2 is outside [0, 2)"),
    (dict(topk=lambda a: torch.where(a >= 0, a * 3, a)), ValueError, "needs logical block 2"),
    (dict(topk=lambda a: torch.where(a >= 0, a + 4, a)), ValueError, "no block allocated"),
    (dict(kw=dict(block_size=4, seq_lens=torch.tensor([8, 3], dtype=torch.int32))), ValueError,
     "is >= seq_lens[1] = 3"),
    (dict(kw=dict(block_size=4, seq_lens=torch.tensor([8], dtype=torch.int32))), ValueError,
     "seq_lens must have shape [2]"),
    (dict(kw=dict(block_size=4, prefill_request_id=torch.tensor([-1, 0], dtype=torch.int32))), ValueError,
     "go together"),
    (dict(kw=dict(block_size=4, prefill_request_id=torch.tensor([-1, 1], dtype=torch.int32),
                  workspace_starts=torch.tensor([0], dtype=torch.int32))), ValueError,
     "prefill_request_id[1] = 1 is outside [-1, 1)"),
    (dict(kw=dict(block_size=4, prefill_request_id=torch.tensor([-1, 0], dtype=torch.int32),
                  workspace_starts=torch.tensor([0], dtype=torch.int32),
                  workspace_lens=torch.tensor([3], dtype=torch.int32))), ValueError,
     "beyond the 3 rows staged for prefill request 0"),
    (dict(kw=dict(block_size=4, out=torch.empty(2, 2, dtype=torch.int32))), ValueError, "out must have shape"),
    (dict(kw=dict(block_size=4, valid_counts_out=torch.empty(3, dtype=torch.int32))), ValueError,
     "valid_counts_out must have shape [2]"),
])
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_raises_before_launch(case, exc, msg, impl):
    topk, req, bt = _base()
    topk = case.get("topk", lambda a: a)(topk)
    req = case.get("req", lambda a: a)(req)
    bt = case.get("bt", lambda a: a)(bt)
    kw = dict(block_size=4)
    kw.update(case.get("kw", {}))
    kw.setdefault("impl", impl)
    sentinel = torch.full((2, 3), 55, dtype=torch.int32)
    if "out" not in kw and topk.dim() == 2 and topk.shape == (2, 3):
        kw["out"] = sentinel
    with pytest.raises(exc) as ei:
        convert(topk, req, bt, **kw)
    assert msg in str(ei.value)
    assert bool((sentinel == 55).all())  # nothing written


def test_valid_input_of_bad_input_base_passes():
    topk, req, bt = _base()
    r = convert(topk, req, bt, block_size=4, return_valid_counts=True)
    assert r.physical.tolist() == [[0, 1, -1], [10, 11, -1]]
    assert r.valid_counts.tolist() == [2, 2]


def test_device_mismatch_rejected():
    topk, req, bt = _base()
    with pytest.raises(ValueError, match="req_id_per_token is on meta, expected cpu"):
        convert(topk, req.to("meta"), bt, block_size=4)


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    st = None

if st is not None:
    @settings(max_examples=30, deadline=None)
    @given(T=st.integers(0, 6), K=st.integers(1, 40), B=st.sampled_from([1, 2, 3, 16]),
           extra=st.integers(0, 4), R=st.integers(1, 3), NB=st.integers(1, 4), P=st.integers(0, 3),
           compact=st.booleans(), use_lens=st.booleans(), seed=st.integers(0, 2**16))
    def test_property_triton_equals_formula(T, K, B, extra, R, NB, P, compact, use_lens, seed):
        """Random shapes, holes in the block table, invalid ids/positions (unchecked),
        prefill tokens mixed in: the kernel equals the plain-Python formula."""
        g = torch.Generator().manual_seed(seed)
        topk, req, bt = make_case(g, T, K, R, NB, B, holes=True)
        topk = torch.where(torch.rand(T, K, generator=g) < 0.1, topk + NB * B, topk)  # beyond NB
        req = torch.where(torch.rand(T, generator=g) < 0.1, req + R, req)  # bad request rows
        seq = torch.randint(0, NB * B + 1, (R,), generator=g).to(torch.int32)
        kw, pre, ws, wl = {}, None, None, None
        if P:
            pre = torch.randint(-1, P + 1, (T,), generator=g).to(torch.int32)  # P = out of range
            ws = torch.randint(0, 100, (P,), generator=g).to(torch.int32)
            wl = torch.randint(0, NB * B + 1, (P,), generator=g).to(torch.int32) if use_lens else None
            kw = dict(prefill_request_id=pre, workspace_starts=ws, workspace_lens=wl)
        want, want_n = naive(topk, req, bt, B, B + extra, seq_lens=seq, pre=pre, ws=ws, wl=wl, compact=compact)
        for impl in IMPLS:
            got = convert(topk, req, bt, block_size=B, block_stride=B + extra, seq_lens=seq,
                                           compact=compact, return_valid_counts=True, validate=False,
                                           impl=impl, **kw)
            assert torch.equal(got.physical, want), impl
            assert torch.equal(got.valid_counts, want_n), impl
