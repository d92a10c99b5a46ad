"""Decode forwards of the engine façade captured in CUDA graphs and replayed (H200).

One graph per batch-size bucket, captured over every layer's ``write_new_rows`` and
conversion (or ``decode_attention``); later forwards of the bucket are
``prepare_for_batch(md, pad_to=N, replay=True)`` + ``graph.replay()``. Over a trace
with joins and leaves the replayed group must equal an eager unpadded one after every
forward: physical indices, every cache state tensor, hot rows byte for byte, and every
host-pool row against the truth (rows written inside a replay reach the pinned pool).
"""

from __future__ import annotations

import pytest
import torch

from graph_trace import Runner, TraceShape, Truth, plan_trace, run_pair
from hisparse.attention.triton_backend import TritonBackend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run_pair(shape, steps, seed, attention=None, atol=None):
    truth = Truth(shape)
    trace = plan_trace(shape, steps=steps, seed=seed)
    a = Runner(shape, "eager", "cuda", "triton", truth, attention=attention)
    b = Runner(shape, "graph", "cuda", "triton", truth, attention=attention)
    run_pair(trace, a, b, atol=atol, check_rows=True)  # host mirror of rows written inside replays
    replays = sum(max(0, v - 1) for v in b.seen.values())
    a.check_rows()
    assert len(b.graphs) >= 2 and replays >= 10, (b.seen, replays)
    return a, b


@pytest.mark.parametrize("query_len,seed", [(1, 0), (2, 1)])
def test_replayed_forwards_equal_eager(query_len, seed):
    _, b = _run_pair(TraceShape(query_len=query_len), steps=60, seed=seed)
    assert b.group.stats()["total"]["misses"] > 0


@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_replayed_decode_attention_equals_eager(overlap):
    backend = TritonBackend(validate=False)
    _run_pair(TraceShape(), steps=40, seed=5, attention=(backend, overlap), atol=2e-2)


def test_replayed_forwards_equal_eager_with_a_pool():
    """The elastic tier under graph replay: resident requests written and resolved through
    pages, demotions between replays; rows written inside replays reach the host pool."""
    _, b = _run_pair(TraceShape(pool_rows=128 + 2 * 64), steps=60, seed=9)
    tot = b.group.stats()["total"]
    assert tot["resident_rows"] > 0 and tot["spills"] > 0, tot
