"""A file-format store that several processes write (``shared=True``): what one publishes the
others find, concurrent writers of one key, eviction and quarantine by one seen by the others
as misses, never as damage, and expiry that respects another process's recent access."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from replaykv.cache.file_store import DirectoryStore
from replaykv.cache.pack_store import PackStore
from replaykv.cache.stores import make_store
from tests.cache.conftest import FakeClock
from tests.cache.test_store import entry_path, k, payload_for

MiB = 1 << 20


def pair(root: Path, clock: FakeClock | None = None, **kw: object) -> tuple[DirectoryStore, DirectoryStore]:
    args: dict[str, object] = {"shared": True, **kw}
    if clock is not None:
        args["clock"] = clock
    return DirectoryStore(root, 64 * MiB, **args), DirectoryStore(root, 64 * MiB, **args)  # type: ignore[arg-type]


def test_what_one_process_publishes_the_other_finds(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    alone = DirectoryStore(tmp_path, 64 * MiB)  # opened before the write, not shared
    assert a.put_many([(k(i), payload_for(i)) for i in range(5)]) == [True] * 5
    assert not alone.contains(k(0)), "an unshared store trusts its own index"
    assert all(b.contains(k(i)) for i in range(3))
    assert [b.get(k(i)) for i in range(5)] == [payload_for(i) for i in range(5)]
    assert not b.contains(k(99)) and b.get(k(99)) is None
    stats = b.stats()
    assert stats["adopted"] == 5 and stats["entries"] == 5 and stats["hits"] == 5
    b.check_integrity()
    a.check_integrity()


def test_concurrent_writers_of_one_key_never_tear_it(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    reader = DirectoryStore(tmp_path, 64 * MiB, shared=True)
    value = payload_for(7, 200_000)
    assert a.put(k(7), value)  # published before the race: every read below must find it whole
    stop = threading.Event()
    seen: list[bytes | None] = []

    puts: list[bool] = []

    def write(store: DirectoryStore) -> None:
        while not stop.is_set():
            puts.append(store.put(k(7), value))

    def read() -> None:
        for _ in range(300):
            seen.append(reader.get(k(7)))
        stop.set()

    threads = [threading.Thread(target=write, args=(s,)) for s in (a, b)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert seen == [value] * 300  # each rename replaces the file whole: never absent, never torn
    assert puts and all(puts)
    assert reader.stats()["quarantined"] == 0
    assert a.get(k(7)) == b.get(k(7)) == value


_WRITER = """
import sys
from replaykv.cache.file_store import DirectoryStore
from tests.cache.test_store import k, payload_for
store = DirectoryStore(sys.argv[1], 1 << 30, shared=True)
first = int(sys.argv[2])
assert store.put_many([(k(i), payload_for(i)) for i in range(first, first + 20)]) == [True] * 20
print("published", flush=True)
"""


def test_entries_of_other_processes(tmp_path: Path) -> None:
    """Two writer processes publish into one directory; a third process's store serves all of it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for first in (0, 20):
        done = subprocess.run(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(first)], env=env, capture_output=True, timeout=120
        )
        assert done.returncode == 0 and b"published" in done.stdout, done.stderr.decode()[-2000:]
    store = DirectoryStore(tmp_path, 64 * MiB, shared=True)
    fresh = [store.get(k(i)) for i in range(40)]
    assert fresh == [payload_for(i) for i in range(40)]


def test_eviction_and_quarantine_by_one_are_misses_for_the_other(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    assert a.put_many([(k(i), payload_for(i)) for i in range(4)]) == [True] * 4
    assert all(b.contains(k(i)) for i in range(4))
    # a evicts k(0) (the oldest) to honour a lowered capacity; b's index still lists it
    a.capacity_bytes = a.stats()["bytes_resident"] - 1  # type: ignore[operator]
    assert a.gc().evicted == 1 and not entry_path(tmp_path, k(0)).exists()
    assert b.get(k(0)) is None and b.stats()["errors"] == {"read:vanished": 1}
    assert not b.contains(k(0))
    # damage k(1): whichever process reads it first quarantines it; the other one never serves it
    path = entry_path(tmp_path, k(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    assert a.get(k(1)) is None and a.stats()["quarantined"] == 1
    assert b.get(k(1)) is None and not b.contains(k(1))
    assert b.get(k(2)) == payload_for(2)
    a.check_integrity()
    b.check_integrity()


def test_expiry_respects_another_process_access(tmp_path: Path) -> None:
    clock = FakeClock(1_000_000.0)
    a, b = pair(tmp_path, clock, retention_s=100.0)
    assert a.put(k(1), payload_for(1)) and a.put(k(2), payload_for(2))
    assert b.get(k(1)) == payload_for(1)
    clock.advance(90)
    os.utime(entry_path(tmp_path, k(1)), (clock(), clock()))  # b's later access, as its reads refresh it
    clock.advance(20)  # a last saw both 110 s ago; on disk k(1) was used 20 s ago
    report = a.gc()
    assert report.expired == 1 and entry_path(tmp_path, k(1)).exists()
    assert not entry_path(tmp_path, k(2)).exists()
    assert a.get(k(1)) == payload_for(1)


def test_make_store_shared_needs_the_file_format(tmp_path: Path) -> None:
    shared = make_store(None, tmp_path / "new", 64 * MiB, shared=True)
    assert isinstance(shared, DirectoryStore) and shared.shared
    PackStore(tmp_path / "packs", 64 * MiB)
    with pytest.raises(ValueError, match="'file' format"):
        make_store(None, tmp_path / "packs", 64 * MiB, shared=True)
    with pytest.raises(ValueError, match="'file' format"):
        make_store("pack", tmp_path / "other", 64 * MiB, shared=True)
