"""Split resolves, prefetches and overlapped decode layers on the GPU (H200).

- The split resolve's Triton kernels leave the state of a serial resolve, bit for bit,
  over random steps with misses, and return the same rows.
- ``DecodeLayer`` in split mode matches serial within tolerance with the
  Triton backend (fp8_ds_mla, 128 heads, the warp-specialised kernel on SM 9.x), the
  state identical; captured in a CUDA graph, a replay from the same state equals the
  eager call (cache bytes exactly, outputs within tolerance).
- A prefetch makes the next layer's resolve hit.
- A split layer whose hit attention fills every SM, or needs more than one wave, stages
  with a few-program copy; past one wave its hit attention starts after the miss phase
  (a spin that holds the miss phase back delays it), within one wave it does not.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.attention.triton_backend import TritonBackend
from hisparse.cache.cache import HiSparseCache
from hisparse.decode import DecodeLayer, Overlap
from hisparse.formats import quantize_fp8_ds_mla

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = torch.device("cuda")
I32 = torch.int32
STATE = ("slot_pos", "slot_stamp", "row_slot", "step", "stats", "seq_lens")
B, CTX, K, S, H = 8, 3000, 256, 512, 128
SM = 576 ** -0.5


def make(seed: int = 0, b: int = B) -> HiSparseCache:
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=b * 3072, row_bytes=656, top_k=K, device_buffer_size=S,
                         max_num_reqs=b, host_block_size=64, max_request_id=max(16, b), device="cuda")
    c = HiSparseCache(cfg)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for r in range(b):
        c.add_request(r)
        for layer in range(2):
            x = torch.randn((CTX, 576), generator=g).to(DEV, torch.bfloat16)
            c.write(layer, r, quantize_fp8_ds_mla(x))
    c.streams.join_backup()
    torch.cuda.synchronize()
    return c


def topk(rng: random.Random, hot_share: float, b: int = B) -> torch.Tensor:
    rows = []
    for _ in range(b):
        nh = int(hot_share * K)
        hot = rng.sample(range(S), nh)
        cold = rng.sample(range(S, CTX - 1), K - nh)
        rows.append(hot + cold)
    return torch.tensor(rows, dtype=I32, device=DEV)


def test_split_resolve_equals_serial():
    a, b = make(), make()
    ids = torch.arange(B, dtype=I32, device=DEV)
    rng = random.Random(1)
    for step in range(6):
        tk = topk(rng, 0.5 + 0.1 * (step % 4))
        res = a.resolve(step % 2, ids, tk, validate=False, split=True)
        res.wait()
        want = b.resolve(step % 2, ids, tk, validate=False)
        torch.cuda.synchronize()
        assert torch.equal(res.physical, want.physical)
        for n in STATE:
            assert torch.equal(getattr(a.state, n), getattr(b.state, n)), (step, n)
        assert torch.equal(a.hot, b.hot)
        hit = res.hit_physical
        assert torch.equal(hit[hit >= 0], want.physical[hit >= 0])
        assert int(res.miss_counts.sum()) + int((hit >= 0).sum()) == int((want.physical >= 0).sum())


def _same_as_serial(got, ref, a: HiSparseCache, b: HiSparseCache, step: int) -> None:
    """An overlapped layer's (out, lse) against the serial layer's within tolerance, and
    its cache ``a`` in the serial cache ``b``'s state, bit for bit."""
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], ref[1], atol=1e-3, rtol=1e-3)
    for n in STATE:
        assert torch.equal(getattr(a.state, n), getattr(b.state, n)), (step, n)
    assert torch.equal(a.hot, b.hot)


@pytest.mark.parametrize("mode", [Overlap.SPLIT])
def test_decode_layer_modes_match_serial(mode):
    a, b = make(), make()
    ids = torch.arange(B, dtype=I32, device=DEV)
    be = TritonBackend()
    la, lb = DecodeLayer(a, be, overlap=mode), DecodeLayer(b, be, overlap=Overlap.SERIAL)
    rng = random.Random(2)
    g = torch.Generator(device="cpu").manual_seed(3)
    for step in range(5):
        tk = topk(rng, 0.9)
        q = (torch.randn((B, H, 576), generator=g) * 0.5).to(DEV, torch.bfloat16)
        _same_as_serial(la(step % 2, ids, tk, q, sm_scale=SM), lb(step % 2, ids, tk, q, sm_scale=SM), a, b, step)


def _replay_equals_eager(c: HiSparseCache, run) -> None:
    """``run()`` -> (out, lse) on cache ``c``, eagerly and captured in a CUDA graph that is
    replayed from the same state: the replay leaves the eager call's state, bit for bit,
    and its outputs within tolerance."""
    saved = ({n: getattr(c.state, n).clone() for n in STATE}, c.hot.clone())

    def restore():
        for n in STATE:
            getattr(c.state, n).copy_(saved[0][n])
        c.hot.copy_(saved[1])

    eager = [t.clone() for t in run()]
    torch.cuda.synchronize()
    after = ({n: getattr(c.state, n).clone() for n in STATE}, c.hot.clone())
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = run()
    restore()
    graph.replay()
    torch.cuda.synchronize()
    for n in STATE:
        assert torch.equal(getattr(c.state, n), after[0][n]), n
    assert torch.equal(c.hot, after[1])
    torch.testing.assert_close(gout[0].float(), eager[0].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", list(Overlap))
def test_decode_layer_graph_replay_equals_eager(mode):
    c = make()
    ids = torch.arange(B, dtype=I32, device=DEV)
    layer = DecodeLayer(c, TritonBackend(validate=False), overlap=mode)  # no host sync in a capture
    tk = topk(random.Random(4), 0.9)
    q = (torch.randn((B, H, 576), generator=torch.Generator().manual_seed(5)) * 0.5).to(DEV, torch.bfloat16)
    _replay_equals_eager(c, lambda: layer(0, ids, tk, q, sm_scale=SM))


def test_prefetch_makes_the_next_layer_hit():
    c = make()
    ids = torch.arange(B, dtype=I32, device=DEV)
    tk = topk(random.Random(6), 0.5)
    c.resolve(0, ids, tk, validate=False)
    before = c.stats()["layers"][1]
    c.prefetch(1, ids, tk)
    mid = c.stats()["layers"][1]
    assert mid["prefetch_rows"] - before["prefetch_rows"] == B * K // 2
    c.resolve(1, ids, tk)
    after = c.stats()["layers"][1]
    assert after["misses"] == mid["misses"]  # everything was prefetched


@pytest.mark.parametrize("extra", [0, 4])
def test_split_layer_that_fills_the_sms_leaves_the_copy_its_own(extra):
    """A batch whose hit attention fills every SM in one wave (2 head blocks a token,
    extra = 0), or needs more than one (extra = 4: 8 programs past it): the split layer
    stages with SPLIT_COPY's few programs and plans the attention for the other SMs
    (a batch that leaves 4 SMs free keeps the defaults); past one wave, the hit
    attention also starts after the miss phase. Its outputs match serial and its state
    is serial's, bit for bit; a replay of begin + finish leaves the eager call's state."""
    from hisparse._checks import sm_count
    from hisparse.decode.layer import SPLIT_COPY
    sms = sm_count(DEV)
    be = TritonBackend(validate=False)
    assert DecodeLayer(make(b=1), be, overlap="split")._launch_plan(sms // 2 - 2, H, K, "fp8_ds_mla") == (None, None, False)
    T, waits, planned = sms // 2 + extra, extra > 0, sms - SPLIT_COPY.programs
    a, b = make(b=T), make(b=T)
    la, lb = DecodeLayer(a, be, overlap=Overlap.SPLIT), DecodeLayer(b, be, overlap=Overlap.SERIAL)
    assert la._launch_plan(T, H, K, "fp8_ds_mla") == (SPLIT_COPY, planned, waits)
    ids = torch.arange(T, dtype=I32, device=DEV)
    rng, g = random.Random(6 + extra), torch.Generator(device="cpu").manual_seed(7 + extra)
    for step in range(3):
        tk = topk(rng, 0.9 - 0.025 * extra, b=T)
        q = (torch.randn((T, H, 576), generator=g) * 0.5).to(DEV, torch.bfloat16)
        launch = la.begin(step % 2, ids, tk, num_heads=H)
        assert (launch.sms, launch.after_miss_phase) == (planned, waits)
        _same_as_serial(la.finish(launch, q, sm_scale=SM), lb(step % 2, ids, tk, q, sm_scale=SM), a, b, step)
    # captured: begin + finish in one graph, replayed from the same state
    tk = topk(rng, 0.9, b=T)
    q = (torch.randn((T, H, 576), generator=g) * 0.5).to(DEV, torch.bfloat16)
    _replay_equals_eager(a, lambda: la.finish(la.begin(1, ids, tk, num_heads=H), q, sm_scale=SM))


def _hit_attention_end_ms(T: int, stall_cycles: int) -> float:
    """Milliseconds from a split layer call's start to the end of its hit attention, with
    the miss phase held back by a ``stall_cycles`` spin on the stage stream."""
    c = make(b=T)
    be = TritonBackend(validate=False)
    layer = DecodeLayer(c, be, overlap=Overlap.SPLIT)
    ids = torch.arange(T, dtype=I32, device=DEV)
    rng, g = random.Random(10), torch.Generator(device="cpu").manual_seed(11)
    q = (torch.randn((T, H, 576), generator=g) * 0.5).to(DEV, torch.bfloat16)
    layer(0, ids, topk(rng, 0.8, b=T), q, sm_scale=SM)  # compiles everything
    torch.cuda.synchronize()
    marks, decode, resolve = [], be.decode, c.kernel_set.resolve

    def timed_decode(*a, **k):
        out = decode(*a, **k)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        return out

    def stalled_resolve(*a, **k):  # runs on the stage stream
        torch.cuda._sleep(stall_cycles)
        return resolve(*a, **k)

    be.decode, c.kernel_set.resolve = timed_decode, stalled_resolve
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    layer(1, ids, topk(rng, 0.8, b=T), q, sm_scale=SM)
    torch.cuda.synchronize()
    return start.elapsed_time(marks[0])


@pytest.mark.gpu_alone  # compares kernel times against a spin: another process's kernels would skew them
def test_split_hit_attention_waits_for_the_miss_phase_only_past_one_wave():
    """Held back by a spin on the stage stream, the miss phase delays the hit attention
    of a batch past one wave of SMs, and not that of a batch within one."""
    from hisparse._checks import sm_count
    cycles = 40_000_000
    stall_ms = cycles / 2.0e6  # the least the spin takes at up to 2 GHz: 20 ms, a layer is < 1 ms
    past = _hit_attention_end_ms(sm_count(DEV) // 2 + 4, cycles)
    within = _hit_attention_end_ms(8, cycles)
    assert past > stall_ms and within < stall_ms / 2, (past, within)
