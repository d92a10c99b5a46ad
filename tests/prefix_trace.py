"""A randomized churn trace that drives a ``HiSparseCache(prefix_caching=True)`` and
``prefix_model.PrefixModel`` side by side (rows: ``prefix_model.Rows``).

:class:`PrefixTrace` checks after every operation: the returned cached tokens, block
ids (aliases included) and host blocks of every live request, the free list, the
index (cached blocks, references, the evictable LRU order, evictions), the device
tables (lengths, block table, ``host_block`` of the aliases in use, the writer's host
copy, free slots clean), ``row_slot`` <-> ``slot_pos`` by row key, every hot row and
every host row of a live request byte-exact against the model's rows, every cached
block's host rows in every layer, the exact LRU state against ``lru_sim.LRUSim``,
and every resolve's physical rows byte-exact. A refused call must change nothing.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import torch

from hisparse import CapacityError
from invariants import _check_sim, _cpu_state, assert_same, snapshot
from lru_sim import LRUSim
from prefix_model import PrefixModel, content


def _fail(msg: str) -> None:
    raise AssertionError(msg)


# ------------------------------------------------------------------- snapshots
def prefix_snapshot(cache) -> dict[str, Any]:
    """``invariants.snapshot`` plus the prefix cache's host-side state."""
    snap = snapshot(cache)
    st = cache.state
    snap["host_block"] = st.host_block.cpu().clone()
    alloc = cache.pool.allocator
    snap["free"] = sorted(alloc._free)
    snap["aliases"] = sorted(alloc._aliases)
    snap["host_of"] = torch.from_numpy(alloc.host_of.copy())
    snap["mapped"] = torch.from_numpy(alloc._mapped.copy())
    p = cache.prefix
    if p is not None:
        ix = p.index
        snap["index"] = (dict(ix._block_of), ix.ref_counts(), ix.evictable_order(), ix.evictions,
                         ix.query_blocks, ix.hit_blocks)
        snap["prefix"] = (p.query_tokens, p.hit_tokens,
                          {r: (t.salt, t.chain.name, t.chain.blocks, t.chain.tail.tolist(), list(t.names),
                               t.done, t.path[:t.done].tolist(), list(t.extra)) for r, t in p._req.items()})
    return snap


# ------------------------------------------------------------------- the trace
class PrefixTrace:
    """Drives a prefix-caching cache and :class:`PrefixModel` together (see module doc).

    ``full_every``: run the full state check after every n-th operation (the cheap
    bookkeeping checks run after every one)."""

    def __init__(self, cache, seed: int, *, groups: int = 3, group_len=(1, 4), suffix=(0, 6),
                 vocab: int = 500, full_every: int = 1) -> None:
        self.cache, self.cfg = cache, cache.cfg
        cfg = cache.cfg
        assert cfg.prefix_caching
        self.B, self.L, self.R = cfg.host_block_size, cfg.num_layers, cfg.max_num_reqs
        self.S, self.SP, self.K = cfg.device_buffer_size, cfg.slots_per_req, cfg.top_k
        self.model = PrefixModel(cfg)
        self.sim = LRUSim.for_cache(cache)
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.suffix = suffix
        B = self.B
        # shared prompt prefixes: a few whole blocks, sometimes plus a partial one
        self.groups = [[self.rng.randrange(vocab) for _ in range(self.rng.randint(*group_len) * B
                                                                 + self.rng.choice([0, 0, B // 2]))]
                       for _ in range(groups)]
        self.history: list[tuple[list[int], bytes | None]] = []  # (tokens, salt) of past requests
        self.full_every = full_every
        self.n_ops = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self._checked: set[tuple[int, bytes]] = set()  # (cached block, its last row key) checked

    # ---- helpers ------------------------------------------------------------------
    def _toks(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _rows(self, rid: int, layer: int, p0: int, p1: int) -> torch.Tensor:
        return self.model.reqs[rid].rows.get(layer, p0, p1).to(self.cache.device)

    def _free_id(self) -> int:
        ids = [i for i in range(self.cfg.max_request_id) if i not in self.model.reqs]
        return self.rng.choice(ids)

    def _live(self) -> list[int]:
        return sorted(self.model.reqs)

    # ---- ops ------------------------------------------------------------------------
    def op_add(self) -> None:
        rng, B = self.rng, self.B
        kind = rng.choice(["group", "group", "group", "follow", "follow", "dup", "exact", "short", "plain"])
        salt = rng.choice([None, None, None, b"tenant-b"])
        if kind == "follow" and self.history:
            prev, salt = rng.choice(self.history)
            tokens = prev + self._toks(rng.randint(1, B + 2))
        elif kind == "dup" and self.model.reqs:  # the prompt of a live request, maybe unwritten
            q = self.model.reqs[rng.choice(self._live())]
            tokens, salt = list(q.tokens[:max(1, q.given)]), q.salt
        elif kind == "exact":  # whole blocks exactly: the cap leaves the last one to compute
            g = rng.choice(self.groups)
            tokens = (g + self._toks(B))[:max(1, len(g) // B) * B]
        elif kind == "short":
            tokens = self._toks(rng.choice([0, 1, 2]))
        else:
            tokens = rng.choice(self.groups) + self._toks(rng.randint(*self.suffix))
        given = kind != "plain"
        if not given:
            salt = None
        rid = self._free_id()
        if len(self.model.reqs) >= self.R:
            before = prefix_snapshot(self.cache)
            try:
                self.cache.add_request(rid, tokens if given else None, salt if given else None)
            except CapacityError:
                assert_same(before, prefix_snapshot(self.cache))
                self.counts["add_refused"] += 1
                return
            _fail("add_request with every request slot taken did not raise CapacityError")
        got = self.cache.add_request(rid, tokens, salt) if given else self.cache.add_request(rid)
        slot = self.cache.request(rid).slot
        want = self.model.add(rid, slot, tokens, salt, given)
        if got != want:
            _fail(f"add_request({rid}, {len(tokens)} tokens, {kind}) returned {got} cached tokens, "
                  f"model {want}")
        holder = self._holder(rid) if want else None
        self.sim.add(rid, slot)
        self.sim.reqs[rid].lens = [want] * self.L
        if want and (holder is None or not self.sim.share(rid, holder, want)):
            self.sim.reqs[rid].pages = None  # no resident holder of its blocks: hot
        if want and self.sim.resident(rid):
            self.counts["resident_joins"] += 1
            self.counts["page_shares"] += want >= 64  # whole pages referenced, not only copied
        self.counts["add"] += 1
        self.counts["hit_tokens"] += want
        if want and any(v >= self.model.NB for v in self.model.reqs[rid].ids):
            self.counts["alias_maps"] += 1
        if given and self.model.short:
            self.counts["ids_short"] += 1

    def _holder(self, rid: int) -> int | None:
        """The resident request (lowest slot) whose published leading blocks are the
        cached blocks ``rid`` just mapped, when the cache shares prefix pages."""
        if not (self.cfg.share_prefix_pages and self.sim.pool_pages):
            return None
        model = self.model
        q = model.reqs[rid]
        want = [model.host(v) for v in q.ids]
        n = len(want)
        for x in sorted(model.reqs.values(), key=lambda x: x.slot):
            if x.rid == rid or x.rid not in self.sim.reqs or not self.sim.resident(x.rid) or x.done < n:
                continue
            if [x.held.get(i, model.host(x.ids[i])) for i in range(n)] == want:
                return x.rid
        return None

    def op_bad_add(self) -> None:
        rid = self._free_id()
        bad = self.rng.choice([[1, -1], [2**32], [[1, 2], [3, 4]], [1.5, 2.0], np.array([[1]])])
        before = prefix_snapshot(self.cache)
        want = CapacityError if len(self.model.reqs) >= self.R else ValueError
        try:
            self.cache.add_request(rid, bad)
        except want:
            pass
        else:
            _fail(f"add_request with token_ids={bad!r} did not raise {want.__name__}")
        assert_same(before, prefix_snapshot(self.cache))
        try:
            self.cache.add_request(rid, [1, 2], salt="not bytes")
        except (TypeError, CapacityError) as e:
            assert isinstance(e, CapacityError) == (len(self.model.reqs) >= self.R)
        else:
            _fail("add_request with a str salt did not raise")
        assert_same(before, prefix_snapshot(self.cache))
        if not self.model.reqs:
            return
        live = self._live()[0]
        with_err = (ValueError, "already live")
        try:
            self.cache.add_request(live, [1, 2, 3])
        except with_err[0] as e:
            assert with_err[1] in str(e)
        else:
            _fail("add_request of a live id did not raise")
        assert_same(before, prefix_snapshot(self.cache))
        self.counts["bad_add"] += 1

    def _write(self, layers, items: list[tuple[int, int]], rows_of, *, step: bool = False) -> bool:
        """Append ``items`` ((rid, n)) to ``layers`` one layer at a time (or as one
        prepared step); False (and nothing changed) on CapacityError."""
        cache, model = self.cache, self.model
        layers = list(layers)
        ok = model.can_write([(rid, model.reqs[rid].lens[layers[0]] + n) for rid, n in items])
        rids = [rid for rid, _ in items]
        counts = [n for _, n in items]
        before = prefix_snapshot(cache) if not ok else None
        try:
            if step:
                plan = cache.prepare_step(cache.plan_write(rids, counts))
            for i, l in enumerate(layers):
                rows = torch.cat([rows_of(rid, l) for rid in rids]) if rids else None
                if step:
                    cache.write_step(l, plan, rows)
                    firsts = None
                else:
                    firsts = cache.write(l, cache.plan_write(rids, counts), rows)
                if firsts is not None:
                    want = [model.reqs[rid].lens[l] for rid in rids]
                    if firsts != want:
                        _fail(f"write of layer {l} returned first positions {firsts}, model {want}")
                if not step:
                    model.write([l], items)
                    self.sim.write([l], items)
                    if i == 0:
                        ok = True  # the blocks are allocated: the other layers need none
        except CapacityError:
            if ok:
                raise
            assert_same(before, prefix_snapshot(cache))
            self.counts["write_refused"] += 1
            others = [rid for rid in self._live() if rid not in rids]
            if others and self.rng.random() < 0.7:  # preempt another request
                self._free(self.rng.choice(others))
            return False
        if not ok:
            _fail(f"a write of {items} needing more than free + evictable blocks succeeded")
        if step:
            model.write(layers, items)
            self.sim.write(layers, items)
        return True

    def op_prefill(self) -> None:
        rng, model = self.rng, self.model
        todo = [rid for rid in self._live() if min(model.reqs[rid].lens) < len(model.reqs[rid].tokens)]
        if not todo:
            return
        rid = rng.choice(todo)
        q = model.reqs[rid]
        n = len(q.tokens)
        end = rng.choice([n, n, rng.randint(min(q.lens) + 1, n)])  # chunked sometimes
        layers = list(range(self.L)) if rng.random() < 0.8 else [rng.randrange(self.L)]
        for l in layers:
            p0 = q.lens[l]
            if p0 >= end:
                continue
            if not self._write([l], [(rid, end - p0)], lambda r, layer, p0=p0: self._rows(r, layer, p0, end)):
                return
        self.counts["prefill"] += 1

    def op_decode(self, step: bool = False) -> None:
        """One new token for some requests whose every layer holds all their tokens:
        write its row to every layer, resolving each layer after its write."""
        rng, model = self.rng, self.model
        ready = [rid for rid in self._live() if set(model.reqs[rid].lens) == {len(model.reqs[rid].tokens)}]
        if not ready:
            return
        rids = rng.sample(ready, rng.randint(1, len(ready)))
        for rid in rids:
            model.reqs[rid].rows.extend(self._toks(1))
        pos = {rid: len(model.reqs[rid].tokens) - 1 for rid in rids}
        items = [(rid, 1) for rid in rids]
        rows_of = lambda r, layer: self._rows(r, layer, pos[r], pos[r] + 1)
        if step:
            if not self._write(range(self.L), items, rows_of, step=True):
                for rid in rids:
                    model.reqs[rid].rows.pop()
                return
            for l in range(self.L):
                self._resolve(l, rids)
        else:
            for l in range(self.L):
                if not self._write([l], items, rows_of):
                    assert l == 0
                    for rid in rids:
                        model.reqs[rid].rows.pop()
                    return
                self._resolve(l, rids)
        self.counts["decode_step" if step else "decode"] += 1

    def op_give(self) -> None:
        """``add_tokens``: tell the cache some of a request's tokens it does not know
        (decode output, a continuation's prompt)."""
        model = self.model
        todo = [rid for rid in self._live() if model.reqs[rid].given < len(model.reqs[rid].tokens)]
        if not todo:
            return
        rid = self.rng.choice(todo)
        q = model.reqs[rid]
        k = self.rng.randint(1, len(q.tokens) - q.given)
        got = self.cache.add_tokens(rid, q.tokens[q.given:q.given + k])
        want = model.give(rid, k)
        if got != want:
            _fail(f"add_tokens returned {got} known tokens, model {want}")
        self.counts["give"] += 1

    def op_extend(self) -> None:
        """A next turn in the same request: new prompt tokens, told now or later."""
        live = self._live()
        if not live:
            return
        rid = self.rng.choice(live)
        q = self.model.reqs[rid]
        new = self._toks(self.rng.randint(1, self.B + 1))
        q.rows.extend(new)
        if q.given == len(q.tokens) - len(new) and self.rng.random() < 0.5:
            self.cache.add_tokens(rid, new)
            self.model.give(rid, len(new))
        self.counts["extend"] += 1

    def _resolve(self, layer: int, rids: list[int]) -> None:
        rng, K, model = self.rng, self.K, self.model
        rng.shuffle(rids)
        topk = []
        for rid in rids:
            n = model.reqs[rid].lens[layer]
            row = [rng.randrange(n) if n and rng.random() < 0.85 else -1 for _ in range(K)]
            if n and rng.random() < 0.5:  # the newest and a cached position, as attention would
                row[0] = n - 1
            topk.append(row)
        dev = self.cache.device
        res = self.cache.resolve(layer, torch.tensor(rids, dtype=torch.int32, device=dev),
                                 torch.tensor(topk, dtype=torch.int32, device=dev))
        self.sim.resolve(layer, rids, topk)
        phys = res.physical.cpu()
        tk = torch.tensor(topk, dtype=torch.int64)
        hot = self.cache.hot[layer].cpu()
        st = _cpu_state(self.cache)
        n_rows = 0
        for t, rid in enumerate(rids):
            q = model.reqs[rid]
            r = q.slot
            valid = tk[t] >= 0
            if (phys[t][~valid] != -1).any():
                _fail(f"padding entries of request {rid} resolved to {phys[t][~valid].tolist()}")
            x, p = phys[t][valid].long(), tk[t][valid]
            if not x.numel():
                continue
            if not int(st["resident"][r]):  # else: the elastic tier's pages (bytes checked below)
                if ((x < r * self.SP) | (x >= (r + 1) * self.SP)).any():
                    _fail(f"request {rid}: physical rows {x.tolist()} outside its slots")
                held = st["slot_pos"][layer, r, x - r * self.SP].long()
                if not torch.equal(held, p):
                    _fail(f"request {rid}: positions {p.tolist()} resolved to slots holding {held.tolist()}")
            want = q.rows.get(layer, 0, q.lens[layer])[p]
            if not torch.equal(hot[x], want):
                bad = [(int(pp), int(xx)) for pp, xx, a, b in zip(p, x, hot[x], want) if not torch.equal(a, b)]
                _fail(f"layer {layer} request {rid}: resolved hot rows of (position, physical) {bad[:6]} "
                      f"({len(bad)} of {len(p)}) differ from the expected rows")
            n_rows += x.numel()
        self.counts["resolve"] += 1
        self.counts["resolved_rows"] += n_rows

    def op_resolve(self) -> None:
        live = self._live()
        if not live:
            return
        rids = self.rng.sample(live, self.rng.randint(1, len(live)))
        self._resolve(self.rng.randrange(self.L), rids)

    def op_free(self) -> None:
        live = self._live()
        if live:
            self._free(self.rng.choice(live))

    def _free(self, rid: int) -> None:
        q = self.model.reqs[rid]
        self.history.append((list(q.tokens[:q.given]) + (list(q.tokens[q.given:]) if self.rng.random() < 0.7
                                                         else []), q.salt))
        self.history = self.history[-8:]
        self.cache.free_request(rid)
        self.model.free_req(rid)
        self.sim.free(rid)
        self.counts["free"] += 1

    def op_reset(self) -> None:
        got = self.cache.reset_prefix_cache()
        want = self.model.reset()
        if got != want:
            _fail(f"reset_prefix_cache dropped {got}, model {want}")
        self.counts["reset"] += 1

    def op_stats(self) -> None:
        tot = self.cache.stats()["total"]
        self.model.publish_all()
        want = self.model.stats()
        got = {k: tot[k] for k in want}
        if got != want:
            _fail(f"prefix stats {got}, model {want}")
        held = collections.Counter(p for q in self.sim.reqs.values() if q.pages for p in q.pages)
        shared = sum(n > 1 for n in held.values())
        if (tot["pool_pages_shared"], tot["prefix_resident_joins"]) != (shared, self.counts["resident_joins"]):
            _fail(f"(pool_pages_shared, prefix_resident_joins) {(tot['pool_pages_shared'], tot['prefix_resident_joins'])}"
                  f", sim {(shared, self.counts['resident_joins'])}")
        self.counts["shared_pages_seen"] += shared
        self.counts["stats"] += 1

    OPS = [("add", 6), ("prefill", 6), ("decode", 6), ("decode_step", 2), ("give", 3), ("extend", 1),
           ("resolve", 3), ("free", 4), ("reset", 0.5), ("stats", 1), ("bad_add", 0.5)]

    def step(self) -> str:
        names, weights = zip(*self.OPS)
        weights = list(weights)
        if len(self.model.reqs) >= self.R:  # mostly finish one, sometimes be refused
            weights[names.index("add")] = 1
            weights[names.index("free")] = 8
        op = self.rng.choices(names, weights)[0]
        if op == "decode_step":
            self.op_decode(step=True)
        else:
            getattr(self, "op_" + op)()
        self.n_ops += 1
        self.check(full=self.n_ops % self.full_every == 0)
        return op

    def run(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def finish(self) -> None:
        """Free everything and reset: the pool, the index and the hot tables are empty."""
        for rid in self._live():
            self.cache.free_request(rid)
            self.model.free_req(rid)
            self.sim.free(rid)
        self.check(full=True)
        assert self.cache.reset_prefix_cache() == self.model.reset()
        self.check(full=True)
        cache = self.cache
        alloc = cache.pool.allocator
        ix = cache.prefix.index
        assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks, (alloc.num_used, alloc.num_free)
        assert alloc.owners() == [] and alloc.aliases_free == self.cfg.prefix_alias_blocks
        assert ix.cached == 0 and ix.evictable == 0 and ix.referenced() == 0 and ix.ref_counts() == {}
        st = _cpu_state(cache)
        assert (st["row_slot"] == -1).all() and (st["slot_pos"] == -1).all() and (st["seq_lens"] == 0).all()
        assert (st["block_table"] == -1).all() and (st["id_to_slot"] == -1).all()
        assert cache.stats()["host_pool"]["blocks_used"] == 0

    # ---- checks -----------------------------------------------------------------
    def check(self, full: bool = True) -> None:
        cache, model = self.cache, self.model
        alloc, ix = cache.pool.allocator, cache.prefix.index
        NB = model.NB
        if sorted(cache.live_requests()) != self._live():
            _fail(f"live {cache.live_requests()}, model {self._live()}")
        # the allocator
        if sorted(alloc._free) != sorted(model.free):
            _fail(f"free blocks {sorted(alloc._free)}, model {sorted(model.free)}")
        if alloc.num_used != NB - len(model.free) or alloc.num_free != len(model.free) + len(model.lru):
            _fail(f"num_used {alloc.num_used} / num_free {alloc.num_free}, model "
                  f"{NB - len(model.free)} / {len(model.free) + len(model.lru)}")
        if alloc.aliases_free != len(model.aliases):
            _fail(f"{alloc.aliases_free} free alias ids, model {len(model.aliases)}")
        for rid, q in model.reqs.items():
            if cache.request(rid).slot != q.slot:
                _fail(f"request {rid} in slot {cache.request(rid).slot}, model {q.slot}")
            if alloc.blocks(q.slot) != q.ids:
                _fail(f"request {rid}: block ids {alloc.blocks(q.slot)}, model {q.ids}")
            hb = [model.host(v) for v in q.ids]
            if alloc.host_blocks(q.slot).tolist() != hb:
                _fail(f"request {rid}: host blocks {alloc.host_blocks(q.slot).tolist()}, model {hb}")
            if list(cache.request(rid).lengths) != q.lens:
                _fail(f"request {rid}: lengths {cache.request(rid).lengths}, model {q.lens}")
        # the index
        if set(ix._name_of) != set(model.name_of):
            _fail(f"cached blocks {sorted(ix._name_of)}, model {sorted(model.name_of)}")
        if ix.ref_counts() != model.refs:
            _fail(f"references {ix.ref_counts()}, model {model.refs}")
        if ix.peek_evict(len(model.lru) + 1) != list(model.lru) or ix.evictable != len(model.lru):
            _fail(f"evictable (LRU order) {ix.peek_evict(10**9)}, model {list(model.lru)}")
        ix.check()  # a cached block's parent is cached
        if ix.evictions != model.evictions:
            _fail(f"evictions {ix.evictions}, model {model.evictions}")
        if ix.referenced() != sum(model.refs.values()):
            _fail("referenced() disagrees with the per-block references")
        if not full:
            return
        self._check_device()
        _check_sim(cache, self.sim, _cpu_state(cache), {rid: q.slot for rid, q in model.reqs.items()})

    def _check_device(self) -> None:
        cache, model, B, L, SP = self.cache, self.model, self.B, self.L, self.SP
        st = _cpu_state(cache)
        host_block = cache.state.host_block.cpu()
        hot = cache.hot.cpu()
        pool = cache.pool.rows
        R = self.R
        live_slots = {q.slot for q in model.reqs.values()}
        w = cache.writer
        for rid, q in model.reqs.items():
            r = q.slot
            bt = st["block_table"][r].tolist()
            if bt[:len(q.ids)] != q.ids or any(v != -1 for v in bt[len(q.ids):]):
                _fail(f"block_table[{r}] = {bt}, model ids {q.ids}")
            if int(w.num_blocks[r]) != len(q.ids) or w.host_blocks[r, :len(q.ids)].tolist() != q.ids:
                _fail(f"writer's block table of slot {r}: {w.host_blocks[r].tolist()}, model {q.ids}")
            for v in q.ids:
                if int(host_block[v]) != model.host(v):
                    _fail(f"host_block[{v}] = {int(host_block[v])}, model {model.host(v)}")
            if st["seq_lens"][:, r].tolist() != q.lens:
                _fail(f"seq_lens[:, {r}] = {st['seq_lens'][:, r].tolist()}, model {q.lens}")
        for r in range(R):
            if r in live_slots:
                continue
            if ((st["seq_lens"][:, r] != 0).any() or (st["block_table"][r] != -1).any()
                    or (st["slot_pos"][:, r] != -1).any() or (st["slot_stamp"][:, r] != -1).any()
                    or (st["step"][:, r] != 0).any() or int(w.num_blocks[r]) != 0):
                _fail(f"free request slot {r} holds stale state")
        # row_slot by row key <-> slot_pos, every hot row and every host row byte-exact
        for l in range(L):
            rs = st["row_slot"][l]
            mapped = 0
            for rid, q in model.reqs.items():
                r = q.slot
                pos = st["slot_pos"][l, r]
                occ = torch.nonzero(pos >= 0).flatten()
                mapped += occ.numel()
                if occ.numel():
                    p = pos[occ].long()
                    if int(p.max()) >= q.lens[l]:
                        _fail(f"({l}, {rid}): a slot holds position {int(p.max())} >= length {q.lens[l]}")
                    ids = torch.tensor(q.ids, dtype=torch.long)
                    keys = ids[p // B] * B + p % B
                    if not torch.equal(rs[keys].long(), occ):
                        _fail(f"({l}, {rid}): row_slot at its row keys {rs[keys].tolist()}, slots {occ.tolist()}")
                    want = q.rows.get(l, 0, q.lens[l])[p]
                    if not torch.equal(hot[l, r * SP + occ], want):
                        bad = [(int(s), int(pp)) for s, pp, a, b in zip(occ, p, hot[l, r * SP + occ], want)
                               if not torch.equal(a, b)]
                        _fail(f"({l}, {rid}): hot rows (slot, position) {bad[:6]} differ from the expected rows")
                n = q.lens[l]
                if n:
                    pp = torch.arange(n)
                    hb = torch.tensor([model.host(v) for v in q.ids], dtype=torch.long)
                    if not torch.equal(pool[l, hb[pp // B] * B + pp % B], q.rows.get(l, 0, n)):
                        _fail(f"({l}, {rid}): host rows differ from the expected rows")
                    if int(st["resident"][r]):  # its page rows (shared prefix pages included)
                        pt = st["page_table"][r].long()
                        phys = self.cfg.hot_rows_per_layer + pt[pp // 64] * 64 + pp % 64
                        if not torch.equal(hot[l, phys], q.rows.get(l, 0, n)):
                            _fail(f"({l}, {rid}): resident page rows differ from the expected rows")
            if int((rs >= 0).sum()) != mapped:
                _fail(f"layer {l}: {int((rs >= 0).sum())} row_slot entries, {mapped} occupied slots")
        # every cached block holds the rows of its name, in every layer (each checked once
        # it is no longer referenced: a referenced one is a live request's, checked above)
        for b, keys in model.keys_of.items():
            if b in model.refs or (b, keys[-1]) in self._checked:
                continue
            self._checked.add((b, keys[-1]))
            for l in range(L):
                want = torch.frombuffer(bytearray(b"".join(content(k, l, self.cfg.row_bytes) for k in keys)),
                                        dtype=torch.uint8).view(B, -1)
                if not torch.equal(pool[l, b * B:(b + 1) * B], want):
                    _fail(f"cached block {b} layer {l}: host rows differ from its name's rows")


__all__ = ["PrefixTrace", "prefix_snapshot"]
