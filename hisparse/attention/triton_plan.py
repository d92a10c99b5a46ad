"""Planned launches of the Triton sparse-MLA decode (``triton_backend``).

What a decode call decides from its inputs' metadata -- the launch shape
(``default_config``), the KV splits, the wave tail, each launch's grid, kernel and
constexprs -- is a ``DecodePlan``, made once from validated inputs; ``plan.run``
allocates the outputs and launches. ``run_sparse_mla`` is a plan made and run at once;
``TritonBackend(validate=False)`` keeps its plans by ``call_signature``, so that a call
with the metadata of one it checked before skips the checks and the planning and
launches through ``fast_launch.BoundLaunch`` (the compiled kernel directly, with no
per-argument work): an engine that runs attention eagerly pays a few microseconds of
host time per call beyond the launch itself.

The signature holds everything the checks and the plan read: for each tensor its
exact type, shape, strides, dtype, device and data pointer modulo 16 (kv_rows' storage
offset parity too); the scale's type (a float in (0, inf) only: anything else is
checked anew), the row format and the SM budget. Two calls with equal signatures pass
or fail the same metadata checks and get the same plan; within a plan, the kernels'
arguments have the same classes but for the outputs allocated per call, whose
alignment is the launches' key.
"""

from __future__ import annotations

import inspect
import math

import torch
import triton

from .._checks import device_type
from ..device import on_device
from ..formats import RowFormat
from ..kernels.fast_launch import fast
from ..kernels.mla_decode import sparse_mla_combine_kernel, sparse_mla_decode_kernel
from ..kernels.mla_decode_wide import sparse_mla_decode_wide_kernel
from .base import D_V, DecodeInputs, empty_result
from .paged import PagedLookup

LOG2E = 1.4426950408889634
_TENSOR = torch.Tensor


def call_signature(q: object, kv_rows: object, indices: object, valid_counts: object, sm_scale: object,
                   row_format: object, sms: object) -> tuple | None:
    """The metadata of a decode call that its checks and its plan depend on (see the
    module docstring); None for a call that is not of the kinds kept (a tensor
    subclass, a scale that is not a positive finite float, anything whose metadata
    can't be read): such calls are checked and planned every time."""
    if type(q) is not _TENSOR or type(kv_rows) is not _TENSOR or type(indices) is not _TENSOR:
        return None
    if type(sm_scale) is not float or not 0.0 < sm_scale < math.inf:
        return None
    if type(row_format) is not str and type(row_format) is not RowFormat:
        return None
    if sms is not None and type(sms) is not int:
        return None
    q_, kv, ix = q, kv_rows, indices
    try:
        vc = None
        if valid_counts is not None:
            if type(valid_counts) is not _TENSOR:
                return None
            v = valid_counts
            vc = (v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15)
        return (q_.shape, q_.stride(), q_.dtype, q_.device, q_.data_ptr() & 15,
                kv.shape, kv.stride(), kv.dtype, kv.device, kv.data_ptr() & 15, kv.storage_offset() & 1,
                ix.shape, ix.stride(), ix.dtype, ix.device, ix.data_ptr() & 15, vc, row_format, sms)
    except (RuntimeError, TypeError, ValueError):  # e.g. a sparse tensor has no strides: the checks say so
        return None


def output_signature(out: object, lse: object) -> tuple | None:
    """The metadata of a call's given outputs that ``base.check_outputs`` reads but their
    addresses (shape, strides, dtype and device of each; None where not given); None
    when one is not a plain tensor (such calls are checked, and refused, every time)."""
    sig = []
    try:
        for t in (out, lse):
            if t is None:
                sig.append(None)
            elif type(t) is not _TENSOR:
                return None
            else:
                sig.append((t.shape, t.stride(), t.dtype, t.device))
    except (RuntimeError, TypeError, ValueError):
        return None
    return tuple(sig)


def _params(kernel) -> list[str]:
    """The kernel's parameter names in order (a JIT, Gluon or interpreted function)."""
    return list(inspect.signature(kernel.fn).parameters)


class _Launch:
    """One decode launch (+ the split combine) for tokens [lo, hi) of a plan; ``paged``:
    the indices are positions that the kernel maps itself (``kernels.paged_rows``)."""

    __slots__ = ("lo", "hi", "sliced", "T", "splits", "ints", "main", "combine", "paged", "lead", "heads")

    def __init__(self, inp: DecodeInputs, cfg, lo: int, hi: int, splits: int, kv: torch.Tensor,
                 paged: PagedLookup | None = None) -> None:
        from . import triton_backend as TB  # its helpers (it imports this module)
        q, idx = inp.q, inp.indices
        T_all, H, _ = q.shape
        K = idx.shape[1]
        self.lo, self.hi, self.T = lo, hi, hi - lo
        self.sliced = lo != 0 or hi != T_all  # the tail launch: a view per token range, no copy
        rows_per_split, self.splits = TB._rows_per_split(K, splits, cfg.block_n)
        self.ints = (kv.shape[0], K, H, q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), rows_per_split)
        has_vc = inp.valid_counts is not None
        grid = (self.T, math.ceil(H / cfg.block_h), self.splits)
        prefetch = cfg.prefetch if device_type(q.device) == "cuda" else 0  # a hint; no inline PTX on CPU
        if cfg.ws:
            kernel = TB._ws_kernel()
            kw = dict(HAS_VC=has_vc, NUM_SPLITS=self.splits, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                      RAW=cfg.ws_raw, PRODUCER_REGS=cfg.ws_producer_regs,
                      CONSUMER_REGS=TB.ws_consumer_regs(cfg.ws_producer_regs), num_warps=4, maxnreg=TB.WS_MAXNREG)
        elif cfg.wide:
            kernel = sparse_mla_decode_wide_kernel
            kw = dict(HAS_VC=has_vc, IS_FP8=inp.row_format is RowFormat.FP8_DS_MLA, NUM_SPLITS=self.splits,
                      BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PREFETCH=prefetch, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        else:
            kernel = sparse_mla_decode_kernel
            kw = dict(HAS_VC=has_vc, IS_FP8=inp.row_format is RowFormat.FP8_DS_MLA, NUM_SPLITS=self.splits,
                      BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, ISOLATE_QK=cfg.isolate_qk, PREFETCH=prefetch,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.paged = paged is not None
        self.heads = grid[1]
        self.lead = ()
        if paged is not None:
            # the paged arguments follow the constexprs: those before PAGED go positionally,
            # then PAGED itself, then the call's tables (run)
            names = _params(kernel)
            between = names[names.index("qk_scale_log2") + 1:names.index("PAGED")]
            self.lead = tuple(kw.pop(n) for n in between) + (True,)
            kw.update(PQ=paged.max_query_len, PCH=paged.scan_chunk, STAT_INVALID=paged.stat_invalid,
                      STAT_RESOLVES=paged.stat_resolves, STAT_RESIDENT=paged.stat_resident)
        self.main = fast(kernel).bind(grid, kw)
        self.combine = None
        if self.splits > 1:
            self.combine = fast(sparse_mla_combine_kernel).bind(
                (self.T, H), dict(NUM_SPLITS=self.splits, SPLITS_P2=triton.next_power_of_2(self.splits), num_warps=4))

    def run(self, q, kv, idx, vc, out, lse, scale_log2: float, paged: PagedLookup | None = None,
            scratch: torch.Tensor | None = None) -> None:
        """q bf16 [T, H, 576], kv rows, idx int32 [T, K], vc int32 [T] | None, out bf16
        [T, H, 512] and lse f32 [T, H] of the whole call: this launch's token rows.
        ``paged``: idx holds positions, mapped through these tables (the call's whole
        top-k and request ids: the kernel offsets them by this launch's first token;
        ``scratch`` int32 [T (head blocks - 1), K]: the rows of head blocks 1..)."""
        if self.sliced:
            lo, hi = self.lo, self.hi
            q, out, lse = q[lo:hi], out[lo:hi], lse[lo:hi]
            if not self.paged:
                idx = idx[lo:hi]
                vc = vc[lo:hi] if vc is not None else None
        if self.combine is not None:
            H = self.ints[2]
            part_out = torch.empty((self.T, self.splits, H, D_V), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((self.T, self.splits, H), dtype=torch.float32, device=q.device)
        else:
            part_out, part_lse = out, lse  # unused by the kernel
        # what the plan does not fix: the alignment of the buffers allocated per call
        po, pl, ppo, ppl = out.data_ptr(), lse.data_ptr(), part_out.data_ptr(), part_lse.data_ptr()
        key = (po & 15, pl & 15, ppo & 15, ppl & 15)
        main = self.main
        if self.paged:
            p = paged  # the tensors themselves: the launcher reads their addresses
            main(key, q, kv, idx, idx, out, lse, part_out, part_lse, *self.ints, scale_log2, *self.lead,
                 self.lo, p.req_ids, p.id_to_slot, p.id_to_slot.shape[0], p.seq_lens.shape[0], p.resident,
                 p.seq_lens, p.page_table, p.page_table.stride(0), p.page_table.shape[1], p.pool_base,
                 p.page_rows, p.num_pages, p.stats, p.physical, p.physical.stride(0),
                 scratch if scratch is not None else p.physical)
        else:
            vc = vc if vc is not None else idx
            direct = main.ready(key)
            if direct is not None:  # pointers as addresses: the launcher takes them as they are
                direct(q.data_ptr(), kv.data_ptr(), idx.data_ptr(), vc.data_ptr(), po, pl, ppo, ppl, *self.ints,
                       scale_log2)
            else:
                main(key, q, kv, idx, vc, out, lse, part_out, part_lse, *self.ints, scale_log2)
        if self.combine is not None:
            direct = self.combine.ready(key)
            if direct is not None:
                direct(ppo, ppl, po, pl, self.ints[2])
            else:
                self.combine(key, part_out, part_lse, out, lse, self.ints[2])


class DecodePlan:
    """The launches of a decode over inputs with one call's metadata (see the module
    docstring). ``config``: the config the plan was made for (None: ``default_config``),
    which its owner compares before reusing it."""

    __slots__ = ("T", "H", "K", "device", "config", "cfg", "kv_as_bf16", "launches", "cuda_device", "interpreter",
                 "paged")

    def __init__(self, inp: DecodeInputs, config, sms: int | None, *, kv_as_bf16: bool = False,
                 paged: PagedLookup | None = None) -> None:
        from . import triton_backend as TB  # its helpers (it imports this module)
        q, kv, idx = inp.q, inp.kv_rows, inp.indices
        self.T, self.H, _ = q.shape
        self.K = idx.shape[1]
        dev = self.device = q.device
        self.config = config
        self.interpreter = None  # the owner's allow_interpreter when it keeps the plan
        self.kv_as_bf16 = kv_as_bf16  # the caller's rows are uint8 [N, 1152] views of bf16 ones
        self.cuda_device = dev if device_type(dev) == "cuda" else None
        if sms is not None:
            TB.check_sms(sms, dev)  # its range on CUDA, its type anywhere
            if device_type(dev) != "cuda":
                sms = None
        self.launches: tuple = ()
        self.cfg = None
        self.paged = paged is not None
        if self.T == 0 or self.K == 0:
            return
        cfg = config
        if cfg is None:
            cfg = TB.default_config(self.T, self.H, self.K, dev, inp.row_format, kv_rows=kv, sms=sms)
        elif cfg.ws:
            reason = TB.ws_unsupported(inp, dev)
            if reason is not None:
                raise ValueError(f"TritonMLAConfig(ws=True) cannot run here: {reason}; use ws=False")
        elif TB.isolate_problem(cfg, dev) is not None:
            raise ValueError(f"TritonMLAConfig(isolate_qk=True) cannot run here: "
                             f"{TB.isolate_problem(cfg, dev)}; use isolate_qk=False or wide=True")
        if paged is not None and cfg.wide:
            raise ValueError("paged lookups run on the tiled and warp-specialised kernels, not wide=True")
        self.cfg = cfg
        T, H, K = self.T, self.H, self.K
        splits = TB._split_plan(T, H, K, cfg, dev, sms)[1]
        tail, tail_splits = TB._tail_plan(T, H, K, cfg, splits, dev, sms)
        # the tail launch runs after the first one (same stream), split so that its
        # programs fill one wave of SMs
        self.launches = tuple(_Launch(inp, cfg, lo, hi, s, kv, paged)
                              for lo, hi, s in ((0, T - tail, splits), (T - tail, T, tail_splits)) if hi > lo)

    def run(self, q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor,
            valid_counts: torch.Tensor | None, sm_scale: float,
            paged: PagedLookup | None = None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch over tensors with the plan's metadata (the caller's promise: checked, or
        of the signature the plan was made for; ``paged`` given exactly when the plan was
        made with it). ``out`` bf16 [T, H, 512] / ``lse`` f32 [T, H] (contiguous): written
        in place where given, else allocated. Returns (out, lse)."""
        if not self.launches:
            o, l = empty_result(self.T, self.H, self.device)
            if out is not None:
                out.copy_(o)
            if lse is not None:
                lse.copy_(l)
            return (o if out is None else out), (l if lse is None else lse)
        if self.kv_as_bf16:
            kv_rows = kv_rows.view(torch.bfloat16)
        if out is None:
            out = torch.empty((self.T, self.H, D_V), dtype=torch.bfloat16, device=self.device)
        if lse is None:
            lse = torch.empty((self.T, self.H), dtype=torch.float32, device=self.device)
        scale = sm_scale * LOG2E
        scratch = None
        if paged is not None:
            hb = self.launches[0].heads
            if hb > 1:  # head blocks 1.. map their entries here (head block 0 into paged.physical)
                scratch = torch.empty((self.T * (hb - 1), self.K), dtype=torch.int32, device=self.device)
        with on_device(self.cuda_device):
            for launch in self.launches:
                launch.run(q, kv_rows, indices, valid_counts, out, lse, scale, paged, scratch)
        return out, lse


__all__ = ["DecodePlan", "call_signature", "output_signature"]
