"""An empty side of an LSE merge contributes nothing, on CPU.

A partial result whose lse is -inf has no entry; its out is never read, whatever it
holds (NaN included). So a merge takes the other side as it is, and two empty sides
merge to out = 0, lse = -inf (never a NaN left over from either). Checked for
``merge_lse`` and the split-mode ``miss_attention_merge``, the torch references and
the Triton kernels (interpreter, one split and several), on hand cases and on the
output of every CPU backend for tokens with no valid index (``attention_common.
check_empty_rows_through_merge``; the GPU backends run the same check in
test_miss_attention_gpu.py and test_backends_gpu.py).
"""

import math

import pytest
import torch
from attention_common import check_empty_rows_through_merge

from hisparse.attention.miss import (MissConfig, MissMode, merge_lse, miss_attention_merge,
                                     plan_miss_attention)
from hisparse.attention.reference import ReferenceBackend
from hisparse.attention.triton_backend import TritonBackend

NINF, NAN = float("-inf"), float("nan")
CPU = torch.device("cpu")


def _four_heads(part_dtype):
    """One token, four heads: both sides, only the first, only the second, neither. The
    out of every empty side is NaN."""
    out = torch.tensor([[[1.0] * 512, [2.0] * 512, [NAN] * 512, [NAN] * 512]]).bfloat16()
    lse = torch.tensor([[0.0, 1.5, NINF, NINF]])
    part = torch.tensor([[[3.0] * 512, [NAN] * 512, [4.0] * 512, [NAN] * 512]]).to(part_dtype)
    plse = torch.tensor([[math.log(3.0), NINF, 2.0, NINF]])
    return out, lse, part, plse


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_merge_lse_reads_no_empty_side(kernels, part_dtype):
    out, lse, part, plse = _four_heads(part_dtype)
    before = out[0, 1].clone()
    merge_lse(out, lse, part, plse, kernels=kernels)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    # head 0: weights 1/4 and 3/4 -> 0.25 + 2.25 = 2.5, lse log(4)
    assert torch.allclose(out[0, 0].float(), torch.full((512,), 2.5))
    assert lse[0, 0].item() == pytest.approx(math.log(4.0), abs=1e-6)
    # head 1: the second side is empty: the first kept bit for bit
    assert torch.equal(out[0, 1].view(torch.int16), before.view(torch.int16))
    assert lse[0, 1].item() == 1.5
    # head 2: the first side is empty: the second alone
    assert torch.equal(out[0, 2].float(), torch.full((512,), 4.0)) and lse[0, 2].item() == 2.0
    # head 3: both empty
    assert torch.equal(out[0, 3].float(), torch.zeros(512)) and lse[0, 3].item() == NINF


def _split_plan(splits, H):
    if splits == 1:
        return None
    cfg = MissConfig(block_h=16, block_n=16, num_warps=4, isolate_qk=False, num_splits=splits)
    return plan_miss_attention(mode=MissMode.SPLIT, max_tokens=6, num_heads=H, row_format="bf16",
                               device=CPU, config=cfg)


PATHS = [("split", "torch", 1), ("split", "triton", 1), ("split", "triton", 2),
         ("merge", "torch", 1), ("merge", "triton", 1)]


@pytest.mark.parametrize("path,kernels,splits", PATHS)
def test_nan_in_an_empty_hit_side_is_not_read(path, kernels, splits):
    """The hit partial of the reference with NaN written into its empty tokens' out."""
    H = 3
    check_empty_rows_through_merge(ReferenceBackend(), fmt="bf16", device=CPU, H=H, path=path,
                                   kernels=kernels, plan=_split_plan(splits, H),
                                   nan_in_empty=True)


@pytest.mark.parametrize("path,kernels,splits", PATHS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backend_empty_rows_through_the_merge(backend, path, kernels, splits):
    """Each CPU backend's own output for tokens with no valid index (out = 0, lse =
    -inf) merged with the misses."""
    H = 3
    be = ReferenceBackend() if backend == "reference" else TritonBackend(allow_interpreter=True)
    check_empty_rows_through_merge(be, fmt="bf16", device=CPU, H=H, path=path, kernels=kernels,
                                   plan=_split_plan(splits, H))


def test_fp8_rows_through_the_split_kernel():
    """The same cases over fp8_ds_mla rows (the split kernel's other row path)."""
    check_empty_rows_through_merge(ReferenceBackend(), fmt="fp8_ds_mla", device=CPU, H=3,
                                   path="split", kernels="triton", nan_in_empty=True)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("K,N", [(0, 8), (3, 0)])
def test_split_merge_that_can_have_no_miss(kernels, K, N):
    """No valid miss entry is possible (K = 0 or N = 0): heads whose hit partial is empty
    (NaN in its out) get out = 0, lse = -inf; the others keep their partial bit for bit."""
    T, H = 2, 3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(T, H, 576, generator=g).bfloat16()
    rows = torch.randn(N, 576, generator=g).bfloat16()
    idx = torch.zeros(T, K, dtype=torch.int32)
    counts = torch.full((T,), K, dtype=torch.int32)
    out = torch.randn(T, H, 512, generator=g).bfloat16()
    lse = torch.randn(T, H, generator=g)
    lse[0, 1] = lse[1, 2] = NINF
    out[torch.isneginf(lse)] = NAN
    before = out.clone(), lse.clone()
    miss_attention_merge(q, rows, idx, counts, out, lse, sm_scale=0.05, row_format="bf16",
                         kernels=kernels)
    empty = torch.isneginf(before[1])
    assert bool((out[empty] == 0).all()) and torch.isneginf(lse[empty]).all()
    assert torch.equal(out[~empty].view(torch.int16), before[0][~empty].view(torch.int16))
    assert torch.equal(lse, before[1])
