"""The mini engine's one-step-ahead loop (``async_steps``): the host prepares and
launches step t + 1 before it waits for step t. On CPU a step has run when its calls
return, so these tests stand a recording event in for the CUDA one: each step's event
is "done" only once the loop has waited on it. They check the bookkeeping: a request
is released only after the step that finished it was waited for, releases do come
after the next step was launched (the loop did run ahead), arrivals are admitted, and
every output and counter equals the step-by-step loop's."""

from __future__ import annotations

import pytest
import torch

from hisparse_tools import mini_engine as me
from hisparse_tools.mini_engine.kv import KV_STORES


class _Event:
    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        self.done = True


def _cfg(**kw):
    base = dict(num_layers=2, num_requests=6, arrival_every=1, min_prompt=20, max_prompt=30,
                min_decode=2, max_decode=6, max_num_reqs=3)
    return me.MiniEngineConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", ["resident", "hisparse"])
@pytest.mark.parametrize("mode", [None, me.DecodeMode.PADDED])
def test_one_step_ahead_serves_what_step_by_step_serves(monkeypatch, kind, mode):
    cfg = _cfg(validate=mode is None)
    plain = me.run_engine(cfg, kind, decode_mode=mode)

    events: list[_Event] = []  # one per launched step, in order
    finishing: list[set[int]] = []  # the requests each step finishes, same order
    releases: list[tuple[int, int]] = []  # (request, steps launched when it was released)

    def step_event(self):
        events.append(_Event())
        return events[-1]

    orig_batch = me.MiniEngine._batch

    def batch(self, items):
        finishing.append({r.rid for r, n in items if r.done + n >= r.total})
        return orig_batch(self, items)

    store = KV_STORES[kind]
    orig_release = store.release

    def release(self, r):
        step = next(i for i, s in enumerate(finishing) if r.rid in s)
        assert events[step].done, f"request {r.rid} released before its last step {step} was waited for"
        releases.append((r.rid, len(events)))
        return orig_release(self, r)

    monkeypatch.setattr(me.MiniEngine, "_step_event", step_event)
    monkeypatch.setattr(me.MiniEngine, "_batch", batch)
    monkeypatch.setattr(store, "release", release)
    ahead = me.run_engine(cfg, kind, decode_mode=mode)

    assert ahead["steps"] == plain["steps"] and ahead["tokens"] == plain["tokens"]
    assert len(ahead["step_times"]) == len(plain["step_times"]) == len(events)
    for rid, out in plain["outputs"].items():
        assert torch.equal(out, ahead["outputs"][rid]), rid
    assert ahead["stats"] == plain["stats"]
    assert sorted(r for r, _ in releases) == list(range(6))
    # the loop ran ahead: some request was released after the step behind its last was launched
    last = {rid: next(i for i, s in enumerate(finishing) if rid in s) for rid, _ in releases}
    assert any(launched > last[rid] + 1 for rid, launched in releases), (releases, last)


def test_step_by_step_releases_at_once(monkeypatch):
    seen = []
    store = KV_STORES["hisparse"]
    orig = store.release
    monkeypatch.setattr(me.MiniEngine, "_step_event", lambda self: _Event())
    monkeypatch.setattr(store, "release", lambda self, r: (seen.append(r.rid), orig(self, r))[1])
    res = me.run_engine(_cfg(async_steps=False), "hisparse")
    assert sorted(seen) == list(range(6)) and res["steps"] > 0


def test_sync_steps_option():
    from hisparse_tools.mini_engine.cli import build_parser, config_from_args
    assert config_from_args(build_parser().parse_args([])).async_steps is True
    assert config_from_args(build_parser().parse_args(["--sync-steps"])).async_steps is False
    with pytest.raises(TypeError, match="async_steps"):
        _cfg(async_steps=1)
