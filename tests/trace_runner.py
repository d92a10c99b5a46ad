"""Randomized traces of a HiSparseCache checked against ``lru_sim.LRUSim``.

:class:`TraceRunner` drives a cache and a sim side by side with random ops (adds,
frees, per-layer and batched writes, steps, resolves, split resolves, prefetches) and
runs ``invariants.check_cache`` / ``invariants.check_result`` after every op;
:func:`long_trace` and :func:`tier_trace` are seeded op mixes for it (the latter for a
cache with an elastic tier).
"""

from __future__ import annotations

import random

import torch

from hisparse import CapacityError
from invariants import _fail, assert_same, check_cache, check_result, snapshot
from lru_sim import LRUSim


# ---------------------------------------------------------------- trace runner
class TraceRunner:
    """Applies ops to a cache and a sim together, checking after every op.

    Ops are abstract (indices are taken modulo what exists), so any op list is valid
    and hypothesis can shrink freely.
    """

    def __init__(self, cache, *, seed: int = 0, check_every: int = 1) -> None:
        cfg = cache.cfg
        self.cache, self.cfg = cache, cfg
        self.sim = LRUSim.for_cache(cache)  # the elastic tier modelled when the config has one
        self.truth: dict[tuple[int, int], torch.Tensor] = {}
        self.rng = random.Random(seed)
        self.next_id = 0
        self.ops = 0
        self.check_every = check_every
        self.capacity_errors = 0

    def _check(self) -> None:
        self.ops += 1
        if self.ops % self.check_every == 0:
            check_cache(self.cache, self.sim, self.truth)

    def add(self) -> None:
        rid = self.next_id % self.cfg.max_request_id
        while rid in self.sim.reqs:
            rid = (rid + 1) % self.cfg.max_request_id
        self.next_id = rid + 1
        if len(self.sim.reqs) >= self.cfg.max_num_reqs:
            before = snapshot(self.cache)
            try:
                self.cache.add_request(rid)
            except CapacityError:
                self.capacity_errors += 1
                assert_same(before, snapshot(self.cache))
                return
            _fail("add_request past max_num_reqs did not raise CapacityError")
        self.cache.add_request(rid)
        r = self.cache.request(rid).slot
        self.sim.add(rid, r)
        self._check()

    def free(self, which: int) -> None:
        live = sorted(self.sim.reqs)
        if not live:
            return
        rid = live[which % len(live)]
        self.cache.free_request(rid)
        self.sim.free(rid)
        for l in range(self.cfg.num_layers):
            self.truth.pop((rid, l), None)
        self._check()

    def append(self, which: int, layer: int, n: int, all_layers: bool = False) -> None:
        live = sorted(self.sim.reqs)
        if not live:
            return
        rid = live[which % len(live)]
        layers = range(self.cfg.num_layers) if all_layers else [layer % self.cfg.num_layers]
        for l in layers:
            rows = torch.randint(0, 256, (n, self.cfg.row_bytes), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
            before = snapshot(self.cache) if n else None
            try:
                p0 = self.cache.write(l, rid, rows.to(self.cache.device))[0]
            except CapacityError:
                self.capacity_errors += 1
                assert_same(before, snapshot(self.cache))
                return
            if p0 != self.sim.reqs[rid].lens[l]:
                _fail(f"write returned {p0}, expected {self.sim.reqs[rid].lens[l]}")
            self.sim.append(l, rid, n)
            old = self.truth.get((rid, l), torch.empty((0, self.cfg.row_bytes), dtype=torch.uint8))
            self.truth[(rid, l)] = torch.cat([old, rows])
            self._check()

    def append_tokens(self, mask: int, layer: int) -> None:
        """One row to each live request picked by ``mask`` through the batched
        ``write`` of one row per request (a decode step's new tokens)."""
        live = sorted(self.sim.reqs)
        rids = [rid for i, rid in enumerate(live) if (mask >> i) & 1]
        l = layer % self.cfg.num_layers
        rows = torch.randint(0, 256, (len(rids), self.cfg.row_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        before = snapshot(self.cache)
        try:
            pos = self.cache.write(l, self.cache.plan_write(rids, [1] * len(rids)), rows.to(self.cache.device))
        except CapacityError:
            self.capacity_errors += 1
            assert_same(before, snapshot(self.cache))
            return
        for i, rid in enumerate(rids):
            if pos[i] != self.sim.reqs[rid].lens[l]:
                _fail(f"the decode write gave position {pos[i]}, expected "
                      f"{self.sim.reqs[rid].lens[l]}")
            old = self.truth.get((rid, l), torch.empty((0, self.cfg.row_bytes), dtype=torch.uint8))
            self.truth[(rid, l)] = torch.cat([old, rows[i:i + 1]])
        self.sim.write([l], [(rid, 1) for rid in rids])  # one batch: one pool plan
        self._check()

    def _batch(self, mask: int, sizes, equal_layers: bool = False) -> tuple[list[int], list[int]]:
        """Live ids picked by ``mask`` (shuffled: the batch order matters to the pool's
        grants) and a row count each from ``sizes``; ``equal_layers``: only requests whose
        layers hold the same rows (what a step accepts)."""
        live = sorted(self.sim.reqs)
        rids = [rid for i, rid in enumerate(live) if (mask >> i) & 1
                and (not equal_layers or len(set(self.sim.reqs[rid].lens)) == 1)]
        self.rng.shuffle(rids)
        return rids, [self.rng.choice(sizes) for _ in rids]

    def _rows(self, n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, self.cfg.row_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))

    def _record(self, layers, rids: list[int], counts: list[int], rows: torch.Tensor) -> None:
        o = 0
        for rid, n in zip(rids, counts):
            for l in layers:
                old = self.truth.get((rid, l), torch.empty((0, self.cfg.row_bytes), dtype=torch.uint8))
                self.truth[(rid, l)] = torch.cat([old, rows[o:o + n]])
            o += n

    def append_batch(self, mask: int, layer: int, sizes=(0, 1, 3, 17, 40)) -> None:
        """Several rows to each live request picked by ``mask`` in one ``cache.write`` of
        one layer (a prefill chunk's batched append)."""
        rids, counts = self._batch(mask, sizes)
        if not rids:
            return
        l = layer % self.cfg.num_layers
        rows = self._rows(sum(counts))
        before = snapshot(self.cache)
        try:
            firsts = self.cache.write(l, self.cache.plan_write(rids, counts), rows.to(self.cache.device))
        except CapacityError:
            self.capacity_errors += 1
            assert_same(before, snapshot(self.cache))
            return
        want = [self.sim.reqs[rid].lens[l] for rid in rids]
        if firsts != want:
            _fail(f"write returned first positions {firsts}, expected {want}")
        self._record([l], rids, counts, rows)
        self.sim.write([l], list(zip(rids, counts)))
        self._check()

    def step(self, mask: int, sizes=(1, 1, 2, 9)) -> None:
        """A forward's append to every layer: ``prepare_step`` once, then ``write_step``
        per layer (requests whose layers hold the same rows only)."""
        rids, counts = self._batch(mask, sizes, equal_layers=True)
        if not rids:
            return
        rows = self._rows(sum(counts))
        before = snapshot(self.cache)
        try:
            step = self.cache.prepare_step(self.cache.plan_write(rids, counts))
        except CapacityError:
            self.capacity_errors += 1
            assert_same(before, snapshot(self.cache))
            return
        for l in range(self.cfg.num_layers):
            self.cache.write_step(l, step, rows.to(self.cache.device))
        self._record(range(self.cfg.num_layers), rids, counts, rows)
        self.sim.write(range(self.cfg.num_layers), list(zip(rids, counts)))
        self._check()

    def make_step(self, mask: int, pad: float, invalid: bool,
                  layer: int = 0) -> tuple[list[int], list[list[int]]]:
        """req_ids/topk for the live requests selected by ``mask`` (positions below the
        request's length in ``layer``). With ``invalid``: bad positions, bad ids, and
        sometimes a second run of an earlier request appended at the end."""
        K, q = self.cfg.top_k, self.cfg.max_query_len
        ids: list[int] = []
        topk: list[list[int]] = []
        live = sorted(self.sim.reqs)
        for i, rid in enumerate(live):
            if not (mask >> i) & 1:
                continue
            n = self.sim.layer_len(layer, rid)
            for _ in range(self.rng.randint(1, q + (1 if invalid else 0))):
                row = []
                for _ in range(K):
                    u = self.rng.random()
                    if u < pad or n == 0:
                        row.append(-1)
                    elif invalid and u < pad + 0.1:
                        row.append(self.rng.choice([-2, n, n + 3, -7]))
                    else:
                        row.append(self.rng.randrange(n))
                topk.append(row)
                ids.append(rid)
        cap = self.cache.cfg.max_tokens
        ids, topk = ids[:cap], topk[:cap]
        if invalid and ids and self.rng.random() < 0.3:
            ids[self.rng.randrange(len(ids))] = self.rng.choice(
                [-1, self.cfg.max_request_id, self.next_id % self.cfg.max_request_id])
        if invalid and ids and len(ids) < cap and self.rng.random() < 0.3:
            # a second run of a request of this step (split runs): must be skipped
            j = self.rng.randrange(len(ids))
            if len(ids) >= 2 and ids[-1] == ids[j]:
                j = self.rng.randrange(len(ids))
            if ids[-1] != ids[j]:
                ids.append(ids[j])
                topk.append(list(topk[j]))
        return ids, topk

    def _step_tensors(self, layer: int, mask: int, pad: float, invalid: bool):
        """(layer mod L, ids, top-k lists, ids int32 [T], top-k int32 [T, K] on the cache's
        device) of a step of the requests picked by ``mask``."""
        layer %= self.cfg.num_layers
        ids, topk = self.make_step(mask, pad, invalid, layer)
        dev = self.cache.device
        ids_t = torch.tensor(ids, dtype=torch.int32, device=dev)
        topk_t = torch.tensor(topk, dtype=torch.int32, device=dev).reshape(len(ids), self.cfg.top_k)
        return layer, ids, topk, ids_t, topk_t

    def resolve(self, layer: int, mask: int, pad: float = 0.2, invalid: bool = False,
                compact: bool = False) -> None:
        """Resolve a step for the live requests picked by bitmask ``mask``; ``invalid``
        runs unchecked with bad ids/positions mixed in."""
        layer, ids, topk, ids_t, topk_t = self._step_tensors(layer, mask, pad, invalid)
        res = self.cache.resolve(layer, ids_t, topk_t, validate=not invalid, compact=compact)
        self.sim.resolve(layer, ids, topk)
        check_result(self.cache, layer, ids, topk, res, self.sim, compact=compact)
        self._check()

    def resolve_split(self, layer: int, mask: int, pad: float = 0.2, invalid: bool = False,
                      compact: bool = False) -> None:
        """``resolve`` in two phases (``split=True``): the same state and union result; a hit
        row (non-compact) is the union's row, a resident token has no misses."""
        layer, ids, topk, ids_t, topk_t = self._step_tensors(layer, mask, pad, invalid)
        res = self.cache.resolve(layer, ids_t, topk_t, validate=not invalid, compact=compact, split=True)
        self.sim.resolve(layer, ids, topk)
        check_result(self.cache, layer, ids, topk, res, self.sim, compact=compact)
        hit, phys = res.hit_physical.cpu(), res.physical.cpu()
        mc = res.miss_counts.cpu().tolist()
        tok = self.sim.token_valid(ids)
        for t, rid in enumerate(ids):
            if not tok[t] or not self.sim.resident(rid):
                if not compact and ((hit[t] >= 0) & (hit[t] != phys[t])).any():
                    _fail(f"token {t}: hit rows {hit[t].tolist()} not in the union {phys[t].tolist()}")
                continue
            if mc[t] != 0:
                _fail(f"token {t} of resident request {rid}: {mc[t]} misses")
            if not compact and not torch.equal(hit[t], phys[t]):
                _fail(f"token {t} of resident request {rid}: hit rows {hit[t].tolist()}, "
                      f"resolved {phys[t].tolist()}")
        self._check()

    def prefetch(self, layer: int, mask: int, pad: float = 0.2) -> None:
        """A prefetch of a predicted selection (valid positions), then the checks."""
        layer %= self.cfg.num_layers
        ids, topk = self.make_step(mask, pad, False, layer)
        dev = self.cache.device
        ids_t = torch.tensor(ids, dtype=torch.int32, device=dev)
        topk_t = torch.tensor(topk, dtype=torch.int32, device=dev).reshape(len(ids), self.cfg.top_k)
        out = self.cache.prefetch(layer, ids_t, topk_t)
        self.sim.resolve(layer, ids, topk, prefetch=True)
        staged = int((out.stage_dst[:len(ids) * self.cfg.top_k] >= 0).sum())
        tok = self.sim.token_valid(ids)
        if any(tok[t] and self.sim.resident(rid) and int(out.stage_counts[t]) for t, rid in enumerate(ids)):
            _fail("a prefetch staged rows of a resident request")
        self._check()
        if staged != sum(int(x) for x in out.stage_counts[:len(ids)]):
            _fail(f"prefetch staged {staged} rows, stage_counts say otherwise")

    def run(self, ops: list[tuple]) -> None:
        for op in ops:
            kind, args = op[0], op[1:]
            getattr(self, kind)(*args)


def long_trace(runner: "TraceRunner", rng, n_ops: int, *, n_big: int = 9,
               token_appends: bool = True) -> None:
    """A seeded mix of adds, frees, appends (some of ``n_big`` rows), batched token appends
    (when ``token_appends``) and resolves (some unchecked with invalid entries)."""
    for _ in range(n_ops):
        u = rng.random()
        if u < 0.12:
            runner.add()
        elif u < 0.18:
            runner.free(rng.randrange(8))
        elif u < 0.5:
            runner.append(rng.randrange(8), rng.randrange(4), rng.choice([1, 1, 2, 5, n_big]),
                          rng.random() < 0.8)
        elif token_appends and u < 0.58:
            runner.append_tokens(rng.randrange(16), rng.randrange(4))
        else:
            runner.resolve(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]),
                           rng.random() < 0.25, rng.random() < 0.3)


def tier_trace(runner: "TraceRunner", rng, n_ops: int) -> None:
    """A seeded mix of every write path (per-layer appends, token appends, batched
    multi-row writes, steps), every resolve path (resolve, split, prefetch) and
    lifecycle, for a cache with an elastic tier (or without)."""
    for _ in range(n_ops):
        u = rng.random()
        if u < 0.10:
            runner.add()
        elif u < 0.15:
            runner.free(rng.randrange(8))
        elif u < 0.25:
            runner.append(rng.randrange(8), rng.randrange(4), rng.choice([1, 2, 30, 70]), rng.random() < 0.8)
        elif u < 0.32:
            runner.append_tokens(rng.randrange(16), rng.randrange(4))
        elif u < 0.42:
            runner.append_batch(rng.randrange(16), rng.randrange(4))
        elif u < 0.55:
            runner.step(rng.randrange(16))
        elif u < 0.75:
            runner.resolve(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]),
                           rng.random() < 0.25, rng.random() < 0.3)
        elif u < 0.9:
            runner.resolve_split(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]),
                                 rng.random() < 0.25, rng.random() < 0.3)
        else:
            runner.prefetch(rng.randrange(4), rng.randrange(16), rng.choice([0.0, 0.3]))


__all__ = ["TraceRunner", "long_trace", "tier_trace"]
