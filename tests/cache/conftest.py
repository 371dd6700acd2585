"""Fixtures for the cache-tier tests: a real ``redis-server`` on a free loopback port, a fake clock.

Not for: anything a test outside ``tests/cache`` should rely on.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replaykv.cache.keys import KeyNamespace

REDIS_BIN = shutil.which("redis-server")


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
