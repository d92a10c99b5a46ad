"""The per-layer graphs' event bookkeeping, on CPU with stand-in CUDA events.

The cache's events are None on CPU, so the trace tests never exercise what
``LayerGraphs`` does with them. Here each ``_Event`` holds a stand-in that behaves as a
CUDA event does in the one way that matters: an event whose last record was made during
a stream capture can't be waited on by a stream outside a capture (CUDA answers
``cudaErrorInvalidValue``; the first GPU run of the per-layer graphs failed so). Pinned:
a capture records only stand-ins (``CacheGraphs.capture``), leaves every flag as it was and
reports the events it recorded; a replay marks exactly those as recorded by a replay;
the wait before a replay picks only events last recorded eagerly.
"""

from __future__ import annotations

import pytest
import torch

from graph_trace import TraceShape, make_group
from hisparse.engine.layer_graphs import LayerGraphs


class _Stream:
    def __init__(self, capturing: bool = False) -> None:
        self.capturing = capturing
        self.waited: list = []

    def wait_event(self, ev) -> None:
        if ev.captured and not self.capturing:
            raise RuntimeError("cudaErrorInvalidValue: an event recorded during capture, waited on outside")
        self.waited.append(ev)


class _CudaEvent:
    def __init__(self) -> None:
        self.captured = False
        self.records = 0

    def record(self, stream=None) -> None:
        self.captured = bool(stream is not None and stream.capturing)
        self.records += 1


class _Backend:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream

    def capture(self, fn):
        self.stream.capturing = True
        try:
            fn()
        finally:
            self.stream.capturing = False
        return "graph"

    def replay(self, graph) -> None:
        pass


def _setup(monkeypatch):
    g = make_group(TraceShape(layers=2), "cpu", "torch")
    cs = g.hisparse_cache.streams
    monkeypatch.setattr(torch.cuda, "Event", _CudaEvent)  # what a capture makes its stand-ins of
    monkeypatch.setattr(cs, "cuda", True)
    for ev in cs.events():
        ev.event = _CudaEvent()
    cur = _Stream()
    monkeypatch.setattr(cs, "current", lambda: cur)
    side = _Stream()
    lg = LayerGraphs(g.hisparse_cache, _Backend(side))
    cs.resolved[0].record(_Stream(), False)  # eager work before the capture
    cs.backup.record(_Stream(), False)
    return cs, cur, side, lg


def _captured_calls(cs, side):
    def fn():  # what the cache's launches record inside a capture
        cs.stage[0].record(side, True)
        cs.resolved[0].record(side, True)
    return fn


def test_a_capture_records_stand_ins_and_a_replay_flags_its_events(monkeypatch):
    cs, cur, side, lg = _setup(monkeypatch)
    real = {id(ev): ev.event for ev in cs.events()}
    before = cs.flags()
    got = lg._capture(("convert", 0), _captured_calls(cs, side))
    assert cs.flags() == before, "a capture changed the events' flags"
    assert all(ev.event is real[id(ev)] for ev in cs.events()), "the real events were not given back"
    assert cs.resolved[0].event.records == 1 and not cs.resolved[0].event.captured
    assert cs.stage[0].event.records == 0
    assert got.events == [cs.stage[0], cs.resolved[0]]
    recorded = [e for e in got.lent if e.records]
    assert len(recorded) == 2 and all(e.captured for e in recorded), "the capture recorded the stand-ins"
    lg.cache.graphs._before_replay(0, resolve=False)  # both last recorded eagerly: waited on
    assert cur.waited == [cs.resolved[0].event, cs.backup.event]
    lg._replay(got, "convert")
    assert (cs.stage[0].recorded, cs.stage[0].in_capture) == (True, True)
    assert (cs.resolved[0].recorded, cs.resolved[0].in_capture) == (True, True)
    assert (cs.backup.recorded, cs.backup.in_capture) == (True, False)
    cur.waited.clear()
    lg.cache.graphs._before_replay(0, resolve=False)  # the replay's record is ordered already
    assert cur.waited == [cs.backup.event]
    assert lg.report() == {"graphs": 1, "eager": 0, "captures": 1, "replays": 1, "copies": 0,
                           "in_place_graphs": 0, "write_replays": 0, "convert_replays": 1}


def test_without_stand_ins_the_wait_before_the_first_replay_is_invalid(monkeypatch):
    """What the stand-ins prevent: recording the real events during the capture makes
    the eager wait before the first replay invalid, as it was on the GPU."""
    cs, cur, side, lg = _setup(monkeypatch)
    monkeypatch.setattr(cs, "cuda", False)  # no stand-ins: the capture records the real events
    lg._capture(("convert", 0), _captured_calls(cs, side))
    monkeypatch.setattr(cs, "cuda", True)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        lg.cache.graphs._before_replay(0, resolve=False)
