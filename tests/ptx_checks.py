"""PTX text checks for the offline sm90 compile tests (imported by the compile scripts,
which run in a fresh interpreter, and by the tests of the checks themselves).

Why ``ex2_args_from_fma``: the compiled code contracts ``x * c - m`` into one fma (the
interpreter, numpy, rounds ``x * c`` first). A softmax or LSE merge that takes a max m
over the rounded products ``x * c`` and then exponentiates ``x * c - m`` gets, in the
compiled code, the *unrounded* product minus the rounded max: at |x * c| ~ 2^45 that
difference is up to 2^21, and exp2 makes it inf or 0 where the interpreter gets
exp2(0) = 1. An exponent argument that comes straight out of an fma is that pattern;
none of the kernels needs one (they exponentiate a plain difference or a product).

Why ``cp_async_after_shared_read``: a ``cp.async`` that refills a shared-memory slot
which other threads of the partition have read must follow a barrier those threads
passed after their reads. The warp-specialised decode kernel's producer relies on the
barriers Triton's shared-memory analysis inserts for that (no barrier in its source
between the conversion of a raw slot and its refill). The check follows the PTX's
control flow backwards from each cp.async (fall-through and branches, loops included)
and reports one that some path reaches from a shared-memory read without a barrier.
"""

import re

_INSTR = re.compile(r"^\s*(?:@!?%p\w+\s+)?([a-z][\w.]*)\s+(%\w+)\s*,\s*([^;]*);", re.M)
_EX2 = re.compile(r"^\s*(?:@!?%p\w+\s+)?ex2\.approx[\w.]*\s+%\w+\s*,\s*(%\w+)\s*;", re.M)
_PASS_THROUGH = ("mov.", "neg.", "abs.", "selp.")  # the value is (one of) its operands
_PRED = r"^\s*(?:@!?%p\w+\s+)?"
_CP_ASYNC = re.compile(_PRED + r"cp\.async\.c[ag]\.shared")
_BARRIER = re.compile(_PRED + r"(?:bar|barrier)\.sync\b")
_SHARED_READ = re.compile(_PRED + r"(?:ld(?:\.\w+)*\.shared|ldmatrix)\b")
_LABEL = re.compile(r"^(\$\w+):")
_BRANCH = re.compile(_PRED + r"bra(?:\.uni)?\s+(\$\w+)\s*;")
_NO_FALL_THROUGH = re.compile(r"^\s*(?:bra(?:\.uni)?\s|ret\b|exit\b)")  # unpredicated


def resource_usage(cubin: bytes) -> str:
    """``cuobjdump --dump-resource-usage`` of a compiled kernel (the Triton wheel's
    cuobjdump): its registers, stack, shared memory, as text."""
    import os
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        return subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def ex2_args_from_fma(ptx: str) -> list[str]:
    """The argument registers of the ``ex2`` instructions in ``ptx`` whose value comes
    from an ``fma`` (directly or through mov / neg / abs / selp); [] when none."""
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    for op, dst, srcs in _INSTR.findall(ptx):
        defs.setdefault(dst, []).append((op, [s.strip() for s in srcs.split(",")]))

    def from_fma(reg: str, seen: set[str]) -> bool:
        if reg in seen:
            return False
        seen.add(reg)
        for op, srcs in defs.get(reg, []):
            if op.startswith("fma."):
                return True
            if op.startswith(_PASS_THROUGH):
                vals = srcs[:2] if op.startswith("selp.") else srcs[:1]
                if any(v.startswith("%") and from_fma(v, seen) for v in vals):
                    return True
        return False

    return [r for r in _EX2.findall(ptx) if from_fma(r, set())]


def cp_async_after_shared_read(ptx: str) -> list[int]:
    """The 1-based line numbers of the ``cp.async`` (into shared memory) in ``ptx`` that
    some control-flow path reaches from a shared-memory read (``ld...shared``,
    ``ldmatrix``) with no ``bar.sync`` / ``barrier.sync`` in between; [] when none.
    Paths are followed backwards through fall-through and through every branch to a
    label (so a loop's refill is checked against the reads at the loop's end)."""
    lines = ptx.splitlines()
    labels = {m.group(1): n for n, line in enumerate(lines) if (m := _LABEL.match(line))}
    into: dict[int, list[int]] = {}  # label line -> the branch lines that jump to it
    for n, line in enumerate(lines):
        m = _BRANCH.match(line)
        if m and m.group(1) in labels:
            into.setdefault(labels[m.group(1)], []).append(n)

    def preds(n: int) -> list[int]:
        out = into.get(n, []).copy()
        if n > 0 and not _NO_FALL_THROUGH.match(lines[n - 1]):
            out.append(n - 1)
        return out

    def reached_from_read(start: int) -> bool:
        seen, todo = set(), preds(start)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if _BARRIER.match(lines[n]):
                continue
            if _SHARED_READ.match(lines[n]):
                return True
            todo.extend(preds(n))
        return False

    return [n + 1 for n, line in enumerate(lines) if _CP_ASYNC.match(line) and reached_from_read(n)]
