"""A corruption sweep of a pack store: every kind of damage at every position class of a batch in
a pack is reported by ``replaykv store verify`` (exit 1) and counted by ``store stats``, damaged
bytes are never served, and every intact batch is kept; a crash's torn tail stays no damage."""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import replaykv.cache.pack_store as pack_mod
from replaykv.cache.pack_store import PACK_BATCH, PACK_RECORD, PACK_TAIL, PackStore
from replaykv.cache.store_cli import main
from tests.cache.test_store import k, payload_for

BATCHES = 3  # in pack A, appended one after another; pack B holds one more, never damaged
PER_BATCH = 4
SIZE = 2000
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def key_of(batch: int, i: int) -> bytes:
    return k(100 * batch + i)


def value_of(batch: int, i: int) -> bytes:
    return payload_for(100 * batch + i, SIZE)


def build(root: Path) -> tuple[Path, list[tuple[int, int]]]:
    """Pack A (three batches) and pack B (one); A's path and its batches' (offset, length)."""
    store = PackStore(root, 1 << 30, pack_bytes=1 << 20)
    for b in range(BATCHES):
        assert (
            store.put_many([(key_of(b, i), value_of(b, i)) for i in range(PER_BATCH)]) == [True] * PER_BATCH
        )
    store.pack_bytes = 0
    assert store.put_many([(key_of(BATCHES, i), value_of(BATCHES, i)) for i in range(PER_BATCH)])
    where = store.pack_of(key_of(0, 0))
    assert where is not None and store.pack_of(key_of(BATCHES, 0)) != where
    path = Path(where[0])
    offsets = pack_mod._read_index(str(path)[:-5] + ".idx")
    assert len(offsets) == BATCHES
    ends = [*offsets[1:], path.stat().st_size]
    return path, [(o, e - o) for o, e in zip(offsets, ends, strict=True)]


def _edit(path: Path, fn: Callable[[bytearray], None]) -> None:
    raw = bytearray(path.read_bytes())
    fn(raw)
    path.write_bytes(bytes(raw))


def bit_flip_table(path: Path, at: int, length: int) -> set[int]:
    def flip(raw: bytearray) -> None:
        raw[at + length - PACK_TAIL.size - 5] ^= 0x10

    _edit(path, flip)
    return {0}


def bit_flip_head(path: Path, at: int, length: int) -> set[int]:
    def flip(raw: bytearray) -> None:
        raw[at + 3] ^= 0x01

    _edit(path, flip)
    return {0}


def bit_flip_payload(path: Path, at: int, length: int) -> set[int]:
    def flip(raw: bytearray) -> None:
        raw[at + PACK_BATCH.size + PACK_RECORD.size + SIZE // 2] ^= 0x80  # the first record's payload

    _edit(path, flip)
    return {0}


def zeroed_range(path: Path, at: int, length: int) -> set[int]:
    def zero(raw: bytearray) -> None:
        raw[at : at + 4096] = bytes(4096)

    _edit(path, zero)
    return {0}


def garbage_batch(path: Path, at: int, length: int) -> set[int]:
    noise = random.Random(at).randbytes(length)

    def overwrite(raw: bytearray) -> None:
        raw[at : at + length] = noise

    _edit(path, overwrite)
    return {0}


def truncation(path: Path, at: int, length: int) -> set[int]:
    with open(path, "r+b") as f:
        f.truncate(at + length // 2)
    return {0, 1, 2}  # this batch and every later one in the pack (relative positions)


def deleted_file(path: Path, at: int, length: int) -> set[int]:
    path.unlink()
    return {-2, -1, 0, 1, 2}  # the whole pack


def garbage_file(path: Path, at: int, length: int) -> set[int]:
    other = path.parent / f"{path.name[:2]}{'7' * 30}.pack"
    other.write_bytes(random.Random(at).randbytes(length))
    return set()


def duplicated_pack(path: Path, at: int, length: int) -> set[int]:
    copy = path.parent / f"{path.name[:2]}{'5' * 30}.pack"
    shutil.copyfile(path, copy)
    return set()


DAMAGE: dict[str, Callable[[Path, int, int], set[int]]] = {
    f.__name__: f
    for f in (
        bit_flip_table,
        bit_flip_head,
        bit_flip_payload,
        zeroed_range,
        garbage_batch,
        truncation,
        deleted_file,
        garbage_file,
        duplicated_pack,
    )
}


@pytest.mark.parametrize("position", sorted(POSITIONS))
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_is_reported_never_served_and_costs_only_the_damaged_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, position: str
) -> None:
    path, batches = build(tmp_path)
    target = POSITIONS[position]
    at, length = batches[target]
    lost = {target + rel for rel in DAMAGE[kind](path, at, length)} & set(range(BATCHES))

    assert main(["verify", "--cache-dir", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bad_count"] >= 1
    if kind != "bit_flip_payload":  # a damaged payload is found by the read (and verify), not the scan
        assert main(["stats", "--cache-dir", str(tmp_path), "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["corrupt_batches"] + stats["corrupt_packs"] + stats["missing_packs"] >= 1

    store = PackStore(tmp_path, 1 << 30)
    for b in range(BATCHES + 1):
        for i in range(PER_BATCH):
            got = store.get(key_of(b, i))
            if b in lost:
                assert got in (None, value_of(b, i))
            else:
                assert got == value_of(b, i), (b, i)
    assert kind == "bit_flip_payload" or store.stats()["quarantined"] >= 1
    assert store.verify().bad == []  # what was found is quarantined, not reported again
    store.check_integrity()
    assert store.put(k(999), b"after") and PackStore(tmp_path, 1 << 30).get(k(999)) == b"after"


def test_a_torn_last_batch_is_a_crash_not_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = build(tmp_path)
    with open(path, "ab") as f:  # an append whose writer died before the batch was listed
        f.write(pack_mod._batch_head(PER_BATCH, 9000, path.name[:-5]) + payload_for(7, 3000))
    assert main(["verify", "--cache-dir", str(tmp_path), "--json"]) == 0
    capsys.readouterr()
    assert main(["stats", "--cache-dir", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["cut_batches"], printed["corrupt_batches"], printed["missing_packs"]) == (1, 0, 0)
    store = PackStore(tmp_path, 1 << 30)
    stats = store.stats()
    assert (stats["cut_batches"], stats["corrupt_batches"], stats["quarantined"]) == (1, 0, 0)
    assert all(
        store.get(key_of(b, i)) == value_of(b, i) for b in range(BATCHES + 1) for i in range(PER_BATCH)
    )


def test_the_issue_reproduction_ten_batches_magic_of_the_fourth_zeroed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PackStore(tmp_path, 1 << 30, pack_bytes=1 << 20)
    for b in range(10):
        assert store.put_many([(key_of(b, i), value_of(b, i)) for i in range(4)]) == [True] * 4
    where = store.pack_of(key_of(0, 0))
    assert where is not None
    offsets = pack_mod._read_index(where[0][:-5] + ".idx")
    _edit(Path(where[0]), lambda raw: raw.__setitem__(slice(offsets[3], offsets[3] + 8), bytes(8)))
    with caplog.at_level(logging.ERROR, logger="replaykv.cache.pack_store"):
        reopened = PackStore(tmp_path, 1 << 30)
    assert [r.getMessage() for r in caplog.records] == [
        f"store: damaged batch in {where[0]} at offset {offsets[3]} ({offsets[4] - offsets[3]} bytes): bad_batch"
    ]
    assert len(reopened) == 36 and reopened.stats()["corrupt_batches"] == 1
    assert all(reopened.get(key_of(b, i)) == value_of(b, i) for b in range(10) if b != 3 for i in range(4))
    assert not any(reopened.contains(key_of(3, i)) for i in range(4))
    assert list((tmp_path / "quarantine").glob("*.bad_batch.*.batch"))


def test_a_tombstone_for_a_pack_removed_elsewhere_is_swept(tmp_path: Path) -> None:
    store = PackStore(tmp_path, 1 << 30, pack_bytes=0)
    assert store.put(k(1), b"one") and store.put(k(2), b"two") and store.put(k(3), b"three")
    other = PackStore(tmp_path, 1 << 30)  # another process evicts k(1)'s pack...
    where = other.pack_of(k(1))
    assert where is not None
    pack_path = Path(where[0])
    other.capacity_bytes = 1
    other.gc(compact=False)
    assert not pack_path.exists()
    store.delete(k(1))  # ...while this one still tombstones into it
    assert not pack_path.with_suffix(".dead").exists()
    pack_path.with_suffix(".dead").write_bytes(bytes(40))  # an orphan from an older version
    reopened = PackStore(tmp_path, 1 << 30)
    assert not pack_path.with_suffix(".dead").exists() and reopened.orphans_swept == 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_bit_flips_are_all_reported_and_cost_only_their_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: int
) -> None:
    store = PackStore(tmp_path, 1 << 30, pack_bytes=1 << 20)
    for b in range(13):
        assert store.put_many([(key_of(b, i), value_of(b, i)) for i in range(4)]) == [True] * 4
    where = store.pack_of(key_of(0, 0))
    assert where is not None
    path = Path(where[0])
    offsets = [*pack_mod._read_index(where[0][:-5] + ".idx"), path.stat().st_size]
    rng = random.Random(seed)
    spots = rng.sample(range(offsets[-1]), 20)
    hit = {b for b in range(13) for s in spots if offsets[b] <= s < offsets[b + 1]}

    def flip(raw: bytearray) -> None:
        for s in spots:
            raw[s] ^= 1 << rng.randrange(8)

    _edit(path, flip)
    assert main(["verify", "--cache-dir", str(tmp_path), "--json"]) == 1
    capsys.readouterr()
    reopened = PackStore(tmp_path, 1 << 30)
    for b in range(13):
        for i in range(4):
            got = reopened.get(key_of(b, i))
            assert got == value_of(b, i) if b not in hit else got in (None, value_of(b, i)), (b, i)
    reopened.verify(quarantine=True)  # record headers are verify's to check, not the read's
    assert reopened.verify().bad == []
    reopened.check_integrity()
