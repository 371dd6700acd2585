"""The deployment ``bench/chaos.py`` runs its faults against, all real processes on loopback.

For: starting and breaking a multi-replica deployment: R ``replaykv serve`` replicas sharing one
store directory (``--store-shared``) and one Redis Cluster pool (six ``redis-server`` nodes), one
``replaykv route`` (sgl-router) in front of them, and a reference replica for cold answers. The
store directory sits on a small tmpfs of its own when this process may mount one (root), so
that "the disk is full" is a real ENOSPC on the store's file system.

Not for: the load or the report (``bench/chaos.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
from procs import interrupt

from replaykv.cache.redis_local import REDIS_BIN, RedisClusterNodes, free_port

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "chaos-admin"
REPLAY_OFF = ["--disable-encoder-swa-bounded-replay", "--disable-decoder-swa-bounded-replay"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAYKV_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 180.0) -> None:
    """Until ``url`` answers 200 (a hang guard: the bench fails rather than waiting forever)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:g} s")


class Replica:
    """One ``replaykv serve`` process; SIGKILL and restart keep its port, store and pool."""

    def __init__(self, name: str, flags: list[str], logdir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.flags = flags
        self.log_path = logdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "replaykv", "serve", "--port", str(self.port), "--admin-key", ADMIN, *self.flags]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        wait_http(self.url + "/health", self.proc, self.name)

    def sigkill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None:
            interrupt(self.proc)

    def running(self) -> int:
        """Requests holding a decode slot now (``replaykv_running_requests``); -1 when unreachable."""
        try:
            text = httpx.get(self.url + "/metrics", timeout=2).text
        except httpx.TransportError:
            return -1
        m = re.search(r"^replaykv_running_requests (\S+)$", text, re.M)
        return int(float(m.group(1))) if m else -1

    def flush_all(self) -> None:
        r = httpx.post(self.url + "/admin/flush_all", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        r.raise_for_status()


class Router:
    """``replaykv route`` over the replicas (health checks every second)."""

    def __init__(self, replicas: list[Replica], logdir: Path) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "replaykv", "route", "--port", str(self.port), "--metrics-port", str(free_port()),
               "--health-check-interval", "1", "--log-level", "warn", *(a for r in replicas for a in ("--replica", r.url))]  # fmt: skip
        with open(logdir / "router.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                                         start_new_session=True)  # fmt: skip
        wait_http(self.url + "/health", self.proc, "the router")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


class Disk:
    """The store's file system: a tmpfs of ``size_mb`` mounted at ``path`` when permitted."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        self.mounted = done.returncode == 0
        self.why_not = "" if self.mounted else (done.stderr.strip() or "mount failed")
        self.filler = path / ".chaos-filler"

    def fill(self) -> int:
        """Write a filler file on the store's file system until ENOSPC; the bytes written."""
        n = 0
        chunk = b"\0" * (1 << 20)
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    n += f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
            with contextlib.suppress(OSError):
                os.fsync(f.fileno())
        return n

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class Deployment:
    """The replicas, their cluster pool, their shared store and the router."""

    def __init__(self, workdir: Path, n_replicas: int, preset: str, store_mb: int) -> None:
        if REDIS_BIN is None:
            raise RuntimeError("redis-server not found on PATH (scripts/test.sh installs it)")
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True)
        self.cluster = RedisClusterNodes(REDIS_BIN, workdir / "redis", debug=True)
        self.cluster.start()
        self.disk = Disk(workdir / "store", store_mb + 16)
        common = ["--preset", preset, "--log-level", "warning", *REPLAY_OFF]
        shared = [*common, "--cache-dir", str(self.disk.path), "--store-shared", "--store-format", "file",
                  "--store-capacity", f"{store_mb}MB", "--swa-pool", "redis", "--redis-cluster",
                  "--redis-url", self.cluster.seeds]  # fmt: skip
        self.replicas = [Replica(f"replica{i}", shared, self.logs) for i in range(n_replicas)]
        for r in self.replicas:
            r.start()
        self.router = Router(self.replicas, self.logs)
        self.reference = Replica("reference", [*common, "--cache-dir", str(workdir / "ref"), "--swa-pool", "off"], self.logs)

    def close(self) -> None:
        self.router.stop()
        for r in [*self.replicas, self.reference]:
            r.stop()
        self.cluster.kill()
        self.disk.close()
