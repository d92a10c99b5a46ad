"""The mini engine's one-step-ahead loop (``async_steps``): the host prepares and
launches step t + 1 before it waits for step t. On CPU a step has run when its calls
return, so these tests stand a never-pending event in for the CUDA one: what they check
is the bookkeeping (requests released only once their last step is finished, slots
reused, arrivals admitted), which must leave every output and counter as the
step-by-step loop does."""

from __future__ import annotations

import pytest
import torch

from hisparse.tools import mini_engine as me


class _Event:
    def synchronize(self) -> None:
        return None


def _cfg(**kw):
    base = dict(num_layers=2, num_requests=6, arrival_every=1, min_prompt=20, max_prompt=30,
                min_decode=2, max_decode=6, max_num_reqs=3)
    return me.MiniEngineConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", ["resident", "hisparse"])
@pytest.mark.parametrize("mode", [None, me.DecodeMode.PADDED])
def test_one_step_ahead_serves_what_step_by_step_serves(monkeypatch, kind, mode):
    cfg = _cfg(validate=mode is None)
    plain = me.run_engine(cfg, kind, decode_mode=mode)
    order = []
    monkeypatch.setattr(me.MiniEngine, "_step_event", lambda self: _Event())
    from hisparse.tools.mini_engine.kv import KV_STORES
    store = KV_STORES[kind]
    rel, adm = store.release, store.admit
    monkeypatch.setattr(store, "release", lambda self, r: (order.append(("release", r.rid)), rel(self, r))[1])
    monkeypatch.setattr(store, "admit", lambda self, r: (order.append(("admit", r.rid)), adm(self, r))[1])
    ahead = me.run_engine(cfg, kind, decode_mode=mode)
    assert ahead["steps"] == plain["steps"] and ahead["tokens"] == plain["tokens"]
    assert len(ahead["step_times"]) == len(plain["step_times"])
    for rid, out in plain["outputs"].items():
        assert torch.equal(out, ahead["outputs"][rid]), rid
    assert ahead["stats"] == plain["stats"]
    # with 3 slots for 6 requests, later ones wait for a release: every request is
    # admitted once and released once, never more than 3 live at a time
    live, most = set(), 0
    for what, rid in order:
        (live.add if what == "admit" else live.remove)(rid)
        most = max(most, len(live))
    assert not live and most <= 3
    assert sorted(r for w, r in order if w == "admit") == list(range(6))


def test_sync_steps_option():
    from hisparse.tools.mini_engine.cli import build_parser, config_from_args
    assert config_from_args(build_parser().parse_args([])).async_steps is True
    assert config_from_args(build_parser().parse_args(["--sync-steps"])).async_steps is False
    with pytest.raises(TypeError, match="async_steps"):
        _cfg(async_steps=1)
