"""Capacity planner: how many concurrent requests fit with and without hisparse.

Notation (all per request unless said otherwise):

  L   layers              row  bytes of one MLA row (656 fp8_ds_mla, 1152 bf16)
  I   indexer key bytes per token per layer (DeepSeek-V3.2: 128 fp8 + 4-byte scale = 132)
  C   context tokens      B  host block size (tokens)      Cb = ceil(C / B) * B
  S   hot rows (LRU slots) per (layer, request); one more reserved newest-token slot
  G   GPU bytes for KV    Hm host bytes for the pool        M  max sequences (a cap)
  P   tensor-parallel ranks per node (each rank's GPU holds the same latent rows: MLA's
      latent KV is replicated across TP ranks); G is per rank, Hm per node
  X   host pool copies per node: 1 with a shared pool (--tp-share), else P
  Li  layers with an indexer: ceil(L / n) when only every n-th layer runs one and the
      layers after it reuse its top-k (IndexCache's Full / Shared layers; n = 1: all)

Formulas (``FORMULAS`` below is printed by ``hisparse plan --help``):

  Li = ceil(L / n): layers that keep indexer keys (--index-share n; n = 1: every layer)
  resident (no hisparse), GPU bytes = C * (L * row + Li * I)
  hisparse, GPU bytes  = L * (S + 1) * (row + 8)     hot rows + slot position/stamp (int32 each)
                       + C * Li * I                  indexer keys stay on the GPU
                       + Cb * L * 4                  row -> slot map (int32 per host row)
                       + 4 * (Cb / B) + 8 * L + 4    block table, LRU step, length
  hisparse, host bytes = Cb * L * row                 (one copy)

  N_index    = min(floor((2^31 - 1) / Cb), floor((2^31 - 1) / (S + 1)))
               one cache indexes host rows and hot rows of a layer with int32
  N_resident = min(floor(G / resident GPU bytes), M)
  N_hisparse = min(floor(G / hisparse GPU bytes), floor(Hm / (X * host bytes)), M, N_index)
  binding resource = the term that gives N_hisparse (gpu | host | max_seqs | int32_indices)
  host pool (per node) for a target of N requests = N * X * host bytes

  device pool (--pool-rows Np rows per layer, hot buffers included: the elastic tier),
  serving R requests (--target, else N_hisparse), pages of 64 rows:
    Hh = ceil(R * (S + 1) / 64) * 64          hot-buffer rows per layer
    P  = floor((Np - Hh) / 64)                pages; Pc = ceil(C / 64) pages per request
    pool GPU bytes = L * Np * row
    GPU bytes at R requests = R * hisparse GPU bytes + L * (Np - R * (S + 1)) * row
    resident at C = min(R, floor(P / Pc))     requests whose whole context fits the pages
    Np for all R resident = Hh + R * Pc * 64
    --pool-rows auto: Np = R * (S + 1) + floor((G - R * hisparse GPU bytes) / (L * row))
                      (every GPU byte the R requests leave)

  prefix sharing (--shared-prefix P --prefix-groups Gp, prefix caching): the requests
  come in Gp groups, each sharing the first P of its C tokens; whole blocks are shared:
    Ps = floor(P / B) * B  shared rows of a group;  Co = Cb - Ps  own rows of a request
    host rows per layer for R requests: min(R, Gp) * Ps + R * Co   (R * Cb unshared)
    host bytes = rows * L * row (per pool copy)
    N_host shared = floor((Hm / X - Gp * Ps * L * row) / (Co * L * row)) when that is
                    >= Gp, else N_host (too few requests to fill every group)
    alias ids (prefix_alias_blocks) for every sharer: A = (R - min(R, Gp)) * Ps / B;
      each costs 4 * L * B (row_slot) + 4 (host_block map) device bytes; the R * Cb
      rows' row map of the unshared count is as large, so GPU bytes grow by 4 * A;
      the cache's default (prefix_alias_blocks = the pool's blocks) costs
      (host rows / B) * (4 * L * B + 4)
    N_hisparse shared = min(N_gpu shared, N_host shared, M, N_index), N_gpu shared the
                    largest N with N * hisparse GPU bytes + 4 * A(N) <= G
    with --pool-rows too: resident sharers reference their group's first resident
    request's device pages of the prefix: Pp = floor(Ps / 64) whole pages per group
    (a partial page is copied: a page of the sharer's own)
      pages for all R resident = min(R, Gp) * Pc + (R - min(R, Gp)) * (Pc - Pp)
      Np for all R resident with sharing = Hh + that * 64
      resident at C with sharing: the groups' first requests first (Pc pages each),
                    then sharers (Pc - Pp each), at most R

Result fields (``plan`` / ``hisparse plan --json``): inputs (PlanInputs + row_bytes),
per_request_bytes {resident_gpu, hisparse_gpu, hisparse_gpu_breakdown {hot_rows_and_
slot_state, indexer_keys, row_to_slot_map, tables}, hisparse_host}, concurrency
{resident, hisparse, hisparse_gpu_limit, hisparse_host_limit, hisparse_index_limit,
max_seqs}, binding,
gain (hisparse / resident, None when resident is 0), host_pool_copies_per_node,
host_pool_for_hisparse_bytes (per node),
target {requests, host_pool_bytes, gpu_bytes, fits_gpu, within_max_seqs} (with a target),
device_pool (with pool_rows) {requests, requests_from, pool_rows, pool_rows_from, hot_rows,
pages, page_rows, device_bytes, gpu_bytes_at_requests, fits_gpu, pages_per_request,
resident_requests, rows_all_resident, device_bytes_all_resident,
gpu_bytes_all_resident, all_resident_fits_gpu; with shared_prefix also
shared_pages_per_group, rows_all_resident_shared, resident_requests_shared},
prefix (with shared_prefix) {requests, requests_from, shared_prefix, groups, shared_rows_per_group,
own_rows_per_request, host_rows_unshared, host_rows_shared, host_rows_saved, host_bytes_unshared,
host_bytes_shared (per node), alias_ids, alias_device_bytes, row_map_bytes_saved,
gpu_bytes_shared, default_alias_ids, default_alias_device_bytes, concurrency_shared,
host_limit_shared, gpu_limit_shared, binding_shared}.
"""

from __future__ import annotations

import dataclasses
import math

from hisparse.config import DEVICE_PAGE_ROWS, RowFormat, ceil_div, check_bool, check_int
from .fields import parse_choices, plain_dict
from .report import table
from .sizing import check_prefix_options, hot_buffer_rows
from .units import fmt_bytes

INT32_ROWS = 2**31 - 1  # rows one layer of a cache can index (int32)

FORMULAS = (__doc__.split("Formulas", 1)[1].split("\n", 1)[1].split("Result fields")[0].rstrip()
            if __doc__ else "")

@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """Inputs of the planner (see module docstring for the symbols)."""

    num_layers: int  # L
    context_len: int  # C
    gpu_bytes: int  # G
    host_bytes: int  # Hm
    row_format: RowFormat = RowFormat.FP8_DS_MLA  # or its value
    top_k: int = 2048
    indexer_bytes: int = 132  # I
    index_share: int = 1  # n: layers per indexer (Li = ceil(L / n))
    hot_rows: int | None = None  # S; default 2 * top_k
    max_seqs: int = 1 << 20  # M
    block_size: int = 64  # B
    target_requests: int | None = None
    tp_ranks: int = 1  # P
    tp_share: bool = False  # one shared host pool per node (hisparse.cache.distributed)
    pool_rows: int | str | None = None  # Np, device rows per layer (the elastic tier), "auto" or None
    shared_prefix: int | None = None  # P: tokens each group's requests share (prefix caching)
    prefix_groups: int | None = None  # Gp: groups sharing a prefix (default 1 with shared_prefix)

    def __post_init__(self) -> None:
        for name in ("num_layers", "context_len", "top_k", "max_seqs", "block_size", "tp_ranks",
                     "gpu_bytes", "host_bytes", "index_share"):
            check_int(name, getattr(self, name), lo=1)
        check_int("indexer_bytes", self.indexer_bytes, lo=0)
        check_bool("tp_share", self.tp_share)
        parse_choices(self, {"row_format": RowFormat.parse})
        if self.hot_rows is None:
            object.__setattr__(self, "hot_rows", 2 * self.top_k)
        check_int("hot_rows", self.hot_rows)
        if self.hot_rows < self.top_k:
            raise ValueError(f"hot_rows must be >= top_k ({self.top_k}): one step may "
                             f"select top_k distinct rows; got {self.hot_rows}")
        if self.target_requests is not None:
            check_int("target_requests", self.target_requests, lo=1)
        cb = math.ceil(self.context_len / self.block_size) * self.block_size
        if cb > INT32_ROWS:
            raise ValueError(
                f"context_len={self.context_len} needs {cb} host rows per layer for one request; "
                f"a cache indexes at most {INT32_ROWS} rows per layer (int32), so not even one "
                "request of this context fits")
        if self.hot_rows + 1 > INT32_ROWS:
            raise ValueError(f"hot_rows={self.hot_rows} (+1 reserved slot) exceeds int32 hot-row indices")
        if self.pool_rows is not None and self.pool_rows != "auto":
            check_int("pool_rows", self.pool_rows, lo=1)
        self._check_prefix()

    def _check_prefix(self) -> None:
        if not check_prefix_options(self.shared_prefix, self.prefix_groups, self.block_size):
            return
        P = self.shared_prefix
        if P >= self.context_len:
            raise ValueError(f"shared_prefix={P} does not fit the context: a request's context_len={self.context_len} "
                             "tokens are the shared prefix plus at least one token of its own (the cache computes "
                             f"its last prompt token); give a shared_prefix below {self.context_len}")


def plan(inp: PlanInputs) -> dict:
    """Evaluate the formulas of the module docstring; returns a JSON-able dict."""
    L, C, B, S, I = inp.num_layers, inp.context_len, inp.block_size, inp.hot_rows, inp.indexer_bytes
    row = inp.row_format.row_bytes
    nblocks = math.ceil(C / B)
    Cb = nblocks * B
    Li = math.ceil(L / inp.index_share)
    resident_gpu = C * (L * row + Li * I)
    hot = L * (S + 1) * (row + 8)
    indexer = C * Li * I
    row_map = Cb * L * 4
    small = 4 * nblocks + 8 * L + 4
    hs_gpu = hot + indexer + row_map + small
    hs_host = Cb * L * row
    copies = 1 if inp.tp_share else inp.tp_ranks  # X
    n_res = min(inp.gpu_bytes // resident_gpu, inp.max_seqs)
    n_gpu = inp.gpu_bytes // hs_gpu
    n_host = inp.host_bytes // (copies * hs_host)
    n_index = min(INT32_ROWS // Cb, INT32_ROWS // (S + 1))
    n_hs = min(n_gpu, n_host, inp.max_seqs, n_index)
    binding = ("gpu" if n_hs == n_gpu else "host" if n_hs == n_host
               else "max_seqs" if n_hs == inp.max_seqs else "int32_indices")
    out = {
        "inputs": plain_dict(inp) | {"row_bytes": row},
        "per_request_bytes": {
            "resident_gpu": resident_gpu,
            "hisparse_gpu": hs_gpu,
            "hisparse_gpu_breakdown": {"hot_rows_and_slot_state": hot, "indexer_keys": indexer,
                                       "row_to_slot_map": row_map, "tables": small},
            "hisparse_host": hs_host,
        },
        "concurrency": {"resident": n_res, "hisparse": n_hs, "hisparse_gpu_limit": n_gpu,
                        "hisparse_host_limit": n_host, "hisparse_index_limit": n_index,
                        "max_seqs": inp.max_seqs},
        "binding": binding,
        "gain": (n_hs / n_res) if n_res else None,
        "host_pool_copies_per_node": copies,
        "host_pool_for_hisparse_bytes": n_hs * copies * hs_host,
    }
    if inp.pool_rows is not None:
        R = inp.target_requests if inp.target_requests is not None else n_hs
        if R:  # none fits: the command reports that (exit 3)
            out["device_pool"] = device_pool(inp, R, hs_gpu, row)
    if inp.shared_prefix is not None:
        out["prefix"] = prefix_sharing(inp, n_gpu=n_gpu, n_host=n_host, n_index=n_index, hs_gpu=hs_gpu, row=row,
                                       copies=copies)
        if "device_pool" in out:
            out["device_pool"].update(shared_pages(inp, out["device_pool"]))
    if inp.target_requests is not None:
        t = inp.target_requests
        out["target"] = {"requests": t, "host_pool_bytes": t * copies * hs_host,
                         "gpu_bytes": t * hs_gpu,
                         "fits_gpu": t * hs_gpu <= inp.gpu_bytes,
                         "within_max_seqs": t <= inp.max_seqs}
    return out


def device_pool(inp: PlanInputs, R: int, hs_gpu: int, row: int) -> dict:
    """The elastic tier's figures for R requests (the formulas of the module docstring)."""
    L, S, C, G, PB = inp.num_layers, inp.hot_rows, inp.context_len, inp.gpu_bytes, DEVICE_PAGE_ROWS
    floor = R * (S + 1)
    hot = hot_buffer_rows(R, S + 1)
    if inp.pool_rows == "auto":
        n = min(floor + max(0, G - R * hs_gpu) // (L * row), INT32_ROWS)  # one cache indexes int32 rows
        source = "auto: every GPU byte the requests leave" + (", capped at int32 rows" if n == INT32_ROWS else "")
    else:
        n = inp.pool_rows
        source = "given"
        if n < floor:
            who = "--target" if inp.target_requests is not None else "the hisparse concurrency"
            raise ValueError(f"pool_rows={n} is smaller than the hot buffers it includes: {R} requests ({who}) x "
                             f"(hot_rows + 1) = {R} x {S + 1} = {floor} rows per layer; give at least {floor}, "
                             "or auto")
        if n > INT32_ROWS:
            raise ValueError(f"pool_rows={n} is more device rows per layer than one cache indexes with int32 "
                             f"({INT32_ROWS})")
    pages = max(0, n - hot) // PB
    pc = ceil_div(C, PB)
    all_rows = hot + R * pc * PB
    at_r = R * hs_gpu + L * (n - floor) * row
    all_gpu = R * hs_gpu + L * (all_rows - floor) * row
    return {"requests": R, "requests_from": "target" if inp.target_requests is not None else "hisparse",
            "pool_rows": n, "pool_rows_from": source, "hot_rows": hot, "pages": pages, "page_rows": PB,
            "device_bytes": L * n * row, "gpu_bytes_at_requests": at_r, "fits_gpu": at_r <= G,
            "pages_per_request": pc, "resident_requests": min(R, pages // pc),
            "rows_all_resident": all_rows, "device_bytes_all_resident": L * all_rows * row,
            "gpu_bytes_all_resident": all_gpu, "all_resident_fits_gpu": all_gpu <= G}


def prefix_sharing(inp: PlanInputs, *, n_gpu: int, n_host: int, n_index: int, hs_gpu: int, row: int,
                   copies: int) -> dict:
    """Host rows with and without prefix sharing, the alias ids it needs and the
    concurrency it allows (the formulas of the module docstring)."""
    L, B, Gp = inp.num_layers, inp.block_size, inp.prefix_groups or 1
    Cb = ceil_div(inp.context_len, B) * B
    Ps = inp.shared_prefix // B * B
    Co = Cb - Ps
    Pb = Ps // B
    per_row = L * row
    budget = inp.host_bytes // copies  # one pool copy's bytes
    n_host_sh = (budget - Gp * Ps * per_row) // (Co * per_row)
    if n_host_sh < Gp:
        n_host_sh = n_host  # fewer requests than groups: each owns its whole context
    # the largest N with N * hs_gpu + 4 * (N - min(N, Gp)) * Pb <= G
    n_gpu_sh = n_gpu if n_gpu <= Gp else max(Gp, (inp.gpu_bytes + 4 * Gp * Pb) // (hs_gpu + 4 * Pb))
    n_sh = min(n_gpu_sh, n_host_sh, inp.max_seqs, n_index)
    binding = ("gpu" if n_sh == n_gpu_sh else "host" if n_sh == n_host_sh
               else "max_seqs" if n_sh == inp.max_seqs else "int32_indices")
    R = inp.target_requests if inp.target_requests is not None else n_sh
    rows_sh = min(R, Gp) * Ps + R * Co
    aliases = (R - min(R, Gp)) * Pb
    alias_bytes = 4 * L * B + 4  # row_slot rows of one block id, and its host_block entry
    return {"requests": R, "requests_from": "target" if inp.target_requests is not None else "hisparse_shared",
            "shared_prefix": inp.shared_prefix, "groups": Gp, "shared_rows_per_group": Ps,
            "own_rows_per_request": Co, "host_rows_unshared": R * Cb, "host_rows_shared": rows_sh,
            "host_rows_saved": R * Cb - rows_sh, "host_bytes_unshared": copies * R * Cb * per_row,
            "host_bytes_shared": copies * rows_sh * per_row, "alias_ids": aliases,
            "alias_device_bytes": aliases * alias_bytes, "row_map_bytes_saved": (R * Cb - rows_sh) * L * 4,
            "gpu_bytes_shared": R * hs_gpu + 4 * aliases, "default_alias_ids": rows_sh // B,
            "default_alias_device_bytes": rows_sh // B * alias_bytes, "concurrency_shared": n_sh,
            "host_limit_shared": n_host_sh, "gpu_limit_shared": n_gpu_sh, "binding_shared": binding}


def shared_pages(inp: PlanInputs, d: dict) -> dict:
    """The device pool's figures with shared prefix pages (the module docstring's
    formulas), for the same ``d["requests"]`` requests as ``d`` (``device_pool``)."""
    Gp, PB, R = inp.prefix_groups or 1, DEVICE_PAGE_ROWS, d["requests"]
    Pp = inp.shared_prefix // inp.block_size * inp.block_size // PB
    pc, first = d["pages_per_request"], min(R, Gp)
    pages = first * pc + (R - first) * (pc - Pp)
    fit = d["pages"]
    # Pp < pc: a shared prefix leaves at least one token of the context its own
    res = fit // pc if fit < first * pc else first + (fit - first * pc) // (pc - Pp)
    return {"shared_pages_per_group": Pp, "rows_all_resident_shared": d["hot_rows"] + pages * PB,
            "resident_requests_shared": min(R, res)}


def _prefix_lines(p: dict) -> list[str]:
    x = p["prefix"]
    who = "the --target" if x["requests_from"] == "target" else "the concurrency with sharing"
    R, Gp = x["requests"], x["groups"]
    saved = x["host_rows_saved"] / x["host_rows_unshared"] if x["host_rows_unshared"] else 0.0
    return [
        f"prefix sharing: {R} requests ({who}) in {Gp} group{'s' if Gp > 1 else ''} sharing {x['shared_prefix']} "
        f"tokens ({x['shared_rows_per_group']} rows in whole blocks), {x['own_rows_per_request']} rows of their own",
        f"host pool rows per layer: {min(R, Gp)} x {x['shared_rows_per_group']} + {R} x {x['own_rows_per_request']} "
        f"= {x['host_rows_shared']} (vs {R} x {x['host_rows_unshared'] // max(R, 1)} = {x['host_rows_unshared']} "
        f"unshared: {100 * saved:.1f}% fewer); host pool {fmt_bytes(x['host_bytes_shared'])} "
        f"(vs {fmt_bytes(x['host_bytes_unshared'])})",
        f"alias ids for every sharer (prefix_alias_blocks): {x['alias_ids']}, "
        f"{fmt_bytes(x['alias_device_bytes'])} of device memory (row_slot: 4 B x L x B each, + 4 B), about what the "
        f"row map of the saved host rows takes unshared ({fmt_bytes(x['row_map_bytes_saved'])}): GPU at {R} "
        f"requests {fmt_bytes(x['gpu_bytes_shared'])}; the cache's default, one id per host block: "
        f"{x['default_alias_ids']} ids, {fmt_bytes(x['default_alias_device_bytes'])}"
        + ("" if x["default_alias_ids"] >= x["alias_ids"] else
           f" (then only {x['default_alias_ids']} of the {x['alias_ids']} shared block mappings share)"),
        f"concurrency with sharing: {x['concurrency_shared']} (binding: {x['binding_shared']}; host allows "
        f"{x['host_limit_shared']}, GPU {x['gpu_limit_shared']})"]


def format_plan(p: dict) -> str:
    """The readable table of a :func:`plan` result."""
    i, b, c = p["inputs"], p["per_request_bytes"], p["concurrency"]
    head = (f"L={i['num_layers']} {i['row_format']} ({i['row_bytes']} B/row) top_k={i['top_k']} "
            f"S={i['hot_rows']} context={i['context_len']} indexer={i['indexer_bytes']} B/token/layer"
            + (f" in {math.ceil(i['num_layers'] / i['index_share'])} layers (one per {i['index_share']})"
               if i["index_share"] > 1 else "") + "\n"
            f"GPU for KV {fmt_bytes(i['gpu_bytes'])}, host {fmt_bytes(i['host_bytes'])}, "
            f"max seqs {i['max_seqs']}")
    rows = [["resident (no hisparse)", fmt_bytes(b["resident_gpu"]), "-", c["resident"]],
            ["hisparse", fmt_bytes(b["hisparse_gpu"]), fmt_bytes(b["hisparse_host"]), c["hisparse"]]]
    lines = [head, "", table(["mode", "GPU / request", "host / request", "concurrent requests"], rows)]
    gb = b["hisparse_gpu_breakdown"]
    lines.append("\nhisparse GPU per request: " + ", ".join(
        f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in gb.items()))
    lines.append(f"binding resource: {p['binding']} (GPU allows {c['hisparse_gpu_limit']}, "
                 f"host allows {c['hisparse_host_limit']}, max seqs {c['max_seqs']}, int32 indices "
                 f"{c['hisparse_index_limit']})")
    if p["gain"] is not None:
        lines.append(f"gain: {p['gain']:.2f}x the resident concurrency")
    lines.append(f"host pool used at that concurrency (per node, {p['host_pool_copies_per_node']} "
                 f"cop{'y' if p['host_pool_copies_per_node'] == 1 else 'ies'}): "
                 f"{fmt_bytes(p['host_pool_for_hisparse_bytes'])}")
    if "target" in p:
        t = p["target"]
        lines.append(f"target {t['requests']} requests: host pool >= {fmt_bytes(t['host_pool_bytes'])}"
                     f", GPU {fmt_bytes(t['gpu_bytes'])} ({'fits' if t['fits_gpu'] else 'does NOT fit'}"
                     " the GPU budget)")
    if "device_pool" in p:
        d = p["device_pool"]
        who = "the --target" if d["requests_from"] == "target" else "the hisparse concurrency"
        fits = (lambda ok: "fits" if ok else "does NOT fit")
        lines.append(f"device pool ({d['pool_rows_from']}): {d['pool_rows']} rows per layer for {d['requests']} "
                     f"requests ({who}) = {d['hot_rows']} hot-buffer rows + {d['pages']} pages of "
                     f"{d['page_rows']}; {fmt_bytes(d['device_bytes'])} on the GPU; GPU at {d['requests']} "
                     f"requests with it {fmt_bytes(d['gpu_bytes_at_requests'])} ({fits(d['fits_gpu'])} the budget)")
        lines.append(f"resident at context {i['context_len']} ({d['pages_per_request']} pages each): "
                     f"{d['resident_requests']} of {d['requests']} requests; all {d['requests']} resident needs "
                     f"--pool-rows {d['rows_all_resident']} ({fmt_bytes(d['device_bytes_all_resident'])}; GPU "
                     f"{fmt_bytes(d['gpu_bytes_all_resident'])}, {fits(d['all_resident_fits_gpu'])} the budget)")
        if "rows_all_resident_shared" in d:
            lines.append(f"with shared prefix pages ({d['shared_pages_per_group']} pages per group): "
                         f"{d['resident_requests_shared']} of {d['requests']} requests resident; all "
                         f"{d['requests']} resident needs --pool-rows {d['rows_all_resident_shared']}")
    if "prefix" in p:
        lines += _prefix_lines(p)
    return "\n".join(lines)
