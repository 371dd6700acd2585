"""RedisSwaPool against a real redis-server: TTL, tenants, outage and restart, eviction, slowness, bad values."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time

import pytest

from replaykv.cache.keys import prefix_key
from replaykv.cache.redis_local import RedisServer
from replaykv.cache.redis_url import redacted_url
from replaykv.cache.swa_pool import SNAPSHOT_FRAME, encode_snapshot_frame, make_swa_pool
from replaykv.cache.swa_pool_redis import RedisSwaPool
from tests.cache.conftest import FakeClock, make_namespace

pytestmark = pytest.mark.redis


def k(i: int) -> bytes:
    return hashlib.sha256(b"redis-pool-%d" % i).digest()


def snapshot(i: int, size: int = 4096) -> bytes:
    seed = hashlib.sha256(b"snap-%d" % i).digest()
    return (seed * (size // 32 + 1))[:size]


def make_pool(url: str, **kw: object) -> RedisSwaPool:
    options: dict[str, object] = dict(ttl_s=300, retry_after_s=0.1)
    options.update(kw)
    pool = make_swa_pool("redis", url=url, **options)
    assert isinstance(pool, RedisSwaPool)
    return pool


def test_round_trip_ttl_and_key_format(redis_server: RedisServer) -> None:
    pool = make_pool(redis_server.url)
    raw = redis_server.client()
    assert pool.get(k(1)) is None
    assert pool.put(k(1), snapshot(1, 2_703_360))  # one V4.1-Flash window snapshot
    assert pool.get(k(1)) == snapshot(1, 2_703_360)
    rkey = pool.redis_key(k(1))
    assert rkey == "replaykv:swa:{" + k(1).hex() + "}"
    assert 299 <= raw.ttl(rkey) <= 300  # SET ... EX really set the TTL
    assert pool.put(k(2), b"x", ttl_s=1.5)
    assert 1000 <= raw.pttl(pool.redis_key(k(2))) <= 1500
    assert raw.strlen(rkey) == SNAPSHOT_FRAME.size + 2_703_360  # one value per snapshot
    assert pool.put(k(1), b"replaced") and pool.get(k(1)) == b"replaced"
    assert 299 <= raw.ttl(rkey) <= 300  # a replacement keeps a TTL
    assert pool.contains(k(1)) and pool.delete(k(1)) and not pool.delete(k(1))
    stats = pool.stats()
    assert (stats["hits"], stats["misses"], stats["puts_ok"]) == (2, 1, 3)
    assert stats["bytes_read"] == 2_703_360 + len(b"replaced")
    assert isinstance(stats["used_memory"], int) and stats["circuit_open"] is False
    pool.check_integrity()


def test_redis_expires_entries(redis_server: RedisServer) -> None:
    pool = make_pool(redis_server.url)
    raw = redis_server.client()
    assert pool.put(k(1), b"short", ttl_s=0.2)
    rkey = pool.redis_key(k(1))
    assert 0 < raw.pttl(rkey) <= 200  # Redis holds the sub-second TTL (PX)
    for _ in range(10_000):  # wait for Redis itself to expire it, however slow the machine
        if not raw.exists(rkey):
            break
        time.sleep(0.01)
    else:
        pytest.fail("Redis never expired the entry")
    assert pool.get(k(1)) is None
    stats = pool.stats()
    assert (stats["misses"], stats["expirations"], stats["quarantined"]) == (1, 0, 0)


def test_stale_value_is_never_served_even_if_redis_keeps_it(redis_server: RedisServer) -> None:
    clock = FakeClock(1_000_000.0)
    pool = make_pool(redis_server.url, clock=clock)
    assert pool.put(k(1), b"snap", ttl_s=10)
    clock.advance(5)
    assert pool.get(k(1)) == b"snap"
    age = pool.stats()["hit_age_s"]
    assert isinstance(age, dict) and age["max"] == pytest.approx(5.0)
    clock.advance(10)  # writer's put time says expired (e.g. a replica that missed the expiry)
    assert pool.get(k(1)) is None and pool.stats()["expirations"] == 1


def test_paired_tenants(redis_server: RedisServer) -> None:
    pool = make_pool(redis_server.url)
    tokens = list(range(7000, 7077))
    assert pool.put(prefix_key(make_namespace("org_a"), tokens), b"window-a")
    assert pool.get(prefix_key(make_namespace("org_a"), tokens)) == b"window-a"
    assert pool.stats()["hits"] == 1
    assert pool.get(prefix_key(make_namespace("org_b"), tokens)) is None
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 1


def test_outage_and_restart_on_the_same_port(redis_server: RedisServer) -> None:
    circuit = FakeClock(0.0)
    pool = make_pool(redis_server.url, retry_after_s=0.2, circuit_clock=circuit)
    assert pool.put(k(1), b"before")
    redis_server.kill()
    assert pool.get(k(1)) is None  # no exception: a connection error, and the circuit opens
    assert pool.stats()["errors"] == {"connection": 1} and pool.circuit_open
    # while the circuit is open nothing waits on Redis: puts and gets fail at once, counted
    assert pool.put(k(2), b"during") is False
    assert not pool.contains(k(1)) and not pool.delete(k(1))
    for _ in range(20):
        assert pool.get(k(1)) is None
    stats = pool.stats()
    assert stats["errors"] == {"connection": 1, "unavailable": 21} and stats["misses"] == 21
    pool.flush()  # flush always tries Redis: one more connection error
    assert pool.stats()["errors"] == {"connection": 2, "unavailable": 21}
    redis_server.start()
    assert pool.put(k(3), b"after") is False  # the circuit is still open
    circuit.advance(0.2)
    assert not pool.circuit_open
    assert pool.put(k(3), b"after") and pool.get(k(3)) == b"after"  # recovered on its own
    assert pool.get(k(1)) is None  # no persistence: the old snapshot is gone, a plain miss
    assert pool.stats()["errors"] == {"connection": 2, "unavailable": 22}
    pool.check_integrity()


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_small_maxmemory_only_complete_snapshots_or_misses(redis_server: RedisServer, policy: str) -> None:
    raw = redis_server.client()
    raw.config_set("maxmemory", str(4 * 1024 * 1024))
    raw.config_set("maxmemory-policy", policy)
    pool = make_pool(redis_server.url)
    size = 300_000
    stored = [pool.put(k(i), snapshot(i, size)) for i in range(40)]
    results = [pool.get(k(i)) for i in range(40)]
    for i, got in enumerate(results):
        assert got is None or got == snapshot(i, size)
    hits = sum(r is not None for r in results)
    assert 0 < hits < 40
    errors = pool.stats()["errors"]
    assert isinstance(errors, dict)
    if policy == "noeviction":
        assert not all(stored) and errors.get("oom", 0) == stored.count(False)
    else:
        assert all(stored)
    assert pool.stats()["quarantined"] == 0
    pool.check_integrity()


def test_slow_redis_is_a_timed_out_miss_then_an_open_circuit(redis_server: RedisServer) -> None:
    circuit = FakeClock(0.0)
    pool = make_pool(redis_server.url, socket_timeout_s=0.2, retry_after_s=0.3, circuit_clock=circuit)
    assert pool.put(k(1), b"snap")
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # Redis accepts nothing and answers nothing
    try:
        assert pool.get(k(1)) is None  # the socket timeout fired: a miss, not a hang or a raise
        assert pool.stats()["errors"] == {"timeout": 1} and pool.circuit_open
        assert pool.put(k(2), b"x") is False  # circuit open: no second wait on the socket
        assert pool.stats()["errors"] == {"timeout": 1, "unavailable": 1}
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    circuit.advance(0.3)
    assert pool.get(k(1)) == b"snap"
    assert pool.stats()["errors"] == {"timeout": 1, "unavailable": 1}


def test_torn_and_foreign_values_are_misses(redis_server: RedisServer) -> None:
    clock = FakeClock(1_000_000.0)
    pool = make_pool(redis_server.url, clock=clock)
    raw = redis_server.client()
    good = encode_snapshot_frame(k(1), b"payload" * 100, put_time=clock(), ttl_s=300)
    raw.set(pool.redis_key(k(1)), good[:-10], ex=300)  # torn
    raw.set(pool.redis_key(k(2)), good, ex=300)  # copied under another key
    raw.set(pool.redis_key(k(3)), b"someone else's value", ex=300)  # foreign
    for i in (1, 2, 3):
        assert pool.get(k(i)) is None
        assert raw.exists(pool.redis_key(k(i))) == 0  # unlinked so it is not read again
    assert pool.stats()["quarantined"] == 3
    raw.set(pool.redis_key(k(1)), good, ex=300)
    assert pool.get(k(1)) == b"payload" * 100


def test_flush_touches_only_this_pool(redis_server: RedisServer) -> None:
    raw = redis_server.client()
    raw.set("other:key", b"keep")
    pool_a = make_pool(redis_server.url, key_prefix="a*[x]:")
    pool_b = make_pool(redis_server.url, key_prefix="b:")
    for i in range(2500):
        pool_a.put(k(i), b"a")
    assert pool_b.put(k(0), b"b")
    pool_a.flush()
    assert raw.dbsize() == 2 and raw.get("other:key") == b"keep" and pool_b.get(k(0)) == b"b"


def test_argument_validation(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match="hash tag"):
        make_pool(redis_server.url, key_prefix="x{y}")
    with pytest.raises(ValueError, match="socket_timeout_s"):
        make_pool(redis_server.url, socket_timeout_s=0)
    pool = make_pool(redis_server.url, max_value_bytes=1000)
    assert pool.put(k(1), b"x" * 1000) is False and pool.stats()["errors"] == {"too_large": 1}


def test_unreachable_redis_never_raises() -> None:
    from tests.cache.conftest import free_port

    pool = RedisSwaPool(host="127.0.0.1", port=free_port(), retry_after_s=0.1, circuit_clock=FakeClock(0.0))
    assert pool.get(k(1)) is None and pool.put(k(1), b"x") is False
    assert pool.stats()["errors"] == {"connection": 1, "unavailable": 1}  # one refused connect, then none
    assert not pool.ping()  # ping ignores the circuit and tries again
    assert pool.stats()["errors"] == {"connection": 2, "unavailable": 1}
    assert pool.stats()["circuit_open"] is True


def test_an_outage_is_logged_once_then_rate_limited_then_its_recovery(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    circuit = FakeClock(0.0)
    pool = make_pool(redis_server.url, retry_after_s=0.2, circuit_clock=circuit)
    caplog.set_level(logging.WARNING, logger="replaykv.cache.swa_pool")
    assert pool.put(k(1), b"before") and not caplog.records  # healthy: silent
    redis_server.kill()
    for _ in range(5):
        assert pool.get(k(1)) is None
        circuit.advance(0.2)  # the circuit closes again: every get tries Redis and fails
    assert len(caplog.records) == 1  # the first failure, not the four after it
    first = caplog.records[0]
    assert first.levelno == logging.WARNING and redis_server.url in first.message
    assert "connection error" in first.message
    circuit.advance(60)
    assert pool.get(k(1)) is None  # still down a minute later: one more line, with the count
    assert len(caplog.records) == 2 and "still failing: 6 times" in caplog.records[1].message
    assert "4 not logged" in caplog.records[1].message
    redis_server.start()
    circuit.advance(0.2)
    assert pool.put(k(2), b"after")
    assert len(caplog.records) == 3
    assert "recovered" in caplog.records[2].message and "connection ×6" in caplog.records[2].message
    assert pool.stats()["errors"] == {"connection": 6}
    assert pool.get(k(2)) == b"after" and len(caplog.records) == 3  # recovered once, then silent
    raw = redis_server.client()
    raw.set(pool.redis_key(k(3)), b"someone else's value", ex=300)
    assert pool.get(k(3)) is None
    assert len(caplog.records) == 4 and pool.redis_key(k(3)) in caplog.records[3].message
    assert "quarantined" in caplog.records[3].message


def test_a_password_in_the_url_never_shows_in_stats_or_the_log(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    redis_server.client().config_set("requirepass", "hunter2")
    url = f"redis://:hunter2@127.0.0.1:{redis_server.port}/0"
    pool = make_pool(url, circuit_clock=FakeClock(0.0))
    assert pool.put(k(1), b"value") and pool.get(k(1)) == b"value"  # the password reached Redis
    assert pool.stats()["address"] == f"redis://:***@127.0.0.1:{redis_server.port}/0"
    caplog.set_level(logging.WARNING, logger="replaykv.cache.swa_pool")
    redis_server.kill()
    assert pool.get(k(1)) is None
    assert caplog.records and all("hunter2" not in r.getMessage() for r in caplog.records)
    assert "redis://:***@" in caplog.records[0].getMessage()
    assert redacted_url("redis://alice:pw@h:1/2") == "redis://alice:***@h:1/2"
    assert redacted_url("rediss://h:1/0") == "rediss://h:1/0"
