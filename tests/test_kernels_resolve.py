"""Triton resolve kernel (interpreter on CPU) against the torch reference.

The kernel pairs misses with victims exactly like the reference, so after every step
all state tensors and all output buffers must be identical. The helpers
(``make_state``, ``random_batch``, ``assert_same``) are in ``resolve_common``, shared
with the GPU tests; the victim search (P3) on hand-made tier layouts is in
test_resolve_victim_search.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.cache.resolve_ref import copy_rows_reference, resolve_reference
from hisparse.cache.resolve_launch import resolve_triton
from hisparse.cache.state import (STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_RESOLVES,
                                  HotState, ResolveBuffers)
from hisparse.config import HiSparseConfig

from resolve_common import (CPU, assert_same, host_row, make_state, new_buffers, random_batch, run_trace,
                            small_cfg)


# ---------------------------------------------------------------- hand-traced case
def test_hand_traced_step():
    """S=4, K=2, B=4, one request (id 3) of 10 tokens: positions 0..3 in slots 0..3,
    position 9 in the reserved slot 4. topk [5, 9]: 9 hits slot 4, 5 misses and evicts
    the smallest key among slots 0..3 (all stamp 0: position 0, slot 0)."""
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=2, device_buffer_size=4,
                         max_num_reqs=2, max_query_len=1, host_block_size=4, max_request_id=8,
                         device="cpu")
    state = HotState.allocate(cfg, CPU)
    state.id_to_slot[3] = 1
    state.seq_lens[:, 1] = 10
    state.block_table[1, :3] = torch.tensor([7, 2, 5], dtype=torch.int32)
    for p, s in [(0, 0), (1, 1), (2, 2), (3, 3), (9, 4)]:
        state.slot_pos[0, 1, s] = p
        state.slot_stamp[0, 1, s] = 0
        state.row_slot[0, host_row(state, 1, p)] = s
    out = ResolveBuffers.allocate(1, 2, CPU)
    resolve_triton(state, 0, torch.tensor([3], dtype=torch.int32),
                   torch.tensor([[5, 9]], dtype=torch.int32), out, max_query_len=1)
    base = 1 * 5
    assert out.physical.tolist() == [[base + 0, base + 4]]
    assert out.valid_counts.tolist() == [2]
    assert out.stage_src.tolist() == [host_row(state, 1, 5), -1]  # block 2 -> row 2*4+1 = 9
    assert out.stage_src[0].item() == 9
    assert out.stage_dst.tolist() == [base + 0, -1]
    assert state.slot_pos[0, 1].tolist() == [5, 1, 2, 3, 9]
    assert state.slot_stamp[0, 1].tolist() == [1, 0, 0, 0, 1]
    assert state.step[0, 1].item() == 1
    assert state.row_slot[0, host_row(state, 1, 0)].item() == -1  # position 0 evicted
    assert state.row_slot[0, 9].item() == 0
    s = state.stats[0]
    assert (s[STAT_HITS].item(), s[STAT_MISSES].item(), s[STAT_INVALID].item(),
            s[STAT_RESOLVES].item()) == (1, 1, 0, 1)


@pytest.mark.parametrize("fn", [resolve_reference, resolve_triton], ids=["reference", "triton"])
def test_hand_traced_pairing_in_slot_order(fn):
    """S=6, K=5, B=4, one request (id 3) of 10 tokens, step 5 -> new step 6.
    slots: 0 pos 0 stamp 4 | 1 empty | 2 pos 4 stamp 2 | 3 pos 3 stamp 2 | 4 pos 2 stamp 3
    | 5 pos 1 stamp 2 | reserved 6 pos 9. topk [7, 0, 5, 7, 8]: 0 hits slot 0; the misses
    in ascending position are 5, 7, 8 (the second 7 is a duplicate). Victims: the empty
    slot 1, then the stamp-2 tier by position (1 in slot 5, 3 in slot 3; position 4 in
    slot 2 stays). In key order the victims are [1, 5, 3]; they are paired in slot
    order [1, 3, 5] with 5, 7, 8."""
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=64, top_k=5, device_buffer_size=6,
                         max_num_reqs=2, max_query_len=1, host_block_size=4, max_request_id=8,
                         device="cpu")
    state = HotState.allocate(cfg, CPU)
    state.id_to_slot[3] = 1
    state.seq_lens[:, 1] = 10
    state.step[0, 1] = 5
    state.block_table[1, :3] = torch.tensor([7, 2, 5], dtype=torch.int32)
    for p, s_, stamp in [(0, 0, 4), (4, 2, 2), (3, 3, 2), (2, 4, 3), (1, 5, 2), (9, 6, 5)]:
        state.slot_pos[0, 1, s_] = p
        state.slot_stamp[0, 1, s_] = stamp
        state.row_slot[0, host_row(state, 1, p)] = s_
    out = ResolveBuffers.allocate(1, 5, CPU)
    fn(state, 0, torch.tensor([3], dtype=torch.int32),
       torch.tensor([[7, 0, 5, 7, 8]], dtype=torch.int32), out, max_query_len=1)
    base = 1 * 7
    assert out.physical.tolist() == [[base + 3, base + 0, base + 1, base + 3, base + 5]]
    assert out.valid_counts.tolist() == [5]
    assert out.stage_src.tolist() == [host_row(state, 1, 5), host_row(state, 1, 7),
                                      host_row(state, 1, 8), -1, -1]
    assert out.stage_dst.tolist() == [base + 1, base + 3, base + 5, -1, -1]
    assert state.slot_pos[0, 1].tolist() == [0, 5, 4, 7, 2, 8, 9]
    assert state.slot_stamp[0, 1].tolist() == [6, 6, 2, 6, 3, 6, 5]
    assert state.step[0, 1].item() == 6
    for p in (1, 3):  # evicted
        assert state.row_slot[0, host_row(state, 1, p)].item() == -1
    for p, s_ in [(0, 0), (5, 1), (4, 2), (7, 3), (2, 4), (8, 5), (9, 6)]:
        assert state.row_slot[0, host_row(state, 1, p)].item() == s_
    assert int((state.row_slot[0] >= 0).sum()) == 7  # no marker or stale mapping left
    s = state.stats[0]
    assert (s[STAT_HITS].item(), s[STAT_MISSES].item(), s[STAT_INVALID].item(),
            s[STAT_RESOLVES].item()) == (1, 3, 0, 1)
    assert int((state.row_slot[0] < -1).sum()) == 0


def test_invalid_entries_counted():
    cfg = small_cfg(K=3, q=2, S=7)
    rng = random.Random(5)
    state = make_state(cfg, {2: 5, 4: 9}, CPU, rng)
    ref = state.clone()
    # id 2: valid run of 2 + a 3rd token (run too long: 3 non -1 entries invalid);
    # entries 5 (= seq), -2 invalid; id 9 is free: 2 non -1 entries invalid
    req = torch.tensor([2, 2, 2, 9, 4], dtype=torch.int32)
    topk = torch.tensor([[0, 5, -1], [-2, 1, 1], [0, 1, 2], [-1, 3, 0], [8, -1, 8]],
                        dtype=torch.int32)
    out, oref = new_buffers(5, 3, CPU), new_buffers(5, 3, CPU)
    resolve_triton(state, 1, req, topk, out, max_query_len=2, compact=True)
    resolve_reference(ref, 1, req, topk, oref, max_query_len=2, compact=True)
    assert_same(ref, state, oref, out)
    assert state.stats[1, STAT_INVALID].item() == 2 + 3 + 2
    assert out.valid_counts[:5].tolist() == [1, 2, 0, 0, 2]
    assert out.physical[2, :3].tolist() == [-1, -1, -1]
    assert state.stats[1, STAT_RESOLVES].item() == 2


@pytest.mark.parametrize("compact", [False, True])
def test_split_runs_second_run_not_resolved(compact):
    """ids [6, 6, 7, 6, 6]: request 6 in two runs (only possible unchecked). The second
    run is not resolved: -1 / count 0, its non -1 entries counted invalid, and request
    6's state moves exactly as for the first run alone (step + 1, not + 2)."""
    cfg = small_cfg(K=3, q=2, S=7, L=2)
    rng = random.Random(11)
    state = make_state(cfg, {6: 20, 7: 5}, CPU, rng, holes=0.3)
    ref, alone = state.clone(), state.clone()
    req = torch.tensor([6, 6, 7, 6, 6], dtype=torch.int32)
    topk = torch.tensor([[12, 0, -1], [13, 19, 3], [4, -1, 1], [14, 15, -1], [16, 2, 17]],
                        dtype=torch.int32)
    out, oref = new_buffers(5, 3, CPU), new_buffers(5, 3, CPU)
    resolve_triton(state, 1, req, topk, out, max_query_len=2, compact=compact)
    resolve_reference(ref, 1, req, topk, oref, max_query_len=2, compact=compact)
    assert_same(ref, state, oref, out, msg="split runs")
    assert out.valid_counts[:5].tolist() == [2, 3, 2, 0, 0]
    assert (out.physical[3:5, :3] == -1).all()
    assert (out.stage_src[9:15] == -1).all() and (out.stage_dst[9:15] == -1).all()
    assert state.stats[1, STAT_INVALID].item() == 2 + 3
    assert state.stats[1, STAT_RESOLVES].item() == 2
    assert state.step[1].tolist() == [x + 1 if i in (int(state.id_to_slot[6]), int(state.id_to_slot[7]))
                                      else x for i, x in enumerate(alone.step[1].tolist())]
    # same state as resolving the batch without the second run of 6
    oal = new_buffers(3, 3, CPU)
    resolve_reference(alone, 1, req[:3].contiguous(), topk[:3].contiguous(), oal, max_query_len=2,
                      compact=compact)
    alone.stats[1, STAT_INVALID] += 5
    assert_same(alone, state, msg="split runs vs first runs only")
    assert torch.equal(oal.physical[:3, :3], out.physical[:3, :3])


def test_split_run_scan_crosses_chunks(monkeypatch):
    """The earlier occurrence lies beyond the first scan chunk (chunk of 2 here)."""
    import hisparse.cache.resolve_launch as rt
    monkeypatch.setattr(rt, "RESOLVE_SCAN_CHUNK", 2)
    cfg = small_cfg(K=2, q=1, S=4, L=1)
    state = make_state(cfg, {1: 3, 2: 3, 3: 3, 4: 3}, CPU, random.Random(2))
    ref = state.clone()
    req = torch.tensor([1, 2, 3, 4, 3, 1], dtype=torch.int32)
    topk = torch.tensor([[0, 1]] * 6, dtype=torch.int32)
    out, oref = new_buffers(6, 2, CPU), new_buffers(6, 2, CPU)
    resolve_triton(state, 0, req, topk, out, max_query_len=1)
    resolve_reference(ref, 0, req, topk, oref, max_query_len=1)
    assert_same(ref, state, oref, out, msg="chunked scan")
    assert out.valid_counts[:6].tolist() == [2, 2, 2, 2, 0, 0]
    assert state.stats[0, STAT_INVALID].item() == 4


def test_set_resolve_kernel_swaps_every_launch_until_set_back():
    """``set_resolve_kernel`` (benchmarks.resolve_phases' hook): the launcher launches the
    kernel it was given, with the real kernel's grid and arguments, until the previous
    one is set back; the results are the real kernel's when the stand-in forwards."""
    from hisparse.cache.resolve_launch import set_resolve_kernel
    from hisparse.kernels.resolve import resolve_kernel

    grids = []

    class Forward:
        def __getitem__(self, grid):
            grids.append(grid)
            return resolve_kernel[grid]

    cfg = small_cfg(K=2, q=1, S=4, L=1)
    state = make_state(cfg, {1: 3, 2: 3}, CPU, random.Random(3))
    ref = state.clone()
    req, topk = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    out, oref = new_buffers(2, 2, CPU), new_buffers(2, 2, CPU)
    previous = set_resolve_kernel(Forward())
    try:
        assert previous is resolve_kernel
        resolve_triton(state, 0, req, topk, out, max_query_len=1)
    finally:
        assert isinstance(set_resolve_kernel(previous), Forward)
    resolve_reference(ref, 0, req, topk, oref, max_query_len=1)
    assert grids == [(2,)]
    assert_same(ref, state, oref, out, msg="through the swapped launcher")
    resolve_triton(state, 0, req, topk, out, max_query_len=1)
    assert grids == [(2,)]  # set back: the real kernel, not the stand-in


def test_lengths_are_per_layer():
    """Layer 0 holds 10 rows of request 3, layer 1 only 8: positions 8, 9 resolve in
    layer 0 and are invalid in layer 1; kernel == reference in both."""
    cfg = small_cfg(K=3, q=1, S=4, L=2)
    state = make_state(cfg, {3: 10}, CPU, random.Random(4))
    r = int(state.id_to_slot[3])
    state.seq_lens[1, r] = 8
    state.slot_pos[1, r, 4] = -1  # layer 1's newest row (7) is not in the reserved slot yet
    state.slot_stamp[1, r, 4] = -1
    state.row_slot[1][state.row_slot[1] == 4] = -1
    ref = state.clone()
    req = torch.tensor([3], dtype=torch.int32)
    topk = torch.tensor([[9, 8, 1]], dtype=torch.int32)
    for layer, want_valid, want_bad in ((0, 3, 0), (1, 1, 2)):
        out, oref = new_buffers(1, 3, CPU), new_buffers(1, 3, CPU)
        resolve_triton(state, layer, req, topk, out, max_query_len=1)
        resolve_reference(ref, layer, req, topk, oref, max_query_len=1)
        assert_same(ref, state, oref, out, msg=f"layer {layer}")
        assert out.valid_counts[0].item() == want_valid
        assert state.stats[layer, STAT_INVALID].item() == want_bad


# ---------------------------------------------------------------- sweeps vs reference
@pytest.mark.parametrize("q", [1, 2, 4])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("K,extra", [(1, 0), (3, 2), (5, 1)])
def test_trace_matches_reference(q, compact, K, extra):
    S = q * K + extra  # tight (extra = 0) and odd buffers
    cfg = small_cfg(K=K, q=q, S=S, B=3 if K != 3 else 4)
    seqs = {1: 0, 3: 1, 5: S, 6: S + 1, 8: 3 * S + 2, 11: 40}
    run_trace(cfg, seqs, steps=5, seed=1000 * q + 10 * K + compact, compact=compact,
              holes=0.3 if compact else 0.0)


def test_trace_without_bad_entries_keeps_stats_consistent():
    cfg = small_cfg(K=4, q=2, S=9)
    seqs = {1: 30, 2: 12, 7: 50}
    tri = run_trace(cfg, seqs, steps=8, seed=42, compact=False, bad=False, holes=0.4)
    s = tri.stats.sum(0)
    assert s[STAT_INVALID].item() == 0
    assert s[STAT_MISSES].item() > 0 and s[STAT_HITS].item() > 0


def scramble_lru(state: HotState, rng: random.Random, *, spread: int) -> None:
    """Give every occupied LRU slot (0..S-1) a random distinct position and a stamp from
    a few values up to ``spread`` (so stamp ties and wide stamp ranges both occur), keep
    row_slot consistent, and set each step past the newest stamp. In place, CPU state."""
    S, B = state.S, state.B
    for layer in range(state.slot_pos.shape[0]):
        for r in range(state.slot_pos.shape[1]):
            seq = int(state.seq_lens[layer, r])
            occ = [s_ for s_ in range(S) if int(state.slot_pos[layer, r, s_]) >= 0]
            if not occ:
                continue
            reserved = int(state.slot_pos[layer, r, S])
            free_pos = [p for p in range(seq) if p != reserved]
            new_pos = rng.sample(free_pos, len(occ))
            stamps = [rng.randrange(spread + 1) for _ in range(3)]
            for s_ in occ:
                p = int(state.slot_pos[layer, r, s_])
                state.row_slot[layer, int(state.block_table[r, p // B]) * B + p % B] = -1
            for s_, p in zip(occ, new_pos):
                state.slot_pos[layer, r, s_] = p
                state.slot_stamp[layer, r, s_] = rng.choice(stamps)
                state.row_slot[layer, int(state.block_table[r, p // B]) * B + p % B] = s_
            state.step[layer, r] = max(stamps) + rng.randrange(3)


@pytest.mark.parametrize("seed", range(8))
def test_scrambled_lru_states_pick_the_reference_victims(seed):
    """Victim selection by bisection (threshold stamp, then position) against the
    reference's key sort, from states with slots holding arbitrary positions, empty
    slots, tied stamps and stamps up to ~10^6 or 2^33 apart (many bisection steps, and
    stamp gaps past the int32 range)."""
    rng = random.Random(seed)
    S, K, B = rng.choice([(9, 4, 2), (23, 7, 3), (37, 9, 4)])
    cfg = small_cfg(K=K, q=1, S=S, B=B)
    seq_by_id = {rid: rng.randint(S + 2, 60) for rid in rng.sample(range(1, 16), 3)}
    ref = make_state(cfg, seq_by_id, CPU, rng, holes=rng.choice([0.0, 0.3]))
    scramble_lru(ref, rng, spread=[3, 1000, 10**6, 2**33][seed % 4])
    tri = ref.clone()
    for i in range(3):
        req, topk = random_batch(seq_by_id, K, 1, rng, bad=False)
        layer = rng.randrange(cfg.num_layers)
        oa, ob = new_buffers(req.numel(), K, CPU), new_buffers(req.numel(), K, CPU)
        resolve_reference(ref, layer, req, topk, oa, max_query_len=1)
        resolve_triton(tri, layer, req, topk, ob, max_query_len=1)
        assert_same(ref, tri, oa, ob, msg=f"seed {seed} step {i}")
    s_ = tri.stats.sum(0)
    assert s_[STAT_MISSES].item() > 0 and s_[STAT_HITS].item() > 0  # victims were chosen


def test_empty_batch_changes_nothing():
    cfg = small_cfg(K=3, q=1, S=5)
    state = make_state(cfg, {1: 7}, CPU, random.Random(0))
    before = state.clone()
    out = new_buffers(0, 3, CPU)
    resolve_triton(state, 0, torch.zeros(0, dtype=torch.int32),
                   torch.zeros(0, 3, dtype=torch.int32), out, max_query_len=1)
    assert_same(before, state)
    assert (out.physical == 777).all()


def test_staged_rows_make_hot_rows_byte_exact():
    """End to end on CPU: resolve + copy_rows keep every physical row byte-equal to
    the host row of its (request, position)."""
    from hisparse.cache.transfer import copy_rows

    cfg = small_cfg(K=4, q=2, S=9, B=4, L=1)
    seqs = {1: 40, 2: 9, 3: 25}
    rng = random.Random(9)
    state = make_state(cfg, seqs, CPU, rng)
    W = 32
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (cfg.num_host_rows, W), dtype=torch.uint8, generator=gen)
    hot = torch.zeros(cfg.hot_rows_per_layer, W, dtype=torch.uint8)
    SP = cfg.slots_per_req
    for rid, seq in seqs.items():  # initial hot rows as the write path leaves them
        r = int(state.id_to_slot[rid])
        for s in range(SP):
            p = int(state.slot_pos[0, r, s])
            if p >= 0:
                hot[r * SP + s] = pool[host_row(state, r, p)]
    for step in range(6):
        req, topk = random_batch(seqs, 4, 2, rng, bad=False)
        out = new_buffers(req.numel(), 4, CPU)
        resolve_triton(state, 0, req, topk, out, max_query_len=2)
        n = req.numel() * 4
        copy_rows(pool, out.stage_src[:n], hot, out.stage_dst[:n])
        for t in range(req.numel()):
            r = int(state.id_to_slot[int(req[t])])
            for k in range(4):
                p, ph = int(topk[t, k]), int(out.physical[t, k])
                if p < 0:
                    assert ph == -1
                    continue
                assert r * SP <= ph < (r + 1) * SP
                assert torch.equal(hot[ph], pool[host_row(state, r, p)]), (step, t, k)


# ---------------------------------------------------------------- robustness
def test_corrupt_state_never_out_of_bounds():
    """Validation off with a corrupt state: garbage slots in row_slot, unmapped blocks,
    an id mapped to a request slot >= R. The kernel must run (the interpreter raises on
    out-of-bounds pointers) and only produce -1 or in-range physical rows."""
    cfg = small_cfg(K=4, q=2, S=8, B=2, L=1, R=3)
    rng = random.Random(3)
    state = make_state(cfg, {1: 20, 2: 6}, CPU, rng)
    state.row_slot[0, :50] = torch.randint(-5, 40, (50,), dtype=torch.int32)
    r1 = int(state.id_to_slot[1])
    state.block_table[r1, 2] = -1
    state.block_table[r1, 3] = 10**6
    state.id_to_slot[5] = 7  # request slot out of range
    state.seq_lens[:, int(state.id_to_slot[2])] = 10**6  # beyond its block table
    req = torch.tensor([1, 1, 2, 5], dtype=torch.int32)
    topk = torch.tensor([[4, 5, 6, 7], [0, 1, 2, 3], [100, 3, 9999, 0], [0, 1, 2, 3]],
                        dtype=torch.int32)
    out = new_buffers(4, 4, CPU)
    for _ in range(3):
        resolve_triton(state, 0, req, topk, out, max_query_len=2, compact=True)
        ph = out.physical[:4, :4]
        assert ((ph == -1) | ((ph >= 0) & (ph < cfg.hot_rows_per_layer))).all()
        sd = out.stage_dst[:16]
        assert ((sd == -1) | ((sd >= 0) & (sd < cfg.hot_rows_per_layer))).all()
        assert ((out.stage_src[:16] >= -1) & (out.stage_src[:16] < cfg.num_host_rows)).all()
    assert state.stats[0, STAT_INVALID].item() > 0


# ---------------------------------------------------------------- argument checks
def _args():
    cfg = small_cfg(K=3, q=2, S=7)
    state = make_state(cfg, {1: 9}, CPU, random.Random(0))
    req = torch.tensor([1, 1], dtype=torch.int32)
    topk = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    return state, req, topk, new_buffers(2, 3, CPU)


@pytest.mark.parametrize("case,exc", [
    ("topk_int64", TypeError), ("req_int64", TypeError), ("req_len", ValueError),
    ("layer", ValueError), ("layer_type", TypeError), ("mql0", ValueError),
    ("S_small", ValueError), ("phys_small", ValueError), ("stage_small", ValueError),
    ("topk_1d", ValueError), ("topk_strided", ValueError), ("valid_small", ValueError),
    ("phys_overlap", ValueError),
])
def test_bad_arguments_raise_before_launch(case, exc):
    state, req, topk, out = _args()
    before = state.clone()
    kw = dict(max_query_len=2)
    layer = 0
    if case == "topk_int64":
        topk = topk.long()
    elif case == "req_int64":
        req = req.long()
    elif case == "req_len":
        req = req[:1]
    elif case == "layer":
        layer = 2
    elif case == "layer_type":
        layer = 0.0
    elif case == "mql0":
        kw["max_query_len"] = 0
    elif case == "S_small":
        kw["max_query_len"] = 3  # 3 x 3 > S = 7
    elif case == "phys_small":
        out.physical = out.physical[:1]
    elif case == "phys_overlap":  # rows sharing memory: a group's victim list lives in its rows
        out.physical = out.physical[0].expand(out.physical.shape[0], -1)
    elif case == "stage_small":
        out.stage_dst = out.stage_dst[:5]
    elif case == "topk_1d":
        topk = topk.flatten()
    elif case == "topk_strided":
        topk = torch.zeros(2, 6, dtype=torch.int32)[:, ::2]
    elif case == "valid_small":
        out.valid_counts = out.valid_counts[:1]
    with pytest.raises(exc):
        resolve_triton(state, layer, req, topk, out, **kw)
    assert_same(before, state)
    assert (out.physical == 777).all()


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    state, req, topk, out = _args()
    ref, oref = state.clone(), new_buffers(2, 3, CPU)
    resolve_triton(state, 0, req, topk, out, max_query_len=2)
    resolve_reference(ref, 0, req, topk, oref, max_query_len=2)
    assert_same(ref, state, oref, out)


def test_copy_rows_reference_helper_consistency():
    """copy_rows_reference (the staging oracle) skips -1 on either side."""
    src = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    dst = torch.zeros(3, 4, dtype=torch.uint8)
    n = copy_rows_reference(src, torch.tensor([2, -1, 0], dtype=torch.int32), dst,
                            torch.tensor([0, 1, -1], dtype=torch.int32))
    assert n == 1 and dst[0].tolist() == [8, 9, 10, 11] and dst[1:].sum() == 0


@pytest.mark.parametrize("compact", [False, True])
def test_all_hit_step_with_duplicates_padding_and_invalid(compact):
    """The kernel's all-hit path (no sort): every valid entry hot, with duplicates within
    and across the two tokens of a group, -1 padding and out-of-range entries. Hits are
    counted once per unique position, state and outputs equal the reference's."""
    cfg = small_cfg(K=6, q=2, S=12)
    ref = make_state(cfg, {3: 9, 5: 12, 9: 40}, CPU, random.Random(5))
    tri = ref.clone()
    # id 3 (9 rows, all in slots) and id 5 (12 rows = S): every position is hot
    req = torch.tensor([3, 3, 5], dtype=torch.int32)
    topk = torch.tensor([[0, 4, 4, -1, 8, 2],
                         [4, 2, 8, 8, -1, 99],   # 99 >= seq_len: invalid, not a miss
                         [11, 0, 11, 5, -1, -1]], dtype=torch.int32)
    oa, ob = new_buffers(3, 6, CPU), new_buffers(3, 6, CPU)
    resolve_reference(ref, 0, req, topk, oa, max_query_len=2, compact=compact)
    resolve_triton(tri, 0, req, topk, ob, max_query_len=2, compact=compact)
    assert_same(ref, tri, oa, ob, msg="all-hit step")
    s = tri.stats[0]
    assert s[STAT_MISSES].item() == 0
    assert s[STAT_HITS].item() == 4 + 3  # id 3: {0, 2, 4, 8}; id 5: {0, 5, 11}
    assert s[STAT_INVALID].item() == 1
    assert bool((ob.stage_src[:3 * 6] == -1).all()) and bool((ob.stage_dst[:3 * 6] == -1).all())



def test_resolve_launch_warps_follow_the_widest_tile():
    """The resolve's warps grow with its widest tile (the S slots or the Q x K group):
    4 up to 1024 lanes, 8 up to 2048, 16 beyond (the default S = 4096 takes 16), and 32
    beyond for the miss phase of a split resolve."""
    from hisparse.cache.resolve_launch import resolve_launch_sizes

    assert resolve_launch_sizes(4096, 2048, 1) == (2048, 1, 4096, 16)
    assert resolve_launch_sizes(2048, 2048, 1) == (2048, 1, 2048, 8)
    assert resolve_launch_sizes(1024, 512, 2) == (512, 2, 1024, 4)
    assert resolve_launch_sizes(1000, 2048, 2)[3] == 16  # a 2 x 2048 group tile over 1024 slots
    assert resolve_launch_sizes(3000, 100, 1) == (128, 1, 4096, 16)
    # the miss phase of a split resolve doubles that widest case only
    assert resolve_launch_sizes(4096, 2048, 1, miss_phase=True) == (2048, 1, 4096, 32)
    assert resolve_launch_sizes(2048, 2048, 1, miss_phase=True)[3] == 8
    assert resolve_launch_sizes(1024, 512, 2, miss_phase=True)[3] == 4
