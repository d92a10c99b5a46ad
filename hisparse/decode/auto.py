"""``DecodeLayer(..., overlap="auto")``: run whichever of serial and split is faster, as measured.

Neither mode wins everywhere (BENCHMARKS.md, "One decode layer in a CUDA graph"): split
hides a staging copy that is shorter than the hit attention, and costs a second
attention and a merge where there is nothing to hide (every row hot) or more than the
attention can cover (the copy longer than it, at 80% hits). Where the two cross depends
on the batch, the hit rate, the backend and the GPU, and the hit rate is only known
after the resolve. So an auto layer measures instead of predicting.

Rule (``ModeChooser``), per key (layer, T):

- each call's GPU time is the time between CUDA events recorded on the current stream
  before and after it (the split layer's stage-stream work is joined before its end),
  read once both have completed (``Event.query``: never a host sync); on a CPU cache,
  whose calls are synchronous, ``perf_counter`` around the call;
- a mode's first ``warm`` calls of a key are not timed: they compile, load and (with
  ``graphs=True``) run eagerly and capture, so they say nothing of the steady cost
  (``warm`` = 2 with graphs, else 1);
- until each mode has ``MIN_SAMPLES`` timings (done or on the way) the modes
  alternate, split first; then, while some are still on the way (a host that runs
  far ahead of the GPU), the mode of the lower cost among the timings done runs
  untimed (the modes alternate until each has one done);
- then the mode with the lower cost runs -- a mode's cost is the lowest of its last
  ``WINDOW`` timings, since what disturbs a timing (host gaps while the call is
  enqueued, other work on the GPU) only ever adds to it; the other
  runs once every ``EXPLORE_EVERY`` calls of the key (so a change of the hit rate is
  noticed within a few dozen calls), and the chosen one is timed every
  ``SAMPLE_EVERY``-th call;
- while a stream is capturing (an engine capturing its step) nothing is timed and the
  mode chosen so far runs (the interim one while timings are on the way; split before
  each mode has a timing done): the graph keeps that mode;
- a call that captured a graph (``DecodeLayer(graphs=True)``: a new key, an evicted
  graph, an in-place one) is not timed, and neither is a call on the cache's resident
  path, where both modes run the same work (``DecodeLayer`` runs it untimed).

What it costs: two event records on a timed call (a few us of host time, none of GPU)
and, while it explores, one call in ``EXPLORE_EVERY`` in the slower mode. Both modes
leave the cache in the same state, bit for bit; their outputs differ within the
rounding of the split merge (``decode.layer``).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch

from .overlap import Overlap

MODES = (Overlap.SPLIT, Overlap.SERIAL)  # the order of the first calls
MIN_SAMPLES = 3  # timings of each mode before their costs decide
WINDOW = 8  # recent timings per mode whose lowest is its cost
EXPLORE_EVERY = 32  # calls of a key between two runs of the mode not chosen
SAMPLE_EVERY = 4  # the chosen mode is timed on every SAMPLE_EVERY-th call
MAX_PENDING = 8  # timings awaiting their events, per key (a GPU far behind: time fewer)


class _Key:
    """The timings and counters of one (layer, T)."""

    __slots__ = ("times", "pending", "calls", "runs")

    def __init__(self) -> None:
        self.times = {m: collections.deque(maxlen=WINDOW) for m in MODES}  # us, newest last
        self.pending: collections.deque = collections.deque()  # (mode, start event, end event)
        self.calls = 0
        self.runs = {m: 0 for m in MODES}

    def poll(self, free: list) -> None:
        """Move the timings whose events completed into ``times`` (oldest first; no
        sync), their events into ``free``."""
        while self.pending and self.pending[0][2].query():
            mode, start, end = self.pending.popleft()
            self.times[mode].append(start.elapsed_time(end) * 1e3)
            free += [start, end]

    def current(self) -> Overlap | None:
        """``best``, or while some timings are on the way, the mode of the lower cost
        among those done once each mode has one; else None."""
        best = self.best()
        if best is None and all(self.times[m] for m in MODES):
            return min(MODES, key=lambda m: min(self.times[m]))
        return best

    def best(self) -> Overlap | None:
        """The mode of the lower cost (its lowest recent timing), once each has
        MIN_SAMPLES timings; else None."""
        if any(len(self.times[m]) < MIN_SAMPLES for m in MODES):
            return None
        return min(MODES, key=lambda m: min(self.times[m]))

    def choose(self, warm: int) -> tuple[Overlap, bool]:
        """(the mode of the next call, whether to time it); a mode's first ``warm`` runs
        are not timed."""
        best = self.best()
        if best is None:  # alternate until both have their first timings
            have = {m: len(self.times[m]) + self._pending(m) for m in MODES}
            short = [m for m in MODES if have[m] < MIN_SAMPLES]
            if short:  # the fewest first, so that they alternate
                m = min(short, key=lambda m: (have[m], self.runs[m]))
                return m, self.runs[m] >= warm
            now = self.current()  # the rest on the way: the lower cost so far
            return (now if now is not None else MODES[self.calls % 2]), False
        if self.calls % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            m = Overlap.SERIAL if best is Overlap.SPLIT else Overlap.SPLIT
            return m, self.runs[m] >= warm
        return best, self.calls % SAMPLE_EVERY == 0 and self.runs[best] >= warm

    def _pending(self, mode: Overlap) -> int:
        return sum(1 for p in self.pending if p[0] is mode)


class ModeChooser:
    """The auto mode's timings and choices for one ``DecodeLayer`` (module docstring).
    ``device``: its cache's device (CUDA: events on that device's current stream; else
    ``clock``, seconds, around the call: ``time.perf_counter``); ``warm``: a mode's
    untimed first runs per key."""

    MIN_SAMPLES, EXPLORE_EVERY, SAMPLE_EVERY, WINDOW = MIN_SAMPLES, EXPLORE_EVERY, SAMPLE_EVERY, WINDOW  # the rule's

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter, warm: int = 1) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.clock = clock
        self.warm = warm  # untimed first runs of each mode per key
        self.keys: dict[tuple[int, int], _Key] = {}
        self._events: list = []  # completed timing events, reused

    def mode_now(self, layer: int, T: int) -> Overlap:
        """The mode a call of (layer, T) that may not be timed runs: the best so far
        (``_Key.current``: the interim one while timings are on the way; split before
        each mode has one done). Changes nothing."""
        k = self.keys.get((layer, T))
        now = k.current() if k is not None else None
        return now if now is not None else Overlap.SPLIT

    def run(self, layer: int, T: int, call: Callable[[Overlap], tuple], *, capturing: bool,
            steady: Callable[[], bool] | None = None) -> tuple:
        """``call(mode)`` in the mode chosen for (layer, T), timed as the rule says.
        ``steady()``, asked after the call, False: the call did one-off work (a graph
        capture), so its timing is dropped. A call that raises changes nothing here (no
        timing, no counter)."""
        if capturing:
            return call(self.mode_now(layer, T))
        k = self.keys.get((layer, T))
        if k is None:
            k = _Key()
        if self.cuda:
            k.poll(self._events)
        mode, timed = k.choose(self.warm)
        if timed and self.cuda and len(k.pending) >= MAX_PENDING:
            timed = False
        if not timed:
            out = call(mode)
        elif self.cuda:
            stream = torch.cuda.current_stream(self.device)  # the cache's device, whichever is current
            start, end = self._event(), self._event()
            start.record(stream)
            try:
                out = call(mode)
            except BaseException:
                self._events += [start, end]
                raise
            if steady is None or steady():
                end.record(stream)
                k.pending.append((mode, start, end))
            else:
                self._events += [start, end]
        else:
            t0 = self.clock()
            out = call(mode)
            t1 = self.clock()
            if steady is None or steady():
                k.times[mode].append((t1 - t0) * 1e6)
        self.keys[(layer, T)] = k
        k.calls += 1
        k.runs[mode] += 1
        return out

    def _event(self):
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def report(self) -> dict:
        """Per "layer/T": the mode chosen now (None until both modes are timed), each
        mode's cost (the lowest of its recent timings, us) and the calls that ran each mode."""
        out = {}
        for (layer, T), k in sorted(self.keys.items()):
            if self.cuda:
                k.poll(self._events)
            out[f"{layer}/{T}"] = {
                "chosen": (lambda b: b.value if b is not None else None)(k.best()),
                "cost_us": {m.value: (min(k.times[m]) if k.times[m] else None) for m in MODES},
                "runs": {m.value: k.runs[m] for m in MODES},
            }
        return out


__all__ = ["ModeChooser", "MIN_SAMPLES", "WINDOW", "EXPLORE_EVERY", "SAMPLE_EVERY"]
