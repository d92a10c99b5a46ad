"""The decode kernels' paged-lookup parameters (``kernels.paged_rows``) for the offline
sm90 compile scripts, which spell out a kernel's signature: a call without paged
lookups leaves them at their defaults, which the JIT turns into constexprs (PAGED,
the None pointers, the constants) and unspecialised ints; newer Tritons (3.9) refuse a
signature that leaves them out. Imported by the scripts, which run in a fresh
interpreter with tests/ on the path."""

_INTS = ("t0", "max_request_id", "R", "pt_stride", "MP", "pool_base", "PB", "NPG", "phys_stride")
_PTRS = ("req_ids_ptr", "id_to_slot_ptr", "resident_ptr", "seq_lens_ptr", "pt_ptr", "stats_ptr", "phys_ptr",
         "scratch_ptr")
_CONSTS = dict(PAGED=False, PQ=1, PCH=64, STAT_INVALID=2, STAT_RESOLVES=4, STAT_RESIDENT=6)


def unpaged_args() -> tuple[dict, dict]:
    """(signature entries, constexpr values) of the paged parameters, unpaged."""
    sig = {n: "i32" for n in _INTS}
    sig.update({n: "constexpr" for n in _PTRS})
    sig.update({n: "constexpr" for n in _CONSTS})
    consts = dict(_CONSTS)
    consts.update({n: None for n in _PTRS})
    return sig, consts
