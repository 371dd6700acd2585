"""Counters, gauges, histograms and the per-tier conservation check."""

from __future__ import annotations

import threading

import pytest

from replaykv.cache.metrics import Counter, Gauge, Histogram, LabeledCounter, TierMetrics


def test_counter_is_thread_safe() -> None:
    counter, labeled = Counter(), LabeledCounter()

    def bump() -> None:
        for _ in range(10_000):
            counter.inc()
            labeled.inc("x")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.value == 40_000 and labeled.as_dict() == {"x": 40_000} and labeled.total == 40_000
    with pytest.raises(ValueError):
        counter.inc(-1)


def test_gauge_and_histogram() -> None:
    gauge = Gauge()
    gauge.inc(5)
    gauge.dec(2)
    assert gauge.value == 3
    hist = Histogram([1, 10])
    for v in (0.5, 3, 30):
        hist.observe(v)
    d = hist.as_dict()
    assert d["count"] == 3 and d["min"] == 0.5 and d["max"] == 30
    assert d["buckets_le"] == {"1": 1, "10": 2, "+Inf": 3}
    assert Histogram().as_dict()["mean"] is None


def test_tier_metrics_counts_and_check() -> None:
    m = TierMetrics("t")
    m.record_hit(100, age_s=2.0)
    m.record_miss()
    m.record_put(True, 50)
    m.record_put(False, error="write:ENOSPC")
    d = m.as_dict()
    assert (d["gets"], d["hits"], d["misses"]) == (2, 1, 1)
    assert (d["puts"], d["puts_ok"], d["puts_failed"]) == (2, 1, 1)
    assert "hit_rate" not in d  # operations carry no ratio: the ledger's hit rate is token-weighted
    assert d["errors"] == {"write:ENOSPC": 1} and d["bytes_written"] == 50 and d["bytes_read"] == 100
    m.check()
    m.hits.inc()  # break conservation on purpose
    with pytest.raises(AssertionError, match="gets"):
        m.check()
    assert TierMetrics("empty").hit_age_s.as_dict()["mean"] is None
