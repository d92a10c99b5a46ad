"""A small resolve + staging trace on the GPU, for compute-sanitizer.

  compute-sanitizer --tool memcheck  python scripts/sanitize_trace.py
  compute-sanitizer --tool racecheck python scripts/sanitize_trace.py
  (also useful: --tool synccheck, --tool initcheck)
  TRITON_INTERPRET=1 python scripts/sanitize_trace.py --cpu   # the script itself, no GPU

Runs several decode steps of resolve_triton + copy_rows (pinned host pool -> hot
rows over UVA) for a few requests with q = 2, including padding, duplicates and,
in the last steps, garbage entries (validation off); requests 3 and 4 fit their buffers,
so every step of theirs takes the kernel's all-hit path. It checks the result against
the torch reference after every step. Shapes are small so the sanitizer finishes
in about a minute; the kernel code paths (sort, gather, barriers, atomics, the
persistent copy loop) are the same as at production shapes. Prints "OK" and exits
0 on success; any mismatch raises.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hisparse.cache.resolve_ref import copy_rows_reference, resolve_reference  # noqa: E402
from hisparse.cache.resolve_triton import resolve_triton  # noqa: E402
from hisparse.cache.state import HotState, ResolveBuffers  # noqa: E402
from hisparse.cache.transfer import copy_rows  # noqa: E402
from hisparse.config import HiSparseConfig  # noqa: E402
from hisparse.device import PinnedBuffer  # noqa: E402

FIELDS = ("id_to_slot", "seq_lens", "block_table", "slot_pos", "slot_stamp", "row_slot",
          "step", "stats")


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


def main() -> int:
    if "--cpu" in sys.argv:  # check the script itself on a machine without a GPU
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("sanitize_trace: needs a CUDA GPU (or --cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
