"""P/D transfers (hisparse.pd) in the faults an independent review found: a reserved
request freed by the engine, an abort while a WRITE is in flight (quarantine), a notice
that raises or is malformed, the sender's error paths, close, a fragmented pool."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from hisparse.pd import PDDescriptor, PDError, PDReceiver, PDSender, StaleDescriptorError, TransferError
from hisparse.pd.descriptor import notice, parse_notice
from invariants import assert_same, check_cache, snapshot
from pd_helpers import (assert_rows, filled_cache, make_rows, nixl_or_skip, release_all, same_but_quarantined,
                        small_cfg)

pytestmark = pytest.mark.usefixtures("nixl")

_N = itertools.count()


@pytest.fixture(scope="module")
def nixl():
    nixl_or_skip()


@pytest.fixture(scope="module")
def sender(nixl):
    tx = PDSender(row_format="fp8_ds_mla", block_size=16)
    yield tx
    tx.close()


def receiver(cache):
    return PDReceiver(cache, name=f"test-faults-decode-{next(_N)}")


def test_free_request_of_a_reserved_request_closes_it_and_quarantines_its_blocks(sender):
    """A reserved request freed by the engine (cache.free_request): its reservation is
    closed at once, so a send of its descriptor is refused; its blocks are quarantined,
    so an ordinary request admitted next gets other blocks and its rows stay intact."""
    cache, truth = filled_cache(small_cfg(max_num_reqs=6))
    rx = receiver(cache)
    before = snapshot(cache)
    d7 = rx.reserve(7, 40)
    cache.free_request(7)
    assert rx.open_requests() == [] and set(rx.quarantined()) == {d7.generation}
    same_but_quarantined(before, snapshot(cache), rx)
    cache.add_request(9)
    rows9 = make_rows(9, 40)
    for layer in range(3):
        cache.write(layer, 9, rows9[layer])
    truth[9] = rows9
    assert not set(cache.pool.allocator.blocks(cache.request(9).slot)) & set(rx.quarantined()[d7.generation].blocks)
    with pytest.raises(StaleDescriptorError, match="nothing was written"):
        sender.send(d7, make_rows(7, 40))
    assert_rows(cache, truth)
    res = rx.poll()
    assert res.committed == () and "freed while reserved" in res.failed[7]
    with pytest.raises(TransferError, match="freed while reserved"):
        rx.wait(7)
    rx.close()


def test_a_free_the_receiver_missed_is_caught_by_the_slot_incarnation(sender):
    """Without the free listener (a free the receiver never heard of), the incarnation
    recorded at reserve tells the request readmitted in the same slot apart: commit is
    refused, the word is cleared (a send is refused), the new occupant is untouched."""
    cache, truth = filled_cache(small_cfg(max_num_reqs=6))
    rx = receiver(cache)
    d7 = rx.reserve(7, 40)
    cache.free_listeners.remove(rx._on_free)
    try:
        slot = cache.request(7).slot
        cache.free_request(7)
        assert cache.add_request(7) == 0 and cache.request(7).slot == slot  # the same id and slot: a new admission
        with pytest.raises(StaleDescriptorError, match="freed while reserved"):
            rx.commit(7, d7.generation)
        assert cache.request(7).lengths == (0, 0, 0) and rx.open_requests() == []
        with pytest.raises(StaleDescriptorError, match="nothing was written"):
            sender.send(d7, make_rows(7, 40))
        assert "freed while reserved" in rx.poll().failed[7]
        rows = make_rows(70, 5)
        for layer in range(3):
            cache.write(layer, 7, rows[layer])
        truth[7] = rows
        assert_rows(cache, truth)
    finally:
        cache.free_listeners.append(rx._on_free)
    rx.close()


def test_abort_while_a_write_is_in_flight_quarantines_until_the_done_notice(sender, monkeypatch):
    """The sender reads an open generation, then the decode side aborts and admits an
    ordinary request before the WRITE lands: the WRITE goes to quarantined blocks, the
    new request's rows stay intact, and the generation's done notice frees them."""
    cache, truth = filled_cache(small_cfg(max_num_reqs=6))
    rx = receiver(cache)
    d = rx.reserve(7, 40, timeout_s=60)
    real = PDSender._check_generation

    def read_then_decode_side_aborts(self, desc, peer):
        real(self, desc, peer)
        rx.abort(7)
        cache.add_request(9)
        rows9 = make_rows(9, 40)
        for layer in range(3):
            cache.write(layer, 9, rows9[layer])
        truth[9] = rows9

    monkeypatch.setattr(PDSender, "_check_generation", read_then_decode_side_aborts)
    rows7 = make_rows(7, 40)
    sender.send(d, rows7)
    assert_rows(cache, truth)
    q = rx.quarantined()[d.generation]
    pool = cache.pool.rows
    got = torch.cat([pool[0, b * 16:(b + 1) * 16] for b in q.blocks])[:40]
    assert torch.equal(got, rows7[0])  # the late WRITE landed in the quarantined blocks
    end = time.monotonic() + 10
    while rx.quarantined() and time.monotonic() < end:
        assert rx.poll() == type(rx.poll())((), {})
        time.sleep(0.005)
    assert rx.quarantined() == {} and rx.stale_notices == 0
    assert_rows(cache, truth)
    rx.close()


def test_quarantine_is_freed_after_quarantine_s_without_a_notice():
    cache, _ = filled_cache(small_cfg())
    q = 0.3
    rx = PDReceiver(cache, name=f"test-decode-{next(_N)}", quarantine_s=q)
    before = snapshot(cache)
    rx.reserve(7, 40)
    t0 = time.monotonic()
    rx.abort(7)
    same_but_quarantined(before, snapshot(cache), rx)
    rx.poll()
    if time.monotonic() - t0 < q:  # a loaded machine may take longer than q to get here
        assert rx.quarantined()  # not yet
    time.sleep(max(0.0, q - (time.monotonic() - t0)) + 0.05)
    rx.poll()
    assert rx.quarantined() == {}
    assert_same(before, snapshot(cache))
    rx.close()


def test_poll_handles_each_notice_on_its_own(sender):
    """A notice whose commit is refused (rows appended to the reserved request) aborts
    that request only; the other notice of the same poll commits, and its outcome is
    kept for wait. A malformed notice from a peer is counted and dropped."""
    cache, truth = filled_cache(small_cfg(max_num_reqs=6))
    rx = receiver(cache)
    d8, d7 = rx.reserve(8, 20), rx.reserve(7, 20)
    sender.send(d8, make_rows(8, 20))
    sender.send(d7, make_rows(7, 20))
    cache.write(0, 7, make_rows(0, 1)[0])[0]  # an engine bug: 7 appended before its commit
    committed, failed = [], {}
    end = time.monotonic() + 10
    while len(committed) + len(failed) < 2 and time.monotonic() < end:
        r = rx.poll()
        committed += r.committed
        failed.update(r.failed)
        time.sleep(0.002)
    assert committed == [8] and list(failed) == [7] and "nothing may append" in failed[7]
    assert cache.request(8).lengths == (20, 20, 20) and not cache.requests.is_live(7)
    rx.wait(8)  # the commit is not lost
    truth[8] = make_rows(8, 20)
    assert_rows(cache, truth)
    bad = rx.bad_notices
    for body in (b'{"request_id":[1],"generation":1}', b'{"request_id":1,"generation":"x"}', b'[1]', b'{'):
        sender._agent.send_notif(rx.name, b"hisparse-pd/1 done " + body)
    end = time.monotonic() + 10
    while rx.bad_notices < bad + 4 and time.monotonic() < end:
        assert rx.poll() == type(rx.poll())((), {})
        time.sleep(0.002)
    assert rx.bad_notices == bad + 4
    rx.close()


def test_parse_notice_wants_int_ids():
    assert parse_notice(notice("done", request_id=3, generation=5)) == ("done", {"request_id": 3, "generation": 5})
    for body in (b'{"request_id":[1],"generation":1}', b'{"request_id":true,"generation":1}',
                 b'{"request_id":1,"generation":1.5}', b'{"request_id":1}'):
        assert parse_notice(b"hisparse-pd/1 done " + body) is None


def test_commit_closes_the_generation_before_it_writes(sender, monkeypatch):
    """A send of the same descriptor while the commit writes is refused."""
    cache, truth = filled_cache(small_cfg())
    rx = receiver(cache)
    d = rx.reserve(7, 40)
    rows = make_rows(7, 40)
    sender.send(d, rows)
    real, seen = cache.kernel_set.apply_write_pooled, []

    def write(state, hot, pool_rows, plan, layers, extra):  # the commit's write of every layer
        with pytest.raises(StaleDescriptorError) as e:
            sender.send(d, make_rows(0, 40))
        seen.append(e.value)
        real(state, hot, pool_rows, plan, layers, extra)

    monkeypatch.setattr(cache.kernel_set, "apply_write_pooled", write)
    rx.wait(7, timeout_s=10)
    assert len(seen) == 1
    truth[7] = rows
    assert_rows(cache, truth)
    rx.close()


def test_transfer_into_a_fragmented_pool_byte_exact(sender):
    """A request whose blocks are not contiguous: a descriptor of several runs, one
    region per run and layer, every byte where the request's positions say."""
    cache, truth = filled_cache(small_cfg(max_num_reqs=6), req_ids=(1, 2, 3), n=20)
    cache.free_request(2)  # a 2-block hole between requests 1 and 3
    del truth[2]
    rx = receiver(cache)
    d = rx.reserve(7, 70)
    assert len(d.runs) == 2
    rows = make_rows(7, 70)
    rep = sender.send(PDDescriptor.from_bytes(d.to_bytes()), rows)
    assert rep.descriptors == 3 * len(d.runs)
    rx.wait(7, timeout_s=10)
    truth[7] = rows
    assert_rows(cache, truth)
    check_cache(cache, truth={(rid, l): r[l] for rid, r in truth.items() for l in range(3)})
    res = cache.resolve(1, torch.tensor([7], dtype=torch.int32),
                        torch.tensor([[0, 17, 33, 69, 50, -1, -1, -1]], dtype=torch.int32))
    assert torch.equal(cache.hot_rows(1)[res.physical[0, :5].long()], rows[1][[0, 17, 33, 69, 50]])
    rx.close()


def test_sender_register_failure_sends_a_fail_notice(sender, monkeypatch):
    cache, truth = filled_cache(small_cfg())
    rx = receiver(cache)
    before = snapshot(cache)
    d = rx.reserve(7, 40)

    def boom(*a, **k):
        raise RuntimeError("no memory to register")

    monkeypatch.setattr(sender._agent, "register_memory", boom)
    with pytest.raises(TransferError, match="registering the rows failed"):
        sender.send(d, make_rows(7, 40))
    monkeypatch.undo()
    with pytest.raises(TransferError, match="no memory to register"):
        rx.wait(7, timeout_s=10)
    assert rx.quarantined() == {}  # nothing was posted: freed with the notice
    assert_same(before, snapshot(cache))
    rx.close()


def test_sender_release_errors_keep_the_original_error_and_release_every_handle(monkeypatch):
    """A timeout whose handles can't be released: every handle is tried, the timeout is
    what raises, the fail notice says in_flight (the receiver keeps the quarantine
    until its timer) and the rows stay registered until close."""
    cache, _ = filled_cache(small_cfg())
    rx = receiver(cache)
    tx = PDSender(row_format="fp8_ds_mla", block_size=16)
    d = rx.reserve(7, 40)
    tried, real_release = [], tx._agent.release_xfer_handle
    real_read = tx._check_generation

    def timeout(handles, timeout_s, what):
        if "transfer" in what:
            for h in handles:  # the WRITEs complete (they are real), then the wait "times out"
                while tx._agent.check_xfer_state(h) != "DONE":
                    pass
            raise TransferError(f"{what} did not complete in {timeout_s} s")

    def release(h):
        tried.append(h)
        raise RuntimeError("can't cancel")

    def read_then_arm(desc, peer):  # the generation read releases its handle as usual
        real_read(desc, peer)
        monkeypatch.setattr(tx._agent, "release_xfer_handle", release)

    monkeypatch.setattr(tx, "_wait", timeout)
    monkeypatch.setattr(tx, "_check_generation", read_then_arm)
    with pytest.raises(TransferError, match="did not complete") as e:
        tx.send(d, make_rows(7, 40), per_layer=True)
    assert len(tried) == 3 and any("can't cancel" in n for n in e.value.__notes__)
    assert len(tx._held) == 1
    end = time.monotonic() + 10
    while rx.open_requests() and time.monotonic() < end:
        rx.poll()
        time.sleep(0.002)
    assert rx.open_requests() == [] and rx.quarantined()[d.generation].in_flight
    monkeypatch.undo()
    for h in tried:
        real_release(h)
    tx.close()
    rx.close()


def test_close_stops_the_agent():
    """A closed receiver's agent is gone with its threads (NIXL's progress thread spins
    on a core while it lives): the threads it started have exited."""
    import os
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc/self/task (Linux) to list the process's threads")

    def threads():
        return set(os.listdir("/proc/self/task"))

    cache, _ = filled_cache(small_cfg())
    t0 = threads()
    rx = receiver(cache)
    started = threads() - t0
    assert started  # the progress thread (and UCX's)
    rx.close()
    end = time.monotonic() + 5
    while threads() & started and time.monotonic() < end:
        time.sleep(0.01)
    assert not threads() & started
    with pytest.raises(PDError, match="closed"):
        rx.reserve(7, 16)
    assert rx._on_free not in cache.free_listeners


def test_shared_pool_is_refused(monkeypatch):
    cache, _ = filled_cache(small_cfg())
    monkeypatch.setattr(cache.pool, "shared", True)
    with pytest.raises(ValueError, match="shared across ranks.*not supported"):
        PDReceiver(cache)


def test_default_names_are_unique_and_generations_never_repeat():
    cache, _ = filled_cache(small_cfg())
    a = PDReceiver(cache)
    ga = a.reserve(7, 16).generation
    a.close()
    b = PDReceiver(cache)
    gb = b.reserve(7, 16).generation
    assert a.name != b.name and a.name.startswith("hisparse-decode-") and gb > ga
    b.close()
    release_all(a)
    release_all(b)
