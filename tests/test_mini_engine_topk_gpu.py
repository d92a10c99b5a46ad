"""The indexer top-k kernel on the H200 against its torch reference (run on the GPU
too), exactly, at the capacity benchmark's shapes and on the fallback paths."""

from __future__ import annotations

import pytest
import torch

from hisparse.tools.mini_engine import topk as T

pytestmark = pytest.mark.gpu


def _check(x: torch.Tensor, k: int) -> list[int]:
    want = T.topk_rows_reference(x, k)
    got, paths = T.topk_rows_triton(x, k, return_paths=True)
    assert torch.equal(got, want), int((got != want).sum())
    return paths.tolist()


@pytest.mark.parametrize("rows", [1, 13, 66, 140])
def test_capacity_shapes(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    C = 131072
    x = torch.randn(rows, C, generator=g, device="cuda")
    lim = torch.randint(0, C, (rows,), generator=g, device="cuda")
    lim[0] = C - 1
    x = x.masked_fill(torch.arange(C, device="cuda")[None, :] > lim[:, None], float("-inf"))
    paths = _check(x, 2048)
    fast = [p for p, n in zip(paths, (lim + 1).tolist()) if n > 2048]
    assert fast and all(p == T.PATH_CANDIDATES for p in fast), paths


def test_fallbacks_and_ties():
    g = torch.Generator(device="cuda").manual_seed(7)
    C = 40000
    x = torch.randint(-3, 4, (4, C), generator=g, device="cuda").float()  # heavy ties
    x[1] = 1.0  # all tied: more candidates than the scratch holds
    x[2, ::2] = float("-inf")
    x[3, (torch.arange(T.NS, device="cuda") * C) // T.NS] += 100.0  # the sample above the row
    paths = _check(x, 2048)
    assert paths[1] == T.PATH_ROW and paths[3] == T.PATH_ROW, paths
    y = torch.full((2, C), float("-inf"), device="cuda")
    y[0, ::40] = torch.randn(1000, generator=g, device="cuda")
    y[1, :1500] = torch.randn(1500, generator=g, device="cuda")
    assert _check(y, 2048) == [T.PATH_ALL_CANDIDATES, T.PATH_ALL_CANDIDATES]


def test_captured_in_a_graph():
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(8, 70000, generator=g, device="cuda")
    T.topk_rows_triton(x, 2048)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.topk_rows_triton(x, 2048)
    x.copy_(torch.randn(8, 70000, generator=g, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, T.topk_rows_reference(x, 2048))
