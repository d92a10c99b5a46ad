"""The Triton resolve kernel's victim search (P3) against the torch reference, on CPU
(interpreter; helpers: ``resolve_common``).

One request whose LRU slots hold hand-made or random tiers of stamps (empty slots,
tied stamps, stamps up to 2^62 apart) resolved for two steps by the kernel and the
reference: every state tensor and output equal, and the threshold tier (its stamp,
size and the members that go) is the case meant.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.cache.resolve_ref import resolve_reference
from hisparse.cache.resolve_launch import resolve_triton
from hisparse.cache.state import STAT_MISSES, HotState

from resolve_common import CPU, assert_same, host_row, make_state, new_buffers, small_cfg


# ---------------------------------------------------------------- P3 victim search
def lay_out_slots(state: HotState, layer: int, r: int, slots: list) -> None:
    """LRU slots 0..S-1 of (layer, request slot r) hold ``slots[s]`` = (position,
    stamp), or nothing (None: an empty slot); row_slot follows. The reserved slot S
    is kept. In place, CPU state."""
    for s_ in range(state.S):
        p = int(state.slot_pos[layer, r, s_])
        if p >= 0:
            state.row_slot[layer, host_row(state, r, p)] = -1
        state.slot_pos[layer, r, s_] = -1
        state.slot_stamp[layer, r, s_] = -1
    for s_, e in enumerate(slots):
        if e is not None:
            p, stamp = e
            state.slot_pos[layer, r, s_] = p
            state.slot_stamp[layer, r, s_] = stamp
            state.row_slot[layer, host_row(state, r, p)] = s_


def threshold_tier(state: HotState, layer: int, r: int, m: int) -> dict:
    """What P3 has to find for m misses, from the reference's key order: the empty
    candidates, the threshold stamp, the members E of its tier and the r2 of them that
    go (r2 = 0 when the empty slots suffice)."""
    S = state.S
    s_new = int(state.step[layer, r]) + 1
    stamp = state.slot_stamp[layer, r, :S].tolist()
    pos = state.slot_pos[layer, r, :S].tolist()
    n_emp = sum(1 for s_ in range(S) if stamp[s_] < s_new and pos[s_] < 0)
    occ = sorted((stamp[s_], pos[s_]) for s_ in range(S) if stamp[s_] < s_new and pos[s_] >= 0)
    m2 = m - n_emp
    if m2 <= 0 or m2 > len(occ):
        return dict(n_emp=n_emp, m2=m2, tau=None, E=0, r2=0)
    tau = occ[m2 - 1][0]
    below = sum(1 for st_, _ in occ if st_ < tau)
    return dict(n_emp=n_emp, m2=m2, tau=tau, E=sum(1 for st_, _ in occ if st_ == tau), r2=m2 - below)


def tiered_case(*, S: int, K: int, q: int, tiers: list[tuple[int, int]], n_empty: int, misses: int,
                seed: int, step_gap: int = 1):
    """One request whose LRU slots hold ``tiers`` = [(stamp, slot count), ...] at random
    distinct positions (in random slots) plus ``n_empty`` empty slots, with its step
    ``step_gap`` past the newest stamp, and two steps of top-k for a group of q tokens:
    each misses ``misses`` distinct positions (spread over the tokens, one repeated in
    the next token) and otherwise hits only the reserved slot or is padding, so that
    no hit moves a slot out of its tier. Returns (state, req_ids, [topk, topk])."""
    assert sum(c for _, c in tiers) + n_empty == S and misses <= q * K
    rng = random.Random(seed)
    seq = S + 2 * misses + 20
    cfg = small_cfg(K=K, q=q, S=S, B=4, L=1, R=2)
    state = make_state(cfg, {3: seq}, CPU, rng)
    r = int(state.id_to_slot[3])
    nh = S - n_empty
    positions = rng.sample(range(seq - 1), nh + 2 * misses)  # seq - 1 is in the reserved slot
    hot = positions[:nh]
    stamps = [st_ for st_, c in tiers for _ in range(c)]
    entries = [(p, st_) for p, st_ in zip(hot, stamps)] + [None] * n_empty
    rng.shuffle(entries)
    lay_out_slots(state, 0, r, entries)
    state.step[0, r] = max(st_ for st_, _ in tiers) + step_gap - 1
    steps = []
    for cold in (positions[nh:nh + misses], positions[nh + misses:]):
        rows = [[-1] * K for _ in range(q)]
        for i, p in enumerate(cold):
            rows[i % q][(i // q) % K] = p
        for j in range(q):
            free = [k for k in range(K) if rows[j][k] == -1]
            if q > 1 and free:
                rows[j][free.pop()] = cold[(j + 1) % len(cold)]
            if free:
                rows[j][free.pop()] = seq - 1
        steps.append(torch.tensor(rows, dtype=torch.int32))
    return state, torch.tensor([3] * q, dtype=torch.int32), steps


def check_tiered(**case) -> dict:
    """Resolve both steps of ``tiered_case(**case)`` with the kernel and the reference
    (the second step evicts among what the first left); every state tensor and output
    must be equal. Returns the first step's ``threshold_tier``."""
    ref, req, steps = tiered_case(**case)
    info = threshold_tier(ref, 0, int(ref.id_to_slot[3]), case["misses"])
    tri = ref.clone()
    K, q = case["K"], case["q"]
    for i, topk in enumerate(steps):
        oa, ob = new_buffers(q, K, CPU), new_buffers(q, K, CPU)
        oa.physical.zero_()  # the kernel's victim list: stale entries would read as slot 0
        ob.physical.zero_()
        resolve_reference(ref, 0, req, topk, oa, max_query_len=q)
        resolve_triton(tri, 0, req, topk, ob, max_query_len=q)
        assert_same(ref, tri, oa, ob, msg=f"{case} step {i}")
    assert int(tri.stats[0, STAT_MISSES]) == 2 * case["misses"]
    return info


# S = 40 slots in a 64-lane tile (24 lanes off)
@pytest.mark.parametrize("name,case,want", [
    ("tier_middle", dict(tiers=[(7, 6), (8, 20), (12, 14)], n_empty=0, misses=15),
     lambda i: i["tau"] == 8 and i["E"] == 20 and i["r2"] == 9),
    ("big_tier_middle", dict(tiers=[(3, 36), (4, 4)], n_empty=0, misses=10),
     lambda i: i["E"] == 36 and i["r2"] == 10),
    ("big_tier_first", dict(tiers=[(3, 36), (4, 4)], n_empty=0, misses=1),
     lambda i: i["E"] == 36 and i["r2"] == 1),
    ("big_tier_last", dict(tiers=[(3, 36), (4, 4)], n_empty=0, misses=31),
     lambda i: i["E"] == 36 and i["r2"] == 31),
    ("whole_tier", dict(tiers=[(5, 10), (6, 10), (9, 20)], n_empty=0, misses=20),
     lambda i: i["tau"] == 6 and i["r2"] == i["E"] == 10),
    ("empties_then_tier", dict(tiers=[(2, 15), (3, 20)], n_empty=5, misses=12),
     lambda i: i["n_emp"] == 5 and i["tau"] == 2 and i["r2"] == 7),
    ("empties_suffice", dict(tiers=[(2, 28)], n_empty=12, misses=5), lambda i: i["m2"] < 0),
    ("empties_exactly", dict(tiers=[(2, 34)], n_empty=6, misses=6), lambda i: i["m2"] == 0),
    ("far_tier", dict(tiers=[(0, 5), (2**33, 10), (2**33 + 1, 5), (2**62, 20)], n_empty=0, misses=30),
     lambda i: i["tau"] == 2**62 and i["r2"] == 10),
    ("far_threshold", dict(tiers=[(0, 3), (9, 4), (2**33, 25), (2**33 + 5, 8)], n_empty=0, misses=20),
     lambda i: i["tau"] == 2**33 and i["r2"] == 13),
    ("near_threshold", dict(tiers=[(100, 4), (101, 4), (102, 4), (104, 20), (107, 8)], n_empty=0, misses=16),
     lambda i: i["tau"] == 104 and i["r2"] == 4),
])
def test_victim_search_tiers(name, case, want):
    """P3 against the reference on hand-made tier layouts: the threshold at the first,
    a middle and the last position of its tier, a tier that goes whole, empty slots
    fewer than, as many as and more than the misses, and threshold stamps a few steps
    or 2^33..2^62 above the oldest (S = 40: a 64-lane tile with 24 lanes off)."""
    info = check_tiered(S=40, K=32, q=1, seed=7, **case)
    assert want(info), info


@pytest.mark.parametrize("seed", range(3))
def test_victim_search_multitoken_group(seed):
    """A q = 2 group (16 entries each, misses repeated across the tokens) with a
    34-slot threshold tier."""
    info = check_tiered(S=40, K=16, q=2, seed=seed, tiers=[(4, 3), (6, 34), (8, 3)],
                        n_empty=0, misses=12)
    assert info["E"] == 34 and info["r2"] == 9


def test_victim_search_victim_list_wider_than_k():
    """K = 4: the victim list (4 misses) fills the group's one row of ``physical``
    exactly; the threshold falls inside a 20-slot tier."""
    info = check_tiered(S=40, K=4, q=1, seed=5, tiers=[(1, 2), (2, 20), (3, 18)],
                        n_empty=0, misses=4)
    assert info["E"] == 20 and info["r2"] == 2


@pytest.mark.parametrize("seed", range(6))
def test_victim_search_random_tiers(seed):
    """Random tier layouts (1..6 tiers, stamp gaps from 1 to 2^40, some empty slots)
    and miss counts, at S = 40 and 23."""
    rng = random.Random(1000 + seed)
    S = rng.choice([40, 23])
    K = 16 if S == 40 else 8
    q = rng.choice([1, 2])
    n_empty = rng.choice([0, 0, 2, 7])
    cuts = sorted(rng.sample(range(1, S - n_empty), rng.randint(0, 5)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [S - n_empty])]
    stamp, tiers = rng.randrange(50), []
    for c in sizes:
        tiers.append((stamp, c))
        stamp += rng.choice([1, 1, 2, 5, 2**20, 2**40])
    misses = rng.randint(1, min(q * K, S))
    check_tiered(S=S, K=K, q=q, seed=seed, tiers=tiers,
                 n_empty=n_empty, misses=misses, step_gap=rng.choice([1, 3]))


@pytest.mark.parametrize("q,K,misses", [(1, 8, 7), (2, 8, 13), (2, 8, 16), (2, 16, 25), (2, 16, 32),
                                        (1, 32, 30)])
def test_victim_search_large_tier(q, K, misses):
    """A 38-slot threshold tier larger than the group's n * K entries, with threshold
    ranks over most of it (one or two tokens)."""
    info = check_tiered(S=40, K=K, q=q, seed=misses, tiers=[(4, 38), (6, 2)], n_empty=0,
                        misses=misses)
    assert info["E"] == 38 and info["r2"] == misses
