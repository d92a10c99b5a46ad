"""Releasing pinned host memory outside CUDA graph capture (hisparse.device).

A page-lock undone while a stream is being captured invalidates the capture, and the
garbage collector can free a host pool at any moment, captures included. These tests run
the release logic against a stand-in CUDA runtime on CPU; test_pinned_release_gpu.py runs
it under a real capture.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from hisparse import device


class FakeRuntime:
    def __init__(self):
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.unregister_error = 0

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 -- the runtime's name
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return self.unregister_error


@pytest.fixture
def rt(monkeypatch):
    fake = FakeRuntime()
    capture = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(device, "_capturing", lambda: capture["on"])
    monkeypatch.setattr(device, "_REGISTERED", {})
    monkeypatch.setattr(device, "_DEFERRED", {})
    fake.capture = capture
    return fake


def _pool_in_a_cycle(nbytes):
    """A pinned buffer that only the cycle collector can free; returns its pointer."""
    buf = device.PinnedBuffer(nbytes, pin=True)
    holder = {"buf": buf}
    holder["self"] = holder
    return buf.tensor.data_ptr()


def test_a_buffer_is_registered_exactly_and_released_when_its_last_view_goes(rt):
    buf = device.PinnedBuffer(3 * 4096 + 5, pin=True)
    ptr = buf.tensor.data_ptr()
    assert rt.registered == [(ptr, 3 * 4096 + 5)] and buf.tensor.numel() == 3 * 4096 + 5
    view = buf.tensor[100:200]
    view.fill_(7)
    del buf
    gc.collect()
    assert rt.unregistered == [] and device.is_pinned_host(view)  # a view keeps it pinned
    assert int(view.sum()) == 700
    del view
    gc.collect()
    assert rt.unregistered == [ptr] and ptr not in device._REGISTERED


def test_a_release_during_a_capture_waits_for_its_end_with_the_memory_mapped(rt):
    ptr = _pool_in_a_cycle(8192)
    rt.capture["on"] = True
    gc.collect()  # the pool is freed mid-capture
    assert rt.unregistered == []
    assert ptr in device._REGISTERED and ptr in device._DEFERRED
    keep = device._DEFERRED[ptr]
    assert not keep.closed and len(keep) == 8192  # still mapped: the address can't be reused
    assert device.release_deferred_pins() == 0  # still capturing: nothing yet
    rt.capture["on"] = False
    assert device.release_deferred_pins() == 1
    assert rt.unregistered == [ptr] and not device._DEFERRED and ptr not in device._REGISTERED
    assert device.release_deferred_pins() == 0


def test_the_next_pin_or_unpin_releases_what_a_capture_deferred(rt):
    first = _pool_in_a_cycle(4096)
    rt.capture["on"] = True
    gc.collect()
    rt.capture["on"] = False
    other = device.PinnedBuffer(4096, pin=True)  # the next pin releases it first
    assert rt.unregistered == [first]
    second = _pool_in_a_cycle(4096)
    rt.capture["on"] = True
    gc.collect()
    rt.capture["on"] = False
    other.release()  # and so does the next unpin
    assert rt.unregistered == [first, other.tensor.data_ptr(), second]
    assert not device._DEFERRED and not device._REGISTERED


def test_release_now_during_a_capture_is_deferred_too_and_runs_once(rt):
    buf = device.PinnedBuffer(4096, pin=True)
    ptr = buf.tensor.data_ptr()
    rt.capture["on"] = True
    buf.release()
    assert not buf.pinned and rt.unregistered == [] and ptr in device._DEFERRED
    rt.capture["on"] = False
    device.release_deferred_pins()
    del buf
    gc.collect()
    assert rt.unregistered == [ptr]  # once, not again when the buffer dies


def test_a_failed_unregister_is_reported_not_swallowed(rt):
    buf = device.PinnedBuffer(4096, pin=True)
    rt.unregister_error = 900
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        buf.release()
    assert any("cudaHostUnregister" in str(w.message) and "900" in str(w.message) for w in got)
    assert not device._REGISTERED


def test_prepare_for_batch_releases_deferred_pins(monkeypatch):
    from hisparse.engine import group as group_mod
    from test_engine import build, make_group

    calls = []
    monkeypatch.setattr(group_mod, "release_deferred_pins", lambda: calls.append(1) or 0)
    g = make_group()
    with pytest.raises(TypeError):
        g.prepare_for_batch("not metadata")
    assert calls == []  # refused before anything (the release itself is process-wide housekeeping)
    g.add_request(0)
    g.prepare_for_batch(build([(0, 1, 1)], num_decodes=0))
    assert calls == [1]


def test_a_release_outside_the_main_thread_waits_for_a_safe_point(rt):
    """Another thread's capture can't be seen, and a global-mode capture (torch's default)
    breaks on an unregister from any thread: a release there is deferred."""
    import threading

    ptr = _pool_in_a_cycle(4096)
    t = threading.Thread(target=gc.collect)
    t.start()
    t.join()
    assert rt.unregistered == [] and ptr in device._DEFERRED
    assert device.release_deferred_pins() == 1  # the main thread, no capture: released
    assert rt.unregistered == [ptr]


def test_a_release_started_inside_release_deferred_pins_is_not_lost(rt):
    """Garbage collection inside an unregister frees another pool, whose finalizer runs
    release_deferred_pins again: every range is released once, nothing raises."""
    late = device.PinnedBuffer(4096, pin=True)
    first = [_pool_in_a_cycle(4096) for _ in range(3)]
    rt.capture["on"] = True
    gc.collect()
    rt.capture["on"] = False
    real, fired = rt.cudaHostUnregister, []

    def unregister(ptr):
        if not fired:
            fired.append(1)
            late.release()  # as a finalizer run by a collection here would
        return real(ptr)

    rt.cudaHostUnregister = unregister
    device.release_deferred_pins()
    assert sorted(rt.unregistered) == sorted(first + [late.tensor.data_ptr()])
    assert not device._DEFERRED and not device._REGISTERED


def test_a_pin_off_the_main_thread_leaves_deferred_ranges_to_the_main_thread(rt):
    import threading

    ptr = _pool_in_a_cycle(4096)
    rt.capture["on"] = True
    gc.collect()
    rt.capture["on"] = False
    made = []
    t = threading.Thread(target=lambda: made.append(device.PinnedBuffer(4096, pin=True).tensor.data_ptr()))
    t.start()
    t.join()  # the thread's buffer died there too: deferred as well
    assert rt.unregistered == [] and set(device._DEFERRED) == {ptr, made[0]}
    assert device.release_deferred_pins() == 2 and sorted(rt.unregistered) == sorted([ptr, made[0]])
