"""Triton resolve kernel (interpreter on CPU) against the torch reference.

The kernel pairs misses with victims exactly like the reference, so after every step
all state tensors and all output buffers must be identical. The helpers at the top
(``make_state``, ``random_batch``, ``assert_same``) are reused by the GPU tests.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.cache.resolve_ref import copy_rows_reference, resolve_reference
from hisparse.cache.resolve_triton import resolve_triton
from hisparse.cache.state import (STAT_HITS, STAT_INVALID, STAT_MISSES, STAT_RESOLVES,
                                  HotState, ResolveBuffers)
from hisparse.config import HiSparseConfig

CPU = torch.device("cpu")
STATE_FIELDS = ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot",
                "host_block", "step", "stats", "resident", "page_table")
OUT_FIELDS = ("physical", "valid_counts", "stage_src", "stage_dst")


# ---------------------------------------------------------------- helpers
def host_row(state: HotState, r: int, p: int) -> int:
    return int(state.block_table[r, p // state.B]) * state.B + p % state.B


def make_state(cfg: HiSparseConfig, seq_by_id: dict[int, int], device: torch.device,
               rng: random.Random, *, holes: float = 0.0) -> HotState:
    """A consistent state as the write path leaves it: live ids on random request
    slots, random distinct host blocks, positions < S in slot == position and the
    last position (if >= S) in the reserved slot S, in every layer. With ``holes``
    that fraction of slots 0..S-1 is left empty (row on host only), so that empty
    slots compete with occupied ones for eviction."""
    st_ = HotState.allocate(cfg, CPU)
    S, B = cfg.device_buffer_size, cfg.host_block_size
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    slots = rng.sample(range(cfg.max_num_reqs), len(seq_by_id))
    blocks = torch.randperm(cfg.num_host_blocks, generator=gen).to(torch.int32)
    used = 0
    for (rid, seq), r in zip(seq_by_id.items(), slots):
        nb = -(-seq // B)
        if used + nb > blocks.numel():
            raise ValueError("test config: host pool too small")
        st_.id_to_slot[rid] = r
        st_.seq_lens[:, r] = seq
        st_.block_table[r, :nb] = blocks[used:used + nb]
        used += nb
        if seq == 0:
            continue
        p = torch.arange(min(seq, S))
        rows = st_.block_table[r, p // B].long() * B + p % B
        last = seq - 1
        last_row = host_row(st_, r, last)
        for layer in range(cfg.num_layers):
            keep = torch.rand(p.numel(), generator=gen) >= holes
            pk = p[keep].to(torch.int32)
            st_.slot_pos[layer, r, pk.long()] = pk
            st_.slot_stamp[layer, r, pk.long()] = 0
            st_.row_slot[layer, rows[keep]] = pk
            if seq > S:
                st_.slot_pos[layer, r, S] = last
                st_.slot_stamp[layer, r, S] = 0
                st_.row_slot[layer, last_row] = S
    return HotState(**{f: (getattr(st_, f).to(device) if f in STATE_FIELDS else getattr(st_, f))
                       for f in ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp",
                                 "row_slot", "host_block", "step", "stats", "resident", "page_table", "S", "B",
                                 "pool_base", "PB", "pool_pages")})


def random_batch(seq_by_id: dict[int, int], K: int, q: int, rng: random.Random, *,
                 bad: bool = True, max_tokens: int | None = None):
    """req_ids int32 [T], topk int32 [T, K]: contiguous runs of 1..q tokens per
    request, positions mostly in range with -1 padding and duplicates; with ``bad``
    also out-of-range positions, unknown/free ids and runs longer than q."""
    ids = list(seq_by_id)
    rng.shuffle(ids)
    req: list[int] = []
    rows: list[list[int]] = []
    for rid in ids:
        if rng.random() < 0.2:
            continue
        n = rng.randint(1, q)
        if bad and rng.random() < 0.15:
            n = q + rng.randint(1, 2)  # run longer than q: extra tokens are invalid
        seq = seq_by_id[rid]
        for _ in range(n):
            req.append(rid)
            row = []
            for _ in range(K):
                u = rng.random()
                if u < 0.15 or seq == 0:
                    row.append(-1)
                elif u < 0.25 and row:
                    row.append(rng.choice(row))  # duplicate within the token
                elif bad and u < 0.3:
                    row.append(rng.choice([seq, seq + 7, -2, -1000]))
                else:
                    row.append(rng.randrange(seq))
            rows.append(row)
    if bad and req and rng.random() < 0.3:
        # a second run of a request already in the batch (split runs): not resolved
        j = rng.randrange(len(req))
        if req[j] != req[-1]:
            req += [req[j]] * rng.randint(1, q)
            rows += [list(rows[j]) for _ in range(len(req) - len(rows))]
    if bad and rng.random() < 0.5:
        req.append(rng.choice([10**6, -3, 0]))  # unknown id (0 is free in these tests)
        rows.append([rng.randrange(-1, 5) for _ in range(K)])
    if max_tokens is not None:
        req, rows = req[:max_tokens], rows[:max_tokens]
    T = len(req)
    return (torch.tensor(req, dtype=torch.int32).reshape(T),
            torch.tensor(rows, dtype=torch.int32).reshape(T, K))


def new_buffers(T: int, K: int, device: torch.device) -> ResolveBuffers:
    """Buffers larger than needed, prefilled with a sentinel (must stay untouched)."""
    out = ResolveBuffers.allocate(T + 2, K + 1, device)
    for f in OUT_FIELDS:
        getattr(out, f).fill_(777)
    return out


def assert_same(a: HotState, b: HotState, oa: ResolveBuffers | None = None,
                ob: ResolveBuffers | None = None, msg: str = "") -> None:
    for f in STATE_FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if not torch.equal(x, y):
            bad = torch.nonzero(x != y)[:5].tolist()
            raise AssertionError(f"{msg}: state.{f} differs at {bad}")
    if oa is not None:
        for f in OUT_FIELDS:
            x, y = getattr(oa, f), getattr(ob, f)
            if not torch.equal(x, y):
                bad = torch.nonzero(x != y)[:5].tolist()
                raise AssertionError(f"{msg}: out.{f} differs at {bad}: {x.flatten()[:40]} vs {y.flatten()[:40]}")


def run_trace(cfg: HiSparseConfig, seq_by_id: dict[int, int], steps: int, seed: int, *,
              compact: bool, bad: bool = True, holes: float = 0.0,
              device: torch.device = CPU) -> HotState:
    rng = random.Random(seed)
    ref = make_state(cfg, seq_by_id, device, rng, holes=holes)
    tri = ref.clone()
    K, q = cfg.top_k, cfg.max_query_len
    for i in range(steps):
        req, topk = random_batch(seq_by_id, K, q, rng, bad=bad)
        req, topk = req.to(device), topk.to(device)
        layer = rng.randrange(cfg.num_layers)
        oa, ob = new_buffers(req.numel(), K, device), new_buffers(req.numel(), K, device)
        resolve_reference(ref, layer, req, topk, oa, max_query_len=q, compact=compact)
        resolve_triton(tri, layer, req, topk, ob, max_query_len=q, compact=compact)
        assert_same(ref, tri, oa, ob, msg=f"seed {seed} step {i} layer {layer} T={req.numel()}")
    return tri


def small_cfg(*, K: int, q: int, S: int, B: int = 3, L: int = 2, R: int = 8) -> HiSparseConfig:
    """256 host blocks: room for 4 requests of up to 64 blocks each (the random traces
    draw up to 3 requests of up to 59 tokens, at 1 token per block)."""
    return HiSparseConfig(num_layers=L, host_pool_tokens=B * 256, top_k=K, device_buffer_size=S,
                          max_num_reqs=R, max_query_len=q, host_block_size=B, max_request_id=16,
                          device="cpu")


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
    import hisparse.cache.resolve_triton as rt
    monkeypatch.setattr(rt, "_SCAN_CHUNK", 2)
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
    from hisparse.cache.resolve_triton import _launch_sizes

    assert _launch_sizes(4096, 2048, 1) == (2048, 1, 4096, 16)
    assert _launch_sizes(2048, 2048, 1) == (2048, 1, 2048, 8)
    assert _launch_sizes(1024, 512, 2) == (512, 2, 1024, 4)
    assert _launch_sizes(1000, 2048, 2)[3] == 16  # a 2 x 2048 group tile over 1024 slots
    assert _launch_sizes(3000, 100, 1) == (128, 1, 4096, 16)
    # the miss phase of a split resolve doubles that widest case only
    assert _launch_sizes(4096, 2048, 1, miss_phase=True) == (2048, 1, 4096, 32)
    assert _launch_sizes(2048, 2048, 1, miss_phase=True)[3] == 8
    assert _launch_sizes(1024, 512, 2, miss_phase=True)[3] == 4


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
