"""A decode forward captured inside ``resident_capture`` is one chain of graph nodes (H200).

A graph with a forked stream launches every one of its nodes with more latency than a
straight chain, so with every request resident the captured writes mirror their rows
on the capturing stream and the resolve joins nothing. Checked on the captured graph's
own structure (``CUDAGraph.debug_dump``), then replayed against an eager group.
"""

from __future__ import annotations

import re

import pytest
import torch

import test_engine
from test_engine import K, L, R, batch_rows, build, fill, make_cfg, make_group, random_topk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _degrees(dot: str) -> tuple[int, dict, dict]:
    """(nodes, in-degree, out-degree) of a graphviz dump of a CUDA graph."""
    edges = re.findall(r'"?(\w+)"?\s*->\s*"?(\w+)"?', dot)
    nodes = set(re.findall(r'^\s*"?(\w+)"?\s*\[', dot, flags=re.M))
    ins, outs = {}, {}
    for a, b in edges:
        outs[a] = outs.get(a, 0) + 1
        ins[b] = ins.get(b, 0) + 1
    return len(nodes), ins, outs


def _pair(monkeypatch):
    monkeypatch.setattr(test_engine, "DEVICE", "cuda")
    probe = make_cfg()
    pool = probe.hot_rows_per_layer + R * 64 * 2  # every request resident (pages of 64 rows)
    groups = []
    for _ in range(2):
        g = make_group(device_pool_rows=pool, validate=False)
        for rid, n in ((0, 9), (1, 20)):
            fill(g, rid, n)
        groups.append(g)
    return groups


def test_a_resident_capture_is_one_chain_and_replays_the_eager_step(monkeypatch, tmp_path):
    eager, graphed = _pair(monkeypatch)
    assert graphed.hisparse_cache.all_resident()
    md = build([(0, 1, 10), (1, 1, 21)], num_decodes=2)
    rows = [batch_rows(layer, md) for layer in range(L)]
    tks = [random_topk(md, 7 + layer).cuda() for layer in range(L)]
    eager.prepare_for_batch(md)
    want = []
    for layer in range(L):
        eager.write_new_rows(layer, rows[layer], md)
        want.append(eager.convert_decode_logical_to_physical_topk(layer, tks[layer], md).clone())
    graphed.prepare_for_batch(md, pad_to=2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    with graphed.hisparse_cache.resident_capture(), torch.cuda.graph(graph):
        got = []
        for layer in range(L):
            graphed.write_new_rows(layer, rows[layer], md)
            got.append(graphed.convert_decode_logical_to_physical_topk(layer, tks[layer], md))
    dump = tmp_path / "graph.dot"
    graph.debug_dump(str(dump))
    n, ins, outs = _degrees(dump.read_text())
    assert n >= 2 * L, n  # a write and a resolve per layer at least
    assert sum(outs.values()) == n - 1, (n, outs)  # connected: a chain of n nodes has n - 1 edges
    assert max(ins.values(), default=0) <= 1 and max(outs.values(), default=0) <= 1, (ins, outs)
    graph.replay()
    torch.cuda.synchronize()
    for layer in range(L):
        assert torch.equal(got[layer], want[layer]), layer
        for rid in (0, 1):  # rows written inside the replay reached the host pool
            assert torch.equal(graphed.hisparse_cache.read_host_rows(layer, rid, [9 if rid == 0 else 20]),
                               eager.hisparse_cache.read_host_rows(layer, rid, [9 if rid == 0 else 20]))
    assert K == 4
