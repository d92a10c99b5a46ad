"""Decode-only steps of the mini engine as CUDA graphs, one per batch-size bucket.

A decode-only step of B requests (q tokens each) runs padded to the smallest bucket
N >= B of :func:`capture_sizes` (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, ...,
and the largest batch itself, as vLLM's capture sizes). The N - B padding requests
write their rows and indexer keys to a scratch slot nobody reads, their top-k rows are
all -1 (the indexer masks every position of a padding token) and their outputs are
dropped. Everything inside the padded forward has the bucket's shapes:

  static inputs  int64 [5, N * q] device buffer per bucket: token ids, write positions,
                 engine slots, sub-token index, own position for the indexer mask (-1
                 for padding); int32 [N * q] slots for the resident block table. Filled
                 from the step's host lists by one copy before the forward.
  indexer        ``Indexer.decode_topk_fixed``: scores over the whole max context of
                 every slot, masked past each token's own position, then top-k
  KV stores      ``KVStore.prepare_padded`` (host work, outside the graph: hisparse's
                 ``prepare_for_batch(md, pad_to=N, replay=...)``), ``begin_padded`` (device work
                 inside: the resident store's write rows from the static positions)

Graph variants: a KV store whose calls take another path in some states keeps a graph
per (bucket, ``KVStore.graph_variant``): hisparse's, one of the cache's resident
resolve (captured inside ``resident_capture`` while every live request is resident)
and one of the full resolve (correct whatever the residency). A step's variant is
read before its host work, which could change it (a write that demotes a request):
a step that might demote one runs the full resolve's graph.

Modes (:class:`DecodeMode`): EAGER (the loop's own forward, no padding), PADDED (the
padded forward run eagerly: what the graphs capture, testable on CPU), GRAPHS (PADDED
for the first step of a bucket, which compiles the kernels; the next step of that
bucket captures the forward, and every step of it replays). Prefill and mixed steps
always run eagerly.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import torch

from hisparse.config import check_int

if TYPE_CHECKING:  # the loop imports this module; only the type is needed here
    from .kv import Batch
    from .loop import MiniEngine


class DecodeMode(enum.Enum):
    EAGER = "eager"
    PADDED = "padded"
    GRAPHS = "graphs"


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes up to ``max_batch``: 1, 2, 4, then steps of 8 to 32, 16 to 64, 32 to
    128, 64 to 256, 128 beyond; ``max_batch`` itself is the last bucket."""
    check_int("max_batch", max_batch, lo=1)
    sizes, n = [1, 2, 4], 8
    while n < max_batch:
        sizes.append(n)
        n += 8 if n < 32 else 16 if n < 64 else 32 if n < 128 else 64 if n < 256 else 128
    return [s for s in sizes if s < max_batch] + [max_batch]


def bucket_for(batch: int, sizes: list[int]) -> int:
    """The smallest bucket >= ``batch``."""
    check_int("batch", batch, lo=1)
    for s in sizes:
        if s >= batch:
            return s
    raise ValueError(f"batch {batch} exceeds the largest bucket {sizes[-1]}")


@dataclasses.dataclass
class StaticInputs:
    """One bucket's static input buffers (the same storage every replay)."""

    n: int  # bucket size N (requests)
    q: int  # tokens per request
    buf: torch.Tensor  # int64 [5, N * q]: tok, pos, slot, sub, lim
    dec_slots: torch.Tensor  # int32 [N * q] engine slot per token (the resident block table's row)
    # fp32 [N * q, hidden], the output of the forward captured for each graph variant
    outs: dict = dataclasses.field(default_factory=dict)
    warm: set = dataclasses.field(default_factory=set)  # variants a padded eager step ran for (compiled)

    @classmethod
    def make(cls, n: int, q: int, device: torch.device) -> "StaticInputs":
        return cls(n=n, q=q, buf=torch.zeros(5, n * q, dtype=torch.int64, device=device),
                   dec_slots=torch.zeros(n * q, dtype=torch.int32, device=device))

    tok = property(lambda self: self.buf[0])  # int64 [N * q] token ids (padding 0)
    pos = property(lambda self: self.buf[1])  # int64 [N * q] write position (padding 0)
    slot = property(lambda self: self.buf[2])  # int64 [N * q] engine slot (padding: the scratch slot)
    sub = property(lambda self: self.buf[3])  # int64 [N * q] index within the request's q tokens
    lim = property(lambda self: self.buf[4])  # int64 [N * q] own position for the mask (padding -1)

    def fill(self, items: list, scratch_slot: int) -> None:
        """Copy a decode step's (request, q) items into the buffers, padding the rest
        (Python lists, one host tensor, one copy: no per-request tensor ops)."""
        q, n = self.q, self.n
        if len(items) > n:
            raise ValueError(f"{len(items)} requests do not fit bucket {n}")
        tok: list[int] = []
        pos: list[int] = []
        slot: list[int] = []
        for r, k in items:
            if k != q:
                raise ValueError(f"request {r.rid} has {k} tokens in a decode step of {q}")
            tok += r.decode_tokens(r.done, r.done + q)
            pos += range(r.done, r.done + q)
            slot += [r.slot] * q
        pad = n * q - len(tok)
        host = torch.tensor([tok + [0] * pad, pos + [0] * pad, slot + [scratch_slot] * pad,
                             list(range(q)) * n, pos + [-1] * pad], dtype=torch.int64)
        self.buf.copy_(host.pin_memory() if self.buf.is_cuda else host, non_blocking=self.buf.is_cuda)
        self.dec_slots.copy_(self.slot)


class DecodeGraphs:
    """Runs the engine's decode-only steps padded to buckets, captured as CUDA graphs in
    :attr:`DecodeMode.GRAPHS` (see the module docstring)."""

    def __init__(self, engine: "MiniEngine", mode: DecodeMode) -> None:
        if mode is DecodeMode.EAGER:
            raise ValueError("DecodeGraphs runs the padded modes (PADDED or GRAPHS)")
        if mode is DecodeMode.GRAPHS and engine.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine is on {engine.device}")
        self.engine = engine
        self.mode = mode
        self.sizes = capture_sizes(engine.slots)
        self.static: dict[int, StaticInputs] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (bucket, the KV store's graph variant) -> graph
        self.pool = torch.cuda.graph_pool_handle() if mode is DecodeMode.GRAPHS else None
        self.counts = {"padded_eager": 0, "captures": 0, "replays": 0, "padding_requests": 0}
        self.last = ""  # what the last step did: "padded" | "capture" | "replay"
        # CUDA events around the last replay (GRAPHS mode): its GPU time, read once it ran
        self.last_marks: tuple | None = None

    def step(self, batch: "Batch") -> torch.Tensor:
        """One decode-only step -> fp32 [B * q, hidden], the real tokens' final hidden states."""
        eng = self.engine
        md = batch.md
        if md.num_prefills or not md.num_decodes:
            raise ValueError("DecodeGraphs runs decode-only steps")
        B, q = md.num_decodes, md.decode_max_query_len
        n = bucket_for(B, self.sizes)
        st = self.static.get(n)
        if st is None:
            st = self.static[n] = StaticInputs.make(n, q, eng.device)
        elif st.q != q:
            raise ValueError(f"bucket {n} was set up for q={st.q}, this step has q={q}")
        st.fill(batch.items, eng.scratch_slot)
        padded = dataclasses.replace(batch, dec_slots=st.dec_slots)
        variant, g = self._prepare(padded, n)
        self.counts["padding_requests"] += n - B
        if self.mode is DecodeMode.PADDED or variant not in st.warm:
            st.warm.add(variant)  # the next step of this bucket and variant captures
            self.counts["padded_eager"] += 1
            self.last = "padded"
            return eng.forward_padded(padded, st)[:B * q]
        if g is None:
            g = torch.cuda.CUDAGraph()
            try:
                with eng.kv.capture_variant(variant), torch.cuda.graph(g, pool=self.pool):
                    st.outs[variant] = eng.forward_padded(padded, st)
            except BaseException:
                eng.kv.abandon_forward()  # nothing captured ran: the store puts the step back
                raise
            self.graphs[(n, variant)] = g
            self.counts["captures"] += 1
            self.last = "capture"
        else:
            self.last = "replay"
        marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        marks[0].record()
        g.replay()
        marks[1].record()
        self.last_marks = marks  # new events each replay: the loop may launch the next one first
        self.counts["replays"] += 1
        return st.outs[variant][:B * q]

    def _prepare(self, padded: "Batch", n: int) -> tuple[object, "torch.cuda.CUDAGraph | None"]:
        """The step's host work (``prepare_padded``) for the graph of the KV store's
        variant for this step (``graph_variant``, read before the host work, which it
        accounts for), and (that variant, its graph or None)."""
        kv = self.engine.kv
        variant = kv.graph_variant(padded)
        g = self.graphs.get((n, variant))
        kv.prepare_padded(padded, n, replay=g is not None)
        if not kv.variant_holds(variant):  # the estimate above is wrong: an engine bug, never replay
            kv.abandon_forward()
            raise RuntimeError(f"decode step of bucket {n}: its host work changed the KV store's graph "
                               f"variant from {variant!r}; a graph of that variant can't serve it")
        return variant, g

    @staticmethod
    def replay_gpu_s(marks: tuple) -> float:
        """GPU time in seconds of the replay whose ``last_marks`` these were (from its
        start to its end on the stream, not the host work before it), once it ran."""
        return marks[0].elapsed_time(marks[1]) / 1e3

    def report(self) -> dict:
        return {"mode": self.mode.value, "buckets": sorted(self.static),
                "captured": sorted({n for n, _ in self.graphs}),
                "variants": sorted({str(v) for _, v in self.graphs}), **self.counts}


__all__ = ["DecodeMode", "capture_sizes", "bucket_for", "StaticInputs", "DecodeGraphs"]
