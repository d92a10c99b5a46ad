"""CPU: the ``tl`` sparse-MLA decode kernels (tiled and fused-tile bodies) and the
split-KV combine kernel compile for sm90 (ptxas from the Triton wheel, no GPU) at the
default shapes: no register spills (small ones on Triton releases other than the
H200's 3.6), shared memory within budget, wgmma at 64-head blocks, the L2 prefetch
hint where asked for, no exp2 argument straight out of an fma. Their numerics are the
interpreter tests' (test_attention_triton.py); the warp-specialised kernel's compile
is test_attention_ws_compile.py.
"""

import triton
from attention_common import run_sm90_compile


# ------------------------------------------- compiles for the H200 (sm90)
_SM90_COMPILE = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dataclasses, torch
from hisparse.attention.triton_backend import DEFAULT_CONFIGS, isolate_problem
from hisparse.formats import RowFormat
from hisparse.kernels import mla_decode as M
from hisparse.kernels import mla_decode_wide as MW
from ptx_checks import ex2_args_from_fma, resource_usage
from compile_args import unpaged_args

def compile_decode(fp8, bh, splits):
    cfg = DEFAULT_CONFIGS[(RowFormat.FP8_DS_MLA if fp8 else RowFormat.BF16, bh)]
    if isolate_problem(cfg, torch.device("cuda")):  # as default_config does on such a Triton
        cfg = dataclasses.replace(cfg, isolate_qk=False)
    sig = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32",
           "vc_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "N": "i32", "K": "i32", "H": "i32", "q_stride_t": "i32",
           "q_stride_h": "i32", "kv_stride": "i32", "idx_stride": "i32",
           "rows_per_split": "i32", "qk_scale_log2": "fp32", "HAS_VC": "constexpr",
           "IS_FP8": "constexpr", "NUM_SPLITS": "constexpr", "BLOCK_H": "constexpr",
           "BLOCK_N": "constexpr", "ISOLATE_QK": "constexpr", "PREFETCH": "constexpr"}
    consts = {"HAS_VC": True, "IS_FP8": fp8, "NUM_SPLITS": splits, "BLOCK_H": bh,
              "BLOCK_N": cfg.block_n, "ISOLATE_QK": cfg.isolate_qk, "PREFETCH": cfg.prefetch}
    if cfg.wide:  # the fused-tile body always isolates its dots
        del sig["ISOLATE_QK"], consts["ISOLATE_QK"]
    else:  # the tiled body's paged-lookup parameters, unused (compile_args)
        psig, pconsts = unpaged_args()
        sig.update(psig)
        consts.update(pconsts)
    names = list(sig)
    # what the launcher specializes at run time: 16-aligned pointers, strides and sizes
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ("N", "K", "H", "q_stride_t", "q_stride_h",
                                                "kv_stride", "idx_stride", "rows_per_split")}
    fn = MW.sparse_mla_decode_wide_kernel if cfg.wide else M.sparse_mla_decode_kernel
    src = ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    usage = resource_usage(k.asm["cubin"])
    stack = re.search(r"STACK:(\d+)", usage)
    mma = re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]", k.asm["ttgir"])
    return {"fp8": fp8, "block_h": bh, "splits": splits, "shared": k.metadata.shared,
            "wide": cfg.wide, "isolated": cfg.isolate_qk or cfg.wide,
            "mma_warps": sorted({(int(a), int(b)) for a, b in mma}),
            "stack": int(stack.group(1)) if stack else None,
            "wgmma": k.asm["ptx"].count("wgmma.mma_async"), "prefetch": cfg.prefetch,
            "l2_prefetches": k.asm["ptx"].count("prefetch.global.L2"),
            "ex2_from_fma": len(ex2_args_from_fma(k.asm["ptx"]))}

res = [compile_decode(fp8, bh, splits) for fp8 in (True, False) for bh, splits in ((64, 1), (16, 4))]
src = ASTSource(fn=M.sparse_mla_combine_kernel,
                signature={"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                           "lse_ptr": "*fp32", "H": "i32", "NUM_SPLITS": "constexpr",
                           "SPLITS_P2": "constexpr"}, constexprs={"NUM_SPLITS": 3, "SPLITS_P2": 4})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(json.dumps({"decode": res, "combine_ex2_from_fma": len(ex2_args_from_fma(k.asm["ptx"]))}))
'''


def test_kernels_compile_for_sm90_without_spills():
    """Compile (ptxas from the Triton wheel, no GPU needed) the decode kernel at the
    default shapes for sm90: no register spills, wgmma used at block_h = 64.

    The defaults were chosen under Triton 3.6 (the H200's), where none spills. Other
    releases allocate registers differently (3.9: 8 bytes of stack in the fp8 fused-tile
    kernel at block_h 64); there the kernels must compile and any spill stay small.
    Under 3.7 / 3.8 the tiled body runs without isolate_qk at block_h 64
    (``isolate_problem``), as ``default_config`` picks it there. No exp2 argument comes
    straight out of an fma, in these or the combine kernel (``ptx_checks``)."""
    got = run_sm90_compile(_SM90_COMPILE, timeout=300)
    stats = got["decode"]
    assert got["combine_ex2_from_fma"] == 0 and all(s["ex2_from_fma"] == 0 for s in stats), got
    spill_limit = 0 if triton.__version__.startswith("3.6.") else 64
    for s in stats:
        assert s["stack"] <= spill_limit, f"register spills (Triton {triton.__version__}): {s}"
        assert s["shared"] <= 227 * 1024, s
    assert all(s["wgmma"] > 0 for s in stats if s["block_h"] == 64)
    # the prefetch hint really reaches the PTX where the default shape asks for it
    assert all((s["l2_prefetches"] > 0) == (s["prefetch"] > 0) for s in stats), stats
    # isolated dots at block_h 64: none laid out over all 8 warps along the 64 heads
    # (which would make both warpgroups compute the same q . k^T)
    assert all([8, 1] not in s["mma_warps"] for s in stats if s["block_h"] == 64
               and s["isolated"]), stats
