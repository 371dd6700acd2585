"""Ledger 2: the SWA host pool of window snapshots (short-lived, never on disk).

For: keeping one opaque snapshot (every layer's last-window entries at a prefix end, see
§13.1 of the V4.1 reference) per prefix key for a few minutes, behind the small
:class:`SwaPool` contract, in process memory (:class:`MemorySwaPool`) or in Redis, one
server or a cluster (``replaykv.cache.swa_pool_redis.RedisSwaPool``), chosen by name with
:func:`make_swa_pool`. The frame every external value carries is defined here, once.

Not for: the global KV (``cache/store.py``), serialising tensors (the caller hands in
bytes), or deciding when to snapshot (``cache/manager.py``). A miss is always safe: the
engine replays or recomputes.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from replaykv.cache.faultlog import FaultLog
from replaykv.cache.keys import KEY_BYTES
from replaykv.cache.metrics import TierMetrics

log = logging.getLogger(__name__)

__all__ = [
    "SNAPSHOT_FRAME",
    "SNAPSHOT_MAGIC",
    "SWA_POOL_BACKENDS",
    "MemorySwaPool",
    "SwaPool",
    "decode_snapshot_frame",
    "default_pool_capacity",
    "encode_snapshot_frame",
    "make_swa_pool",
]

Payload = bytes | bytearray | memoryview

SNAPSHOT_MAGIC = b"RKVSWA02"
SNAPSHOT_FRAME = struct.Struct("<8sHHIdQ16s16x")
"""Frame of one snapshot value in an external pool (Redis), 64 bytes, little-endian, then the payload.

====== ===== ==============================================================
offset bytes field
====== ===== ==============================================================
0      8     magic ``b"RKVSWA02"`` (the version is part of the magic)
8      2     u16 flags (0; reserved)
10     2     u16 reserved (0)
12     4     u32 ttl in milliseconds the value was written with
16     8     f64 put time, Unix seconds of the writer
24     8     u64 payload length (value length = 64 + this)
32     16    XXH3-128 over (bytes [0, 32) of this header || pool key || payload), canonical form
48     16    reserved (0)
====== ===== ==============================================================

The digest covers the key, so a value copied under another key, a foreign value, or a torn
value fails to decode and is a miss. It is a checksum, not an authenticator: whoever can write
to the pool's Redis can forge any value (a cryptographic hash would not change that, and
SHA-256 over a 2.7 MB snapshot cost more than the Redis round trip itself).
"""
_DIGEST_OFFSET = 32


def encode_snapshot_frame(key: bytes, payload: Payload, put_time: float, ttl_s: float) -> bytes:
    """``SNAPSHOT_FRAME`` header followed by ``payload`` (one contiguous value)."""
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
    ttl_ms = min(0xFFFFFFFF, math.ceil(ttl_s * 1000))
    head = SNAPSHOT_FRAME.pack(SNAPSHOT_MAGIC, 0, 0, ttl_ms, put_time, view.nbytes, bytes(16))[
        :_DIGEST_OFFSET
    ]
    return b"".join((head, _frame_digest(head, key, view), bytes(16), view))


def _frame_digest(head: Payload, key: bytes, payload: Payload) -> bytes:
    h = xxhash.xxh3_128(head)
    h.update(key)
    h.update(payload)
    return h.digest()


@dataclass(frozen=True)
class DecodedSnapshot:
    payload: bytes
    put_time: float
    ttl_s: float


def decode_snapshot_frame(key: bytes, value: bytes) -> DecodedSnapshot | str:
    """The payload and put time, or the reason the value cannot be trusted."""
    if len(value) < SNAPSHOT_FRAME.size:
        return "truncated"
    magic, _flags, _reserved, ttl_ms, put_time, length, digest = SNAPSHOT_FRAME.unpack_from(value)
    if magic != SNAPSHOT_MAGIC:
        return "bad_magic"
    if len(value) != SNAPSHOT_FRAME.size + length:
        return "bad_length"
    view = memoryview(value)
    if _frame_digest(view[:_DIGEST_OFFSET], key, view[SNAPSHOT_FRAME.size :]) != digest:
        return "bad_digest"
    return DecodedSnapshot(bytes(view[SNAPSHOT_FRAME.size :]), put_time, ttl_ms / 1000.0)


def default_pool_capacity() -> int:
    """10% of the host's physical memory (``os.sysconf``), or 1 GiB where that is unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"SWA pool keys are {KEY_BYTES}-byte prefix keys (keys.prefix_key); got {key!r:.80}")


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0 or math.isinf(ttl_s):
        raise ValueError(f"ttl_s must be a finite number of seconds > 0; got {ttl_s}")


class SwaPool(ABC):
    """Contract of a window-snapshot pool. Keys are 32-byte prefix keys, payloads opaque bytes.

    * ``put(key, payload, ttl_s=None) -> bool``: store one complete snapshot that lives
      ``ttl_s`` seconds (default: the pool's ``ttl_s``) unless evicted first; replaces an
      existing one. ``False`` when it was not stored (too large, backend error or timeout);
      never raises for backend trouble. The pool copies what it keeps.
    * ``get(key) -> bytes | None``: exactly the bytes of one earlier complete put, or ``None``
      (never stored, expired, evicted, torn/foreign value, backend down or slow). Never
      raises for backend trouble and never returns an expired snapshot.
    * ``contains(key)`` is a hint only; ``delete(key) -> bool``; ``flush()`` drops every
      snapshot of this pool (and only this pool's).
    * Every method is safe to call concurrently from several threads; each call is atomic
      with respect to the others on the same key.
    * ``stats()`` returns counters with their denominators and the age at hit;
      ``check_integrity()`` raises ``AssertionError`` if an internal invariant is broken.
    """

    ttl_s: float
    metrics: TierMetrics

    @abstractmethod
    def put(self, key: bytes, payload: Payload, ttl_s: float | None = None) -> bool: ...

    @abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> bool: ...

    @abstractmethod
    def flush(self) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, object]: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


@dataclass
class _Snapshot:
    payload: bytes
    put_at: float
    expires_at: float


class MemorySwaPool(SwaPool):
    """In-process pool: LRU within ``capacity_bytes`` (payload bytes), TTL checked on every read.

    An entry is alive while ``clock() < put time + ttl``. Eviction takes the least recently
    used entry first (a get hit or a put makes an entry most recent); a victim that had
    already expired counts as an expiration, otherwise as an eviction. :meth:`sweep_expired`
    frees expired entries eagerly (optional; reads never serve them anyway).
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        capacity = default_pool_capacity() if capacity_bytes is None else capacity_bytes
        if capacity <= 0:
            raise ValueError(f"capacity_bytes must be > 0; got {capacity}")
        _check_ttl(ttl_s)
        self.capacity_bytes = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Snapshot] = OrderedDict()  # least recently used first
        self.metrics = TierMetrics("swa_pool_memory")
        self._faults = FaultLog(log, "memory SWA pool", clock=clock)

    def _drop_locked(self, key: bytes) -> _Snapshot | None:
        snap = self._entries.pop(key, None)
        if snap is not None:
            self.metrics.bytes_resident.dec(len(snap.payload))
            self.metrics.entries.dec()
        return snap

    def put(self, key: bytes, payload: Payload, ttl_s: float | None = None) -> bool:
        _check_key(key)
        ttl = self.ttl_s if ttl_s is None else ttl_s
        _check_ttl(ttl)
        data = payload if isinstance(payload, bytes) else bytes(payload)
        if len(data) > self.capacity_bytes:
            self.metrics.record_put(False, error="too_large")
            self._faults.failed(
                "too_large",
                f"a snapshot of {len(data)} B is over the pool's capacity of {self.capacity_bytes} B: "
                "not kept (give the pool more memory)",
            )
            return False
        now = self._clock()
        with self._lock:
            self._drop_locked(key)
            used = self.metrics.bytes_resident.value
            while used + len(data) > self.capacity_bytes:
                victim = next(iter(self._entries))
                snap = self._drop_locked(victim)
                assert snap is not None
                used -= len(snap.payload)
                if now >= snap.expires_at:
                    self.metrics.expirations.inc()
                else:
                    self.metrics.evictions.inc()
            self._entries[key] = _Snapshot(data, now, now + ttl)
            self.metrics.bytes_resident.inc(len(data))
            self.metrics.entries.inc()
        self.metrics.record_put(True, len(data))
        return True

    def get(self, key: bytes) -> bytes | None:
        _check_key(key)
        now = self._clock()
        with self._lock:
            snap = self._entries.get(key)
            if snap is not None and now >= snap.expires_at:
                self._drop_locked(key)
                self.metrics.expirations.inc()
                snap = None
            if snap is not None:
                self._entries.move_to_end(key)
        if snap is None:
            self.metrics.record_miss()
            return None
        self.metrics.record_hit(len(snap.payload), age_s=now - snap.put_at)
        return snap.payload

    def contains(self, key: bytes) -> bool:
        _check_key(key)
        now = self._clock()
        with self._lock:
            snap = self._entries.get(key)
            return snap is not None and now < snap.expires_at

    def delete(self, key: bytes) -> bool:
        _check_key(key)
        with self._lock:
            gone = self._drop_locked(key) is not None
        if gone:
            self.metrics.deletes.inc()
        return gone

    def flush(self) -> None:
        with self._lock:
            self._entries.clear()
            self.metrics.bytes_resident.set(0)
            self.metrics.entries.set(0)

    def sweep_expired(self) -> int:
        """Drop every expired entry now; returns how many."""
        now = self._clock()
        with self._lock:
            dead = [k for k, s in self._entries.items() if now >= s.expires_at]
            for key in dead:
                self._drop_locked(key)
        self.metrics.expirations.inc(len(dead))
        return len(dead)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict[str, object]:
        out = self.metrics.as_dict()
        out.update(backend="memory", capacity_bytes=self.capacity_bytes, ttl_s=self.ttl_s)
        return out

    def check_integrity(self) -> None:
        self.metrics.check()
        with self._lock:
            total = sum(len(s.payload) for s in self._entries.values())
            count = len(self._entries)
            bad_ttl = [s for s in self._entries.values() if not s.expires_at > s.put_at]
        if total != self.metrics.bytes_resident.value:
            raise AssertionError(
                f"pool holds {total} B but bytes_resident = {self.metrics.bytes_resident.value}"
            )
        if count != self.metrics.entries.value:
            raise AssertionError(f"pool holds {count} entries but gauge = {self.metrics.entries.value}")
        if total > self.capacity_bytes:
            raise AssertionError(f"{total} B resident exceeds capacity {self.capacity_bytes}")
        if bad_ttl:
            raise AssertionError(f"{len(bad_ttl)} entries with expiry not after put time")


def _backends() -> dict[str, type[SwaPool]]:
    from replaykv.cache.swa_pool_redis import RedisSwaPool  # redis is imported only when used

    return {"memory": MemorySwaPool, "redis": RedisSwaPool}


SWA_POOL_BACKENDS: tuple[str, ...] = ("memory", "redis")
"""The pool backends by name (``redis``: one server, or a Redis Cluster with ``cluster=True``)."""


def make_swa_pool(name: str, **kwargs: Any) -> SwaPool:
    """Build the pool registered under ``name`` (``memory`` or ``redis``) with ``kwargs``.

    Raises ``ValueError`` naming the choices for an unknown backend, or the accepted
    arguments for an unknown keyword.
    """
    cls = _backends().get(name) if name in SWA_POOL_BACKENDS else None
    if cls is None:
        choices = ", ".join(sorted(SWA_POOL_BACKENDS))
        raise ValueError(f"unknown SWA pool backend {name!r}; choose one of: {choices}")
    params = inspect.signature(cls).parameters
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        accepted = ", ".join(p for p in params if p != "self")
        raise ValueError(f"SWA pool {name!r} does not take {', '.join(unknown)}; it takes: {accepted}")
    return cls(**kwargs)
