"""Miss attention on the GPU at decode shapes (T = 64, H = 128, K = 2048, ~10% misses,
fp8_ds_mla; host rows in a pinned ``PinnedBuffer``): the kernels against the torch
references, split + merge after the Triton hit attention against the float32 reference
over all entries, empty hit / miss sides (NaN in an empty side's out never read; both
empty -> out = 0, lse = -inf), and CUDA-graph capture / replay of a split layer.

Tolerance: as ``attention_common`` (|out - ref| <= 2e-2 + 1e-2 |ref|, |lse - ref| <=
1e-3, -inf pattern exact); merge kernel vs reference: |out - ref| <= 2^-7 |ref| + 1e-6
(one bf16 rounding each: at most one bf16 ulp apart). The misses' hot rows start as
*other* valid rows, so a read of a row not staged shows as a wrong result.
"""

import dataclasses

import pytest
import torch
from attention_common import REF, SCALE, check, check_empty_rows_through_merge

from hisparse.attention.miss import (MissMode, merge_lse, merge_lse_reference, miss_attention_merge,
                                     miss_attention_merge_reference, plan_miss_attention)
from hisparse.attention.triton_backend import TritonBackend
from hisparse.device import PinnedBuffer
from hisparse.formats import quantize_fp8_ds_mla

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
TRI = TritonBackend(validate=False)
SLOTS = 4096  # hot rows per token's region
NINF = float("-inf")


@dataclasses.dataclass
class Step:
    """One decode step of T tokens (one request each) over a pinned host pool.

    host_buf keeps the pinned memory alive; host: uint8 [NH, row_bytes] (pinned CPU);
    host_dev: the same rows on the GPU (the resident reference); hot: uint8 [T * SLOTS,
    row_bytes] with the hit rows in place and stale rows everywhere else; full: int32
    [T, K] host rows of every entry (-1 padding); hit_idx / hit_cnt: the hits' hot rows,
    compacted, and their counts; miss_idx / miss_host / miss_cnt: the misses' hot rows
    and host rows, compacted (-1 after the count), and their counts.
    """

    fmt: str
    q: torch.Tensor
    host_buf: PinnedBuffer
    host: torch.Tensor
    host_dev: torch.Tensor
    hot: torch.Tensor
    full: torch.Tensor
    hit_idx: torch.Tensor
    hit_cnt: torch.Tensor
    miss_idx: torch.Tensor
    miss_host: torch.Tensor
    miss_cnt: torch.Tensor

    def kv(self, rows=None):
        rows = self.hot if rows is None else rows
        return rows if self.fmt == "fp8_ds_mla" else rows.view(torch.bfloat16)

    def staged(self):
        """The hot buffer with every miss staged (what the staging copy leaves)."""
        hot = self.hot.clone()
        m = self.miss_host >= 0
        hot[self.miss_idx[m].long()] = self.host_dev[self.miss_host[m].long()]
        return hot


def _rows(n, fmt, g, *, extreme=False):
    x = torch.randn(n, 576, device=DEV, generator=g)
    if extreme:
        x *= torch.exp2(torch.randint(-40, 31, (n, 1), device=DEV, generator=g).float())
        x[::97] = 0.0
        x[1::89, 256:384] = 0.0
    x = x.bfloat16()
    return quantize_fp8_ds_mla(x) if fmt == "fp8_ds_mla" else x.view(torch.uint8)


def make_step(T=64, H=128, K=2048, fmt="fp8_ds_mla", *, miss_frac=0.1, pad=0.05, seed=0,
              NH=1 << 17, extreme=False) -> Step:
    g = torch.Generator(device=DEV).manual_seed(seed)
    host_dev = _rows(NH, fmt, g, extreme=extreme)
    rb = host_dev.shape[1]
    buf = PinnedBuffer(NH * rb)
    assert buf.pinned
    host = buf.tensor.view(NH, rb)
    host.copy_(host_dev.cpu())
    q = torch.randn(T, H, 576, device=DEV, generator=g)
    if extreme:
        q[:, 0] *= 3e4
        q[:, 1] *= 1e-30
        q[:, 2] = 0.0
    q = q.bfloat16()
    full = torch.stack([torch.randperm(NH, device=DEV, generator=g)[:K] for _ in range(T)])
    full = full.to(torch.int32)
    full[torch.rand(T, K, device=DEV, generator=g) < pad] = -1
    slots = torch.stack([torch.randperm(SLOTS, device=DEV, generator=g)[:K] for _ in range(T)])
    slots = (slots + SLOTS * torch.arange(T, device=DEV)[:, None]).to(torch.int32)
    valid = full >= 0
    miss = valid & (torch.rand(T, K, device=DEV, generator=g) < miss_frac)
    hit = valid & ~miss
    hot = _rows(T * SLOTS, fmt, g)  # stale rows
    hot[slots[hit].long()] = host_dev[full[hit].long()]

    def compact(mask, vals):
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        return torch.gather(torch.where(mask, vals, -1), 1, order).to(torch.int32)

    return Step(fmt, q, buf, host, host_dev, hot, full, compact(hit, slots),
                hit.sum(1).to(torch.int32), compact(miss, slots), compact(miss, full),
                miss.sum(1).to(torch.int32))


def _hit(step):
    return TRI.decode(step.q, step.kv(), step.hit_idx, valid_counts=step.hit_cnt,
                      sm_scale=SCALE, row_format=step.fmt)


def _want(step):
    return REF.decode(step.q, step.kv(step.host_dev), step.full, sm_scale=SCALE,
                      row_format=step.fmt)


# ------------------------------------------------------------------ merge
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lse_matches_reference(dtype):
    T, H = 64, 128
    g = torch.Generator(device=DEV).manual_seed(1)
    out = torch.randn(T, H, 512, device=DEV, generator=g).bfloat16()
    lse = torch.randn(T, H, device=DEV, generator=g) * 5
    part = torch.randn(T, H, 512, device=DEV, generator=g).to(dtype)
    plse = torch.randn(T, H, device=DEV, generator=g) * 5
    r = torch.rand(T, H, device=DEV, generator=g)
    lse[r < 0.2] = NINF
    plse[(r > 0.15) & (r < 0.4)] = NINF
    lse[r > 0.95] += 1e4
    out[torch.isneginf(lse)] = float("nan")  # never read
    part[torch.isneginf(plse)] = float("nan")
    before = out.clone(), lse.clone()
    ref = out.clone(), lse.clone()
    merge_lse_reference(*ref, part, plse)
    merge_lse(out, lse, part, plse)
    torch.cuda.synchronize()
    keep = torch.isneginf(plse) & torch.isfinite(before[1])  # only the first side: kept
    assert torch.equal(out[keep].view(torch.int16), before[0][keep].view(torch.int16))
    assert torch.equal(lse[keep].view(torch.int32), before[1][keep].view(torch.int32))
    neither = torch.isneginf(plse) & torch.isneginf(before[1])  # NaN in both outs: 0 now
    for o, l in ((out, lse), ref):
        assert not torch.isnan(o.float()).any() and bool((o[neither] == 0).all())
        assert torch.isneginf(l[neither]).all()
    m = ~keep & ~neither
    err = (out[m].float() - ref[0][m].float()).abs()
    assert (err <= 2 ** -7 * ref[0][m].float().abs() + 1e-6).all(), err.max()
    assert ((lse[m] - ref[1][m]).abs() <= 1e-5 + 1e-6 * ref[1][m].abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lse_at_huge_lse(dtype):
    """lses of +-3e13 (what a x3e4 head over rows with tile scales 2^30 gives), the second
    side 0..3 float32 ulps (2^21 there) from the first: every merged lse finite and at the
    reference's (a merge that subtracts a max of rounded lse * log2(e) products from the
    fma-contracted unrounded one got inf or 0 weights here)."""
    T, H = 64, 128
    g = torch.Generator(device=DEV).manual_seed(2)
    out = torch.randn(T, H, 512, device=DEV, generator=g).bfloat16()
    part = torch.randn(T, H, 512, device=DEV, generator=g).to(dtype)
    lse = 3e13 * (1 + torch.rand(T, H, device=DEV, generator=g))
    lse[T // 2:] *= -1
    ulp = torch.nextafter(lse.abs(), torch.full_like(lse, float("inf"))) - lse.abs()
    steps = torch.randint(-3, 4, (T, H), device=DEV, generator=g).float()
    plse = lse + steps * ulp
    ref = out.clone(), lse.clone()
    merge_lse_reference(*ref, part, plse)
    merge_lse(out, lse, part, plse)
    torch.cuda.synchronize()
    assert torch.isfinite(lse).all() and not torch.isnan(out.float()).any()
    assert ((lse - ref[1]).abs() <= 1e-6 * ref[1].abs()).all()
    err = (out.float() - ref[0].float()).abs()
    assert (err <= 2 ** -7 * ref[0].float().abs() + 1e-6).all(), err.max()


# ------------------------------------------------------------------ split mode
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("T,miss_frac,planned", [(64, 0.1, False), (64, 0.1, True),
                                                 (16, 0.1, True), (16, 1.0, True)])
def test_split_matches_reference(fmt, T, miss_frac, planned):
    """T = 16 with a plan runs several splits (the combine kernel); 1.0 = every entry
    a miss (counts up to K)."""
    step = make_step(T=T, fmt=fmt, miss_frac=miss_frac, seed=T)
    hot = step.staged()
    out, lse = _hit(step)
    ref = out.clone(), lse.clone()
    miss_attention_merge_reference(step.q, step.kv(hot), step.miss_idx, step.miss_cnt, *ref,
                                   sm_scale=SCALE, row_format=fmt)
    plan = (plan_miss_attention(mode=MissMode.SPLIT, max_tokens=T, num_heads=128,
                                row_format=fmt, device=DEV) if planned else None)
    if planned and T == 16:
        assert plan.config.num_splits > 1
    miss_attention_merge(step.q, step.kv(hot), step.miss_idx, step.miss_cnt, out, lse,
                         sm_scale=SCALE, row_format=fmt, plan=plan)
    check(out, lse, *ref, what="split vs reference")
    check(out, lse, *_want(step), what="hit + split vs unsplit")


def test_bad_entries_are_padding():
    """-1, negative and out-of-range hot rows and counts beyond K (unchecked inputs, as
    in a captured step): skipped, never dereferenced (run this one under
    compute-sanitizer memcheck too); the result equals the reference, which treats those
    entries as padding."""
    step = make_step(T=64, seed=21)
    g = torch.Generator(device=DEV).manual_seed(22)
    N = step.hot.shape[0]
    r = torch.rand(step.miss_idx.shape, device=DEV, generator=g)
    step.miss_idx[r < 0.02] = N
    step.miss_idx[(r > 0.02) & (r < 0.04)] = -(2 ** 31)
    step.miss_cnt[::7] = 2 ** 30  # clamped to K: the -1 tail is read, as padding
    step.miss_cnt[1::7] = -5  # no miss
    out, lse = _hit(step)
    ref_split = out.clone(), lse.clone()
    miss_attention_merge_reference(step.q, step.kv(), step.miss_idx, step.miss_cnt, *ref_split,
                                   sm_scale=SCALE, row_format=step.fmt)
    miss_attention_merge(step.q, step.kv(), step.miss_idx, step.miss_cnt, out, lse,
                         sm_scale=SCALE, row_format=step.fmt)
    check(out, lse, *ref_split, what="split, bad entries")


def test_extreme_scales():
    """Tile scales 2^-40..2^30, zero rows and tiles, heads x3e4 / x1e-30 / 0: each (token,
    head) within 1.5% of its largest |ref out| (the single-pass decode's 1%, plus the bf16
    rounding of the hit partial before the merge), lse within 1e-3 relative."""
    step = make_step(T=16, seed=7, extreme=True)
    out, lse = _hit(step)
    miss_attention_merge(step.q, step.kv(step.staged()), step.miss_idx, step.miss_cnt, out,
                         lse, sm_scale=SCALE, row_format=step.fmt)
    ref_out, ref_lse = _want(step)
    torch.cuda.synchronize()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert ((lse[fin] - ref_lse[fin]).abs() <= 1e-3 * ref_lse[fin].abs().clamp_min(1.0)).all()
    err = (out.float() - ref_out.float()).abs().amax(-1)
    bound = 1.5e-2 * ref_out.float().abs().amax(-1)
    assert (err <= bound + 1e-30).all(), f"worst err / bound {(err / (bound + 1e-30)).max()}"


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("path,planned", [("split", False), ("split", True), ("merge", False)])
@pytest.mark.parametrize("nan_in_empty", [False, True])
def test_triton_empty_rows_through_the_merge(fmt, path, planned, nan_in_empty):
    """Tokens whose hit list, miss list or both are empty (``attention_common.
    empty_rows_problem``): the Triton hit attention's out = 0, lse = -inf for an empty
    token, merged by the miss kernels (planned: several splits and the combine kernel),
    equal the float32 reference over both lists, no NaN even where the empty side's out
    holds NaN, and out = 0, lse = -inf where both sides are empty."""
    plan = None
    if planned:
        plan = plan_miss_attention(mode=MissMode.SPLIT, max_tokens=6, num_heads=128,
                                   row_format=fmt, device=DEV)
        assert plan.config.num_splits > 1
    check_empty_rows_through_merge(TRI, fmt=fmt, device=DEV, H=128, path=path, plan=plan,
                                   nan_in_empty=nan_in_empty)


def test_no_misses_change_nothing():
    step = make_step(T=64, miss_frac=0.0, seed=3)
    assert int(step.miss_cnt.sum()) == 0
    out, lse = _hit(step)
    before = out.clone(), lse.clone(), step.hot.clone()
    miss_attention_merge(step.q, step.kv(), step.miss_idx, step.miss_cnt, out, lse,
                         sm_scale=SCALE, row_format=step.fmt)
    torch.cuda.synchronize()
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])
    assert torch.equal(step.hot, before[2])


# ------------------------------------------------------------------ CUDA graphs
def _capture(fn):
    """Warm ``fn`` up on a side stream, capture it; returns (graph, captured outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    return graph, res


def _new_misses(step, seed):
    """Fresh q and a fresh miss set written into the same tensors (what a replayed step
    sees): the hot rows are reset to stale rows, the miss counts change."""
    fresh = make_step(T=step.q.shape[0], fmt=step.fmt, seed=seed, NH=step.host.shape[0])
    step.host.copy_(fresh.host)
    step.host_dev.copy_(fresh.host_dev)
    for f in ("q", "hot", "full", "hit_idx", "hit_cnt", "miss_idx", "miss_host", "miss_cnt"):
        getattr(step, f).copy_(getattr(fresh, f))


def test_graph_capture_split_layer():
    """Hit decode + split miss attention (T = 16: several splits and the combine kernel)
    in one graph: the replay equals the eager call bitwise, and a replay after new inputs
    are written into the same tensors matches the unsplit reference."""
    step = make_step(T=16, seed=11)
    step.hot.copy_(step.staged())
    plan = plan_miss_attention(mode=MissMode.SPLIT, max_tokens=16, num_heads=128,
                               row_format=step.fmt, device=DEV)
    assert plan.config.num_splits > 1

    def layer():
        out, lse = _hit(step)
        miss_attention_merge(step.q, step.kv(), step.miss_idx, step.miss_cnt, out, lse,
                             sm_scale=SCALE, row_format=step.fmt, plan=plan)
        return out, lse

    eager = layer()
    graph, (out, lse) = _capture(layer)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    _new_misses(step, seed=12)
    step.hot.copy_(step.staged())
    graph.replay()
    check(out, lse, *_want(step), what="split layer replay")
