"""The stress workload, shared by ``stress`` (which drives the real cache with it) and
``whatif`` (which only simulates it): :class:`StressOptions`, the knobs of a run,
:class:`Schedule`, the synthetic join/leave schedule, and :class:`RampSchedule`, the
load ramp of ``stress --ramp`` (requests join until the device pool overflows, then
leave). Nothing here imports the cache or a kernel, so the simulators can use it on
numpy alone."""

from __future__ import annotations

import dataclasses

import numpy as np

from hisparse.config import Kernels, RowFormat, check_bool, check_int
from .fields import parse_choices
from .sizing import check_prefix_options
from .sources import WORKINGSET_DRIFT, WORKINGSET_RECENT, WORKINGSET_SINKS
from .traces import Trace


@dataclasses.dataclass(frozen=True)
class StressOptions:
    """Workload and checking knobs of a stress run (the CLI flags, 1:1), checked when built
    (``row_format`` and ``kernels`` parsed to their enum members there: each takes its
    string value too).

    With ``trace="replay"`` the trace file fixes the layers, top-k, steps and the request
    schedule: ``num_requests``, ``context``, ``context_min``, ``num_layers``, ``top_k``,
    ``steps``, ``churn`` and ``drift`` are not used (the CLI refuses them next to
    ``--replay``); the result's ``config`` and ``workload`` report the trace's values.
    """

    num_requests: int = 4  # live requests at once
    context: int = 2048  # max context of a joining request (tokens)
    context_min: int | None = None  # min context of a joining request (default context // 2)
    num_layers: int = 2
    top_k: int = 64
    buffer_size: int | None = None  # hot LRU slots S (default 2 * top_k)
    row_format: RowFormat = RowFormat.FP8_DS_MLA
    steps: int = 40
    churn: float = 0.05  # per step and request: probability it leaves (a new one joins)
    trace: Trace = Trace.CORRELATED
    drift: float | None = None  # correlated / indexer / workingset: per step replacement (None: the trace's default)
    replay: str | None = None  # trace file for trace="replay"
    record: str | None = None  # write the trace used to this .npz
    verify: int | str = 64  # rows checked per layer and step, "all" or "none"
    seed: int = 0
    device: str | None = None  # cpu, cuda, cuda:N; default: cuda when available, else cpu
    block_size: int = 64
    kernels: Kernels = Kernels.AUTO
    optimal: bool = True  # compute the Belady bound
    checked: bool = True  # checked resolve (host sync); False times the unchecked fast path
    prefill_chunk: int = 16384  # rows per append call when a request joins
    prefetch: bool = False  # after layer l's resolve, stage its selection into layer l+1 (exact if shared)
    pool_rows: int | None = None  # HiSparseConfig.device_pool_rows: the elastic device tier (None: none)
    ramp: bool = False  # RampSchedule: join until the pool overflows, then leave (needs pool_rows)
    shared_prefix: int | None = None  # prefix caching: every prompt starts with its group's P shared tokens
    prefix_groups: int | None = None  # groups of requests sharing a prefix (default 1 with shared_prefix)
    progress: bool = True

    @property
    def drift_used(self) -> float:
        """``drift``, or the trace's default: the working-set generator's own
        (``WORKINGSET_DRIFT``, as whatif's preset), 0.1 for the others."""
        if self.drift is not None:
            return float(self.drift)
        return WORKINGSET_DRIFT if self.trace is Trace.WORKINGSET else 0.1

    def __post_init__(self) -> None:
        for name in ("num_requests", "context", "num_layers", "top_k", "steps", "block_size",
                     "prefill_chunk"):
            check_int(name, getattr(self, name), lo=1)
        check_int("seed", self.seed, 0, 2**62)  # the tools derive seed + 1, seed + 2, ... from it
        if self.buffer_size is not None:
            check_int("buffer_size", self.buffer_size, lo=1)
        cm = self.context_min if self.context_min is not None else max(1, self.context // 2)
        check_int("context_min", cm)
        if not 1 <= cm <= self.context:
            raise ValueError(f"context_min must be in [1, context={self.context}], got {cm}")
        for name in ("churn", "drift"):
            v = getattr(self, name)
            if v is None and name == "drift":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
        check_bool("prefetch", self.prefetch)
        check_bool("ramp", self.ramp)
        if self.pool_rows is not None:
            check_int("pool_rows", self.pool_rows, lo=1)
        if self.ramp and self.pool_rows is None:
            raise ValueError("ramp needs pool_rows: it adds requests until the device pool overflows")
        parse_choices(self, {"row_format": RowFormat.parse, "kernels": Kernels.parse, "trace": Trace.parse})
        if self.ramp and self.trace is Trace.REPLAY:
            raise ValueError("ramp makes its own join/leave schedule and a replayed trace fixes one: "
                             "give one of them")
        self._check_prefix(cm)
        fixed = WORKINGSET_SINKS + WORKINGSET_RECENT
        if self.trace is Trace.WORKINGSET and self.top_k <= fixed:
            raise ValueError(f"trace='workingset' always selects {WORKINGSET_SINKS} sink and the "
                             f"{WORKINGSET_RECENT} newest tokens, so it needs top_k > {fixed} (got {self.top_k}); "
                             "give a larger --top-k or another --trace")
        if self.drift is not None and not self.trace.drifts:
            raise ValueError(f"drift does not apply to trace={self.trace.value!r} (only correlated, indexer "
                             "and workingset drift); leave --drift out or pick one of those traces")
        if self.trace is Trace.REPLAY and not self.replay:
            raise ValueError("trace='replay' needs a trace file (--replay FILE)")
        if self.replay and self.trace is not Trace.REPLAY:
            raise ValueError(f"a trace file to replay ({self.replay!r}) and trace={self.trace.value!r} "
                             "conflict: use trace='replay' with it, or drop the file")
        v = self.verify
        if not (v in ("all", "none") or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)):
            raise ValueError(f"verify must be a count >= 0, 'all' or 'none'; got {v!r}")

    @property
    def groups_used(self) -> int:
        """``prefix_groups``, or 1 when only ``shared_prefix`` is given."""
        return self.prefix_groups if self.prefix_groups is not None else 1

    def _check_prefix(self, cm: int) -> None:
        """``shared_prefix`` / ``prefix_groups`` (``hisparse stress --shared-prefix P
        --prefix-groups G``): P >= one host block and below the shortest prompt, G >= 1,
        and neither with a replayed trace or a ramp (which fix their own requests)."""
        if not check_prefix_options(self.shared_prefix, self.prefix_groups, self.block_size):
            return
        P = self.shared_prefix
        if P >= cm:
            given = "" if self.context_min is not None else ", by default context / 2"
            raise ValueError(f"shared_prefix={P} does not fit the prompts: a prompt is the shared prefix plus at "
                             f"least one token of its own, and the shortest has {cm} tokens (context_min{given}); "
                             f"give a shared_prefix below {cm} or a longer context_min")
        if self.trace is Trace.REPLAY:
            raise ValueError("shared_prefix makes its own requests (prompts, follow-up turns) and a replayed "
                             "trace fixes them: give one of the two")
        if self.ramp:
            raise ValueError("shared_prefix and ramp each make their own request schedule: give one of the two")


class Schedule:
    """Synthetic join/leave schedule: (req_ids, seq_lens) per step, int64 numpy arrays."""

    def __init__(self, o: StressOptions, max_request_id: int) -> None:
        self.o = o
        self.rng = np.random.default_rng(o.seed + 1)
        self.cmin = o.context_min if o.context_min is not None else max(1, o.context // 2)
        self.max_id = max_request_id
        self.live: dict[int, int] = {}  # id -> length after the last step

    def _join(self, busy: set[int]) -> None:
        # lowest id neither live nor freed this step: ids get reused one step later, so a
        # recorded trace stays unambiguous (a join = an id absent from the previous step)
        rid = min(set(range(len(busy) + 1)) - busy)
        busy.add(rid)
        self.live[rid] = int(self.rng.integers(self.cmin, self.o.context + 1)) - 1

    def _leave(self, rid: int) -> None:
        del self.live[rid]

    def step(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        busy = set(self.live)
        if s > 0:
            for rid in list(self.live):
                if self.rng.random() < self.o.churn:
                    self._leave(rid)
        while len(self.live) < self.o.num_requests:
            self._join(busy)
        for rid in self.live:
            self.live[rid] += 1
        ids = np.array(sorted(self.live), dtype=np.int64)
        return ids, np.array([self.live[i] for i in ids], dtype=np.int64)


class RampSchedule:
    """The load ramp of ``stress --ramp``: (req_ids, seq_lens) per step, as
    :class:`Schedule`, but steered by the cache's device pool.

    Phase "join": every step one request joins (a context drawn from
    [context_min, context], as :class:`Schedule` draws them) while every live request
    appends one row, until ``step(s, overflowed=True)`` says the pool has overflowed
    (a spill happened and a request is hot) or ``num_requests`` are live. Phase
    "leave": every step the oldest live request leaves, the others append one row,
    until none is left (``step`` then returns empty arrays: the ramp is over). Ids are
    0, 1, 2, ... in join order (never reused). ``max_steps``: 2 x num_requests bounds
    the ramp's length."""

    def __init__(self, o: StressOptions) -> None:
        self.o = o
        self.rng = np.random.default_rng(o.seed + 1)
        self.cmin = o.context_min if o.context_min is not None else max(1, o.context // 2)
        self.live: dict[int, int] = {}  # id -> length after the last step, in join order
        self.next_id = 0
        self.phase = "join"
        self.overflow_step: int | None = None  # the step after which the pool had overflowed
        self.peak_live = 0
        self.max_steps = 2 * o.num_requests

    def step(self, s: int, *, overflowed: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The requests of step ``s`` and their lengths; ``overflowed``: the pool has
        overflowed by the end of step s - 1."""
        if self.phase == "join" and overflowed:
            self.phase = "leave"
            self.overflow_step = s - 1
        if self.phase == "join" and len(self.live) >= self.o.num_requests:
            self.phase = "leave"  # every request slot taken: the ramp turns without an overflow
        if self.phase == "join":
            self.live[self.next_id] = int(self.rng.integers(self.cmin, self.o.context + 1)) - 1
            self.next_id += 1
        elif self.live:
            del self.live[next(iter(self.live))]  # the oldest leaves
        for rid in self.live:
            self.live[rid] += 1
        self.peak_live = max(self.peak_live, len(self.live))
        ids = np.array(sorted(self.live), dtype=np.int64)
        return ids, np.array([self.live[i] for i in ids], dtype=np.int64)


__all__ = ["StressOptions", "Schedule", "RampSchedule"]
