"""Triton bodies of prefill staging: gather each prefill request's rows [0, seq_len)
from the host pool (pinned, read over UVA) or, when the row is hot, from the layer's
hot rows, into a contiguous workspace.

Launchers, validation and the torch reference live in ``hisparse.cache.prefill``.

Grid: (cdiv(max_rows, ROWS), P). Program (b, i) stages positions
[b * ROWS, (b + 1) * ROWS) of prefill request i; programs past the request's length
do nothing. For each position p of request i (request slot r = req_slots[i]):

    h   = block_table[r, p // B] * B + p % B           host row
    s   = row_slot[h]                                  (HAS_HOT) hot slot, -1 = not hot
    src = hot[r * SP + s] if s >= 0 else host[h]       same bytes by the cache invariant
    workspace[workspace_starts[i] + p] = convert(src)

Two bodies: ``stage_dequant_kernel`` turns fp8_ds_mla rows into bf16 workspace rows
(element j of the latent = e4m3 code j times scale j // 128, rounded to bf16 to
nearest even with integer arithmetic, so the result is bit-identical to the torch
reference on GPU and in the CPU interpreter, whose own float32 -> bf16 cast
truncates); ``stage_copy_kernel`` copies rows unchanged as int32 words (bf16 rows into
a bf16 workspace, or any format into a workspace of stored rows).

Every index is bounds-checked in-kernel (a row that cannot be located is skipped), so
even with validation off nothing outside the tensors is read or written. Loop-free:
the CPU interpreter cannot loop over runtime bounds under NumPy >= 2.4.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate_rows(
    i, b,  # program ids: prefill request, row block
    bt_ptr,  # int32 [R, NB] block table
    slots_ptr,  # int32 [P] request slot of each prefill request
    lens_ptr,  # int32 [P] rows to stage per request
    starts_ptr,  # int32 [P] first workspace row of each request
    row_slot_ptr,  # int32 [H] hot slot of each host row, -1 = not hot (HAS_HOT)
    R, NB, H, W, HOT_N, SP, stride_bt,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, HAS_HOT: tl.constexpr,
):
    """int64 [ROWS] source row in host / hot and workspace row, masks of what to do."""
    r = tl.load(slots_ptr + i).to(tl.int64)
    n = tl.load(lens_ptr + i).to(tl.int64)
    w0 = tl.load(starts_ptr + i).to(tl.int64)
    p = b.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = p // BLOCK_SIZE
    ok = (p < n) & (r >= 0) & (r < R) & (blk < NB) & (w0 >= 0)
    pb = tl.load(bt_ptr + r * stride_bt + blk, mask=ok, other=-1).to(tl.int64)
    h = pb * BLOCK_SIZE + p % BLOCK_SIZE
    wrow = w0 + p
    ok = ok & (pb >= 0) & (h < H) & (wrow < W)
    hot_row = h * 0 - 1
    if HAS_HOT:
        s = tl.load(row_slot_ptr + h, mask=ok, other=-1).to(tl.int64)
        hot_row = tl.where((s >= 0) & (s < SP), r * SP + s, -1)
        hot_row = tl.where(hot_row < HOT_N, hot_row, -1)
    from_hot = ok & (hot_row >= 0)
    from_host = ok & (hot_row < 0)
    return h, hot_row, wrow, ok, from_hot, from_host


@triton.jit
def _bf16_bits_rne(x):
    """float32 tensor -> int16 bit pattern of bf16, round to nearest even, NaN -> 0x7FC0."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = tl.where(nan, 0x7FC0, rounded)  # torch's canonical bf16 NaN
    return bits.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def stage_dequant_kernel(
    host_ptr,  # uint8 [H, 656] host pool rows of the layer (pinned CPU memory over UVA, or device)
    hot_ptr,  # uint8 [HOT_N, 656] hot rows of the layer (HAS_HOT)
    row_slot_ptr,  # int32 [H] hot slot of each host row, -1 = not hot (HAS_HOT)
    bt_ptr,  # int32 [R, NB] block table
    slots_ptr,  # int32 [P] request slot of each prefill request
    lens_ptr,  # int32 [P] rows to stage per request
    starts_ptr,  # int32 [P] first workspace row of each request
    ws_ptr,  # int16 [W, 576] workspace (bf16 bit patterns)
    R, NB, H, W, HOT_N, SP, stride_bt,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program
    HAS_HOT: tl.constexpr,
):
    i = tl.program_id(1)
    b = tl.program_id(0)
    h, hot_row, wrow, ok, from_hot, from_host = _locate_rows(
        i, b, bt_ptr, slots_ptr, lens_ptr, starts_ptr, row_slot_ptr, R, NB, H, W, HOT_N, SP,
        stride_bt, BLOCK_SIZE, ROWS, HAS_HOT)
    hot_base = hot_ptr + tl.where(from_hot, hot_row, 0) * 656
    host_base = host_ptr + tl.where(from_host, h, 0) * 656  # [ROWS] row pointers (uint8)

    mh = from_host[:, None]
    mt = from_hot[:, None]
    mo = ok[:, None]
    out = ws_ptr + wrow[:, None] * 576  # [ROWS, 1] int16 pointers
    # the 4 float32 scales of a row in one 16-byte load (bytes 512..527), as raw bits
    sc = tl.arange(0, 4)
    scales = tl.load((host_base + 512).to(tl.pointer_type(tl.int32))[:, None] + sc[None, :], mask=mh, other=0)
    if HAS_HOT:
        scales = tl.where(mt, tl.load((hot_base + 512).to(tl.pointer_type(tl.int32))[:, None] + sc[None, :],
                                      mask=mt, other=0), scales)
    cols = tl.arange(0, 128)
    for tile in tl.static_range(4):
        # 128 e4m3 codes of latent tile `tile` times its scale
        codes = tl.load(host_base[:, None] + tile * 128 + cols[None, :], mask=mh, other=0)
        if HAS_HOT:
            codes = tl.where(mt, tl.load(hot_base[:, None] + tile * 128 + cols[None, :], mask=mt, other=0), codes)
        # pick column `tile`: an integer sum with one nonzero term is exact (keeps -0.0, NaN bits)
        scale = tl.sum(tl.where(sc[None, :] == tile, scales, 0), axis=1).to(tl.float32, bitcast=True)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        tl.store(out + tile * 128 + cols[None, :], _bf16_bits_rne(x), mask=mo)
    rc = tl.arange(0, 64)
    rope = tl.load((host_base + 528).to(tl.pointer_type(tl.int16))[:, None] + rc[None, :], mask=mh, other=0)
    if HAS_HOT:
        rope = tl.where(mt, tl.load((hot_base + 528).to(tl.pointer_type(tl.int16))[:, None] + rc[None, :],
                                    mask=mt, other=0), rope)
    tl.store(out + 512 + rc[None, :], rope, mask=mo)


@triton.jit
def stage_copy_kernel(
    host_ptr,  # int32 [H, WORDS] host pool rows of the layer as words (pinned CPU over UVA, or device)
    hot_ptr,  # int32 [HOT_N, WORDS] hot rows of the layer (HAS_HOT)
    row_slot_ptr,  # int32 [H] hot slot of each host row, -1 = not hot (HAS_HOT)
    bt_ptr,  # int32 [R, NB] block table
    slots_ptr,  # int32 [P] request slot of each prefill request
    lens_ptr,  # int32 [P] rows to stage per request
    starts_ptr,  # int32 [P] first workspace row of each request
    ws_ptr,  # int32 [W, WORDS] workspace rows as words
    R, NB, H, W, HOT_N, SP, stride_bt,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program
    WORDS: tl.constexpr,  # int32 words per row (row_bytes / 4)
    WORDS_P2: tl.constexpr,  # next power of two >= WORDS
    HAS_HOT: tl.constexpr,
):
    i = tl.program_id(1)
    b = tl.program_id(0)
    h, hot_row, wrow, ok, from_hot, from_host = _locate_rows(
        i, b, bt_ptr, slots_ptr, lens_ptr, starts_ptr, row_slot_ptr, R, NB, H, W, HOT_N, SP,
        stride_bt, BLOCK_SIZE, ROWS, HAS_HOT)
    cols = tl.arange(0, WORDS_P2)
    in_row = (cols < WORDS)[None, :]
    mh = from_host[:, None] & in_row
    v = tl.load(host_ptr + (tl.where(from_host, h, 0) * WORDS)[:, None] + cols[None, :], mask=mh, other=0)
    if HAS_HOT:
        mt = from_hot[:, None] & in_row
        v = tl.where(mt, tl.load(hot_ptr + (tl.where(from_hot, hot_row, 0) * WORDS)[:, None] + cols[None, :],
                                 mask=mt, other=0), v)
    tl.store(ws_ptr + (wrow * WORDS)[:, None] + cols[None, :], v, mask=ok[:, None] & in_row)
