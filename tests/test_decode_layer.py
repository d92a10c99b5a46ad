"""``hisparse.decode.DecodeLayer``: serial and split decode of one layer give the same
attention (split within the rounding of one LSE merge of bf16 partials) and leave the
cache bit-identical, on CPU (torch and interpreter kernels); a mode that is not one of
them is refused before anything changes.

Cases: all hits, all misses, tokens with no valid entry, repeated positions, padding,
multi-token (q = 2) groups, fp8_ds_mla and bf16 rows; plus a prefetch of the next
layer from this layer's selection, and the engine façade's decode_attention.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from hisparse import HiSparseConfig
from hisparse.attention.reference import ReferenceBackend
from hisparse.cache.cache import HiSparseCache
from hisparse.cache.results import SplitResult
from hisparse.decode import DecodeLayer, Overlap
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.formats import quantize_fp8_ds_mla

from invariants import assert_same, check_cache, snapshot

I32 = torch.int32
STATE = ("slot_pos", "slot_stamp", "row_slot", "step", "stats", "seq_lens")
H = 3
SM = 0.125


def make(kernels: str, fmt: str, q: int = 2) -> tuple[HiSparseCache, dict]:
    rb = 656 if fmt == "fp8_ds_mla" else 1152
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=256, row_bytes=rb, top_k=6, device_buffer_size=12,
                         max_num_reqs=3, max_query_len=q, host_block_size=8, max_request_id=8, device="cpu")
    c = HiSparseCache(cfg, kernels=kernels)
    truth = {}
    for rid, n in ((1, 40), (2, 9), (5, 30)):
        c.add_request(rid)
        for layer in range(2):
            g = torch.Generator().manual_seed(17 * rid + layer)
            x = torch.randn((n, 576), generator=g) * 2
            rows = quantize_fp8_ds_mla(x) if fmt == "fp8_ds_mla" else x.to(torch.bfloat16).view(torch.uint8)
            truth[(rid, layer)] = rows
            c.write(layer, rid, rows)
    return c, truth


def qs(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((T, H, 576), generator=g) * 0.3).to(torch.bfloat16)


CASES = {
    "mixed": ([1, 1, 2, 5], [[39, 3, 20, 20, -1, 11], [38, 0, 1, 2, 3, 4], [8, 7, -1, -1, -1, -1],
                             [29, 28, 27, 13, 14, 15]]),
    "all_hit": ([1, 5], [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
    "all_miss": ([1, 5], [[30, 31, 32, 33, 34, 35], [20, 21, 22, 23, 24, 25]]),
    "empty_rows": ([1, 2], [[-1] * 6, [-1, -1, 3, -1, -1, -1]]),
}


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_modes_agree(kernels, fmt, case):
    ids, tk = CASES[case]
    ids, tk = torch.tensor(ids, dtype=I32), torch.tensor(tk, dtype=I32)
    q = qs(len(ids), 3)
    results, states = {}, {}
    for mode in Overlap:
        c, _ = make(kernels, fmt)
        layer = DecodeLayer(c, ReferenceBackend(), overlap=mode, kernels=kernels)
        results[mode] = layer(0, ids, tk, q, sm_scale=SM)
        states[mode] = ({n: getattr(c.state, n).clone() for n in STATE}, c.hot.clone())
    out0, lse0 = results[Overlap.SERIAL]
    for mode in (Overlap.SPLIT, Overlap.AUTO):
        out, lse = results[mode]
        assert torch.equal(torch.isinf(lse), torch.isinf(lse0)), mode
        fin = torch.isfinite(lse0)
        torch.testing.assert_close(lse[fin], lse0[fin], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.float(), out0.float(), atol=2e-2, rtol=2e-2)
        for n in STATE:
            assert torch.equal(states[mode][0][n], states[Overlap.SERIAL][0][n]), (mode, n)
        assert torch.equal(states[mode][1], states[Overlap.SERIAL][1]), mode
    empty = (tk == -1).all(dim=1)
    assert (out0[empty] == 0).all() and torch.isinf(lse0[empty]).all()


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_random_steps_modes_agree(kernels):
    """Several steps on both layers; every mode keeps the same state throughout."""
    rng = random.Random(4)
    caches = {m: make(kernels, "fp8_ds_mla")[0] for m in Overlap}
    layers = {m: DecodeLayer(caches[m], ReferenceBackend(), overlap=m, kernels=kernels) for m in Overlap}
    lens = {1: 40, 2: 9, 5: 30}
    for step in range(5):
        ids, rows = [], []
        for rid, n in lens.items():
            for _ in range(rng.choice([1, 2])):
                ids.append(rid)
                rows.append([rng.randrange(-1, n) for _ in range(6)])
        ids, tk = torch.tensor(ids, dtype=I32), torch.tensor(rows, dtype=I32)
        q = qs(len(rows), step)
        outs = {m: layers[m](step % 2, ids, tk, q, sm_scale=SM) for m in Overlap}
        for m in (Overlap.SPLIT, Overlap.AUTO):  # auto: split, serial, then its choice
            torch.testing.assert_close(outs[m][0].float(), outs[Overlap.SERIAL][0].float(), atol=2e-2, rtol=2e-2)
            for n in STATE:
                assert torch.equal(getattr(caches[m].state, n), getattr(caches[Overlap.SERIAL].state, n)), (step, n)


def test_prefetch_then_decode_reads_the_right_rows():
    c, truth = make("torch", "fp8_ds_mla", q=1)
    ids = torch.tensor([1, 5], dtype=I32)
    tk0 = torch.tensor([[30, 31, 32, 33, 1, 2], [20, 21, 22, 23, 24, 0]], dtype=I32)
    layer = DecodeLayer(c, ReferenceBackend(), overlap="split")
    q = qs(2, 9)
    layer(0, ids, tk0, q, sm_scale=SM)
    layer.prefetch(1, ids, tk0)
    before = c.stats()["layers"][1]
    out, lse = layer(1, ids, tk0, q, sm_scale=SM)
    after = c.stats()["layers"][1]
    assert after["misses"] == before["misses"]  # everything was prefetched
    ref, ref_lse = ReferenceBackend().decode(q, torch.cat([truth[(1, 1)], truth[(5, 1)]]),
                                             tk0 + torch.tensor([[0], [40]], dtype=I32), sm_scale=SM,
                                             row_format="fp8_ds_mla")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _engine(*, write_decode: bool = True):
    """A group of 2 layers holding request 1's 20 prefilled rows, prepared for one decode
    token (its row written in both layers unless write_decode=False); its rows and md."""
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=256, row_bytes=656, top_k=4, device_buffer_size=8,
                         max_num_reqs=2, host_block_size=8, max_request_id=8, device="cpu")
    g = HiSparseIndexGroup(cfg, kernels="torch")
    for _ in range(2):
        g.register_layer()
    g.add_request(1)
    rows = quantize_fp8_ds_mla(torch.randn((21, 576), generator=torch.Generator().manual_seed(3)))
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[20], seq_lens=[20], num_decodes=0)
    g.prepare_for_batch(md)
    for layer in range(2):
        g.write_new_rows(layer, rows[:20], md)
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[1], seq_lens=[21], num_decodes=1)
    g.prepare_for_batch(md)
    for layer in range(2 if write_decode else 0):
        g.write_new_rows(layer, rows[20:], md)
    return g, md, rows


@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_engine_decode_attention(overlap):
    g, md, rows = _engine(write_decode=False)
    q = qs(1, 1)
    tk = torch.tensor([[20, 15, 3, 9]], dtype=I32)
    for layer in range(2):
        g.write_new_rows(layer, rows[20:], md)
        if layer == 0:
            g.prefetch(1, tk, md)
        out, lse = g.decode_attention(layer, q, tk, md, backend=ReferenceBackend(), sm_scale=SM, overlap=overlap)
        ref, _ = ReferenceBackend().decode(q, rows, tk, sm_scale=SM, row_format="fp8_ds_mla")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        with pytest.raises(ValueError, match="already resolved"):
            g.decode_attention(layer, q, tk, md, backend=ReferenceBackend(), sm_scale=SM, overlap=overlap)


@pytest.mark.parametrize("mode", ["fused", "FUSED", "", None])
def test_an_unknown_overlap_is_refused_before_anything_changes(mode):
    """``overlap`` is one of serial, split and auto: anything else (e.g. "fused") is
    a ValueError naming them, raised by the DecodeLayer constructor and by the engine's
    decode_attention before any resolve (cache, counters and bookkeeping unchanged)."""
    assert [m.value for m in Overlap] == ["serial", "split", "auto"]
    c, _ = make("torch", "fp8_ds_mla")
    before = snapshot(c)
    with pytest.raises(ValueError, match=r"overlap must be one of \['serial', 'split', 'auto'\]"):
        DecodeLayer(c, ReferenceBackend(), overlap=mode)
    assert_same(before, snapshot(c))
    g, md, rows = _engine()
    q, tk = qs(1, 1), torch.tensor([[20, 15, 3, 9]], dtype=I32)
    before = snapshot(g.hisparse_cache)
    with pytest.raises(ValueError, match=r"overlap must be one of \['serial', 'split', 'auto'\]"):
        g.decode_attention(0, q, tk, md, backend=ReferenceBackend(), sm_scale=SM, overlap=mode)
    assert_same(before, snapshot(g.hisparse_cache))
    assert g.resolves_per_layer == [0, 0] and not g._decode.layers
    out, _ = g.decode_attention(0, q, tk, md, backend=ReferenceBackend(), sm_scale=SM, overlap="split")
    ref, _ = ReferenceBackend().decode(q, rows, tk, sm_scale=SM, row_format="fp8_ds_mla")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)  # the layer still runs


class _Unsupported(ReferenceBackend):
    name = "unsupported"

    def supports(self, *, device, row_format, num_heads, phase):
        return "this stand-in runs nothing"


@pytest.mark.parametrize("overlap", ["serial", "split"])
@pytest.mark.parametrize("bad", ["sm_scale", "q_width", "q_dtype", "backend"])
def test_a_decode_the_backend_refuses_changes_nothing(overlap, bad):
    """q, sm_scale and the backend's support are checked before the resolve: a refused
    call leaves the LRU state, counters and hot rows as they were, and the retry equals
    a cache that never saw the refused call."""
    c, twin = make("torch", "fp8_ds_mla")[0], make("torch", "fp8_ds_mla")[0]
    req = torch.tensor([1, 1, 2], dtype=I32)
    topk = torch.tensor([[0, 5, 39, 12, -1, 7], [3, 3, 38, 20, 1, 2], [0, 8, 4, -1, -1, 6]], dtype=I32)
    q = qs(3, seed=4)
    args = {"sm_scale": (q, -1.0, ReferenceBackend()), "q_width": (q[..., :512].contiguous(), SM, ReferenceBackend()),
            "q_dtype": (q.float(), SM, ReferenceBackend()), "backend": (q, SM, _Unsupported())}[bad]
    before = ({n: getattr(c.state, n).clone() for n in STATE}, c.hot.clone())
    with pytest.raises((ValueError, TypeError)):
        DecodeLayer(c, args[2], overlap=overlap)(1, req, topk, args[0], sm_scale=args[1])
    for n in STATE:
        assert torch.equal(before[0][n], getattr(c.state, n)), f"a refused decode changed {n}"
    assert torch.equal(before[1], c.hot)
    outs = [DecodeLayer(x, ReferenceBackend(), overlap=overlap)(1, req, topk, q, sm_scale=SM) for x in (c, twin)]
    assert torch.equal(outs[0][0], outs[1][0])
    for n in STATE:
        assert torch.equal(getattr(c.state, n), getattr(twin.state, n)), n
    assert torch.equal(c.hot, twin.hot)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_begin_then_finish_equals_one_call(kernels):
    """DecodeLayer.begin + finish (the resolve launched before the query exists) gives
    the same bits and leaves the same state as one split call; misuse is refused."""
    ids, tk = CASES["mixed"]
    ids, tk = torch.tensor(ids, dtype=I32), torch.tensor(tk, dtype=I32)
    q = qs(len(ids), 6)
    c1, _ = make(kernels, "fp8_ds_mla")
    c2, _ = make(kernels, "fp8_ds_mla")
    one = DecodeLayer(c1, ReferenceBackend(), overlap="split", kernels=kernels)(1, ids, tk, q, sm_scale=SM)
    layer = DecodeLayer(c2, ReferenceBackend(), overlap="split", kernels=kernels)
    sp = layer.begin(1, ids, tk, num_heads=H)
    with pytest.raises(ValueError, match="tokens"):
        layer.finish(sp, q[:2], sm_scale=SM)
    with pytest.raises(ValueError, match="heads"):
        layer.finish(sp, q[:, :2].contiguous(), sm_scale=SM)
    with pytest.raises(ValueError):
        layer.finish(sp, q, sm_scale=-1.0)
    two = layer.finish(sp, q, sm_scale=SM)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for n in STATE:
        assert torch.equal(getattr(c1.state, n), getattr(c2.state, n)), n
    assert torch.equal(c1.hot, c2.hot)
    layer(1, ids, tk, q, sm_scale=SM)  # a later resolve of the layer
    with pytest.raises(ValueError, match="begin"):
        layer.finish(sp, q, sm_scale=SM)
    with pytest.raises(TypeError, match="SplitLaunch"):
        layer.finish(object(), q, sm_scale=SM)
    with pytest.raises(ValueError, match="split"):
        DecodeLayer(c2, ReferenceBackend(), overlap="serial").begin(1, ids, tk, num_heads=H)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_finish_refuses_a_launch_begun_over_another_cache(kernels):
    """A SplitLaunch is bound to the cache its begin() resolved: a layer over another
    cache (same config and admissions, so the same request-table generation) refuses it
    before anything is launched or changed; the layer over its cache still finishes it."""
    ids, tk = CASES["mixed"]
    ids, tk = torch.tensor(ids, dtype=I32), torch.tensor(tk, dtype=I32)
    q = qs(len(ids), 6)
    x, y = make(kernels, "fp8_ds_mla")[0], make(kernels, "fp8_ds_mla")[0]
    lx, ly = (DecodeLayer(c, ReferenceBackend(), overlap="split", kernels=kernels) for c in (x, y))
    launch = lx.begin(1, ids, tk, num_heads=H)
    before = snapshot(x), snapshot(y)
    with pytest.raises(ValueError, match="another cache"):
        ly.finish(launch, q, sm_scale=SM)
    assert_same(before[0], snapshot(x))
    assert_same(before[1], snapshot(y))
    out = lx.finish(launch, q, sm_scale=SM)
    ref = DecodeLayer(y, ReferenceBackend(), overlap="split", kernels=kernels)(1, ids, tk, q, sm_scale=SM)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_engine_begin_decode_attention():
    """begin_decode_attention then decode_attention (split) equals decode_attention alone;
    it counts as the layer's resolve; another top-k tensor, mode or backend is refused and
    leaves the begun layer to be finished."""
    q, be = qs(1, 2), ReferenceBackend()
    tk = torch.tensor([[20, 15, 3, 9]], dtype=I32)
    g1, md1, _ = _engine()
    ref = g1.decode_attention(0, q, tk, md1, backend=be, sm_scale=SM, overlap="split")
    g2, md2, _ = _engine()
    g2.begin_decode_attention(0, tk, md2, backend=be, num_heads=H)
    with pytest.raises(ValueError, match="already resolved"):
        g2.begin_decode_attention(0, tk, md2, backend=be, num_heads=H)
    for kw in (dict(topk=tk.clone()), dict(overlap="serial"), dict(backend=ReferenceBackend())):
        args = dict(topk=tk, overlap="split", backend=be) | kw
        with pytest.raises(ValueError, match="begin_decode_attention"):
            g2.decode_attention(0, q, args["topk"], md2, backend=args["backend"], sm_scale=SM, overlap=args["overlap"])
    out = g2.decode_attention(0, q, tk, md2, backend=be, sm_scale=SM, overlap="split")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert g2.resolves_per_layer == g1.resolves_per_layer == [1, 0]
    with pytest.raises(ValueError, match="already resolved"):
        g2.decode_attention(0, q, tk, md2, backend=be, sm_scale=SM, overlap="split")


class _RefusesHeads(ReferenceBackend):
    """Runs any head count but ``H`` (as FlashMLA and FlashInfer refuse some)."""

    name = "refuses-heads"

    def supports(self, *, device, row_format, num_heads, phase):
        if num_heads == H:
            return f"{H} heads are not supported by this stand-in"
        return super().supports(device=device, row_format=row_format, num_heads=num_heads, phase=phase)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_begin_asks_the_backend_before_the_resolve(kernels):
    """A head count the backend refuses is refused by begin(), before the resolve: the
    cache is left as it was, and the layer then resolves as on a cache that never saw
    the call."""
    ids, tk = CASES["mixed"]
    ids, tk = torch.tensor(ids, dtype=I32), torch.tensor(tk, dtype=I32)
    q = qs(len(ids), 6)
    c, twin = make(kernels, "fp8_ds_mla")[0], make(kernels, "fp8_ds_mla")[0]
    before = snapshot(c)
    with pytest.raises(ValueError, match="heads are not supported"):
        DecodeLayer(c, _RefusesHeads(), overlap="split", kernels=kernels).begin(1, ids, tk, num_heads=H)
    assert_same(before, snapshot(c))
    outs = [DecodeLayer(x, ReferenceBackend(), overlap="split", kernels=kernels)(1, ids, tk, q, sm_scale=SM)
            for x in (c, twin)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert_same(snapshot(twin), snapshot(c))
    check_cache(c)


def _split_against_a_twin():
    """(q, backend, top-k, a split decode_attention's (out, lse) of layer 0 on a twin
    engine, a fresh engine, its metadata, a snapshot of its cache)."""
    q, be = qs(1, 2), ReferenceBackend()
    tk = torch.tensor([[20, 15, 3, 9]], dtype=I32)
    g1, md1, _ = _engine()
    ref = g1.decode_attention(0, q, tk, md1, backend=be, sm_scale=SM, overlap="split")
    g, md, _ = _engine()
    return q, be, tk, ref, g, md, snapshot(g.hisparse_cache)


def test_engine_begin_refused_by_the_backend_leaves_the_layer_to_resolve():
    """begin_decode_attention with a head count the backend refuses raises before the
    resolve (nothing changed, no resolve counted), so the layer can still be attended in
    that forward; converting a begun (or attended) layer names the call that resolved it."""
    q, be, tk, ref, g, md, before = _split_against_a_twin()
    with pytest.raises(ValueError, match="heads are not supported"):
        g.begin_decode_attention(0, tk, md, backend=_RefusesHeads(), num_heads=H)
    assert_same(before, snapshot(g.hisparse_cache))
    assert g.resolves_per_layer == [0, 0]
    out = g.decode_attention(0, q, tk, md, backend=be, sm_scale=SM, overlap="split")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    with pytest.raises(ValueError, match="resolved by decode_attention"):
        g.convert_decode_logical_to_physical_topk(0, tk, md)
    g.begin_decode_attention(1, tk, md, backend=be, num_heads=H)
    with pytest.raises(ValueError, match="begun by begin_decode_attention"):
        g.convert_decode_logical_to_physical_topk(1, tk, md)
    g.decode_attention(1, q, tk, md, backend=be, sm_scale=SM, overlap="split")  # still finishes
    assert g.resolves_per_layer == [1, 1]
    with pytest.raises(ValueError, match="resolved by decode_attention"):  # begun, then attended
        g.convert_decode_logical_to_physical_topk(1, tk, md)


def test_engine_finishes_a_begun_layer_given_the_overlap_enum():
    """decode_attention takes ``Overlap.SPLIT`` as it takes "split", begun or not; an
    unknown mode is refused before anything changes."""
    q, be, tk, ref, g, md, before = _split_against_a_twin()
    with pytest.raises(ValueError, match="overlap"):
        g.decode_attention(0, q, tk, md, backend=be, sm_scale=SM, overlap="sideways")
    assert_same(before, snapshot(g.hisparse_cache))
    g.begin_decode_attention(0, tk, md, backend=be, num_heads=H)
    out = g.decode_attention(0, q, tk, md, backend=be, sm_scale=SM, overlap=Overlap.SPLIT)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    g.decode_attention(1, q, tk, md, backend=be, sm_scale=SM, overlap=Overlap.SPLIT)
    assert g.resolves_per_layer == [1, 1]


def _decode_forward(g: HiSparseIndexGroup, n: int) -> SparseMLAMetadata:
    """Prepare the next forward of an ``_engine`` group: one decode token of request 1
    at position n, its row (random) written in both layers."""
    md = SparseMLAMetadata.build(request_ids=[1], query_lens=[1], seq_lens=[n + 1], num_decodes=1)
    g.prepare_for_batch(md)
    row = quantize_fp8_ds_mla(torch.randn((1, 576), generator=torch.Generator().manual_seed(n)))
    for layer in range(2):
        g.write_new_rows(layer, row, md)
    return md


@pytest.mark.parametrize("overlap", ["serial", "split"])
def test_engine_keeps_no_layer_per_backend_object(overlap):
    """An engine that makes its backend object per forward: the group keeps none of the
    old objects alive, nor a DecodeLayer (and its scratch) for each."""
    g, md, _ = _engine()
    q, tk = qs(1, 2), torch.tensor([[20, 15, 3, 9]], dtype=I32)
    made = []
    for n in range(21, 27):
        be = ReferenceBackend()
        made.append(weakref.ref(be))
        for layer in range(2):
            g.decode_attention(layer, q, tk, md, backend=be, sm_scale=SM, overlap=overlap)
        del be
        md = _decode_forward(g, n)
    gc.collect()
    assert sum(r() is not None for r in made) <= 1  # at most the last one's layer is kept
    assert len(g._decode.layers) == 1


def test_engine_never_hands_a_layer_to_another_backend_object():
    """The layer the group keeps serves only the backend object it was made for: another
    object, even at the address of a dead one (id() reused after GC), is asked itself."""
    g, md, _ = _engine()
    q, tk = qs(1, 2), torch.tensor([[20, 15, 3, 9]], dtype=I32)
    old = ReferenceBackend()
    g.decode_attention(0, q, tk, md, backend=old, sm_scale=SM, overlap="split")
    md = _decode_forward(g, 21)
    g.decode_attention(0, q, tk, md, backend=ReferenceBackend(), sm_scale=SM, overlap="split")
    addr, dead = id(old), weakref.ref(old)
    del old  # freed here: the group holds the later backend's layer now
    assert dead() is None
    others = [_RefusesHeads() for _ in range(64)]  # CPython hands the freed address out again
    other = next((b for b in others if id(b) == addr), others[0])
    before = snapshot(g.hisparse_cache)
    with pytest.raises(ValueError, match="heads are not supported"):
        g.decode_attention(1, q, tk, md, backend=other, sm_scale=SM, overlap="split")
    assert_same(before, snapshot(g.hisparse_cache))
    assert g.resolves_per_layer == [2, 0]


def test_split_fills_sms():
    """The split layer's few-program copy and SM plan apply to a hit attention that would
    leave the copy fewer than SPLIT_FREE_SMS SMs of its one wave."""
    from hisparse.decode.layer import SPLIT_FREE_SMS, split_fills_sms
    assert SPLIT_FREE_SMS == 4
    assert [split_fills_sms(p, 132) for p in (None, 1, 128, 129, 132, 133, 264)] == \
        [False, False, False, True, True, False, False]
    layer = DecodeLayer(make("torch", "fp8_ds_mla")[0], ReferenceBackend(), overlap="split")
    assert layer._launch_plan(66, 128, 2048, "fp8_ds_mla") == (None, None, False)  # CPU: no plan
    assert layer._launch_plan(256, 128, 2048, "fp8_ds_mla") == (None, None, False)


def test_split_waits_for_misses_past_one_wave():
    """A split layer's hit attention starts after the miss phase only when its programs
    exceed one wave of SMs."""
    from hisparse.decode.layer import split_waits_for_misses
    assert [split_waits_for_misses(p, 132) for p in (1, 128, 132, 133, 136, 512)] == \
        [False, False, False, True, True, True]


class _Counted(ReferenceBackend):
    """A backend whose decode launches ``programs`` programs that each hold an SM."""

    def __init__(self, programs: int, *, plans: bool = True) -> None:
        super().__init__()
        self.programs, self.plans_sms = programs, plans

    def decode_programs(self, T, H, K, *, device, row_format):
        return self.programs


class _Persistent(ReferenceBackend):
    persistent_grid = True


def test_split_launch_plan_on_a_cuda_cache(monkeypatch):
    """Every branch of the split layer's plan, on a cache that says it is on CUDA with 132
    SMs: the copy's shape, the SMs the attention plans for, whether it waits for the
    miss phase."""
    import hisparse.decode.layer as L
    from hisparse.decode.layer import SPLIT_COPY
    c = make("torch", "fp8_ds_mla")[0]
    monkeypatch.setattr(L, "sm_count", lambda device: 132)
    monkeypatch.setattr(c, "cuda", True)

    def plan(backend, T, H=128):
        return DecodeLayer(c, backend, overlap="split")._launch_plan(T, H, 2048, "fp8_ds_mla")

    assert plan(_Counted(128), 64) == (None, None, False)  # 4 SMs left to the copy
    assert plan(_Counted(132), 66) == (SPLIT_COPY, 124, False)  # fills the one wave
    assert plan(_Counted(136), 68) == (SPLIT_COPY, 124, True)  # past it
    assert plan(_Counted(512), 256) == (SPLIT_COPY, 124, True)
    assert plan(_Counted(132, plans=False), 66) == (None, None, False)
    assert plan(_Counted(136, plans=False), 68) == (SPLIT_COPY, None, True)
    assert plan(ReferenceBackend(), 256) == (None, None, False)  # programs not counted, grid not persistent
    assert [plan(_Persistent(), T, H) for T, H in ((66, 128), (67, 128), (132, 64), (133, 64), (256, 16))] == \
        [(None, None, False), (SPLIT_COPY, None, True), (None, None, False), (SPLIT_COPY, None, True),
         (SPLIT_COPY, None, True)]
    c.stage_programs = 16
    assert plan(_Counted(136), 68) == (SPLIT_COPY, 116, True)


@pytest.mark.parametrize("waits", [False, True])
def test_split_hit_attention_waits_for_the_miss_phase_when_planned(monkeypatch, waits):
    """A split layer whose plan says so makes the current stream wait for the layer's
    miss phase before its hit attention, and only then; the wait for the staging comes
    after the hit attention either way; the result is the same."""
    ids, tk = CASES["mixed"]
    ids, tk = torch.tensor(ids, dtype=I32), torch.tensor(tk, dtype=I32)
    q = qs(len(ids), 3)
    ref = DecodeLayer(make("torch", "fp8_ds_mla")[0], ReferenceBackend(), overlap="split")(0, ids, tk, q, sm_scale=SM)
    c = make("torch", "fp8_ds_mla")[0]
    be = ReferenceBackend()
    layer = DecodeLayer(c, be, overlap="split")
    monkeypatch.setattr(layer, "_launch_plan", lambda T, H, K, fmt: (None, None, waits))
    events, decode, wait = [], be.decode, c.streams.wait_resolved
    monkeypatch.setattr(c.streams, "wait_resolved",
                        lambda lay, stream=None: (events.append(("wait", lay)), wait(lay, stream)))
    monkeypatch.setattr(be, "decode", lambda *a, **k: (events.append(("decode",)), decode(*a, **k))[1])
    staged = SplitResult.wait
    monkeypatch.setattr(SplitResult, "wait", lambda self, stream=None: (events.append(("staged",)),
                                                                         staged(self, stream))[1])
    out = layer(0, ids, tk, q, sm_scale=SM)
    assert events == ([("wait", 0)] if waits else []) + [("decode",), ("staged",)]
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_layer_graphs_are_refused_where_they_cannot_run():
    """``graphs=True`` replays CUDA graphs of unchecked calls: a CPU cache, checked calls
    or a bad ``max_graphs`` are refused when the layer is made (the GPU behaviour:
    tests/test_decode_graphs_gpu.py)."""
    cache, _ = make("torch", "fp8_ds_mla")
    with pytest.raises(ValueError, match="CUDA cache"):
        DecodeLayer(cache, ReferenceBackend(), graphs=True)
    with pytest.raises(ValueError, match="validate=False"):
        DecodeLayer(cache, ReferenceBackend(), graphs=True, validate=True)
    with pytest.raises(TypeError):
        DecodeLayer(cache, ReferenceBackend(), graphs=1)
    with pytest.raises(ValueError):
        DecodeLayer(cache, ReferenceBackend(), max_graphs=0)
    assert DecodeLayer(cache, ReferenceBackend()).graphs is None
