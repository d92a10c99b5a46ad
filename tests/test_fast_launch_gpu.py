"""The direct launch of compiled Triton kernels (``hisparse.kernels.fast_launch``) on a GPU:
after the JIT's first launch of a specialisation, later calls launch the compiled
kernel directly, with results bit-identical to the JIT's; a call of another
specialisation (an unaligned pointer, a new constexpr) takes the JIT path; launch hooks
send every call through the JIT; direct launches are captured by CUDA graphs and
replay; and a decode layer (resolve + Triton attention) gives the same bits with the
direct path on and off."""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels import fast_launch as FL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _needs_fast():
    why = FL.fast_launch_problem()
    if why is not None:
        pytest.skip(f"direct launch off here: {why}")


def test_second_call_is_direct_and_identical():
    _needs_fast()
    from hisparse.kernels.quant import quantize_fp8_ds_mla_kernel as k
    fk = FL.FastKernel(k)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn((300, 576), device="cuda", generator=g).to(torch.bfloat16)
    out_jit = torch.empty((300, 656), dtype=torch.uint8, device="cuda")
    k[(300,)](x, out_jit, x.stride(0), out_jit.stride(0), X_IS_BF16=True, num_warps=4)
    outs = []
    for _ in range(3):
        o = torch.full((300, 656), 7, dtype=torch.uint8, device="cuda")
        fk[(300,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)
        outs.append(o)
    torch.cuda.synchronize()
    assert fk.misses == 1 and fk.hits == 2
    for o in outs:
        assert torch.equal(o, out_jit)
    # another specialisation: an input 8 bytes off 16-byte alignment -> the JIT path, then direct
    buf = torch.empty(300 * 576 + 4, dtype=torch.bfloat16, device="cuda")
    xs = buf[4:4 + 299 * 576].view(299, 576)
    xs.copy_(x[1:])
    assert xs.data_ptr() % 16 == 8
    o1 = torch.empty((299, 656), dtype=torch.uint8, device="cuda")
    o2 = torch.empty((299, 656), dtype=torch.uint8, device="cuda")
    fk[(299,)](xs, o1, xs.stride(0), o1.stride(0), X_IS_BF16=True, num_warps=4)
    fk[(299,)](xs, o2, xs.stride(0), o2.stride(0), X_IS_BF16=True, num_warps=4)
    torch.cuda.synchronize()
    assert fk.misses == 2 and fk.hits == 3
    assert torch.equal(o1, out_jit[1:]) and torch.equal(o2, out_jit[1:])
    # a new launch option is a new key too
    fk[(300,)](x, outs[0], x.stride(0), outs[0].stride(0), X_IS_BF16=True, num_warps=8)
    assert fk.misses == 3


def test_launch_hooks_take_the_jit_path():
    _needs_fast()
    from triton import knobs
    from hisparse.kernels.quant import quantize_fp8_ds_mla_kernel as k
    fk = FL.FastKernel(k)
    x = torch.randn((64, 576), device="cuda").to(torch.bfloat16)
    o = torch.empty((64, 656), dtype=torch.uint8, device="cuda")
    fk[(64,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)
    fk[(64,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)
    assert fk.hits == 1  # direct with Triton's default (empty) hook chains
    seen = []

    def hook(md):
        seen.append(md)

    knobs.runtime.launch_enter_hook.add(hook)  # as a profiler installs one
    try:
        fk[(64,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fk.hits == 1 and fk.misses == 2 and len(seen) == 1
    fk[(64,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)
    assert fk.hits == 2


def test_direct_launches_are_captured_and_replayed():
    _needs_fast()
    from hisparse.kernels.quant import quantize_fp8_ds_mla_kernel as k
    fk = FL.FastKernel(k)
    x = torch.randn((128, 576), device="cuda").to(torch.bfloat16)
    o = torch.zeros((128, 656), dtype=torch.uint8, device="cuda")
    fk[(128,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)  # compiled (JIT)
    ref = o.clone()
    o.zero_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fk[(128,)](x, o, x.stride(0), o.stride(0), X_IS_BF16=True, num_warps=4)  # direct, captured
    assert fk.hits == 1
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert not o.any()  # captured, not run
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, ref)
    x.mul_(2)
    graph.replay()
    k[(128,)](x, ref, x.stride(0), ref.stride(0), X_IS_BF16=True, num_warps=4)
    torch.cuda.synchronize()
    assert torch.equal(o, ref)


def test_decode_layer_bits_with_direct_launch_on_and_off():
    """A serial decode layer over a hot cache (resolve, staging, Triton attention), every
    kernel through ``fast``: three steps with the direct path on give the bits and the
    cache state of the same steps with it off."""
    _needs_fast()
    from hisparse import HiSparseConfig
    from hisparse.attention.triton_backend import TritonBackend
    from hisparse.cache.cache import HiSparseCache
    from hisparse.decode import DecodeLayer
    from hisparse.formats import quantize_fp8_ds_mla

    def run(direct: bool):
        FL.set_direct_launch(direct)
        cfg = HiSparseConfig(num_layers=1, host_pool_tokens=8192, row_bytes=656, top_k=256,
                             device_buffer_size=512, max_num_reqs=4, max_query_len=1, host_block_size=64,
                             max_request_id=8, device="cuda")
        c = HiSparseCache(cfg, kernels="triton")
        g = torch.Generator().manual_seed(3)
        for r, n in enumerate((1500, 900, 2000)):
            c.add_request(r)
            c.write(0, r, quantize_fp8_ds_mla((torch.randn((n, 576), generator=g) * 0.5).to("cuda", torch.bfloat16)))
        layer = DecodeLayer(c, TritonBackend(validate=False), overlap="serial")
        req = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
        outs = []
        for step in range(3):
            gs = torch.Generator().manual_seed(10 + step)
            topk = torch.stack([torch.randperm(n, generator=gs)[:256] for n in (1500, 900, 2000)]).to("cuda", torch.int32)
            q = (torch.randn((3, 128, 576), generator=gs) * 0.3).to("cuda", torch.bfloat16)
            out, lse = layer(0, req, topk, q, sm_scale=0.07)
            outs.append((out.clone(), lse.clone()))
        torch.cuda.synchronize()
        return outs, c.stats()["total"]

    hits0 = sum(f.hits for f in list(FL._FAST.values()))
    try:
        on, stats_on = run(True)
        assert sum(f.hits for f in list(FL._FAST.values())) > hits0  # the direct path was taken
        off, stats_off = run(False)
    finally:
        FL.set_direct_launch(True)
    for (a, la), (b, lb) in zip(on, off):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert stats_on == stats_off


def test_attention_plans_launch_through_the_c_function_with_given_outputs():
    """An unchecked Triton decode past one wave of SMs (a wave-tail launch) into given
    outputs, 16-byte aligned or not (another key: the JIT first, then direct), equals
    the checked call bit for bit on every repeat; its remembered launches call the
    launcher's C function (``DirectLaunch._c``), pointers passed as addresses."""
    _needs_fast()
    from hisparse.attention import TritonBackend
    from hisparse.formats import quantize_fp8_ds_mla
    g = torch.Generator(device="cuda").manual_seed(3)
    T, H, K, N = 70, 128, 2048, 4096
    rows = quantize_fp8_ds_mla((torch.randn((N, 576), device="cuda", generator=g) * 0.5).to(torch.bfloat16))
    q = (torch.randn((T, H, 576), device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    idx = torch.randint(-1, N, (T, K), device="cuda", generator=g, dtype=torch.int32)
    kw = dict(sm_scale=576 ** -0.5, row_format="fp8_ds_mla")
    want = TritonBackend().decode(q, rows, idx, **kw)
    be = TritonBackend(validate=False)
    ob = torch.empty(T * H * 512 + 8, dtype=torch.bfloat16, device="cuda")
    lb = torch.empty(T * H + 4, dtype=torch.float32, device="cuda")
    for out, lse in ((None, None), (ob[:T * H * 512].view(T, H, 512), lb[:T * H].view(T, H)),
                     (ob[4:4 + T * H * 512].view(T, H, 512), lb[1:1 + T * H].view(T, H))):
        for _ in range(3):
            if out is not None:
                out.fill_(7)
                lse.fill_(7)
            got = be.decode(q, rows, idx, out=out, lse=lse, **kw)
            torch.cuda.synchronize()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert out is None or (got[0] is out and got[1] is lse)
    plans = list(be._plans.values())
    assert len(plans) == 2 and all(len(p.launches) == 2 for p in plans)  # main + wave tail each
    remembered = [d for p in plans for la in p.launches for d in la.main._compiled.values()]
    assert len(remembered) >= 6 and all(d._c is not None for d in remembered)
