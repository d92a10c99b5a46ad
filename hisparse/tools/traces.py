"""Top-k trace sources for the stress tool, and the ``.npz`` trace file format.

A *trace* says, for every decode step, which requests are live, how long each one is
(its context length after that step's new token), and which positions each layer's
indexer selected for each request. The stress tool turns a trace into cache calls
(joins, appends, resolves, frees); the Belady bound is computed on the same trace.

Sources (all produce int32 ``[T, K]`` logical top-k, -1 = padding, distinct positions
per row, every valid entry in ``[0, seq_len)``):

- :class:`UniformSource`     K distinct positions uniformly at random every step.
- :class:`CorrelatedSource`  consecutive steps share most of their selection, like a
  real indexer: each step every entry is replaced with probability ``drift`` by a
  fresh position not already selected (``drift = 0`` repeats the selection forever,
  ``drift = 1`` is uniform). Locality = 1 - drift. Padding entries (left when the
  context was shorter than K) are refilled as soon as the context allows.
- :class:`ReplaySource`      the top-k recorded in a trace file (schedule included).
- :class:`IndexerSource`     a real q.k indexer (random keys, a drifting query), the
  kind the mini engine (``hisparse.tools.mini_engine``) runs.
- The mini engine's own indexer: ``hisparse mini-engine --record FILE`` writes the
  top-k its model's indexer selected at every decode step in this format;
  ``hisparse stress --replay FILE`` then drives the cache with it.

Trace file format (a ``.npz`` archive, ``np.savez_compressed``, written to exactly the
path given; write with :class:`TraceRecorder`, read with :func:`load_trace`):

  ===============  =================  =============================================
  key              dtype / shape      meaning
  ===============  =================  =============================================
  ``meta``         str (0-d)          JSON: {"format": "hisparse-trace", "version": 1,
                                      "num_layers": L, "top_k": K, "num_steps": N}
  ``step_offsets`` int64 [N + 1]      entries of step s are rows
                                      ``step_offsets[s] : step_offsets[s + 1]``
  ``req_ids``      int64 [E]          request id of each entry (live at that step)
  ``seq_lens``     int64 [E]          context length of that request at that step,
                                      counting the token appended in the step
  ``topk``         int32 [E, L, K]    selected positions per layer, -1 = padding
  ===============  =================  =============================================

:func:`load_trace` checks all of it and names the file and the key at fault: integer
arrays only (any integer dtype is read; a float array is refused), no pickled objects,
``meta`` valid JSON with positive ints, shapes consistent with ``meta``, request ids
and lengths in int32 range, every position in ``[-1, seq_len)``, no request twice in
a step.

Replay semantics: a request id that appears in step s and not in step s-1 joins (its
first ``seq_len - 1`` rows are prefilled, then the step's row is appended); a request
live in s-1 and absent in s leaves (freed before step s). Within a step the entries
are the batch in order (tokens of the resolve). A request whose entry's seq_len grows
by more than one appends all the missing rows in that step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile

import numpy as np
import torch

TRACE_FORMAT = "hisparse-trace"
TRACE_VERSION = 1
_SCORE_BUDGET = 1 << 24  # elements of one random-score chunk (rows x context)
_INT32_MAX = 2**31 - 1
_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"


def sample_distinct(seq_lens: torch.Tensor, k: int, gen: torch.Generator,
                    exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, ``k`` distinct random positions in ``[0, seq_len)`` not in ``exclude``.

    seq_lens: int64 [T] (device of the result); exclude: int32/int64 [T, E], -1 = none.
    Returns int32 [T, k]; rows with fewer than k eligible positions are padded with -1
    (padding at the end). Vectorised: random scores over the context, top-k of them.
    """
    T = int(seq_lens.numel())
    dev = seq_lens.device
    out = torch.full((T, k), -1, dtype=torch.int32, device=dev)
    if T == 0 or k == 0:
        return out
    cmax = int(seq_lens.max())
    if cmax <= 0:
        return out
    kk = min(k, cmax)
    cols = torch.arange(cmax + 1, device=dev)
    rows_per_chunk = max(1, _SCORE_BUDGET // (cmax + 1))
    for a in range(0, T, rows_per_chunk):
        b = min(T, a + rows_per_chunk)
        # one extra column (index cmax) absorbs the -1 entries of ``exclude``
        scores = torch.rand((b - a, cmax + 1), generator=gen, device=dev)
        scores.masked_fill_(cols[None, :] >= seq_lens[a:b, None], -1.0)
        if exclude is not None and exclude.numel():
            ex = exclude[a:b].long()
            ex = torch.where(ex >= 0, ex, torch.full_like(ex, cmax))
            scores.scatter_(1, ex, -1.0)
        val, idx = torch.topk(scores, kk, dim=1)
        out[a:b, :kk] = torch.where(val >= 0, idx, torch.full_like(idx, -1)).to(torch.int32)
    return out


class TopkSource:
    """Interface of a top-k source.

    ``select(layer, req_ids, seq_lens, step)``: req_ids int64 [T], seq_lens int64 [T]
    (on the source's device) -> int32 [T, K]. ``drop(req_id)`` forgets a request that
    left (so a reused id starts fresh).
    """

    name = "base"

    def __init__(self, *, top_k: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(int(seed))

    def select(self, layer: int, req_ids: torch.Tensor, seq_lens: torch.Tensor,
               step: int) -> torch.Tensor:
        raise NotImplementedError

    def drop(self, req_id: int) -> None:
        """Forget per-request state (default: none)."""


class UniformSource(TopkSource):
    """K distinct uniformly random positions per request and layer, every step."""

    name = "uniform"

    def select(self, layer, req_ids, seq_lens, step):  # noqa: D102 (see TopkSource)
        return sample_distinct(seq_lens, self.top_k, self.gen)


class CorrelatedSource(TopkSource):
    """Temporally correlated selection: each step replaces a ``drift`` fraction.

    State: the previous selection of each (layer, request), int32 [K] on the device.
    """

    name = "correlated"

    def __init__(self, *, top_k: int, drift: float = 0.1, device="cpu", seed: int = 0) -> None:
        super().__init__(top_k=top_k, device=device, seed=seed)
        if not isinstance(drift, (int, float)) or not 0.0 <= float(drift) <= 1.0:
            raise ValueError(f"drift must be a number in [0, 1], got {drift!r}")
        self.drift = float(drift)
        self._prev: dict[tuple[int, int], torch.Tensor] = {}

    def select(self, layer, req_ids, seq_lens, step):  # noqa: D102
        T, K = int(req_ids.numel()), self.top_k
        ids = req_ids.tolist()
        prev = torch.full((T, K), -1, dtype=torch.int32, device=self.device)
        known = torch.zeros(T, dtype=torch.bool, device=self.device)
        for t, rid in enumerate(ids):
            p = self._prev.get((layer, rid))
            if p is not None:
                prev[t] = p
                known[t] = True
        fresh = sample_distinct(seq_lens, K, self.gen, exclude=prev)
        replace = torch.rand((T, K), generator=self.gen, device=self.device) < self.drift
        pad = prev < 0
        replace &= ~pad
        # fresh candidates are packed at the front of each row (-1 after them): padding
        # entries take the first ones, then the drift-replaced entries in order
        n_pad = pad.sum(dim=1, keepdim=True)
        rank = torch.where(pad, torch.cumsum(pad.long(), dim=1) - 1,
                           n_pad + torch.cumsum(replace.long(), dim=1) - 1)
        rank = rank.clamp(min=0, max=K - 1)
        replace |= pad
        cand = torch.gather(fresh, 1, rank)
        new = torch.where(replace & (cand >= 0), cand, prev)
        new = torch.where(known[:, None], new, fresh)
        # padding to the end of each row, valid entries in their order
        new = torch.gather(new, 1, torch.argsort((new < 0).to(torch.int8), dim=1, stable=True))
        for t, rid in enumerate(ids):
            self._prev[(layer, rid)] = new[t].clone()
        return new

    def drop(self, req_id: int) -> None:
        for key in [k for k in self._prev if k[1] == req_id]:
            del self._prev[key]


class IndexerSource(TopkSource):
    """A real q.k indexer, of the mini engine's kind: top-k of causal scores.

    Each (layer, request) gets random indexer keys fp32 [max_context, dim] (kept on the
    device while the request lives) and a query fp32 [dim] that drifts every step:
    ``q <- normalize((1 - drift) * q + drift * noise)``, so consecutive selections
    overlap the way a trained indexer's do, and the overlap falls as drift grows.
    Selection: the K positions < seq_len with the largest ``keys . q``.
    """

    name = "indexer"

    def __init__(self, *, top_k: int, max_context: int, dim: int = 16, drift: float = 0.1,
                 device="cpu", seed: int = 0) -> None:
        super().__init__(top_k=top_k, device=device, seed=seed)
        if not 0.0 <= float(drift) <= 1.0:
            raise ValueError(f"drift must be in [0, 1], got {drift!r}")
        self.max_context, self.dim, self.drift = int(max_context), int(dim), float(drift)
        self._keys: dict[tuple[int, int], torch.Tensor] = {}
        self._q: dict[tuple[int, int], torch.Tensor] = {}

    def _unit(self, *shape: int) -> torch.Tensor:
        x = torch.randn(shape, generator=self.gen, device=self.device)
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)

    def select(self, layer, req_ids, seq_lens, step):  # noqa: D102
        T, K = int(req_ids.numel()), self.top_k
        out = torch.full((T, K), -1, dtype=torch.int32, device=self.device)
        for t, (rid, n) in enumerate(zip(req_ids.tolist(), seq_lens.tolist())):
            key = (layer, rid)
            if n > self.max_context:
                raise ValueError(f"request {rid} has {n} tokens > max_context {self.max_context}")
            if key not in self._keys:
                self._keys[key] = self._unit(self.max_context, self.dim)
                self._q[key] = self._unit(self.dim)
            else:
                q = (1 - self.drift) * self._q[key] + self.drift * self._unit(self.dim)
                self._q[key] = q / q.norm().clamp_min(1e-6)
            scores = self._keys[key][:n] @ self._q[key]
            k = min(K, n)
            out[t, :k] = torch.topk(scores, k).indices.to(torch.int32)
        return out

    def drop(self, req_id: int) -> None:
        for d in (self._keys, self._q):
            for key in [k for k in d if k[1] == req_id]:
                del d[key]


@dataclasses.dataclass
class TraceStep:
    """One step of a recorded trace (numpy, host).

    req_ids: int64 [T]; seq_lens: int64 [T]; topk: int32 [T, L, K].
    """

    req_ids: np.ndarray
    seq_lens: np.ndarray
    topk: np.ndarray


class TraceRecorder:
    """Collects steps and writes the ``.npz`` trace file documented above."""

    def __init__(self, *, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = int(num_layers), int(top_k)
        self._steps: list[tuple[np.ndarray, np.ndarray, list[np.ndarray | None]]] = []

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def begin_step(self, req_ids, seq_lens) -> None:
        """Start a step: req_ids / seq_lens int64 [T] (numpy, list or tensor)."""
        r = np.asarray(torch.as_tensor(req_ids).cpu(), dtype=np.int64).reshape(-1)
        s = np.asarray(torch.as_tensor(seq_lens).cpu(), dtype=np.int64).reshape(-1)
        self._steps.append((r, s, [None] * self.num_layers))

    def add_layer(self, layer: int, topk) -> None:
        """Record the current step's top-k of ``layer``: int32 [T, K]."""
        r, _, layers = self._steps[-1]
        a = np.asarray(torch.as_tensor(topk).cpu(), dtype=np.int32)
        if a.shape != (r.size, self.top_k):
            raise ValueError(f"topk of layer {layer} has shape {a.shape}, expected "
                             f"{(r.size, self.top_k)}")
        layers[layer] = a

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace file to ``path`` (exactly that name; no suffix is added)."""
        L, K = self.num_layers, self.top_k
        offs, tks = [0], []
        for s, (r, _, layers) in enumerate(self._steps):
            missing = [i for i, a in enumerate(layers) if a is None]
            if missing:
                raise ValueError(f"step {s} has no top-k for layers {missing}")
            offs.append(offs[-1] + r.size)
            tks.append(np.stack(layers, axis=1) if r.size else np.zeros((0, L, K), np.int32))
        meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "num_layers": L,
                "top_k": K, "num_steps": len(self._steps)}
        cat = np.concatenate
        with open(path, "wb") as fh:
            np.savez_compressed(
                fh, meta=np.array(json.dumps(meta)),
                step_offsets=np.asarray(offs, dtype=np.int64),
                req_ids=cat([r for r, _, _ in self._steps]) if self._steps else np.zeros(0, np.int64),
                seq_lens=cat([s for _, s, _ in self._steps]) if self._steps else np.zeros(0, np.int64),
                topk=cat(tks).astype(np.int32) if tks else np.zeros((0, L, K), np.int32),
            )


_KEYS = ("meta", "step_offsets", "req_ids", "seq_lens", "topk")


def _read_arrays(path: str) -> dict[str, np.ndarray]:
    """The five arrays of a trace file; ValueError naming the file (and key) otherwise."""
    if not os.path.exists(path):
        raise ValueError(f"trace file {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"trace file {path!r} is a directory")
    try:
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
    except OSError as e:
        raise ValueError(f"trace file {path!r} cannot be read ({e.strerror or e})") from None
    if head != _ZIP_MAGIC:
        what = ("an empty file" if not head else "a single .npy array" if head == _NPY_MAGIC[:4]
                else "not a zip archive (text or another format)")
        raise ValueError(f"trace file {path!r} is not a .npz trace: it is {what}; record one "
                         "with `hisparse stress --record FILE` or `hisparse mini-engine --record FILE`")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"trace file {path!r} is not a readable .npz archive: {e}") from None
    with z:
        missing = [k for k in _KEYS if k not in z.files]
        if missing:
            raise ValueError(f"trace file {path!r} lacks keys {missing} (has {sorted(z.files)})")
        out = {}
        for key in _KEYS:
            try:
                out[key] = z[key]
            except ValueError:  # numpy refuses object arrays with allow_pickle=False
                raise ValueError(f"trace file {path!r}: key {key!r} holds pickled Python objects; "
                                 "trace arrays are plain integer arrays and a JSON string") from None
            except (OSError, zipfile.BadZipFile, EOFError) as e:
                raise ValueError(f"trace file {path!r}: key {key!r} cannot be read: {e}") from None
    return out


def _read_meta(path: str, m: np.ndarray) -> dict:
    if m.shape != () or m.dtype.kind not in "US":
        raise ValueError(f"trace file {path!r}: key 'meta' must be a 0-d string array (JSON), "
                         f"got dtype {m.dtype} shape {m.shape}")
    try:
        meta = json.loads(str(m))
    except json.JSONDecodeError as e:
        raise ValueError(f"trace file {path!r}: key 'meta' is not valid JSON ({e.msg} at "
                         f"character {e.pos})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"trace file {path!r}: key 'meta' must be a JSON object, got "
                         f"{type(meta).__name__}")
    if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
        raise ValueError(f"trace file {path!r}: meta says format {meta.get('format')!r} "
                         f"version {meta.get('version')!r}; expected {TRACE_FORMAT!r} "
                         f"version {TRACE_VERSION}")
    for key, lo in (("num_layers", 1), ("top_k", 1), ("num_steps", 0)):
        if key not in meta:
            raise ValueError(f"trace file {path!r}: meta lacks {key!r}")
        v = meta[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"trace file {path!r}: meta {key!r} must be an int >= {lo}, got {v!r}")
    return meta


def load_trace(path: str | os.PathLike) -> tuple[dict, list[TraceStep]]:
    """Read and validate a trace file; returns (meta, steps).

    ValueError naming the file and the key at fault when it is malformed (see the
    module docstring for what is checked).
    """
    name = os.fspath(path)
    arr = _read_arrays(name)
    meta = _read_meta(name, arr["meta"])
    for key in _KEYS[1:]:
        if not np.issubdtype(arr[key].dtype, np.integer):
            raise ValueError(f"trace file {name!r}: key {key!r} has dtype {arr[key].dtype}; "
                             "expected integers (int64 offsets/ids/lengths, int32 top-k)")
    offs, rid, sl, tk = arr["step_offsets"], arr["req_ids"], arr["seq_lens"], arr["topk"]
    L, K, N = meta["num_layers"], meta["top_k"], meta["num_steps"]
    if rid.ndim != 1:
        raise ValueError(f"trace file {name!r}: key 'req_ids' must be 1-D, got shape {rid.shape}")
    E = rid.shape[0]
    if offs.shape != (N + 1,):
        raise ValueError(f"trace file {name!r}: key 'step_offsets' has shape {offs.shape}, "
                         f"expected ({N + 1},) for meta num_steps={N}")
    if offs[0] != 0 or offs[-1] != E or np.any(np.diff(offs) < 0):
        raise ValueError(f"trace file {name!r}: key 'step_offsets' must rise from 0 to {E} "
                         "(the number of entries in 'req_ids')")
    if sl.shape != (E,):
        raise ValueError(f"trace file {name!r}: key 'seq_lens' has shape {sl.shape}, expected ({E},)")
    if tk.shape != (E, L, K):
        raise ValueError(f"trace file {name!r}: key 'topk' has shape {tk.shape}, expected "
                         f"(entries, num_layers, top_k) = ({E}, {L}, {K})")
    if E:
        if rid.min() < 0 or rid.max() > _INT32_MAX:
            raise ValueError(f"trace file {name!r}: key 'req_ids' has ids outside [0, 2**31)")
        if sl.min() <= 0 or sl.max() > _INT32_MAX:
            raise ValueError(f"trace file {name!r}: key 'seq_lens' has lengths outside [1, 2**31)")
        if np.any(tk < -1) or np.any(tk >= sl[:, None, None]):
            raise ValueError(f"trace file {name!r}: key 'topk' has positions outside [-1, seq_len)")
    steps = [TraceStep(rid[offs[s]:offs[s + 1]].astype(np.int64),
                       sl[offs[s]:offs[s + 1]].astype(np.int64),
                       tk[offs[s]:offs[s + 1]].astype(np.int32)) for s in range(N)]
    for s, st in enumerate(steps):
        if np.unique(st.req_ids).size != st.req_ids.size:
            raise ValueError(f"trace file {name!r}: step {s} lists a request twice")
    return meta, steps


class ReplaySource(TopkSource):
    """Replays a trace file: its schedule (``steps``) and its top-k."""

    name = "replay"

    def __init__(self, path: str | os.PathLike, *, device="cpu") -> None:
        self.meta, self.steps = load_trace(path)
        super().__init__(top_k=int(self.meta["top_k"]), device=device)
        self.num_layers = int(self.meta["num_layers"])

    def select(self, layer, req_ids, seq_lens, step):  # noqa: D102
        st = self.steps[step]
        if not np.array_equal(np.asarray(req_ids.cpu()), st.req_ids):
            raise ValueError(f"replay step {step}: batch {req_ids.tolist()} differs from the "
                             f"recorded batch {st.req_ids.tolist()}")
        return torch.from_numpy(np.ascontiguousarray(st.topk[:, layer])).to(self.device)


SOURCES = ("uniform", "correlated", "replay", "indexer")
