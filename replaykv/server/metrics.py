"""The server's Prometheus registry: HTTP metrics, the process collectors and the engine.

For: one ``CollectorRegistry`` per app holding requests by route template, method and status
(the template, not the raw path, so a scanner cannot grow the label set), request durations by
route, requests in flight, streams the client broke off, ``prometheus_client``'s process,
platform and GC collectors, and the engine itself (a custom collector: ``Engine.collect()``).
``/metrics`` encodes it with the format the scraper's ``Accept`` header asks for (Prometheus
text 0.0.4 or OpenMetrics). Not for: what the engine's families mean (``replaykv.engine.metrics``).

One registry per app, never the global one, so several servers (tests, replicas embedded in
one process) never collide. Each ``replaykv serve`` process is one engine and one registry:
replicas are scraped one by one, which is why ``prometheus_client``'s multiprocess mode (many
workers behind one port) is not used.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from replaykv.engine.api import EngineAPI
from replaykv.engine.cache_metrics import MetricDoc

__all__ = ["DURATION_BUCKETS_S", "HTTP_METRICS", "ServerMetrics", "encode"]

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

HTTP_METRICS: list[MetricDoc] = [
    MetricDoc("replaykv_http_requests_total", "counter", "HTTP requests by route template, method and status.",
              ("route", "method", "status")),
    MetricDoc("replaykv_http_request_duration_seconds", "histogram",
              "Time from a request's arrival to the end of its response, by route template.", ("route",)),
    MetricDoc("replaykv_http_requests_in_flight", "gauge", "HTTP requests being served now."),
    MetricDoc("replaykv_http_client_disconnects_total", "counter",
              "Requests cancelled because the client went away (their engine work was aborted)."),
]  # fmt: skip
_DOC = {d.name: d.help for d in HTTP_METRICS}


class ServerMetrics:
    """The app's registry: HTTP metrics (thread-safe; ``observe`` once per finished request),
    the process, platform and GC collectors, and the engine."""

    def __init__(self, engine: EngineAPI | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "replaykv_http_requests", _DOC["replaykv_http_requests_total"], ["route", "method", "status"], registry=r
        )
        self.durations = Histogram(
            "replaykv_http_request_duration_seconds", _DOC["replaykv_http_request_duration_seconds"], ["route"],
            buckets=DURATION_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("replaykv_http_requests_in_flight", _DOC["replaykv_http_requests_in_flight"], registry=r)
        self.disconnects = Counter(
            "replaykv_http_client_disconnects", _DOC["replaykv_http_client_disconnects_total"], registry=r
        )
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        if engine is not None:
            r.register(engine)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.durations.labels(route).observe(seconds)


class _Only:
    """The families of ``registry`` named in ``names`` (a family's name or any of its samples')."""

    def __init__(self, registry: CollectorRegistry, names: list[str]) -> None:
        self.registry, self.names = registry, set(names)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name in self.names or any(s.name in self.names for s in family.samples):
                yield family


def encode(registry: CollectorRegistry, accept: str | None, names: list[str] | None = None) -> tuple[bytes, str]:
    """``registry`` in the format ``accept`` asks for (body, content type); ``names`` keeps only
    those families (the ``name[]`` query parameter of ``prometheus_client``'s own handler)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(_Only(registry, names) if names else registry), content_type
