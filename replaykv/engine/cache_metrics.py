"""The ledgers' Prometheus families: every number of ``CacheManager.stats()`` that is exported,
with its name, type and help, in one declarative catalogue (:data:`CACHE_METRICS`).

For: ``cache_families(stats)``, which the engine's collector yields, and the list in
docs/metrics.md. A number of the stats that is not exported is named in
:data:`NOT_EXPORTED` with the reason; a test walks a full engine's stats and fails on any
number that is neither. Naming and the one hit rate per ledger: see ``replaykv.engine.metrics``.

Not for: counting (the tiers and the manager count; ``replaykv.cache.metrics``) or encoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

__all__ = ["CACHE_INFO", "CACHE_METRICS", "NOT_EXPORTED", "MetricDoc", "StatMetric", "cache_families", "family"]

Kind = Literal["counter", "gauge", "histogram", "info"]


@dataclass(frozen=True)
class MetricDoc:
    """A family as documented: its exposed name (counters with ``_total``), type, help, labels."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class StatMetric:
    """One family read from ``CacheManager.stats()`` at ``path``.

    ``label``: the stat is a ``{label value: count}`` dict exported as one labelled family.
    A path that is missing or ``None`` (a tier that is not configured, a Redis-only field) is
    skipped, never exported as zero.
    """

    path: tuple[str, ...]
    name: str
    kind: Kind
    help: str
    label: str = ""

    @property
    def doc(self) -> MetricDoc:
        labels = (self.label,) if self.label else ()
        suffix = "_total" if self.kind == "counter" else "_info" if self.kind == "info" else ""
        return MetricDoc(self.name + suffix, self.kind, self.help, labels)


CACHE_INFO = MetricDoc(
    "replaykv_cache_info", "info", "The cache's settings: write policy, store format and root, SWA pool backend (value 1).",
    ("write_policy", "store_format", "store_root", "swa_pool_backend", "swa_pool_address"),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The ledgers (CacheManager.stats())
# ------------------------------------------------------------------------------------------------

_C = "replaykv_cache_"
_LEDGERS = {
    "requests": (
        "prompt tokens looked up, one lookup per prefill",
        "prompt tokens whose global KV some tier held (H, summed over prefills)",
    ),
    "device": (
        "tokens the device pool was asked for (the prompt less its last token)",
        "tokens served by the device pool: its chunks from token 0 on",
    ),
    "store": (
        "tokens asked of the store: those past the device pool's hit",
        "tokens the store added past the device pool's hit (chunks and a turn-boundary tail)",
    ),
    "swa_pool": (
        "window rows wanted at a global-KV hit H: min(W, H) per lookup, W the sliding window (128 in V4.1)",
        "window rows whose snapshot was in the SWA pool or the store at H",
    ),
}


def _ledger(name: str) -> list[StatMetric]:
    asked, held = _LEDGERS[name]
    p, hit_rate = (name,), f"{_C}{name}_hit_rate"
    return [
        StatMetric((*p, "lookups"), f"{_C}{name}_lookups", "counter", f"Lookups in the {name} ledger."),
        StatMetric((*p, "requested_tokens"), f"{_C}{name}_requested_tokens", "counter",
                   f"Denominator of {hit_rate}: {asked}."),
        StatMetric((*p, "hit_tokens"), f"{_C}{name}_hit_tokens", "counter", f"Numerator of {hit_rate}: {held}."),
        StatMetric((*p, "miss_tokens"), f"{_C}{name}_miss_tokens", "counter",
                   "Requested tokens the ledger did not hold (requested − hit)."),
        StatMetric((*p, "hit_rate"), hit_rate, "gauge",
                   f"The {name} ledger's hit rate since start: hit_tokens_total / requested_tokens_total "
                   "(token-weighted; absent before the first lookup)."),
        StatMetric((*p, "loaded_tokens"), f"{_C}{name}_loaded_tokens", "counter",
                   "Hit tokens actually copied into a request's cache view (a load can come up short)."),
    ]  # fmt: skip


_TIERS = {"device": "device pool", "store": "global-KV store", "swa_pool": "SWA pool"}


def _tier(ledger: str) -> list[StatMetric]:
    noun, p, n = _TIERS[ledger], (ledger, "tier"), f"{_C}{ledger}_tier_"
    return [
        StatMetric((*p, "gets"), n + "gets", "counter",
                   f"Get operations on the {noun}, one per entry asked for (operations, not tokens)."),
        StatMetric((*p, "hits"), n + "hits", "counter", f"Gets the {noun} answered with an entry."),
        StatMetric((*p, "misses"), n + "misses", "counter",
                   f"Gets the {noun} answered without one (absent, expired, quarantined or unreadable)."),
        StatMetric((*p, "puts"), n + "puts", "counter", f"Put operations on the {noun}."),
        StatMetric((*p, "puts_ok"), n + "puts_ok", "counter", f"Puts the {noun} kept."),
        StatMetric((*p, "puts_failed"), n + "puts_failed", "counter", f"Puts the {noun} refused or failed."),
        StatMetric((*p, "deletes"), n + "deletes", "counter", f"Entries deleted from the {noun} by request."),
        StatMetric((*p, "bytes_read"), n + "read_bytes", "counter", f"Payload bytes the {noun}'s hits returned."),
        StatMetric((*p, "bytes_written"), n + "written_bytes", "counter", f"Payload bytes of the {noun}'s kept puts."),
        StatMetric((*p, "bytes_resident"), n + "resident_bytes", "gauge", f"Bytes the {noun} holds now."),
        StatMetric((*p, "entries"), n + "entries", "gauge", f"Entries the {noun} holds now."),
        StatMetric((*p, "evictions"), n + "evictions", "counter", f"Entries the {noun} dropped to make room."),
        StatMetric((*p, "expirations"), n + "expirations", "counter", f"Entries the {noun} dropped at their TTL or retention."),
        StatMetric((*p, "quarantined"), n + "quarantined", "counter",
                   f"Entries of the {noun} that failed verification and were set aside, never served."),
        StatMetric((*p, "errors"), n + "errors", "counter", f"Failed operations on the {noun}, by kind.", label="kind"),
        StatMetric((*p, "hit_age_s"), n + "hit_age_seconds", "histogram", f"Age of an entry of the {noun} when a get hit it."),
    ]  # fmt: skip


_DEV, _STORE, _POOL = ("device", "tier"), ("store", "tier"), ("swa_pool", "tier")
_REQUESTS_EXTRA = [
    StatMetric(("requests", "loads"), _C + "requests_loads", "counter", "Cache plans loaded into a request's view."),
    StatMetric(("requests", "fallbacks"), _C + "requests_fallbacks", "counter",
               "Loads that came up short of their plan (a chunk missing or failing verification); the rest was computed."),
]  # fmt: skip
_DEVICE_EXTRA = [
    StatMetric((*_DEV, "free"), _C + "device_tier_free_pages", "gauge", "Device pages on the free list."),
    StatMetric((*_DEV, "used"), _C + "device_tier_used_pages", "gauge", "Device pages a running request references."),
    StatMetric((*_DEV, "cached"), _C + "device_tier_cached_pages", "gauge", "Device pages holding a cached chunk no request references (evictable)."),
    StatMetric((*_DEV, "window"), _C + "device_tier_window_pages", "gauge", "Device pages holding running requests' sliding windows."),
    StatMetric((*_DEV, "capacity_pages"), _C + "device_tier_capacity_pages", "gauge", "Device pages in all (free + used + cached)."),
    StatMetric((*_DEV, "page_bytes"), _C + "device_tier_page_bytes", "gauge", "Bytes of one device page (one chunk of global KV)."),
    StatMetric((*_DEV, "budget_bytes"), _C + "device_tier_budget_bytes", "gauge", "Device memory the pool may use (--device-pool-bytes)."),
    StatMetric((*_DEV, "window_bytes"), _C + "device_tier_window_bytes", "gauge", "Device bytes held by running requests' sliding windows."),
    StatMetric((*_DEV, "window_owners"), _C + "device_tier_window_owners", "gauge", "Running requests holding window pages."),
]  # fmt: skip
_STORE_EXTRA = [
    StatMetric((*_STORE, "capacity_bytes"), _C + "store_tier_capacity_bytes", "gauge", "Bytes the store may hold (--store-bytes)."),
    StatMetric((*_STORE, "retention_s"), _C + "store_tier_retention_seconds", "gauge", "How long an entry is kept after its last access."),
    StatMetric((*_STORE, "reserved_bytes"), _C + "store_tier_reserved_bytes", "gauge", "Bytes reserved by puts in flight."),
    StatMetric((*_STORE, "fill_ratio"), _C + "store_tier_fill_ratio", "gauge", "Share of the capacity in use: resident_bytes / capacity_bytes."),
    StatMetric((*_STORE, "packs"), _C + "store_tier_packs", "gauge", "Published pack files (pack format)."),
    StatMetric((*_STORE, "open_packs"), _C + "store_tier_open_packs", "gauge", "Packs still taking batches (pack format)."),
    StatMetric((*_STORE, "live_bytes"), _C + "store_tier_live_bytes", "gauge", "Pack bytes of entries still indexed (pack format)."),
    StatMetric((*_STORE, "dead_bytes"), _C + "store_tier_dead_bytes", "gauge", "Pack bytes no entry uses any more, until compaction (pack format)."),
    StatMetric((*_STORE, "cut_batches"), _C + "store_tier_cut_batches", "counter", "Packs the start-up scan found ending in a batch a crash cut short (not damage: nothing acknowledged is lost)."),
    StatMetric((*_STORE, "corrupt_batches"), _C + "store_tier_corrupt_batches", "counter", "Damaged batches found (start-up scan, verify) with intact ones around them."),
    StatMetric((*_STORE, "corrupt_packs"), _C + "store_tier_corrupt_packs", "counter", "Packs the start-up scan found with no batch that checks out."),
    StatMetric((*_STORE, "missing_packs"), _C + "store_tier_missing_packs", "counter", "Packs an index lists that are not on disk."),
    StatMetric((*_STORE, "oldest_access"), _C + "store_tier_oldest_access_timestamp_seconds", "gauge", "Unix time of the least recently used entry's last access."),
    StatMetric((*_STORE, "newest_access"), _C + "store_tier_newest_access_timestamp_seconds", "gauge", "Unix time of the most recent access to any entry."),
    StatMetric((*_STORE, "shared"), _C + "store_tier_shared", "gauge", "Whether other processes write this store too (--store-shared: 1)."),
    StatMetric((*_STORE, "adopted"), _C + "store_tier_adopted", "counter", "Entries another process published, found on disk at a lookup (--store-shared)."),
    StatMetric((*_STORE, "quarantine_files"), _C + "store_tier_quarantine_files", "gauge", "Files in the store's quarantine folder."),
    StatMetric((*_STORE, "orphans_swept"), _C + "store_tier_orphans_swept", "counter", "Temporary files of crashed writers removed."),
    StatMetric((*_STORE, "temp_files_seen"), _C + "store_tier_temp_files_seen", "counter", "Temporary files found by scans (removed once past their grace period)."),
    StatMetric((*_STORE, "unknown_files"), _C + "store_tier_unknown_files", "counter", "Files in the store's folder that are no entry, pack or index (left alone)."),
    StatMetric((*_STORE, "quarantine_reasons"), _C + "store_tier_quarantined_by_reason", "counter", "Entries or packs set aside, by the reason verification gave.", label="reason"),
]  # fmt: skip
_POOL_EXTRA = [
    StatMetric(("swa_pool", "found"), _C + "swa_pool_found", "counter", "Lookups that found a window snapshot at their hit."),
    StatMetric(("swa_pool", "loaded"), _C + "swa_pool_loaded", "counter", "Window snapshots loaded into a request (exact continuation, no replay)."),
    StatMetric(("swa_pool", "age_at_hit_s"), _C + "swa_pool_age_at_hit_seconds", "histogram", "Age of a window snapshot when a request loaded it."),
    StatMetric((*_POOL, "capacity_bytes"), _C + "swa_pool_tier_capacity_bytes", "gauge", "Bytes the SWA pool may hold (--swa-pool-bytes; Redis: its maxmemory)."),
    StatMetric((*_POOL, "ttl_s"), _C + "swa_pool_tier_ttl_seconds", "gauge", "How long a window snapshot lives in the SWA pool."),
    StatMetric((*_POOL, "circuit_open"), _C + "swa_pool_tier_circuit_open", "gauge", "Whether the Redis pool's circuit breaker is open (1: requests fall back to replay)."),
    StatMetric((*_POOL, "used_memory"), _C + "swa_pool_tier_redis_used_memory_bytes", "gauge", "Redis INFO used_memory."),
    StatMetric((*_POOL, "maxmemory"), _C + "swa_pool_tier_redis_maxmemory_bytes", "gauge", "Redis INFO maxmemory (0: no limit)."),
    StatMetric((*_POOL, "keys"), _C + "swa_pool_tier_redis_keys", "gauge", "Keys in the Redis database (DBSIZE)."),
]  # fmt: skip
_W = ("writes",)
_WRITES = [
    StatMetric((*_W, "submitted"), _C + "writes_submitted", "counter", "Write-back jobs submitted after a request."),
    StatMetric((*_W, "enqueued"), _C + "writes_enqueued", "counter", "Write-back jobs queued for the writer thread."),
    StatMetric((*_W, "dropped"), _C + "writes_dropped", "counter", "Write-back jobs dropped because the queue was full (logged)."),
    StatMetric((*_W, "done"), _C + "writes_done", "counter", "Write-back jobs finished."),
    StatMetric((*_W, "failed"), _C + "writes_failed", "counter", "Write-back jobs that failed (logged; the answer was not affected)."),
    StatMetric((*_W, "queued"), _C + "writes_queued", "gauge", "Write-back jobs waiting now."),
    StatMetric((*_W, "chunks"), _C + "writes_chunks", "counter", "Global-KV chunks written to the store."),
    StatMetric((*_W, "chunk_bytes"), _C + "writes_chunk_bytes", "counter", "Bytes of those chunks."),
    StatMetric((*_W, "tails"), _C + "writes_tails", "counter", "Turn-boundary tail entries written to the store."),
    StatMetric((*_W, "tail_bytes"), _C + "writes_tail_bytes", "counter", "Bytes of those tails."),
    StatMetric((*_W, "snapshots_pool"), _C + "writes_snapshots_pool", "counter", "Window snapshots written to the SWA pool."),
    StatMetric((*_W, "snapshot_pool_bytes"), _C + "writes_snapshot_pool_bytes", "counter", "Bytes of those snapshots."),
    StatMetric((*_W, "snapshots_store"), _C + "writes_snapshots_store", "counter", "Window snapshots persisted in the store (write policy v4 only)."),
    StatMetric((*_W, "snapshot_store_bytes"), _C + "writes_snapshot_store_bytes", "counter", "Bytes of those snapshots."),
    StatMetric((*_W, "device_pages"), _C + "writes_device_pages", "counter", "Chunks kept on the device pool after a request."),
    StatMetric(("errors",), _C + "errors", "counter", "Load and write-back failures of the cache manager, by kind (each degraded to a shorter hit or no write).", label="kind"),
    StatMetric(("chunk_size",), _C + "chunk_size_tokens", "gauge", "Tokens per global-KV chunk, the unit of prefix reuse."),
]  # fmt: skip

CACHE_METRICS: tuple[StatMetric, ...] = (
    *(m for ledger in _LEDGERS for m in _ledger(ledger)),
    *_REQUESTS_EXTRA,
    *(m for ledger in _TIERS for m in _tier(ledger)),
    *_DEVICE_EXTRA,
    *_STORE_EXTRA,
    *_POOL_EXTRA,
    *_WRITES,
)

# Stats read by people and tests but deliberately not exported: strings go to replaykv_cache_info.
NOT_EXPORTED: frozenset[tuple[str, ...]] = frozenset(
    {
        ("write_policy",), ("device", "tier", "tier"), ("store", "tier", "tier"),
        ("swa_pool", "tier", "tier"), ("store", "tier", "root"), ("store", "tier", "format"),
        ("swa_pool", "tier", "backend"), ("swa_pool", "tier", "address"),
        # the errors' sum: the labelled family sums in PromQL
        ("device", "tier", "errors_total"), ("store", "tier", "errors_total"), ("swa_pool", "tier", "errors_total"),
    }
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------------


def _histogram(name: str, text: str, data: dict[str, Any]) -> HistogramMetricFamily:
    buckets = [(le, float(n)) for le, n in data["buckets_le"].items()]
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=float(data["sum"]))


def family(kind: Kind, name: str, text: str, value: Any, label: str) -> Metric | None:
    if value is None:
        return None
    if kind == "histogram":
        return _histogram(name, text, value)
    if label:
        fam: Metric = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=[label])
        for key, n in sorted(value.items()):
            fam.add_metric([str(key)], float(n))  # type: ignore[attr-defined]
        return fam
    if kind == "counter":
        return CounterMetricFamily(name, text, value=float(value))
    return GaugeMetricFamily(name, text, value=float(value))


def _at(stats: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = stats
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def cache_info(stats: dict[str, Any]) -> dict[str, str]:
    """The string settings of ``CacheManager.stats()`` as ``replaykv_cache_info`` labels."""
    fields = {
        "write_policy": _at(stats, ("write_policy",)),
        "store_format": _at(stats, ("store", "tier", "format")) or ("directory" if _at(stats, ("store", "tier")) else None),
        "store_root": _at(stats, ("store", "tier", "root")),
        "swa_pool_backend": _at(stats, ("swa_pool", "tier", "backend")),
        "swa_pool_address": _at(stats, ("swa_pool", "tier", "address")),
    }  # fmt: skip
    return {k: str(v) for k, v in fields.items() if v is not None}


def cache_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """Every :data:`CACHE_METRICS` family present in ``stats``, then ``replaykv_cache_info``."""
    for m in CACHE_METRICS:
        fam = family(m.kind, m.name, m.help, _at(stats, m.path), m.label)
        if fam is not None:
            yield fam
    yield InfoMetricFamily(CACHE_INFO.name.removesuffix("_info"), CACHE_INFO.help, value=cache_info(stats))
