"""Miss attention on CPU: the torch references against hand cases and the unsplit float32
reference, the Triton kernels (interpreter) against the references, input validation,
and a dry run of the benchmark.

Tolerances (rows and q ~ N(0, 1), sm_scale = 1/sqrt(576)):
- attention (kernel vs reference, split + merge vs unsplit): |out - ref| <= 3e-2 + 1e-2
  |ref| elementwise, |lse - ref| <= 1e-3, and the -inf pattern of lse exact. The kernels
  round p to bf16 for p . v, outputs are bf16, the hit partial of the split path is
  rounded to bf16 before the merge, and the interpreter truncates to bf16 (the GPU
  rounds), as in test_attention_triton.py.
- merge kernel vs merge reference (both float32 math, one bf16 rounding):
  |out - ref| <= 2^-7 |ref| + 1e-6, |lse - ref| <= 1e-5 + 1e-6 |ref|.
- extreme scales: per (token, head), 1% of that head's largest |ref out|; lse 1e-3
  relative.
"""

import json
import math

import pytest
import torch
from attention_common import run_sm90_compile
from ptx_checks import ex2_args_from_fma

from benchmarks import bench_miss_attention  # noqa: E402
from hisparse.attention.miss import (MissConfig, MissMode, merge_lse, merge_lse_reference,
                                     miss_attention_merge, miss_attention_merge_reference,
                                     plan_miss_attention)
from hisparse.attention.reference import ReferenceBackend
from hisparse.formats import BF16_ROW_BYTES, D_ROW, FP8_ROW_BYTES, quantize_fp8_ds_mla_reference

SCALE = 1.0 / math.sqrt(D_ROW)
ATOL, RTOL, LSE_TOL = 3e-2, 1e-2, 1e-3
REF = ReferenceBackend()
NINF = float("-inf")
FMTS = ["fp8_ds_mla", "bf16"]
CPU = torch.device("cpu")


# ------------------------------------------------------------------ builders and checks
def _rows(n, fmt, seed=0, *, extreme=False):
    """n rows as uint8 bytes [n, row_bytes] in ``fmt`` (fp8_ds_mla or bf16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_ROW, generator=g)
    if extreme:  # tile scales from 2^-40 to 2^30, zero rows and zero tiles
        x *= torch.exp2(torch.randint(-40, 31, (n, 1), generator=g).float())
        x[::7] = 0.0
        x[1::5, 256:384] = 0.0
    x = x.bfloat16()
    if fmt == "fp8_ds_mla":
        return quantize_fp8_ds_mla_reference(x)
    return x.contiguous().view(torch.uint8)


def _kv(rows, fmt):
    """The row view a backend takes: fp8 bytes as they are, bf16 rows as bf16 [n, 576]."""
    return rows if fmt == "fp8_ds_mla" else rows.view(torch.bfloat16)


def _q(T, H, seed=1, *, extreme=False):
    q = torch.randn(T, H, D_ROW, generator=torch.Generator().manual_seed(seed))
    if extreme and H >= 3:
        q[:, 0] *= 3e4
        q[:, 1] *= 1e-30
        q[:, 2] = 0.0
    return q.bfloat16()


def _garbage(n, rb, seed):
    """Random bytes as stale hot rows (fp8 NaN codes, NaN/inf scales and bf16 NaNs
    included): a kernel that read one it should not would produce NaN. Row 0 is a finite
    row: the float32 reference gathers row 0 for every padding entry and multiplies it
    by p = 0."""
    x = torch.randint(0, 256, (n, rb), generator=torch.Generator().manual_seed(seed),
                      dtype=torch.uint8)
    x[0] = _rows(1, "fp8_ds_mla" if rb == FP8_ROW_BYTES else "bf16", seed=seed)[0]
    return x


def _close(out, lse, ref_out, ref_lse, what=""):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), what
    assert not torch.isnan(lse).any() and not torch.isnan(out.float()).any(), what
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert err <= LSE_TOL, f"{what}: lse err {err}"
    err = (out.float() - ref_out.float()).abs()
    bad = err > ATOL + RTOL * ref_out.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max err {err.max().item()}"


def _close_extreme(out, lse, ref_out, ref_lse):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert ((lse[fin] - ref_lse[fin]).abs() <= 1e-3 * ref_lse[fin].abs().clamp_min(1.0)).all()
    err = (out.float() - ref_out.float()).abs().amax(-1)
    bound = 1e-2 * ref_out.float().abs().amax(-1)
    assert (err <= bound + 1e-30).all(), f"worst err / bound {(err / (bound + 1e-30)).max()}"


def _plan(mode, T, H, fmt, splits):
    if splits == 1:
        return None  # the no-scratch default
    cfg = MissConfig(block_h=16, block_n=16, num_warps=4, isolate_qk=False, num_splits=splits)
    return plan_miss_attention(mode=mode, max_tokens=max(T, 1) + 1, num_heads=H,
                               row_format=fmt, device=CPU, config=cfg)


# ------------------------------------------------------------------ merge_lse
def test_merge_lse_reference_hand_cases():
    """Four heads: both sides, only the hit side, only the miss side, neither."""
    out = torch.tensor([[[1.0] * 512, [2.0] * 512, [0.0] * 512, [0.0] * 512]]).bfloat16()
    lse = torch.tensor([[0.0, 1.5, NINF, NINF]])
    part = torch.tensor([[[3.0] * 512, [9.0] * 512, [4.0] * 512, [5.0] * 512]])
    plse = torch.tensor([[math.log(3.0), NINF, 2.0, NINF]])
    merge_lse_reference(out, lse, part, plse)
    # head 0: weights 1/4 and 3/4 -> 0.25 + 2.25 = 2.5, lse log(4)
    assert torch.allclose(out[0, 0].float(), torch.full((512,), 2.5))
    assert lse[0, 0].item() == pytest.approx(math.log(4.0), abs=1e-6)
    assert torch.equal(out[0, 1].float(), torch.full((512,), 2.0)) and lse[0, 1].item() == 1.5
    assert torch.equal(out[0, 2].float(), torch.full((512,), 4.0)) and lse[0, 2].item() == 2.0
    assert torch.equal(out[0, 3].float(), torch.zeros(512)) and lse[0, 3].item() == NINF


def _merge_problem(T, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(T, H, 512, generator=g).bfloat16()
    lse = torch.randn(T, H, generator=g) * 5
    part = torch.randn(T, H, 512, generator=g).to(dtype)
    plse = torch.randn(T, H, generator=g) * 5
    r = torch.rand(T, H, generator=g)
    lse[r < 0.2] = NINF
    plse[(r > 0.15) & (r < 0.4)] = NINF  # some heads with both sides empty
    far = torch.rand(T, H, generator=g) < 0.2  # one side dominating completely
    lse[far & torch.isfinite(lse)] += 1e4
    plse[(r > 0.9) & torch.isfinite(plse)] -= 1e4
    out[torch.isneginf(lse)] = float("nan")  # an empty side's out is never read
    part[torch.isneginf(plse)] = float("nan")
    return out, lse, part, plse


@pytest.mark.parametrize("T,H", [(0, 3), (1, 1), (3, 3), (3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lse_kernel_matches_reference(T, H, dtype):
    out, lse, part, plse = _merge_problem(T, H, dtype, seed=10 * T + H)
    before_out, before_lse = out.clone(), lse.clone()
    ref_out, ref_lse = out.clone(), lse.clone()
    merge_lse_reference(ref_out, ref_lse, part, plse)
    merge_lse(out, lse, part, plse, kernels="triton")
    keep = torch.isneginf(plse) & torch.isfinite(before_lse)  # untouched bit for bit
    assert torch.equal(out[keep].view(torch.int16), before_out[keep].view(torch.int16))
    assert torch.equal(lse[keep].view(torch.int32), before_lse[keep].view(torch.int32))
    neither = torch.isneginf(plse) & torch.isneginf(before_lse)  # NaN outs replaced by 0
    for o, l in ((out, lse), (ref_out, ref_lse)):
        assert not torch.isnan(o.float()).any() and bool((o[neither] == 0).all())
        assert torch.isneginf(l[neither]).all()
    m = ~keep & ~neither
    err = (out[m].float() - ref_out[m].float()).abs()
    assert (err <= 2 ** -7 * ref_out[m].float().abs() + 1e-6).all(), err.max()
    assert ((lse[m] - ref_lse[m]).abs() <= 1e-5 + 1e-6 * ref_lse[m].abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lse_kernel_at_huge_lse(dtype):
    """lses of ~3e13 (a x3e4 head over rows with tile scales 2^30), the second side a
    few float32 ulps (2^21 there) from the first, equal, or far below / above: the
    weights come from the difference alone, so the result is the reference's (the GPU
    build of a max-then-subtract merge got inf or 0 here; the sm90 compile test checks
    the PTX for that pattern)."""
    T, H = 2, 16
    g = torch.Generator().manual_seed(12)
    out = torch.randn(T, H, 512, generator=g).bfloat16()
    part = torch.randn(T, H, 512, generator=g).to(dtype)
    lse = (3e13 * (1 + torch.rand(T, H, generator=g))).float()
    lse[1] = -lse[1]
    ulp = torch.nextafter(lse.abs(), torch.tensor(float("inf"))) - lse.abs()
    step = torch.tensor([0, 0, 1, -1, 2, -2, 5, -5, 40, -40, 1e6, -1e6, 0, 0, 0, 0])
    plse = lse + step * ulp
    lse[:, 12] = NINF
    plse[:, 13] = NINF
    ref_out, ref_lse = out.clone(), lse.clone()
    merge_lse_reference(ref_out, ref_lse, part, plse)
    merge_lse(out, lse, part, plse, kernels="triton")
    assert torch.isfinite(lse[:, :12]).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert ((lse[fin] - ref_lse[fin]).abs() <= 1e-6 * ref_lse[fin].abs()).all()
    err = (out.float() - ref_out.float()).abs()
    assert (err <= 2 ** -7 * ref_out.float().abs() + 1e-6).all(), err.max()


# ------------------------------------------------------------------ split mode
def _miss_lists(T, K, N, seed, *, counts=None):
    """miss_idx int32 [T, K] with padding (-1), out-of-range entries and, beyond each
    count, entries that name real rows (must be ignored)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    r = torch.rand(T, K, generator=g)
    idx[r < 0.15] = -1
    idx[(r > 0.15) & (r < 0.2)] = N + 3
    idx[(r > 0.2) & (r < 0.22)] = -(2 ** 31)
    if counts is None:
        counts = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
        if T > 0:
            counts[0] = K
        if T > 1:
            counts[1] = 0
        if T > 2:
            counts[2] = K + 5  # clamped to K
    return idx, counts


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("T,H,K,splits", [(0, 3, 7, 1), (1, 1, 1, 1), (3, 3, 7, 1),
                                          (3, 16, 33, 1), (3, 3, 33, 3)])
def test_miss_attention_merge_matches_reference(fmt, T, H, K, splits):
    N = 40
    rows = _kv(_rows(N, fmt, seed=K), fmt)
    q = _q(T, H, seed=T + H)
    idx, counts = _miss_lists(T, K, N, seed=7 * K + T)
    out, lse, _, _ = _merge_problem(T, H, torch.float32, seed=3)
    out = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(out), out)
    ref_out, ref_lse = out.clone(), lse.clone()
    miss_attention_merge_reference(q, rows, idx, counts, ref_out, ref_lse, sm_scale=SCALE,
                                   row_format=fmt)
    plan = _plan(MissMode.SPLIT, T, H, fmt, splits)
    miss_attention_merge(q, rows, idx, counts, out, lse, sm_scale=SCALE, row_format=fmt,
                         plan=plan, kernels="triton")
    _close(out, lse, ref_out, ref_lse)
    if T > 1:  # token 1 has no miss: untouched
        assert torch.equal(out[1], ref_out[1])


@pytest.mark.parametrize("splits", [1, 2])
def test_merge_weights_exact_with_one_miss_per_token(splits):
    """With one valid miss per token the miss attention is exact (p = 1: out = the row,
    lse = its score), so only the merge's bf16 rounding remains: each element within
    2^-7 of the sum of the magnitudes of its two weighted terms. Hit lses are put near
    the miss scores so both weights matter (a 1% error in either would show)."""
    fmt, T, H, N = "bf16", 3, 16, 12
    rows = _rows(N, fmt, seed=8)
    q = _q(T, H, seed=9)
    idx = torch.tensor([[5, 1, 2, 3], [-1, 7, 8, 9], [11, 0, 0, 0]], dtype=torch.int32)
    counts = torch.tensor([1, 2, 1], dtype=torch.int32)  # token 1: the -1 then row 7
    one_idx = torch.tensor([[5], [7], [11]], dtype=torch.int32)
    score = torch.einsum("thd,td->th", q.float(), rows.view(torch.bfloat16)[one_idx[:, 0]].float())
    g = torch.Generator().manual_seed(10)
    out = torch.randn(T, H, 512, generator=g).bfloat16()
    lse = score * SCALE + torch.randn(T, H, generator=g)
    lse[0, :4] = NINF  # some heads without hits
    out[0, :4] = 0
    ref_out, ref_lse = out.clone(), lse.clone()
    miss_out = rows.view(torch.bfloat16)[one_idx[:, 0], :512].float()[:, None, :].expand(T, H, 512)
    merge_lse_reference(ref_out, ref_lse, miss_out.contiguous(), score * SCALE)
    w_miss = torch.exp(score * SCALE - ref_lse)
    bound = 2 ** -7 * ((1 - w_miss)[..., None] * out.float().abs()
                       + w_miss[..., None] * miss_out.abs()) + 1e-6
    plan = _plan(MissMode.SPLIT, T, H, fmt, splits)
    miss_attention_merge(q, _kv(rows, fmt), idx, counts, out, lse, sm_scale=SCALE,
                         row_format=fmt, plan=plan, kernels="triton")
    assert ((out.float() - ref_out.float()).abs() <= bound).all()
    assert ((lse - ref_lse).abs() <= 1e-5 * ref_lse.abs().clamp_min(1)).all()


# ------------------------------------------------------------------ end to end
def _pipeline_case(case, T, K, NH, seed):
    """(logical host rows int32 [T, K], is_hit bool [NH]) of a scenario."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, NH, (T, K), generator=g, dtype=torch.int32)
    hit = torch.rand(NH, generator=g) < 0.5
    if case == "all_hit":
        hit[:] = True
    elif case == "all_miss":
        hit[:] = False
    elif case == "empty":
        idx[:] = -1
    elif case == "duplicates":
        idx[:, 1::2] = idx[:, 0::2][:, : idx[:, 1::2].shape[1]]  # each row twice
        idx[-1] = idx[0]  # and across tokens
    elif case == "padding":
        idx[torch.rand(T, K, generator=g) < 0.4] = -1
        idx[0] = -1
    return idx, hit


def _split_inputs(idx, hit, NH, fmt, seed):
    """A hot buffer holding the hit rows (garbage in the misses' slots, staged later) and
    the per-token hit / miss lists the resolve would emit."""
    T, K = idx.shape
    rb = FP8_ROW_BYTES if fmt == "fp8_ds_mla" else BF16_ROW_BYTES
    N = NH + 5
    slot_of = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:NH]
    slot_of = slot_of.to(torch.int32)
    valid = idx >= 0
    safe = idx.clamp_min(0).long()
    phys = torch.where(valid, slot_of[safe], -1)
    is_hit = valid & hit[safe]
    hit_idx = torch.where(is_hit, phys, -1)
    miss = valid & ~hit[safe]
    counts = miss.sum(1).to(torch.int32)
    order = torch.argsort((~miss).to(torch.int8), dim=1, stable=True)  # misses first
    miss_idx = torch.gather(torch.where(miss, phys, -1), 1, order).to(torch.int32)
    miss_host = torch.gather(torch.where(miss, idx, -1), 1, order).to(torch.int32)
    hot = _garbage(N, rb, seed + 1)
    return hot, slot_of, hit_idx.to(torch.int32), miss_idx, miss_host, counts


CASES = ["mixed", "all_hit", "all_miss", "empty", "duplicates", "padding"]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", CASES)
def test_split_plus_merge_equals_unsplit(fmt, case):
    """Hit attention (reference backend over the hit rows in the hot buffer) + miss
    attention over the staged rows merged == attention over all entries of the resident
    rows."""
    T, H, K, NH = 3, 3, 33, 48
    seed = CASES.index(case) + 100 * FMTS.index(fmt)
    host = _rows(NH, fmt, seed=seed)
    q = _q(T, H, seed=seed + 1)
    idx, hit = _pipeline_case(case, T, K, NH, seed)
    hot, slot_of, hit_idx, miss_idx, miss_host, counts = _split_inputs(idx, hit, NH, fmt, seed)
    hot[slot_of[hit].long()] = host[hit]  # the hit rows are resident
    want_out, want_lse = REF.decode(q, _kv(host, fmt), idx, sm_scale=SCALE, row_format=fmt)
    out, lse = REF.decode(q, _kv(hot, fmt), hit_idx, sm_scale=SCALE, row_format=fmt)
    expect_hot = hot.clone()
    m = miss_host >= 0
    expect_hot[miss_idx[m].long()] = host[miss_host[m].long()]
    hot.copy_(expect_hot)  # the staging copy
    miss_attention_merge(q, _kv(hot, fmt), miss_idx, counts, out, lse, sm_scale=SCALE,
                         row_format=fmt, kernels="triton")
    _close(out, lse, want_out, want_lse, what=f"split {case} {fmt}")
    if case == "empty":
        assert torch.isneginf(lse).all() and (out == 0).all()


def test_split_plus_merge_extreme_scales():
    """fp8 rows with tile scales 2^-40..2^30 and zero tiles, heads scaled by 3e4, 1e-30
    and 0: split + merge still equals the unsplit reference."""
    fmt, T, H, K, NH = "fp8_ds_mla", 3, 16, 33, 48
    host = _rows(NH, fmt, seed=5, extreme=True)
    q = _q(T, H, seed=6, extreme=True)
    idx, hit = _pipeline_case("mixed", T, K, NH, seed=5)
    hot, slot_of, hit_idx, miss_idx, _, counts = _split_inputs(idx, hit, NH, fmt, 5)
    hot[slot_of.long()] = host  # everything staged
    want_out, want_lse = REF.decode(q, host, idx, sm_scale=SCALE, row_format=fmt)
    out, lse = REF.decode(q, hot, hit_idx, sm_scale=SCALE, row_format=fmt)
    miss_attention_merge(q, hot, miss_idx, counts, out, lse, sm_scale=SCALE,
                         row_format=fmt, kernels="triton")
    _close_extreme(out, lse, want_out, want_lse)


def test_auto_kernels_on_cpu_is_the_reference():
    """kernels='auto' on a CPU device runs the torch reference (the CPU path)."""
    T, H, K, N = 2, 3, 7, 16
    rows = _rows(N, "fp8_ds_mla")
    q = _q(T, H)
    idx, counts = _miss_lists(T, K, N, seed=4)
    a_out, a_lse = torch.zeros(T, H, 512).bfloat16(), torch.full((T, H), NINF)
    b_out, b_lse = a_out.clone(), a_lse.clone()
    miss_attention_merge(q, rows, idx, counts, a_out, a_lse, sm_scale=SCALE,
                         row_format="fp8_ds_mla")
    miss_attention_merge_reference(q, rows, idx, counts, b_out, b_lse, sm_scale=SCALE,
                                   row_format="fp8_ds_mla")
    assert torch.equal(a_out, b_out) and torch.equal(a_lse, b_lse)


# ------------------------------------------------------------------ validation
def _split_args(T=2, H=3, K=5, N=8):
    return dict(q=_q(T, H), kv_rows=_rows(N, "fp8_ds_mla"),
                miss_idx=torch.zeros(T, K, dtype=torch.int32),
                miss_counts=torch.full((T,), K, dtype=torch.int32),
                out=torch.zeros(T, H, 512).bfloat16(), lse=torch.full((T, H), NINF))


@pytest.mark.parametrize("bad,exc,msg", [
    (dict(q=torch.zeros(2, 3, 576)), TypeError, "q must have dtype bfloat16"),
    (dict(miss_idx=torch.zeros(2, 5, dtype=torch.int64)), TypeError, "miss_idx"),
    (dict(miss_idx=torch.zeros(3, 5, dtype=torch.int32)), ValueError, "miss_idx must be"),
    (dict(miss_counts=torch.zeros(3, dtype=torch.int32)), ValueError, "miss_counts"),
    (dict(out=torch.zeros(2, 3, 512)), TypeError, "out must have dtype bfloat16"),
    (dict(lse=torch.zeros(2, 4)), ValueError, "lse must have shape"),
    (dict(kv_rows=torch.zeros(8, 576, dtype=torch.uint8)), ValueError, "656"),
])
def test_split_bad_input_raises_and_changes_nothing(bad, exc, msg):
    args = _split_args()
    args.update(bad)
    before = args["out"].clone()
    with pytest.raises(exc, match=msg):
        miss_attention_merge(**args, sm_scale=SCALE, row_format="fp8_ds_mla", kernels="triton")
    assert torch.equal(args["out"], before)


def test_plan_mismatch_and_bad_config_raise():
    args = _split_args()
    small = _plan(MissMode.SPLIT, 0, 3, "fp8_ds_mla", 2)  # max_tokens 2
    args3 = _split_args(T=3)
    with pytest.raises(ValueError, match="plan covers 2 tokens"):
        miss_attention_merge(**args3, sm_scale=SCALE, row_format="fp8_ds_mla", plan=small)
    with pytest.raises(ValueError, match="bf16 rows"):
        miss_attention_merge(**args, sm_scale=SCALE, row_format="fp8_ds_mla",
                             plan=_plan(MissMode.SPLIT, 2, 3, "bf16", 2))
    with pytest.raises(TypeError, match="plan must be a MissPlan"):
        miss_attention_merge(**args, sm_scale=SCALE, row_format="fp8_ds_mla", plan="split")
    with pytest.raises(ValueError, match="power of two"):
        MissConfig(block_h=24)
    with pytest.raises(ValueError, match="num_splits"):
        MissConfig(num_splits=0)
    with pytest.raises(TypeError, match="isolate_qk"):
        MissConfig(isolate_qk=1)
    p = plan_miss_attention(mode="split", max_tokens=4, num_heads=3, row_format="bf16",
                            device="cpu", config=MissConfig(num_splits=3))
    assert p.part_out.shape == (4, 3, 3, 512) and p.part_lse.shape == (4, 3, 3)
    assert plan_miss_attention(mode="split", max_tokens=4, num_heads=3, row_format="bf16",
                               device="cpu").part_out is None  # CPU default: one split
    with pytest.raises(ValueError, match="fused"):  # split is the only miss mode
        plan_miss_attention(mode="fused", max_tokens=4, num_heads=3, row_format="bf16", device="cpu")


# ------------------------------------------------------------------ sm90 build
_SM90_COMPILE = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hisparse.attention.miss import MERGE_BLOCK_H, gpu_config
from hisparse.kernels import mla_miss as M
from ptx_checks import ex2_args_from_fma, resource_usage

STRIDES = ("H", "q_stride_t", "q_stride_h", "kv_stride", "idx_stride")

def build(fn, sig, consts, **opts):
    # what the launcher specializes at run time: 16-aligned pointers, strides and sizes
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n in STRIDES}
    k = triton.compile(ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    usage = resource_usage(k.asm["cubin"])
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    layouts = dict(re.findall(r"^(#\w+) = #ttg.blocked<\{sizePerThread = \[([\d, ]+)\]", ttgir, re.M))
    # vector width (int32 elements per thread) of every load/store of an i32 row tile
    vec = sorted({int(layouts[l].split(",")[-1]) for l in re.findall(
        r"tt\.(?:load|store) [^\n]*tensor<\d+x(?:256|512)x!tt\.ptr<i32>, (#\w+)>", ttgir)})
    mma = re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]", ttgir)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"stack": int(stack.group(1)) if stack else None, "shared": k.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "barriers": len(re.findall(r"\b(?:gpu\.barrier|ttg\.barrier)\b", ttgir)),
            "mma_warps": sorted({(int(a), int(b)) for a, b in mma}), "row_vec": vec,
            "ex2_from_fma": len(ex2_args_from_fma(ptx))}

res = []
for fp8 in (True, False):
    kv = "*u8" if fp8 else "*bf16"
    for H, S in ((128, 1), (128, 4), (16, 1), (32, 2)):
        c = gpu_config("split", H, num_splits=S)
        sig = {"q_ptr": "*bf16", "kv_ptr": kv, "idx_ptr": "*i32", "cnt_ptr": "*i32",
               "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
               "part_lse_ptr": "*fp32", "N": "i32", "K": "i32", "H": "i32", "q_stride_t": "i32",
               "q_stride_h": "i32", "kv_stride": "i32", "idx_stride": "i32",
               "qk_scale_log2": "fp32", "IS_FP8": "constexpr", "NUM_SPLITS": "constexpr",
               "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "ISOLATE_QK": "constexpr",
               "PREFETCH": "constexpr"}
        consts = {"IS_FP8": fp8, "NUM_SPLITS": S, "BLOCK_H": c.block_h, "BLOCK_N": c.block_n,
                  "ISOLATE_QK": c.isolate_qk, "PREFETCH": int(c.prefetch)}
        r = build(M.miss_split_kernel, sig, consts, num_warps=c.num_warps,
                  num_stages=c.num_stages)
        res.append({"kernel": "split", "fp8": fp8, "H": H, "S": S, "block_h": c.block_h, **r})
sig = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*bf16",
       "lse_ptr": "*fp32", "K": "i32", "H": "i32", "NUM_SPLITS": "constexpr", "BLOCK_N": "constexpr",
       "BLOCK_H": "constexpr"}
r = build(M.miss_combine_kernel, sig, {"NUM_SPLITS": 4, "BLOCK_N": 32, "BLOCK_H": MERGE_BLOCK_H},
          num_warps=4)
res.append({"kernel": "combine", "block_h": MERGE_BLOCK_H, **r})
for po in ("*fp32", "*bf16"):
    sig = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": po, "part_lse_ptr": "*fp32",
           "H": "i32", "BLOCK_H": "constexpr"}
    r = build(M.miss_merge_kernel, sig, {"BLOCK_H": MERGE_BLOCK_H}, num_warps=4)
    res.append({"kernel": "merge", "block_h": MERGE_BLOCK_H, **r})
print(json.dumps(res))
'''


def test_ex2_args_from_fma_finds_a_contracted_scale_minus_max():
    """The PTX check of the compile tests flags an exp2 argument that comes out of an fma
    (directly or through selp / neg / mov), as the GPU build of ``exp2(a * c - max)``
    produced, and nothing else."""
    bad = """
	mul.f32 	%r6, %r28, 0f3FB8AA3B;
	max.f32 	%r56, %r51, %r6;
	fma.rn.f32 	%r62, %r42, 0f3FB8AA3B, %r61;
	ex2.approx.ftz.f32 	%r71, %r62;
	fma.rn.f32 	%r63, %r43, 0f3FB8AA3B, %r61;
	selp.f32 	%r64, %r63, 0f00000000, %p13;
	neg.f32 	%r65, %r64;
	ex2.approx.ftz.f32 	%r72, %r65;
	@%p2 ex2.approx.f32 	%r73, %r6;
"""
    assert ex2_args_from_fma(bad) == ["%r62", "%r65"]
    good = """
	sub.f32 	%r60, %r55, %r56;
	mul.f32 	%r65, %r60, 0f3FB8AA3B;
	selp.f32 	%r70, %r65, 0f00000000, %p13;
	ex2.approx.ftz.f32 	%r71, %r70;
	ex2.approx.ftz.f32 	%r72, %r60;
"""
    assert ex2_args_from_fma(good) == []


def test_kernels_compile_for_sm90_without_spills():
    """Compile every miss kernel at the shapes ``gpu_config`` picks (ptxas from the Triton
    wheel, no GPU needed) for sm90: no register spills; wgmma with both warpgroups
    splitting the rows at 64-head blocks (the one-trip loops survive); no CTA barrier;
    no exp2 argument straight out of an fma (a product
    contracted into the subtraction of a max taken over the rounded products: inf or 0
    at |lse| ~ 1e13, see ``ptx_checks``), which the interpreter cannot show."""
    stats = run_sm90_compile(_SM90_COMPILE, timeout=300)
    assert len(stats) == 11
    for s in stats:
        assert s["stack"] == 0, f"register spills: {s}"
        assert s["shared"] <= 227 * 1024, s
        assert s["ex2_from_fma"] == 0, f"exp2 of an fma (product - max): {s}"
        if s["block_h"] == 64:
            assert s["wgmma"] > 0 and [8, 1] not in s["mma_warps"], s
        assert s["barriers"] == 0, s


# ------------------------------------------------------------------ benchmark smoke
def test_bench_miss_attention_dry_run(tmp_path, capsys):
    out = tmp_path / "miss.json"
    assert bench_miss_attention.main(["--dry-run", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["benchmark"] == "miss_attention" and "dry run" in d["note"]
    assert d["cases"], "no cases recorded"
    assert [(c["miss_frac"], c["misses_per_token"]) for c in d["cases"]] == [(0.0, 0), (0.1, 3)]
    for c in d["cases"]:
        assert c["ok"] and c["staged_rows_exact"], c
        for key in ("resident_decode", "hit_decode", "staging", "split", "layer_serial",
                    "layer_split"):
            assert c[key]["median_us"] > 0, key
        assert (c["bulk_h2d"] is None) == (c["misses_per_token"] == 0)
        assert c["max_err_split"] < 0.05, c
