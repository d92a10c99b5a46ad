"""Top-k trace sources: what the stress tool, whatif and autotune feed the cache.

Every source produces int32 ``[T, K]`` logical top-k per (layer, step), -1 = padding,
distinct positions per row, every valid entry in ``[0, seq_len)``:

- :class:`UniformSource`     K distinct positions uniformly at random every step.
- :class:`CorrelatedSource`  consecutive steps share most of their selection, like a
  real indexer: each step every entry is replaced with probability ``drift`` by a
  fresh position not already selected (``drift = 0`` repeats the selection forever,
  ``drift = 1`` is uniform). Locality = 1 - drift. Padding entries (left when the
  context was shorter than K) are refilled as soon as the context allows.
- :class:`IndexerSource`     a real q.k indexer (random keys, a drifting query), the
  kind the mini engine (``hisparse_tools.mini_engine``) runs.
- :class:`WorkingSetSource`  attention sinks + a recent window + a drifting working set
  whose candidates' scores follow an AR(1) process, adjacent layers sharing a chosen
  share of it; ``hisparse whatif --preset glm51`` calibrates it to published miss rates
  (docs/WHATIF.md).

A recorded trace replays through ``hisparse_tools.traces.ReplaySource``.
"""


from __future__ import annotations

import math

import torch

from hisparse.config import check_int

_SCORE_BUDGET = 1 << 24  # elements of one random-score chunk (rows x context)


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
        check_int("top_k", top_k, lo=1, error=ValueError)
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


# the working-set generator's defaults: sink and recent tokens always selected, candidates
# per free place, per-step replacement rate
WORKINGSET_SINKS, WORKINGSET_RECENT, WORKINGSET_POOL, WORKINGSET_DRIFT = 4, 64, 2.5, 0.03


def workingset_width(top_k: int, sinks: int = WORKINGSET_SINKS, recent: int = WORKINGSET_RECENT,
                     pool: float = WORKINGSET_POOL) -> int:
    """W, the candidates a (layer, request) of the working-set generator keeps."""
    free = top_k - sinks - recent
    return max(free, int(round(float(pool) * free)))


def workingset_state_bytes(top_k: int, max_context: int, **knobs) -> int:
    """Bytes of the working-set generator's state per (layer, request) at contexts up to
    ``max_context``: candidates int64, scores float32 and the mirror mask per candidate,
    and the position owner map (``knobs``: sinks / recent / pool; a pool the generator
    would refuse counts as 1: the estimate is made before the generator checks them)."""
    pool = float(knobs.get("pool", WORKINGSET_POOL))
    pool = pool if math.isfinite(pool) and pool >= 1.0 else 1.0
    w = workingset_width(top_k, knobs.get("sinks", WORKINGSET_SINKS), knobs.get("recent", WORKINGSET_RECENT), pool)
    return max(w, 1) * 13 + max_context * 4


class WorkingSetSource(TopkSource):
    """A drifting working set with attention sinks, a recent window and layer overlap.

    The selection of a request with n tokens (n > K) in one layer and step is

    - ``sinks``: positions ``0 .. sinks-1`` (attention sinks), always selected;
    - ``recent``: the last ``recent`` positions (the newest token included), always
      selected;
    - the K' = K - sinks - recent best-scoring candidates of the request's *working set*:
      W = round(pool * K') candidate positions in ``[sinks, n - recent)``.

    A request with n <= K selects all its positions (a real indexer has no choice).

    Every step each candidate's score follows an AR(1) process, ``x <- persistence * x
    + sqrt(1 - persistence^2) * noise`` (stationary N(0, 1)), so a candidate near the
    cut drifts in and out of the selection and one far above it stays for many steps;
    and each candidate is replaced with probability ``drift`` by a fresh position drawn
    uniformly from the context (score drawn anew). Knobs and what they do to the miss
    curve (miss rate against buffer size), see docs/WHATIF.md:

    - ``persistence``: step-to-step locality; higher -> fewer misses at buffer = K
      (consecutive selections overlap more).
    - ``pool``: how many candidates compete for the K' places; a bigger pool -> the
      curve falls more slowly (rows come back after longer absences, so only a buffer of
      about W rows holds them all).
    - ``drift``: rate of never-seen rows; sets the floor of the curve at large buffers
      (about drift * W / K misses per lookup, compulsory for every policy).
    - ``sinks`` / ``recent``: rows that are always hits (the recent window costs one
      miss per step: the previous newest token left the reserved slot); they scale the
      whole curve down by their share of K.
    - ``layer_overlap``: a fraction of layer l's candidate slots (drawn once per request)
      mirror layer l-1's slot of the same index, position and score; the rest are the
      layer's own. About that fraction of a layer's selection is also selected by the
      layer before it in the same step (0: independent layers, 1: identical). Call the
      layers of a step in order (layer l-1 first), as the stress tool and whatif do.

    The defaults are the ``glm51`` calibration of ``hisparse whatif`` (with top_k = 2048).

    State per (layer, request): candidate positions int64 [W] (-1 = empty), scores
    fp32 [W] and the mirror mask bool [W], rows of per-layer tensors indexed by a lane
    per live request (vectorised over the requests of a call; no per-entry Python).
    """

    name = "workingset"

    def __init__(self, *, top_k: int, sinks: int = WORKINGSET_SINKS, recent: int = WORKINGSET_RECENT,
                 pool: float = WORKINGSET_POOL,
                 persistence: float = 0.72, drift: float = WORKINGSET_DRIFT, layer_overlap: float = 0.8,
                 device="cpu", seed: int = 0) -> None:
        super().__init__(top_k=top_k, device=device, seed=seed)
        check_int("sinks", sinks, 0)
        check_int("recent", recent, 0)
        if sinks + recent >= top_k:
            raise ValueError(f"sinks + recent must be < top_k={top_k}, got {sinks} + {recent}")
        for name, v, lo, hi in (("persistence", persistence, 0.0, 1.0), ("drift", drift, 0.0, 1.0),
                                ("layer_overlap", layer_overlap, 0.0, 1.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")
        if persistence >= 1.0:
            raise ValueError(f"persistence must be < 1 (1 freezes the scores), got {persistence!r}")
        if isinstance(pool, bool) or not isinstance(pool, (int, float)) or not float(pool) >= 1.0 \
                or not math.isfinite(float(pool)):
            raise ValueError(f"pool must be a number >= 1 (candidates per free place), got {pool!r}")
        self.sinks, self.recent = sinks, recent
        self.free = top_k - sinks - recent  # K'
        self.width = workingset_width(top_k, sinks, recent, pool)  # W
        self.persistence, self.drift = float(persistence), float(drift)
        self.layer_overlap = float(layer_overlap)
        self._lane: dict[int, int] = {}  # request id -> lane (row of the state tensors)
        self._free_lanes: list[int] = []
        self._cap, self._width = 0, 0  # lanes, positions covered by the owner maps
        self._odt = torch.int16 if self.width < 2**15 else torch.int32
        self._layers: dict[int, dict[str, torch.Tensor]] = {}

    # ---- per-request lanes and per-layer state ----------------------------------------
    def _lanes(self, ids: list[int], width: int) -> torch.Tensor:
        for rid in ids:
            if rid not in self._lane:
                self._lane[rid] = self._free_lanes.pop() if self._free_lanes else len(self._lane)
        cap = max(self._cap, max(self._lane.values(), default=-1) + 1)
        cap = self._cap if cap <= self._cap else max(16, 2 * cap)
        width = max(self._width, width)
        if cap > self._cap or width > self._width:
            width = width if width == self._width else max(width, 2 * self._width)
            for st in self._layers.values():
                for k, v in st.items():
                    if k == "owner":
                        grown = torch.full((cap, width), -1, dtype=v.dtype, device=v.device)
                        grown[:v.shape[0], :v.shape[1]] = v
                    else:
                        fill = -1 if k == "pos" else 0
                        grown = torch.full((cap,) + v.shape[1:], fill, dtype=v.dtype, device=v.device)
                        grown[:v.shape[0]] = v
                    st[k] = grown
            self._cap, self._width = cap, width
        return torch.tensor([self._lane[r] for r in ids], dtype=torch.int64, device=self.device)

    def _state(self, layer: int) -> dict[str, torch.Tensor]:
        st = self._layers.get(layer)
        if st is None:
            W, dev = self.width, self.device
            st = self._layers[layer] = {
                "pos": torch.full((self._cap, W), -1, dtype=torch.int64, device=dev),
                "x": torch.zeros((self._cap, W), dtype=torch.float32, device=dev),
                "mirror": torch.zeros((self._cap, W), dtype=torch.bool, device=dev),
                "seen": torch.zeros((self._cap,), dtype=torch.bool, device=dev),
                # entry of the working set holding each position, -1 = none
                "owner": torch.full((self._cap, self._width), -1, dtype=self._odt, device=dev)}
        return st

    def drop(self, req_id: int) -> None:
        lane = self._lane.pop(req_id, None)
        if lane is None:
            return
        for st in self._layers.values():
            st["seen"][lane] = False
            st["pos"][lane] = -1
            st["owner"][lane] = -1
        self._free_lanes.append(lane)

    # ---- sampling --------------------------------------------------------------------
    def _set_owner(self, own: torch.Tensor, ln: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                   value: torch.Tensor | int) -> None:
        """owner[ln[t], pos[t, j]] = value (entry j, or -1) where ``mask``."""
        r, j = mask.nonzero(as_tuple=True)
        if r.numel():
            v = j.to(own.dtype) if isinstance(value, str) else torch.full_like(j, value, dtype=own.dtype)
            own.view(-1)[ln[r] * own.shape[1] + pos[r, j]] = v

    def _fill(self, own: torch.Tensor, ln: torch.Tensor, pos: torch.Tensor, fill: torch.Tensor,
              hi: torch.Tensor) -> torch.Tensor:
        """Fresh distinct positions in [sinks, hi) for the ``fill`` entries of each row.

        own: the layer's owner map [cap, P] (updated); ln: int64 [T] lanes; pos: int64
        [T, W] (-1 = empty); fill: bool [T, W] (empty entries to fill); hi: int64 [T].
        Entries beyond the region's free positions stay -1. Rows with a region under
        4 W positions are drawn exactly, the others by rejection against the owner map.
        """
        lo, W = self.sinks, pos.shape[1]
        span = (hi - lo).clamp(min=0)
        room = span - (pos >= 0).sum(1)
        fill = fill & (torch.cumsum(fill.long(), 1) <= room[:, None])
        dense = span < 4 * W
        if bool((fill & dense[:, None]).any()):
            d = dense.nonzero().flatten()
            fd = fill[d]
            k = int(fd.sum(1).max())
            ex = torch.where(pos[d] >= 0, pos[d] - lo, torch.full_like(pos[d], -1))
            cand = sample_distinct(span[d], k, self.gen, exclude=ex).long()
            new = torch.gather(cand, 1, (torch.cumsum(fd.long(), 1) - 1).clamp(min=0, max=k - 1))
            fd &= new >= 0
            pd = torch.where(fd, new + lo, pos[d])
            pos[d] = pd
            self._set_owner(own, ln[d], pd, fd, "entry")
            fill = fill & ~dense[:, None]
        r, j = fill.nonzero(as_tuple=True)
        P = own.shape[1]
        for _ in range(64):
            if r.numel() == 0:
                return pos
            u = torch.rand(r.shape, generator=self.gen, device=self.device)
            cand = lo + (u * span[r]).long().clamp(max=(span[r] - 1).clamp(min=0))
            flat = ln[r] * P + cand
            ok = own.view(-1)[flat] < 0
            srt, order = torch.sort(flat)
            dup = torch.zeros_like(ok)
            dup[order[1:]] = srt[1:] == srt[:-1]  # a position drawn twice: the first keeps it
            ok &= ~dup
            pos[r[ok], j[ok]] = cand[ok]
            own.view(-1)[flat[ok]] = j[ok].to(own.dtype)
            r, j = r[~ok], j[~ok]
        raise RuntimeError("workingset: could not draw distinct positions in 64 rounds")

    def select(self, layer, req_ids, seq_lens, step):  # noqa: D102 (see TopkSource)
        T, K, W = int(req_ids.numel()), self.top_k, self.width
        n = seq_lens.to(torch.int64)
        ln = self._lanes(req_ids.tolist(), int(n.max()) + 1 if T else 1)
        st = self._state(layer)
        own = st["owner"]
        pos, x, seen = st["pos"][ln], st["x"][ln], st["seen"][ln]
        dev, rho = self.device, self.persistence
        noise = torch.randn((T, W), generator=self.gen, device=dev)
        x = torch.where(seen[:, None], rho * x + (1.0 - rho * rho) ** 0.5 * noise, noise)
        mirror = torch.zeros((T, W), dtype=torch.bool, device=dev)
        prev = self._layers.get(layer - 1)
        if self.layer_overlap > 0 and prev is not None:
            draw = torch.rand((T, W), generator=self.gen, device=dev) < self.layer_overlap
            mirror = torch.where(seen[:, None], st["mirror"][ln], draw)
            st["mirror"][ln] = mirror
            mirror = mirror & prev["seen"][ln][:, None]
        renew = (torch.rand((T, W), generator=self.gen, device=dev) < self.drift)
        renew &= seen[:, None] & (pos >= 0) & ~mirror
        self._set_owner(own, ln, pos, renew, -1)
        pos = torch.where(renew, torch.full_like(pos, -1), pos)
        x = torch.where(renew, torch.randn((T, W), generator=self.gen, device=dev), x)
        if bool(mirror.any()):
            ppos = prev["pos"][ln]
            change = mirror & (ppos != pos)
            self._set_owner(own, ln, pos, change & (pos >= 0), -1)
            r, j = (change & (ppos >= 0)).nonzero(as_tuple=True)
            if r.numel():  # an own entry at a mirrored entry's new position is replaced
                flat = ln[r] * own.shape[1] + ppos[r, j]
                holder = own.view(-1)[flat].long()
                c = holder >= 0
                pos[r[c], holder[c]] = -1
                own.view(-1)[flat] = j.to(own.dtype)
            pos = torch.where(mirror, ppos, pos)
            x = torch.where(mirror, prev["x"][ln], x)
        pos = self._fill(own, ln, pos, ~mirror & (pos < 0), n - self.recent)
        st["pos"][ln], st["x"][ln], st["seen"][ln] = pos, x, True
        # selection: sinks, the best K' candidates, the recent window
        kf = min(self.free, W)
        score = torch.where(pos >= 0, x, torch.full_like(x, -float("inf")))
        chosen = torch.gather(pos, 1, torch.topk(score, kf, dim=1, sorted=False).indices)
        sinks = torch.arange(self.sinks, device=dev).expand(T, self.sinks)
        recent = n[:, None] - self.recent + torch.arange(self.recent, device=dev)[None, :]
        out = torch.cat([sinks, chosen, recent], dim=1)
        if out.shape[1] < K:
            out = torch.cat([out, torch.full((T, K - out.shape[1]), -1, dtype=torch.int64, device=dev)], 1)
        every = torch.arange(K, device=dev)[None, :].expand(T, K)
        every = torch.where(every < n[:, None], every, torch.full_like(every, -1))
        return torch.where((n > K)[:, None], out, every).to(torch.int32)


__all__ = ["TopkSource", "UniformSource", "CorrelatedSource", "IndexerSource", "WorkingSetSource", "WORKINGSET_DRIFT",
           "WORKINGSET_SINKS", "WORKINGSET_RECENT", "WORKINGSET_POOL", "workingset_width", "workingset_state_bytes",
           "sample_distinct"]
