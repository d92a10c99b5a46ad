"""The decode kernels' paged-lookup parameters (``kernels.paged_rows``) for the offline
sm90 compile scripts, which spell out a kernel's signature: a call without paged
lookups leaves them at their defaults, which the JIT turns into constexprs (PAGED,
the None pointers, the constants) and unspecialised ints; newer Tritons (3.9) refuse a
signature that leaves them out. Imported by the scripts, which run in a fresh
interpreter with tests/ on the path."""

import inspect

from hisparse.kernels.mla_decode import PAGED_NO_ALIGNMENT, PAGED_NO_SPECIALIZE, sparse_mla_decode_kernel

_CONSTS = dict(PAGED=False, PQ=1, PCH=64, STAT_INVALID=2, STAT_RESOLVES=4, STAT_RESIDENT=6)


def _names() -> list[str]:
    """The paged parameters in the kernels' order (the tl and ws kernels end alike)."""
    names = list(inspect.signature(sparse_mla_decode_kernel.fn).parameters)
    return names[names.index("PAGED"):]


def _type(name: str) -> str:
    if name in _CONSTS:
        return "constexpr"
    if name in PAGED_NO_SPECIALIZE:
        return "i32"
    assert name in PAGED_NO_ALIGNMENT, name
    return "*i64" if name == "stats_ptr" else "*i32"


def unpaged_args() -> tuple[dict, dict]:
    """(signature entries, constexpr values) of the paged parameters, unpaged."""
    sig = {n: ("constexpr" if n in PAGED_NO_ALIGNMENT else _type(n)) for n in _names()}
    consts = dict(_CONSTS)
    consts.update({n: None for n in PAGED_NO_ALIGNMENT})
    return sig, consts


def paged_args() -> tuple[dict, dict]:
    """(signature entries, constexpr values) of the paged parameters of a paged launch."""
    return {n: _type(n) for n in _names()}, {**_CONSTS, "PAGED": True, "PQ": 2, "PCH": 256}
