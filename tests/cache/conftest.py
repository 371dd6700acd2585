"""Fixtures for the cache-tier tests: a real ``redis-server`` on a free loopback port, a fake clock.

Not for: anything a test outside ``tests/cache`` should rely on.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replaykv.cache.keys import KeyNamespace

REDIS_BIN = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` child (no persistence) that tests can kill and restart on the same port."""

    def __init__(self, binary: str, workdir: Path, port: int) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--daemonize",
                "no",
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; see {self.workdir / 'redis.log'}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


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


def free_cluster_port() -> int:
    """A free loopback port whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterNodes:
    """A real Redis Cluster: six ``redis-server --cluster-enabled yes`` nodes on loopback, made
    three masters with one replica each by ``redis-cli --cluster create``; node timeout 1 s, so
    a killed master fails over within a few seconds."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.nodes: list[RedisServer] = []
        for i in range(6):
            (workdir / f"node{i}").mkdir()
            self.nodes.append(RedisServer(binary, workdir / f"node{i}", free_cluster_port()))

    @property
    def url(self) -> str:
        """One seed node: the client learns the rest of the cluster from it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                       "--cluster-node-timeout", "1000")  # fmt: skip
        assert REDIS_CLI is not None
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_healthy()

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None]

    def _nodes(self, node: RedisServer) -> dict[str, dict[str, Any]]:
        """``CLUSTER NODES`` as ``node`` sees it: address -> flags, slot ranges, …"""
        table: dict[str, dict[str, Any]] = node.client().execute_command("CLUSTER NODES")
        return {address.split("@")[0]: row for address, row in table.items()}

    def wait_healthy(self) -> None:
        """Until every live node reports ``cluster_state:ok``, sees every dead node as failed
        and three masters serving slots (a hang guard, not a timing claim)."""
        dead = {f"127.0.0.1:{n.port}" for n in self.nodes if n.proc is None}
        deadline = time.monotonic() + 60
        while True:
            try:
                ok = True
                for node in self.alive():
                    state = node.client().execute_command("CLUSTER INFO")["cluster_state"]
                    table = self._nodes(node)
                    masters = [r for r in table.values() if "master" in r["flags"] and "fail" not in r["flags"] and r["slots"]]
                    ok &= state == "ok" and len(masters) == 3
                    ok &= all("fail" in row["flags"] for address, row in table.items() if address in dead)
                if ok:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, "the Redis Cluster did not become healthy"
            time.sleep(0.05)

    def master_of(self, redis_key: str) -> RedisServer:
        """The live master serving ``redis_key``'s slot."""
        node = self.alive()[0]
        slot = int(node.client().execute_command("CLUSTER KEYSLOT", redis_key))
        for address, row in self._nodes(node).items():
            if "master" not in row["flags"] or "fail" in row["flags"]:
                continue
            if any(int(lo) <= slot <= int(hi) for lo, hi in row["slots"]):
                port = int(address.rpartition(":")[2])
                return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no master serves slot {slot}")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


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
