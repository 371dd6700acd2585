"""The SWA pool in Redis: one server, or a Redis Cluster through redis-py's ``RedisCluster``.

For: :class:`RedisSwaPool`, the :class:`~replaykv.cache.swa_pool.SwaPool` contract over Redis,
so that every replica of a deployment sees the window snapshots any of them wrote. One value
per snapshot (framed by :data:`~replaykv.cache.swa_pool.SNAPSHOT_FRAME`), under a hash-tagged
key, so a snapshot never spans two cluster slots. In a cluster the client follows MOVED / ASK
redirections and re-reads the slot map after a failover; a call that still fails is a counted
miss or a failed put, never an error: the engine replays or rebuilds the window instead.

Not for: the frame itself or the in-process pool (``replaykv.cache.swa_pool``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from replaykv.cache.faultlog import FaultLog
from replaykv.cache.keys import key_hex
from replaykv.cache.metrics import TierMetrics
from replaykv.cache.redis_url import redacted_url
from replaykv.cache.swa_pool import (
    SNAPSHOT_FRAME,
    Payload,
    SwaPool,
    _check_key,
    _check_ttl,
    decode_snapshot_frame,
    encode_snapshot_frame,
)

log = logging.getLogger(__name__)

__all__ = ["RedisSwaPool", "seed_nodes"]


def seed_nodes(url: str) -> list[tuple[str, int]]:
    """``host:port`` pairs of a comma-separated list of Redis URLs (``redis://h1:p1,redis://h2:p2``
    or bare ``h:p``); a cluster has one database only, so a path other than ``/0`` is refused."""
    out = []
    for part in (p.strip() for p in url.split(",")):
        if not part:
            continue
        parts = urllib.parse.urlsplit(part if "://" in part else f"redis://{part}")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"a Redis Cluster has database 0 only; got {redacted_url(part)!r}")
        if parts.hostname is None:
            raise ValueError(f"no host in Redis URL {redacted_url(part)!r}")
        out.append((parts.hostname, parts.port or 6379))
    if not out:
        raise ValueError("no Redis seed node given")
    return out


class RedisSwaPool(SwaPool):
    """Redis (or Valkey) pool: one snapshot = one value written by ``SET key value EX/PX ttl``.

    ``cluster=True`` (or a comma-separated list of seed nodes in ``url``) talks to a Redis
    Cluster: the seeds give the slot map, the client follows MOVED / ASK and re-reads the map
    after a failover (bounded: one retry per call, within the socket timeouts), and a cluster
    that cannot be reached at start-up is a closed circuit that retries later, not an error.

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
        cluster: bool = False,
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
        self.cluster = cluster or (url is not None and "," in url)
        self._client: Any = None
        if self.cluster:
            seeds = seed_nodes(url) if url is not None else [(host, port)]
            if url is not None:
                first = urllib.parse.urlsplit(url.split(",")[0].strip())
                password = first.password or password
                options["username"] = first.username or None
            options.pop("health_check_interval")
            self._cluster_args: dict[str, Any] = dict(seeds=seeds, password=password, options=options)
            self.address = ",".join(f"redis://{h}:{p}" for h, p in seeds)
        elif url is not None:
            self._client = redis.Redis.from_url(url, **options)
            self.address = redacted_url(url)  # logged and in stats: never the password
        else:
            self._client = redis.Redis(host=host, port=port, db=db, password=password, **options)
            self.address = f"redis://{host}:{port}/{db}"
        # A cluster's own failures (no node reachable, a slot with no master, CLUSTERDOWN while
        # a failover runs) count as the cluster being unavailable.
        cluster_down: tuple[type[BaseException], ...] = (
            redis.exceptions.RedisClusterException,
            redis.exceptions.ClusterDownError,
        )
        if self.cluster:
            # redis-py's cluster client raises IndexError when it re-reads the slot map from a
            # node that knows no master yet (a cluster being created again after a restart);
            # the client is then rebuilt from the seeds.
            cluster_down += (IndexError,)
        self._redis_errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError, *cluster_down)
        self._unavailable: tuple[type[BaseException], ...] = (
            *cluster_down,
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            TimeoutError,
            ConnectionError,
        )
        self._timeout_types: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
        self._down_until = 0.0
        self._down_lock = threading.Lock()
        self.metrics = TierMetrics("swa_pool_redis_cluster" if self.cluster else "swa_pool_redis")
        what = "Redis Cluster SWA pool" if self.cluster else "Redis SWA pool"
        self._faults = FaultLog(log, f"{what} at {self.address}", clock=circuit_clock)
        self._bad_values = FaultLog(log, f"{what} at {self.address}", clock=circuit_clock)
        self._connect_lock = threading.RLock()  # _classify may drop the client while it is made

    # ---------------------------------------------------------------- helpers
    def redis_key(self, key: bytes) -> str:
        """``<prefix>{<hex>}``: the Redis key of a prefix key."""
        return f"{self.key_prefix}{{{key_hex(key)}}}"

    def _available(self) -> Any:
        """The client when the circuit is closed (making a cluster's client first), else None.
        Callers use the returned client, never ``self._client``: a cluster's client can be
        dropped by another thread meanwhile."""
        if self._circuit_clock() < self._down_until:
            return None
        return self._ensure_client()

    def _ensure_client(self) -> Any:
        """The client; a cluster's is made on first use (its constructor reads the slot map,
        which fails while no seed answers: counted and the circuit opened, as any connection
        error, and None returned)."""
        client = self._client
        if client is not None:
            return client
        with self._connect_lock:
            if self._client is None:
                try:
                    self._client = self._make_cluster_client()
                except self._redis_errors as exc:
                    self._classify(exc)
                    return None
            return self._client

    def _make_cluster_client(self) -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        args = self._cluster_args
        nodes = [ClusterNode(h, p) for h, p in args["seeds"]]
        return RedisCluster(
            startup_nodes=nodes, password=args["password"], require_full_coverage=False, **args["options"]
        )

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
        if isinstance(exc, IndexError) and self.cluster:
            with self._connect_lock:
                self._client = None  # its slot map is half read: start again from the seeds
        self.metrics.errors.inc(kind)
        pause = f"; not calling it for {self.retry_after_s:g} s" if kind in ("timeout", "connection") else ""
        self._faults.failed(kind, f"{kind} error ({exc}): snapshots are misses{pause}")
        return kind

    @property
    def circuit_open(self) -> bool:
        return self._circuit_clock() < self._down_until

    # ---------------------------------------------------------------- contract
    def put(self, key: bytes, payload: Payload, ttl_s: float | None = None) -> bool:
        _check_key(key)
        ttl = self.ttl_s if ttl_s is None else ttl_s
        _check_ttl(ttl)
        size = memoryview(payload).nbytes
        if SNAPSHOT_FRAME.size + size > self.max_value_bytes:
            self.metrics.record_put(False, error="too_large")
            return False
        client = self._available()
        if client is None:
            self.metrics.record_put(False, error="unavailable")
            return False
        value = encode_snapshot_frame(key, payload, self._clock(), ttl)
        whole_seconds = float(ttl).is_integer()
        try:
            if whole_seconds:
                ok = client.set(self.redis_key(key), value, ex=int(ttl))
            else:
                ok = client.set(self.redis_key(key), value, px=math.ceil(ttl * 1000))
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
        client = self._available()
        if client is None:
            self.metrics.errors.inc("unavailable")
            self.metrics.record_miss()
            return None
        rkey = self.redis_key(key)
        try:
            value = client.get(rkey)
        except self._redis_errors as exc:
            self._classify(exc)
            self.metrics.record_miss()
            return None
        self._faults.recovered()
        if value is None:
            self.metrics.record_miss()
            return None
        decoded = decode_snapshot_frame(key, bytes(value))
        if isinstance(decoded, str):
            self.metrics.quarantined.inc()
            self.metrics.errors.inc(f"bad_value:{decoded}")
            self._bad_values.failed(
                f"bad_value:{decoded}", f"quarantined the value under {rkey} ({decoded}); unlinking it"
            )
            try:
                client.unlink(rkey)
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
        client = self._available()
        if client is None:
            return False
        try:
            return bool(client.exists(self.redis_key(key)))
        except self._redis_errors as exc:
            self._classify(exc)
            return False

    def delete(self, key: bytes) -> bool:
        _check_key(key)
        client = self._available()
        if client is None:
            return False
        try:
            gone = bool(client.unlink(self.redis_key(key)))
        except self._redis_errors as exc:
            self._classify(exc)
            return False
        if gone:
            self.metrics.deletes.inc()
        return gone

    def flush(self) -> None:
        """Unlink every key under this pool's prefix (SCAN + UNLINK; other keys are untouched)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.key_prefix) + "*"
        client = self._ensure_client()
        if client is None:
            return
        try:
            batch: list[bytes] = []
            for rkey in client.scan_iter(match=pattern, count=1000):
                batch.append(rkey)
                if len(batch) >= 1000:
                    client.unlink(*batch)
                    batch.clear()
            if batch:
                client.unlink(*batch)
        except self._redis_errors as exc:
            self._classify(exc)

    def ping(self) -> bool:
        """``True`` if Redis answers now (every primary of a cluster); ignores and resets the circuit."""
        client = self._ensure_client()
        if client is None:
            return False
        try:
            ok = bool(client.ping())
        except self._redis_errors as exc:
            self._classify(exc)
            return False
        self._faults.recovered()
        with self._down_lock:
            self._down_until = 0.0
        return ok

    def stats(self) -> dict[str, object]:
        out = self.metrics.as_dict()
        out.update(
            backend="redis_cluster" if self.cluster else "redis",
            address=self.address,
            ttl_s=self.ttl_s,
            circuit_open=self.circuit_open,
        )
        client = self._available()
        if client is not None:
            try:
                if self.cluster:  # summed over the primaries (replicas hold copies)
                    primaries = client.PRIMARIES
                    per_node = client.info("memory", target_nodes=primaries).values()
                    keys = client.dbsize(target_nodes=primaries)
                else:
                    per_node, keys = [client.info("memory")], client.dbsize()
                out.update(
                    used_memory=sum(int(i.get("used_memory", 0)) for i in per_node),
                    maxmemory=sum(int(i.get("maxmemory", 0)) for i in per_node),
                    keys=int(keys),
                )
            except self._redis_errors as exc:
                self._classify(exc)
        return out

    def check_integrity(self) -> None:
        self.metrics.check()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
