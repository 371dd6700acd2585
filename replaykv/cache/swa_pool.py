"""Ledger 2: the SWA host pool of window snapshots (short-lived, never on disk).

For: keeping one opaque snapshot (every layer's last-window entries at a prefix end, see
§13.1 of the V4.1 reference) per prefix key for a few minutes, behind the small
:class:`SwaPool` contract, in process memory (:class:`MemorySwaPool`) or in Redis
(:class:`RedisSwaPool`), chosen by name with :func:`make_swa_pool`.

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
from replaykv.cache.keys import KEY_BYTES, key_hex
from replaykv.cache.metrics import TierMetrics
from replaykv.cache.redis_url import redacted_url

log = logging.getLogger(__name__)

__all__ = [
    "SNAPSHOT_FRAME",
    "SNAPSHOT_MAGIC",
    "SWA_POOL_BACKENDS",
    "MemorySwaPool",
    "RedisSwaPool",
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


class RedisSwaPool(SwaPool):
    """Redis (or Valkey) pool: one snapshot = one value written by ``SET key value EX/PX ttl``.

    Keys are ``<key_prefix>{<64-hex prefix key>}``: the hash tag makes Redis Cluster place
    everything about one prefix key in one slot. Values carry :data:`SNAPSHOT_FRAME`, so a
    torn, foreign or half-evicted value is a miss (and is unlinked). Every Redis error or
    timeout becomes a counted miss or a failed put; after a connection error or timeout the
    pool stops calling Redis for ``retry_after_s`` (each call is then an immediate miss) and
    reconnects on the next call after that. Socket timeouts bound each call's waits
    (``socket_timeout_s`` per read/write, ``connect_timeout_s`` per connect; one reconnect
    retry on a dropped connection). ``clock`` stamps put times (wall time, shared with other
    writers); ``circuit_clock`` times the pause after an error (monotonic).

    ``bytes_resident``/``entries`` are not tracked (Redis evicts on its own); ``stats()``
    adds ``used_memory`` and ``keys`` from Redis when it answers. Failures are logged with the
    address: a warning when a kind starts, at most one a minute while it lasts, one when Redis
    answers again; quarantined values likewise, with their Redis key.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        password: str | None = None,
        ttl_s: float = 300.0,
        key_prefix: str = "replaykv:swa:",
        socket_timeout_s: float = 0.2,
        connect_timeout_s: float = 0.2,
        retry_after_s: float = 1.0,
        max_value_bytes: int = 512 * 1024 * 1024,
        clock: Callable[[], float] = time.time,
        circuit_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        _check_ttl(ttl_s)
        for name, value in (("socket_timeout_s", socket_timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not 0 < value <= 60:
                raise ValueError(f"{name} must be in (0, 60] seconds; got {value}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0; got {retry_after_s}")
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError("key_prefix must not contain '{' or '}' (the pool adds the hash tag itself)")
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self.retry_after_s = retry_after_s
        self.max_value_bytes = max_value_bytes
        self._clock = clock
        self._circuit_clock = circuit_clock
        options: dict[str, Any] = dict(
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            health_check_interval=0,
            decode_responses=False,
        )
        if url is not None:
            self._client = redis.Redis.from_url(url, **options)
            self.address = redacted_url(url)  # logged and in stats: never the password
        else:
            self._client = redis.Redis(host=host, port=port, db=db, password=password, **options)
            self.address = f"redis://{host}:{port}/{db}"
        self._redis_errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._unavailable: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            TimeoutError,
            ConnectionError,
        )
        self._timeout_types: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
        self._down_until = 0.0
        self._down_lock = threading.Lock()
        self.metrics = TierMetrics("swa_pool_redis")
        self._faults = FaultLog(log, f"Redis SWA pool at {self.address}", clock=circuit_clock)
        self._bad_values = FaultLog(log, f"Redis SWA pool at {self.address}", clock=circuit_clock)

    # ---------------------------------------------------------------- helpers
    def redis_key(self, key: bytes) -> str:
        """``<prefix>{<hex>}``: the Redis key of a prefix key."""
        return f"{self.key_prefix}{{{key_hex(key)}}}"

    def _available(self) -> bool:
        return self._circuit_clock() >= self._down_until

    def _classify(self, exc: BaseException) -> str:
        """Count the error and open the circuit for connection trouble; returns its kind."""
        if isinstance(exc, self._timeout_types):
            kind = "timeout"
        elif isinstance(exc, self._unavailable):
            kind = "connection"
        elif "OutOfMemory" in type(exc).__name__ or str(exc).startswith("OOM"):
            kind = "oom"
        else:
            kind = type(exc).__name__
        if kind in ("timeout", "connection"):
            with self._down_lock:
                self._down_until = self._circuit_clock() + self.retry_after_s
        self.metrics.errors.inc(kind)
        pause = f"; not calling it for {self.retry_after_s:g} s" if kind in ("timeout", "connection") else ""
        self._faults.failed(kind, f"{kind} error ({exc}): snapshots are misses{pause}")
        return kind

    @property
    def circuit_open(self) -> bool:
        return not self._available()

    # ---------------------------------------------------------------- contract
    def put(self, key: bytes, payload: Payload, ttl_s: float | None = None) -> bool:
        _check_key(key)
        ttl = self.ttl_s if ttl_s is None else ttl_s
        _check_ttl(ttl)
        size = memoryview(payload).nbytes
        if SNAPSHOT_FRAME.size + size > self.max_value_bytes:
            self.metrics.record_put(False, error="too_large")
            return False
        if not self._available():
            self.metrics.record_put(False, error="unavailable")
            return False
        value = encode_snapshot_frame(key, payload, self._clock(), ttl)
        whole_seconds = float(ttl).is_integer()
        try:
            if whole_seconds:
                ok = self._client.set(self.redis_key(key), value, ex=int(ttl))
            else:
                ok = self._client.set(self.redis_key(key), value, px=math.ceil(ttl * 1000))
        except self._redis_errors as exc:
            self.metrics.record_put(False)
            self._classify(exc)
            return False
        self._faults.recovered()
        if not ok:
            self.metrics.record_put(False, error="not_set")
            return False
        self.metrics.record_put(True, size)
        return True

    def get(self, key: bytes) -> bytes | None:
        _check_key(key)
        if not self._available():
            self.metrics.errors.inc("unavailable")
            self.metrics.record_miss()
            return None
        rkey = self.redis_key(key)
        try:
            value = self._client.get(rkey)
        except self._redis_errors as exc:
            self._classify(exc)
            self.metrics.record_miss()
            return None
        self._faults.recovered()
        if value is None:
            self.metrics.record_miss()
            return None
        decoded = decode_snapshot_frame(key, bytes(value))  # type: ignore[arg-type]
        if isinstance(decoded, str):
            self.metrics.quarantined.inc()
            self.metrics.errors.inc(f"bad_value:{decoded}")
            self._bad_values.failed(
                f"bad_value:{decoded}", f"quarantined the value under {rkey} ({decoded}); unlinking it"
            )
            try:
                self._client.unlink(rkey)
            except self._redis_errors as exc:
                self._classify(exc)
            self.metrics.record_miss()
            return None
        age = self._clock() - decoded.put_time
        if age >= decoded.ttl_s + 1.0:  # Redis should have expired it; clocks may differ by ~1 s
            self.metrics.expirations.inc()
            self.metrics.record_miss()
            return None
        self.metrics.record_hit(len(decoded.payload), age_s=age)
        return decoded.payload

    def contains(self, key: bytes) -> bool:
        _check_key(key)
        if not self._available():
            return False
        try:
            return bool(self._client.exists(self.redis_key(key)))
        except self._redis_errors as exc:
            self._classify(exc)
            return False

    def delete(self, key: bytes) -> bool:
        _check_key(key)
        if not self._available():
            return False
        try:
            gone = bool(self._client.unlink(self.redis_key(key)))
        except self._redis_errors as exc:
            self._classify(exc)
            return False
        if gone:
            self.metrics.deletes.inc()
        return gone

    def flush(self) -> None:
        """Unlink every key under this pool's prefix (SCAN + UNLINK; other keys are untouched)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.key_prefix) + "*"
        try:
            batch: list[bytes] = []
            for rkey in self._client.scan_iter(match=pattern, count=1000):
                batch.append(rkey)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)
        except self._redis_errors as exc:
            self._classify(exc)

    def ping(self) -> bool:
        """``True`` if Redis answers now (ignores and resets the circuit)."""
        try:
            ok = bool(self._client.ping())
        except self._redis_errors as exc:
            self._classify(exc)
            return False
        self._faults.recovered()
        with self._down_lock:
            self._down_until = 0.0
        return ok

    def stats(self) -> dict[str, object]:
        out = self.metrics.as_dict()
        out.update(backend="redis", address=self.address, ttl_s=self.ttl_s, circuit_open=self.circuit_open)
        if self._available():
            try:
                info: Any = self._client.info("memory")
                out.update(
                    used_memory=int(info.get("used_memory", 0)), maxmemory=int(info.get("maxmemory", 0))
                )
                out.update(keys=int(self._client.dbsize()))
            except self._redis_errors as exc:
                self._classify(exc)
        return out

    def check_integrity(self) -> None:
        self.metrics.check()

    def close(self) -> None:
        self._client.close()


SWA_POOL_BACKENDS: dict[str, type[SwaPool]] = {"memory": MemorySwaPool, "redis": RedisSwaPool}


def make_swa_pool(name: str, **kwargs: Any) -> SwaPool:
    """Build the pool registered under ``name`` (``memory`` or ``redis``) with ``kwargs``.

    Raises ``ValueError`` naming the choices for an unknown backend, or the accepted
    arguments for an unknown keyword.
    """
    cls = SWA_POOL_BACKENDS.get(name)
    if cls is None:
        choices = ", ".join(sorted(SWA_POOL_BACKENDS))
        raise ValueError(f"unknown SWA pool backend {name!r}; choose one of: {choices}")
    params = inspect.signature(cls).parameters
    unknown = sorted(k for k in kwargs if k not in params)
    if unknown:
        accepted = ", ".join(p for p in params if p != "self")
        raise ValueError(f"SWA pool {name!r} does not take {', '.join(unknown)}; it takes: {accepted}")
    return cls(**kwargs)
