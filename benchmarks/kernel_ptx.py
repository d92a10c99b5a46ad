"""Do the sparse-MLA kernels compile to the same code as at another commit? (sm90, no GPU)

  python -m benchmarks.kernel_ptx --against c19557e            # this tree vs that commit
  python -m benchmarks.kernel_ptx --against main --keep /tmp/ptx --json

Compiles the ``tl`` attention kernels (``mla_decode``, ``mla_decode_wide``, ``mla_miss``)
with ``triton.compile`` for sm90 at every specialisation their launchers use (see
``specialisations``), once from this tree and once from ``--against``'s ``hisparse/``
(``git archive``), each in a fresh interpreter with its own Triton cache, and compares:

- the PTX, normalised by ``normalise_ptx``: line info (``.loc``, ``.file``), the DWARF
  sections, the labels only those reference (``$L__tmpN``, ``$L__func_begin0``,
  ``$L__func_end0``) and ``//`` comments are dropped (they carry source line numbers,
  file paths and LLVM's names of inlined values), blank lines too; every instruction,
  directive, register and branch label is compared as emitted;
- where the dropped debug-scope labels stand (``debug_label_positions``): they bound
  the inlined ``@triton.jit`` calls, so code moved into or out of a helper moves them,
  and ptxas schedules around them (the same instructions can assemble to different SASS
  when only these labels moved; Triton emits them whenever line info is on, its default);
- the SASS of the cubin (``cuobjdump -sass``, instruction lines only): the deciding
  comparison;
- ptxas's resource usage (registers, stack, shared memory).

The Gluon kernel (``mla_decode_ws``) is not compiled here (``tests/test_attention_ws_compile``
covers it). Exit status 0 when every specialisation has the same PTX instructions and
the same SASS (moved labels alone are reported, not failed), 1 when one differs,
2 when a tree does not compile or the options are bad. Figures are the compiler's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4}\*/\s*(.*?)\s*;?\s*/\*.*$", re.MULTILINE)
_DEBUG_LABEL = re.compile(r"^\$L__(?:tmp\d+|func_begin\d+|func_end\d+):$")


def normalise_ptx(ptx: str) -> str:
    """``ptx`` without what moves with source lines (see the module docstring)."""
    return "\n".join(_split_ptx(ptx)[0]) + "\n"


def debug_label_positions(ptx: str) -> list[int]:
    """Where the debug-scope labels stand: for each, the number of lines of
    ``normalise_ptx(ptx)`` before it. Inert for the PTX's meaning, not for ptxas: it
    schedules differently when they move (the labels bound the inlined calls, so
    moving code into or out of a helper moves them)."""
    return _split_ptx(ptx)[1]


def _split_ptx(ptx: str) -> tuple[list[str], list[int]]:
    out: list[str] = []
    labels: list[int] = []
    for line in ptx.splitlines():
        if re.match(r"^\s*\.section\s+\.debug_", line):
            break  # the DWARF sections close the module
        code = line.split("//", 1)[0].rstrip()
        s = code.strip()
        if _DEBUG_LABEL.match(s):
            labels.append(len(out))
            continue
        if not s or s.startswith((".loc", ".file")):
            continue
        if "$L__tmp" in s or "$L__func_" in s:
            raise RuntimeError(f"a debug label is referenced by code: {s!r}")
        out.append(code)
    return out, labels


# ------------------------------------------------------------------ specialisations
_DECODE_SIG = {"q_ptr": "*bf16", "kv_ptr": None, "idx_ptr": "*i32", "vc_ptr": "*i32",
               "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
               "part_lse_ptr": "*fp32", "N": "i32", "K": "i32", "H": "i32",
               "q_stride_t": "i32", "q_stride_h": "i32", "kv_stride": "i32",
               "idx_stride": "i32", "rows_per_split": "i32", "qk_scale_log2": "fp32"}
_MISS_SIG = {"q_ptr": "*bf16", "kv_ptr": None, "idx_ptr": "*i32", "cnt_ptr": "*i32",
             "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "N": "i32", "K": "i32", "H": "i32",
             "q_stride_t": "i32", "q_stride_h": "i32", "kv_stride": "i32",
             "idx_stride": "i32", "qk_scale_log2": "fp32"}
# what the launchers specialise at run time on 16-aligned inputs (the compile tests' choice;
# the miss kernel does not specialise N and K)
_DECODE_DIV16 = ("N", "K", "H", "q_stride_t", "q_stride_h", "kv_stride", "idx_stride",
                 "rows_per_split")
_MISS_DIV16 = ("H", "q_stride_t", "q_stride_h", "kv_stride", "idx_stride")


def _spec(name, module, kernel, sig, consts, div16, **options) -> dict:
    sig = {**sig, **{k: "constexpr" for k in consts}}
    return {"name": name, "module": module, "kernel": kernel, "sig": sig, "consts": consts,
            "div16": [n for n in sig if sig[n].startswith("*") or n in div16], "options": options}


def specialisations() -> list[dict]:
    """Every (kernel, constants, launch options) the launchers compile on a GPU: the decode
    defaults (``DEFAULT_CONFIGS``: both row formats, 16/32/64-head blocks; the tiled body
    at 64 heads for fp8 rows too, and without isolate_qk as ``isolate_problem`` falls back
    to), one split and four, with and without valid counts; the miss kernel at
    ``gpu_config``'s shapes (16/32/64-head blocks, one split and four) and at the CPU
    default's; the combine and merge kernels."""
    import dataclasses

    from hisparse.attention import DEFAULT_CONFIGS, MERGE_BLOCK_H, MissConfig, gpu_config
    from hisparse.formats import RowFormat

    specs = []
    decode = [(f"{f.value}-h{bh}", f, c) for (f, bh), c in DEFAULT_CONFIGS.items()]
    fp8_64 = DEFAULT_CONFIGS[(RowFormat.FP8_DS_MLA, 64)]
    decode.append(("fp8_ds_mla-h64-tiled", RowFormat.FP8_DS_MLA,
                   dataclasses.replace(fp8_64, wide=False)))
    for f in RowFormat:
        c = DEFAULT_CONFIGS[(f, 64)]
        decode.append((f"{f.value}-h64-tiled-noiso", f,
                       dataclasses.replace(c, wide=False, isolate_qk=False)))
    for label, fmt, c in decode:
        fp8 = fmt is RowFormat.FP8_DS_MLA
        sig = {**_DECODE_SIG, "kv_ptr": "*u8" if fp8 else "*bf16"}
        for splits in (1, 4):
            for vc in (True, False):
                consts = {"HAS_VC": vc, "IS_FP8": fp8, "NUM_SPLITS": splits,
                          "BLOCK_H": c.block_h, "BLOCK_N": c.block_n}
                if c.wide:
                    consts["PREFETCH"] = c.prefetch
                    kernel = ("hisparse.kernels.mla_decode_wide", "sparse_mla_decode_wide_kernel")
                else:
                    consts.update(ISOLATE_QK=c.isolate_qk, PREFETCH=c.prefetch)
                    kernel = ("hisparse.kernels.mla_decode", "sparse_mla_decode_kernel")
                specs.append(_spec(f"decode{'-wide' if c.wide else ''} {label} s{splits}"
                                   f"{' vc' if vc else ''}", *kernel, sig, consts, _DECODE_DIV16,
                                   num_warps=c.num_warps, num_stages=c.num_stages))
    specs.append(_spec("decode-combine s3", "hisparse.kernels.mla_decode",
                       "sparse_mla_combine_kernel",
                       {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                        "lse_ptr": "*fp32", "H": "i32"}, {"NUM_SPLITS": 3, "SPLITS_P2": 4}, (),
                       num_warps=4))
    miss = [(f"h{H}", gpu_config("split", H, num_splits=S)) for H in (16, 32, 128) for S in (1, 4)]
    miss.append(("cpu-default", MissConfig(block_h=64, block_n=16, num_warps=4, isolate_qk=False)))
    for label, c in miss:
        for fp8 in (True, False):
            sig = {**_MISS_SIG, "kv_ptr": "*u8" if fp8 else "*bf16"}
            consts = {"IS_FP8": fp8, "NUM_SPLITS": c.num_splits, "BLOCK_H": c.block_h,
                      "BLOCK_N": c.block_n, "ISOLATE_QK": c.isolate_qk,
                      "PREFETCH": int(c.prefetch)}
            specs.append(_spec(f"miss-split {'fp8_ds_mla' if fp8 else 'bf16'} {label} "
                               f"s{c.num_splits}", "hisparse.kernels.mla_miss", "miss_split_kernel",
                               sig, consts, _MISS_DIV16, num_warps=c.num_warps,
                               num_stages=c.num_stages))
    specs.append(_spec("miss-combine s4", "hisparse.kernels.mla_miss", "miss_combine_kernel",
                       {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "cnt_ptr": "*i32",
                        "out_ptr": "*bf16", "lse_ptr": "*fp32", "K": "i32", "H": "i32"},
                       {"NUM_SPLITS": 4, "BLOCK_N": 32, "BLOCK_H": MERGE_BLOCK_H}, _MISS_DIV16,
                       num_warps=4))
    for po in ("fp32", "bf16"):
        specs.append(_spec(f"miss-merge part {po}", "hisparse.kernels.mla_miss",
                           "miss_merge_kernel",
                           {"out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": f"*{po}",
                            "part_lse_ptr": "*fp32", "H": "i32"}, {"BLOCK_H": MERGE_BLOCK_H},
                           _MISS_DIV16, num_warps=4))
    return specs


# ------------------------------------------------------------------ one tree (child)
def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_tree(specs: list[dict]) -> list[dict]:
    """Compile ``specs`` with the hisparse on sys.path: per spec its normalised PTX, SASS
    instruction lines and resource usage."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # every kernel up front: the source is read at import, before any long compile
    fns = [getattr(importlib.import_module(s["module"]), s["kernel"]) for s in specs]
    out = []
    for s, fn in zip(specs, fns):
        names = list(s["sig"])
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in s["div16"]}
        src = ASTSource(fn=fn, signature=s["sig"], attrs=attrs, constexprs=s["consts"])
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=s["options"])
        with tempfile.TemporaryDirectory() as d:
            cubin = os.path.join(d, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(k.asm["cubin"])
            sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True, check=True).stdout
            usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin],
                                   capture_output=True, text=True, check=True).stdout
        sass = "\n".join(m.group(1).strip() for m in _SASS_LINE.finditer(sass))
        res = {k2: int(v) for k2, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", usage)}
        out.append({"name": s["name"], "ptx": normalise_ptx(k.asm["ptx"]), "sass": sass,
                    "labels": debug_label_positions(k.asm["ptx"]), "usage": res})
    return out


# ------------------------------------------------------------------ compare (parent)
def _run_tree(tree: str, specs: list[dict], cache: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=tree, TRITON_CACHE_DIR=cache)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(specs, f)
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f.name],
                           check=False, capture_output=True, text=True, env=env, cwd=tree)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def compare(base: list[dict], head: list[dict]) -> list[dict]:
    """One row per specialisation: whether the normalised PTX and the SASS are identical,
    the PTX line counts and the resource usage of both trees."""
    rows = []
    for b, h in zip(base, head, strict=True):
        rows.append({"name": h["name"], "ptx_same": b["ptx"] == h["ptx"],
                     "labels_same": b["labels"] == h["labels"], "sass_same": b["sass"] == h["sass"],
                     "ptx_lines": [b["ptx"].count("\n"), h["ptx"].count("\n")],
                     "sass_instr": [b["sass"].count("\n") + 1, h["sass"].count("\n") + 1],
                     "usage": [b["usage"], h["usage"]],
                     "ptx_sha": [_digest(b["ptx"]), _digest(h["ptx"])]})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernel_ptx", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD",
                    help="git revision to compare this tree's kernels with [HEAD]")
    ap.add_argument("--only", default=None, help="specialisations whose name contains this")
    ap.add_argument("--keep", default=None,
                    help="write each tree's normalised PTX and SASS under this folder")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--cache", default=None,
                    help="Triton cache folder kept between runs (keyed by the kernels' source; "
                         "default: a fresh one per run)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        with open(a.child) as f:
            print(json.dumps(compile_tree(json.load(f))))
        return 0
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(_tool("cuobjdump")) or not os.path.exists(_tool("ptxas")):
        print(f"kernel_ptx: no ptxas / cuobjdump in the Triton wheel ({_tool('ptxas')})",
              file=sys.stderr)
        return 2
    specs = [s for s in specialisations() if a.only is None or a.only in s["name"]]
    if not specs:
        print(f"kernel_ptx: no specialisation matches --only {a.only!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        os.mkdir(base_tree)
        arch = subprocess.run(["git", "-C", repo, "archive", a.against, "hisparse"],
                              check=False, capture_output=True)
        if arch.returncode != 0:
            print(f"kernel_ptx: git archive {a.against}: {arch.stderr.decode().strip()}",
                  file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", base_tree], input=arch.stdout, check=True)
        try:
            base = _run_tree(base_tree, specs, a.cache or os.path.join(tmp, "cache-base"))
            head = _run_tree(repo, specs, a.cache or os.path.join(tmp, "cache-head"))
        except RuntimeError as e:
            print(f"kernel_ptx: {e}", file=sys.stderr)
            return 2
    if a.keep:
        for tag, tree in (("base", base), ("head", head)):
            os.makedirs(os.path.join(a.keep, tag), exist_ok=True)
            for r in tree:
                stem = os.path.join(a.keep, tag, re.sub(r"\W+", "_", r["name"]))
                for ext in ("ptx", "sass"):
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(r[ext])
    rows = compare(base, head)
    if a.json:
        print(json.dumps({"against": a.against, "rows": rows}, indent=1))
    else:
        for r in rows:
            verdict = (f"PTX {'same' if r['ptx_same'] else 'DIFFERS'}"
                       f"{'' if r['labels_same'] else ' (labels moved)'}, "
                       f"SASS {'same' if r['sass_same'] else 'DIFFERS'}")
            u = r["usage"][1]
            print(f"{r['name']:<40} {verdict:<37} REG {u.get('REG')} STACK {u.get('STACK')} "
                  f"SHARED {u.get('SHARED')}"
                  + ("" if r["usage"][0] == u else f" (was {r['usage'][0]})"))
    return 0 if all(r["ptx_same"] and r["sass_same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
