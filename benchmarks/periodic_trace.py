"""A periodic decode trace with an exact steady miss rate, for ``bench_layer --trace periodic``.

Every step each request selects K positions: a fixed core of ``round(hit K)`` positions
(drawn once among its first S, which its hot buffer holds from the start) and
``K - round(hit K)`` fresh ones taken in turn from a per-request cycle over the other
positions [S, ctx - 1). A fresh position comes back only after the cycle has gone round
once, by which time the LRU (S slots, the core touched every step) has evicted it, so
once the first S slots have been cycled through every step misses exactly its fresh
entries: the steady miss rate is (K - round(hit K)) / K, with no block locality and no
state restored between steps (the cache's LRU state runs on, as in an engine).

``PeriodicTrace.step(t)`` is step t's top-k; ``warmup_steps`` the steps before the
steady state; :func:`run_steps` feeds a function one step after another through a fixed
input buffer (a CUDA graph replays over it) and counts the misses of the timed steps.
"""

from __future__ import annotations

import math

import torch

from benchmarks import common


class PeriodicTrace:
    """Top-k of B requests with ``ctx`` rows each (see the module docstring)."""

    def __init__(self, B: int, K: int, S: int, ctx: int, hit: float, seed: int, device: torch.device) -> None:
        cold = ctx - 1 - S  # [S, ctx - 1): the last position stays out, as bench_layer's other trace
        if cold < S + K:
            raise ValueError(f"a periodic trace needs ctx - 1 - S >= S + K so that a fresh position is "
                             f"evicted before it comes back; got ctx {ctx}, S {S}, K {K}")
        self.B, self.K, self.S, self.device = B, K, S, device
        self.core_n = round(hit * K)
        self.fresh_n = K - self.core_n
        g = torch.Generator().manual_seed(seed)
        self.core = torch.stack([torch.randperm(S, generator=g)[:self.core_n] for _ in range(B)])  # int64 [B, core_n]
        self.cycle = torch.stack([S + torch.randperm(cold, generator=g) for _ in range(B)])  # int64 [B, cold]
        self.order = torch.stack([torch.randperm(K, generator=g) for _ in range(B)])  # int64 [B, K]
        self.cold = cold

    @property
    def miss_rate(self) -> float:
        """The steady miss rate: fresh entries over K."""
        return self.fresh_n / self.K

    @property
    def warmup_steps(self) -> int:
        """Steps after which every fresh entry misses and every core entry hits: the hot
        buffer's S slots cycled through once by fresh rows, plus one."""
        return 1 if self.fresh_n == 0 else math.ceil(self.S / self.fresh_n) + 1

    def step(self, t: int) -> torch.Tensor:
        """int32 [B, K] on the trace's device: step t's positions, in a fixed shuffled order."""
        m = self.fresh_n
        idx = (t * m + torch.arange(m)) % self.cold  # int64 [m]
        fresh = self.cycle[:, idx]  # int64 [B, m]
        row = torch.cat([self.core, fresh], dim=1)
        return torch.gather(row, 1, self.order).to(device=self.device, dtype=torch.int32)


def run_steps(fn, trace: PeriodicTrace, buf: torch.Tensor, t0: int, *, warmup: int, reps: int, flush,
              cache=None, cuda: bool, eager: bool = False) -> tuple[dict, object, int, float | None]:
    """Run ``fn()`` over steps t0, t0 + 1, ... of ``trace`` written into ``buf`` (int32
    [B, K], which ``fn`` reads): on CUDA captured in a graph (``common.capture``) and
    replayed, or with ``eager`` called as it is and timed as GPU time (a sleep kernel
    queued ahead of the start event hides the host's enqueueing), else (CPU) eagerly;
    ``warmup`` steps untimed, then ``reps`` timed (``flush()`` before each). Returns (stats of the timed steps, the last output, the
    next step index, the misses / lookups of the timed steps counted by ``cache``'s layer
    0 counters, or None without a cache)."""
    t = [t0]

    def before():
        buf.copy_(trace.step(t[0]))
        t[0] += 1
        flush()

    if cuda and not eager:  # the capture's own replay runs a step too: one more warm-up step
        g, out = common.capture(fn, before)
        call = g.replay
    else:
        out, call = None, fn
    for _ in range(warmup):
        before()
        call()
    h0, m0 = _counts(cache)
    samples = common.time_calls(call, reps=reps, warmup=0, cuda=cuda, before=before, gpu_sleep=cuda and eager)
    if not cuda or eager:  # the output of one more eager step
        before()
        out = fn()
    h1, m1 = _counts(cache)
    looked = (h1 - h0) + (m1 - m0)
    rate = (m1 - m0) / looked if cache is not None and looked else None
    return common.stats(samples, unit="_us"), out, t[0], rate


def _counts(cache) -> tuple[int, int]:
    """(hits, misses) of layer 0 so far (a host sync); (0, 0) without a cache."""
    if cache is None:
        return 0, 0
    d = cache.stats()["layers"][0]
    return int(d["hits"]), int(d["misses"])


__all__ = ["PeriodicTrace", "run_steps"]
