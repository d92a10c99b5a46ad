"""Helpers shared by the attention tests: GPU problems and checks against the float32
reference (test_attention_gpu.py, test_attention_ws_gpu.py) and the offline sm90
compile runner (test_attention_triton.py, test_attention_ws_compile.py).

Tolerance (rows and q ~ N(0, 1), sm_scale = 1/sqrt(576)): |out - ref| <= 2e-2 + 1e-2 *
|ref| elementwise and |lse - ref| <= 1e-3, ref the float32 torch reference.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import triton

from hisparse.attention.reference import ReferenceBackend
from hisparse.formats import quantize_fp8_ds_mla

SCALE = 1.0 / math.sqrt(576)
ATOL, RTOL, LSE_TOL = 2e-2, 1e-2, 1e-3
REF = ReferenceBackend()


def make_problem(T, H, K, fmt, *, N=8192, pad=0.1, seed=0):
    """q bf16 [T, H, 576], rows, indices int32 [T, K] (distinct rows per token, ~pad -1),
    valid counts int32 [T] (0, K and random in between)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, 576, device="cuda", generator=g).bfloat16()
    rows = quantize_fp8_ds_mla(x) if fmt == "fp8_ds_mla" else x
    q = torch.randn(T, H, 576, device="cuda", generator=g).bfloat16()
    idx = torch.rand(T, N, device="cuda", generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    idx[torch.rand(T, K, device="cuda", generator=g) < pad] = -1
    vc = torch.randint(0, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
    vc[0] = K
    if T > 1:
        vc[1] = 0
    return q, rows, idx, vc


def check(out, lse, ref_out, ref_lse, what=""):
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), what
    fin = torch.isfinite(ref_lse)
    if fin.any():
        lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert lse_err <= LSE_TOL, f"{what}: lse err {lse_err}"
    err = (out.float() - ref_out.float()).abs()
    bad = err > ATOL + RTOL * ref_out.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max err {err.max().item()}"


def check_extreme_scales(backend):
    """fp8 rows with tile scales 2^-40..2^30, zero rows and tiles, q heads from 1e-30 to
    3e4 and a zero head, a short index row: each (token, head) must match the reference
    to 1% of its own largest |out|, and the lse to 1e-3 relative."""
    T, H, K, N = 16, 128, 2048, 8192
    g = torch.Generator(device="cuda").manual_seed(77)
    x = torch.randn(N, 576, device="cuda", generator=g)
    x *= torch.exp2(torch.randint(-40, 31, (N, 1), device="cuda", generator=g).float())
    x[::97] = 0.0
    x[1::89, 256:384] = 0.0
    rows = quantize_fp8_ds_mla(x.bfloat16())
    q = torch.randn(T, H, 576, device="cuda", generator=g)
    q[:, 0] *= 3e4
    q[:, 1] *= 1e-30
    q[:, 2] = 0.0
    q[0, 64:100] *= 1e-3
    q = q.bfloat16()
    idx = torch.rand(T, N, device="cuda", generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    idx[3, 1000:] = -1  # a short row: loads running past its end are masked
    out, lse = backend.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    ref_out, ref_lse = REF.decode(q, rows, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    torch.cuda.synchronize()
    assert ((lse - ref_lse).abs() <= 1e-3 * ref_lse.abs().clamp_min(1.0)).all()
    err = (out.float() - ref_out.float()).abs().amax(-1)
    bound = 1e-2 * ref_out.float().abs().amax(-1)
    assert (err <= bound + 1e-30).all(), f"worst err / max|ref| {(err / bound).max().item()}"


def check_graph_capture(backend, T: int = 64):
    """Capture one fp8 decode (T tokens, H=128) in a CUDA graph: the replay equals the
    eager call bitwise, and replays on new q in the same buffers match the reference."""
    q, rows, idx, vc = make_problem(T, 128, 2048, "fp8_ds_mla", seed=5)
    eager = backend.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        backend.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = backend.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE,
                                  row_format="fp8_ds_mla")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    q.copy_(torch.randn_like(q, dtype=torch.float32).bfloat16())  # new inputs, same buffers
    graph.replay()
    ref = REF.decode(q, rows, idx, valid_counts=vc, sm_scale=SCALE, row_format="fp8_ds_mla")
    check(out, lse, *ref, what="graph replay")


def run_sm90_compile(script: str, *args: str, timeout: int = 600):
    """Run a compile script (ptxas from the Triton wheel, no GPU) in a fresh interpreter
    without TRITON_INTERPRET, with the repository and tests/ (``ptx_checks``) on the path;
    returns the JSON its last stdout line holds."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"no ptxas in the Triton wheel ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
