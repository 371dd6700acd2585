"""Both stores on a full file system: on ENOSPC they evict what was used longest ago and retry
the write once, and log the failure once and the recovery; on a real 2 MiB tmpfs (when this
process may mount one) the pack store keeps accepting writes with a capacity far above the disk."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from replaykv.cache.file_store import DirectoryStore
from replaykv.cache.pack_store import PackStore
from tests.cache.conftest import FakeClock
from tests.cache.test_store import k, payload_for


@pytest.mark.parametrize("fmt", ["pack", "file"])
def test_enospc_evicts_the_oldest_pack_and_retries_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: FakeClock, fmt: str
) -> None:
    store: PackStore | DirectoryStore = (
        PackStore(tmp_path, 1 << 30, clock=clock, pack_bytes=0)
        if fmt == "pack"
        else DirectoryStore(tmp_path, 1 << 30, clock=clock)
    )
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(10)
    assert store.get(k(0)) == payload_for(0)  # k(1) is now the least recently used
    real_write = os.write
    failures = [1]

    def full_once(fd: int, data: bytes) -> int:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_once)
    assert store.put(k(9), payload_for(9))
    monkeypatch.undo()
    assert not store.contains(k(1)) and store.stats()["evictions"] == 1
    assert [store.get(k(i)) for i in (0, 2, 9)] == [payload_for(0), payload_for(2), payload_for(9)]
    store.check_integrity()


@pytest.mark.parametrize("fmt", ["pack", "file"])
def test_enospc_that_persists_fails_the_write_after_one_retry(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    clock: FakeClock,
    fmt: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store: PackStore | DirectoryStore = (
        PackStore(tmp_path, 1 << 30, clock=clock, pack_bytes=0)
        if fmt == "pack"
        else DirectoryStore(tmp_path, 1 << 30, clock=clock)
    )
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(10)
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING, logger="replaykv.cache"):
        assert store.put(k(9), payload_for(9)) is False
        assert store.put(k(8), payload_for(8)) is False
        monkeypatch.undo()
        assert store.put(k(7), payload_for(7))
    assert store.stats()["errors"] == {"write:ENOSPC": 2}
    assert sorted(store.indexed_keys()) == sorted(
        [k(2), k(7)]
    )  # each failed write evicted one entry, then gave up
    store.check_integrity()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("store write: failed (write:ENOSPC)" in m for m in messages) == 1  # the first, not each
    assert sum("store write: recovered" in m for m in messages) == 1
    assert sum("is full (ENOSPC); evicted" in m for m in messages) == 2


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_tmpfs_keeps_taking_writes(tiny_tmpfs: Path, clock: FakeClock) -> None:
    store = PackStore(tiny_tmpfs, 1 << 30, clock=clock, pack_bytes=0)  # capacity far above the disk
    for i in range(60):  # 60 × 100 KB on a 2 MiB file system
        assert store.put(k(i), payload_for(i, 100_000)), i
        clock.advance(1)
    assert store.get(k(59)) == payload_for(59, 100_000)
    assert not store.contains(k(0)) and store.stats()["evictions"] > 0
    assert store.stats()["puts_failed"] == 0
    store.check_integrity()
    store.close()
