"""PackStore: round trip, one pack per batch, tenants, restart, corruption, write/read faults,
capacity, retention, compaction, tombstones, read descriptors, races and SIGKILL crashes."""

from __future__ import annotations

import errno
import os
import random
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import replaykv.cache.pack_store as pack_mod
from replaykv.cache.keys import chunk_keys, key_hex
from replaykv.cache.pack_store import (
    PACK_BATCH,
    PACK_RECORD,
    PACK_TABLE_ROW,
    PACK_TAIL,
    PackRecord,
    PackStore,
)
from replaykv.cache.store import EntryMeta, GlobalKVStore
from tests.cache.conftest import FakeClock, make_namespace
from tests.cache.test_store import FAULTS, _fd_path, half_a_write_then_enospc, inject, k, payload_for
from tests.cache.test_store_crash import kill_writer

REC = PACK_RECORD.size
ROW = PACK_TABLE_ROW.size
TAIL = PACK_TAIL.size
MiB = 1 << 20


def one_batch_packs(root: Path, capacity: int, **kwargs: Any) -> PackStore:
    """A store that starts a new pack for every batch (``pack_bytes=0``), so that a test can
    point at the pack of a batch; the appending default has tests of its own below."""
    return PackStore(root, capacity, pack_bytes=0, **kwargs)


def pack_size(*payloads: int) -> int:
    """Bytes of a pack holding records of these payload sizes."""
    return pack_mod.batch_overhead(len(payloads)) + sum(REC + n for n in payloads)


def packs(root: Path, suffix: str = ".pack") -> list[Path]:
    base = root / "packs"
    return (
        sorted(p for p in base.rglob("*") if p.is_file() and p.name.endswith(suffix)) if base.is_dir() else []
    )


def record_of(store: PackStore, key: bytes) -> tuple[Path, int]:
    where = store.pack_of(key)
    assert where is not None
    return Path(where[0]), where[1]


def damage(path: Path, fn: Callable[[bytearray], None]) -> None:
    raw = bytearray(path.read_bytes())
    fn(raw)
    path.write_bytes(bytes(raw))


# ---------------------------------------------------------------- round trip and layout
def test_round_trip_and_contract(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert isinstance(store, GlobalKVStore) and isinstance(store, PackStore)
    sizes = [0, 1, 4095, 256 * 890, 3 * MiB + 7]
    for i, size in enumerate(sizes):
        assert not store.contains(k(i)) and store.get(k(i)) is None
        data = payload_for(i, size)
        payload: bytes | bytearray | memoryview = (data, bytearray(data), memoryview(data))[i % 3]
        assert store.put(k(i), payload)
        assert store.contains(k(i)) and store.get(k(i)) == data
        store.check_integrity()
    assert len(packs(tmp_path)) == len(sizes)  # a put is a pack of one
    assert store.put(k(0), b"replacement") and store.get(k(0)) == b"replacement"
    assert len(packs(tmp_path)) == len(sizes)  # the replaced pack held only k(0): unlinked
    assert store.delete(k(0)) and not store.delete(k(0))
    assert store.get(k(0)) is None
    stats = store.stats()
    assert stats["hits"] == len(sizes) + 1 and stats["misses"] == len(sizes) + 1
    assert stats["bytes_written"] == sum(sizes) + len(b"replacement")
    assert stats["entries"] == len(sizes) - 1 and stats["packs"] == len(sizes) - 1
    assert stats["bytes_resident"] == sum(pack_size(s) for s in sizes[1:]) and stats["dead_bytes"] == 0
    assert not packs(tmp_path, ".tmp")
    store.check_integrity()
    with pytest.raises(ValueError, match="32-byte"):
        store.get(b"not a digest")


def test_a_batch_is_one_pack_with_its_table(tmp_path: Path, clock: FakeClock) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    items = [(k(i), payload_for(i, 5000 + i)) for i in range(16)]
    assert store.put_many(items, EntryMeta(kv_layout_version=3)) == [True] * 16
    (path,) = packs(tmp_path)
    assert path.stat().st_size == pack_size(*(5000 + i for i in range(16)))
    with open(path, "rb") as f:
        parsed = pack_mod.read_pack_table(f.fileno(), path.stat().st_size)
    assert not isinstance(parsed, str)
    created, rows = parsed.created_at, parsed.rows
    assert created == clock.now and [r[0] for r in rows] == [key for key, _ in items]
    assert parsed.end == path.stat().st_size and parsed.overhead == pack_mod.batch_overhead(16)
    raw = path.read_bytes()
    for (key, offset, length, digest), (_, data) in zip(rows, items, strict=True):
        rec = PackRecord.unpack(raw[offset : offset + REC])
        assert isinstance(rec, PackRecord)
        assert (rec.key, rec.payload_len, rec.kv_layout_version) == (key, length, 3)
        assert rec.payload_xxh3 == digest == pack_mod._digest(data)
        assert raw[offset + REC : offset + REC + length] == data
    assert all(store.get(key) == data for key, data in items)
    reopened = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    assert sorted(reopened.indexed_keys()) == sorted(key for key, _ in items)
    assert reopened.verify().ok == 16
    assert store.put_many([]) == []


def test_put_many_rejects_bad_batches(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, MiB)
    with pytest.raises(ValueError, match="more than once"):
        store.put_many([(k(1), b"a"), (k(2), b"b"), (k(1), b"c")])
    with pytest.raises(ValueError, match="32-byte"):
        store.put_many([(k(1), b"a"), (b"short", b"b")])
    assert len(store) == 0 and not packs(tmp_path, "")
    assert one_batch_packs(tmp_path, MiB, read_only=True).put_many([(k(1), b"a")]) == [False]


def test_paired_tenants(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB)
    tokens = list(range(5000, 5064))
    ns_a, ns_b = make_namespace("org_a"), make_namespace("org_b")
    keys_a = chunk_keys(ns_a, tokens)
    assert store.put_many(
        [(key, payload_for(i)) for i, key in enumerate(keys_a)], EntryMeta.for_namespace(ns_a)
    )
    hits = [store.get(key) for key in chunk_keys(make_namespace("org_a"), tokens)]
    assert hits == [payload_for(i) for i in range(len(keys_a))] and store.stats()["hits"] == len(keys_a)
    keys_b = chunk_keys(ns_b, tokens)
    assert not any(store.contains(key) for key in keys_b) and all(store.get(key) is None for key in keys_b)
    assert store.stats()["hits"] == len(keys_a)


def test_header_records_meta(tmp_path: Path) -> None:
    ns = make_namespace("hdr", kv_layout_version=7)
    store = one_batch_packs(tmp_path, MiB)
    key = chunk_keys(ns, list(range(16)))[0]
    assert store.put(key, b"abc", EntryMeta.for_namespace(ns))
    path, offset = record_of(store, key)
    raw = path.read_bytes()
    rec = PackRecord.unpack(raw[offset:])
    assert isinstance(rec, PackRecord)
    assert (rec.kv_layout_version, rec.namespace_digest, rec.key) == (7, ns.seed(), key)
    assert rec.payload_xxh3 == pack_mod._digest(b"abc") and raw[offset + REC : offset + REC + 3] == b"abc"


def test_restart_sees_entries_and_recency(tmp_path: Path, clock: FakeClock) -> None:
    cap = 3 * pack_size(1000)
    store = one_batch_packs(tmp_path, cap, clock=clock)
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(61)
    assert store.get(k(0)) == payload_for(0)  # k(0)'s pack becomes the most recent
    clock.advance(61)
    reopened = one_batch_packs(tmp_path, cap, clock=clock)
    assert len(reopened) == 3 and reopened.indexed_keys() == [k(1), k(2), k(0)]
    for i in range(3):
        clock.advance(61)
        assert reopened.get(k(i)) == payload_for(i)
    reopened.check_integrity()
    third = one_batch_packs(tmp_path, cap, clock=clock)
    assert third.indexed_keys() == [k(0), k(1), k(2)]  # the reads refreshed the packs' mtimes
    assert third.put(k(9), payload_for(9))
    assert not third.contains(k(0)) and third.stats()["evictions"] == 1
    third.check_integrity()


# ---------------------------------------------------------------- corruption
def _at(offset: int, fn: Callable[[bytearray, int], None]) -> Callable[[bytearray], None]:
    return lambda raw: fn(raw, offset)


def _flip_payload(raw: bytearray, at: int) -> None:
    raw[at + REC + 17] ^= 0x01


def _flip_header(raw: bytearray, at: int) -> None:
    raw[at + 40] ^= 0x80  # inside the namespace digest: only the header CRC notices


def _zero_record(raw: bytearray, at: int) -> None:
    raw[at : at + REC + 4096] = bytes(REC + 4096)


def _zero_payload_tail(raw: bytearray, at: int) -> None:
    raw[at + REC + 4096 - 512 : at + REC + 4096] = bytes(512)


def _wrong_version(raw: bytearray, at: int) -> None:
    raw[at + 8 : at + 10] = struct.pack("<H", pack_mod.PACK_FORMAT_VERSION + 1)
    raw[at + REC - 4 : at + REC] = struct.pack("<I", zlib.crc32(bytes(raw[at : at + REC - 4])))


def _other_key(raw: bytearray, at: int) -> None:
    raw[at + 64 : at + 96] = k(77)
    raw[at + REC - 4 : at + REC] = struct.pack("<I", zlib.crc32(bytes(raw[at : at + REC - 4])))


PAYLOAD_DAMAGE: dict[str, Callable[[bytearray, int], None]] = {
    "bit_flip_payload": _flip_payload,
    "zero_filled_record": _zero_record,
    "zero_filled_tail": _zero_payload_tail,
}


def _other_digest(raw: bytearray, at: int) -> None:
    raw[at + 96 : at + 104] = bytes(8)
    raw[at + REC - 4 : at + REC] = struct.pack("<I", zlib.crc32(bytes(raw[at : at + REC - 4])))


HEADER_DAMAGE: dict[str, tuple[Callable[[bytearray, int], None], str]] = {
    "header_digest_differs_from_table": (_other_digest, "header_mismatch"),
    "bit_flip_header": (_flip_header, "bad_header_crc"),
    "wrong_version": (_wrong_version, "wrong_version"),
    "wrong_key": (_other_key, "wrong_key"),
}


@pytest.mark.parametrize("name", sorted(PAYLOAD_DAMAGE))
def test_a_bad_payload_is_a_miss_quarantined_and_its_neighbours_served(tmp_path: Path, name: str) -> None:
    fn, reason = PAYLOAD_DAMAGE[name], "bad_digest"
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert store.put_many([(k(i), payload_for(i, 4096)) for i in range(3)]) == [True] * 3
    path, offset = record_of(store, k(1))
    damage(path, _at(offset, fn))
    assert store.get(k(1)) is None and store.get(k(1)) is None  # and never served later
    (quarantined,) = list((tmp_path / "quarantine").iterdir())
    assert quarantined.name.startswith(key_hex(k(1))) and f".{reason}." in quarantined.name
    assert quarantined.stat().st_size == REC + 4096  # the record's bytes, kept for inspection
    assert store.stats()["quarantined"] == 1 and store.stats()["quarantine_reasons"] == {reason: 1}
    assert store.get(k(0)) == payload_for(0, 4096) and store.get(k(2)) == payload_for(2, 4096)
    store.check_integrity()
    reopened = one_batch_packs(tmp_path, 64 * MiB)  # the tombstone keeps it out after a restart
    assert not reopened.contains(k(1)) and reopened.get(k(2)) == payload_for(2, 4096)
    assert reopened.verify().bad == []


@pytest.mark.parametrize("name", sorted(HEADER_DAMAGE))
def test_a_bad_record_header_is_found_by_verify(tmp_path: Path, name: str) -> None:
    """A read needs only the payload and the table's digest, so an intact payload behind a
    damaged header is still served exactly; verify reports the header and quarantines it."""
    fn, reason = HEADER_DAMAGE[name]
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert store.put_many([(k(i), payload_for(i, 4096)) for i in range(3)]) == [True] * 3
    path, offset = record_of(store, k(1))
    damage(path, _at(offset, fn))
    assert store.get(k(1)) == payload_for(1, 4096)
    report = store.verify(quarantine=True)
    assert report.bad == [(f"{path.name}:{key_hex(k(1))}", reason)] and report.quarantined == 1
    assert not store.contains(k(1)) and store.get(k(2)) == payload_for(2, 4096)
    assert store.stats()["quarantine_reasons"] == {reason: 1}
    store.check_integrity()


def _cut_tail(raw: bytearray) -> None:
    del raw[-10:]


def _cut_into_records(raw: bytearray) -> None:
    del raw[len(raw) // 2 :]


def _flip_table(raw: bytearray) -> None:
    raw[-TAIL - ROW + 3] ^= 0x01


def _zero_pack(raw: bytearray) -> None:
    raw[:] = bytes(len(raw))


PACK_DAMAGE: dict[str, tuple[Callable[[bytearray], None], str]] = {
    "truncated_tail": (_cut_tail, "truncated"),
    "truncated_records": (_cut_into_records, "truncated"),
    "table_bit_flip": (_flip_table, "bad_table"),
    "zero_filled": (_zero_pack, "bad_batch"),
}


@pytest.mark.parametrize("name", sorted(PACK_DAMAGE))
def test_a_pack_without_a_trusted_table_is_quarantined_whole(tmp_path: Path, name: str) -> None:
    fn, reason = PACK_DAMAGE[name]
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert store.put_many([(k(i), payload_for(i, 4096)) for i in range(3)]) == [True] * 3
    assert store.put(k(9), payload_for(9))
    path, _ = record_of(store, k(0))
    damage(path, fn)
    reopened = one_batch_packs(tmp_path, 64 * MiB)
    assert not any(reopened.contains(k(i)) for i in range(3)) and reopened.get(k(9)) == payload_for(9)
    assert reopened.stats()["quarantine_reasons"] == {reason: 1} and not path.exists()
    (quarantined,) = list((tmp_path / "quarantine").iterdir())
    assert quarantined.name.endswith(".pack")
    reopened.check_integrity()


def test_verify_quarantines_a_pack_whose_table_broke_under_a_live_store(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert store.put_many([(k(i), payload_for(i, 4096)) for i in range(3)]) == [True] * 3
    assert store.put(k(9), payload_for(9))
    path, _ = record_of(store, k(0))
    assert store.get(k(0)) == payload_for(0, 4096)  # its descriptor is open
    damage(path, _flip_table)
    report = store.verify(quarantine=True)
    assert report.bad == [(path.name, "bad_table")] and report.quarantined == 1
    assert not any(store.contains(k(i)) for i in range(3)) and store.get(k(9)) == payload_for(9)
    assert not path.exists() and store.stats()["quarantine_reasons"] == {"bad_table": 1}
    (quarantined,) = list((tmp_path / "quarantine").iterdir())
    assert ".bad_table." in quarantined.name and quarantined.name.endswith(".pack")
    assert store.stats()["packs"] == 1 and store.stats()["open_packs"] <= 1
    store.check_integrity()
    assert store.put(k(0), payload_for(0)) and store.get(k(0)) == payload_for(0)


def test_damage_under_a_live_store_is_caught_by_the_read(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert store.put_many([(k(i), payload_for(i, 4096)) for i in range(2)]) == [True, True]
    path, offset = record_of(store, k(1))
    with open(path, "r+b") as f:  # the file shrinks under the open store: the read notices
        f.truncate(offset + REC + 100)
    assert store.get(k(1)) is None and store.stats()["quarantine_reasons"] == {"truncated": 1}
    assert store.get(k(0)) == payload_for(0, 4096)


def test_verify_reports_and_quarantines(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, MiB)
    assert store.put_many([(k(i), payload_for(i)) for i in range(4)]) == [True] * 4
    path, offset = record_of(store, k(3))
    damage(path, _at(offset, _flip_payload))
    report = one_batch_packs(tmp_path, MiB, read_only=True).verify()
    assert (report.checked, report.ok, report.quarantined) == (4, 3, 0)
    assert report.bad == [(f"{path.name}:{key_hex(k(3))}", "bad_digest")]
    report = store.verify(quarantine=True)
    assert report.quarantined == 1 and not store.contains(k(3))
    assert store.verify().bad == [] and store.verify().ok == 3
    store.check_integrity()


# ---------------------------------------------------------------- write and read faults


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_write_faults_publish_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    func, err, when, label = FAULTS[fault]
    store = one_batch_packs(tmp_path, 64 * MiB)
    assert store.put(k(0), payload_for(0))
    before = packs(tmp_path)
    with monkeypatch.context() as m:
        hits = inject(m, tmp_path, func, err, when)
        batch = [(k(1), payload_for(1, 100_000)), (k(0), payload_for(0, 7)), (k(3), b"x")]
        assert store.put_many(batch) == [False] * 3  # no exception; the batch is one file
        assert store.put(k(4), b"y") is False
        assert hits
    assert not any(store.contains(k(i)) for i in (1, 3, 4))
    if err == errno.ENOSPC:  # a full disk evicts the least recently used pack and retries once
        assert not store.contains(k(0)) and packs(tmp_path) == [] and store.stats()["evictions"] == 1
    else:
        assert store.get(k(0)) == payload_for(0) and packs(tmp_path) == before
    assert not packs(tmp_path, ".tmp")
    errors = store.stats()["errors"]
    assert errors == {label: 4}
    assert store.stats()["puts_failed"] == 4
    store.check_integrity()
    assert one_batch_packs(tmp_path, 64 * MiB).get(k(1)) is None
    assert store.put_many([(k(1), payload_for(1)), (k(3), b"x")]) == [True, True]  # recovers
    assert store.get(k(1)) == payload_for(1)


def test_partial_write_then_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB)
    monkeypatch.setattr(os, "write", half_a_write_then_enospc())
    assert store.put_many([(k(5), payload_for(5, 50_000)), (k(6), b"z")]) == [False, False]
    monkeypatch.undo()
    assert store.get(k(5)) is None and not packs(tmp_path, "")
    assert store.stats()["errors"] == {"write:ENOSPC": 2}


def test_raise_on_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = one_batch_packs(tmp_path, MiB)
    with monkeypatch.context() as m:
        inject(m, tmp_path, "fsync", errno.EIO)
        with pytest.raises(OSError) as info:
            store.put(k(1), b"x", raise_on_error=True)
    assert info.value.errno == errno.EIO and not store.contains(k(1))
    assert store.stats()["puts_failed"] == 1


def test_read_error_is_a_miss_not_a_quarantine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one_batch_packs(tmp_path, MiB).put(k(1), b"data")
    store = one_batch_packs(tmp_path, MiB)  # no descriptor open yet: the first read opens the pack
    with monkeypatch.context() as m:
        inject(m, tmp_path, "open", errno.EIO)
        assert store.get(k(1)) is None
    assert store.stats()["errors"] == {"read:EIO": 1} and store.stats()["quarantined"] == 0
    assert store.get(k(1)) == b"data"
    with monkeypatch.context() as m:  # an I/O error on the open descriptor: a miss too
        inject(m, tmp_path, "pread", errno.EIO)
        assert store.get(k(1)) is None
    assert store.stats()["errors"] == {"read:EIO": 2} and store.get(k(1)) == b"data"


def test_a_pack_removed_under_the_store_is_a_miss(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, MiB)
    assert store.put(k(1), b"one") and store.put(k(2), b"two")
    path, _ = record_of(store, k(1))
    path.unlink()
    assert store.get(k(1)) is None and store.stats()["errors"] == {"read:vanished": 1}
    assert not store.contains(k(1)) and store.get(k(2)) == b"two"


def test_read_only_store_writes_nothing(tmp_path: Path) -> None:
    one_batch_packs(tmp_path, MiB).put(k(1), b"data")
    ro = one_batch_packs(tmp_path, MiB, read_only=True)
    assert ro.get(k(1)) == b"data"
    assert ro.put(k(2), b"x") is False and not ro.delete(k(1))
    assert ro.stats()["errors"] == {"read_only": 1} and not packs(tmp_path, ".dead")
    with pytest.raises(FileNotFoundError):
        one_batch_packs(tmp_path / "nope", MiB, read_only=True)


def test_reads_survive_short_preads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB)
    data = payload_for(1, 300_000)
    assert store.put_many([(k(1), data), (k(2), payload_for(2, 5000))]) == [True, True]
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: real_pread(fd, min(n, 4096), off))
    assert store.get(k(1)) == data and store.get(k(2)) == payload_for(2, 5000)
    assert one_batch_packs(tmp_path, 64 * MiB).verify().ok == 2


# ---------------------------------------------------------------- start-up scan
def test_startup_sweeps_orphans_and_counts_unknown_files(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, MiB)
    assert store.put(k(1), b"one")
    d = record_of(store, k(1))[0].parent
    dead_pid = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )
    (d / f".{'a' * 32}.{dead_pid}.abcdef.tmp").write_bytes(b"partial")
    (d / f".{'b' * 32}.garbage.tmp").write_bytes(b"partial")
    live = d / f".{'c' * 32}.{os.getpid()}.abcdef.tmp"
    live.write_bytes(b"in flight in this process")
    (d / "README").write_text("not a pack")
    reopened = one_batch_packs(tmp_path, MiB)
    assert reopened.orphans_swept == 2 and live.exists() and reopened.unknown_files == 1
    assert reopened.indexed_keys() == [k(1)]
    assert one_batch_packs(tmp_path, MiB, orphan_grace_s=0).orphans_swept == 1 and not live.exists()


def test_tombstones_and_replacements_survive_restarts(tmp_path: Path, clock: FakeClock) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    assert store.put_many([(k(i), payload_for(i)) for i in range(4)]) == [True] * 4
    (first,) = packs(tmp_path)
    assert store.delete(k(0))
    clock.advance(1)
    assert store.put(k(1), b"newer")  # the first pack's k(1) is now dead
    assert len(packs(tmp_path, ".dead")) == 1
    reopened = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    assert not reopened.contains(k(0)) and reopened.get(k(1)) == b"newer"
    assert sorted(reopened.indexed_keys()) == sorted([k(1), k(2), k(3)])
    # Without the tombstones (lost in a crash) the newer pack still wins k(1); k(0) comes back
    # as the complete entry it was.
    for p in packs(tmp_path, ".dead"):
        p.unlink()
    lost = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    assert lost.get(k(1)) == b"newer" and lost.get(k(0)) == payload_for(0)
    lost.check_integrity()
    # Every entry of a pack dropped: the pack goes, with its tombstones.
    for i in range(4):
        lost.delete(k(i))
    assert first not in packs(tmp_path) and not packs(tmp_path, ".dead") and len(packs(tmp_path)) == 0


# ---------------------------------------------------------------- capacity, retention, compaction
def test_capacity_evicts_the_oldest_accessed_pack_first(tmp_path: Path, clock: FakeClock) -> None:
    one = pack_size(1000)
    store = one_batch_packs(tmp_path, 3 * one, clock=clock)
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(1)
    assert store.get(k(0)) == payload_for(0)
    clock.advance(1)
    assert store.put(k(3), payload_for(3))  # evicts k(1)'s pack, the least recently accessed
    assert [store.contains(k(i)) for i in range(4)] == [True, False, True, True]
    assert store.put(k(4), payload_for(4, 2 * one - pack_size(0)))  # needs two packs: k(2), k(0) go
    assert [store.contains(k(i)) for i in range(5)] == [False, False, False, True, True]
    assert store.stats()["evictions"] == 3 and store.stats()["bytes_resident"] <= 3 * one
    assert store.put(k(9), payload_for(9, 3 * one)) is False
    assert store.stats()["errors"] == {"too_large": 1}
    store.check_integrity()


def test_eviction_takes_a_pack_whole(tmp_path: Path, clock: FakeClock) -> None:
    batch = pack_size(*[1000] * 4)
    store = one_batch_packs(tmp_path, batch + pack_size(1000), clock=clock)
    assert store.put_many([(k(i), payload_for(i)) for i in range(4)]) == [True] * 4
    clock.advance(1)
    assert store.put(k(8), payload_for(8))
    clock.advance(1)
    assert store.get(k(3)) == payload_for(3)  # one entry of the batch read recently ...
    clock.advance(1)
    assert store.put(k(9), payload_for(9))  # ... the oldest access is k(0): its pack goes whole
    assert not any(store.contains(k(i)) for i in range(4)) and store.contains(k(8))
    assert store.stats()["evictions"] == 4
    store.check_integrity()


def test_put_many_fits_what_the_capacity_allows(tmp_path: Path, clock: FakeClock) -> None:
    store = one_batch_packs(tmp_path, pack_size(1000, 1000, 1000), clock=clock)
    assert store.put(k(9), payload_for(9))
    clock.advance(1)
    results = store.put_many([(k(i), payload_for(i)) for i in range(4)])
    assert results == [True, True, True, False]  # k(9) evicted for the batch; no room for a fourth
    assert store.put_many([(k(4), payload_for(4, 4 * 1000 + 4 * REC))]) == [False]
    assert store.stats()["errors"] == {"capacity:ENOSPC": 1, "too_large": 1}
    assert sorted(store.indexed_keys()) == sorted([k(0), k(1), k(2)]) and store.stats()["evictions"] == 1
    store.check_integrity()


def test_retention_expiry_and_gc(tmp_path: Path, clock: FakeClock) -> None:
    store = one_batch_packs(tmp_path, MiB, retention_s=72 * 3600, clock=clock)
    assert store.put_many([(k(1), b"old"), (k(2), b"kept")]) == [True, True]
    clock.advance(71 * 3600)
    assert store.get(k(2)) == b"kept"  # a read refreshes the retention of that entry
    clock.advance(2 * 3600)
    assert not store.contains(k(1)) and store.get(k(1)) is None
    assert store.stats()["expirations"] == 1 and store.contains(k(2))
    assert store.put(k(3), b"new")
    clock.advance(72 * 3600 + 1)
    report = store.gc()
    assert report.expired == 2 and len(store) == 0 and not packs(tmp_path)
    store.check_integrity()


def test_gc_applies_lowered_capacity_after_restart(tmp_path: Path, clock: FakeClock) -> None:
    store = one_batch_packs(tmp_path, MiB, clock=clock)
    for i in range(5):
        assert store.put(k(i), payload_for(i))
        clock.advance(61)
    small = one_batch_packs(tmp_path, 2 * pack_size(1000), clock=clock)
    small.check_integrity()  # over capacity at open is allowed until gc
    report = small.gc()
    assert report.evicted == 3 and small.indexed_keys() == [k(3), k(4)]
    small.check_integrity()


def test_gc_compacts_packs_that_are_mostly_dead(tmp_path: Path, clock: FakeClock) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    assert store.put_many([(k(i), payload_for(i, 4000)) for i in range(8)]) == [True] * 8
    assert store.put_many([(k(i), payload_for(i, 4000)) for i in range(10, 14)]) == [True] * 4
    for i in range(6):
        assert store.delete(k(i))
    assert store.delete(k(10))  # the second pack stays more than half live
    before = store.stats()
    assert before["dead_bytes"] > 0 and before["packs"] == 2
    clock.advance(5)
    report = store.gc()
    after = store.stats()
    assert report.bytes_freed == before["bytes_resident"] - after["bytes_resident"] > 0
    assert after["packs"] == 2 and all(store.get(k(i)) == payload_for(i, 4000) for i in (6, 7, 11, 12, 13))
    assert store.stats()["bytes_resident"] == pack_size(4000, 4000) + pack_size(4000, 4000, 4000, 4000)
    store.check_integrity()
    reopened = one_batch_packs(tmp_path, 64 * MiB, clock=clock)
    assert sorted(reopened.indexed_keys()) == sorted(k(i) for i in (6, 7, 11, 12, 13))
    assert reopened.verify().bad == []


# ---------------------------------------------------------------- batches appended to a pack
def test_batches_are_appended_to_a_pack_until_it_is_full(tmp_path: Path, clock: FakeClock) -> None:
    batch = pack_size(5000, 5000, 5000, 5000)
    store = PackStore(tmp_path, 64 * MiB, clock=clock, pack_bytes=3 * batch)
    assert store.pack_bytes == 3 * batch and PackStore(tmp_path / "d", 1 << 40).pack_bytes == 64 << 20
    keys = [k(i) for i in range(20)]
    for b in range(5):
        clock.advance(1)
        assert (
            store.put_many([(key, payload_for(i, 5000)) for i, key in enumerate(keys) if i // 4 == b])
            == [True] * 4
        )
        store.check_integrity()
    files = packs(tmp_path)
    assert sorted(p.stat().st_size for p in files) == [2 * batch, 3 * batch]  # 3 batches, then 2
    assert store.stats()["packs"] == 2 and store.stats()["bytes_resident"] == 5 * batch
    assert all(store.get(key) == payload_for(i, 5000) for i, key in enumerate(keys))
    reopened = PackStore(tmp_path, 64 * MiB, clock=clock, pack_bytes=3 * batch)
    assert sorted(reopened.indexed_keys()) == sorted(keys) and reopened.verify().ok == 20
    assert reopened.put(k(99), b"new pack after a restart") and len(packs(tmp_path)) == 3
    # A key written again in a later batch of the same pack: the later record wins, also after
    # a restart without the tombstone.
    assert store.put(k(0), b"again")
    for p in packs(tmp_path, ".dead"):
        p.unlink()
    assert PackStore(tmp_path, 64 * MiB, clock=clock).get(k(0)) == b"again"


def test_rewriting_the_only_key_of_the_pack_being_appended_keeps_the_pack(tmp_path: Path, clock: FakeClock) -> None:
    """A batch replaces the only key of the pack it is appended to: dropping the old version
    empties the pack for a moment, which must not remove the pack the new version goes into."""
    store = PackStore(tmp_path, 64 * MiB, clock=clock)
    assert store.put(k(0), payload_for(0, 300))
    clock.advance(1)
    assert store.put(k(0), payload_for(1, 300))
    store.check_integrity()
    assert len(packs(tmp_path)) == 1 and store.stats()["packs"] == 1
    assert store.get(k(0)) == payload_for(1, 300)
    reopened = PackStore(tmp_path, 64 * MiB, clock=clock)
    assert reopened.get(k(0)) == payload_for(1, 300)
    reopened.check_integrity()


def test_a_batch_cut_short_by_a_crash_stays_dead_bytes(tmp_path: Path, clock: FakeClock) -> None:
    batch = pack_size(5000, 5000)
    store = PackStore(tmp_path, 64 * MiB, clock=clock, pack_bytes=4 * batch)
    for b in range(2):
        assert store.put_many(
            [(k(2 * b), payload_for(2 * b, 5000)), (k(2 * b + 1), payload_for(2 * b + 1, 5000))]
        )
    (path,) = packs(tmp_path)
    with open(path, "ab") as f:  # a third batch whose writer died half way: its head, some records
        f.write(pack_mod._batch_head(2, batch) + payload_for(9, 3000))
    reopened = PackStore(tmp_path, 64 * MiB, clock=clock, pack_bytes=4 * batch)
    assert sorted(reopened.indexed_keys()) == sorted(k(i) for i in range(4))
    assert all(reopened.get(k(i)) == payload_for(i, 5000) for i in range(4))
    stats = reopened.stats()
    assert stats["bytes_resident"] == path.stat().st_size == 2 * batch + PACK_BATCH.size + 3000
    assert (
        stats["dead_bytes"] == PACK_BATCH.size + 3000
    )  # the cut batch; heads, tables and tails are not dead
    assert reopened.put(k(5), b"x") and len(packs(tmp_path)) == 2  # the cut pack takes no more batches
    assert reopened.verify().bad == [] and reopened.stats()["quarantined"] == 0
    reopened.check_integrity()


@pytest.mark.parametrize(
    "fault", ["write_EIO", "fsync_EIO"]
)  # ENOSPC evicts and retries: test_pack_enospc.py
def test_an_append_that_fails_publishes_nothing_and_cuts_the_pack_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    func, err, when, label = FAULTS[fault]
    store = PackStore(tmp_path, 64 * MiB, pack_bytes=1 << 20)
    assert store.put_many([(k(0), payload_for(0)), (k(1), payload_for(1))]) == [True, True]
    (path,) = packs(tmp_path)
    size = path.stat().st_size
    with monkeypatch.context() as m:
        inject(m, tmp_path, func, err, when)
        assert store.put_many([(k(2), payload_for(2)), (k(0), b"replacement")]) == [False, False]
    assert path.stat().st_size == size and store.stats()["errors"] == {label: 2}
    assert (
        store.get(k(0)) == payload_for(0) and store.get(k(1)) == payload_for(1) and not store.contains(k(2))
    )
    store.check_integrity()
    assert store.put(k(2), payload_for(2)) and len(packs(tmp_path)) == 2  # a new pack after a failed append
    reopened = PackStore(tmp_path, 64 * MiB)
    assert sorted(reopened.indexed_keys()) == sorted([k(0), k(1), k(2)]) and reopened.verify().bad == []


def test_an_append_that_cannot_be_cut_back_leaves_dead_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PackStore(tmp_path, 64 * MiB, pack_bytes=1 << 20)
    assert store.put_many([(k(0), payload_for(0)), (k(1), payload_for(1))]) == [True, True]
    (path,) = packs(tmp_path)
    size = path.stat().st_size
    with monkeypatch.context() as m:
        inject(m, tmp_path, "fsync", errno.EIO, lambda p: not os.path.isdir(p))
        inject(m, tmp_path, "ftruncate", errno.EIO)
        assert store.put_many([(k(2), payload_for(2))]) == [False]
    grown = path.stat().st_size - size
    assert grown == pack_size(1000) and store.stats()["bytes_resident"] == path.stat().st_size
    assert store.stats()["dead_bytes"] == grown and not store.contains(k(2))
    store.check_integrity()
    assert store.put(k(3), b"y") and len(packs(tmp_path)) == 2  # that pack takes no more batches
    reopened = PackStore(tmp_path, 64 * MiB)
    # The batch reached the page cache whole, so the scan finds it complete: k(2) is back, a
    # complete entry whose bytes verify (never acknowledged, never wrong).
    assert reopened.get(k(2)) == payload_for(2) and reopened.verify().bad == []


# ---------------------------------------------------------------- descriptors and prefetch
def test_read_descriptors_are_bounded_and_closed(tmp_path: Path) -> None:
    store = one_batch_packs(tmp_path, 64 * MiB, open_packs=2)
    for i in range(6):
        assert store.put(k(i), payload_for(i))
    for _ in range(2):
        for i in range(6):
            assert store.get(k(i)) == payload_for(i)
            store.check_integrity()
    assert store.stats()["open_packs"] == 2
    fds = {os.readlink(f"/proc/self/fd/{fd}") for fd in map(int, os.listdir("/proc/self/fd")) if _fd_path(fd)}
    assert sum(p.endswith(".pack") and str(tmp_path) in p for p in fds) == 2
    store.delete(k(5))  # an open pack removed: its descriptor goes too
    store.close()
    assert store.stats()["open_packs"] == 0 and store.get(k(4)) == payload_for(4)


@pytest.mark.parametrize("hint", [True, False], ids=["fadvise", "no-fadvise"])
def test_prefetch_is_only_a_hint(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, hint: bool
) -> None:
    if not hint:
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    store = one_batch_packs(tmp_path, 8 * pack_size(5000), clock=clock)
    for i in range(8):
        assert store.put(k(i), payload_for(i, 5000))
        clock.advance(1)
    before = store.stats()
    store.prefetch([k(0), k(99), k(3), k(0)])
    after = store.stats()
    assert {n: v for n, v in after.items() if n != "open_packs"} == {
        n: v for n, v in before.items() if n != "open_packs"
    }
    assert store.put(k(8), payload_for(8, 5000))  # recency unchanged: the oldest, 0, is evicted
    assert not store.contains(k(0)) and store.contains(k(1)) and store.get(k(3)) == payload_for(3, 5000)
    with pytest.raises(ValueError):
        store.prefetch([k(3), b"short"])
    store.check_integrity()


# ---------------------------------------------------------------- concurrency
def test_concurrent_puts_gets_deletes_and_gc(tmp_path: Path) -> None:
    # Batches of two appended to packs of up to three: appends, whole-pack evictions, tombstones
    # and compaction all race.
    store = PackStore(tmp_path, 8 * pack_size(4096, 4096), open_packs=4, pack_bytes=3 * pack_size(4096, 4096))
    keys = [k(i) for i in range(24)]
    expected = {key: payload_for(i, 4096) for i, key in enumerate(keys)}
    wrong: list[bytes] = []
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                op = rng.random()
                if op < 0.35:
                    pair = rng.sample(keys, 2)
                    store.put_many([(key, expected[key]) for key in pair])
                elif op < 0.85:
                    key = rng.choice(keys)
                    got = store.get(key)
                    if got is not None and got != expected[key]:
                        wrong.append(key)
                elif op < 0.97:
                    store.delete(rng.choice(keys))
                else:
                    store.gc()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    store.check_integrity()
    assert store.stats()["hits"] > 0 and store.stats()["evictions"] > 0 and not packs(tmp_path, ".tmp")
    reopened = PackStore(tmp_path, 8 * pack_size(4096, 4096))
    assert sorted(reopened.indexed_keys()) == sorted(store.indexed_keys())
    assert all(reopened.get(key) == expected[key] for key in reopened.indexed_keys())


# ---------------------------------------------------------------- SIGKILL
_WRITER = r"""
import os, sys, time
from replaykv.cache.pack_store import PackStore
from tests.cache.test_store_crash import _expected, _key

root, start, stall = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = PackStore(root, 1 << 40)
real_fsync = os.fsync
def slow_fsync(fd):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if (stall == "data" and path.endswith(".tmp")) or (stall == "dir" and os.path.isdir(path)):
        print("stalled", flush=True)
        time.sleep(60)
    return real_fsync(fd)
real_write = os.write
writes = {"n": 0}
def slow_write(fd, data):  # an append to a published pack stops after its third write
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".pack"):
        writes["n"] += 1
        if writes["n"] > 3:
            print("stalled", flush=True)
            time.sleep(60)
    return real_write(fd, data)
if stall in ("data", "dir"):
    os.fsync = slow_fsync
if stall == "append":
    os.write = slow_write
print("ready", flush=True)
i = start
while True:
    ok = store.put_many([(_key(j), _expected(j)) for j in range(i, i + 6)])
    if i % 18 == 0:
        for j in range(i, i + 3):
            store.delete(_key(j))
    kept = [j for j, done in zip(range(i, i + 6), ok) if done and not (i % 18 == 0 and j < i + 3)]
    if stall == "go":
        print("stored", *kept, flush=True)
    i += 6
"""


def _run_and_kill(root: Path, start: int, stored: int, stall: str) -> list[int]:
    return kill_writer(_WRITER, [str(root), str(start), stall], stored, None if stall == "go" else b"stalled")


def _check_fresh(root: Path) -> PackStore:
    from tests.cache.test_store_crash import _expected, _key

    temps = packs(root, ".tmp")
    store = PackStore(root, 1 << 40)
    assert store.orphans_swept == len(temps) and not packs(root, ".tmp")
    by_key = {_key(i): i for i in range(100_000)}
    for key in store.indexed_keys():
        assert store.get(key) == _expected(by_key[key])  # complete and exact, never partial
    assert store.stats()["quarantined"] == 0 and store.verify().bad == []
    store.check_integrity()
    return store


def test_sigkill_mid_publish_leaves_complete_packs_or_orphans(tmp_path: Path) -> None:
    from tests.cache.test_store_crash import _expected, _key

    _run_and_kill(tmp_path, 0, 0, stall="data")  # killed inside the first pack's fsync
    assert len(packs(tmp_path, ".tmp")) == 1
    assert len(_check_fresh(tmp_path)) == 0
    _run_and_kill(tmp_path, 0, 0, stall="dir")  # renamed, not acknowledged: complete all the same
    assert len(_check_fresh(tmp_path)) == 6
    # A new writer starts a new pack (it appends to none it did not write) and is killed half way
    # through appending its second batch to it: its first batch is served, the cut one is dead
    # bytes, found by the scan.
    _run_and_kill(tmp_path, 60, 0, stall="append")
    store = _check_fresh(tmp_path)
    assert len(store) == 12 and store.cut_batches == 1 and store.stats()["dead_bytes"] > 0
    rng = random.Random(20261201)
    for r in range(4):  # overlapping ranges: later rounds replace what earlier ones published
        acked = _run_and_kill(tmp_path, start=r * 30, stored=rng.randint(1, 30), stall="go")
        store = _check_fresh(tmp_path)
        assert all(store.get(_key(j)) == _expected(j) for j in acked)  # every acknowledged put survives
    assert len(store) > 0
