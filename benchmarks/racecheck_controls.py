"""Control kernels for reading compute-sanitizer racecheck's reports on the warp-specialised
Gluon decode kernel (``hisparse/kernels/mla_decode_ws.py``): tiny SM 9.x Gluon kernels,
each isolating one way warps exchange data through shared memory, each checking its own
output on the GPU.

  compute-sanitizer --tool racecheck python -m benchmarks.racecheck_controls
  compute-sanitizer --tool memcheck  python -m benchmarks.racecheck_controls
  python -m benchmarks.racecheck_controls --compile-only   # no GPU: compile for sm90, PTX counts
  (``bash benchmarks/gpu_run.sh racecheck_controls`` runs both tools and keeps the reports)

Controls (one kernel each, so racecheck names the control in every report):

  ctl_a_ws_bare      warp_specialize, the decode kernel's partition shape (default + two
                     4-warp workers, the same register split), no user shared memory: each
                     partition writes its own global values. Any shared-memory hazard
                     reported here comes from Triton's warp-specialize lowering itself.
  ctl_a_ws_inits     ctl_a_ws_bare plus the decode kernel's prologue before the fork: a
                     ring of mbarriers initialised, fence_async_shared, a CTA barrier.
  ctl_a_ws_inits_nobar  the same prologue without the CTA barrier (inits + fence).
  ctl_a_ws_bar       ctl_a_ws_bare plus only a CTA barrier before the fork (which the four
                     default warps execute as bar.sync 0, 128: the workers are parked at
                     the fork), no shared memory: whether that alone is reported.
  ctl_b_mbarrier     a producer partition stores tiles to a 2-slot shared ring with generic
                     st.shared; a consumer partition loads them (ld.shared, another layout)
                     after mbarrier.wait(ready) and releases the slot with
                     mbarrier.arrive(empty), which the producer waits for before reuse:
                     correct by the PTX memory model (arrive has release, the completed
                     wait acquire semantics at CTA scope).
  ctl_c_unsynced     ctl_b_mbarrier with the consumer's waits removed (and so the empty
                     round trip): a real race, the positive control. Its output may or may
                     not differ from the expected tiles on a given run; either is printed,
                     neither fails the script.
  ctl_d_cta_barrier  the same exchange in one 8-warp CTA without partitions: every warp
                     stores, a CTA barrier (bar.sync 0, all threads), every warp loads in
                     the other layout, a CTA barrier before the slot is rewritten.

How to read racecheck's report (its summary line counts hazards per kernel name):
  ctl_c_unsynced reported, ctl_d_cta_barrier clean: racecheck sees generic cross-warp
      shared-memory races and honours bar.sync.
  ctl_b_mbarrier reported: racecheck does not model mbarrier arrive / try_wait ordering
      for generic accesses (a tool artefact); clean: it does.
  ctl_a_ws_bare reported at the kernel entry: Triton's warp-specialize switch (each worker
      warp reads its partition number from a shared byte the default warps write, the
      two sides ordered by barrier.sync 1 over all the CTA's threads) is what racecheck
      flags in every warp-specialised kernel, hisparse's included.

Prints one line per control and exits 0 when every control but ctl_c_unsynced computed
what it should (1 otherwise; 4 when this Triton or device can't run Gluon SM 9.x kernels).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from hisparse.attention import WS_MAXNREG, gluon_ws_problem, ws_consumer_regs, ws_device_problem
from hisparse.kernels import cta_barrier

PRODUCER_REGS = 72  # the decode kernel's default register split (WS_DEFAULT)
ROWS, COLS, SLOTS = 32, 64, 2  # one ring slot: int32 [ROWS, COLS]


@gluon.jit
def _tile(layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """(row, col) index grids int32 [ROWS, 1] and [1, COLS] in ``layout``."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    return r[:, None], c[None, :]


@gluon.jit
def _tile_value(cta, j, r, c, ROWS: gl.constexpr, COLS: gl.constexpr):
    """The value element (r, c) of round j's tile holds in CTA cta (all distinct)."""
    return (cta * 4096 + j) * (ROWS * COLS) + r * COLS + c


# --- a: warp_specialize without user shared memory ------------------------------------

@gluon.jit
def _mark(out_ptr, part: gl.constexpr, NPART: gl.constexpr):
    """out[cta, part, thread] = cta * 8 + part + 1 (int32 [CTAS, NPART, 128])."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    cta = gl.program_id(0)
    tid = gl.arange(0, 128, layout=lay)
    gl.store(out_ptr + (cta * NPART + part) * 128 + tid, tid * 0 + cta * 8 + part + 1)


@gluon.jit
def _mark0(out_ptr, NPART: gl.constexpr):
    _mark(out_ptr, 0, NPART)


@gluon.jit
def _mark1(out_ptr, NPART: gl.constexpr):
    _mark(out_ptr, 1, NPART)


@gluon.jit
def _mark2(out_ptr, NPART: gl.constexpr):
    _mark(out_ptr, 2, NPART)


@gluon.jit
def ctl_a_ws_bare_kernel(out_ptr,  # int32 [CTAS, 3, 128]
                         WORKER_REGS0: gl.constexpr, WORKER_REGS1: gl.constexpr):
    gl.warp_specialize([(_mark0, (out_ptr, 3)), (_mark1, (out_ptr, 3)), (_mark2, (out_ptr, 3))],
                       [4, 4], [WORKER_REGS0, WORKER_REGS1])


@gluon.jit
def ctl_a_ws_inits_kernel(out_ptr,  # int32 [CTAS, 3, 128]
                          WORKER_REGS0: gl.constexpr, WORKER_REGS1: gl.constexpr,
                          SLOTS: gl.constexpr):
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    cta_barrier()
    gl.warp_specialize([(_mark0, (out_ptr, 3)), (_mark1, (out_ptr, 3)), (_mark2, (out_ptr, 3))],
                       [4, 4], [WORKER_REGS0, WORKER_REGS1])


@gluon.jit
def ctl_a_ws_inits_nobar_kernel(out_ptr,  # int32 [CTAS, 3, 128]
                                WORKER_REGS0: gl.constexpr, WORKER_REGS1: gl.constexpr,
                                SLOTS: gl.constexpr):
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([(_mark0, (out_ptr, 3)), (_mark1, (out_ptr, 3)), (_mark2, (out_ptr, 3))],
                       [4, 4], [WORKER_REGS0, WORKER_REGS1])


@gluon.jit
def ctl_a_ws_bar_kernel(out_ptr,  # int32 [CTAS, 3, 128]
                        WORKER_REGS0: gl.constexpr, WORKER_REGS1: gl.constexpr):
    cta_barrier()
    gl.warp_specialize([(_mark0, (out_ptr, 3)), (_mark1, (out_ptr, 3)), (_mark2, (out_ptr, 3))],
                       [4, 4], [WORKER_REGS0, WORKER_REGS1])


# --- b, c: producer / consumer partitions exchanging tiles through shared memory -------

@gluon.jit
def _ring_producer(ring, ready, empty, n_rounds, SYNC: gl.constexpr, ROWS: gl.constexpr,
                   COLS: gl.constexpr, SLOTS: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    r, c = _tile(lay, ROWS, COLS)
    cta = gl.program_id(0)
    for j in range(n_rounds):
        s = j % SLOTS
        if SYNC:
            mbarrier.wait(empty.index(s), ((j // SLOTS) & 1) ^ 1)
        ring.index(s).store(_tile_value(cta, j, r, c, ROWS, COLS))
        fence_async_shared()  # as the decode kernel's producer does before its arrive
        mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _ring_consumer(ring, ready, empty, out_ptr, n_rounds, SYNC: gl.constexpr,
                   ROWS: gl.constexpr, COLS: gl.constexpr, SLOTS: gl.constexpr):
    """Copies round j's tile to out[cta, j] (int32 [CTAS, n_rounds, ROWS, COLS]), reading
    it in a layout whose threads hold other threads' (and warps') elements."""
    lay: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, 4], [0, 1])
    r, c = _tile(lay, ROWS, COLS)
    cta = gl.program_id(0)
    for j in range(n_rounds):
        s = j % SLOTS
        if SYNC:
            mbarrier.wait(ready.index(s), (j // SLOTS) & 1)
        v = ring.index(s).load(lay)
        if SYNC:
            mbarrier.arrive(empty.index(s), count=1)
        gl.store(out_ptr + ((cta * n_rounds + j) * ROWS + r) * COLS + c, v)


@gluon.jit
def _idle(n_rounds):
    pass


@gluon.jit
def _ring_kernel(out_ptr, n_rounds, SYNC: gl.constexpr, WORKER_REGS0: gl.constexpr,
                 WORKER_REGS1: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                 SLOTS: gl.constexpr):
    """Partitions as in the decode kernel: consumer = the default warps, producer = the
    second worker; the first worker idles (it takes the decode kernel's second consumer's
    place, so the warp and register layout is the same)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.int32, [SLOTS, ROWS, COLS], plain)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    cta_barrier()
    gl.warp_specialize([
        (_ring_consumer, (ring, ready, empty, out_ptr, n_rounds, SYNC, ROWS, COLS, SLOTS)),
        (_idle, (n_rounds, )),
        (_ring_producer, (ring, ready, empty, n_rounds, SYNC, ROWS, COLS, SLOTS)),
    ], [4, 4], [WORKER_REGS0, WORKER_REGS1])


@gluon.jit
def ctl_b_mbarrier_kernel(out_ptr,  # int32 [CTAS, n_rounds, ROWS, COLS]
                          n_rounds, WORKER_REGS0: gl.constexpr, WORKER_REGS1: gl.constexpr,
                          ROWS: gl.constexpr, COLS: gl.constexpr, SLOTS: gl.constexpr):
    _ring_kernel(out_ptr, n_rounds, True, WORKER_REGS0, WORKER_REGS1, ROWS, COLS, SLOTS)


@gluon.jit
def ctl_c_unsynced_kernel(out_ptr,  # int32 [CTAS, n_rounds, ROWS, COLS]
                          n_rounds, WORKER_REGS0: gl.constexpr, WORKER_REGS1: gl.constexpr,
                          ROWS: gl.constexpr, COLS: gl.constexpr, SLOTS: gl.constexpr):
    _ring_kernel(out_ptr, n_rounds, False, WORKER_REGS0, WORKER_REGS1, ROWS, COLS, SLOTS)


# --- d: the same exchange ordered by CTA barriers, no partitions ------------------------

@gluon.jit
def ctl_d_cta_barrier_kernel(out_ptr,  # int32 [CTAS, n_rounds, ROWS, COLS]
                             n_rounds, ROWS: gl.constexpr, COLS: gl.constexpr,
                             SLOTS: gl.constexpr):
    """8 warps: all store round j's tile (warps split by rows), CTA barrier, all load it
    (warps split by columns, so each warp reads what other warps stored) and write it to
    out[cta, j], CTA barrier before the slot is stored again."""
    st_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])
    ld_l: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, 8], [0, 1])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.int32, [SLOTS, ROWS, COLS], plain)
    rs, cs = _tile(st_l, ROWS, COLS)
    rl, cl = _tile(ld_l, ROWS, COLS)
    cta = gl.program_id(0)
    for j in range(n_rounds):
        s = j % SLOTS
        ring.index(s).store(_tile_value(cta, j, rs, cs, ROWS, COLS))
        cta_barrier()
        v = ring.index(s).load(ld_l)
        cta_barrier()
        gl.store(out_ptr + ((cta * n_rounds + j) * ROWS + rl) * COLS + cl, v)


# --- host side -----------------------------------------------------------------------

def _regs() -> tuple[int, int]:
    return ws_consumer_regs(PRODUCER_REGS), PRODUCER_REGS


def _expected_marks(ctas: int, device: torch.device) -> torch.Tensor:
    cta = torch.arange(ctas, device=device, dtype=torch.int32)[:, None, None]
    part = torch.arange(3, device=device, dtype=torch.int32)[None, :, None]
    return (cta * 8 + part + 1).expand(ctas, 3, 128)


def _expected_tiles(ctas: int, rounds: int, device: torch.device) -> torch.Tensor:
    cta = torch.arange(ctas, device=device, dtype=torch.int64)[:, None, None, None]
    j = torch.arange(rounds, device=device, dtype=torch.int64)[None, :, None, None]
    e = torch.arange(ROWS * COLS, device=device, dtype=torch.int64).view(1, 1, ROWS, COLS)
    return ((cta * 4096 + j) * (ROWS * COLS) + e).to(torch.int32)


def run_controls(ctas: int, rounds: int, device: torch.device) -> list[tuple[str, bool, str]]:
    """Launch every control once; (name, computed what it should, detail) per control."""
    r0, r1 = _regs()
    ws = dict(num_warps=4, maxnreg=WS_MAXNREG)
    rows = []
    for name, kern, extra in (("ctl_a_ws_bare", ctl_a_ws_bare_kernel, {}),
                              ("ctl_a_ws_inits", ctl_a_ws_inits_kernel, dict(SLOTS=SLOTS)),
                              ("ctl_a_ws_inits_nobar", ctl_a_ws_inits_nobar_kernel, dict(SLOTS=SLOTS)),
                              ("ctl_a_ws_bar", ctl_a_ws_bar_kernel, {})):
        out = torch.zeros(ctas, 3, 128, dtype=torch.int32, device=device)
        kern[(ctas, )](out, WORKER_REGS0=r0, WORKER_REGS1=r1, **extra, **ws)
        torch.cuda.synchronize(device)
        bad = int((out != _expected_marks(ctas, device)).sum())
        rows.append((name, bad == 0, f"{bad} of {out.numel()} marks wrong"))
    want = _expected_tiles(ctas, rounds, device)
    wsr = dict(WORKER_REGS0=r0, WORKER_REGS1=r1, **ws)
    for name, kern, kw in (
            ("ctl_b_mbarrier", ctl_b_mbarrier_kernel, wsr),
            ("ctl_d_cta_barrier", ctl_d_cta_barrier_kernel, dict(num_warps=8)),
            # last: its hazards can't use up the sanitizer's print limit before the others'
            ("ctl_c_unsynced", ctl_c_unsynced_kernel, wsr)):
        out = torch.full((ctas, rounds, ROWS, COLS), -1, dtype=torch.int32, device=device)
        kern[(ctas, )](out, rounds, ROWS=ROWS, COLS=COLS, SLOTS=SLOTS, **kw)
        torch.cuda.synchronize(device)
        bad = int((out != want).sum())
        detail = f"{bad} of {out.numel()} elements differ from the tiles stored"
        if name == "ctl_c_unsynced":
            rows.append((name, True, detail + " (racy by design: any count is possible)"))
        else:
            rows.append((name, bad == 0, detail))
    return rows


_COMPILE_SIGS = {
    "ctl_a_ws_bare": ({"out_ptr": "*i32"}, ("WORKER_REGS0", "WORKER_REGS1")),
    "ctl_a_ws_inits": ({"out_ptr": "*i32"}, ("WORKER_REGS0", "WORKER_REGS1", "SLOTS")),
    "ctl_a_ws_inits_nobar": ({"out_ptr": "*i32"}, ("WORKER_REGS0", "WORKER_REGS1", "SLOTS")),
    "ctl_a_ws_bar": ({"out_ptr": "*i32"}, ("WORKER_REGS0", "WORKER_REGS1")),
    "ctl_b_mbarrier": ({"out_ptr": "*i32", "n_rounds": "i32"},
                       ("WORKER_REGS0", "WORKER_REGS1", "ROWS", "COLS", "SLOTS")),
    "ctl_c_unsynced": ({"out_ptr": "*i32", "n_rounds": "i32"},
                       ("WORKER_REGS0", "WORKER_REGS1", "ROWS", "COLS", "SLOTS")),
    "ctl_d_cta_barrier": ({"out_ptr": "*i32", "n_rounds": "i32"}, ("ROWS", "COLS", "SLOTS")),
}


def compile_controls() -> list[dict]:
    """Compile every control for sm90 without a GPU (ptxas from the Triton wheel); counts
    of the PTX instructions the controls are about, per control."""
    r0, r1 = _regs()
    values = dict(WORKER_REGS0=r0, WORKER_REGS1=r1, ROWS=ROWS, COLS=COLS, SLOTS=SLOTS)
    kernels = {n: globals()[n + "_kernel"] for n in _COMPILE_SIGS}
    out = []
    for name, (sig, consts) in _COMPILE_SIGS.items():
        signature = {**sig, **{k: "constexpr" for k in consts}}
        options = dict(num_warps=8) if name == "ctl_d_cta_barrier" else dict(
            num_warps=4, maxnreg=WS_MAXNREG)
        k = triton.compile(GluonASTSource(fn=kernels[name], signature=signature,
                                          constexprs={c: values[c] for c in consts},
                                          attrs={(0, ): [["tt.divisibility", 16]]}),
                           target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        out.append({"control": name, "warps": k.metadata.num_warps, "shared": k.metadata.shared,
                    **{key: len(re.findall(pat, ptx)) for key, pat in (
                        ("st_shared", r"\bst\.shared\."), ("ld_shared", r"\bld\.shared\."),
                        ("bar_sync", r"\bbar\.sync\b"), ("barrier_sync", r"\bbarrier\.sync\b"),
                        ("mbarrier_wait", r"mbarrier\.try_wait"),
                        ("mbarrier_arrive", r"mbarrier\.arrive"))}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, default=8, help="CTAs per control (default 8)")
    ap.add_argument("--rounds", type=int, default=6,
                    help="tiles passed through the 2-slot ring per CTA (default 6)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile for sm90 without a GPU and print PTX counts as JSON")
    args = ap.parse_args(argv)
    if args.ctas < 1 or args.rounds < 1:
        print("racecheck_controls: --ctas and --rounds must be >= 1", file=sys.stderr)
        return 2
    problem = gluon_ws_problem()
    if problem is not None:
        print(f"racecheck_controls: cannot build Gluon SM 9.x kernels: {problem}", file=sys.stderr)
        return 4
    if args.compile_only:
        for row in compile_controls():
            print(json.dumps(row))
        return 0
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    problem = ws_device_problem(device)
    if problem is not None:
        print(f"racecheck_controls: the controls need a CUDA SM 9.x GPU: {problem}",
              file=sys.stderr)
        return 4
    rows = run_controls(args.ctas, args.rounds, device)
    for name, ok, detail in rows:
        print(f"{name:18s} {'ok ' if ok else 'BAD'}  {detail}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
