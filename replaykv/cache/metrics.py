"""Thread-safe counters, gauges and histograms shared by the cache tiers.

For: the numbers each tier keeps about itself (operations, bytes, hits with their real
denominators, failures by kind) and a plain ``as_dict()`` view of them that tests, the CLI
(``replaykv store stats``) and the admin endpoint read. Counters that must agree (``gets ==
hits + misses``) share one lock, so a reader never sees them torn.

Not for: exporting. ``replaykv.engine.metrics`` maps these dicts to Prometheus families with
``prometheus_client``; nothing here knows a wire format. Not for per-request accounting (the
engine owns that) or timing assertions.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable

__all__ = ["AGE_BUCKETS_S", "Counter", "Gauge", "Histogram", "LabeledCounter", "TierMetrics"]


class Counter:
    """A monotonically increasing integer. ``inc`` is safe from any thread. Counters that are
    always updated together may share one ``lock`` (the owner then updates them in one step)."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self._lock = lock if lock is not None else threading.Lock()
        self._value = 0

    def inc(self, n: int = 1) -> None:
        if n < 0:
            raise ValueError(f"a counter only goes up; got inc({n}) (use a Gauge for values that go down)")
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        return self._value


class Gauge:
    """An integer that goes up and down (bytes resident, entries). Safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def set(self, value: int) -> None:
        with self._lock:
            self._value = value

    def inc(self, n: int = 1) -> None:
        with self._lock:
            self._value += n

    def dec(self, n: int = 1) -> None:
        with self._lock:
            self._value -= n

    @property
    def value(self) -> int:
        return self._value


class LabeledCounter:
    """Counters keyed by a short label, e.g. errors by kind (``"ENOSPC"``, ``"timeout"``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def inc(self, label: str, n: int = 1) -> None:
        if n < 0:
            raise ValueError(f"a counter only goes up; got inc({label!r}, {n})")
        with self._lock:
            self._values[label] = self._values.get(label, 0) + n

    def get(self, label: str) -> int:
        with self._lock:
            return self._values.get(label, 0)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._values.values())

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._values.items()))


# Upper bounds (seconds) for the age of an entry at a hit: SWA snapshots live minutes, store
# chunks up to the 72 h retention.
AGE_BUCKETS_S: tuple[float, ...] = (
    1,
    5,
    15,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
    6 * 3600,
    24 * 3600,
    72 * 3600,
)


class Histogram:
    """Cumulative-bucket histogram (Prometheus-style ``le`` buckets) with count, sum, min, max."""

    def __init__(self, buckets: Iterable[float] = AGE_BUCKETS_S, lock: threading.Lock | None = None) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(math.isnan(b) for b in bounds):
            raise ValueError("a histogram needs at least one finite bucket bound")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = tuple(bounds)
        self._lock = lock if lock is not None else threading.Lock()
        self._counts = [0] * len(self._bounds)
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf

    def observe(self, value: float) -> None:
        with self._lock:
            self._observe_locked(value)

    def _observe_locked(self, value: float) -> None:
        """``observe`` for an owner that holds the (shared) lock already."""
        self._count += 1
        self._sum += value
        if value == value:  # NaN falls in no bucket and moves neither extreme
            self._counts[bisect.bisect_left(self._bounds, value)] += 1  # < len: the last bound is +inf
            if value < self._min:
                self._min = value
            if value > self._max:
                self._max = value

    @property
    def count(self) -> int:
        return self._count

    def as_dict(self) -> dict[str, object]:
        with self._lock:
            cumulative: dict[str, int] = {}
            running = 0
            for bound, n in zip(self._bounds, self._counts, strict=True):
                running += n
                cumulative["+Inf" if bound == math.inf else f"{bound:g}"] = running
            return {
                "count": self._count,
                "sum": self._sum,
                "min": self._min if self._count else None,
                "max": self._max if self._count else None,
                "mean": self._sum / self._count if self._count else None,
                "buckets_le": cumulative,
            }


class TierMetrics:
    """What every storage tier counts, with the denominators needed to read the ratios.

    Conservation (checked by :meth:`check`): ``gets == hits + misses`` and
    ``puts == puts_ok + puts_failed``. A miss caused by an expired, quarantined or unreadable
    entry is also counted under ``expirations``/``quarantined``/``errors``; those are causes,
    not extra outcomes. ``bytes_read`` counts payload bytes returned by hits, ``bytes_written``
    payload bytes of successful puts; ``bytes_resident`` and ``entries`` are gauges of what the
    tier holds now (for Redis, what this client believes it wrote: Redis may evict silently).

    ``gets``/``hits`` count operations, one per entry asked for; they carry no ratio here on
    purpose. A ledger's hit rate is token-weighted and kept by the cache manager
    (``CacheManager.stats()[ledger]["hit_rate"]``: hit tokens over requested tokens).
    """

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._outcome_lock = threading.Lock()
        self.gets = Counter(self._outcome_lock)
        self.hits = Counter(self._outcome_lock)
        self.misses = Counter(self._outcome_lock)
        self.puts = Counter()
        self.puts_ok = Counter()
        self.puts_failed = Counter()
        self.deletes = Counter()
        self.bytes_read = Counter(self._outcome_lock)
        self.bytes_written = Counter()
        self.evictions = Counter()
        self.expirations = Counter()
        self.quarantined = Counter()
        self.errors = LabeledCounter()
        self.bytes_resident = Gauge()
        self.entries = Gauge()
        self.hit_age_s = Histogram(lock=self._outcome_lock)

    # Recording helpers keep the pairs together so the conservation laws hold.
    def record_hit(self, payload_bytes: int, age_s: float | None = None) -> None:
        with self._outcome_lock:  # the lock of gets, hits, misses, bytes_read and hit_age_s
            self.gets._value += 1
            self.hits._value += 1
            self.bytes_read._value += payload_bytes
            if age_s is not None:
                self.hit_age_s._observe_locked(age_s if age_s > 0.0 else 0.0)

    def record_miss(self) -> None:
        with self._outcome_lock:
            self.gets._value += 1
            self.misses._value += 1

    def record_put(self, ok: bool, payload_bytes: int = 0, error: str | None = None) -> None:
        with self._outcome_lock:
            self.puts.inc()
            if ok:
                self.puts_ok.inc()
            else:
                self.puts_failed.inc()
        if ok:
            self.bytes_written.inc(payload_bytes)
        if error is not None:
            self.errors.inc(error)

    def check(self) -> None:
        """Raise ``AssertionError`` if a conservation law is broken."""
        with self._outcome_lock:
            gets, hits, misses = self.gets.value, self.hits.value, self.misses.value
            puts, ok, failed = self.puts.value, self.puts_ok.value, self.puts_failed.value
        if gets != hits + misses:
            raise AssertionError(f"{self.tier}: gets {gets} != hits {hits} + misses {misses}")
        if puts != ok + failed:
            raise AssertionError(f"{self.tier}: puts {puts} != ok {ok} + failed {failed}")
        if self.bytes_resident.value < 0 or self.entries.value < 0:
            raise AssertionError(
                f"{self.tier}: negative gauge (bytes_resident={self.bytes_resident.value}, "
                f"entries={self.entries.value})"
            )

    def as_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "gets": self.gets.value,
            "hits": self.hits.value,
            "misses": self.misses.value,
            "puts": self.puts.value,
            "puts_ok": self.puts_ok.value,
            "puts_failed": self.puts_failed.value,
            "deletes": self.deletes.value,
            "bytes_read": self.bytes_read.value,
            "bytes_written": self.bytes_written.value,
            "bytes_resident": self.bytes_resident.value,
            "entries": self.entries.value,
            "evictions": self.evictions.value,
            "expirations": self.expirations.value,
            "quarantined": self.quarantined.value,
            "errors": self.errors.as_dict(),
            "errors_total": self.errors.total,
            "hit_age_s": self.hit_age_s.as_dict(),
        }
