"""A multi-step decode trace with joins and leaves, run through the engine façade in
three ways that must leave the same cache: ``eager`` (unpadded batches), ``padded``
(``prepare_for_batch(md, pad_to=bucket)``, per-layer calls eager) and ``graph`` (the
per-layer calls of a bucket captured once in a CUDA graph and replayed; CUDA only).

Rows are real fp8_ds_mla rows derived from (layer, request, position), so hot rows,
host rows and physical indices can be checked byte-exact against the truth.
Used by tests/test_graph_step.py (CPU) and tests/test_graph_step_gpu.py.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from hisparse import HiSparseConfig
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.formats import quantize_fp8_ds_mla_reference

BUCKETS = (1, 2, 4, 6)


@dataclasses.dataclass(frozen=True)
class TraceShape:
    layers: int = 2
    top_k: int = 8
    slots: int = 16  # LRU slots per (layer, request)
    block: int = 4
    max_reqs: int = 6
    max_len: int = 64
    query_len: int = 1
    pool_rows: int | None = None  # device_pool_rows (the elastic tier), None = no pool


class RecordingGraphs:
    """A CPU stand-in for ``hisparse.engine.layer_graphs.CudaGraphBackend``: a capture
    records the calls of the cache's launch functions without running them; a replay
    runs them again, in order, with the same arguments (what a CUDA graph's replay of
    those launches does). ``fail_capture``: the next capture raises after its first
    recorded launch (a capture that fails part way)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.fail_capture = False

    def targets(self) -> list[tuple[object, str]]:
        """(object, attribute) of each function a capture records."""
        c = self.cache
        return [(c.kernel_set, name) for name in ("apply_write", "mirror", "resolve", "copy_staged", "lookup",
                                                  "resolve_resident")]

    def capture(self, fn):
        calls = []
        saved = [(o, n, getattr(o, n)) for o, n in self.targets()]

        def recorder(f):
            def rec(*a, **k):
                calls.append((f, a, k))
                if self.fail_capture:
                    self.fail_capture = False
                    raise RuntimeError("capture failed (injected)")
            return rec

        for obj, name, f in saved:
            setattr(obj, name, recorder(f))
        try:
            fn()
        finally:
            for obj, name, f in saved:
                setattr(obj, name, f)
        return calls

    def replay(self, calls) -> None:
        for f, a, k in calls:
            f(*a, **k)


class KernelGraphs(RecordingGraphs):
    """A stricter CPU stand-in (Triton kernels only): a capture records the kernel
    launchers alone (the write, resolve and lookup launches and the two copy kernels),
    below the Python wrappers around them, so a replay re-runs no host-side check or
    decision of those wrappers, as a CUDA graph's replay does not."""

    def targets(self) -> list[tuple[object, str]]:
        import hisparse.cache.kernel_set as cache_module
        c = self.cache
        return [*((c.kernel_set, name) for name in ("apply_write", "resolve", "lookup", "resolve_resident")),
                (cache_module, "copy_rows_unchecked"), (cache_module, "copy_staged_unchecked")]


def make_group(shape: TraceShape, device: str, kernels: str, *, validate: bool = False,
               layer_graphs: str | None = None) -> HiSparseIndexGroup:
    """``layer_graphs``: None, "cuda" (``layer_graphs=True``), "recording" or "kernels"
    (the CPU stand-ins ``RecordingGraphs`` and ``KernelGraphs``)."""
    cfg = HiSparseConfig(num_layers=shape.layers, row_bytes=656, top_k=shape.top_k,
                         device_buffer_size=shape.slots, max_num_reqs=shape.max_reqs,
                         host_block_size=shape.block, host_pool_tokens=shape.max_reqs * shape.max_len,
                         max_query_len=shape.query_len, max_request_id=64, device=device,
                         device_pool_rows=shape.pool_rows)
    g = HiSparseIndexGroup(cfg, validate=validate, kernels=kernels, layer_graphs=layer_graphs == "cuda")
    if layer_graphs in ("recording", "kernels"):
        from hisparse.engine.layer_graphs import LayerGraphs
        backend = RecordingGraphs if layer_graphs == "recording" else KernelGraphs
        g._layer_graphs = LayerGraphs(g.hisparse_cache, backend(g.hisparse_cache))
    for _ in range(shape.layers):
        g.register_layer(kv_cache_dtype="fp8_ds_mla")
    return g


class Truth:
    """The row of every (layer, request, position)."""

    def __init__(self, shape: TraceShape) -> None:
        self.shape = shape
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def rows(self, layer: int, rid: int) -> torch.Tensor:
        key = (layer, rid)
        if key not in self._rows:
            g = torch.Generator().manual_seed(7919 * layer + rid)
            self._rows[key] = quantize_fp8_ds_mla_reference(torch.randn(self.shape.max_len, 576, generator=g))
        return self._rows[key]


def bucket_of(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


def plan_trace(shape: TraceShape, steps: int, seed: int) -> list[dict]:
    """A list of events: {"join": rid, "prompt": n} | {"leave": rid} | {"decode": [rids],
    "topk": {layer: int32 [T, K]}} with distinct positions below each token's length."""
    rng = random.Random(seed)
    live: dict[int, int] = {}
    next_id, out = 0, []
    q = shape.query_len
    for _ in range(steps):
        if live and (len(live) == shape.max_reqs or rng.random() < 0.2):
            rid = rng.choice(sorted(live))
            out.append({"leave": rid})
            del live[rid]
        if len(live) < shape.max_reqs and (not live or rng.random() < 0.35):
            n = rng.randrange(3, shape.slots + 12)  # some fit the LRU slots, some do not
            out.append({"join": next_id, "prompt": n})
            live[next_id] = n
            next_id += 1
        rids = sorted(r for r in live if live[r] + q <= shape.max_len)
        if not rids:
            continue
        topk = {}
        for layer in range(shape.layers):
            t = torch.full((len(rids) * q, shape.top_k), -1, dtype=torch.int32)
            for i, rid in enumerate(rids):
                for j in range(q):
                    visible = live[rid] + j + 1
                    k = min(shape.top_k, visible) if rng.random() > 0.1 else rng.randrange(1, shape.top_k)
                    k = min(k, visible)
                    pos = rng.sample(range(visible), k)
                    t[i * q + j, :k] = torch.tensor(pos, dtype=torch.int32)
            topk[layer] = t
        out.append({"decode": rids, "topk": topk})
        for rid in rids:
            live[rid] += q
    return out


class Runner:
    """Runs a planned trace through one group in one mode; records each decode step's
    physical indices (the batch's rows only)."""

    def __init__(self, shape: TraceShape, mode: str, device: str, kernels: str, truth: Truth, *,
                 attention: tuple | None = None, heads: int = 16, layer_graphs: str | None = None,
                 in_place: bool = False, own_buffers: bool = False) -> None:
        """attention: (backend, overlap) to run ``decode_attention`` per layer (its
        outputs recorded) instead of the conversion (physical indices recorded).
        layer_graphs: ``make_group``'s. in_place: padded forwards write each layer's rows
        and top-k into ``layer_input_buffers`` and pass those. own_buffers: padded
        forwards write them into buffers of the runner's own, one pair per (layer,
        bucket), and pass those (tensors at a steady address, not the group's)."""
        self.shape, self.mode, self.device, self.truth = shape, mode, device, truth
        self.attention, self.heads = attention, heads
        self.in_place, self.own_buffers = in_place, own_buffers
        self.own: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.step_no = 0
        self.group = make_group(shape, device, kernels, layer_graphs=layer_graphs)
        self.lens: dict[int, int] = {}
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph or None, rows, topk, phys)
        self.seen: dict[int, int] = {}  # bucket -> steps run in it
        self.phys: list[list[torch.Tensor]] = []

    def _md(self, rids, qlens, num_decodes: int) -> SparseMLAMetadata:
        return SparseMLAMetadata.build(request_ids=list(rids), query_lens=list(qlens),
                                       seq_lens=[self.lens[r] + n for r, n in zip(rids, qlens)],
                                       num_decodes=num_decodes, device=self.device)

    def _rows(self, layer: int, rids, qlens, pad_tokens: int | None = None) -> torch.Tensor:
        parts = [self.truth.rows(layer, r)[self.lens[r]:self.lens[r] + n] for r, n in zip(rids, qlens)]
        rows = torch.cat(parts)
        if pad_tokens is not None and pad_tokens > rows.shape[0]:  # padding rows: never read
            rows = torch.cat([rows, torch.full((pad_tokens - rows.shape[0], 656), 0xAB, dtype=torch.uint8)])
        return rows.to(self.device)

    def _q(self, layer: int, T: int) -> torch.Tensor:
        """bf16 [T, H, 576] queries of this step and layer (deterministic)."""
        g = torch.Generator().manual_seed(104729 * self.step_no + layer)
        return (torch.randn(T, self.heads, 576, generator=g) * 0.5).to(torch.bfloat16).to(self.device)

    def _layer_call(self, layer: int, q, tk, md) -> torch.Tensor:
        g = self.group
        if self.attention is None:
            return g.convert_decode_logical_to_physical_topk(layer, tk, md)
        backend, overlap = self.attention
        out, _ = g.decode_attention(layer, q, tk, md, backend=backend, sm_scale=576 ** -0.5, overlap=overlap)
        return out

    def event(self, ev: dict) -> None:
        g = self.group
        if "leave" in ev:
            g.free_request(ev["leave"])
            del self.lens[ev["leave"]]
        elif "join" in ev:
            rid, n = ev["join"], ev["prompt"]
            g.add_request(rid)
            self.lens[rid] = 0
            md = self._md([rid], [n], 0)
            g.prepare_for_batch(md)
            for layer in range(self.shape.layers):
                g.write_new_rows(layer, self._rows(layer, [rid], [n]), md)
            self.lens[rid] = n
        else:
            self._decode(ev["decode"], ev["topk"])

    def _decode(self, rids: list[int], topk: dict) -> None:
        g, q, L = self.group, self.shape.query_len, self.shape.layers
        md = self._md(rids, [q] * len(rids), len(rids))
        td = len(rids) * q
        self.step_no += 1
        if self.mode == "eager":
            g.prepare_for_batch(md)
            phys = []
            for layer in range(L):
                g.write_new_rows(layer, self._rows(layer, rids, [q] * len(rids)), md)
                tk = topk[layer].to(self.device)
                phys.append(self._layer_call(layer, self._q(layer, td), tk, md).clone())
        else:
            n = bucket_of(len(rids))
            T = n * q
            rows = [self._rows(layer, rids, [q] * len(rids), T) for layer in range(L)]
            qs = [self._q(layer, T) for layer in range(L)]
            for x, layer in zip(qs, range(L)):
                x[td:] = 0  # padding tokens' queries (their top-k rows are -1)
                x[:td] = self._q(layer, td)
            tks = []
            for layer in range(L):
                t = torch.full((T, self.shape.top_k), -1, dtype=torch.int32)
                t[:td] = topk[layer]
                tks.append(t.to(self.device))
            seen = self.seen.get(n, 0)
            self.seen[n] = seen + 1
            if self.mode == "padded" or seen == 0:  # eager (the graph mode's warm-up of the bucket)
                g.prepare_for_batch(md, pad_to=n)
                phys = []
                for layer in range(L):
                    r, tk = rows[layer], tks[layer]
                    if self.in_place and self.mode == "padded":
                        r, tk = g.layer_input_buffers(md)
                        r.copy_(rows[layer])
                        tk.copy_(tks[layer])
                    elif self.own_buffers and self.mode == "padded":
                        if (layer, n) not in self.own:
                            self.own[(layer, n)] = (torch.empty_like(r), torch.empty_like(tk))
                        r, tk = (o.copy_(x) for o, x in zip(self.own[(layer, n)], (r, tk)))
                    g.write_new_rows(layer, r, md)
                    phys.append(self._layer_call(layer, qs[layer], tk, md).clone())
            else:
                phys = self._graph_step(md, n, rows, tks, qs)
            for p in phys:
                if self.attention is None:
                    assert torch.all(p[td:] == -1), "padding tokens resolved to rows"
                else:
                    assert torch.all(p[td:] == 0), "padding tokens attended to rows"
            phys = [p[:td] for p in phys]
        self.phys.append([p.cpu() for p in phys])
        for rid in rids:
            self.lens[rid] += q

    def _graph_step(self, md, n: int, rows, tks, qs) -> list[torch.Tensor]:
        g, L = self.group, self.shape.layers
        got = self.graphs.get(n)
        if got is None:  # capture this step's calls, then replay them once
            s_rows = [r.clone() for r in rows]
            s_tk = [t.clone() for t in tks]
            s_q = [x.clone() for x in qs]
            g.prepare_for_batch(md, pad_to=n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = []
                for layer in range(L):
                    g.write_new_rows(layer, s_rows[layer], md)
                    outs.append(self._layer_call(layer, s_q[layer], s_tk[layer], md))
            got = self.graphs[n] = (graph, s_rows, s_tk, s_q, outs)
        else:
            graph, s_rows, s_tk, s_q, outs = got
            for layer in range(L):
                s_rows[layer].copy_(rows[layer])
                s_tk[layer].copy_(tks[layer])
                s_q[layer].copy_(qs[layer])
            g.prepare_for_batch(md, pad_to=n, replay=True)
        graph.replay()
        return [o.clone() for o in outs]

    def check_rows(self) -> None:
        """Every stored position of every live request: host row and (when hot) the hot
        row byte-exact against the truth."""
        c = self.group.hisparse_cache
        for rid, n in self.lens.items():
            for layer in range(self.shape.layers):
                assert c.request(rid).lengths[layer] == n, (rid, layer)
                host = c.read_host_rows(layer, rid, list(range(n)))
                assert torch.equal(host, self.truth.rows(layer, rid)[:n]), f"host rows of {rid} layer {layer}"


def _stall_stage(r: Runner, cycles: int) -> None:
    """On CUDA, hold the cache's stage stream for ``cycles`` GPU clocks before the next
    eager staging, so that a replay not ordered after that staging runs first and
    leaves another cache (instead of only sometimes)."""
    stage = r.group.hisparse_cache.streams.stage_stream
    if cycles and stage is not None:
        with torch.cuda.stream(stage):
            torch.cuda._sleep(cycles)


def mixed_decode(r: Runner, rids, topk, stall: int = 0) -> list[torch.Tensor]:
    """A padded decode step of ``r`` whose layer 1 converts with ``wait=False`` and
    whose layers >= 1 are prefetched from the layer before: eager calls between the
    layer graphs' replays. Returns the batch's physical indices per layer. ``stall``:
    GPU clocks the stage stream idles before each of those eager calls."""
    g, L, q = r.group, r.shape.layers, r.shape.query_len
    md = r._md(rids, [q] * len(rids), len(rids))
    n = bucket_of(len(rids))
    T, td = n * q, len(rids) * q
    g.prepare_for_batch(md, pad_to=n)
    phys, tks = [], []
    for layer in range(L):
        t = torch.full((T, r.shape.top_k), -1, dtype=torch.int32)
        t[:td] = topk[layer]
        tks.append(t.to(r.device))
    for layer in range(L):
        g.write_new_rows(layer, r._rows(layer, rids, [q] * len(rids), T), md)
        if layer:
            _stall_stage(r, stall)
            g.prefetch(layer, tks[layer - 1], md)
        wait = layer != 1
        if not wait:
            _stall_stage(r, stall)
        p = g.convert_decode_logical_to_physical_topk(layer, tks[layer], md, wait=wait)
        if not wait:
            g.wait_for_staging(layer)
        phys.append(p[:td].clone())
    for rid in rids:
        r.lens[rid] += q
    return phys


def run_mixed(device: str, kernels: str, layer_graphs: str, *, steps: int, seed: int = 7,
              stall: int = 0) -> None:
    """A padded group with per-layer graphs (``layer_graphs``: ``make_group``'s) and one
    without run the same trace through ``mixed_decode`` (``stall``: its stage-stream
    stall before each eager call): both must leave the same cache after every forward,
    and the graphs must have been replayed."""
    shape = TraceShape(layers=3)
    truth = Truth(shape)
    trace = plan_trace(shape, steps=steps, seed=seed)
    a = Runner(shape, "padded", device, kernels, truth)
    b = Runner(shape, "padded", device, kernels, truth, layer_graphs=layer_graphs)
    for i, ev in enumerate(trace):
        if "decode" not in ev:
            a.event(ev)
            b.event(ev)
            continue
        pa = mixed_decode(a, ev["decode"], ev["topk"], stall)
        pb = mixed_decode(b, ev["decode"], ev["topk"], stall)
        if device == "cuda":
            torch.cuda.synchronize()
        same_after_step(i, pa, pb, a.group, b.group)
        b.check_rows()
    counts = b.group.layer_graphs()
    assert counts["replays"] >= 2 * steps // 3, counts
    assert b.group.stats()["total"]["prefetch_rows"] > 0


def same_after_step(i: int, pa, pb, a_group, b_group, *, atol: float | None = None) -> None:
    """Event ``i``'s per-layer outputs ``pa`` / ``pb`` (physical indices, or attention
    outputs within ``atol``) and every cache state tensor of the two groups agree."""
    for layer, (x, y) in enumerate(zip(pa, pb)):
        if atol is None:
            assert torch.equal(x, y), f"event {i} layer {layer}: physical indices differ"
        else:
            torch.testing.assert_close(y.float(), x.float(), atol=atol, rtol=0.02, msg=f"event {i} layer {layer}")
    assert_same_state(cache_state(a_group), cache_state(b_group), f"event {i}: state {{}} differs")


def run_pair(trace: list[dict], a: "Runner", b: "Runner", *, atol: float | None = None,
             check_rows: bool = False) -> None:
    """Run ``trace`` through both runners; after every decode event their outputs and
    cache states must agree (``same_after_step``), and with ``check_rows`` every row of
    ``b``'s host pool must equal the truth."""
    for i, ev in enumerate(trace):
        a.event(ev)
        b.event(ev)
        if "decode" not in ev:
            continue
        if a.device == "cuda":
            torch.cuda.synchronize()
        same_after_step(i, a.phys[-1], b.phys[-1], a.group, b.group, atol=atol)
        if check_rows:
            b.check_rows()


def decode_md(rids, lens) -> SparseMLAMetadata:
    """A one-token decode of ``rids`` whose contexts are ``lens[rid]`` rows."""
    return SparseMLAMetadata.build(request_ids=rids, query_lens=[1] * len(rids),
                                   seq_lens=[lens[r] + 1 for r in rids], num_decodes=len(rids))


def join(g: HiSparseIndexGroup, rid: int, n: int, truth: Truth, lens: dict) -> None:
    """Admit ``rid`` and write its first ``n`` rows of every layer (one unpadded forward)."""
    g.add_request(rid)
    md = SparseMLAMetadata.build(request_ids=[rid], query_lens=[n], seq_lens=[n], num_decodes=0)
    g.prepare_for_batch(md)
    for layer in range(g.config.num_layers):
        g.write_new_rows(layer, truth.rows(layer, rid)[:n], md)
    lens[rid] = n


def assert_same_state(a: dict, b: dict, what: str = "{}") -> None:
    """Two ``cache_state`` snapshots hold equal tensors (``what``: the message, ``{}``
    the differing key)."""
    for k in a:
        assert torch.equal(a[k], b[k]), what.format(k)


def cache_state(g: HiSparseIndexGroup) -> dict:
    c = g.hisparse_cache
    st = c.state
    snap = {k: getattr(st, k).cpu().clone() for k in ("id_to_slot", "seq_lens", "block_table", "slot_pos",
                                                       "slot_stamp", "row_slot", "step", "stats")}
    snap["hot"] = c.hot.cpu().clone()
    return snap


__all__ = ["TraceShape", "Truth", "Runner", "RecordingGraphs", "plan_trace", "cache_state", "assert_same_state",
           "bucket_of",
           "BUCKETS", "mixed_decode", "run_mixed"]
