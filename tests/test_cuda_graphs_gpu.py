"""PriorityGraph: a torch-captured CUDA graph launched with its nodes' priorities (H200)."""

from __future__ import annotations

import pytest
import torch

from hisparse.cuda_graphs import PriorityGraph

pytestmark = pytest.mark.gpu


def test_priority_graph_replays_what_was_captured_across_streams():
    dev = torch.device("cuda")
    x = torch.randn(4096, 256, device=dev)
    w = torch.randn(256, 256, device=dev)
    side = torch.cuda.Stream(priority=-1)
    out_main = torch.empty(4096, 256, device=dev)
    out_side = torch.empty(4096, device=dev)

    def step():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out_side.copy_(x.sum(dim=1))
        out_main.copy_(x @ w)
        torch.cuda.current_stream().wait_stream(side)

    step()
    torch.cuda.synchronize()
    pg = PriorityGraph()
    with torch.cuda.graph(pg.graph):
        step()
    pg.instantiate()
    for _ in range(3):
        x.normal_()
        pg.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out_main, x @ w, rtol=1e-4, atol=1e-3)
        assert torch.allclose(out_side, x.sum(dim=1), rtol=1e-4, atol=1e-3)


def test_replay_instantiates_once_on_first_use():
    dev = torch.device("cuda")
    a = torch.zeros(8, device=dev)
    a.add_(1)
    torch.cuda.synchronize()
    pg = PriorityGraph()
    with torch.cuda.graph(pg.graph):
        a.add_(1)
    pg.replay()
    pg.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, torch.full((8,), 3.0, device=dev))  # eager 1, capture runs nothing, 2 replays
