"""hisparse.metrics: a cache's stats() in the Prometheus text format.

The plain formatter is checked always (hand-written expected text, a real cache's
stats, escaping, extra/missing keys); the prometheus_client path when it is importable
(same samples, names, types and help as the plain one; its own parser reads the plain
text; the HTTP server serves it).
"""

from __future__ import annotations

import os
import re
import socket
import urllib.request

import pytest
import torch

from hisparse import HiSparseCache, HiSparseConfig, __version__
from hisparse import metrics as M

STATS = {
    "layers": [
        {"hits": 7, "misses": 3, "invalid": 0, "resolves": 4, "bytes_h2d": 1968, "bytes_d2h": 6560,
         "hit_rate": 0.7},
        {"hits": 0, "misses": 0, "invalid": 1, "resolves": 0, "bytes_h2d": 0, "bytes_d2h": 0,
         "hit_rate": 0.0},
    ],
    "total": {"hits": 7, "misses": 3},
    "host_pool": {"blocks_used": 2, "blocks_total": 8, "block_size": 16, "bytes": 167936,
                  "bytes_used": 41984, "pinned": False},
    "live_requests": 1,
    "kernels": "torch",
}

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str):
    """{(name, labels): value}, {name: type}, {name: help} of exposition text."""
    samples, types, helps = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, h = line[7:].split(" ", 1)
            helps[name] = h
        elif line.startswith("# TYPE "):
            name, t = line[7:].split(" ", 1)
            types[name] = t
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
            samples[(m.group(1), labels)] = float(m.group(3))
            assert m.group(1) in types, f"sample before its TYPE line: {line}"
    return samples, types, helps


def test_plain_text_exact():
    text = M.format_text(STATS)
    lines = text.splitlines()
    assert lines[:5] == [
        "# HELP hisparse_hits_total Unique (request, position) rows a resolve found in the GPU hot buffer.",
        "# TYPE hisparse_hits_total counter",
        'hisparse_hits_total{layer="0"} 7',
        'hisparse_hits_total{layer="1"} 0',
        "# HELP hisparse_misses_total Unique rows a resolve staged from the host pool into the hot buffer.",
    ]
    for want in ('hisparse_bytes_h2d_total{layer="0"} 1968', 'hisparse_bytes_d2h_total{layer="0"} 6560',
                 'hisparse_invalid_total{layer="1"} 1', 'hisparse_resolves_total{layer="0"} 4',
                 'hisparse_hit_ratio{layer="0"} 0.7', "# TYPE hisparse_hit_ratio gauge",
                 "hisparse_host_pool_used_bytes 41984", "hisparse_host_pool_capacity_bytes 167936",
                 "hisparse_host_pool_used_blocks 2", "hisparse_host_pool_capacity_blocks 8",
                 "hisparse_host_pool_block_size_tokens 16", "hisparse_host_pool_pinned 0.0",
                 "hisparse_live_requests 1", "# TYPE hisparse_live_requests gauge",
                 "# TYPE hisparse_info gauge",
                 f'hisparse_info{{version="{__version__}",kernels="torch"}} 1'):
        assert want in lines, want
    assert text.endswith("\n")
    samples, types, helps = parse(text)
    assert set(types) == set(helps)  # every metric has HELP and TYPE
    assert len(types) == 7 + 6 + 1 + 1


def test_every_metric_is_documented():
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "METRICS.md")).read()
    names = {m.exposed_name for m in M.collect(STATS)}
    for n in names:
        assert f"`{n}`" in doc, n


def test_extra_keys_ignored_missing_keys_left_out():
    st = {"layers": [{"hits": 1, "misses": 2, "new_counter": 5}], "host_pool": {"bytes": 10},
          "something_new": {"a": 1}, "live_requests": 0}
    samples, types, _ = parse(M.format_text(st))
    assert set(types) == {"hisparse_hits_total", "hisparse_misses_total", "hisparse_host_pool_capacity_bytes",
                          "hisparse_live_requests", "hisparse_info"}
    assert samples[("hisparse_misses_total", (("layer", "0"),))] == 2
    assert parse(M.format_text({}))[1] == {"hisparse_info": "gauge"}


def test_labels_and_escaping():
    text = M.format_text(STATS, labels={"rank": 'a"b\\c\nd'})
    assert 'hisparse_live_requests{rank="a\\"b\\\\c\\nd"} 1' in text
    assert 'hisparse_hits_total{rank="a\\"b\\\\c\\nd",layer="0"} 7' in text
    for bad in ({"1x": "v"}, {"a-b": "v"}, {"layer": "0"}, {"__x": "v"}):
        with pytest.raises(ValueError, match="label"):
            M.format_text(STATS, labels=bad)
    with pytest.raises(TypeError, match="stats must be a dict"):
        M.format_text([1, 2])
    with pytest.raises(TypeError, match="layers"):
        M.format_text({"layers": 3})


def _real_stats():
    cfg = HiSparseConfig(num_layers=2, host_pool_tokens=64, row_bytes=32, top_k=4, device_buffer_size=8,
                         max_num_reqs=2, host_block_size=16, max_request_id=8, device="cpu")
    c = HiSparseCache(cfg, kernels="torch")
    c.add_request(3)
    for layer in range(2):
        c.write(layer, 3, torch.randint(0, 256, (20, 32), dtype=torch.uint8))
    for _ in range(2):
        c.resolve(0, torch.tensor([3], dtype=torch.int32), torch.tensor([[0, 9, 15, 19]], dtype=torch.int32))
    return c.stats()


def test_real_cache_stats():
    st = _real_stats()
    samples, types, _ = parse(M.format_text(st))
    for i, d in enumerate(st["layers"]):
        lbl = (("layer", str(i)),)
        for key, name in (("hits", "hits_total"), ("misses", "misses_total"), ("bytes_h2d", "bytes_h2d_total"),
                          ("bytes_d2h", "bytes_d2h_total"), ("resolves", "resolves_total")):
            assert samples[(f"hisparse_{name}", lbl)] == d[key]
    assert samples[("hisparse_host_pool_used_bytes", ())] == st["host_pool"]["bytes_used"] > 0
    assert samples[("hisparse_live_requests", ())] == 1
    assert samples[("hisparse_misses_total", (("layer", "0"),))] > 0


def test_write_metrics_file_atomic(tmp_path):
    path = tmp_path / "hisparse.prom"
    M.write_metrics_file(path, STATS)
    assert path.read_text() == M.prometheus_text(STATS)
    M.write_metrics_file(path, {**STATS, "live_requests": 5})
    assert "hisparse_live_requests 5" in path.read_text()
    assert sorted(os.listdir(tmp_path)) == ["hisparse.prom"]  # no temporary file left


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_write_metrics_file_keeps_the_umask_and_an_existing_mode(tmp_path, umask_022):
    """A textfile collector runs as another user: the rewrite must stay readable to it.
    The temporary file was created 0600 and renamed over, whatever the umask or the
    file's own mode."""
    new = tmp_path / "new.prom"
    M.write_metrics_file(new, STATS)
    assert new.stat().st_mode & 0o777 == 0o644  # 0666 less the umask, as open() creates files
    shared = tmp_path / "shared.prom"
    shared.write_text("")
    shared.chmod(0o640)
    M.write_metrics_file(shared, STATS)
    M.write_metrics_file(shared, STATS)
    assert shared.stat().st_mode & 0o777 == 0o640 and shared.read_text() == M.prometheus_text(STATS)
    target = tmp_path / "target.prom"  # through a symlink: the target's mode
    target.write_text("")
    target.chmod(0o604)
    (tmp_path / "link.prom").symlink_to(target)
    M.write_metrics_file(tmp_path / "link.prom", STATS)
    assert target.stat().st_mode & 0o777 == 0o604
    assert sorted(os.listdir(tmp_path)) == ["link.prom", "new.prom", "shared.prom", "target.prom"]


def test_write_metrics_file_keeps_a_symlink_and_refuses_a_fifo(tmp_path):
    target = tmp_path / "real.prom"
    target.write_text("old")
    link = tmp_path / "link.prom"
    link.symlink_to(target)
    M.write_metrics_file(link, STATS)
    assert link.is_symlink() and target.read_text() == M.prometheus_text(STATS)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        M.write_metrics_file(fifo, STATS)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link.prom", "real.prom"]


def test_server_needs_prometheus_client(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    assert not M.prometheus_client_available()
    assert M.prometheus_text(STATS) == M.format_text(STATS)  # the plain path
    with pytest.raises(ModuleNotFoundError, match="prometheus_client"):
        M.start_metrics_server(9100, lambda: STATS)


# ----------------------------------------------------------------- prometheus_client
def test_client_path_matches_plain():
    pytest.importorskip("prometheus_client")
    for st in (STATS, _real_stats(), {"layers": [{"hits": 1}]}):
        for labels in (None, {"rank": "0"}):
            plain = parse(M.format_text(st, labels=labels))
            client = parse(M.prometheus_text(st, labels=labels, use_client=True))
            assert client == plain


def test_client_parser_reads_the_plain_text():
    parser = pytest.importorskip("prometheus_client.parser")
    fams = {f.name: f for f in parser.text_string_to_metric_families(M.format_text(STATS, labels={"rank": "1"}))}
    assert fams["hisparse_hits"].type == "counter"
    assert {s.labels["layer"]: s.value for s in fams["hisparse_hits"].samples} == {"0": 7.0, "1": 0.0}
    assert fams["hisparse_host_pool_used_bytes"].samples[0].value == 41984


def test_http_server_serves_the_stats():
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls = []
    server = M.start_metrics_server(port, lambda: calls.append(1) or STATS)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'hisparse_hits_total{layer="0"} 7.0' in body
    assert len(calls) == 1  # one stats() call per scrape


def test_a_pooled_cache_exports_the_elastic_tier():
    """A real cache with an elastic pool: every metric it exports is documented, and the
    tier's figures are the stats dict's."""
    cfg = HiSparseConfig(num_layers=1, host_pool_tokens=256, row_bytes=32, top_k=4, device_buffer_size=8,
                         max_num_reqs=2, host_block_size=16, device="cpu", device_pool_rows=64 + 64)
    c = HiSparseCache(cfg, kernels="torch")
    for rid, n in ((1, 40), (2, 40)):
        c.add_request(rid)
        c.write(0, rid, torch.zeros((n, 32), dtype=torch.uint8))
    c.resolve(0, torch.tensor([2], dtype=torch.int32), torch.tensor([[0, 1, 2, 3]], dtype=torch.int32))
    st = c.stats()
    samples, types, _ = parse(M.format_text(st))
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "METRICS.md")).read()
    for n in types:
        assert f"`{n}`" in doc, n
    tot = st["total"]
    assert (tot["resident_requests"], tot["hot_requests"], tot["spills"]) == (1, 1, 1)
    for key, name in (("resident_requests", "hisparse_resident_requests"), ("spills", "hisparse_spills_total"),
                      ("pool_rows_used", "hisparse_device_pool_used_rows"),
                      ("pool_rows_total", "hisparse_device_pool_capacity_rows")):
        assert samples[(name, ())] == tot[key], name
    assert samples[("hisparse_resident_rows_total", (("layer", "0"),))] == 4
