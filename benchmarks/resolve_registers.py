"""Registers and spills of the decode resolve kernel for sm_90, without a GPU.

  python -m benchmarks.resolve_registers                      # S = 2048 4096 6144 8192
  python -m benchmarks.resolve_registers --slots 5120 --warps 8 16 --json

Compiles ``hisparse.kernels.resolve.resolve_kernel`` with ``triton.compile`` for a
CUDA target (compute capability 9.0 by default) exactly as ``resolve_triton`` would
launch it for K top-k entries, S slots and query length q, the serial decode variant
(no miss lists, no compaction, no alias ids; ``--miss-lists`` / ``--compact`` /
``--aliased`` for the others). The
PTX then goes through the ptxas Triton uses for that target (``-v``). Reported per case:
registers per thread, spill stores / loads in bytes and the stack frame. This runs
on a CPU-only machine: no driver is needed to compile, only to launch.

The launch's alignment specialisation of pointers and strides is not applied, so
the counts can differ a little from the launched kernel's. The figures are the
compiler's, not timings: a kernel that spills is not necessarily slower, nor one that
does not faster (the resolve's slot scans in 2048-lane chunks spilled nothing and
measured slower: BENCHMARKS.md, "Measured slower and removed"). Exit status 2 when the options
are bad or Triton has no ptxas for the target, 1 when a case fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from benchmarks.common import number_in

pos = number_in(int, 1)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.resolve_registers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=pos, nargs="+", default=[2048, 4096, 6144, 8192],
                    help="LRU slots S per (layer, request) [2048 4096 6144 8192]")
    ap.add_argument("--top-k", type=pos, default=2048, help="top-k entries K per token [2048]")
    ap.add_argument("--query-len", type=pos, default=1, help="max query length q [1]")
    ap.add_argument("--warps", type=pos, nargs="+", default=None,
                    help="warps per program [what resolve_triton launches with]")
    ap.add_argument("--sm", type=pos, default=90, help="compute capability, e.g. 90 [90]")
    ap.add_argument("--miss-lists", action="store_true", help="the miss phase of a split resolve")
    ap.add_argument("--compact", action="store_true", help="compacted physical rows")
    ap.add_argument("--aliased", action="store_true", help="with prefix-cache alias ids (host rows through host_block)")
    ap.add_argument("--json", action="store_true", help="print the cases as JSON")
    a = ap.parse_args(argv)
    if a.query_len * a.top_k > min(a.slots):
        ap.error(f"--query-len x --top-k = {a.query_len * a.top_k} exceeds --slots {min(a.slots)}: "
                 "the resolve refuses that (a group could run out of slots)")
    return a


def ptxas_path(sm: int = 90) -> str:
    """The ptxas Triton itself assembles sm_``sm`` code with (releases after 3.6 pick a
    newer one than ``bin/ptxas`` for the PTX they emit)."""
    import triton
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(sm).path
    except (ImportError, AttributeError, TypeError, RuntimeError):
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"no ptxas in this Triton install ({path}); install a triton wheel "
                                "with the NVIDIA backend")
    return path


def compile_case(S: int, K: int, q: int, warps: int | None, sm: int, *, miss_lists: bool,
                 compact: bool, aliased: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hisparse.cache import (RESOLVE_SCAN_CHUNK, RESOLVE_SMALL_SORT, STAT_HITS, STAT_INVALID, STAT_MISSES,
                                STAT_PREFETCH, STAT_RESOLVES, resolve_launch_sizes)
    from hisparse.kernels import resolve_kernel

    KB, GQ, SB, default_warps = resolve_launch_sizes(S, K, q, miss_phase=miss_lists)
    warps = warps or default_warps
    consts = dict(STAT_HITS=STAT_HITS, STAT_MISSES=STAT_MISSES, STAT_INVALID=STAT_INVALID,
                  STAT_RESOLVES=STAT_RESOLVES, STAT_PREFETCH=STAT_PREFETCH, STAMPED=miss_lists,
                  MISS_LISTS=miss_lists, PREFETCH=False, Q=q, KB=KB, GQ=GQ,
                  SMALL_SORT=min(RESOLVE_SMALL_SORT, GQ * KB), SB=SB, COMPACT=compact, CH=RESOLVE_SCAN_CHUNK,
                  ALIASED=aliased)
    int64_ptrs = {"slot_stamp_ptr", "undo_hit_ptr", "undo_vstamp_ptr", "step_ptr", "stats_ptr"}
    sig = {}
    for name in resolve_kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i64" if name in int64_ptrs else "*i32"
        else:
            sig[name] = "i32"
    missing = set(consts) - set(resolve_kernel.arg_names)
    if missing:
        raise RuntimeError(f"resolve_kernel no longer takes {sorted(missing)}: update this script")
    src = ASTSource(fn=resolve_kernel, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", sm, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas_path(sm), "-v", f"--gpu-name=sm_{sm}a" if sm >= 90 else f"--gpu-name=sm_{sm}",
                            ptx, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {r.stderr.strip()[-400:]}")
    out = r.stderr

    def grab(pattern: str) -> int | None:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else None

    return dict(S=S, K=K, q=q, SB=SB, warps=warps, registers=grab(r"Used (\d+) registers"),
                spill_stores=grab(r"(\d+) bytes spill stores"), spill_loads=grab(r"(\d+) bytes spill loads"),
                stack=grab(r"(\d+) bytes stack frame"))


def main(argv=None) -> int:
    a = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("resolve_registers: TRITON_INTERPRET is set, so Triton would interpret the kernel "
              "instead of compiling it; unset it and rerun", file=sys.stderr)
        return 2
    try:
        ptxas_path(a.sm)
    except FileNotFoundError as e:
        print(f"resolve_registers: {e}", file=sys.stderr)
        return 2
    cases = []
    for S in a.slots:
        for w in (a.warps or [None]):
            try:
                c = compile_case(S, a.top_k, a.query_len, w, a.sm, miss_lists=a.miss_lists,
                                 compact=a.compact, aliased=a.aliased)
            except Exception as e:  # ptxas or the compiler (its CompilationError too) refused the case
                print(f"resolve_registers: S={S}: {e}", file=sys.stderr)
                return 1
            cases.append(c)
            if not a.json:
                print(f"S={c['S']:6d} (tile {c['SB']:5d})  warps {c['warps']:2d}  registers {c['registers']}  "
                      f"spills {c['spill_stores']} / {c['spill_loads']} B  stack {c['stack']} B", flush=True)
    if a.json:
        print(json.dumps(cases, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
