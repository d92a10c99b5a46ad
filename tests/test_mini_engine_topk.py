"""The mini engine's indexer top-k kernel against its torch reference, exactly, on every
path through the kernel (interpreter on the CPU; small block, sample and scratch sizes
so rows of a few thousand scores take each path)."""

from __future__ import annotations

import pytest
import torch

from hisparse.tools.mini_engine import topk as T

SMALL = dict(block=128, sample=64, cap=256)


def _check(x: torch.Tensor, k: int, path: int | None = None, **sizes) -> torch.Tensor:
    want = T.topk_rows_reference(x, k)
    got, paths = T.topk_rows_triton(x, k, return_paths=True, **(sizes or SMALL))
    assert torch.equal(got, want), (k, x.shape, int((got != want).sum()))
    if path is not None:
        assert paths.tolist() == [path] * x.shape[0], paths.tolist()
    return paths


def test_reference_definition():
    x = torch.tensor([[0.5, -0.0, 2.0, 0.0, float("nan"), float("-inf"), 2.0, float("inf")]])
    # K largest finite-or-+inf, ties to the smaller index, -0.0 == +0.0, index order
    assert T.topk_rows_reference(x, 3).tolist() == [[2, 6, 7]]
    assert T.topk_rows_reference(x, 5).tolist() == [[0, 1, 2, 6, 7]]  # the 0.0 tie: index 1 first
    assert T.topk_rows_reference(x, 8).tolist() == [[0, 1, 2, 3, 6, 7, -1, -1]]
    assert T.topk_rows_reference(x, 10).tolist() == [[0, 1, 2, 3, 6, 7, -1, -1, -1, -1]]


def test_short_rows_select_from_the_candidates():
    g = torch.Generator().manual_seed(0)
    _check(torch.randn(3, 200, generator=g), 40, T.PATH_CANDIDATES)  # C <= cap: every score a candidate
    _check(torch.randn(2, 30, generator=g), 64, T.PATH_ALL_CANDIDATES)  # fewer scores than K


def test_long_rows_select_from_the_sample_candidates():
    g = torch.Generator().manual_seed(1)
    sizes = dict(block=128, sample=256, cap=512)  # a sample large enough to land in the scratch
    x = torch.randn(4, 3000, generator=g) * torch.tensor([[1.0], [1e-30], [1e30], [-5.0]])
    _check(x, 50, T.PATH_CANDIDATES, **sizes)
    _check(-1.0 - torch.rand(3, 3000, generator=g), 40, T.PATH_CANDIDATES, **sizes)  # all negative
    _check(torch.randn(2, 2999, generator=g), 53, T.PATH_CANDIDATES, **sizes)  # C, K not multiples of anything


def test_many_ties_fall_back_to_the_row():
    g = torch.Generator().manual_seed(2)
    _check(torch.ones(2, 1000), 100, T.PATH_ROW)  # every score equal: the first K
    x = torch.randint(-2, 3, (3, 1500), generator=g).float()
    x[1] = torch.where(x[1] == 0, -0.0, x[1])  # -0.0 ties with +0.0
    _check(x, 300, T.PATH_ROW)


def test_a_sample_above_the_row_falls_back_to_the_row():
    """The sampled scores are the row's largest: fewer than K candidates."""
    g = torch.Generator().manual_seed(3)
    C, ns = 2048, SMALL["sample"]
    x = torch.rand(2, C, generator=g)
    x[:, (torch.arange(ns) * C) // ns] += 10.0
    _check(x, 100, T.PATH_ROW)


def test_masked_rows():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 2000, generator=g)
    x[0, 700:] = float("-inf")  # the masked tail of a decode token
    x[1, :] = float("-inf")  # a padding token: nothing
    x[2, 100:] = float("-inf")  # 100 finite < K: all of them
    x[3, ::3] = float("nan")
    paths = _check(x, 150).tolist()
    assert paths[1:3] == [T.PATH_ALL_CANDIDATES, T.PATH_ALL_CANDIDATES]
    assert paths[0] in (T.PATH_CANDIDATES, T.PATH_ROW) and paths[3] in (T.PATH_CANDIDATES, T.PATH_ROW)
    assert bool((T.topk_rows_triton(x, 150, **SMALL)[1] == -1).all())


def test_few_finite_scores_spread_over_a_long_row_come_from_the_row():
    """At most K finite scores, more than the scratch holds: written from the row."""
    x = torch.full((1, 4096), float("-inf"))
    x[0, ::10] = torch.arange(410, dtype=torch.float32)
    _check(x, 512, T.PATH_ALL_ROW)


def test_extremes_and_strided_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1200, generator=g)
    x[0, 17] = float("inf")
    x[0, 18] = 3.4e38
    x[1, :50] = -3.4e38
    x[1, 60] = 1e-45  # the smallest subnormal
    _check(x, 64)
    wide = torch.randn(3, 1500, generator=g)
    _check(wide[:, 100:1300], 77)  # a row stride wider than the row


def test_default_sizes_on_a_few_rows():
    g = torch.Generator().manual_seed(6)
    _check(torch.randn(2, 9000, generator=g), 256, T.PATH_CANDIDATES, block=T.BLOCK, sample=T.NS, cap=T.CAP)


def test_empty_and_bad_inputs():
    assert T.topk_rows_triton(torch.zeros(0, 10), 4).shape == (0, 4)
    assert T.topk_rows_triton(torch.zeros(2, 0), 3).tolist() == [[-1] * 3] * 2
    with pytest.raises(ValueError, match="fp32"):
        T.topk_rows_triton(torch.zeros(2, 8, dtype=torch.float16), 2)
    with pytest.raises(ValueError, match="unit column stride"):
        T.topk_rows_triton(torch.zeros(8, 2).T, 2)
    with pytest.raises(ValueError, match="power of two"):
        T.topk_rows_triton(torch.zeros(2, 8), 2, cap=100)
    with pytest.raises(ValueError, match="k must be"):
        T.topk_rows_triton(torch.zeros(2, 8), 0)
