"""Helpers shared by the attention tests: GPU problems and checks against the float32
reference (test_attention_gpu.py, test_attention_ws_gpu.py), the offline sm90
compile runner (test_attention_compile.py, test_attention_ws_compile.py), and the
empty-row cases every backend's output goes through the LSE merges with
(test_miss_merge_empty.py on CPU, test_miss_attention_gpu.py and test_backends_gpu.py).

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

from hisparse.attention.miss import merge_lse, miss_attention_merge
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


# ------------------------------------------------------------------ empty rows into a merge
EMPTY_ATOL, EMPTY_RTOL, EMPTY_LSE_TOL = 3e-2, 2e-2, 5e-3  # any backend vs the float32 union
NAN = float("nan")


def empty_rows_problem(*, H, fmt, device, K_hit=8, K_miss=4, N=64, seed=0):
    """Six query tokens whose hit and miss lists cover every way a side can be empty:

      token  hit entries        miss entries                    merged result
      0      none (all -1)      valid                           the misses alone
      1      valid              count 0                         the hits alone
      2      none               count > 0, every entry -1       out = 0, lse = -inf
      3      none               count 0                         out = 0, lse = -inf
      4      valid              valid                           both
      5      valid, -1 mixed    valid, -1 mixed                 both

    Returns q bf16 [6, H, 576], rows (the kv view of ``fmt``: uint8 [N, 656] or bf16
    [N, 576]), hit_idx int32 [6, K_hit], miss_idx int32 [6, K_miss], miss_counts int32
    [6] and union int32 [6, K_hit + K_miss] (every valid entry of both lists, -1
    elsewhere). A token's hit and miss rows are distinct rows.
    """
    T = 6
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 576, generator=g).bfloat16()
    rows = quantize_fp8_ds_mla(x.to(device)) if fmt == "fp8_ds_mla" else x.to(device)
    q = torch.randn(T, H, 576, generator=g).bfloat16().to(device)
    perm = torch.stack([torch.randperm(N, generator=g)[:K_hit + K_miss] for _ in range(T)])
    hit = perm[:, :K_hit].to(torch.int32)
    miss = perm[:, K_hit:].to(torch.int32)
    counts = torch.full((T,), K_miss, dtype=torch.int32)
    hit[[0, 2, 3]] = -1
    counts[[1, 3]] = 0
    miss[2] = -1
    hit[5, ::2] = -1
    miss[5, 1] = -1
    counts[5] = K_miss - 1
    k = torch.arange(K_miss)[None, :]
    used_miss = torch.where(k < counts[:, None], miss, -1)
    union = torch.cat([hit, used_miss], dim=1).to(torch.int32)
    return (q, rows, hit.to(device), miss.to(device), counts.to(device), union.to(device))


def check_empty_rows_through_merge(hit_backend, *, fmt, device, H, path, kernels="auto",
                                   plan=None, nan_in_empty=False, seed=0):
    """The hit partial of ``hit_backend`` over ``empty_rows_problem`` merged with the
    misses along ``path`` equals the float32 reference over both lists, with no NaN
    anywhere, out = 0 and lse = -inf where both sides are empty.

    path: "split" (``miss_attention_merge`` over the miss lists) or "merge" (the
    reference's miss partial into ``merge_lse``). The backend's empty tokens must come
    back as out = 0, lse = -inf (the backend contract); with ``nan_in_empty`` their out
    is then overwritten with NaN (and so is the miss partial's, "merge"), which the
    merge must not read.
    """
    q, rows, hit, miss, counts, union = empty_rows_problem(H=H, fmt=fmt, device=device,
                                                           seed=seed)
    out, lse = hit_backend.decode(q, rows, hit, sm_scale=SCALE, row_format=fmt)
    empty = torch.isneginf(lse)
    assert empty[[0, 2, 3]].all() and not empty[[1, 4, 5]].any(), f"{hit_backend.name}: {lse}"
    assert bool((out[empty] == 0).all()), f"{hit_backend.name}: an empty token's out is not 0"
    if nan_in_empty:
        out[empty] = NAN
    if path == "split":
        miss_attention_merge(q, rows, miss, counts, out, lse, sm_scale=SCALE, row_format=fmt,
                             plan=plan, kernels=kernels)
    elif path == "merge":
        k = torch.arange(miss.shape[1], device=device)[None, :]
        listed = torch.where(k < counts[:, None], miss, torch.full_like(miss, -1))
        part_out, part_lse = REF.decode(q, rows, listed, sm_scale=SCALE, row_format=fmt)
        part_out = part_out.float()
        if nan_in_empty:
            part_out[torch.isneginf(part_lse)] = NAN
        merge_lse(out, lse, part_out, part_lse, kernels=kernels)
    else:
        raise ValueError(f"path must be 'split' or 'merge', got {path!r}")
    want_out, want_lse = REF.decode(q, rows, union, sm_scale=SCALE, row_format=fmt)
    if device.type == "cuda":
        torch.cuda.synchronize()
    what = f"{hit_backend.name} {path} {fmt} nan_in_empty={nan_in_empty}"
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any(), what
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), what
    assert torch.isneginf(lse[[2, 3]]).all() and bool((out[[2, 3]] == 0).all()), what
    fin = torch.isfinite(want_lse)
    lse_err = (lse[fin] - want_lse[fin]).abs().max().item()
    assert lse_err <= EMPTY_LSE_TOL, f"{what}: lse err {lse_err}"
    err = (out.float() - want_out.float()).abs()
    bad = err > EMPTY_ATOL + EMPTY_RTOL * want_out.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max err {err.max().item()}"
