"""What a stress run's sizes must satisfy, said in the words of its flags.

:class:`hisparse.HiSparseConfig` checks the same limits, but names its own fields
(``device_buffer_size``, ``max_request_id``, the host pool): a ``hisparse stress`` user
gave ``--buffer``, ``--requests`` and ``--block-size``. :func:`check_stress_sizes` runs
before the config is built, once a replayed trace's sizes are known, and names the flag
(or the trace) that sets the size at fault. ``--prefetch`` into a one-layer run is
refused here too (the rule of :mod:`hisparse_tools.flag_rules`): the layer count may
come from the trace.
"""

from __future__ import annotations

from hisparse.errors import CapacityError
from .flag_rules import unused

INT32_MAX = 2**31 - 1


def check_stress_sizes(*, layers: int, top_k: int, buffer: int | None, block_size: int, live: int,
                       max_len: int, replay: bool, prefetch: bool) -> None:
    """ValueError naming the flag when the sizes break a cache limit; CapacityError for a
    hot buffer smaller than the top-k (the cache's own capacity failure, exit 3).

    ``buffer``: --buffer as given (None: 2 x top-k); ``live``: requests at once;
    ``max_len``: the longest sequence; ``replay``: the layers, top-k and requests come
    from a trace file rather than from --layers, --top-k and --requests.
    """
    k_from = "the trace's top-k" if replay else "--top-k"
    if prefetch and layers < 2:
        raise unused(["--prefetch"], f"with one layer ({'the trace has one' if replay else '--layers 1'}): "
                                     "it stages a layer's selection into the next layer",
                     "drop it" + ("" if replay else ", or give --layers 2 or more"))
    S = 2 * top_k if buffer is None else buffer
    if buffer is not None and buffer < top_k:
        raise CapacityError(f"--buffer {buffer} is smaller than {k_from} ({top_k}): one step of one request can "
                         f"select {top_k} distinct rows, which must all be hot at once; give --buffer >= "
                         f"{top_k}, or leave it out (2 x top-k)")
    requests = "the trace's requests" if replay else f"--requests {live}"
    most = (INT32_MAX - 1) // 2  # request ids (up to 2 x live + 1) are int32
    if live > most:
        raise ValueError(f"{requests} is more than one cache holds: it numbers requests with int32, which "
                         f"allows at most {most} at once; lower --requests")
    if live * (S + 1) > INT32_MAX:
        buf = "--buffer" if buffer is not None else f"2 x {k_from}"
        raise ValueError(f"{requests} with {S} hot slots each ({buf}) and one for the newest token take "
                         f"{live * (S + 1)} hot rows per layer, more than one cache indexes with int32 "
                         f"({INT32_MAX}); lower --requests, --buffer or --top-k")
    blocks = -(-max_len // block_size)
    rows = live * blocks * block_size
    if rows > INT32_MAX:
        if block_size > max_len:
            raise ValueError(f"--block-size {block_size}: each request takes whole blocks, so {live} "
                             f"request(s) take {rows} host rows per layer, more than one cache indexes with "
                             f"int32 ({INT32_MAX}); give a block size below the context ({max_len})")
        raise ValueError(f"{requests} x a context of up to {max_len} tokens is {rows} host rows per layer, "
                         f"more than one cache indexes with int32 ({INT32_MAX}); lower "
                         + ("--requests or --context" if not replay else "the trace's sizes"))


__all__ = ["check_stress_sizes"]
