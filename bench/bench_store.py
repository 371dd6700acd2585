"""Throughput of the storage tiers next to a plain baseline measured in the same run.

For: ``python bench/bench_store.py [--dir DIR] [--mib N]``: DirectoryStore put/get versus a
plain sequential write/read of the same bytes (one file, one fsync at the end), and the
SWA pools (memory, Redis on a private ``redis-server``) versus a plain dict / raw redis-py
SET/GET of the same bytes. Prints one Markdown table of absolute figures and ratios to
stdout and removes everything it created.

Not for: assertions (tests never time anything) or tuning advice; figures depend on the
disk, the page cache and the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replaykv.cache.store import DirectoryStore
from replaykv.cache.swa_pool import MemorySwaPool, RedisSwaPool

CHUNK_BYTES = 256 * 890  # one 256-token chunk of V4.1-Flash global KV (890 B/token)
SNAPSHOT_BYTES = 40 * 128 * 528  # one V4.1-Flash SWA window snapshot (2,703,360 B)
MiB = 1 << 20


@dataclass
class Row:
    case: str
    size: int
    ops: int
    seconds: float
    baseline: str
    baseline_seconds: float

    def cells(self) -> list[str]:
        total = self.size * self.ops
        mbs = total / MiB / self.seconds
        base_mbs = total / MiB / self.baseline_seconds
        return [
            self.case,
            f"{self.size:,}",
            str(self.ops),
            f"{mbs:,.0f}",
            f"{self.ops / self.seconds:,.0f}",
            self.baseline,
            f"{base_mbs:,.0f}",
            f"{mbs / base_mbs:.2f}",
        ]


def payloads(size: int, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        seed = hashlib.sha256(b"bench-%d-%d" % (size, i)).digest()
        out.append((seed * (size // 32 + 1))[:size])
    return out


def keys(n: int, tag: bytes) -> list[bytes]:
    return [hashlib.sha256(tag + b"-%d" % i).digest() for i in range(n)]


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    """Best of ``repeat`` runs (in-memory cases repeat to shed scheduler noise)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_store(workdir: Path, size: int, n: int) -> list[Row]:
    data = payloads(size, n)
    ks = keys(n, b"store-%d" % size)
    root = workdir / f"store-{size}"
    plain = workdir / f"plain-{size}.bin"
    store = DirectoryStore(root, capacity_bytes=1 << 40)

    def store_writes() -> None:
        for key, payload in zip(ks, data, strict=True):
            assert store.put(key, payload)

    def plain_writes() -> None:
        fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for payload in data:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def store_reads() -> None:
        for key in ks:
            assert store.get(key) is not None

    def plain_reads() -> None:
        with open(plain, "rb", buffering=0) as f:
            for _ in range(n):
                assert len(f.read(size)) == size

    def threaded_writes(threads: int = 4) -> None:
        tkeys = keys(n, b"store-threads-%d" % size)
        with ThreadPoolExecutor(threads) as pool:
            assert all(pool.map(lambda i: store.put(tkeys[i], data[i]), range(n)))

    w_store, w_plain = timed(store_writes), timed(plain_writes)
    w_threads = timed(threaded_writes)
    entry_files = list((root / "entries").rglob("*.kv"))
    r_store_warm, r_plain_warm = timed(store_reads), timed(plain_reads)
    drop_page_cache([*entry_files, plain])
    r_store_cold = timed(store_reads)
    drop_page_cache([*entry_files, plain])
    r_plain_cold = timed(plain_reads)
    shutil.rmtree(root)
    plain.unlink()
    base = "one file, 1 fsync"
    return [
        Row("store put (fsync each)", size, n, w_store, base, w_plain),
        Row("store put, 4 threads", size, n, w_threads, base, w_plain),
        Row("store get, page cache", size, n, r_store_warm, "one file read", r_plain_warm),
        Row("store get, cache dropped", size, n, r_store_cold, "one file read", r_plain_cold),
    ]


def bench_memory_pool(size: int, n: int, rounds: int) -> list[Row]:
    data = payloads(size, n)
    ks = keys(n, b"mem-%d" % size)
    pool = MemorySwaPool(capacity_bytes=2 * size * n, ttl_s=300)
    plain: dict[bytes, bytes] = {}

    def pool_puts() -> None:
        for _ in range(rounds):
            for key, payload in zip(ks, data, strict=True):
                assert pool.put(key, payload)

    def dict_puts() -> None:
        for _ in range(rounds):
            for key, payload in zip(ks, data, strict=True):
                plain[key] = payload

    def pool_gets() -> None:
        for _ in range(rounds):
            for key in ks:
                assert pool.get(key) is not None

    def dict_gets() -> None:
        for _ in range(rounds):
            for key in ks:
                assert plain.get(key) is not None

    ops = n * rounds
    return [
        Row("memory pool put", size, ops, timed(pool_puts, 3), "dict set", timed(dict_puts, 3)),
        Row("memory pool get", size, ops, timed(pool_gets, 3), "dict get", timed(dict_gets, 3)),
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server(workdir: Path) -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def bench_redis_pool(url: str, size: int, n: int, rounds: int) -> list[Row]:
    import redis

    data = payloads(size, n)
    ks = keys(n, b"redis-%d" % size)
    pool = RedisSwaPool(url, ttl_s=300, socket_timeout_s=5, connect_timeout_s=1)
    raw = redis.Redis.from_url(url, socket_timeout=5)
    raw_keys = [f"plain:{key.hex()}" for key in ks]

    def pool_puts() -> None:
        for _ in range(rounds):
            for key, payload in zip(ks, data, strict=True):
                assert pool.put(key, payload)

    def raw_puts() -> None:
        for _ in range(rounds):
            for key, payload in zip(raw_keys, data, strict=True):
                raw.set(key, payload, ex=300)

    def pool_gets() -> None:
        for _ in range(rounds):
            for key in ks:
                assert pool.get(key) is not None

    def raw_gets() -> None:
        for _ in range(rounds):
            for key in raw_keys:
                assert raw.get(key) is not None

    ops = n * rounds
    rows = [
        Row("redis pool put", size, ops, timed(pool_puts, 3), "raw SET EX", timed(raw_puts, 3)),
        Row("redis pool get", size, ops, timed(pool_gets, 3), "raw GET", timed(raw_gets, 3)),
    ]
    raw.flushdb()
    pool.close()
    raw.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=128, help="bytes written per store case, MiB")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="replaykv-bench-", dir=args.dir))
    rows: list[Row] = []
    try:
        for size in (CHUNK_BYTES, 16 * CHUNK_BYTES):
            rows += bench_store(workdir, size, max(4, args.mib * MiB // size))
        for size, n in ((CHUNK_BYTES, 64), (SNAPSHOT_BYTES, 16)):
            rows += bench_memory_pool(size, n, rounds=8)
        with redis_server(workdir) as url:
            if url is not None:
                for size, n in ((CHUNK_BYTES, 64), (SNAPSHOT_BYTES, 16)):
                    rows += bench_redis_pool(url, size, n, rounds=4)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    header = ["case", "bytes/op", "ops", "MiB/s", "ops/s", "baseline", "baseline MiB/s", "ratio"]
    print(
        f"<!-- bench/bench_store.py on {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()} -->"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    if not any(r.case.startswith("redis") for r in rows):
        print("\n(redis-server not found: Redis rows skipped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
