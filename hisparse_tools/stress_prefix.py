"""``hisparse stress --shared-prefix P [--prefix-groups G]``: prefix caching under the
stress tool (``HiSparseConfig(prefix_caching=True)``, ``hisparse.cache.prefix``).

Requests carry token ids (:class:`PrefixSchedule`). A fresh request belongs to one of
G groups: its prompt is the group's P shared tokens plus tokens of its own (the prompt
lengths are drawn from [context_min, context] as without the option). A joining
request is instead, with probability ``FOLLOWUP`` when one fits, a *follow-up turn*
of a request that left: its prompt is that request's tokens (prompt and the tokens it
generated) plus a new user turn of 1 .. 2 x block_size tokens. Past its prompt a
request generates tokens of its own, one per decode step, told to the cache with
``add_tokens`` as they are appended, so that a follow-up finds them.

A request joins with ``add_request(rid, token_ids=prompt)``; the cache answers how many
leading tokens are cached already, and only the rows past them are prefilled (the rows
the engine was told not to compute: ``prefill_rows_saved``). Row bytes are a
deterministic function of (seed, layer, token ids up to the position, position): the
verification's expected bytes come from a 32-bit polynomial hash of the token prefix
(:func:`prefix_keys`) in place of the request instance of a plain run, so two requests
that share a prefix expect the same rows there and every verified row (hot and host
copy) checks the sharing. The Belady bound is not computed: it models a request that
appended its own rows, and a cached prefix starts on the host only (or, with
``--pool-rows``, on another request's device pages).

The host pool holds every live request's longest context, as without the option, so a
run that churns fills it with cached blocks of requests that left and then evicts them
(``prefix_evictions``). At the end every live request is freed and
``reset_prefix_cache()`` called: a host block still used then fails the run.

Result ``prefix`` (JSON; the text table says the same): shared_prefix, groups, joins,
followups, joins_with_hit, query_tokens, hit_tokens, hit_rate (hit / query tokens),
followup_hit_tokens, prefill_rows_saved (cached tokens x layers), host_rows_unshared_peak
(rows per layer the live requests would hold owning their rows), host_rows_peak (the
distinct host rows they held), host_rows_saved (the two peaks' difference),
host_rows_saved_mean (per step), cached_blocks, shared_blocks (at the end of the steps),
shared_blocks_peak, evictions, alias_blocks (``prefix_alias_blocks``), resident_joins
(joins resident on another request's device prefix pages, ``--pool-rows``),
shared_pages_peak (device pool pages several requests shared), drained (no host
block used after every request left and the reset), blocks_used_after_reset; per_step
gains host_rows_unshared, host_rows (and prefix_hit_rate, cumulative).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from .report import table
from .workload import Schedule, StressOptions

FOLLOWUP = 0.5  # probability that a joining request continues a conversation that left
_M = 0x9E3779B1  # odd: invertible mod 2**32
_MASK = np.uint64(0xFFFFFFFF)


def prefix_keys(tokens: np.ndarray) -> np.ndarray:
    """int64 [n]: key[p] = sum_{i <= p} tokens[i] x M^(p - i) mod 2**32, a hash of the
    token prefix up to p (vectorised: M^p x cumsum(tokens[i] x M^-i), in uint64 arithmetic,
    which wraps mod 2**64 and so keeps every product exact mod 2**32)."""
    n = tokens.shape[0]
    if n == 0:
        return np.zeros(0, np.int64)
    inv = pow(_M, -1, 2**32)
    with np.errstate(over="ignore"):
        pw = np.cumprod(np.full(n, _M, np.uint64)) & _MASK  # M^(i+1)
        pwi = np.cumprod(np.full(n, inv, np.uint64)) & _MASK  # M^-(i+1)
        s = np.cumsum((tokens.astype(np.uint64) * pwi) & _MASK) & _MASK
        return ((s * pw) & _MASK).astype(np.int64)


class PrefixSchedule(Schedule):
    """:class:`~hisparse_tools.workload.Schedule` whose requests have token ids: fresh
    prompts in groups sharing ``shared_prefix`` tokens, and follow-up turns of requests
    that left (see the module docstring). ``tokens[rid]``: uint32 [max_len], every token
    the request can reach; ``prompt[rid]``: its prompt length."""

    def __init__(self, o: StressOptions, max_request_id: int, max_len: int) -> None:
        super().__init__(o, max_request_id)
        self.max_len = max_len
        g = np.random.default_rng(o.seed + 5)
        self.prefixes = [self._draw(g, o.shared_prefix) for _ in range(o.groups_used)]
        self.tokens: dict[int, np.ndarray] = {}
        self.prompt: dict[int, int] = {}
        self.kind: dict[int, str] = {}  # "fresh" | "followup"
        self.parents: collections.deque[np.ndarray] = collections.deque(maxlen=max(o.num_requests, 1))
        self.followups = 0

    @staticmethod
    def _draw(rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(1, 2**31, n, dtype=np.int64).astype(np.uint32)

    def _join(self, busy: set[int]) -> None:
        o, B = self.o, self.o.block_size
        rid = min(set(range(len(busy) + 1)) - busy)
        busy.add(rid)
        turn = int(self.rng.integers(1, 2 * B + 1))
        fits = [i for i, p in enumerate(self.parents) if p.size + turn <= o.context]
        if fits and self.rng.random() < FOLLOWUP:
            i = fits[int(self.rng.integers(len(fits)))]
            parent = self.parents[i]
            del self.parents[i]  # a conversation goes on in one follow-up
            prompt = np.concatenate([parent, self._draw(self.rng, turn)])
            self.kind[rid] = "followup"
            self.followups += 1
        else:
            grp = int(self.rng.integers(len(self.prefixes)))
            n0 = int(self.rng.integers(self.cmin, o.context + 1))
            prompt = np.concatenate([self.prefixes[grp], self._draw(self.rng, n0 - o.shared_prefix)])
            self.kind[rid] = "fresh"
        self.prompt[rid] = prompt.size
        self.tokens[rid] = np.concatenate([prompt, self._draw(self.rng, self.max_len - prompt.size)])
        self.live[rid] = prompt.size - 1

    def _leave(self, rid: int) -> None:
        self.parents.append(self.tokens[rid][:self.live.pop(rid)])  # its rows: prompt + output


class PrefixKeys:
    """The rows' keys on the run's device: one row of ``buf`` (int64 [live_max, max_len])
    per live request holds :func:`prefix_keys` of its tokens; ``kmap[instance]`` is that
    row, so the verifier maps (request instance, position) to a key."""

    def __init__(self, live_max: int, max_len: int, device: torch.device) -> None:
        self.buf = torch.zeros(live_max, max_len, dtype=torch.int64, device=device)
        self.free = list(range(live_max - 1, -1, -1))
        self.row_of: dict[int, int] = {}
        self.kmap = torch.full((64,), -1, dtype=torch.int64, device=device)

    def join(self, rid: int, inst: int, tokens: np.ndarray) -> None:
        row = self.free.pop()
        self.row_of[rid] = row
        self.buf[row] = torch.from_numpy(prefix_keys(tokens)).to(self.buf.device)
        if inst >= self.kmap.numel():
            grow = torch.full((max(2 * self.kmap.numel(), inst + 1),), -1, dtype=torch.int64, device=self.buf.device)
            grow[:self.kmap.numel()] = self.kmap
            self.kmap = grow
        self.kmap[inst] = row

    def leave(self, rid: int) -> None:
        self.free.append(self.row_of.pop(rid))

    def keys(self, inst: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.buf[self.kmap[inst.long()], pos.long()]


class PrefixRun:
    """The stress run's prefix-caching parts: a mixin of ``stress.StressRun``, which
    provides ``o``, ``cfg``, ``L``, ``dev``, ``live_max``, ``max_len`` and ``schedule``
    (a :class:`PrefixSchedule` when ``o.shared_prefix`` is set)."""

    def _prefix_begin(self) -> None:
        self.keys = PrefixKeys(self.live_max, self.max_len, self.dev) if self.o.shared_prefix else None
        self._given: dict[int, int] = {}  # rid -> tokens told to the cache
        self._px = collections.Counter()
        self._px_steps: dict[str, list] = {"host_rows_unshared": [], "host_rows": [], "prefix_hit_rate": []}
        self._shared_peak = 0
        self._pages_peak = 0  # device pool pages several resident requests share, peak

    def _admit(self, cache, rid: int, inst: int) -> int:
        """Add a joining request; returns its cached tokens (0 without --shared-prefix)."""
        if self.keys is None:
            cache.add_request(rid)
            return 0
        sch = self.schedule
        n0 = sch.prompt[rid]
        cached = cache.add_request(rid, token_ids=sch.tokens[rid][:n0])
        self.keys.join(rid, inst, sch.tokens[rid])
        self._given[rid] = n0
        px = self._px
        px["joins"] += 1
        px["joins_with_hit"] += int(cached > 0)
        px["prefill_tokens_saved"] += cached
        if sch.kind[rid] == "followup":
            px["followups"] += 1
            px["followup_hit_tokens"] += cached
        return cached

    def _leave(self, rid: int) -> None:
        if self.keys is not None:
            self.keys.leave(rid)
            self._given.pop(rid, None)

    def _prefix_step(self, cache, ids: np.ndarray, lens: np.ndarray) -> None:
        """After a step's appends: the generated tokens appended go to ``add_tokens``; the
        host rows the live requests map, counted per mapping and distinct."""
        if self.keys is None:
            return
        sch, B = self.schedule, self.cfg.host_block_size
        alloc = cache.pool.allocator
        blocks = []
        for rid, n in zip(ids.tolist(), lens.tolist()):
            if n > self._given[rid]:
                cache.add_tokens(rid, sch.tokens[rid][self._given[rid]:n])
                self._given[rid] = n
            blocks.append(alloc.host_blocks(cache.request(rid).slot))
        allb = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
        self._px_steps["host_rows_unshared"].append(int(allb.size) * B)
        self._px_steps["host_rows"].append(int(np.unique(allb).size) * B)

    def _prefix_note(self, total: dict[str, Any]) -> str:
        """The progress bar's prefix figures (and the per-step hit rate and shared peak)."""
        if self.keys is None:
            return ""
        q = total["prefix_query_tokens"]
        rate = total["prefix_hit_tokens"] / q if q else 0.0
        self._px_steps["prefix_hit_rate"].append(rate)
        self._shared_peak = max(self._shared_peak, total["shared_blocks"])
        self._pages_peak = max(self._pages_peak, total["pool_pages_shared"])
        return f" prefix hit {rate:.3f} evictions {total['prefix_evictions']}"

    def _prefix_end(self, cache, live: dict, stats: dict[str, Any], *, check: bool) -> tuple[dict, list[str]]:
        """The ``prefix`` report from the last step's ``stats``; then every live request
        leaves, ``reset_prefix_cache()`` runs and (``check``) no host block may stay used."""
        t, px, ps = stats["total"], self._px, self._px_steps
        for rid in list(live):
            cache.free_request(rid)
            self._leave(rid)
        live.clear()
        cache.reset_prefix_cache()
        after = cache.stats()
        used = after["host_pool"]["blocks_used"]
        fails = []
        if check and (used or after["total"]["cached_blocks"] or after["live_requests"]):
            fails.append(f"--shared-prefix: after every request left and reset_prefix_cache(), {used} host "
                         f"block(s) are still used ({after['total']['cached_blocks']} cached, "
                         f"{after['live_requests']} live request(s)); the pool should be empty")
        un, sh = ps["host_rows_unshared"], ps["host_rows"]
        q = t["prefix_query_tokens"]
        report = {
            "shared_prefix": self.o.shared_prefix, "groups": self.o.groups_used,
            "joins": px["joins"], "followups": px["followups"], "joins_with_hit": px["joins_with_hit"],
            "query_tokens": q, "hit_tokens": t["prefix_hit_tokens"],
            "hit_rate": t["prefix_hit_tokens"] / q if q else 0.0,
            "followup_hit_tokens": px["followup_hit_tokens"],
            "prefill_rows_saved": px["prefill_tokens_saved"] * self.L,
            "host_rows_unshared_peak": max(un, default=0), "host_rows_peak": max(sh, default=0),
            "host_rows_saved": max(un, default=0) - max(sh, default=0),
            "host_rows_saved_mean": float(np.mean(np.subtract(un, sh))) if un else 0.0,
            "cached_blocks": t["cached_blocks"], "shared_blocks": t["shared_blocks"],
            "shared_blocks_peak": self._shared_peak, "evictions": t["prefix_evictions"],
            "alias_blocks": self.cfg.prefix_alias_blocks,
            "resident_joins": t["prefix_resident_joins"], "shared_pages_peak": self._pages_peak,
            "drained": not (used or after["total"]["cached_blocks"] or after["live_requests"]),
            "blocks_used_after_reset": used,
        }
        return report, fails


def format_prefix(r: dict[str, Any]) -> list[str]:
    """The text lines of a result's ``prefix`` section."""
    p = r["prefix"]
    pct = (lambda a, b: f"{100.0 * a / b:.1f}%" if b else "-")
    rows = [["prefix hit rate (hit / query tokens)", f"{p['hit_rate']:.4f}",
             f"{p['hit_tokens']} / {p['query_tokens']}"],
            ["joins with a hit", p["joins_with_hit"], f"of {p['joins']} ({p['followups']} follow-up turns, "
                                                      f"{p['followup_hit_tokens']} tokens hit)"],
            ["prefill rows saved", p["prefill_rows_saved"], "rows the run was told not to compute (all layers)"],
            ["host rows per layer, peak", p["host_rows_peak"],
             f"vs {p['host_rows_unshared_peak']} owning their rows: {p['host_rows_saved']} saved "
             f"({pct(p['host_rows_saved'], p['host_rows_unshared_peak'])}); mean per step "
             f"{p['host_rows_saved_mean']:.0f}"],
            ["cached / shared blocks", f"{p['cached_blocks']} / {p['shared_blocks']}",
             f"at the last step; shared peak {p['shared_blocks_peak']}"],
            ["evictions", p["evictions"], f"cached blocks reused for new rows (alias ids {p['alias_blocks']})"]]
    if p.get("resident_joins") is not None and (p["resident_joins"] or p["shared_pages_peak"]):
        rows.append(["joins resident on shared pages", p["resident_joins"],
                     f"device pool pages shared, peak {p['shared_pages_peak']} (one device copy of a prefix)"])
    return [f"prefix caching: {p['groups']} group(s) sharing {p['shared_prefix']} tokens, follow-up turns", "",
            table(["", "value", ""], rows), "",
            "after every request left and reset_prefix_cache(): "
            + ("host pool empty" if p["drained"] else f"{p['blocks_used_after_reset']} host blocks STILL USED")]


__all__ = ["PrefixSchedule", "PrefixKeys", "PrefixRun", "prefix_keys", "format_prefix", "FOLLOWUP"]
