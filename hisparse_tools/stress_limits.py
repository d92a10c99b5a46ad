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

from hisparse.config import DEVICE_PAGE_ROWS, ceil_div
from hisparse.errors import CapacityError
from .flag_rules import unused
from .sizing import HOT_ALIGN, hot_buffer_rows

INT32_MAX = 2**31 - 1


def pool_rows_minimum(live: int, S: int) -> tuple[int, int]:
    """(the hot buffers' rows per layer: live x (S + 1); the least ``--pool-rows`` that
    gives resident requests a page: those rows rounded up to 64, plus one page)."""
    return live * (S + 1), hot_buffer_rows(live, S + 1) + DEVICE_PAGE_ROWS


def check_stress_sizes(*, layers: int, top_k: int, buffer: int | None, block_size: int, live: int,
                       max_len: int, replay: bool, prefetch: bool, pool_rows: int | None = None) -> None:
    """ValueError naming the flag when the sizes break a cache limit; CapacityError for a
    hot buffer smaller than the top-k (the cache's own capacity failure, exit 3).

    ``buffer``: --buffer as given (None: 2 x top-k); ``live``: requests at once;
    ``max_len``: the longest sequence; ``replay``: the layers, top-k and requests come
    from a trace file rather than from --layers, --top-k and --requests; ``pool_rows``:
    --pool-rows as given (it includes the hot buffers and must leave a page past them).
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
    if pool_rows is not None:
        hot, least = pool_rows_minimum(live, S)
        if pool_rows < least:
            buf = "--buffer" if buffer is not None else f"2 x {k_from}"
            raise ValueError(f"--pool-rows {pool_rows} is below its minimum {least}: the pool includes the hot "
                             f"buffers, {requests} x ({S} hot slots ({buf}) + 1) = {hot} rows per layer "
                             f"({least - DEVICE_PAGE_ROWS} rounded up to {HOT_ALIGN}), and resident requests "
                             "need at least one page "
                             f"of {DEVICE_PAGE_ROWS} rows past them; give --pool-rows >= {least}, or leave it "
                             "out (every request hot)")
        if pool_rows > INT32_MAX:
            raise ValueError(f"--pool-rows {pool_rows} is more device rows per layer than one cache indexes with "
                             f"int32 ({INT32_MAX}); lower it")


def check_ramp_overflows(cfg, o) -> None:
    """``--ramp`` adds requests until the device pool overflows: refuse (ValueError, in
    the flags' words) a pool that ``--requests`` requests of ``--context-min`` tokens can
    not overflow, and one too small to hold even one such request resident (every
    request would go hot as it joins: no spill would seed a hot buffer from its pages).
    ``cfg``: the run's HiSparseConfig; ``o``: its StressOptions."""
    PB = DEVICE_PAGE_ROWS
    cmin = o.context_min if o.context_min is not None else max(1, o.context // 2)
    per = ceil_div(cmin, PB)
    if per > cfg.pool_pages:
        raise ValueError(f"--ramp: --pool-rows {o.pool_rows} leaves {cfg.pool_pages} page{'' if cfg.pool_pages == 1 else 's'} of {PB} rows past the hot "
                         f"buffers ({cfg.hot_rows_per_layer} rows), fewer than one request of {cmin} tokens "
                         f"(--context-min) takes ({per}): every request would go hot as it joins; give --pool-rows "
                         f">= {cfg.hot_rows_per_layer + per * PB}, or a shorter --context-min")
    need = o.num_requests * per
    if need <= cfg.pool_pages:
        below = cfg.hot_rows_per_layer + need * PB
        raise ValueError(f"--ramp: --pool-rows {o.pool_rows} would never overflow: it leaves {cfg.pool_pages} page{'' if cfg.pool_pages == 1 else 's'} of "
                         f"{PB} rows past the hot buffers ({cfg.hot_rows_per_layer} rows), and --requests "
                         f"{o.num_requests} requests of at least {cmin} tokens (--context-min) take {per} pages each, "
                         f"{need} in all; give --pool-rows below {below}, more --requests or a longer --context-min")


__all__ = ["check_stress_sizes", "check_ramp_overflows", "pool_rows_minimum"]
