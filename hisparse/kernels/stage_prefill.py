"""Triton bodies of prefill staging: gather each prefill request's rows [0, seq_len)
from the host pool (pinned, read over UVA) or, when the row is on the device, from the
layer's flat device view (a hot row, or a resident request's page row) into a
contiguous workspace.

Launchers, validation and the torch reference live in ``hisparse.staging.prefill``.

Grid: (cdiv(max_rows, ROWS), P). Program (b, i) stages positions
[b * ROWS, (b + 1) * ROWS) of prefill request i; programs past the request's length
do nothing. For each position p of request i (request slot r = req_slots[i]):

    resident request (HAS_POOL and resident[r] != 0): its page row, device to device
        src = hot[pool_base + page_table[r, p // PB] * PB + p % PB]
    otherwise
        v   = block_table[r, p // B]                       block id
        h   = v * B + p % B                                row key (< HV)
        s   = row_slot[h]                                  (HAS_HOT) hot slot, -1 = not hot
        hr  = host_block[v] * B + p % B                    (ALIASED) host row; else hr = h
        src = hot[r * SP + s] if s >= 0 else host[hr]      same bytes by the cache invariant
    workspace[workspace_starts[i] + p] = convert(src)

A resident request never reads its block table or the host pool (the cache keeps its
page rows byte-identical to its host rows). ``HAS_POOL`` and ``ALIASED`` are
constexprs: a view without the elastic tier, or without block-id aliases (prefix
caching), compiles no code and issues no load for them.

Two bodies, both reading whole rows as int32 words: ``stage_dequant_kernel`` turns
fp8_ds_mla rows into bf16 workspace rows (element j of the latent = e4m3 code j times
scale j // 128, rounded to bf16 to nearest even with integer arithmetic, so the result
is bit-identical to the torch reference on GPU and in the CPU interpreter, whose own
float32 -> bf16 cast truncates); ``stage_copy_kernel`` copies rows unchanged (bf16
rows into a bf16 workspace, or any format into a workspace of stored rows).

Every index is bounds-checked in-kernel (a row that cannot be located is skipped: for
a resident request, a position whose page is unmapped or past the device view), so
even with validation off nothing outside the tensors is read or written. Loop-free:
the CPU interpreter cannot loop over runtime bounds under NumPy >= 2.4.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate_rows(
    i, b,  # program ids: prefill request, row block
    bt_ptr,  # int32 [R, NB] block table (block ids)
    slots_ptr,  # int32 [P] request slot of each prefill request
    lens_ptr,  # int32 [P] rows to stage per request
    starts_ptr,  # int32 [P] first workspace row of each request
    row_slot_ptr,  # int32 [HV] hot slot of each row key, -1 = not hot (HAS_HOT)
    resident_ptr,  # int32 [R] != 0 = resident request slot (HAS_POOL)
    pt_ptr,  # int32 [R, MP] pool page of each logical page, -1 = none (HAS_POOL)
    hb_ptr,  # int32 [NV] host block of each block id (ALIASED)
    R, NB, H, HV, W, HOT_N, SP, stride_bt, MP, stride_pt, pool_base,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, HAS_HOT: tl.constexpr,
    HAS_POOL: tl.constexpr, PAGE_ROWS: tl.constexpr, ALIASED: tl.constexpr,
):
    """int64 [ROWS] host row, source row in the device view (hot or page row, -1 =
    host) and workspace row, masks of what to do."""
    r = tl.load(slots_ptr + i).to(tl.int64)
    n = tl.load(lens_ptr + i).to(tl.int64)
    w0 = tl.load(starts_ptr + i).to(tl.int64)
    p = b.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    wrow = w0 + p
    base_ok = (p < n) & (r >= 0) & (r < R) & (w0 >= 0) & (wrow < W)
    is_res = r * 0  # scalar: 1 = the request is resident (HAS_POOL)
    if HAS_POOL:
        r_ok = (r >= 0) & (r < R)
        is_res = (tl.load(resident_ptr + tl.where(r_ok, r, 0), mask=r_ok, other=0) != 0).to(tl.int64)
    blk = p // BLOCK_SIZE
    ok = base_ok & (blk < NB) & (is_res == 0)
    pb = tl.load(bt_ptr + r * stride_bt + blk, mask=ok, other=-1).to(tl.int64)
    h = pb * BLOCK_SIZE + p % BLOCK_SIZE  # row key
    ok = ok & (pb >= 0) & (h < HV)
    if ALIASED:
        hb = tl.load(hb_ptr + tl.where(ok, pb, 0), mask=ok, other=-1).to(tl.int64)
        hr = hb * BLOCK_SIZE + p % BLOCK_SIZE
        ok = ok & (hb >= 0) & (hr < H)
    else:
        hr = h
    hot_row = h * 0 - 1
    if HAS_HOT:
        s = tl.load(row_slot_ptr + h, mask=ok, other=-1).to(tl.int64)
        hot_row = tl.where((s >= 0) & (s < SP), r * SP + s, -1)
        hot_row = tl.where(hot_row < HOT_N, hot_row, -1)
    if HAS_POOL:
        pg = p // PAGE_ROWS
        okp = base_ok & (is_res != 0) & (pg < MP)
        page = tl.load(pt_ptr + r * stride_pt + pg, mask=okp, other=-1).to(tl.int64)
        prow = pool_base + page * PAGE_ROWS + p % PAGE_ROWS
        okp = okp & (page >= 0) & (prow < HOT_N)
        hot_row = tl.where(okp, prow, hot_row)
        ok = ok | okp
    from_hot = ok & (hot_row >= 0)
    from_host = ok & (hot_row < 0)
    return hr, hot_row, wrow, ok, from_hot, from_host


@triton.jit
def _bf16_bits_rne(x):
    """float32 tensor -> int16 bit pattern of bf16, round to nearest even, NaN -> 0x7FC0."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = tl.where(nan, 0x7FC0, rounded)  # torch's canonical bf16 NaN
    return bits.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def stage_copy_kernel(
    host_ptr,  # int32 [H, WORDS] host pool rows of the layer as words (pinned CPU over UVA, or device)
    hot_ptr,  # int32 [HOT_N, WORDS] the layer's flat device view: hot rows, then pool pages (HAS_HOT)
    row_slot_ptr,  # int32 [HV] hot slot of each row key, -1 = not hot (HAS_HOT)
    resident_ptr,  # int32 [R] != 0 = resident request slot (HAS_POOL)
    pt_ptr,  # int32 [R, MP] pool page of each logical page (HAS_POOL)
    hb_ptr,  # int32 [NV] host block of each block id (ALIASED)
    bt_ptr,  # int32 [R, NB] block table (block ids)
    slots_ptr,  # int32 [P] request slot of each prefill request
    lens_ptr,  # int32 [P] rows to stage per request
    starts_ptr,  # int32 [P] first workspace row of each request
    ws_ptr,  # int32 [W, WORDS] workspace rows as words
    R, NB, H, HV, W, HOT_N, SP, stride_bt, MP, stride_pt, pool_base,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program
    WORDS: tl.constexpr,  # int32 words per row (row_bytes / 4)
    WORDS_P2: tl.constexpr,  # next power of two >= WORDS
    HAS_HOT: tl.constexpr,
    HAS_POOL: tl.constexpr,  # resident requests read their page rows
    PAGE_ROWS: tl.constexpr,  # PB, rows per pool page (HAS_POOL)
    ALIASED: tl.constexpr,  # block ids past the host blocks: host rows through hb_ptr
):
    i = tl.program_id(1)
    b = tl.program_id(0)
    h, hot_row, wrow, ok, from_hot, from_host = _locate_rows(
        i, b, bt_ptr, slots_ptr, lens_ptr, starts_ptr, row_slot_ptr, resident_ptr, pt_ptr, hb_ptr, R, NB, H, HV,
        W, HOT_N, SP, stride_bt, MP, stride_pt, pool_base, BLOCK_SIZE, ROWS, HAS_HOT, HAS_POOL, PAGE_ROWS,
        ALIASED)
    cols = tl.arange(0, WORDS_P2)
    in_row = (cols < WORDS)[None, :]
    mh = from_host[:, None] & in_row
    v = tl.load(host_ptr + (tl.where(from_host, h, 0) * WORDS)[:, None] + cols[None, :], mask=mh, other=0)
    if HAS_HOT:
        mt = from_hot[:, None] & in_row
        v = tl.where(mt, tl.load(hot_ptr + (tl.where(from_hot, hot_row, 0) * WORDS)[:, None] + cols[None, :],
                                 mask=mt, other=0), v)
    tl.store(ws_ptr + (wrow * WORDS)[:, None] + cols[None, :], v, mask=ok[:, None] & in_row)


@triton.jit
def stage_dequant_kernel(
    host_ptr,  # int32 [H, 164] host pool rows of the layer as words (pinned CPU over UVA, or device)
    hot_ptr,  # int32 [HOT_N, 164] the layer's flat device view as words: hot rows, then pool pages (HAS_HOT)
    row_slot_ptr,  # int32 [HV] hot slot of each row key, -1 = not hot (HAS_HOT)
    resident_ptr,  # int32 [R] != 0 = resident request slot (HAS_POOL)
    pt_ptr,  # int32 [R, MP] pool page of each logical page (HAS_POOL)
    hb_ptr,  # int32 [NV] host block of each block id (ALIASED)
    bt_ptr,  # int32 [R, NB] block table (block ids)
    slots_ptr,  # int32 [P] request slot of each prefill request
    lens_ptr,  # int32 [P] rows to stage per request
    starts_ptr,  # int32 [P] first workspace row of each request
    ws_ptr,  # int32 [W, 288] workspace rows as words (two bf16 per word)
    R, NB, H, HV, W, HOT_N, SP, stride_bt, MP, stride_pt, pool_base,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program
    HAS_HOT: tl.constexpr,
    HAS_POOL: tl.constexpr,  # resident requests read their page rows
    PAGE_ROWS: tl.constexpr,  # PB, rows per pool page (HAS_POOL)
    ALIASED: tl.constexpr,  # block ids past the host blocks: host rows through hb_ptr
):
    """fp8_ds_mla rows -> bf16 workspace rows, each source row read in one contiguous
    656-byte load (164 int32 words).

    Rows are 656 bytes, so they start 16-byte but not 128-byte aligned: separate loads
    of the four code tiles, the scales and the RoPE part touch up to 11 host cache lines
    per row where the row spans 6, and over PCIe every line is a read request (that
    version staged at 0.71-0.86x of a bulk copy on the H200, this one at 0.87-0.95x).
    The codes are taken apart with shifts (byte k of word j is code 4j + k, little
    endian) and two bf16 results are packed per output word.
    """
    i = tl.program_id(1)
    b = tl.program_id(0)
    h, hot_row, wrow, ok, from_hot, from_host = _locate_rows(
        i, b, bt_ptr, slots_ptr, lens_ptr, starts_ptr, row_slot_ptr, resident_ptr, pt_ptr, hb_ptr, R, NB, H, HV,
        W, HOT_N, SP, stride_bt, MP, stride_pt, pool_base, BLOCK_SIZE, ROWS, HAS_HOT, HAS_POOL, PAGE_ROWS,
        ALIASED)
    cols = tl.arange(0, 256)
    in_row = (cols < 164)[None, :]
    v = tl.load(host_ptr + (tl.where(from_host, h, 0) * 164)[:, None] + cols[None, :],
                mask=from_host[:, None] & in_row, other=0)  # [ROWS, 256] int32
    if HAS_HOT:
        mt = from_hot[:, None] & in_row
        v = tl.where(mt, tl.load(hot_ptr + (tl.where(from_hot, hot_row, 0) * 164)[:, None] + cols[None, :],
                                 mask=mt, other=0), v)
    # lat[r, j] = word j (codes 4j..4j+3), ext[r, j] = word 128 + j (scales, RoPE)
    lat, ext = tl.split(tl.permute(tl.reshape(v, [ROWS, 2, 128]), [0, 2, 1]))
    j = tl.arange(0, 128)[None, :]
    s0 = tl.sum(tl.where(j == 0, ext, 0), axis=1).to(tl.float32, bitcast=True)  # exact: one term
    s1 = tl.sum(tl.where(j == 1, ext, 0), axis=1).to(tl.float32, bitcast=True)
    s2 = tl.sum(tl.where(j == 2, ext, 0), axis=1).to(tl.float32, bitcast=True)
    s3 = tl.sum(tl.where(j == 3, ext, 0), axis=1).to(tl.float32, bitcast=True)
    tile = j // 32  # 32 words = 128 codes per scale tile
    scale = tl.where(tile == 0, s0[:, None], tl.where(tile == 1, s1[:, None],
                                                     tl.where(tile == 2, s2[:, None], s3[:, None])))
    u = lat.to(tl.uint32, bitcast=True)
    e0 = _bf16_word_bits(u, 0, scale)
    e1 = _bf16_word_bits(u, 8, scale)
    e2 = _bf16_word_bits(u, 16, scale)
    e3 = _bf16_word_bits(u, 24, scale)
    w01 = (e0 | (e1 << 16)).to(tl.int32, bitcast=True)  # bf16 elements 4j, 4j + 1
    w23 = (e2 | (e3 << 16)).to(tl.int32, bitcast=True)  # 4j + 2, 4j + 3
    out_words = tl.reshape(tl.join(w01, w23), [ROWS, 256])  # word 2j + k
    base = ws_ptr + (wrow * 288)[:, None]
    mo = ok[:, None]
    tl.store(base + tl.arange(0, 256)[None, :], out_words, mask=mo)
    # RoPE: source words 132..163 = ext columns 4..35 -> workspace words 256..287
    tl.store(base + 256 + (j - 4), ext, mask=mo & (j >= 4) & (j < 36))


@triton.jit
def _bf16_word_bits(u, SHIFT: tl.constexpr, scale):
    """uint32 [ROWS, 128]: bf16 bits (low 16) of code byte SHIFT / 8 of each word x scale."""
    code = ((u >> SHIFT) & 0xFF).to(tl.uint8)
    x = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    return _bf16_bits_rne(x).to(tl.uint16, bitcast=True).to(tl.uint32)
