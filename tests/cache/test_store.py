"""DirectoryStore: round trip, tenants, restart, corruption, write/read faults, capacity, retention, races."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

import replaykv.cache.file_store as file_store_mod
import replaykv.cache.store as store_mod
from replaykv.cache.file_store import DirectoryStore
from replaykv.cache.keys import chunk_keys, key_hex
from replaykv.cache.store import STORE_HEADER, EntryMeta, GlobalKVStore
from tests.cache.conftest import FakeClock, make_namespace

HDR = STORE_HEADER.size
MiB = 1 << 20


def k(i: int) -> bytes:
    return hashlib.sha256(b"store-test-%d" % i).digest()


def payload_for(i: int, size: int = 1000) -> bytes:
    seed = hashlib.sha256(b"payload-%d" % i).digest()
    return (seed * (size // 32 + 1))[:size]


def entry_path(root: Path, key: bytes) -> Path:
    h = key_hex(key)
    return root / "entries" / h[:2] / h[2:4] / f"{h}.kv"


def files_under(root: Path, suffix: str) -> list[Path]:
    return [p for p in (root / "entries").rglob("*") if p.is_file() and p.name.endswith(suffix)]


# ---------------------------------------------------------------- round trip and tenants
def test_round_trip_and_contract(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB)
    assert isinstance(store, GlobalKVStore)
    sizes = [0, 1, 4095, 256 * 890, 3 * MiB + 7]
    for i, size in enumerate(sizes):
        assert not store.contains(k(i))
        assert store.get(k(i)) is None
        data = payload_for(i, size)
        payload: bytes | bytearray | memoryview = (data, bytearray(data), memoryview(data))[i % 3]
        assert store.put(k(i), payload)
        assert store.contains(k(i))
        assert store.get(k(i)) == data
        store.check_integrity()
    assert store.put(k(0), b"replacement")
    assert store.get(k(0)) == b"replacement"
    assert store.delete(k(0)) and not store.delete(k(0))
    assert store.get(k(0)) is None and not entry_path(tmp_path, k(0)).exists()
    stats = store.stats()
    assert stats["hits"] == len(sizes) + 1
    assert stats["misses"] == len(sizes) + 1
    assert stats["bytes_written"] == sum(sizes) + len(b"replacement")
    assert stats["entries"] == len(sizes) - 1
    assert stats["bytes_resident"] == sum(s + HDR for s in sizes[1:])
    assert not files_under(tmp_path, ".tmp")
    store.check_integrity()
    with pytest.raises(ValueError, match="32-byte"):
        store.get(b"not a digest")


def test_paired_tenants(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB)
    tokens = list(range(5000, 5064))
    ns_a, ns_b = make_namespace("org_a"), make_namespace("org_b")
    for i, key in enumerate(chunk_keys(ns_a, tokens)):
        assert store.put(key, payload_for(i), EntryMeta.for_namespace(ns_a))
    # Same salt → a real hit on every chunk.
    hits = [store.get(key) for key in chunk_keys(make_namespace("org_a"), tokens)]
    assert hits == [payload_for(i) for i in range(4)]
    assert store.stats()["hits"] == 4
    # Different salt, same tokens → miss everywhere.
    keys_b = chunk_keys(ns_b, tokens)
    assert not any(store.contains(key) for key in keys_b)
    assert all(store.get(key) is None for key in keys_b)
    assert store.stats()["hits"] == 4 and store.stats()["misses"] == 4


def test_header_records_meta(tmp_path: Path) -> None:
    ns = make_namespace("hdr", kv_layout_version=7)
    store = DirectoryStore(tmp_path, MiB)
    key = chunk_keys(ns, list(range(16)))[0]
    assert store.put(key, b"abc", EntryMeta.for_namespace(ns))
    raw = entry_path(tmp_path, key).read_bytes()
    header = store_mod.EntryHeader.unpack(raw)
    assert isinstance(header, store_mod.EntryHeader)
    assert (header.kv_layout_version, header.namespace_digest, header.key) == (7, ns.seed(), key)
    assert header.payload_sha256 == hashlib.sha256(b"abc").digest() and raw[HDR:] == b"abc"


def test_restart_sees_entries_and_recency(tmp_path: Path, clock: FakeClock) -> None:
    store = DirectoryStore(tmp_path, 3 * (HDR + 1000), clock=clock)
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(1)
    assert store.get(k(0)) == payload_for(0)  # k(0) becomes the most recent
    clock.advance(1)
    reopened = DirectoryStore(tmp_path, 3 * (HDR + 1000), clock=clock)
    assert len(reopened) == 3 and reopened.indexed_keys() == [k(1), k(2), k(0)]
    for i in range(3):
        clock.advance(1)
        assert reopened.get(k(i)) == payload_for(i)
    reopened.check_integrity()
    third = DirectoryStore(tmp_path, 3 * (HDR + 1000), clock=clock)
    assert third.indexed_keys() == [k(0), k(1), k(2)]  # reads above refreshed the order, persisted in mtimes
    assert third.put(k(9), payload_for(9))
    assert not third.contains(k(0)) and third.stats()["evictions"] == 1
    third.check_integrity()


# ---------------------------------------------------------------- corruption
def _flip_payload(raw: bytearray) -> None:
    raw[HDR + 17] ^= 0x01


def _flip_header(raw: bytearray) -> None:
    raw[40] ^= 0x80  # inside the namespace digest: only the header CRC notices


def _truncate(raw: bytearray) -> None:
    del raw[-100:]


def _truncate_into_header(raw: bytearray) -> None:
    del raw[HDR // 2 :]


def _zero_fill(raw: bytearray) -> None:
    raw[:] = bytes(len(raw))


def _zero_fill_payload_tail(raw: bytearray) -> None:
    raw[-512:] = bytes(512)


def _wrong_version(raw: bytearray) -> None:
    raw[8:10] = struct.pack("<H", store_mod.STORE_FORMAT_VERSION + 1)
    raw[HDR - 4 : HDR] = struct.pack("<I", zlib.crc32(bytes(raw[: HDR - 4])))


def _old_version(raw: bytearray) -> None:
    """Rewrite the entry as format version 1 would have: 132-byte header, no payload CRC-32."""
    payload = bytes(raw[HDR:])
    head = bytearray(raw[:128])
    head[8:10] = struct.pack("<H", 1)
    head[96:128] = hashlib.sha256(payload).digest()
    raw[:] = head + struct.pack("<I", zlib.crc32(bytes(head))) + payload


def _appended(raw: bytearray) -> None:
    raw += b"junk"


CORRUPTIONS: dict[str, tuple[Callable[[bytearray], None], str]] = {
    "bit_flip_payload": (_flip_payload, "bad_digest"),
    "bit_flip_header": (_flip_header, "bad_header_crc"),
    "truncated": (_truncate, "truncated"),
    "truncated_header": (_truncate_into_header, "truncated"),
    "zero_filled": (_zero_fill, "bad_magic"),
    "zero_filled_tail": (_zero_fill_payload_tail, "bad_digest"),
    "wrong_version": (_wrong_version, "wrong_version"),
    "old_version_1": (_old_version, "wrong_version"),
    "appended": (_appended, "size_mismatch"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corruption_is_a_miss_and_quarantined(tmp_path: Path, name: str) -> None:
    damage, reason = CORRUPTIONS[name]
    store = DirectoryStore(tmp_path, 64 * MiB)
    assert store.put(k(1), payload_for(1, 4096))
    assert store.put(k(2), payload_for(2, 4096))
    path = entry_path(tmp_path, k(1))
    raw = bytearray(path.read_bytes())
    damage(raw)
    path.write_bytes(bytes(raw))
    if name == "truncated_header":  # too short to be an entry: caught by the start-up scan already
        store = DirectoryStore(tmp_path, 64 * MiB)
    assert store.get(k(1)) is None
    assert store.get(k(1)) is None  # and never served later
    assert not path.exists()
    quarantined = list((tmp_path / "quarantine").iterdir())
    assert len(quarantined) == 1 and f".{reason}." in quarantined[0].name
    assert store.stats()["quarantined"] == 1
    assert store.stats()["quarantine_reasons"] == {reason: 1}
    assert store.get(k(2)) == payload_for(2, 4096)  # the neighbour is unaffected
    store.check_integrity()
    reopened = DirectoryStore(tmp_path, 64 * MiB)
    assert reopened.get(k(1)) is None and reopened.get(k(2)) == payload_for(2, 4096)


def test_file_under_the_wrong_name_is_quarantined(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, MiB)
    assert store.put(k(1), b"one")
    target = entry_path(tmp_path, k(2))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(entry_path(tmp_path, k(1)).read_bytes())  # a valid file for k(1) posing as k(2)
    reopened = DirectoryStore(tmp_path, MiB)
    assert reopened.get(k(2)) is None
    assert reopened.stats()["quarantine_reasons"] == {"wrong_key": 1}
    assert reopened.get(k(1)) == b"one"


def test_verify_reports_and_quarantines(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, MiB)
    for i in range(4):
        assert store.put(k(i), payload_for(i))
    path = entry_path(tmp_path, k(3))
    raw = bytearray(path.read_bytes())
    _flip_payload(raw)
    path.write_bytes(bytes(raw))
    report = DirectoryStore(tmp_path, MiB, read_only=True).verify()
    assert (report.checked, report.ok, report.quarantined) == (4, 3, 0)
    assert report.bad == [(path.name, "bad_digest")] and path.exists()
    report = store.verify(quarantine=True)
    assert report.quarantined == 1 and not path.exists() and not store.contains(k(3))
    assert store.verify().bad == []
    store.check_integrity()


# ---------------------------------------------------------------- write and read faults
def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def inject(
    monkeypatch: pytest.MonkeyPatch,
    root: Path,
    func: str,
    err: int,
    when: Callable[[str], bool] = lambda path: True,
    module: object = os,
) -> list[str]:
    """Make ``module.func`` raise ``OSError(err)`` for targets under ``root``; returns the hit paths."""
    real = getattr(module, func)
    prefix = os.path.realpath(root)
    hits: list[str] = []

    def fake(*args: object, **kwargs: object) -> object:
        target = args[0]
        path = _fd_path(target) if isinstance(target, int) else os.path.realpath(os.fspath(target))  # type: ignore[arg-type]
        if path.startswith(prefix) and when(path):
            hits.append(path)
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, func, fake)
    return hits


FAULTS = {
    "write_ENOSPC": ("write", errno.ENOSPC, lambda p: True, "write:ENOSPC"),
    "write_EIO": ("write", errno.EIO, lambda p: True, "write:EIO"),
    "fsync_EIO": ("fsync", errno.EIO, lambda p: not os.path.isdir(p), "fsync:EIO"),
    "rename_EIO": ("rename", errno.EIO, lambda p: True, "rename:EIO"),
    "fsync_dir_EIO": ("fsync", errno.EIO, os.path.isdir, "fsync_dir:EIO"),
    "open_ENOSPC": ("open", errno.ENOSPC, lambda p: p.endswith(".tmp"), "write:ENOSPC"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_write_faults_publish_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    func, err, when, label = FAULTS[fault]
    store = DirectoryStore(tmp_path, 64 * MiB)
    assert store.put(k(0), payload_for(0))  # warms the fan-out dirs of k(0) only
    with monkeypatch.context() as m:
        hits = inject(m, tmp_path, func, err, when)
        assert store.put(k(1), payload_for(1, 100_000)) is False  # no exception
        assert store.put(k(0), payload_for(0, 7)) is False  # a failed replace drops nothing silently
        assert hits
    assert store.get(k(1)) is None and not store.contains(k(1))
    assert not entry_path(tmp_path, k(1)).exists()
    assert not files_under(tmp_path, ".tmp")
    errors = store.stats()["errors"]
    assert isinstance(errors, dict) and label in errors and sum(errors.values()) == 2
    assert all(kind.endswith(":" + errno.errorcode[err]) for kind in errors)  # e.g. mkdir:EIO for a new dir
    assert store.stats()["puts_failed"] == 2
    # The old k(0) is served unless the failure hit after its rename (then it is gone, never torn).
    assert store.get(k(0)) in (payload_for(0), None)
    store.check_integrity()
    reopened = DirectoryStore(tmp_path, 64 * MiB)
    assert reopened.get(k(1)) is None
    assert store.put(k(1), payload_for(1)) and store.get(k(1)) == payload_for(1)  # recovers


def half_a_write_then_enospc() -> Callable[[int, bytes], int]:
    """An ``os.write`` whose first write to a temp file writes half, and every later one fails
    with ENOSPC (a disk filling up mid-entry)."""
    real_write = os.write
    calls = {"n": 0}

    def write(fd: int, data: bytes) -> int:
        if _fd_path(fd).endswith(".tmp"):
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, memoryview(data)[: len(data) // 2])
        return real_write(fd, data)

    return write


def test_partial_write_then_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB)
    monkeypatch.setattr(os, "write", half_a_write_then_enospc())
    assert store.put(k(5), payload_for(5, 50_000)) is False
    monkeypatch.undo()
    assert store.get(k(5)) is None and not files_under(tmp_path, ".tmp")
    assert store.stats()["errors"] == {"write:ENOSPC": 1}


def test_raise_on_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path, MiB)
    inject(monkeypatch, tmp_path, "fsync", errno.EIO)
    with pytest.raises(OSError) as info:
        store.put(k(1), b"x", raise_on_error=True)
    assert info.value.errno == errno.EIO
    assert not store.contains(k(1))


def test_read_error_is_a_miss_not_a_quarantine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path, MiB)
    assert store.put(k(1), b"data")
    with monkeypatch.context() as m:
        inject(m, tmp_path, "open", errno.EIO)  # the read path opens with os.open
        assert store.get(k(1)) is None
    assert store.stats()["errors"] == {"read:EIO": 1} and store.stats()["quarantined"] == 0
    assert store.get(k(1)) == b"data"


def test_read_only_store_writes_nothing(tmp_path: Path) -> None:
    DirectoryStore(tmp_path, MiB).put(k(1), b"data")
    ro = DirectoryStore(tmp_path, MiB, read_only=True)
    assert ro.get(k(1)) == b"data"
    assert ro.put(k(2), b"x") is False and not ro.delete(k(1))
    assert ro.stats()["errors"] == {"read_only": 1}
    with pytest.raises(FileNotFoundError):
        DirectoryStore(tmp_path / "nope", MiB, read_only=True)


# ---------------------------------------------------------------- start-up scan
def test_startup_sweeps_orphans_and_quarantines_stubs(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, MiB)
    assert store.put(k(1), b"one")
    d = entry_path(tmp_path, k(1)).parent
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    (d / f".{key_hex(k(2))}.{dead_pid}.abcdef.tmp").write_bytes(b"partial")
    (d / f".{key_hex(k(3))}.garbage.tmp").write_bytes(b"partial")
    live = d / f".{key_hex(k(4))}.{os.getpid()}.abcdef.tmp"
    live.write_bytes(b"in flight in this process")
    stub = entry_path(tmp_path, k(5))
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_bytes(b"short")
    (d / "README").write_text("not an entry")
    reopened = DirectoryStore(tmp_path, MiB)
    assert reopened.orphans_swept == 2 and live.exists()
    assert reopened.unknown_files == 1
    assert reopened.stats()["quarantine_reasons"] == {"truncated": 1} and not stub.exists()
    assert reopened.indexed_keys() == [k(1)]
    assert DirectoryStore(tmp_path, MiB, orphan_grace_s=0).orphans_swept == 1 and not live.exists()


# ---------------------------------------------------------------- capacity and retention
def test_capacity_evicts_oldest_access_first(tmp_path: Path, clock: FakeClock) -> None:
    entry = HDR + 1000
    store = DirectoryStore(tmp_path, 3 * entry, clock=clock)
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(1)
    assert store.get(k(0)) == payload_for(0)
    clock.advance(1)
    assert store.put(k(3), payload_for(3))  # evicts k(1), the least recently accessed
    assert [store.contains(k(i)) for i in range(4)] == [True, False, True, True]
    assert not entry_path(tmp_path, k(1)).exists()
    assert store.put(k(4), payload_for(4, 2000))  # needs two slots: k(2), k(0) go
    assert [store.contains(k(i)) for i in range(5)] == [False, False, False, True, True]
    stats = store.stats()
    assert stats["evictions"] == 3 and stats["bytes_resident"] == 2 * entry + 1000 <= 3 * entry
    assert store.put(k(9), payload_for(9, 3 * entry)) is False  # larger than the whole store
    assert store.stats()["errors"] == {"too_large": 1}
    store.check_integrity()


def test_retention_expiry_and_gc(tmp_path: Path, clock: FakeClock) -> None:
    store = DirectoryStore(tmp_path, MiB, retention_s=72 * 3600, clock=clock)
    assert store.put(k(1), b"old") and store.put(k(2), b"kept")
    clock.advance(71 * 3600)
    assert store.get(k(2)) == b"kept"  # a read refreshes the retention
    clock.advance(2 * 3600)
    assert not store.contains(k(1))
    assert store.get(k(1)) is None
    assert store.stats()["expirations"] == 1 and not entry_path(tmp_path, k(1)).exists()
    assert store.put(k(3), b"new")
    clock.advance(72 * 3600 + 1)
    report = store.gc()
    assert report.expired == 2 and len(store) == 0 and not files_under(tmp_path, ".kv")
    store.check_integrity()


def test_gc_applies_lowered_capacity_after_restart(tmp_path: Path, clock: FakeClock) -> None:
    store = DirectoryStore(tmp_path, MiB, clock=clock)
    for i in range(5):
        assert store.put(k(i), payload_for(i))
        clock.advance(1)
    small = DirectoryStore(tmp_path, 2 * (HDR + 1000), clock=clock)
    small.check_integrity()  # over capacity at open is allowed until gc
    report = small.gc()
    assert report.evicted == 3 and small.indexed_keys() == [k(3), k(4)]
    small.check_integrity()


# ---------------------------------------------------------------- concurrency
def test_concurrent_puts_gets_deletes(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, 12 * (HDR + 4096))
    keys = [k(i) for i in range(24)]
    expected = {key: payload_for(i, 4096) for i, key in enumerate(keys)}
    wrong: list[bytes] = []
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                key = rng.choice(keys)
                op = rng.random()
                if op < 0.45:
                    store.put(key, expected[key])
                elif op < 0.9:
                    got = store.get(key)
                    if got is not None and got != expected[key]:
                        wrong.append(key)
                else:
                    store.delete(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    store.check_integrity()
    assert store.stats()["hits"] > 0 and store.stats()["evictions"] > 0
    assert not files_under(tmp_path, ".tmp")
    on_disk = {p.name for p in files_under(tmp_path, ".kv")}
    assert on_disk == {f"{key_hex(key)}.kv" for key in store.indexed_keys()}


# ---------------------------------------------------------------- put_many (group commit)
def _batch(ids: list[int], size: int = 3000) -> list[tuple[bytes, bytes]]:
    return [(k(i), payload_for(i, size)) for i in ids]


def test_put_many_round_trip(tmp_path: Path, clock: FakeClock) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB, clock=clock)
    assert store.put(k(0), b"old version")
    items: list[tuple[bytes, bytes | bytearray | memoryview]] = [
        (k(i), payload_for(i, 5000)) for i in range(8)
    ]
    items[3] = (k(3), bytearray(payload_for(3, 5000)))
    items[4] = (k(4), memoryview(payload_for(4, 5000)))
    assert store.put_many(items, EntryMeta(kv_layout_version=3)) == [True] * 8
    assert all(store.get(k(i)) == payload_for(i, 5000) for i in range(8))  # k(0) replaced
    assert store.stats()["puts"] == 9 and store.stats()["bytes_written"] == 8 * 5000 + len(b"old version")
    assert not files_under(tmp_path, ".tmp")
    store.check_integrity()
    assert store.put_many([]) == []
    reopened = DirectoryStore(tmp_path, 64 * MiB, clock=clock)
    assert sorted(reopened.indexed_keys()) == sorted(k(i) for i in range(8))
    assert reopened.verify().ok == 8
    header = store_mod.EntryHeader.unpack(entry_path(tmp_path, k(5)).read_bytes())
    assert isinstance(header, store_mod.EntryHeader) and header.kv_layout_version == 3
    store.close()
    store.close()  # idempotent; the store stays usable and restarts its threads
    assert store.put_many(_batch([20, 21])) == [True, True]


def test_put_many_rejects_bad_batches(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, MiB)
    with pytest.raises(ValueError, match="more than once"):
        store.put_many([(k(1), b"a"), (k(2), b"b"), (k(1), b"c")])
    with pytest.raises(ValueError, match="32-byte"):
        store.put_many([(k(1), b"a"), (b"short", b"b")])
    assert len(store) == 0 and not files_under(tmp_path, "")
    assert DirectoryStore(tmp_path, MiB, read_only=True).put_many(_batch([1, 2])) == [False, False]


def test_put_many_group_commit_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every temp file is fsynced before any rename; every directory is fsynced once, after them."""
    store = DirectoryStore(tmp_path, 64 * MiB)
    assert store.put(k(0), b"warm")  # k(0)'s directories are known durable from now on
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        with lock:
            events.append(("fsync_dir" if os.path.isdir(path) else "fsync", path))
        real_fsync(fd)

    def rename(src: str, dst: str) -> None:
        with lock:
            events.append(("rename", os.fspath(src)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    ids = list(range(12))
    assert store.put_many(_batch(ids)) == [True] * len(ids)
    kinds = [kind for kind, _ in events]
    assert kinds.count("fsync") == kinds.count("rename") == len(ids)
    last = {kind: max(i for i, x in enumerate(kinds) if x == kind) for kind in set(kinds)}
    first = {kind: min(i for i, x in enumerate(kinds) if x == kind) for kind in set(kinds)}
    assert last["fsync"] < first["rename"] and last["rename"] < first["fsync_dir"]
    synced = [path for kind, path in events if kind == "fsync_dir"]
    assert len(synced) == len(set(synced))  # each directory once
    leaves = {os.path.realpath(entry_path(tmp_path, k(i)).parent) for i in ids}
    assert leaves <= set(synced)  # every entry's name is durable
    assert os.path.realpath(tmp_path / "entries") in synced  # new top-level fan-out dirs
    # A second batch into the same (now known) directories fsyncs only those directories.
    events.clear()
    assert store.put_many(_batch(ids, 100)) == [True] * len(ids)
    assert {path for kind, path in events if kind == "fsync_dir"} == leaves


@pytest.mark.parametrize("stage", ["fsync", "fsync_dir", "rename", "write"])
def test_put_many_failure_halfway_publishes_only_durable_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB)
    old = [(k(i), payload_for(i, 700)) for i in range(10)]
    assert store.put_many(old) == [True] * 10  # warm every directory; k(2), k(5) get replaced below
    doomed = {key_hex(k(2)), key_hex(k(5))}
    ids = list(range(10))
    if stage == "fsync_dir":  # the directories of the doomed entries; k(2), k(5) share none with others
        dirs = {os.path.realpath(entry_path(tmp_path, k(i)).parent) for i in (2, 5)}
        assert all(
            os.path.realpath(entry_path(tmp_path, k(i)).parent) not in dirs for i in ids if i not in (2, 5)
        )
        when: Callable[[str], bool] = lambda p: p in dirs  # noqa: E731
    else:
        when = lambda p: any(h in p for h in doomed)  # noqa: E731
    func = {"fsync": "fsync", "fsync_dir": "fsync", "rename": "rename", "write": "write"}[stage]
    with monkeypatch.context() as m:
        hits = inject(m, tmp_path, func, errno.EIO, when)
        results = store.put_many(_batch(ids, 4000))
    assert hits
    assert results == [i not in (2, 5) for i in ids]
    errors = store.stats()["errors"]
    assert errors == {f"{stage}:EIO": 2}
    for i in ids:
        got = store.get(k(i))
        if i in (2, 5):  # never the new (non-durable) bytes; the old version only if not yet replaced
            assert got in ((None, payload_for(i, 700)) if stage in ("fsync", "write", "rename") else (None,))
        else:
            assert got == payload_for(i, 4000)
    assert not files_under(tmp_path, ".tmp")
    store.check_integrity()
    reopened = DirectoryStore(tmp_path, 64 * MiB)
    assert all(reopened.get(k(i)) == payload_for(i, 4000) for i in ids if i not in (2, 5))
    assert reopened.verify().bad == []


def test_put_many_raise_on_error_settles_the_batch_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB)
    bad = key_hex(k(1))
    inject(monkeypatch, tmp_path, "fsync", errno.EIO, lambda p: bad in p)
    with pytest.raises(OSError) as info:
        store.put_many(_batch([0, 1, 2]), raise_on_error=True)
    assert info.value.errno == errno.EIO
    assert store.contains(k(0)) and not store.contains(k(1)) and store.contains(k(2))
    assert store.stats()["puts_failed"] == 1 and not files_under(tmp_path, ".tmp")


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_put_many_write_faults_publish_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    func, err, when, label = FAULTS[fault]
    store = DirectoryStore(tmp_path, 64 * MiB)
    assert store.put(k(0), payload_for(0))
    with monkeypatch.context() as m:
        inject(m, tmp_path, func, err, when)
        assert (
            store.put_many([(k(1), payload_for(1, 100_000)), (k(0), payload_for(0, 7)), (k(3), b"x")])
            == [False] * 3
        )
    assert not store.contains(k(1)) and not store.contains(k(3)) and not files_under(tmp_path, ".tmp")
    errors = store.stats()["errors"]
    assert isinstance(errors, dict) and label in errors and sum(errors.values()) == 3
    assert store.get(k(0)) in (payload_for(0), None)
    store.check_integrity()
    assert store.put_many(_batch([1, 3])) == [True, True]


def test_put_many_capacity(tmp_path: Path, clock: FakeClock) -> None:
    entry = HDR + 1000
    store = DirectoryStore(tmp_path, 3 * entry, clock=clock)
    assert store.put(k(9), payload_for(9))
    clock.advance(1)
    # Room for three: k(9) is evicted for the batch, entries of the batch never evict each other.
    assert store.put_many(_batch([0, 1, 2, 3], 1000)) == [True, True, True, False]
    assert store.put_many(_batch([4], 4 * entry)) == [False]
    assert store.stats()["errors"] == {"capacity:ENOSPC": 1, "too_large": 1}
    assert sorted(store.indexed_keys()) == sorted([k(0), k(1), k(2)]) and store.stats()["evictions"] == 1
    store.check_integrity()


def test_read_path_checks_the_crc_and_verify_the_sha256(tmp_path: Path) -> None:
    """A payload whose CRC-32 still matches but whose SHA-256 does not is served by get (the fast
    check) and reported by verify (the thorough one); any other payload change fails the CRC."""
    store = DirectoryStore(tmp_path, MiB)
    assert store.put(k(1), payload_for(1))
    path = entry_path(tmp_path, k(1))
    raw = bytearray(path.read_bytes())
    raw[96:128] = bytes(32)  # a wrong SHA-256, header CRC recomputed
    raw[HDR - 4 : HDR] = struct.pack("<I", zlib.crc32(bytes(raw[: HDR - 4])))
    path.write_bytes(bytes(raw))
    assert store.get(k(1)) == payload_for(1)
    assert store.verify().bad == [(path.name, "bad_digest")]


def test_default_put_many_of_the_contract() -> None:
    class DictStore(GlobalKVStore):
        def __init__(self) -> None:
            self.data: dict[bytes, bytes] = {}

        def get(self, key: bytes) -> bytes | None:
            return self.data.get(key)

        def put(
            self, key: bytes, payload: bytes | bytearray | memoryview, meta: EntryMeta | None = None
        ) -> bool:
            if len(payload) > 3:
                return False
            self.data[key] = bytes(payload)
            return True

        def contains(self, key: bytes) -> bool:
            return key in self.data

        def delete(self, key: bytes) -> bool:
            return self.data.pop(key, None) is not None

        def stats(self) -> dict[str, object]:
            return {}

        def check_integrity(self) -> None:
            pass

    store = DictStore()
    assert store.put_many([(k(1), b"abc"), (k(2), b"toolong"), (k(3), b"")]) == [True, False, True]
    assert store.get(k(1)) == b"abc" and not store.contains(k(2))
    store.prefetch([k(1), k(2)])  # a hint: the default does nothing
    assert store.get(k(1)) == b"abc"


@pytest.mark.parametrize("hint", [True, False], ids=["fadvise", "no-fadvise"])
def test_prefetch_is_only_a_hint(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, hint: bool
) -> None:
    if not hint:
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    store = DirectoryStore(tmp_path, 8 * (5000 + HDR), clock=clock)
    for i in range(8):
        assert store.put(k(i), payload_for(i, 5000))
        clock.advance(1)
    before = store.stats()
    store.prefetch([k(0), k(99), k(3), k(0)])  # missing and repeated keys too
    assert store.stats() == before  # no hit, miss or read counted
    # Recency unchanged: the next put evicts the oldest entry, 0, though it was prefetched last.
    assert store.put(k(8), payload_for(8, 5000))
    assert not store.contains(k(0)) and store.contains(k(1))
    assert store.get(k(3)) == payload_for(3, 5000)
    with pytest.raises(ValueError):
        store.prefetch([k(3), b"short"])
    store.check_integrity()


_BATCH_WRITER = r"""
import hashlib, os, sys, time
from replaykv.cache.file_store import DirectoryStore
from tests.cache.test_store_crash import _expected, _key

root, start, stall = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "stall"
if stall:  # hang in the batch's directory fsyncs: every entry renamed, none acknowledged
    real_fsync = os.fsync
    def slow_fsync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            print("in-dir-fsync", flush=True)
            time.sleep(60)
        return real_fsync(fd)
store = DirectoryStore(root, 1 << 40, io_threads=4)
if stall:
    os.fsync = slow_fsync
print("ready", flush=True)
i = start
while True:
    done = store.put_many([(_key(j), _expected(j)) for j in range(i, i + 6)])
    print("stored", *[j for j, ok in zip(range(i, i + 6), done) if ok], flush=True)
    i += 6
"""


def _run_batch_writer(root: Path, start: int, stored: int, stall: bool) -> list[int]:
    """Kill the batch writer in its stalled directory fsync, or after ``stored`` acknowledged
    entries (the writer prints them once each batch returns); returns those entries."""
    from tests.cache.test_store_crash import kill_writer

    args = [str(root), str(start), "stall" if stall else "go"]
    return kill_writer(_BATCH_WRITER, args, stored, b"in-dir-fsync" if stall else None)


def test_put_many_sigkill_leaves_complete_entries_or_orphans(tmp_path: Path) -> None:
    from tests.cache.test_store_crash import _check_fresh_store

    _run_batch_writer(tmp_path, 0, 0, stall=True)  # killed between the renames and the dir fsyncs
    store = _check_fresh_store(tmp_path, 100)
    assert len(store) == 6  # all renamed, none acknowledged: complete (data fsynced before the rename)
    rng = random.Random(20260518)
    acked: set[int] = set(range(6))
    for r in range(3):
        acked.update(_run_batch_writer(tmp_path, start=r * 30, stored=rng.randint(1, 18), stall=False))
        store = _check_fresh_store(tmp_path, 100_000, tuple(sorted(acked)))
    assert len(store) >= len(acked) > 6


def test_reads_survive_short_preads_and_huge_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirectoryStore(tmp_path, 64 * MiB)
    data = payload_for(1, 300_000)
    assert store.put(k(1), data) and store.put(k(2), payload_for(2, 5000))
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: real_pread(fd, min(n, 4096), off))
    assert store.get(k(1)) == data
    monkeypatch.setattr(file_store_mod, "_PAYLOAD_FIRST_MAX", 1000)  # header first, then the payload
    assert store.get(k(1)) == data
    path = entry_path(tmp_path, k(2))
    raw = bytearray(path.read_bytes())
    _flip_payload(raw)
    path.write_bytes(bytes(raw))
    assert store.get(k(2)) is None and store.stats()["quarantine_reasons"] == {"bad_digest": 1}
    assert store.verify().bad == []


def test_an_entry_replaced_by_another_writer_with_another_size_is_read_not_quarantined(
    tmp_path: Path,
) -> None:
    writer = DirectoryStore(tmp_path, 64 * MiB)
    assert writer.put(k(1), payload_for(1, 1000))
    reader = DirectoryStore(tmp_path, 64 * MiB)  # its index records the 1,000-byte entry
    for size in (3000, 10):  # larger, then smaller than the reader's index says
        assert writer.put(k(1), payload_for(size, size))
        assert reader.get(k(1)) == payload_for(size, size)
    assert reader.metrics.quarantined.value == 0 and not files_under(tmp_path / "quarantine", ".kv")
