"""MemorySwaPool: TTL with a fake clock, LRU under the cap, tenants, registry, a model-based test."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from replaykv.cache.keys import prefix_key
from replaykv.cache.swa_pool import (
    SWA_POOL_BACKENDS,
    MemorySwaPool,
    SwaPool,
    decode_snapshot_frame,
    default_pool_capacity,
    encode_snapshot_frame,
    make_swa_pool,
)
from tests.cache.conftest import FakeClock, make_namespace


def k(i: int) -> bytes:
    return hashlib.sha256(b"pool-%d" % i).digest()


def test_round_trip_and_stats(clock: FakeClock) -> None:
    pool = MemorySwaPool(capacity_bytes=1 << 20, ttl_s=300, clock=clock)
    assert isinstance(pool, SwaPool)
    assert pool.get(k(1)) is None
    data = bytearray(b"snapshot" * 100)
    assert pool.put(k(1), data)
    data[:8] = b"mutated!"  # the pool keeps its own copy
    clock.advance(12.5)
    assert pool.get(k(1)) == b"snapshot" * 100
    assert pool.contains(k(1)) and not pool.contains(k(2))
    stats = pool.stats()
    assert (stats["gets"], stats["hits"], stats["misses"], stats["puts_ok"]) == (2, 1, 1, 1)
    assert stats["bytes_resident"] == 800 and stats["bytes_read"] == 800
    age = stats["hit_age_s"]
    assert isinstance(age, dict) and age["count"] == 1 and age["max"] == pytest.approx(12.5)
    assert pool.delete(k(1)) and not pool.delete(k(1)) and pool.get(k(1)) is None
    pool.check_integrity()


def test_ttl_with_fake_clock(clock: FakeClock) -> None:
    pool = MemorySwaPool(capacity_bytes=1 << 20, ttl_s=300, clock=clock)
    assert pool.put(k(1), b"a")
    assert pool.put(k(2), b"b", ttl_s=10)
    clock.advance(9.99)
    assert pool.get(k(2)) == b"b"
    clock.advance(0.01)  # alive while age < ttl
    assert pool.get(k(2)) is None and not pool.contains(k(2))
    clock.advance(289.9)
    assert pool.get(k(1)) == b"a"  # a hit does not extend the TTL
    clock.advance(0.1)
    assert pool.get(k(1)) is None
    assert pool.stats()["expirations"] == 2 and len(pool) == 0
    assert pool.put(k(3), b"c") and pool.put(k(4), b"d", ttl_s=1)
    clock.advance(1)
    assert pool.sweep_expired() == 1 and len(pool) == 1
    pool.check_integrity()
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ttl_s"):
            pool.put(k(5), b"x", ttl_s=bad)


def test_lru_under_the_cap(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    pool = MemorySwaPool(capacity_bytes=300, ttl_s=300, clock=clock)
    for i in range(3):
        assert pool.put(k(i), bytes([i]) * 100)
    assert pool.get(k(0)) is not None  # order now 1, 2, 0
    assert pool.put(k(3), b"x" * 100)
    assert [pool.contains(k(i)) for i in range(4)] == [True, False, True, True]
    assert pool.put(k(4), b"y" * 200)  # evicts 2 then 0
    assert [pool.contains(k(i)) for i in range(5)] == [False, False, False, True, True]
    assert pool.stats()["evictions"] == 3
    with caplog.at_level(logging.WARNING, logger="replaykv.cache.swa_pool"):
        assert pool.put(k(5), b"z" * 301) is False and pool.stats()["errors"] == {"too_large": 1}
        assert pool.put(k(6), b"z" * 302) is False  # the same failure again: not logged twice
    (record,) = caplog.records
    assert "a snapshot of 301 B is over the pool's capacity of 300 B" in record.message
    assert pool.put(k(3), b"w" * 50)  # replacing frees the old size first
    assert pool.stats()["bytes_resident"] == 250
    pool.check_integrity()


def test_expired_victim_counts_as_expiration(clock: FakeClock) -> None:
    pool = MemorySwaPool(capacity_bytes=200, ttl_s=300, clock=clock)
    assert pool.put(k(0), b"a" * 100, ttl_s=1)
    assert pool.put(k(1), b"b" * 100)
    clock.advance(2)
    assert pool.put(k(2), b"c" * 100)
    assert pool.stats()["expirations"] == 1 and pool.stats()["evictions"] == 0


def test_paired_tenants(clock: FakeClock) -> None:
    pool = MemorySwaPool(capacity_bytes=1 << 20, clock=clock)
    tokens = list(range(300, 341))
    assert pool.put(prefix_key(make_namespace("org_a"), tokens), b"window")
    assert pool.get(prefix_key(make_namespace("org_a"), tokens)) == b"window"
    assert pool.stats()["hits"] == 1
    assert pool.get(prefix_key(make_namespace("org_b"), tokens)) is None
    assert pool.get(prefix_key(make_namespace("org_a"), tokens[:-1])) is None
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 2


def test_default_capacity_is_a_tenth_of_ram() -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_pool_capacity() == ram // 10
    assert MemorySwaPool().capacity_bytes == ram // 10


def test_registry() -> None:
    assert set(SWA_POOL_BACKENDS) == {"memory", "redis"}
    pool = make_swa_pool("memory", capacity_bytes=1000, ttl_s=5)
    assert isinstance(pool, MemorySwaPool) and pool.ttl_s == 5
    with pytest.raises(ValueError, match="choose one of: memory, redis"):
        make_swa_pool("disk")
    with pytest.raises(ValueError, match="does not take url"):
        make_swa_pool("memory", url="redis://x")
    with pytest.raises(ValueError, match="capacity_bytes"):
        make_swa_pool("memory", capacity_bytes=0)
    with pytest.raises(ValueError, match="32-byte"):
        pool.put(b"short", b"x")


def test_snapshot_frame_rejects_tampering() -> None:
    value = encode_snapshot_frame(k(1), b"payload", put_time=123.0, ttl_s=300)
    decoded = decode_snapshot_frame(k(1), value)
    assert not isinstance(decoded, str)
    assert (decoded.payload, decoded.put_time, decoded.ttl_s) == (b"payload", 123.0, 300.0)
    assert decode_snapshot_frame(k(2), value) == "bad_digest"  # copied under another key
    assert decode_snapshot_frame(k(1), value[:-1]) == "bad_length"
    assert decode_snapshot_frame(k(1), value[:10]) == "truncated"
    assert decode_snapshot_frame(k(1), b"\x00" * len(value)) == "bad_magic"
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert decode_snapshot_frame(k(1), bytes(flipped)) == "bad_digest"


def test_concurrent_use() -> None:
    pool = MemorySwaPool(capacity_bytes=20 * 1000, ttl_s=300)
    payloads = {k(i): bytes([i]) * 1000 for i in range(40)}
    wrong: list[bytes] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2000):
            key = rng.choice(list(payloads))
            if rng.random() < 0.5:
                pool.put(key, payloads[key])
            else:
                got = pool.get(key)
                if got is not None and got != payloads[key]:
                    wrong.append(key)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    pool.check_integrity()
    assert pool.stats()["hits"] > 0 and pool.stats()["evictions"] > 0


class PoolModel(RuleBasedStateMachine):
    """The pool against a plain ordered dict with the documented LRU + TTL policy."""

    CAPACITY = 1000

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock(0.0)
        self.pool = MemorySwaPool(capacity_bytes=self.CAPACITY, ttl_s=50, clock=self.clock)
        self.model: OrderedDict[int, tuple[bytes, float]] = OrderedDict()  # key → (payload, expires_at)
        self.counts = dict(hits=0, misses=0, evictions=0, expirations=0)

    @rule(
        i=st.integers(0, 7),
        size=st.integers(0, 600),
        ttl=st.one_of(st.none(), st.sampled_from([1.0, 5.0, 100.0])),
    )
    def put(self, i: int, size: int, ttl: float | None) -> None:
        payload = bytes([i]) * size
        ok = self.pool.put(k(i), payload, ttl_s=ttl)
        assert ok == (size <= self.CAPACITY)
        if not ok:
            return
        self.model.pop(i, None)
        used = sum(len(p) for p, _ in self.model.values())
        while used + size > self.CAPACITY:
            _, (old, expires) = self.model.popitem(last=False)
            used -= len(old)
            self.counts["expirations" if self.clock.now >= expires else "evictions"] += 1
        self.model[i] = (payload, self.clock.now + (50 if ttl is None else ttl))

    @rule(i=st.integers(0, 7))
    def get(self, i: int) -> None:
        got = self.pool.get(k(i))
        entry = self.model.get(i)
        if entry is not None and self.clock.now >= entry[1]:
            del self.model[i]
            self.counts["expirations"] += 1
            entry = None
        if entry is None:
            self.counts["misses"] += 1
            assert got is None
        else:
            self.counts["hits"] += 1
            self.model.move_to_end(i)
            assert got == entry[0]

    @rule(i=st.integers(0, 7))
    def delete(self, i: int) -> None:
        assert self.pool.delete(k(i)) == (self.model.pop(i, None) is not None)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 20.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule()
    def flush(self) -> None:
        self.pool.flush()
        self.model.clear()

    @invariant()
    def agrees(self) -> None:
        self.pool.check_integrity()
        stats = self.pool.stats()
        assert {name: stats[name] for name in self.counts} == self.counts
        assert stats["entries"] == len(self.model)
        assert stats["bytes_resident"] == sum(len(p) for p, _ in self.model.values())


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
