"""Helpers shared by the resolve kernel tests (test_kernels_resolve.py,
test_resolve_victim_search.py, test_kernels_resolve_random.py) and the GPU tests
(test_kernels_gpu.py, test_cache_gpu.py): a consistent ``HotState`` as the write path
leaves it (``make_state``), random resolve batches (``random_batch``), sentinel-filled
output buffers (``new_buffers``), state / output comparison (``assert_same``) and a
random trace of the Triton kernel against the reference (``run_trace``, ``small_cfg``).
"""

from __future__ import annotations

import random

import torch

from hisparse.cache.resolve_ref import resolve_reference
from hisparse.cache.resolve_launch import resolve_triton
from hisparse.cache.state import HotState, ResolveBuffers
from hisparse.config import HiSparseConfig


CPU = torch.device("cpu")
STATE_FIELDS = ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot",
                "host_block", "step", "stats", "resident", "page_table")
OUT_FIELDS = ("physical", "valid_counts", "stage_src", "stage_dst")


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
