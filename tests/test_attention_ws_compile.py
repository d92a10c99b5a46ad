"""CPU: the warp-specialised Gluon decode kernel (``mla_decode_ws``) compiles for sm90
(ptxas from the Triton wheel, no GPU) at the default ring and a spread of the ring
shapes the GPU tests run, within the register and shared-memory budget the launcher
sets; and its config is validated. Its numerics are checked on the H200
(tests/test_attention_ws_gpu.py): Gluon has no interpreter mode. Under a Triton whose
Gluon lacks what the kernel uses (``gluon_ws_problem()``), the compile test is skipped
with that reason: the launcher then runs the ``tl`` kernels.
"""

import json

import pytest
import torch
from attention_common import run_sm90_compile

from hisparse._checks import interpreter_mode
from hisparse.attention.triton_backend import (WS_DEFAULT, WS_MAX_SHARED, TritonBackend,
                                               TritonMLAConfig, default_config, ws_shared_bytes)
from hisparse.kernels.gluon_support import gluon_ws_problem
from ptx_checks import cp_async_after_shared_read

_COMPILE = r'''
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from hisparse.attention.triton_backend import WS_MAXNREG, ws_consumer_regs
from hisparse.kernels.mla_decode_ws import sparse_mla_decode_ws_kernel
from ptx_checks import cp_async_after_shared_read, ex2_args_from_fma
from compile_args import unpaged_args

out = []
for bn, stages, raw, preg, splits in json.loads(sys.argv[1]):
    sig = {"q_ptr": "*bf16", "kv_ptr": "*u8", "idx_ptr": "*i32", "vc_ptr": "*i32",
           "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "N": "i32", "K": "i32", "H": "i32", "q_stride_t": "i32",
           "q_stride_h": "i32", "kv_stride": "i32", "idx_stride": "i32",
           "rows_per_split": "i32", "qk_scale_log2": "fp32"}
    consts = dict(HAS_VC=True, NUM_SPLITS=splits, BLOCK_N=bn, STAGES=stages, RAW=raw,
                  PRODUCER_REGS=preg, CONSUMER_REGS=ws_consumer_regs(preg))
    sig.update({k: "constexpr" for k in consts})
    psig, pconsts = unpaged_args()  # the paged-lookup parameters, unused (compile_args)
    sig.update(psig)
    consts.update(pconsts)
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ("K", "q_stride_t", "q_stride_h", "kv_stride",
                                                "idx_stride", "rows_per_split")}
    k = triton.compile(GluonASTSource(fn=sparse_mla_decode_ws_kernel, signature=sig,
                                      constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, maxnreg=WS_MAXNREG))
    ptx = k.asm["ptx"]
    out.append({"cfg": [bn, stages, raw, preg, splits], "shared": k.metadata.shared,
                "warps": k.metadata.num_warps,
                "setmaxnreg": sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                "wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async.cg.shared.global"),
                "mbarrier_wait": ptx.count("mbarrier.try_wait"),
                "ex2_from_fma": len(ex2_args_from_fma(ptx)),
                "cp_async_after_read": cp_async_after_shared_read(ptx),
                "consumer_regs": ws_consumer_regs(preg)})
print(json.dumps(out))
'''

# (block_n, stages, raw, producer regs, splits): the default and some of the GPU tests' rings
RINGS = [(WS_DEFAULT["block_n"], WS_DEFAULT["num_stages"], WS_DEFAULT["ws_raw"],
          WS_DEFAULT["ws_producer_regs"], 1),
         (32, 2, 3, 56, 3), (16, 4, 4, 56, 1), (32, 2, 2, 72, 3), (16, 2, 8, 88, 1)]


def test_ws_kernel_compiles_for_sm90_within_budget():
    problem = gluon_ws_problem()
    if problem is not None:
        pytest.skip(f"the launcher runs the tl kernels instead: {problem}")
    stats = run_sm90_compile(_COMPILE, json.dumps(RINGS))
    assert len(stats) == len(RINGS)
    for s in stats:
        bn, stages, raw, preg, _ = s["cfg"]
        assert s["warps"] == 12, s  # 4 (consumer 0) + 4 (consumer 1) + 4 (producer)
        # the partitions really get the registers the launcher asks for
        assert preg in s["setmaxnreg"] and s["consumer_regs"] in s["setmaxnreg"], s
        # the budget estimate the config validates against covers what Triton allocates
        est = ws_shared_bytes(bn, stages, raw)
        assert est <= s["shared"] <= est + 2048 and s["shared"] <= WS_MAX_SHARED + 1024, (est, s)
        assert s["wgmma"] > 0 and s["cp_async"] > 0 and s["mbarrier_wait"] > 0, s
        assert s["ex2_from_fma"] == 0, s  # exp2 of a contracted product - max (ptx_checks)
        # every raw-slot refill follows a producer barrier (ptx_checks): the scales of a
        # slot are read by other warps than those that gather them
        assert s["cp_async_after_read"] == [], s


def test_ws_config_validation():
    base = dict(block_h=64, block_n=32, num_warps=4, num_stages=2, ws=True)
    TritonMLAConfig(**base)
    for bad, match in ((dict(block_n=64), "block_n 16 or 32"), (dict(block_h=32), "block_h 64"),
                       (dict(num_warps=8), "num_warps 4"), (dict(ws_raw=1), "ws_raw"),
                       (dict(ws_raw=9), "ws_raw"), (dict(ws_producer_regs=48), "ws_producer_regs"),
                       (dict(num_stages=6), "shared memory"), (dict(wide=True), "own kernel"),
                       (dict(isolate_qk=True), "own kernel")):
        with pytest.raises(ValueError, match=match):
            TritonMLAConfig(**{**base, **bad})
    for bad, match in ((dict(ws_raw=True), "ws_raw must be an int"),
                       (dict(ws=1), "ws must be a bool")):
        with pytest.raises(TypeError, match=match):
            TritonMLAConfig(**{**base, **bad})
    # CPU (and any non-SM-9.x device) never gets the ws kernel by default
    assert not default_config(64, 128, 2048, torch.device("cpu"), "fp8_ds_mla").ws


def test_ws_on_cpu_is_a_clear_error():
    be = TritonBackend(config=TritonMLAConfig(block_h=64, block_n=32, num_warps=4, num_stages=2,
                                              ws=True), allow_interpreter=True)
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    rows = torch.zeros(16, 656, dtype=torch.uint8)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    if not interpreter_mode():
        pytest.skip("the CPU path needs TRITON_INTERPRET=1 (set by the test runner)")
    with pytest.raises(ValueError, match="ws=True.*CUDA SM 9.x"):
        be.decode(q, rows, idx, sm_scale=0.1, row_format="fp8_ds_mla")


def test_cp_async_after_shared_read_finds_a_refill_without_a_barrier():
    ok = """
\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
\tld.shared.v4.b32 \t{%r3, %r4, %r5, %r6}, [%r7+16];
\tbar.sync \t3, 128;
\t@%p1 cp.async.ca.shared.global [ %r8 + 0 ], [ %rd2 + 0 ], 0x4, %r9;
"""
    assert cp_async_after_shared_read(ok) == []
    bad = ok.replace("\tbar.sync \t3, 128;\n", "\tadd.s32 \t%r10, %r10, 1;\n")
    assert cp_async_after_shared_read(bad) == [5]
    read_after_barrier = ok.replace("\tbar.sync \t3, 128;\n", "\tbarrier.sync \t1;\n\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];\n")
    assert cp_async_after_shared_read(read_after_barrier) == [6]
    assert cp_async_after_shared_read(bad.replace("ld.shared", "ld.volatile.shared")) == [5]
    # a loop: the refill at its head follows the reads at its end
    loop = """$L__BB0_1:
\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
\tbar.sync \t3, 128;
\tld.shared.v4.b32 \t{%r4, %r5, %r6, %r7}, [%r8+16];
\t@%p1 bra \t$L__BB0_1;
\tret;
"""
    assert cp_async_after_shared_read(loop) == [2]
    assert cp_async_after_shared_read(loop.replace("\t@%p1 bra", "\tbar.sync \t3, 128;\n\t@%p1 bra")) == []
    # a branch over the barrier
    skip = """\tld.shared.u32 \t%r1, [%r2];
\t@%p1 bra \t$L__BB0_2;
\tbar.sync \t3, 128;
$L__BB0_2:
\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
"""
    assert cp_async_after_shared_read(skip) == [5]
    assert cp_async_after_shared_read(skip.replace("\t@%p1 bra", "\tbar.sync \t3, 128;\n\t@%p1 bra")) == []
