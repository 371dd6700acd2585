"""RedisSwaPool against a real 3-master / 3-replica Redis Cluster: keys spread over the slots,
MOVED followed from one seed, the TTL kept per entry, a killed master degrading to misses
(never an error) and serving again from its promoted replica, and the cache manager answering
exactly through it all."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replaykv.cache.swa_pool import make_swa_pool
from replaykv.cache.swa_pool_redis import RedisSwaPool, seed_nodes
from tests.cache.conftest import FakeClock, RedisClusterNodes
from tests.cache.test_manager import (
    SPEC4,
    _reference,
    make_manager,
    managers,  # noqa: F401  (fixture)
    serve_model,
    tokens_of,
)

pytestmark = pytest.mark.redis


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def cluster_pool(cluster: RedisClusterNodes, **kw: Any) -> RedisSwaPool:
    pool = make_swa_pool("redis", url=cluster.url, cluster=True, ttl_s=300, **kw)
    assert isinstance(pool, RedisSwaPool) and pool.cluster
    return pool


def test_seed_nodes_parse() -> None:
    assert seed_nodes("redis://a:7000, b:7001,redis://:pw@c") == [("a", 7000), ("b", 7001), ("c", 6379)]
    with pytest.raises(ValueError, match="database 0"):
        seed_nodes("redis://a:7000/3")
    with pytest.raises(ValueError, match="no Redis seed"):
        seed_nodes(" , ")


def test_cluster_pool_spreads_keys_and_follows_moved(redis_cluster: RedisClusterNodes) -> None:
    pool = cluster_pool(redis_cluster)  # one seed: every other master is reached through MOVED
    for i in range(60):
        assert pool.put(k(i), bytes([i]) * (100 + i), ttl_s=100 + i)
    holders = {redis_cluster.master_of(pool.redis_key(k(i))).port for i in range(60)}
    assert len(holders) == 3, "the hash-tagged keys land on every master"
    for i in range(60):
        assert pool.get(k(i)) == bytes([i]) * (100 + i)
        assert pool.contains(k(i))
        master = redis_cluster.master_of(pool.redis_key(k(i))).client()
        assert 0 < master.ttl(pool.redis_key(k(i))) <= 100 + i  # each entry keeps its own TTL
    stats = pool.stats()
    assert stats["backend"] == "redis_cluster" and stats["keys"] == 60 and int(stats["used_memory"]) > 0
    assert pool.delete(k(0)) and not pool.contains(k(0))
    pool.flush()  # SCAN over every master, UNLINK split by slot
    assert all(not pool.contains(k(i)) for i in range(60))
    assert pool.stats()["keys"] == 0
    assert (stats["hits"], stats["misses"], stats["errors"]) == (60, 0, {})
    pool.check_integrity()
    pool.close()


def test_a_list_of_seeds_means_a_cluster(redis_cluster: RedisClusterNodes) -> None:
    seeds = ",".join(f"redis://127.0.0.1:{n.port}" for n in redis_cluster.nodes[:2])
    pool = make_swa_pool("redis", url=seeds, ttl_s=60)
    assert isinstance(pool, RedisSwaPool) and pool.cluster and pool.ping()
    assert pool.put(k(1), b"x") and pool.get(k(1)) == b"x"
    pool.close()


def test_unreachable_cluster_is_a_miss_not_an_error() -> None:
    circuit = FakeClock(0.0)
    pool = RedisSwaPool("redis://127.0.0.1:1", cluster=True, retry_after_s=5, circuit_clock=circuit)
    assert not pool.put(k(1), b"x") and pool.get(k(1)) is None and not pool.ping()
    assert pool.circuit_open and pool.stats()["errors"]["connection"] >= 1  # type: ignore[index]
    pool.close()


def _wait_replicated(cluster: RedisClusterNodes, pool: RedisSwaPool, key: bytes) -> None:
    """Until the key's master has a replica that acknowledged every write (a hang guard)."""
    master = cluster.master_of(pool.redis_key(key)).client()
    assert int(master.execute_command("WAIT", 1, 30_000)) >= 1, "no replica acknowledged the writes"


def test_master_failure_degrades_then_the_replica_serves(redis_cluster: RedisClusterNodes) -> None:
    circuit = FakeClock(0.0)
    pool = cluster_pool(redis_cluster, retry_after_s=1.0, circuit_clock=circuit)
    for i in range(30):
        assert pool.put(k(i), bytes([i]) * 64)
    victim = redis_cluster.master_of(pool.redis_key(k(0)))
    on_victim = [i for i in range(30) if redis_cluster.master_of(pool.redis_key(k(i))) is victim]
    _wait_replicated(redis_cluster, pool, k(0))
    victim.kill()
    # Until the cluster notices, calls to the dead master fail: counted misses, never raised.
    assert pool.get(k(on_victim[0])) is None
    assert pool.circuit_open and not pool.put(k(99), b"y")  # the circuit stops further calls
    errors = pool.stats()["errors"]
    assert isinstance(errors, dict) and errors.get("connection", 0) >= 1
    redis_cluster.wait_healthy()  # the replica is promoted
    circuit.advance(1.0)
    for i in on_victim:  # the promoted replica serves what the master had replicated
        assert pool.get(k(i)) == bytes([i]) * 64, i
    assert pool.put(k(99), b"y") and pool.get(k(99)) == b"y"
    assert not pool.circuit_open
    pool.check_integrity()
    pool.close()


def test_a_cluster_restarted_empty_is_a_miss_until_it_is_created_again(redis_cluster: RedisClusterNodes) -> None:
    """Every node dies and comes back empty, first without slots: calls are misses and failed
    puts (redis-py's client raises IndexError re-reading such a slot map), never errors; once
    the new cluster is created the pool stores and serves again, the old snapshots gone."""
    circuit = FakeClock(0.0)
    pool = cluster_pool(redis_cluster, retry_after_s=1.0, circuit_clock=circuit)
    for i in range(10):
        assert pool.put(k(i), bytes([i]) * 64)
    redis_cluster.restart_empty(create=False)
    for i in range(10):  # the nodes answer, but none serves a slot
        circuit.advance(1.0)
        assert not pool.put(k(i), b"z") and pool.get(k(i)) is None
    errors = pool.stats()["errors"]
    assert isinstance(errors, dict) and sum(errors.values()) >= 10, errors
    redis_cluster.create()
    circuit.advance(1.0)
    assert pool.get(k(0)) is None  # the new cluster is empty
    assert pool.put(k(0), b"new") and pool.get(k(0)) == b"new"
    pool.check_integrity()
    pool.close()


def test_manager_over_a_failing_cluster_answers_exactly(
    tmp_path: Any, clock: FakeClock, managers: Any, redis_cluster: RedisClusterNodes  # noqa: F811
) -> None:
    """The snapshot's master dies: the next turn's global KV still hits (store) and the answer
    equals a cold run; after the failover a new conversation continues exactly from the pool."""
    circuit = FakeClock(0.0)
    pool = cluster_pool(redis_cluster, retry_after_s=0.05, circuit_clock=circuit)
    m = make_manager(tmp_path, clock, spec=SPEC4, chunk=16, device=False, pool=pool)
    managers.append(m)
    ids = torch.tensor([tokens_of(21, 50)])
    _, cold = _reference(ids, 37)
    serve_model(m, ids[:, :37], "acme")
    plan = m.lookup(ids[0].tolist(), "acme")
    assert plan.snapshot_at_hit and plan.prefix_key is not None
    _wait_replicated(redis_cluster, pool, plan.prefix_key)
    redis_cluster.master_of(pool.redis_key(plan.prefix_key)).kill()
    loaded, logits = serve_model(m, ids, "acme")
    assert torch.equal(logits, cold) or (loaded.exact and loaded.snapshot_source == "pool")
    redis_cluster.wait_healthy()
    circuit.advance(1.0)
    ids = torch.tensor([tokens_of(22, 50)])
    split, _ = _reference(ids, 37)
    serve_model(m, ids[:, :37], "acme")
    loaded, logits = serve_model(m, ids, "acme")
    assert loaded.exact and loaded.snapshot_source == "pool" and torch.equal(logits, split)
    m.check_integrity()
