"""A cache's ``stats()`` in the Prometheus text exposition format.

``HiSparseCache.stats()`` (and ``HiSparseIndexGroup.stats()``) return a dict; this
module turns it into metrics an engine's ``/metrics`` endpoint or a node exporter's
textfile collector can serve. It reads the dict only (extra keys are ignored, missing
ones leave their metric out), never the cache itself.

- :func:`collect(stats)`: the metrics as :class:`Metric` objects (name, type, help,
  samples). The one table of names, types and help texts (``METRICS``) drives both
  output paths below, so they cannot drift apart.
- :func:`format_text(stats)`: the plain formatter (no dependency).
- :class:`StatsCollector`: a custom collector for ``prometheus_client`` (optional;
  imported only when used): ``REGISTRY.register(StatsCollector(cache.stats))``.
- :func:`prometheus_text(stats)`: through ``prometheus_client`` when it is installed,
  the plain formatter otherwise; the same names, types and values either way.
- :func:`write_metrics_file(path, stats)`: atomic write (temporary file + rename), the
  way textfile collectors expect; the file keeps its mode (a new one: the umask's).
- :func:`start_metrics_server(port, source)`: ``prometheus_client``'s HTTP server
  serving a collector of ``source()`` (``ModuleNotFoundError`` without it).

Counters are named without the ``_total`` suffix here and exposed with it
(``hisparse_hits`` -> ``hisparse_hits_total``), as ``prometheus_client`` does. The
values come from the cache's cumulative counters, so ``rate()`` works on them.
Every metric is documented in ``docs/METRICS.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math
import os
import secrets
import stat
from typing import Any, Callable, Iterator, Mapping

from . import __version__

PREFIX = "hisparse"


class MetricType(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    INFO = "info"  # a gauge of value 1 whose labels carry the facts (exposed as NAME_info)


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric family: ``name`` without the ``_total`` / ``_info`` suffix."""

    name: str
    type: MetricType
    help: str
    samples: tuple[tuple[tuple[tuple[str, str], ...], float], ...]  # ((label, value), ...), value

    @property
    def exposed_name(self) -> str:
        """The name in the exposition: counters end in ``_total``, info in ``_info``."""
        if self.type is MetricType.COUNTER:
            return self.name + "_total"
        if self.type is MetricType.INFO:
            return self.name + "_info"
        return self.name


# (stats key, metric name, type, help); per-layer ones carry a "layer" label
LAYER_METRICS = (
    ("hits", "hits", MetricType.COUNTER,
     "Unique (request, position) rows a resolve found in the GPU hot buffer."),
    ("misses", "misses", MetricType.COUNTER,
     "Unique rows a resolve staged from the host pool into the hot buffer."),
    ("resident_rows", "resident_rows", MetricType.COUNTER,
     "Top-k entries a resolve mapped to a resident request's device pages (no LRU, no miss; "
     "entries, not unique rows: a row two query tokens select counts twice)."),
    ("invalid", "invalid", MetricType.COUNTER,
     "Top-k entries a resolve treated as padding because they were out of range."),
    ("resolves", "resolves", MetricType.COUNTER,
     "(layer, request) resolves: one per request per decode step and layer."),
    ("prefetch_rows", "prefetch_rows", MetricType.COUNTER,
     "Rows staged ahead of a resolve by prefetches of predicted selections."),
    ("bytes_h2d", "bytes_h2d", MetricType.COUNTER,
     "Bytes copied host -> device by staging ((misses + prefetched rows) x row bytes)."),
    ("bytes_d2h", "bytes_d2h", MetricType.COUNTER,
     "Bytes written device -> host pool (appended rows x row bytes)."),
    ("hit_rate", "hit_ratio", MetricType.GAUGE,
     "(hits + resident rows) / (hits + resident rows + misses) since the cache was built; "
     "0 before any lookup."),
)
# the elastic device tier, from stats["total"]
TIER_METRICS = (
    ("resident_requests", "resident_requests", MetricType.GAUGE,
     "Live requests whose whole context is in device pool pages (no misses)."),
    ("hot_requests", "hot_requests", MetricType.GAUGE,
     "Live requests served by an LRU hot buffer."),
    ("pool_rows_used", "device_pool_used_rows", MetricType.GAUGE,
     "Device rows per layer in use: a hot buffer per live request plus the taken pages."),
    ("pool_rows_total", "device_pool_capacity_rows", MetricType.GAUGE,
     "Device rows per layer (hot buffers and pool pages)."),
    ("spills", "spills", MetricType.COUNTER,
     "Resident requests demoted to hot buffers: the pool ran out of pages, or a request "
     "outgrew the whole pool."),
    ("promotions", "promotions", MetricType.COUNTER,
     "Hot requests promoted back to resident."),
    ("seeded_rows", "seeded_rows", MetricType.COUNTER,
     "Rows copied device to device into hot buffers by demotions (all layers)."),
    ("pool_pages_shared", "device_pool_shared_pages", MetricType.GAUGE,
     "Device pool pages that more than one resident request references (shared prefixes)."),
    ("prefix_resident_joins", "prefix_resident_joins", MetricType.COUNTER,
     "Requests admitted resident on another resident request's prefix pages."),
    ("prefix_query_tokens", "prefix_query_tokens", MetricType.COUNTER,
     "Prompt tokens add_request looked up in the prefix cache."),
    ("prefix_hit_tokens", "prefix_hit_tokens", MetricType.COUNTER,
     "Prompt tokens found cached (whole host blocks the engine did not prefill)."),
    ("cached_blocks", "prefix_cached_blocks", MetricType.GAUGE,
     "Host blocks in the prefix cache (referenced by a live request or evictable)."),
    ("shared_blocks", "prefix_shared_blocks", MetricType.GAUGE,
     "Cached host blocks that more than one live request references."),
    ("prefix_evictions", "prefix_evictions", MetricType.COUNTER,
     "Cached host blocks evicted (least recently used first) to make room for an allocation."),
)
POOL_METRICS = (
    ("bytes_used", "host_pool_used_bytes", MetricType.GAUGE,
     "Bytes of the host pool held by live requests or the prefix cache (whole blocks, all layers)."),
    ("bytes", "host_pool_capacity_bytes", MetricType.GAUGE,
     "Bytes of the host pool (all layers)."),
    ("blocks_used", "host_pool_used_blocks", MetricType.GAUGE,
     "Host pool blocks held by live requests or the prefix cache."),
    ("blocks_total", "host_pool_capacity_blocks", MetricType.GAUGE,
     "Host pool blocks in all."),
    ("block_size", "host_pool_block_size_tokens", MetricType.GAUGE,
     "Tokens per host pool block."),
    ("pinned", "host_pool_pinned", MetricType.GAUGE,
     "1 when the host pool is page-locked (cudaHostRegister), else 0."),
)
TOP_METRICS = (
    ("live_requests", "live_requests", MetricType.GAUGE, "Requests currently in the cache."),
)
INFO_HELP = "The hisparse version and the cache kernels in use (value 1)."


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
        return v
    return None


def _check_labels(labels: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    out = []
    for k, v in (labels or {}).items():
        if not isinstance(k, str) or not k or not (k[0].isalpha() or k[0] == "_") \
                or not all(c.isalnum() or c == "_" for c in k) or k.startswith("__"):
            raise ValueError(f"metric label name {k!r} is not valid ([a-zA-Z_][a-zA-Z0-9_]*)")
        if k == "layer":
            raise ValueError("the label name 'layer' is reserved for the per-layer metrics")
        out.append((k, str(v)))
    return tuple(out)


def collect(stats: Mapping[str, Any], *, labels: Mapping[str, str] | None = None,
            prefix: str = PREFIX) -> list[Metric]:
    """The metrics of one ``stats()`` dict; ``labels`` are added to every sample
    (e.g. ``{"rank": "0"}``). A metric whose key is absent from ``stats`` is left out."""
    if not isinstance(stats, Mapping):
        raise TypeError(f"stats must be a dict (a cache's stats()), got {type(stats).__name__}")
    base = _check_labels(labels)
    out: list[Metric] = []
    layers = stats.get("layers") or []
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"stats['layers'] must be a list of per-layer dicts, got {type(layers).__name__}")
    for key, name, kind, help_ in LAYER_METRICS:
        samples = []
        for i, d in enumerate(layers):
            v = _number(d.get(key)) if isinstance(d, Mapping) else None
            if v is not None:
                layer = d.get("layer", i)
                samples.append((base + (("layer", str(layer)),), v))
        if samples:
            out.append(Metric(f"{prefix}_{name}", kind, help_, tuple(samples)))
    pool = stats.get("host_pool")
    if isinstance(pool, Mapping):
        for key, name, kind, help_ in POOL_METRICS:
            v = _number(pool.get(key))
            if v is not None:
                out.append(Metric(f"{prefix}_{name}", kind, help_, ((base, v),)))
    total = stats.get("total")
    if isinstance(total, Mapping):
        for key, name, kind, help_ in TIER_METRICS:
            v = _number(total.get(key))
            if v is not None:
                out.append(Metric(f"{prefix}_{name}", kind, help_, ((base, v),)))
    for key, name, kind, help_ in TOP_METRICS:
        v = _number(stats.get(key))
        if v is not None:
            out.append(Metric(f"{prefix}_{name}", kind, help_, ((base, v),)))
    info = base + (("version", __version__),)
    if isinstance(stats.get("kernels"), str):
        info += (("kernels", stats["kernels"]),)
    out.append(Metric(prefix, MetricType.INFO, INFO_HELP, ((info, 1),)))
    return out


# ----------------------------------------------------------------- plain formatter
def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _value(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def format_text(stats: Mapping[str, Any], *, labels: Mapping[str, str] | None = None,
                prefix: str = PREFIX) -> str:
    """The exposition text (version 0.0.4) of ``stats``, without prometheus_client."""
    lines = []
    for m in collect(stats, labels=labels, prefix=prefix):
        name = m.exposed_name
        kind = "gauge" if m.type is MetricType.INFO else m.type.value
        lines.append(f"# HELP {name} {_escape_help(m.help)}")
        lines.append(f"# TYPE {name} {kind}")
        for lbl, v in m.samples:
            ls = ",".join(f'{k}="{_escape_label(val)}"' for k, val in lbl)
            lines.append(f"{name}{{{ls}}} {_value(v)}" if ls else f"{name} {_value(v)}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- prometheus_client
def prometheus_client_available() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


class StatsCollector:
    """A ``prometheus_client`` collector of ``source()`` (a callable returning a stats
    dict, e.g. ``cache.stats``); each scrape calls it once."""

    def __init__(self, source: Callable[[], Mapping[str, Any]], *,
                 labels: Mapping[str, str] | None = None, prefix: str = PREFIX) -> None:
        if not callable(source):
            raise TypeError(f"source must be a callable returning a stats dict, got {type(source).__name__}")
        _check_labels(labels)
        self.source, self.labels, self.prefix = source, dict(labels or {}), prefix

    def collect(self) -> Iterator[Any]:
        # prometheus_client is optional (the [metrics] extra): imported when a scrape runs
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        for m in collect(self.source(), labels=self.labels, prefix=self.prefix):
            names = [k for k, _ in m.samples[0][0]]
            if m.type is MetricType.INFO:
                fam = InfoMetricFamily(m.name, m.help, labels=[])
                fam.add_metric([], dict(m.samples[0][0]))
            else:
                cls = CounterMetricFamily if m.type is MetricType.COUNTER else GaugeMetricFamily
                fam = cls(m.name, m.help, labels=names)
                for lbl, v in m.samples:
                    fam.add_metric([val for _, val in lbl], v)
            yield fam


def _registry(source: Callable[[], Mapping[str, Any]], labels, prefix):
    from prometheus_client import CollectorRegistry  # optional, see StatsCollector.collect

    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(source, labels=labels, prefix=prefix))
    return reg


def prometheus_text(stats: Mapping[str, Any], *, labels: Mapping[str, str] | None = None,
                    prefix: str = PREFIX, use_client: bool | None = None) -> str:
    """The exposition text: through prometheus_client when installed (``use_client``
    None), or forced either way (True needs it installed)."""
    if use_client is None:
        use_client = prometheus_client_available()
    if not use_client:
        return format_text(stats, labels=labels, prefix=prefix)
    from prometheus_client import generate_latest  # optional, see StatsCollector.collect

    return generate_latest(_registry(lambda: stats, labels, prefix)).decode()


def _temp_file_beside(path: str) -> tuple[int, str]:
    """A new file in ``path``'s directory, created with mode 0666 less the umask (the
    mode ``open(path, "w")`` would give a new file; ``mkstemp`` makes 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(os.path.dirname(path), f".hisparse-metrics-{secrets.token_hex(6)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path!r} after 100 tries")


def write_metrics_file(path: str | os.PathLike, stats: Mapping[str, Any], *,
                       labels: Mapping[str, str] | None = None) -> None:
    """Write :func:`prometheus_text` to ``path`` atomically (a reader never sees half).

    A symlink at ``path`` is followed: its target is replaced and the link kept. A
    path that exists and is not a regular file (a device, a FIFO) is a ValueError.
    The file keeps its mode and, where this user may set it, its group; a new one
    gets the umask's mode, as any file the process creates (a textfile collector
    running as another user must be able to read it)."""
    text = prometheus_text(stats, labels=labels)
    p = os.path.realpath(os.fspath(path))
    if os.path.exists(p) and not os.path.isfile(p):
        raise ValueError(f"metrics file {os.fspath(path)!r} exists and is not a regular file; the "
                         "atomic write would replace it")
    try:
        old = os.stat(p)
    except FileNotFoundError:
        old = None
    fd, tmp = _temp_file_beside(p)
    try:
        with os.fdopen(fd, "w") as f:
            if old is not None:
                if old.st_gid != os.fstat(fd).st_gid:
                    try:
                        os.fchown(fd, -1, old.st_gid)
                    except PermissionError:  # not a member of that group: the mode still applies
                        pass
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        os.unlink(tmp)
        raise


def start_metrics_server(port: int, source: Callable[[], Mapping[str, Any]], *,
                         addr: str = "127.0.0.1", labels: Mapping[str, str] | None = None):
    """Serve ``source()`` on ``http://addr:port/metrics`` from a daemon thread.

    Returns the server (``shutdown()`` + ``server_close()`` stop it). Needs
    prometheus_client (``ModuleNotFoundError`` otherwise); ``OSError`` when the port
    can't be bound.
    """
    if not prometheus_client_available():
        raise ModuleNotFoundError("the metrics server needs prometheus_client "
                                  "(`pip install prometheus_client`)", name="prometheus_client")
    from prometheus_client import start_http_server  # optional, see StatsCollector.collect

    got = start_http_server(port, addr=addr, registry=_registry(source, labels, PREFIX))
    return got[0] if isinstance(got, tuple) else got  # recent versions return (server, thread); old ones None


__all__ = ["PREFIX", "MetricType", "Metric", "LAYER_METRICS", "POOL_METRICS", "TOP_METRICS",
           "collect", "format_text", "prometheus_client_available", "StatsCollector",
           "prometheus_text", "write_metrics_file", "start_metrics_server"]
