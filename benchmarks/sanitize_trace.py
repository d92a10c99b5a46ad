"""A small trace of the cache's GPU kernels and the decode attention, for compute-sanitizer.

  compute-sanitizer --tool memcheck  python -m benchmarks.sanitize_trace
  compute-sanitizer --tool racecheck python -m benchmarks.sanitize_trace
  (also useful: --tool synccheck, --tool initcheck; ``bash benchmarks/gpu_run.sh
  sanitize`` runs the first two and keeps their reports)
  TRITON_INTERPRET=1 python -m benchmarks.sanitize_trace --cpu   # the script itself, no GPU

Two parts, each checked against the torch reference after every step; shapes are small
so each sanitizer tool finishes in a few minutes, and the kernels' code paths are the
ones production shapes take.

1. Kernels directly: several decode steps of resolve_triton + copy_rows (pinned host
   pool -> hot rows over UVA) for a few requests with q = 2, including padding,
   duplicates and, in the last steps, garbage entries (validation off); requests 3 and
   4 fit their buffers, so every step of theirs takes the kernel's all-hit path (the
   miss sort, gather, barriers, atomics and the persistent copy loop otherwise).
2. The engine facade (``HiSparseIndexGroup``, Triton kernels beside a torch-kernel
   twin fed the same trace), fp8_ds_mla rows, 2 layers: chunked prefill and mixed
   decode + prefill batches whose rows go through the batched write kernel
   (apply_write), prefill staging into a bf16 workspace (fp8 dequantised) and in the
   stored format (stage_prefill), decode steps with q = 1 and q = 2 (resolve + miss
   staging, copy_rows), a request leaving; then the Triton decode attention over the
   hot rows with 16 heads (the ``tl`` kernel) and 64 and 128 heads (on SM 9.x the
   warp-specialised Gluon kernel), each with its split combine, against the float32
   reference. Every staged or hot row is compared byte-exact with the row written.
   Every other decode-only forward runs padded to a bucket one request larger
   (``prepare_for_batch(pad_to=)``, as a graph-capturing engine's eager steps do): the
   write kernel skips the -1 padding entries of its persistent plan buffers and the
   resolve the padding tokens' all -1 rows.

Not covered: ``convert_topk_to_physical`` (an engine's own paged-table conversion) and
decode over bf16 rows.

Prints "OK" per part and exits 0 on success; any mismatch raises.
"""

from __future__ import annotations

import argparse
import math
import random
import sys

import torch

from hisparse.attention import ReferenceBackend, TritonBackend, default_config
from hisparse.cache import (HiSparseCache, HotState, ResolveBuffers, copy_rows, copy_rows_reference, resolve_reference,
                            resolve_triton)
from hisparse.decode import DecodeLayer, Overlap
from hisparse.config import HiSparseConfig, RowFormat
from hisparse.device import PinnedBuffer
from hisparse.engine import HiSparseIndexGroup, SparseMLAMetadata
from hisparse.formats import quantize_fp8_ds_mla

FIELDS = ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot", "host_block",
          "step", "stats", "resident", "page_table")


def build(cfg: HiSparseConfig, seqs: dict[int, int], rng: random.Random) -> HotState:
    st = HotState.allocate(cfg, torch.device("cpu"))
    S, B = cfg.device_buffer_size, cfg.host_block_size
    blocks = list(range(cfg.num_host_blocks))
    rng.shuffle(blocks)
    for r, (rid, seq) in enumerate(seqs.items()):
        nb = -(-seq // B)
        st.id_to_slot[rid] = r
        st.seq_lens[:, r] = seq
        st.block_table[r, :nb] = torch.tensor(blocks[:nb], dtype=torch.int32)
        blocks = blocks[nb:]
        for p in list(range(min(seq, S))) + ([seq - 1] if seq > S else []):
            s = min(p, S)
            st.slot_pos[0, r, s] = p
            st.slot_stamp[0, r, s] = 0
            st.row_slot[0, int(st.block_table[r, p // B]) * B + p % B] = s
    return st


def kernel_trace(dev: torch.device) -> None:
    """Part 1: resolve_triton + copy_rows against their references on a hand-built state."""
    K, q, S, B, W = 32, 2, 64, 8, 656
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=4096, top_k=K, device_buffer_size=S,
                         max_num_reqs=4, max_query_len=q, host_block_size=B, max_request_id=8,
                         device=dev.type)
    rng = random.Random(0)
    seqs = {1: 300, 3: 40, 4: 65, 6: 700}
    cpu_state = build(cfg, seqs, rng)
    ref = HotState(**{f: getattr(cpu_state, f).to(dev) for f in FIELDS}, S=S, B=B)
    tri = ref.clone()
    H = cfg.num_host_rows
    pool = PinnedBuffer(H * W, pin=dev.type == "cuda").tensor.view(H, W)
    pool.random_(0, 256)
    hot_ref = torch.zeros(cfg.hot_rows_per_layer, W, dtype=torch.uint8, device=dev)
    hot_tri = hot_ref.clone()
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        req, rows = [], []
        for rid, seq in seqs.items():
            for _ in range(rng.randint(1, q)):
                req.append(rid)
                rows.append(torch.randint(-1, seq, (K,), generator=g))
        topk = torch.stack(rows).to(torch.int32)
        req_t = torch.tensor(req, dtype=torch.int32)
        if step >= 6:  # garbage entries, as with validation off
            topk[0, :4] = torch.tensor([-7, 10**6, 2**31 - 1, -(2**31)], dtype=torch.int32)
            req_t[-1] = 99
        T = req_t.numel()
        req_d, topk_d = req_t.to(dev), topk.to(dev)
        oa, ob = ResolveBuffers.allocate(T, K, dev), ResolveBuffers.allocate(T, K, dev)
        resolve_reference(ref, 0, req_d, topk_d, oa, max_query_len=q, compact=step % 2 == 1)
        resolve_triton(tri, 0, req_d, topk_d, ob, max_query_len=q, compact=step % 2 == 1)
        copy_rows_reference(pool, oa.stage_src[:T * K].cpu(), hot_ref, oa.stage_dst[:T * K].cpu())
        copy_rows(pool, ob.stage_src[:T * K], hot_tri, ob.stage_dst[:T * K])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        for f in FIELDS:
            if not torch.equal(getattr(ref, f), getattr(tri, f)):
                raise RuntimeError(f"step {step}: state.{f} differs from the reference")
        for f in ("physical", "valid_counts", "stage_src", "stage_dst"):
            if not torch.equal(getattr(oa, f), getattr(ob, f)):
                raise RuntimeError(f"step {step}: out.{f} differs from the reference")
        if not torch.equal(hot_ref, hot_tri):
            raise RuntimeError(f"step {step}: staged hot rows differ from the reference")
    print("OK: 8 steps of resolve + staging match the reference; stats",
          tri.stats[0].tolist())


# ---------------------------------------------------------------------- part 2
ATOL, RTOL, LSE_TOL = 2e-2, 1e-2, 1e-3  # decode attention vs the float32 reference
FP8 = RowFormat.FP8_DS_MLA
# (decode request ids, decode query length, {prefill request id: rows this forward}, leaving)
TRACE = [
    ([], 1, {1: 90, 2: 200}, []),
    ([1, 2], 1, {3: 200}, []),  # request 3's prefill in two chunks, beside decodes
    ([1, 2], 1, {3: 133}, []),
    ([1, 2, 3], 1, {}, []),
    ([1, 2, 3], 1, {5: 150}, []),
    ([1, 2, 3, 5], 2, {}, [2]),  # multi-token decode; request 2 leaves after it
    ([1, 3, 5], 1, {}, []),
    ([1, 3, 5], 2, {}, []),
]


class EngineTrace:
    """Part 2: the facade with Triton kernels and a torch-kernel twin, fed the same
    calls; ``rows`` keeps every row written (uint8 [n, 656] CPU per (layer, request)),
    the truth each staged and hot row is compared with."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.L, self.K = 2, 64
        cfg = HiSparseConfig(num_layers=self.L, host_pool_tokens=2048, top_k=self.K,
                             device_buffer_size=2 * self.K, max_num_reqs=4, max_query_len=2,
                             host_block_size=16, max_request_id=8, device=dev.type)
        self.groups = [HiSparseIndexGroup(cfg, kernels="triton"),
                       HiSparseIndexGroup(cfg, kernels="torch")]
        for g in self.groups:
            for _ in range(self.L):
                g.register_layer(kv_cache_dtype="fp8_ds_mla")
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self.gen = torch.Generator(device=dev).manual_seed(3)
        self.cpu_gen = torch.Generator().manual_seed(4)
        self.attention = TritonBackend(allow_interpreter=not self.cuda)
        self.heads = (16, 64, 128) if self.cuda else (16,)  # the interpreter is slow
        self.kernels_used: set[str] = set()
        self.attention_checks = 0
        self.padded_forwards = 0

    def length(self, rid: int) -> int:
        t = self.rows.get((0, rid))
        return 0 if t is None else t.shape[0]

    def run(self) -> None:
        for step, (dec, q, pre, leave) in enumerate(TRACE):
            self.forward(step, dec, q, pre)
            for rid in leave:
                for g in self.groups:
                    g.free_request(rid)
                for layer in range(self.L):
                    del self.rows[(layer, rid)]
        a, b = (g.stats()["layers"] for g in self.groups)
        if a != b:
            raise RuntimeError(f"cache counters differ between the kernels: {a} vs {b}")
        if not self.padded_forwards:
            raise RuntimeError("the trace ran no padded forward")
        print(f"OK: {len(TRACE)} forwards ({self.padded_forwards} padded) through the facade (writes, prefill staging, resolve "
              f"+ miss staging) match the torch kernels and the rows written; "
              f"{self.attention_checks} decode attention checks ({', '.join(sorted(self.kernels_used))}) "
              f"within tolerance of the reference; stats {a}")

    def forward(self, step: int, dec: list[int], q: int, pre: dict[int, int]) -> None:
        for rid in pre:
            if self.length(rid) == 0:
                for g in self.groups:
                    g.add_request(rid)
        ids = dec + list(pre)
        qlens = [q] * len(dec) + list(pre.values())
        seqs = [self.length(r) + n for r, n in zip(ids, qlens)]
        md = SparseMLAMetadata.build(request_ids=ids, query_lens=qlens, seq_lens=seqs,
                                     num_decodes=len(dec), device=self.dev)
        pad = min(len(dec) + 1, 4) if dec and not pre and step % 2 else None  # a bucket one request larger (max_num_reqs 4)
        for g in self.groups:
            g.prepare_for_batch(md, pad_to=pad)
        self.padded_forwards += pad is not None and pad > len(dec)  # forwards with padding tokens
        T = sum(qlens)
        T_pad = T if pad is None else pad * q
        # query token t's context bound (the causal limit of a multi-token decode)
        bounds = [s - n + j + 1 for s, n in zip(seqs[:len(dec)], qlens) for j in range(n)]
        owners = [r for r, n in zip(dec, qlens) for _ in range(n)]
        for layer in range(self.L):
            new = quantize_fp8_ds_mla(torch.randn(T_pad, 576, generator=self.gen, device=self.dev))
            for g in self.groups:  # with padding: the rows past T are never read
                g.write_new_rows(layer, new, md)
            new_cpu, t0 = new[:T].cpu(), 0
            for rid, n in zip(ids, qlens):
                old = self.rows.get((layer, rid), new_cpu[:0])
                self.rows[(layer, rid)] = torch.cat([old, new_cpu[t0:t0 + n]])
                t0 += n
            if dec:
                self.decode(step, layer, md, owners, bounds + [0] * (T_pad - T))
            if pre:
                self.prefill(step, layer, md, list(pre))

    def _topk(self, bounds: list[int]) -> torch.Tensor:
        """int32 [Td, K]: random positions below each token's bound, the newest first,
        about 10% padding and some duplicates; bound 0 (a padding token): all -1."""
        out = []
        for b in bounds:
            if b == 0:
                out.append(torch.full((self.K,), -1, dtype=torch.int32))
                continue
            x = torch.randint(0, b, (self.K,), generator=self.cpu_gen, dtype=torch.int32)
            x[torch.rand(self.K, generator=self.cpu_gen) < 0.1] = -1
            x[0] = b - 1
            out.append(x)
        return torch.stack(out).to(self.dev)

    def decode(self, step: int, layer: int, md, owners: list[int], bounds: list[int]) -> None:
        topk = self._topk(bounds)
        phys = [g.convert_decode_logical_to_physical_topk(layer, topk, md) for g in self.groups]
        if not torch.equal(phys[0], phys[1]):
            raise RuntimeError(f"forward {step} layer {layer}: physical rows differ between kernels")
        if not bool((phys[0][len(owners):] == -1).all()):
            raise RuntimeError(f"forward {step} layer {layer}: a padding token got physical rows")
        phys = [p[:len(owners)] for p in phys]
        topk_c = topk.cpu()
        for g, ph in zip(self.groups, phys):
            hot = g.physical_kv_cache(layer)
            ph_c = ph.cpu()
            for t, rid in enumerate(owners):
                ok = topk_c[t] >= 0
                if not torch.equal(ok, ph_c[t] >= 0):
                    raise RuntimeError(f"forward {step} layer {layer} token {t}: padding moved")
                want = self.rows[(layer, rid)][topk_c[t][ok].long()]
                if not torch.equal(hot[ph[t][ok.to(ph.device)].long()].cpu(), want):
                    raise RuntimeError(f"forward {step} layer {layer} token {t}: a hot row holds "
                                       f"other bytes than request {rid}'s row")
        if not self.cuda and (layer or self.attention_checks):
            return  # on CPU one attention check shows the script works
        hot, ph = self.groups[0].physical_kv_cache(layer), phys[0]
        Td = ph.shape[0]
        for H in self.heads:
            qa = torch.randn(Td, H, 576, generator=self.gen, device=self.dev).to(torch.bfloat16)
            scale = 1.0 / math.sqrt(576)
            out, lse = self.attention.decode(qa, hot, ph, sm_scale=scale, row_format=FP8)
            ref_out, ref_lse = ReferenceBackend().decode(qa, hot, ph, sm_scale=scale, row_format=FP8)
            cfg = default_config(Td, H, self.K, self.dev, FP8)
            kernel = "ws" if cfg.ws else "wide" if cfg.wide else "tl"
            what = f"forward {step} layer {layer} H={H} ({kernel} kernel)"
            self.kernels_used.add(f"{kernel} H={H}")
            if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
                raise RuntimeError(f"{what}: empty rows differ from the reference")
            fin = torch.isfinite(ref_lse)
            lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
            err = (out.float() - ref_out.float()).abs()
            bad = err > ATOL + RTOL * ref_out.float().abs()
            if lse_err > LSE_TOL or bool(bad.any()):
                raise RuntimeError(f"{what}: lse err {lse_err:.2e}, {int(bad.sum())} outputs off "
                                   f"(max err {err.max().item():.2e})")
            self.attention_checks += 1

    def prefill(self, step: int, layer: int, md, pre: list[int]) -> None:
        lens = [self.length(r) for r in pre]
        starts = [sum(lens[:p]) for p in range(len(pre))]
        i32 = dict(dtype=torch.int32, device=self.dev)
        works = []
        for g in self.groups:  # fp8 rows dequantised into a bf16 workspace
            ws = torch.empty((sum(lens), 576), dtype=torch.bfloat16, device=self.dev)
            ev = g.gather_fp8_prefill(layer, None, ws, None, torch.tensor(starts, **i32), len(pre),
                                      md, 0)
            if ev is not None:
                torch.cuda.current_stream(self.dev).wait_event(ev)
            works.append(ws)
        if not torch.equal(works[0].view(torch.uint8), works[1].view(torch.uint8)):
            raise RuntimeError(f"forward {step} layer {layer}: bf16 prefill workspaces differ "
                               "between kernels")
        for g in self.groups:  # the stored format, into 16-row blocks
            area = torch.zeros((-(-sum(lens) // 16) + len(pre), 16, FP8.row_bytes), dtype=torch.uint8,
                               device=self.dev)
            flat, table, _ = g.stage_prefill_rows(layer, area, md)
            for p, rid in enumerate(pre):
                first = int(table[p, 0]) * 16
                if not torch.equal(flat[first:first + lens[p]].cpu(), self.rows[(layer, rid)]):
                    raise RuntimeError(f"forward {step} layer {layer}: staged rows of request {rid} "
                                       "differ from the rows written")


def overlap_trace(dev: torch.device) -> None:
    """Part 3: split decode layers (hit phase, miss phase, the miss-attention
    and merge kernels, a prefetch) beside a serial twin, a few steps; state and outputs
    compared."""
    g = torch.Generator().manual_seed(5)
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=4 * 2048, row_bytes=656, top_k=64, device_buffer_size=128,
                         max_num_reqs=4, host_block_size=64, max_request_id=8, device=str(dev))
    kern = "triton"
    caches = {m: HiSparseCache(cfg, kernels=kern) for m in (Overlap.SERIAL, Overlap.SPLIT)}
    rows = {(r, l): quantize_fp8_ds_mla(torch.randn(1500, 576, generator=g).to(dev)) for r in range(4) for l in range(2)}
    for c in caches.values():
        for r in range(4):
            c.add_request(r)
            for layer in range(2):
                c.write(layer, r, rows[(r, layer)])
    be = TritonBackend(allow_interpreter=dev.type != "cuda")
    layers = {m: DecodeLayer(c, be, overlap=m) for m, c in caches.items()}
    ids = torch.arange(4, dtype=torch.int32, device=dev)
    for step in range(4):
        tk = torch.stack([torch.randperm(1500, generator=g)[:64] for _ in range(4)]).to(torch.int32).to(dev)
        q = torch.randn(4, 64, 576, generator=g).to(device=dev, dtype=torch.bfloat16)
        outs = {}
        for m, dl in layers.items():
            for layer in range(2):
                outs[(m, layer)] = dl(layer, ids, tk, q, sm_scale=0.04)
                if layer == 0:
                    dl.prefetch(1, ids, tk)
        for m in (Overlap.SPLIT,):
            for layer in range(2):
                d = (outs[(m, layer)][0].float() - outs[(Overlap.SERIAL, layer)][0].float()).abs().max().item()
                if d > 3e-2:
                    raise RuntimeError(f"overlap step {step} {m.value} layer {layer}: output differs by {d:.3e}")
            for n in ("slot_pos", "slot_stamp", "row_slot", "step", "stats"):
                if not torch.equal(getattr(caches[m].state, n), getattr(caches[Overlap.SERIAL].state, n)):
                    raise RuntimeError(f"overlap step {step} {m.value}: state.{n} differs from serial")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print("part 3 (split decode layers, prefetch): OK", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true",
                    help="check the script itself on a machine without a GPU (with TRITON_INTERPRET=1)")
    a = ap.parse_args(argv)
    if a.cpu:  # check the script itself on a machine without a GPU
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("sanitize_trace: needs a CUDA GPU (or --cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    kernel_trace(dev)
    EngineTrace(dev).run()
    overlap_trace(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
