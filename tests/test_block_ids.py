"""Block ids (prefix caching, ``hisparse.cache.state``): a request whose block table
holds alias ids (>= NB) reads the rows of the cached host blocks they stand for, while
``row_slot`` stays indexed by its own row keys (alias range).

Most cases build the aliased state by hand (``map_aliases``), independent of the
prefix index: request A writes rows through the cache, then request B's block table
points at alias ids whose ``host_block`` entry is A's host block. Resolves (full,
split, prefetch, a rolled-back one) and prefill staging of B must read A's bytes
exactly, and leave A's row_slot entries alone; the torch and Triton (interpreter)
kernels must agree byte for byte. One case maps the aliases through
``add_request(token_ids=...)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from hisparse.formats import dequantize_fp8_ds_mla_reference
from hisparse.staging import StageRequests, stage_prefill

KERNELS = ["torch", "triton"]
CFG = dict(num_layers=2, top_k=8, device_buffer_size=16, max_num_reqs=4, host_pool_tokens=512,
           host_block_size=16, row_bytes=656, device="cpu", max_request_id=16)
A_ID, B_ID = 3, 5
N_A = 40  # rows of A (2.5 blocks)
SHARED = 2  # whole blocks of A that B maps under alias ids
I32 = torch.int32


def fp8_rows(g: torch.Generator, n: int) -> torch.Tensor:
    """uint8 [n, 656] fp8_ds_mla rows without NaN codes or non-finite scales."""
    codes = torch.randint(0, 256, (n, 512), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    scales = (torch.rand(n, 4, generator=g) * 5 + 0.01).to(torch.float32)
    rope = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    return torch.cat([codes, scales.view(torch.uint8).reshape(n, 16), rope.view(torch.uint8).reshape(n, 128)], 1)


def map_aliases(cache: HiSparseCache, r_dst: int, r_src: int, nblocks: int, first_alias: int = 0) -> torch.Tensor:
    """Give request slot r_dst the first ``nblocks`` blocks of r_src under alias ids
    NB + first_alias + i (host_block -> r_src's host blocks), with nblocks x B rows in
    every layer (device lengths, the host-side request table and the writer's block
    mirror). Returns the alias ids (int64 [nblocks])."""
    st, cfg = cache.state, cache.cfg
    B, NB = cfg.host_block_size, cfg.num_host_blocks
    ids = torch.arange(NB + first_alias, NB + first_alias + nblocks)
    st.host_block[ids] = st.block_table[r_src, :nblocks]
    st.block_table[r_dst, :nblocks] = ids.to(I32)
    n = nblocks * B
    st.seq_lens[:, r_dst] = n
    cache.requests.set_written_rows(np.array([r_dst]), np.array([n]), np.array([-1]))
    cache.writer.host_blocks[r_dst, :nblocks] = ids.numpy()
    cache.writer.num_blocks[r_dst] = nblocks
    return ids


def build(kernels: str, seed: int = 0):
    """(cache, rows per layer of A (uint8 [N_A, 656]), slot of A, slot of B, alias ids)."""
    cache = HiSparseCache(HiSparseConfig(**CFG, prefix_caching=True), kernels=kernels)
    cache.add_request(A_ID)
    cache.add_request(B_ID)
    ra, rb = cache.request(A_ID).slot, cache.request(B_ID).slot
    g = torch.Generator().manual_seed(seed)
    rows = [fp8_rows(g, N_A) for _ in range(CFG["num_layers"])]
    for layer, r in enumerate(rows):
        cache.write(layer, A_ID, r)
    ids = map_aliases(cache, rb, ra, SHARED)
    return cache, rows, ra, rb, ids


def key_of(cache: HiSparseCache, r: int, p: int) -> int:
    B = cache.cfg.host_block_size
    return int(cache.state.block_table[r, p // B]) * B + p % B


def topk_steps(seed: int, steps: int, K: int = 8) -> list[torch.Tensor]:
    """int32 [1, K] selections of B's positions (with duplicates and padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, SHARED * CFG["host_block_size"], (1, K), generator=g, dtype=I32)
        t[0, K - 1] = -1
        t[0, K - 2] = t[0, 0]
        out.append(t)
    return out


def check_rows(cache, rows, layer, physical, topk):
    """Every valid entry's hot row holds A's row of that position."""
    for k in range(topk.shape[1]):
        p = int(topk[0, k])
        if p < 0:
            assert int(physical[0, k]) == -1
            continue
        assert torch.equal(cache.hot[layer, int(physical[0, k])], rows[layer][p]), (layer, k, p)


def snapshot(cache) -> dict:
    st = cache.state
    return {name: getattr(st, name).clone() for name in ("row_slot", "slot_pos", "slot_stamp", "step", "stats",
                                                          "host_block", "block_table")} | {"hot": cache.hot.clone()}


def run_resolves(kernels: str, split: bool):
    cache, rows, ra, rb, ids = build(kernels)
    cfg = cache.cfg
    NB, B = cfg.num_host_blocks, cfg.host_block_size
    a_keys = slice(0, NB * B)
    a_before = cache.state.row_slot[:, a_keys].clone()
    req = torch.tensor([B_ID], dtype=I32)
    for step, topk in enumerate(topk_steps(1, 6)):
        for layer in range(cfg.num_layers):
            if split:
                res = cache.resolve(layer, req, topk, split=True)
                assert bool((res.miss_host[0, :int(res.miss_counts[0])] >= NB * B).all())  # row keys
            else:
                res = cache.resolve(layer, req, topk)
            check_rows(cache, rows, layer, res.physical, topk)
            m = int(cache._bufs[layer].stage_counts[0])
            a_rows = (cache.state.block_table[ra, :SHARED].long()[:, None] * B + torch.arange(B)).flatten()
            assert bool(torch.isin(res.stage_src[:m].long(), a_rows).all())  # A's host rows
            for p in {int(x) for x in topk[0].tolist() if x >= 0}:
                key = key_of(cache, rb, p)
                assert key // B in ids.tolist()
                assert int(cache.state.row_slot[layer, key]) >= 0  # B's own key is hot
    assert torch.equal(cache.state.row_slot[:, a_keys], a_before)  # A's keys untouched
    return cache


@pytest.mark.parametrize("split", [False, True])
def test_resolve_reads_aliased_host_rows(split):
    got = {k: snapshot(run_resolves(k, split)) for k in KERNELS}
    for name in got["torch"]:
        assert torch.equal(got["torch"][name], got["triton"][name]), name


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefetch_reads_aliased_host_rows(kernels):
    cache, rows, ra, rb, ids = build(kernels)
    topk = torch.tensor([[1, 17, 30, -1]], dtype=I32)
    cache.prefetch(0, torch.tensor([B_ID], dtype=I32), topk)
    for p in (1, 17, 30):
        s = int(cache.state.row_slot[0, key_of(cache, rb, p)])
        assert s >= 0
        assert torch.equal(cache.hot[0, rb * cache.cfg.slots_per_req + s], rows[0][p])


@pytest.mark.parametrize("kernels", KERNELS)
def test_failed_staging_rolls_back_from_aliased_rows(kernels):
    """A resolve whose copy launch raises after copying: the victims' bytes come back
    from the host rows of their (alias) row keys, the state as before the call."""
    cache, rows, ra, rb, ids = build(kernels)
    req = torch.tensor([B_ID], dtype=I32)
    for first in (16, 24):  # fill the 16 slots: every victim of the next misses holds a row
        cache.resolve(0, req, torch.arange(first, first + 8, dtype=I32)[None])
    assert bool((cache.state.slot_pos[0, rb, :16] >= 0).all())
    before = snapshot(cache)
    real = cache.kernel_set.copy_staged

    def copy_then_fail(*a, **kw):
        real(*a, **kw)
        raise RuntimeError("injected copy failure")

    cache.kernel_set.copy_staged = copy_then_fail
    fresh = torch.tensor([[0, 2, 4, 6, 8, 10, 12, 14]], dtype=I32)
    with pytest.raises(RuntimeError, match="injected"):
        cache.resolve(0, req, fresh)
    cache.kernel_set.copy_staged = real
    after = snapshot(cache)
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("ws_dtype", [torch.uint8, torch.bfloat16])
def test_prefill_staging_reads_aliased_host_rows(kernels, ws_dtype):
    cache, rows, ra, rb, ids = build(kernels)
    n_b = SHARED * cache.cfg.host_block_size
    reqs = StageRequests(req_slots=torch.tensor([rb, ra], dtype=I32), seq_lens=torch.tensor([n_b, N_A], dtype=I32),
                         starts=torch.tensor([0, n_b], dtype=I32), max_rows=N_A)
    want = [torch.cat([r[:n_b], r]) for r in rows]
    if ws_dtype == torch.bfloat16:
        want = [dequantize_fp8_ds_mla_reference(w) for w in want]
    for resolved in (False, True):
        if resolved:  # now some of B's rows are read from its hot slots (row_slot at its alias keys)
            cache.resolve(1, torch.tensor([B_ID], dtype=I32), torch.tensor([[0, 5, 16, 31]], dtype=I32))
        for layer in range(cache.cfg.num_layers):
            view = cache.layer_view(layer)
            assert view.host_block is cache.state.host_block and view.num_row_keys == cache.cfg.num_virtual_rows
            shape = (n_b + N_A, 656 if ws_dtype == torch.uint8 else 576)
            got = {}
            for k in KERNELS:
                ws = torch.zeros(shape, dtype=ws_dtype)
                stage_prefill(view, reqs, ws, kernels=k)
                got[k] = ws
            assert torch.equal(got["torch"].view(torch.uint8), got["triton"].view(torch.uint8))
            assert torch.equal(got["torch"].view(torch.uint8), want[layer].view(torch.uint8)), (layer, resolved)


def test_prefill_validation_checks_block_ids():
    cache, rows, ra, rb, ids = build("torch")
    n_b = SHARED * cache.cfg.host_block_size
    view = cache.layer_view(0)
    reqs = StageRequests(req_slots=torch.tensor([rb], dtype=I32), seq_lens=torch.tensor([n_b], dtype=I32),
                         starts=torch.tensor([0], dtype=I32))
    ws = torch.zeros((n_b, 656), dtype=torch.uint8)
    st = cache.state
    st.host_block[int(ids[1])] = -1  # an alias without a host block
    with pytest.raises(ValueError, match="maps to host block -1"):
        stage_prefill(view, reqs, ws)
    st.host_block[int(ids[1])] = st.block_table[ra, 1]
    st.block_table[rb, 1] = cache.cfg.num_virtual_blocks  # past the block ids
    with pytest.raises(ValueError, match="points past the 64 block ids"):
        stage_prefill(view, reqs, ws)
    st.block_table[rb, 1] = int(ids[1])
    stage_prefill(view, reqs, ws)
    assert torch.equal(ws, rows[0][:n_b])


@pytest.mark.parametrize("kernels", KERNELS)
def test_resolve_stages_host_rows_of_aliases(kernels):
    """A resolve stages the host row of each miss's row key (``stage_src``): A's rows for
    B's alias keys; a miss whose alias maps no host block (-1) is mapped but staged from
    nowhere (-1: the copy skips it); torch and Triton agree on every list and byte."""
    got = {}
    for k in KERNELS:
        cache, rows, ra, rb, ids = build(k)
        B = cache.cfg.host_block_size
        cache.state.host_block[int(ids[1])] = -1
        topk = torch.tensor([[3, 20, 9, 31, -1]], dtype=I32)
        res = cache.resolve(0, torch.tensor([B_ID], dtype=I32), topk)
        m = int(cache._bufs[0].stage_counts[0])
        src = res.stage_src[:m].tolist()
        a_row = [int(cache.state.block_table[ra, p // B]) * B + p % B for p in (3, 9)]
        assert src == a_row + [-1, -1]  # ascending positions 3, 9, 20, 31
        check_rows(cache, rows, 0, res.physical[:, [0, 2]], topk[:, [0, 2]])
        got[k] = (res.stage_src[:m].clone(), res.stage_dst[:m].clone(), snapshot(cache))
    assert torch.equal(got["torch"][0], got["triton"][0]) and torch.equal(got["torch"][1], got["triton"][1])
    for name in got["torch"][2]:
        assert torch.equal(got["torch"][2][name], got["triton"][2][name]), name


@pytest.mark.parametrize("kernels", KERNELS)
def test_prefix_api_aliases_read_cached_rows(kernels):
    """B's prompt shares A's first two blocks: add_request maps them under alias ids
    (A still maps them); B's resolves and prefill staging read A's rows there and B's
    own appended rows past them."""
    cache = HiSparseCache(HiSparseConfig(**CFG, prefix_caching=True), kernels=kernels)
    cfg = cache.cfg
    NB, B = cfg.num_host_blocks, cfg.host_block_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1000, (N_A,), generator=g).tolist()
    assert cache.add_request(A_ID, token_ids=prompt) == 0
    rows_a = [fp8_rows(g, N_A) for _ in range(cfg.num_layers)]
    for layer, r in enumerate(rows_a):
        cache.write(layer, A_ID, r)
    b_prompt = prompt[:2 * B] + [7, 8, 9, 10]
    assert cache.add_request(B_ID, token_ids=b_prompt) == 2 * B
    ra, rb = cache.request(A_ID).slot, cache.request(B_ID).slot
    ids = cache.state.block_table[rb, :2].long()
    assert bool((ids >= NB).all())  # aliases: A maps the host blocks under their own ids
    assert torch.equal(cache.state.host_block[ids], cache.state.block_table[ra, :2])
    rows_b = [fp8_rows(g, 4) for _ in range(cfg.num_layers)]
    for layer, r in enumerate(rows_b):
        cache.write(layer, B_ID, r)[0]  # into a fresh block of B's own
    want = [torch.cat([a[:2 * B], b]) for a, b in zip(rows_a, rows_b)]
    a_keys = (cache.state.block_table[ra, :3].long()[:, None] * B + torch.arange(B)).flatten()
    a_before = cache.state.row_slot[:, a_keys].clone()
    req = torch.tensor([B_ID], dtype=I32)
    for topk in ([0, 5, 16, 31, 32, 33, 35, -1], [1, 2, 3, 17, 18, 34, 31, 0]):
        t = torch.tensor([topk], dtype=I32)
        for layer in range(cfg.num_layers):
            check_rows(cache, want, layer, cache.resolve(layer, req, t).physical, t)
    assert torch.equal(cache.state.row_slot[:, a_keys], a_before)  # A's keys untouched
    n_b = 2 * B + 4
    reqs = StageRequests(req_slots=torch.tensor([rb], dtype=I32), seq_lens=torch.tensor([n_b], dtype=I32),
                         starts=torch.tensor([0], dtype=I32))
    for layer in range(cfg.num_layers):
        ws = torch.zeros((n_b, 656), dtype=torch.uint8)
        stage_prefill(cache.layer_view(layer), reqs, ws, kernels=kernels)
        assert torch.equal(ws, want[layer])
    cache.free_request(B_ID)
    assert not bool((cache.state.row_slot[:, NB * B:] >= 0).any())  # B's alias keys cleared


def test_no_prefix_caching_no_host_block():
    cache = HiSparseCache(HiSparseConfig(**CFG), kernels="torch")
    assert cache.cfg.num_virtual_blocks == cache.cfg.num_host_blocks
    assert cache.layer_view(0).host_block is None
    assert cache.layer_view(0).num_row_keys == cache.cfg.num_host_rows


def test_aliased_resolve_compiles_for_sm90():
    """The resolve's ALIASED variant (host rows through host_block) compiles for the GPU
    (offline, sm90, through ptxas): the interpreter runs it above."""
    import os
    import subprocess
    import sys
    import textwrap

    from benchmarks import resolve_registers
    try:
        resolve_registers.ptxas_path(90)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    code = textwrap.dedent("""
        from benchmarks.resolve_registers import compile_case
        c = compile_case(64, 16, 1, None, 90, miss_lists=False, compact=False, aliased=True)
        assert c["registers"], c
        print("compiled")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
