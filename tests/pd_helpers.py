"""What the P/D tests share: a small cache config, rows, a skip when NIXL can't run (a
failure under HISPARSE_REQUIRE_NIXL=1), and the prefill process the two-process tests
start (``prefill_main``)."""

from __future__ import annotations

import os

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig
from invariants import assert_same


_PROBE: list[str | None] = []  # the probe's answer, once per process


def nixl_problem() -> str | None:
    """None when NIXL imports and a UCX agent starts here (one is made and dropped),
    else why not."""
    if not _PROBE:
        from hisparse.pd import NixlUnavailable, nixl_available
        why = nixl_available()
        if why is None:
            from hisparse.pd.nixl_api import default_agent_name, make_agent
            try:
                make_agent(default_agent_name("probe"), ("UCX",), progress_thread=False)
            except NixlUnavailable as e:
                why = str(e)
        _PROBE.append(why)
    return _PROBE[0]


def nixl_or_skip() -> None:
    """Skip with NIXL's own error when it can't load or start a UCX agent here; with
    HISPARSE_REQUIRE_NIXL=1 (the CI sets it) fail instead."""
    why = nixl_problem()
    if why is not None:
        if os.environ.get("HISPARSE_REQUIRE_NIXL") == "1":
            pytest.fail(f"HISPARSE_REQUIRE_NIXL=1 but NIXL can't run here: {why}")
        pytest.skip(why)


def small_cfg(**kw) -> HiSparseConfig:
    base = dict(num_layers=3, host_pool_tokens=512, row_bytes=656, top_k=8, device_buffer_size=16,
                max_num_reqs=4, max_query_len=1, host_block_size=16, device="cpu")
    base.update(kw)
    return HiSparseConfig(**base)


def make_rows(seed: int, n: int, row_bytes: int = 656, layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=g) for _ in range(layers)]


def filled_cache(cfg: HiSparseConfig, req_ids=(1, 2), n: int = 37) -> tuple[HiSparseCache, dict]:
    """A cache whose requests ``req_ids`` hold ``n`` appended rows each; returns their rows."""
    cache = HiSparseCache(cfg)
    truth = {}
    for rid in req_ids:
        cache.add_request(rid)
        rows = make_rows(100 + rid, n, cfg.row_bytes, cfg.num_layers)
        for layer in range(cfg.num_layers):
            cache.write(layer, rid, rows[layer])
        truth[rid] = rows
    return cache, truth


def assert_rows(cache: HiSparseCache, truth: dict) -> None:
    """Every request of ``truth`` holds exactly those host rows in every layer."""
    for rid, rows in truth.items():
        for layer, want in enumerate(rows):
            got = cache.read_host_rows(layer, rid, list(range(want.shape[0])))
            assert torch.equal(got, want), (rid, layer)


def quarantined(snap: dict) -> dict:
    """The quarantine owners of a snapshot's allocator and their blocks."""
    return {o: b for o, b in snap["alloc"][1].items() if isinstance(o, tuple) and o[0] == "pd-quarantine"}


def same_but_quarantined(before: dict, after: dict, rx) -> None:
    """As before the reservation for every other request: ``same_but_freed_bytes`` except
    the blocks ``rx`` holds in quarantine (allocated to a quarantine owner, not free)."""
    q = quarantined(after)
    assert q and {o[2] for o in q} == set(rx.quarantined())
    held = sorted(b for blocks in q.values() for b in blocks)
    assert held == sorted(b for x in rx.quarantined().values() for b in x.blocks)
    assert after["alloc"][0] + len(held) == before["alloc"][0]
    assert {o: b for o, b in after["alloc"][1].items() if o not in q} == before["alloc"][1]
    strip = lambda d: {k: v for k, v in d.items() if k not in ("pool", "alloc")}  # noqa: E731
    assert_same(strip(before), strip(after))


def release_all(rx) -> None:
    """Free every quarantine now (as if its time were up)."""
    rx.release_quarantine(float("inf"))
    assert rx.quarantined() == {}


def prefill_main(conn, mode: str) -> None:
    """The prefill process: receives (descriptor bytes, seed, per_layer) jobs on ``conn``,
    sends, answers the report. ``mode`` "die": write layer 0 of the request (a
    completed transfer, no notice), then exit without a word: a prefill process killed
    between two layers' transfers."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from hisparse.pd import PDDescriptor, PDSender
    from hisparse.pd import sender as sender_mod
    tx = PDSender(row_format="fp8_ds_mla", block_size=16, name=f"prefill-{os.getpid()}")
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        data, seed, per_layer = job
        desc = PDDescriptor.from_bytes(data)
        rows = make_rows(seed, desc.num_tokens, desc.row_bytes, desc.num_layers)
        if mode == "die":
            sender_mod.notice = lambda *a, **k: b""  # no notice reaches the decode side
            half = type(desc)(**{**desc.__dict__, "num_layers": 1, "layer_addrs": desc.layer_addrs[:1]})
            tx.send(half, rows[:1], per_layer=True)
            os._exit(17)
        rep = tx.send(desc, rows, per_layer=per_layer)
        conn.send((rep.bytes, rep.seconds, rep.transfers))
