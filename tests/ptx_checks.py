"""PTX text checks for the offline sm90 compile tests (imported by the compile scripts,
which run in a fresh interpreter, and by the tests of the checks themselves).

Why ``ex2_args_from_fma``: the compiled code contracts ``x * c - m`` into one fma (the
interpreter, numpy, rounds ``x * c`` first). A softmax or LSE merge that takes a max m
over the rounded products ``x * c`` and then exponentiates ``x * c - m`` gets, in the
compiled code, the *unrounded* product minus the rounded max: at |x * c| ~ 2^45 that
difference is up to 2^21, and exp2 makes it inf or 0 where the interpreter gets
exp2(0) = 1. An exponent argument that comes straight out of an fma is that pattern;
none of the kernels needs one (they exponentiate a plain difference or a product).
"""

import re

_INSTR = re.compile(r"^\s*(?:@!?%p\w+\s+)?([a-z][\w.]*)\s+(%\w+)\s*,\s*([^;]*);", re.M)
_EX2 = re.compile(r"^\s*(?:@!?%p\w+\s+)?ex2\.approx[\w.]*\s+%\w+\s*,\s*(%\w+)\s*;", re.M)
_PASS_THROUGH = ("mov.", "neg.", "abs.", "selp.")  # the value is (one of) its operands


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
