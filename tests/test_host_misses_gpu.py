"""GPU (SM 9.x): decode attention that reads the missed rows from pinned host memory
itself (``TritonBackend.decode_host_misses``, the warp-specialised kernel with
HOST_MISSES) against staging them first and running the same kernel: outputs and lse
bit for bit (the same bytes in the same order), the hot rows byte for byte afterwards
(the misses written into their slots, nothing else touched).

Shapes: T = 1 / 3 / 64 / 67 (past a wave of SMs: the tail launch gets the miss rows of
its own tokens), K = 2048 and an awkward 1000, H = 128 / 100 / 16 (fewer than 64 heads
run in one masked 64-head block), one and three KV splits, ring shapes; ~10% padding,
misses duplicated within a token and shared between tokens, misses in every block or
none at all.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_common import REF, SCALE, check

from hisparse.attention.triton_backend import TritonBackend, TritonMLAConfig
from hisparse.formats import quantize_fp8_ds_mla

pytestmark = pytest.mark.gpu

WS = TritonMLAConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, ws=True)


def _skip_unless_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernel is Hopper-only (SM 9.x)")


def problem(T, H, K, *, N=12288, NH=20000, miss=0.1, pad=0.1, seed=0):
    """q, hot rows uint8 [N, 656], host rows (pinned) uint8 [NH, 656], indices int32 [T, K]
    and miss_rows int32 [T, K]: each token's entries are distinct hot rows; a ``miss``
    share of them are misses into slots [N - T K miss.., N) that no other entry names as
    a hot row, each with its own host row; a few misses repeat within a token and
    between tokens (same slot, same host row)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    rows = quantize_fp8_ds_mla(torch.randn(N, 576, device="cuda", generator=g).bfloat16())
    host = quantize_fp8_ds_mla(torch.randn(NH, 576, device="cuda", generator=g).bfloat16()).cpu().pin_memory()
    q = torch.randn(T, H, 576, device="cuda", generator=g).bfloat16()
    nm = max(1, int(miss * K)) if miss > 0 else 0
    victims = N // 2  # slots [victims, N) are miss slots only
    idx = torch.empty((T, K), dtype=torch.int32)
    mr = torch.full((T, K), -1, dtype=torch.int32)
    slot_host = torch.randperm(NH, generator=gc)[:N - victims]  # the host row of each miss slot
    prev = None
    for t in range(T):
        hits = torch.randperm(victims, generator=gc)[:K - nm]
        vs = victims + torch.randperm(N - victims, generator=gc)[:nm]
        if nm >= 2:
            vs[-1] = vs[0]  # a miss repeated within the token
        if prev is not None and nm >= 3:
            vs[1] = prev  # a miss shared with the token before
        prev = vs[0] if nm else None
        row = torch.cat([hits, vs])
        perm = torch.randperm(K, generator=gc)
        idx[t] = row[perm].to(torch.int32)
        ism = perm >= K - nm
        mr[t] = torch.where(ism, slot_host[(idx[t] - victims).clamp_min(0).long()].to(torch.int32),
                            torch.full((K,), -1, dtype=torch.int32))
    padm = torch.rand((T, K), generator=gc) < pad
    idx[padm], mr[padm] = -1, -1
    return q, rows, host, idx.cuda(), mr.cuda()


def staged(rows, host, idx, mr):
    """The hot rows with every miss copied in (what a staging copy leaves)."""
    want = rows.clone()
    m = mr >= 0
    want[idx[m].long()] = host[mr[m].cpu().long()].cuda()
    return want


def run_both(be, q, rows, host, idx, mr):
    want = staged(rows, host, idx, mr)
    ref = be.decode(q, want, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    got_rows = rows.clone()
    out, lse = be.decode_host_misses(q, got_rows, idx, host, mr, sm_scale=SCALE, row_format="fp8_ds_mla")
    torch.cuda.synchronize()
    return (out, lse), ref, got_rows, want


@pytest.mark.parametrize("T,H,K", [(1, 128, 2048), (3, 128, 1000), (64, 128, 2048), (67, 128, 2048),
                                   (5, 100, 1000), (8, 16, 2048)])
@pytest.mark.parametrize("miss", [0.0, 0.05, 0.3, 1.0])
def test_host_misses_equal_staging_then_decode(T, H, K, miss):
    _skip_unless_sm90()
    q, rows, host, idx, mr = problem(T, H, K, miss=miss, seed=T * 7 + H + int(miss * 100))
    be = TritonBackend()  # the default config (ws at 64-head blocks, wave tail past a wave)
    (out, lse), (rout, rlse), got_rows, want = run_both(be, q, rows, host, idx, mr)
    assert torch.equal(got_rows, want), "the hot rows after the call differ from a staging copy's"
    assert torch.equal(out, rout) and torch.equal(lse, rlse), "not bitwise equal to staging + decode"
    check(out, lse, *REF.decode(q, want, idx, sm_scale=SCALE, row_format="fp8_ds_mla"),
          what=f"T={T} H={H} K={K} miss={miss}")


@pytest.mark.parametrize("bn,stages,raw,preg,splits", [(32, 2, 2, 72, 1), (32, 2, 2, 72, 3), (32, 2, 3, 56, 1),
                                                       (16, 4, 4, 56, 3), (32, 2, 2, 88, 1)])
def test_host_misses_ring_shapes(bn, stages, raw, preg, splits):
    _skip_unless_sm90()
    q, rows, host, idx, mr = problem(6, 128, 1000, miss=0.2, seed=bn + raw + splits)
    cfg = dataclasses.replace(WS, block_n=bn, num_stages=stages, ws_raw=raw, ws_producer_regs=preg,
                              num_splits=splits)
    (out, lse), (rout, rlse), got_rows, want = run_both(TritonBackend(config=cfg), q, rows, host, idx, mr)
    assert torch.equal(got_rows, want)
    assert torch.equal(out, rout) and torch.equal(lse, rlse)


def test_host_misses_out_of_range_entries_read_nothing_out_of_bounds():
    """Unchecked: host rows past NH (or below -1) read the hot row; indices past N are
    padding; nothing is written for either."""
    _skip_unless_sm90()
    q, rows, host, idx, mr = problem(4, 128, 512, miss=0.2, seed=3)
    bad = mr.clone()
    bad[0, :50] = torch.where(bad[0, :50] >= 0, host.shape[0] + 5, bad[0, :50])
    bad[1, :50] = torch.where(bad[1, :50] >= 0, -7, bad[1, :50])
    be = TritonBackend(validate=False)
    got_rows = rows.clone()
    out, lse = be.decode_host_misses(q, got_rows, idx, host, bad, sm_scale=SCALE, row_format="fp8_ds_mla")
    ok = (bad >= 0) & (bad < host.shape[0])
    want = staged(rows, host, idx, torch.where(ok, bad, -1))
    ref = be.decode(q, want, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    torch.cuda.synchronize()
    assert torch.equal(got_rows, want)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    with pytest.raises(ValueError, match="miss_rows must lie in"):
        TritonBackend().decode_host_misses(q, rows.clone(), idx, host, bad, sm_scale=SCALE,
                                           row_format="fp8_ds_mla")


def test_host_misses_in_a_cuda_graph():
    _skip_unless_sm90()
    q, rows, host, idx, mr = problem(64, 128, 2048, miss=0.1, seed=11)
    be = TritonBackend(validate=False)
    want = staged(rows, host, idx, mr)
    ref = be.decode(q, want, idx, sm_scale=SCALE, row_format="fp8_ds_mla")
    got_rows = rows.clone()
    be.decode_host_misses(q, got_rows, idx, host, mr, sm_scale=SCALE, row_format="fp8_ds_mla")  # compile
    got_rows.copy_(rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = be.decode_host_misses(q, got_rows, idx, host, mr, sm_scale=SCALE, row_format="fp8_ds_mla")
    got_rows.copy_(rows)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_rows, want)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
