"""Fixtures for the cache-tier tests: a real ``redis-server`` on a free loopback port (or a real
Redis Cluster; the processes come from ``replaykv.cache.redis_local``), a fake clock.

Not for: anything a test outside ``tests/cache`` should rely on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replaykv.cache.keys import KeyNamespace
from replaykv.cache.redis_local import REDIS_BIN, REDIS_CLI, RedisClusterNodes, RedisServer, free_port


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server --save "" --appendonly no`` on a free 127.0.0.1 port; killed after the test."""
    if REDIS_BIN is None:  # a declared test dependency: its absence fails, it never skips
        pytest.fail("redis-server binary not found on PATH: `make test` (scripts/test.sh) installs it")
    last: Exception | None = None
    for _ in range(5):  # the free port can be taken between probe and bind
        server = RedisServer(REDIS_BIN, tmp_path, free_port())
        try:
            server.start()
        except RuntimeError as exc:
            last = exc
            continue
        try:
            yield server
        finally:
            server.kill()
        return
    raise RuntimeError(f"could not start redis-server: {last}")


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A fresh 3-master / 3-replica Redis Cluster on loopback; killed after the test."""
    if REDIS_BIN is None or REDIS_CLI is None:  # declared test dependencies: never a skip
        pytest.fail("redis-server and redis-cli must be on PATH: `make test` (scripts/test.sh) installs them")
    cluster = RedisClusterNodes(REDIS_BIN, tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill()


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_namespace(salt: bytes | str = "tenant-a", **overrides: object) -> KeyNamespace:
    fields: dict[str, object] = dict(
        model_config_hash="cfg-v41-tiny",
        weights_digest="weights-0",
        kv_layout_version=1,
        kv_dtypes=("fp4_e2m1", "ue8m0", "fp8_e4m3"),
        compress_ratios=(0, 2, 2, 1, 0),
        chunk_size=16,
        tenant_salt=salt,
    )
    fields.update(overrides)
    return KeyNamespace(**fields)  # type: ignore[arg-type]
