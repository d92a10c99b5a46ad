"""Row-copy kernel (Triton interpreter on CPU) against ``copy_rows_reference``."""

from __future__ import annotations

import pytest
import torch

from hisparse.cache.resolve_ref import copy_rows_reference
from hisparse.cache.transfer import copy_rows, copy_staged


def _case(Ns: int, Nd: int, W: int, N: int, seed: int, *, skip: float = 0.3):
    """Random rows and index lists with -1, out-of-range entries and repeated sources;
    destinations are distinct so the result does not depend on write order."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (Ns, W), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (Nd, W), dtype=torch.uint8, generator=g)
    si = torch.randint(-1, Ns + 2, (N,), dtype=torch.int32, generator=g)  # -1 and Ns, Ns+1 invalid
    if Nd:
        perm = torch.randperm(Nd + 3, generator=g)[:N].to(torch.int32) - 1  # distinct, some -1 / >= Nd
        di = torch.full((N,), -1, dtype=torch.int32)
        di[: perm.numel()] = perm
    else:
        di = torch.randint(-1, 3, (N,), dtype=torch.int32, generator=g)
    drop = torch.rand(N, generator=g) < skip
    si[drop] = -1
    return src, si, dst, di


def _expected(src, si, dst, di):
    ok = (si >= 0) & (si < src.shape[0]) & (di >= 0) & (di < dst.shape[0])
    exp = dst.clone()
    copy_rows_reference(src, torch.where(ok, si, -1), exp, torch.where(ok, di, -1))
    return exp


@pytest.mark.parametrize("W", [16, 48, 656, 1152])
@pytest.mark.parametrize("N", [0, 1, 7, 33])
def test_matches_reference(W, N):
    src, si, dst, di = _case(11, 40, W, N, seed=W + N)
    exp = _expected(src, si, dst, di)
    copy_rows(src, si, dst, di)
    assert torch.equal(dst, exp)


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("warps", [1, 4])
def test_launch_shapes(rows, warps):
    """Several chunks per program (the interpreter grid has at most 3 programs)."""
    src, si, dst, di = _case(9, 60, 656, 50, seed=rows * 10 + warps)
    exp = _expected(src, si, dst, di)
    copy_rows(src, si, dst, di, rows_per_program=rows, num_warps=warps, programs_per_sm=2)
    assert torch.equal(dst, exp)


def test_all_skipped_and_empty_tensors():
    src, si, dst, di = _case(5, 6, 32, 6, seed=1)
    before = dst.clone()
    copy_rows(src, torch.full_like(si, -1), dst, di)
    assert torch.equal(dst, before)
    copy_rows(src[:0], si, dst, di)  # nothing to read
    copy_rows(src, si, dst[:0], di)  # nothing to write
    assert torch.equal(dst, before)


def test_views_of_a_pool_and_one_row():
    """Rows taken from a [L, H, W] pool view (as the host pool is) and a 1-row dst."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randint(0, 256, (3, 10, 64), dtype=torch.uint8, generator=g)
    dst = torch.zeros(1, 64, dtype=torch.uint8)
    copy_rows(pool[2], torch.tensor([7], dtype=torch.int32), dst, torch.tensor([0], dtype=torch.int32))
    assert torch.equal(dst[0], pool[2, 7])


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    """The torch fallback skips -1 and out-of-range indices like the kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    src, si, dst, di = _case(7, 9, 48, 20, seed=2)
    assert ((si >= 7) | (di >= 9)).any()
    exp = _expected(src, si, dst, di)
    copy_rows(src, si, dst, di)
    assert torch.equal(dst, exp)


def _bad(case):
    src, si, dst, di = _case(6, 6, 32, 4, seed=0)
    kw = {}
    if case == "src_dtype":
        src = src.view(torch.int8)
    elif case == "dst_1d":
        dst = dst.flatten()
    elif case == "width_mismatch":
        dst = torch.zeros(6, 48, dtype=torch.uint8)
    elif case == "width_not_16":
        src = torch.zeros(6, 24, dtype=torch.uint8)
        dst = torch.zeros(6, 24, dtype=torch.uint8)
    elif case == "idx_int64":
        si = si.long()
    elif case == "idx_len":
        di = di[:3]
    elif case == "idx_2d":
        si = si.reshape(2, 2)
    elif case == "rows_strided":
        src = torch.zeros(6, 64, dtype=torch.uint8)[:, :32]
    elif case == "misaligned":
        src = torch.zeros(6 * 32 + 8, dtype=torch.uint8)[8:].view(6, 32)
    elif case == "rows_per_program":
        kw["rows_per_program"] = 3
    elif case == "num_warps":
        kw["num_warps"] = 0
    elif case == "src_not_tensor":
        src = src.numpy()
    return src, si, dst, di, kw


@pytest.mark.parametrize("case,exc", [
    ("src_dtype", TypeError), ("dst_1d", ValueError), ("width_mismatch", ValueError),
    ("width_not_16", ValueError), ("idx_int64", TypeError), ("idx_len", ValueError),
    ("idx_2d", ValueError), ("rows_strided", ValueError), ("misaligned", ValueError),
    ("rows_per_program", ValueError), ("num_warps", ValueError), ("src_not_tensor", TypeError),
])
def test_bad_arguments_raise_before_launch(case, exc):
    src, si, dst, di, kw = _bad(case)
    before = dst.clone() if isinstance(dst, torch.Tensor) else None
    with pytest.raises(exc):
        copy_rows(src, si, dst, di, **kw)
    assert torch.equal(dst, before)


def _staged_case(T: int, K: int, seed: int, *, W: int = 48, Ns: int = 23, Nd: int = 0):
    """Per-group staging lists as a resolve leaves them: group t's list at [t*K, t*K +
    counts[t]) (a group of q tokens may list up to q*K entries, so a list can run into
    the next tokens' slices, whose counts are then 0), with -1 and out-of-range entries,
    and garbage past each count that must not be copied. Destinations are distinct."""
    g = torch.Generator().manual_seed(seed)
    Nd = Nd or T * K + 5
    src = torch.randint(0, 256, (Ns, W), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (Nd, W), dtype=torch.uint8, generator=g)
    si = torch.randint(-1, Ns + 2, (T * K,), dtype=torch.int32, generator=g)
    di = (torch.randperm(Nd + 2, generator=g)[:T * K] - 1).to(torch.int32)  # some -1 / >= Nd
    counts = torch.zeros(T, dtype=torch.int32)
    t = 0
    while t < T:
        q = int(torch.randint(1, 4, (1,), generator=g))  # a group of q tokens
        q = min(q, T - t)
        kind = int(torch.randint(0, 5, (1,), generator=g))
        counts[t] = [0, 1, K, q * K, int(torch.randint(0, q * K + 1, (1,), generator=g))][kind]
        t += q
    counts[torch.rand(T, generator=g) < 0.1] = -3  # negative counts stage nothing
    return src, si, dst, di, counts


def _staged_expected(src, si, dst, di, counts, K):
    T = counts.numel()
    exp = dst.clone()
    for t in range(T):
        m = max(0, min(int(counts[t]), (T - t) * K))
        for j in range(t * K, t * K + m):
            s, d = int(si[j]), int(di[j])
            if 0 <= s < src.shape[0] and 0 <= d < dst.shape[0]:
                exp[d] = src[s]
    return exp


@pytest.mark.parametrize("T,K", [(1, 4), (5, 3), (9, 1), (130, 2), (257, 1)])
@pytest.mark.parametrize("programs,rows", [(1, 1), (3, 2), (7, 8)])
def test_copy_staged_matches_reference(T, K, programs, rows):
    """Only the first counts[t] entries of each group's list are copied, however the
    chunks fall over the programs and over blocks of the count vector (T > 128)."""
    src, si, dst, di, counts = _staged_case(T, K, seed=T * 31 + K * 7 + programs + rows)
    exp = _staged_expected(src, si, dst, di, counts, K)
    copy_staged(src, si, dst, di, counts, K=K, programs=programs, rows_per_program=rows)
    assert torch.equal(dst, exp)


def test_copy_staged_nothing_to_stage():
    src, si, dst, di, counts = _staged_case(6, 4, seed=5)
    before = dst.clone()
    copy_staged(src, si, dst, di, torch.zeros_like(counts), K=4, programs=3)
    assert torch.equal(dst, before)
