"""Throughput of the storage tiers next to plain baselines measured in the same run.

For: ``python bench/bench_store.py [--dir DIR] [--mib N] [--write docs/benchmarks.md]``: DirectoryStore put / put_many / get
versus two plain baselines that move the same bytes (see ``BASELINES``, printed with the table),
and the SWA pools (memory, Redis on a private ``redis-server``) versus a plain dict / raw
redis-py SET/GET of the same bytes. Prints Markdown tables of absolute figures and ratios to
stdout (and with ``--write`` into its own section of that file) and removes everything it created.

Not for: assertions (tests never time anything) or tuning advice; figures depend on the
disk, the file system, the page cache, the CPU and whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import replace_section

from replaykv.cache.file_store import DEFAULT_IO_THREADS, DirectoryStore
from replaykv.cache.pack_store import PACK_FORMAT_VERSION, PackStore
from replaykv.cache.store import STORE_FORMAT_VERSION
from replaykv.cache.swa_pool import MemorySwaPool
from replaykv.cache.swa_pool_redis import RedisSwaPool

CHUNK_BYTES = 256 * 890  # one 256-token chunk of V4.1-Flash global KV (890 B/token)
SNAPSHOT_BYTES = 40 * 128 * 528  # one V4.1-Flash SWA window snapshot (2,703,360 B)
BATCH = {CHUNK_BYTES: 16, 16 * CHUNK_BYTES: 4}  # a request's new chunks: one put_many per request
MiB = 1 << 20
WRITE_ROUNDS = 5
MARK_BEGIN = "<!-- bench_store:begin -->"
MARK_END = "<!-- bench_store:end -->"

BASELINES = """\
Store baselines (same bytes, same run; the store rows' ratios are store MiB/s ÷ baseline MiB/s):

* **(a) file per chunk**, the primary, like-for-like baseline. Writes: each chunk into its own
  new file, `write` + `fsync` + `close`, one after the other, and one `fsync` of the directory
  at the end. Reads: `open` + `read` + `close` per chunk file. This is what a plain program needs
  for the guarantee the store gives each entry: an acknowledged chunk survives a crash on its
  own (the store acknowledges nothing before its data and its name are durable) and can be
  replaced, evicted or expired alone. The baseline computes no checksum and fsyncs its single
  directory once for all chunks, both in its favour (the store hashes every payload with SHA-256
  and XXH3-64 and fsyncs every fan-out directory it touches).
* **(b) one file**, the raw disk speed. Writes: all chunks appended to one file, one `fsync` at
  the very end, so nothing is durable until the last byte is, and no chunk can be replaced or
  dropped alone. Reads: one sequential pass over that file. The issue states its goals (put ≥ 0.5,
  get ≥ 0.7) against "a plain sequential write/read of the same bytes"; (b) is the literal
  reading, (a) the one with the same durability per entry.
* **(a) + XXH3** (reads): (a) plus the XXH3-64 checksum that `get` checks on every read, i.e.
  what a plain reader pays to notice a corrupt chunk at all.

`put_many` writes a request's new chunks together: {batch} per batch of the first size (a
{batch_tokens:,}-token request in 256-token chunks), {big_batch} of the second (a {big_tokens:,}-token
request in 4,096-token entries); `prefetch` of the same batches before their `get`s is how a
cache load reads a prefix's chunks (a read-ahead hint: the disk works on a batch at once).
Entries written one at a time by `put`, and by 4 threads calling `put`, are shown too. Two
stores: `DirectoryStore` (a file per entry, format version {version}, {threads} I/O threads) and
`PackStore` (pack format version {pack_version}: each `put_many` batch appended to a pack of up
to 64 MiB with one fsync, or a new pack with a rename and a directory fsync; reads `pread` from
descriptors it keeps open; its `prefetch` does nothing, so it has no prefetched rows).
Writes are the median of {write_rounds} interleaved rounds, each case deleting what it wrote the
round before; reads the median of 9 interleaved rounds (3 with the cache dropped before each);
both after one warm-up round; pool operations the median of 5, so a slow spell of a shared
machine hits the tiers and their baselines alike.
"""


@dataclass
class Row:
    case: str
    size: int
    ops: int
    seconds: float
    vs: dict[str, float] = field(default_factory=dict)  # baseline column -> its seconds, same bytes

    @property
    def mbs(self) -> float:
        return self.size * self.ops / MiB / self.seconds

    def cells(self, columns: list[str]) -> list[str]:
        total = self.size * self.ops
        ratios = [f"{self.mbs / (total / MiB / self.vs[c]):.2f}" if c in self.vs else "" for c in columns]
        return [
            self.case,
            f"{self.size:,}",
            str(self.ops),
            f"{self.mbs:,.0f}",
            f"{self.ops / self.seconds:,.0f}",
            *ratios,
        ]


@dataclass
class PoolRow:
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


def interleaved(
    cases: dict[str, tuple[Callable[[], object], Callable[[], None] | None]], rounds: int
) -> dict[str, float]:
    """Median time of each case over ``rounds`` rounds that each run every case once, in turn, so
    a slow spell of a shared machine hits all cases alike; a case's ``before`` runs untimed first.
    Round 0 only warms up (first reads touch every file's metadata) and is not counted."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds + 1):
        for name, (fn, before) in cases.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_store(workdir: Path, size: int, n: int, batch: int, write_rounds: int = WRITE_ROUNDS) -> list[Row]:
    data = payloads(size, n)
    ks_put, ks_many, ks_threads, ks_pack_put, ks_pack = (
        keys(n, b"store-%s-%d" % (tag, size)) for tag in (b"put", b"many", b"threads", b"pput", b"pack")
    )
    root = workdir / f"store-{size}"
    one_file = workdir / f"one-file-{size}.bin"
    file_dir = workdir / f"file-per-chunk-{size}"
    file_dir.mkdir()
    chunk_files = [file_dir / f"{i:06d}.bin" for i in range(n)]
    store = DirectoryStore(root, capacity_bytes=1 << 40)
    pack_root = workdir / f"pack-store-{size}"
    pack = PackStore(pack_root, capacity_bytes=1 << 40)

    def forget(target: DirectoryStore | PackStore, ks: list[bytes]) -> Callable[[], None]:
        def clear() -> None:
            for key in ks:
                target.delete(key)

        return clear

    def clear_files() -> None:
        for path in chunk_files:
            path.unlink(missing_ok=True)

    def one_file_writes() -> None:
        fd = os.open(one_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for payload in data:
                _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)

    def file_per_chunk_writes() -> None:
        for path, payload in zip(chunk_files, data, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_path(file_dir)

    def puts(target: DirectoryStore | PackStore, ks: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for key, payload in zip(ks, data, strict=True):
                assert target.put(key, payload)

        return run

    def put_many(target: DirectoryStore | PackStore, ks: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for start in range(0, n, batch):
                items = list(zip(ks[start : start + batch], data[start : start + batch], strict=True))
                assert all(target.put_many(items))

        return run

    def threaded_puts(threads: int = 4) -> None:
        with ThreadPoolExecutor(threads) as pool:
            assert all(pool.map(lambda i: store.put(ks_threads[i], data[i]), range(n)))

    def one_file_reads() -> None:
        with open(one_file, "rb", buffering=0) as f:
            for _ in range(n):
                assert len(f.read(size)) == size

    def file_per_chunk_reads() -> None:
        for path in chunk_files:
            with open(path, "rb", buffering=0) as f:
                assert len(f.read(size)) == size

    def file_per_chunk_reads_crc() -> None:
        for path in chunk_files:
            with open(path, "rb", buffering=0) as f:
                xxhash.xxh3_64_intdigest(f.read(size))

    def gets(target: DirectoryStore | PackStore, ks: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for key in ks:
                assert target.get(key) is not None

        return run

    store_gets, pack_gets = gets(store, ks_many), gets(pack, ks_pack)

    def store_prefetched_gets() -> None:
        for start in range(0, n, batch):
            store.prefetch(ks_many[start : start + batch])
            for key in ks_many[start : start + batch]:
                assert store.get(key) is not None

    writes = interleaved(
        {
            "(b)": (one_file_writes, lambda: one_file.unlink(missing_ok=True)),
            "(a)": (file_per_chunk_writes, clear_files),
            "put": (puts(store, ks_put), forget(store, ks_put)),
            "many": (put_many(store, ks_many), forget(store, ks_many)),
            "threads": (threaded_puts, forget(store, ks_threads)),
            "pack put": (puts(pack, ks_pack_put), forget(pack, ks_pack_put)),
            "pack many": (put_many(pack, ks_pack), forget(pack, ks_pack)),
        },
        rounds=write_rounds,
    )
    store.close()
    os.sync()  # the deletes and writes of the rounds settle before the reads are timed
    wv = {"(a)": writes["(a)"], "(b)": writes["(b)"]}
    rows = [
        Row("write (b) one file, 1 fsync at the end", size, n, writes["(b)"], dict(wv)),
        Row("write (a) file per chunk, fsync each + 1 dir fsync", size, n, writes["(a)"], dict(wv)),
        Row("store put, one at a time", size, n, writes["put"], dict(wv)),
        Row(f"store put_many, {batch} per batch", size, n, writes["many"], dict(wv)),
        Row("store put, 4 threads", size, n, writes["threads"], dict(wv)),
        Row("pack store put, one at a time", size, n, writes["pack put"], dict(wv)),
        Row(f"pack store put_many, {batch} per batch", size, n, writes["pack many"], dict(wv)),
    ]
    read_set = [root / "entries" / k[:2] / k[2:4] / f"{k}.kv" for k in (key.hex() for key in ks_many)]
    warm = interleaved(
        {
            "(b)": (one_file_reads, None),
            "(a)": (file_per_chunk_reads, None),
            "(a)+crc": (file_per_chunk_reads_crc, None),
            "store": (store_gets, None),
            "store ahead": (store_prefetched_gets, None),
            "pack": (pack_gets, None),
        },
        rounds=9,
    )
    rv = {"(a)": warm["(a)"], "(b)": warm["(b)"]}
    rows += [
        Row("read (b) one file, page cache", size, n, warm["(b)"], dict(rv)),
        Row("read (a) file per chunk, page cache", size, n, warm["(a)"], dict(rv)),
        Row("read (a) + XXH3, page cache", size, n, warm["(a)+crc"], dict(rv)),
        Row("store get, page cache", size, n, warm["store"], dict(rv)),
        Row(f"store get, {batch} prefetched at a time, page cache", size, n, warm["store ahead"], dict(rv)),
        Row("pack store get, page cache", size, n, warm["pack"], dict(rv)),
    ]
    pack_files = sorted(pack_root.rglob("*.pack"))
    cold = interleaved(
        {
            "(b)": (one_file_reads, lambda: drop_page_cache([one_file])),
            "(a)": (file_per_chunk_reads, lambda: drop_page_cache(chunk_files)),
            "store": (store_gets, lambda: drop_page_cache(read_set)),
            "store ahead": (store_prefetched_gets, lambda: drop_page_cache(read_set)),
            "pack": (pack_gets, lambda: drop_page_cache(pack_files)),
        },
        rounds=3,
    )
    cv = {"(a)": cold["(a)"], "(b)": cold["(b)"]}
    rows += [
        Row("read (b) one file, cache dropped", size, n, cold["(b)"], dict(cv)),
        Row("read (a) file per chunk, cache dropped", size, n, cold["(a)"], dict(cv)),
        Row("store get, cache dropped", size, n, cold["store"], dict(cv)),
        Row(
            f"store get, {batch} prefetched at a time, cache dropped", size, n, cold["store ahead"], dict(cv)
        ),
        Row("pack store get, cache dropped", size, n, cold["pack"], dict(cv)),
    ]
    store.close()
    pack.close()
    shutil.rmtree(root)
    shutil.rmtree(pack_root)
    shutil.rmtree(file_dir)
    one_file.unlink()
    return rows


def bench_memory_pool(size: int, n: int, rounds: int) -> list[PoolRow]:
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
    t = interleaved({"pp": (pool_puts, None), "dp": (dict_puts, None)}, rounds=5)
    t |= interleaved({"pg": (pool_gets, None), "dg": (dict_gets, None)}, rounds=5)
    return [
        PoolRow("memory pool put", size, ops, t["pp"], "dict set", t["dp"]),
        PoolRow("memory pool get", size, ops, t["pg"], "dict get", t["dg"]),
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


def bench_redis_pool(url: str, size: int, n: int, rounds: int) -> list[PoolRow]:
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
    t = interleaved({"pp": (pool_puts, None), "rp": (raw_puts, None)}, rounds=5)
    t |= interleaved({"pg": (pool_gets, None), "rg": (raw_gets, None)}, rounds=5)
    rows = [
        PoolRow("redis pool put", size, ops, t["pp"], "raw SET EX", t["rp"]),
        PoolRow("redis pool get", size, ops, t["pg"], "raw GET", t["rg"]),
    ]
    raw.flushdb()
    pool.close()
    raw.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=128, help="bytes written per store case, MiB")
    parser.add_argument("--write", default="", help="also put the tables into this Markdown file")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="replaykv-bench-", dir=args.dir))
    store_rows: list[Row] = []
    pool_rows: list[PoolRow] = []
    try:
        fs = subprocess.run(["df", "-T", str(workdir)], capture_output=True, text=True).stdout.split("\n")[
            1:2
        ]
        for size in (CHUNK_BYTES, 16 * CHUNK_BYTES):
            store_rows += bench_store(workdir, size, max(4, args.mib * MiB // size), BATCH[size])
        for size, n in ((CHUNK_BYTES, 64), (SNAPSHOT_BYTES, 16)):
            pool_rows += bench_memory_pool(size, n, rounds=8)
        with redis_server(workdir) as url:
            if url is not None:
                for size, n in ((CHUNK_BYTES, 64), (SNAPSHOT_BYTES, 16)):
                    pool_rows += bench_redis_pool(url, size, n, rounds=4)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    fs_type = fs[0].split()[1] if fs and len(fs[0].split()) > 1 else "?"
    out: list[str] = [MARK_BEGIN]
    out.append(
        f"<!-- bench/bench_store.py on {platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, zlib {zlib.ZLIB_RUNTIME_VERSION}, "
        f"{fs_type} under {args.dir or tempfile.gettempdir()} -->"
    )
    out.append(
        BASELINES.format(
            batch=BATCH[CHUNK_BYTES],
            batch_tokens=BATCH[CHUNK_BYTES] * 256,
            big_batch=BATCH[16 * CHUNK_BYTES],
            big_tokens=BATCH[16 * CHUNK_BYTES] * 16 * 256,
            threads=DEFAULT_IO_THREADS,
            version=STORE_FORMAT_VERSION,
            pack_version=PACK_FORMAT_VERSION,
            write_rounds=WRITE_ROUNDS,
        )
    )
    columns = ["(a)", "(b)"]
    header = ["case", "bytes/op", "ops", "MiB/s", "ops/s", "vs (a)", "vs (b)"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for row in store_rows:
        out.append("| " + " | ".join(row.cells(columns)) + " |")
    out.append("")
    header = ["case", "bytes/op", "ops", "MiB/s", "ops/s", "baseline", "baseline MiB/s", "ratio"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for pool_row in pool_rows:
        out.append("| " + " | ".join(pool_row.cells()) + " |")
    if not any(r.case.startswith("redis") for r in pool_rows):
        out.append("\n(redis-server not found: Redis rows skipped)")
    out.append(MARK_END)
    section = "\n".join(out)
    print(section)
    if args.write:
        replace_section(args.write, section, MARK_BEGIN, MARK_END, "## Persistent store and SWA pool")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
