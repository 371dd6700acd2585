"""Local ``redis-server`` processes on loopback: one server, or a 3-master / 3-replica cluster.

For: the tests of the Redis pools and ``bench/chaos.py``, which need real Redis processes they
can kill, pause and restart (never a mock). Every process runs without persistence
(``--save "" --appendonly no``), binds 127.0.0.1 only and lives in its own work directory.

Not for: running Redis in production (use your deployment's Redis or Redis Cluster and point
``--redis-url`` at it); the pool itself (``replaykv.cache.swa_pool_redis``).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["REDIS_BIN", "REDIS_CLI", "RedisClusterNodes", "RedisServer", "free_cluster_port", "free_port"]

REDIS_BIN = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


class RedisServer:
    """One ``redis-server`` child (no persistence) that can be killed and restarted on its port."""

    def __init__(self, binary: str, workdir: Path, port: int) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *extra: str) -> None:
        """Start the server and wait (at most 10 s) until it answers PING."""
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no", *extra],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
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
        """SIGKILL the server (what it held in memory is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self, timeout_s: float = 5.0) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s)


class RedisClusterNodes:
    """A real Redis Cluster: six ``redis-server --cluster-enabled yes`` nodes on loopback, made
    three masters with one replica each by ``redis-cli --cluster create``; node timeout 1 s, so
    a killed master fails over within a few seconds. ``debug=True`` enables ``DEBUG`` from
    loopback (``DEBUG SLEEP`` stalls a node)."""

    def __init__(self, binary: str, workdir: Path, debug: bool = False) -> None:
        self.workdir = workdir
        self.debug = debug
        self.nodes: list[RedisServer] = []
        for i in range(6):
            (workdir / f"node{i}").mkdir(parents=True, exist_ok=True)
            self.nodes.append(RedisServer(binary, workdir / f"node{i}", free_cluster_port()))

    @property
    def url(self) -> str:
        """One seed node: the client learns the rest of the cluster from it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    @property
    def seeds(self) -> str:
        """Every node as a comma-separated seed list (``--redis-url``), so a client can find the
        cluster again whichever nodes are down."""
        return ",".join(f"redis://{n.address}" for n in self.nodes)

    def _node_args(self) -> list[str]:
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
        ]
        return args + (["--enable-debug-command", "local"] if self.debug else [])

    def start(self, create: bool = True) -> None:
        """Start the six nodes, create the cluster and wait until it is healthy (``create=False``:
        the nodes run, each knowing only itself and serving no slot, until :meth:`create`)."""
        for node in self.nodes:
            self._start_node(node)
        if create:
            self.create()

    def _start_node(self, node: RedisServer, attempts: int = 5) -> None:
        """Start a node that has not joined a cluster yet; when another process took its port or
        its bus port since it was chosen (both are picked free, then bound by the child), pick
        another pair and start again."""
        for attempt in range(attempts):
            try:
                node.start(*self._node_args())
                return
            except RuntimeError:
                log = (node.workdir / "redis.log").read_text(errors="replace")
                if "Address already in use" not in log or attempt == attempts - 1:
                    raise
                (node.workdir / "redis.log").rename(node.workdir / f"redis.{attempt}.log")
                (node.workdir / "nodes.conf").unlink(missing_ok=True)
                node.port = free_cluster_port()

    def create(self) -> None:
        """``redis-cli --cluster create`` over the six running nodes; wait until healthy."""
        if REDIS_CLI is None:
            raise RuntimeError("redis-cli not found on PATH: it creates the cluster")
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes), "--cluster-replicas", "1",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_healthy()

    def restart(self, node: RedisServer) -> None:
        """Start a killed node again on its port with its ``nodes.conf``: it rejoins the cluster
        (a former master comes back as a replica of the one that took its slots)."""
        node.start(*self._node_args())

    def restart_empty(self, create: bool = True) -> None:
        """Kill every node, delete their state and start a new, empty cluster on the same ports
        (``create=False``: as in :meth:`start`)."""
        self.kill()
        for node in self.nodes:
            shutil.rmtree(node.workdir)
            node.workdir.mkdir(parents=True)
        self.start(create)

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None]

    def _nodes(self, node: RedisServer) -> dict[str, dict[str, Any]]:
        """``CLUSTER NODES`` as ``node`` sees it: address -> flags, slot ranges, …"""
        table: dict[str, dict[str, Any]] = node.client().execute_command("CLUSTER NODES")
        return {address.split("@")[0]: row for address, row in table.items()}

    def masters(self) -> list[RedisServer]:
        """The live nodes that serve slots as masters now."""
        node = self.alive()[0]
        ports = {int(a.rpartition(":")[2]) for a, row in self._nodes(node).items()
                 if "master" in row["flags"] and "fail" not in row["flags"] and row["slots"]}  # fmt: skip
        return [n for n in self.alive() if n.port in ports]

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live node reports ``cluster_state:ok``, sees every dead node as failed
        and three masters serving slots (a hang guard, not a timing claim)."""
        import redis

        dead = {n.address for n in self.nodes if n.proc is None}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ok = True
                for node in self.alive():
                    state = node.client().execute_command("CLUSTER INFO")["cluster_state"]
                    table = self._nodes(node)
                    masters = [
                        r
                        for r in table.values()
                        if "master" in r["flags"] and "fail" not in r["flags"] and r["slots"]
                    ]
                    ok &= state == "ok" and len(masters) == 3
                    ok &= all("fail" in row["flags"] for address, row in table.items() if address in dead)
                if ok:
                    return
            except (OSError, redis.exceptions.RedisError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError("the Redis Cluster did not become healthy")
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
        raise RuntimeError(f"no master serves slot {slot}")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()
