"""HTTP-level metrics of the server, rendered as Prometheus text next to the engine's.

For: requests by route template, method and status (the route template, not the raw path, so
a scanner cannot grow the label set), request durations by route, requests in flight, and
streams the client broke off. Not for: engine or cache metrics (``engine.metrics_text()``).
"""

from __future__ import annotations

import threading

from replaykv.cache.metrics import Counter, Gauge, Histogram, LabeledCounter

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class HttpMetrics:
    """Thread-safe; `observe` is called once per finished HTTP request."""

    def __init__(self) -> None:
        self.requests = LabeledCounter()  # label: "route\tmethod\tstatus"
        self.in_flight = Gauge()
        self.disconnects = Counter()
        self._lock = threading.Lock()
        self._durations: dict[str, Histogram] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.inc(f"{route}\t{method}\t{status}")
        with self._lock:
            hist = self._durations.get(route)
            if hist is None:
                hist = self._durations[route] = Histogram(DURATION_BUCKETS_S)
        hist.observe(seconds)

    def render(self) -> str:
        lines = [
            "# HELP replaykv_http_requests_total HTTP requests by route template, method and status.",
            "# TYPE replaykv_http_requests_total counter",
        ]
        for key, n in self.requests.as_dict().items():
            route, method, status = key.split("\t")
            lines.append(
                f'replaykv_http_requests_total{{route="{_label(route)}",method="{method}",status="{status}"}} {n}'
            )
        lines += [
            "# HELP replaykv_http_request_duration_seconds Time to the end of the response, by route.",
            "# TYPE replaykv_http_request_duration_seconds histogram",
        ]
        with self._lock:
            durations = sorted(self._durations.items())
        for route, hist in durations:
            d = hist.as_dict()
            r = _label(route)
            for le, n in d["buckets_le"].items():  # type: ignore[attr-defined]
                lines.append(f'replaykv_http_request_duration_seconds_bucket{{route="{r}",le="{le}"}} {n}')
            lines.append(f'replaykv_http_request_duration_seconds_sum{{route="{r}"}} {d["sum"]}')
            lines.append(f'replaykv_http_request_duration_seconds_count{{route="{r}"}} {d["count"]}')
        lines += [
            "# HELP replaykv_http_requests_in_flight HTTP requests being served.",
            "# TYPE replaykv_http_requests_in_flight gauge",
            f"replaykv_http_requests_in_flight {self.in_flight.value}",
            "# HELP replaykv_http_client_disconnects_total Requests cancelled because the client went away.",
            "# TYPE replaykv_http_client_disconnects_total counter",
            f"replaykv_http_client_disconnects_total {self.disconnects.value}",
        ]
        return "\n".join(lines) + "\n"
