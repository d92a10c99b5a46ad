"""``overlap="auto"`` (``hisparse.decode.auto``): the rule on a fake clock, and auto layers
over real CPU caches (the same cache state as a serial layer, bit for bit; the output
of whichever mode ran). Its CUDA-event timings: ``tests/test_decode_auto_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from hisparse.attention.reference import ReferenceBackend
from hisparse.decode import DecodeLayer, Overlap
from hisparse.decode.auto import EXPLORE_EVERY, MIN_SAMPLES, SAMPLE_EVERY, WINDOW, ModeChooser

from invariants import assert_same, check_cache, snapshot
from test_decode_layer import I32, SM, STATE, make, qs

SPLIT, SERIAL = Overlap.SPLIT, Overlap.SERIAL


class FakeClock:
    """Seconds that move only inside a call, by the cost given for its mode."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def runner(clock: FakeClock, cost: dict, log: list):
    def call(mode):
        log.append(mode)
        clock.now += cost[mode] * 1e-6
        return mode
    return call


def _timed_both(cost: dict | None = None):
    """A chooser (no untimed runs) after the first calls of key (0, 8), with the clock,
    the call and the log of modes run."""
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=0)
    call = runner(clock, cost or {SPLIT: 120.0, SERIAL: 100.0}, log)
    for _ in range(2 * MIN_SAMPLES):
        ch.run(0, 8, call, capturing=False)
    return ch, call, log


def test_first_calls_time_both_modes_then_the_faster_runs():
    ch, call, log = _timed_both()
    assert log == [SPLIT, SERIAL] * MIN_SAMPLES  # alternating, split first
    log.clear()
    for _ in range(EXPLORE_EVERY):
        ch.run(0, 8, call, capturing=False)
    assert log.count(SERIAL) == EXPLORE_EVERY - 1 and log.count(SPLIT) == 1, log  # one exploring call
    rep = ch.report()["0/8"]
    assert rep["chosen"] == "serial"
    assert rep["cost_us"] == {"split": pytest.approx(120.0), "serial": pytest.approx(100.0)}
    assert rep["runs"] == {"split": MIN_SAMPLES + 1, "serial": MIN_SAMPLES + EXPLORE_EVERY - 1}


def test_the_choice_follows_a_change_of_costs():
    """Split becomes the faster mode (e.g. the hit rate fell into split's range): the
    exploring calls notice it and the choice moves within a few explore periods."""
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=0)
    cost = {SPLIT: 150.0, SERIAL: 100.0}
    call = runner(clock, cost, log)
    for _ in range(3 * EXPLORE_EVERY):
        ch.run(3, 64, call, capturing=False)
    assert ch.mode_now(3, 64) is SERIAL
    cost[SPLIT], cost[SERIAL] = 80.0, 100.0
    for _ in range((WINDOW + 2) * EXPLORE_EVERY):
        ch.run(3, 64, call, capturing=False)
    assert ch.mode_now(3, 64) is SPLIT
    log.clear()
    for _ in range(EXPLORE_EVERY):
        ch.run(3, 64, call, capturing=False)
    assert log.count(SPLIT) == EXPLORE_EVERY - 1


class _Event:
    """A CUDA event stand-in whose completion the test decides."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_Event") -> float:
        return end.ms


def test_timings_still_on_the_way_do_not_make_the_modes_alternate():
    """A host far ahead of the GPU: each mode's first timing has completed, the others
    are still pending. The calls then run the mode of the lower cost so far, untimed,
    instead of alternating until every timing is in; a capture takes the same mode."""
    from hisparse.decode.auto import _Key
    k = _Key()
    runs = []
    for _ in range(2 * MIN_SAMPLES):  # both modes' timings enqueued, none completed
        mode, timed = k.choose(0)
        assert timed
        end = _Event()
        end.ms = {SPLIT: 0.120, SERIAL: 0.100}[mode]
        k.pending.append((mode, _Event(), end))
        k.calls += 1
        k.runs[mode] += 1
        runs.append(mode)
    assert runs.count(SPLIT) == runs.count(SERIAL) == MIN_SAMPLES
    mode, timed = k.choose(0)  # nothing completed yet: they alternate
    assert not timed
    for m in (SPLIT, SERIAL):  # the first timing of each mode completes
        next(p for p in k.pending if p[0] is m)[2].done = True
    k.pending[0][2].done = k.pending[1][2].done = True  # (poll takes completed ones in order)
    k.poll([])
    assert k.best() is None and all(k.times[m] for m in (SPLIT, SERIAL))
    for i in range(10):
        k.calls += 1
        assert k.choose(0) == (SERIAL, False)
    ch = ModeChooser("cpu")
    ch.keys[(0, 8)] = k
    assert ch.mode_now(0, 8) is SERIAL  # a capture now keeps what the eager calls run


def test_keys_are_per_layer_and_batch_size():
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=0)
    fast_split = runner(clock, {SPLIT: 50.0, SERIAL: 90.0}, log)
    fast_serial = runner(clock, {SPLIT: 90.0, SERIAL: 50.0}, log)
    for _ in range(4 * MIN_SAMPLES):
        ch.run(0, 4, fast_split, capturing=False)
        ch.run(0, 64, fast_serial, capturing=False)
        ch.run(1, 4, fast_serial, capturing=False)
    assert (ch.mode_now(0, 4), ch.mode_now(0, 64), ch.mode_now(1, 4)) == (SPLIT, SERIAL, SERIAL)
    assert ch.mode_now(2, 4) is SPLIT  # never seen: split


def test_a_capture_keeps_the_mode_chosen_so_far_and_times_nothing():
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=0)
    call = runner(clock, {SPLIT: 120.0, SERIAL: 100.0}, log)
    assert ch.run(0, 8, call, capturing=True) is SPLIT  # nothing known: split
    assert ch.keys == {}
    for _ in range(2 * MIN_SAMPLES):
        ch.run(0, 8, call, capturing=False)
    before = ch.report()
    for _ in range(5):
        assert ch.run(0, 8, call, capturing=True) is SERIAL
    assert ch.report() == before


def test_a_call_that_raises_changes_nothing():
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=0)
    call = runner(clock, {SPLIT: 120.0, SERIAL: 100.0}, log)
    ch.run(0, 8, call, capturing=False)
    before = ch.report()

    def bad(mode):
        clock.now += 1.0
        raise ValueError("bad input")
    with pytest.raises(ValueError, match="bad input"):
        ch.run(0, 8, bad, capturing=False)
    with pytest.raises(ValueError, match="bad input"):
        ch.run(5, 2, bad, capturing=False)
    assert ch.report() == before and set(ch.keys) == {(0, 8)}
    assert ch.run(0, 8, call, capturing=False) is SERIAL  # the next mode still the one owed


@pytest.mark.parametrize("warm", [1, 2])
def test_the_first_runs_of_each_mode_are_not_timed(warm):
    """A mode's first ``warm`` calls of a key (compiling; with graphs the eager call and
    the capture) say nothing of its steady cost: they are not timed, and their cost
    (here 100x) does not decide anything."""
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=warm)
    cost = {SPLIT: 10_000.0, SERIAL: 10_000.0}
    call = runner(clock, cost, log)
    for _ in range(2 * warm):
        ch.run(0, 8, call, capturing=False)
    assert log == [SPLIT, SERIAL] * warm
    k = ch.keys[(0, 8)]
    assert not k.times[SPLIT] and not k.times[SERIAL]
    cost[SPLIT], cost[SERIAL] = 80.0, 100.0
    for _ in range(2 * MIN_SAMPLES):
        ch.run(0, 8, call, capturing=False)
    assert log[2 * warm:] == [SPLIT, SERIAL] * MIN_SAMPLES
    assert ch.mode_now(0, 8) is SPLIT
    assert ch.report()["0/8"]["cost_us"] == {"split": pytest.approx(80.0), "serial": pytest.approx(100.0)}


def test_the_chosen_mode_is_timed_every_few_calls():
    ch, call, _ = _timed_both()
    k = ch.keys[(0, 8)]
    n0 = len(k.times[SERIAL])
    calls0 = k.calls
    for _ in range(4 * SAMPLE_EVERY):
        ch.run(0, 8, call, capturing=False)
    timed = sum(1 for c in range(calls0, calls0 + 4 * SAMPLE_EVERY)
                if c % SAMPLE_EVERY == 0 and c % EXPLORE_EVERY != EXPLORE_EVERY - 1)
    assert len(k.times[SERIAL]) == min(WINDOW, n0 + timed)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_auto_layer_keeps_the_serial_state_and_returns_its_modes_outputs(kernels):
    """Auto runs split, serial, then its choice; after every call the cache is the
    serial twin's bit for bit, and the output is the one the mode that ran gives."""
    ca, _ = make(kernels, "fp8_ds_mla")
    cs, _ = make(kernels, "fp8_ds_mla")
    auto = DecodeLayer(ca, ReferenceBackend(), kernels=kernels)  # the default
    assert auto.overlap is Overlap.AUTO
    serial = DecodeLayer(cs, ReferenceBackend(), overlap="serial", kernels=kernels)
    ids = torch.tensor([1, 5], dtype=I32)
    for step in range(4 * (MIN_SAMPLES + 1) + 2):
        tk = torch.tensor([[39 - step, 3, 20, 11, 0, 1], [29, 28 - step, 13, 14, 15, 2]], dtype=I32)
        q = qs(2, step)
        out, lse = auto(step % 2, ids, tk, q, sm_scale=SM)
        ref, ref_lse = serial(step % 2, ids, tk, q, sm_scale=SM)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
        for n in STATE:
            assert torch.equal(getattr(ca.state, n), getattr(cs.state, n)), (step, n)
        assert torch.equal(ca.hot, cs.hot)
        check_cache(ca)
    rep = auto.auto_report()
    assert set(rep) == {"0/2", "1/2"}
    assert all(r["runs"]["split"] >= MIN_SAMPLES and r["runs"]["serial"] >= MIN_SAMPLES for r in rep.values())
    assert DecodeLayer(ca, ReferenceBackend(), overlap="split").auto_report() == {}


def test_auto_layer_refuses_bad_input_before_anything_changes():
    c, _ = make("torch", "fp8_ds_mla")
    layer = DecodeLayer(c, ReferenceBackend())
    before = snapshot(c)
    with pytest.raises(ValueError, match="rows but q has"):
        layer(0, torch.tensor([1], dtype=I32), torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=I32), qs(2, 0), sm_scale=SM)
    with pytest.raises((ValueError, TypeError)):
        layer(0, torch.tensor([1], dtype=I32), torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=I32), "q", sm_scale=SM)
    assert_same(snapshot(c), before)
    assert layer.auto_report() == {}


def test_begin_finish_on_an_auto_layer_is_split_and_serial_refuses():
    c, _ = make("torch", "fp8_ds_mla")
    layer = DecodeLayer(c, ReferenceBackend(), overlap="auto")
    ids = torch.tensor([1, 5], dtype=I32)
    tk = torch.tensor([[39, 3, 20, 11, 0, 1], [29, 28, 13, 14, 15, 2]], dtype=I32)
    q = qs(2, 1)
    out, _ = layer.finish(layer.begin(0, ids, tk, num_heads=q.shape[1]), q, sm_scale=SM)
    assert layer.auto_report() == {}  # a begun call is not timed
    c2, _ = make("torch", "fp8_ds_mla")
    ref, _ = DecodeLayer(c2, ReferenceBackend(), overlap="split")(0, ids, tk, q, sm_scale=SM)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="this layer is serial"):
        DecodeLayer(c, ReferenceBackend(), overlap="serial").begin(0, ids, tk, num_heads=q.shape[1])


def test_with_backend_shares_the_timings():
    c, _ = make("torch", "fp8_ds_mla")
    layer = DecodeLayer(c, ReferenceBackend())
    assert layer.with_backend(ReferenceBackend()).chooser is layer.chooser


def test_a_call_that_was_not_steady_is_not_timed():
    """``steady()`` False after the call (it captured a graph): its timing is dropped."""
    clock, log = FakeClock(), []
    ch = ModeChooser("cpu", clock=clock, warm=0)
    call = runner(clock, {SPLIT: 120.0, SERIAL: 100.0}, log)
    ch.run(0, 8, call, capturing=False, steady=lambda: False)
    assert not ch.keys[(0, 8)].times[SPLIT] and ch.keys[(0, 8)].runs[SPLIT] == 1
    assert ch.run(0, 8, call, capturing=False, steady=lambda: True) is SERIAL  # the fewer runs
    assert list(ch.keys[(0, 8)].times[SERIAL]) == [pytest.approx(100.0)]
    assert ch.run(0, 8, call, capturing=False, steady=lambda: True) is SPLIT  # still owed a timing
    assert list(ch.keys[(0, 8)].times[SPLIT]) == [pytest.approx(120.0)]


def test_the_resident_path_is_not_timed():
    """Every live request resident: both modes run the same work, so an auto layer runs
    it untimed (no key, no graph per mode)."""
    from test_paged_decode import _cache
    c = _cache(3, kernels="torch")
    layer = DecodeLayer(c, ReferenceBackend())
    ids = torch.tensor([3, 7], dtype=I32)
    tk = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [1, 0, -1, -1, 3, 2, 4, 5]], dtype=I32)
    for _ in range(3):
        layer(0, ids, tk, qs(2, 0), sm_scale=SM)
    assert layer.auto_report() == {}
