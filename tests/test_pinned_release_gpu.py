"""A pinned host pool freed by the garbage collector during a CUDA graph capture (H200).

``torch.cuda.graph`` does not collect before capturing, so a pool left in a reference
cycle by earlier work can be freed mid-capture; undoing its page-lock there would
invalidate the capture. hisparse defers the release to the next safe point.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hisparse import device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _pool_in_a_cycle(nbytes: int) -> tuple[int, list]:
    buf = device.PinnedBuffer(nbytes)
    assert buf.pinned
    cycle = [buf]
    cycle.append(cycle)
    return buf.tensor.data_ptr(), cycle


@pytest.fixture
def collect_only_when_asked():
    """No automatic collection: what the test drops is freed by its gc.collect() inside
    the capture, not before it. What earlier tests of the same process left in cycles is
    collected first, outside any capture: it may hold a torch CUDAGraph, whose destructor
    (a graph reset) is refused inside a capture and would invalidate it, and its pinned
    pools would add to the count of deferred releases the first test expects."""
    gc.collect()
    device.release_deferred_pins()
    assert not device._DEFERRED
    gc.disable()
    yield
    gc.enable()


@pytest.mark.usefixtures("collect_only_when_asked")
def test_a_pool_freed_during_a_capture_leaves_the_capture_whole():
    ptr, cycle = _pool_in_a_cycle(1 << 20)
    x = torch.arange(4096, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        del cycle
        gc.collect()  # frees the pool mid-capture
        y = x * 2 + 1
        assert ptr in device._DEFERRED and ptr in device._REGISTERED
    x.copy_(torch.arange(4096, device="cuda", dtype=torch.float32) * 3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2 + 1)
    assert device.release_deferred_pins() == 1
    assert ptr not in device._REGISTERED and not device._DEFERRED


@pytest.mark.usefixtures("collect_only_when_asked")
def test_a_group_freed_during_another_groups_capture(monkeypatch):
    """A whole engine group (pinned pool, streams, device state) dropped in a reference
    cycle and collected inside a capture; the next prepare_for_batch releases its pool."""
    import test_engine
    from test_engine import build, make_group

    monkeypatch.setattr(test_engine, "DEVICE", "cuda")
    dead = make_group()
    ptr = dead._cache.pool.buffer.tensor.data_ptr()
    assert ptr in device._REGISTERED
    dead.self_ref = dead
    del dead
    g = make_group(validate=False)
    g.add_request(0)
    g.prepare_for_batch(build([(0, 1, 1)], num_decodes=0))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    x = torch.ones(256, device="cuda")
    with torch.cuda.graph(graph):
        gc.collect()
        y = x + 1
        assert ptr in device._DEFERRED
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1)
    g.prepare_for_batch(build([(0, 1, 1)], num_decodes=0))  # the unwritten forward, again
    assert not device._DEFERRED and ptr not in device._REGISTERED
