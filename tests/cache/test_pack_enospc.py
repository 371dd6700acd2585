"""A pack store on a full file system: on ENOSPC it evicts the least recently used packs and
retries the write once; on a real 2 MiB tmpfs (when this process may mount one) it keeps
accepting writes without any capacity set below the disk."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from replaykv.cache.pack_store import PackStore
from tests.cache.conftest import FakeClock
from tests.cache.test_store import k, payload_for


def test_enospc_evicts_the_oldest_pack_and_retries_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    store = PackStore(tmp_path, 1 << 30, clock=clock, pack_bytes=0)
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


def test_enospc_that_persists_fails_the_write_after_one_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    store = PackStore(tmp_path, 1 << 30, clock=clock, pack_bytes=0)
    for i in range(3):
        assert store.put(k(i), payload_for(i))
        clock.advance(10)
    real_write = os.write
    calls = [0]

    def full(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            calls[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert store.put(k(9), payload_for(9)) is False
    monkeypatch.undo()
    assert calls[0] == 2 and store.stats()["errors"] == {"write:ENOSPC": 1}
    assert sorted(store.indexed_keys()) == sorted([k(1), k(2)])  # one eviction, then it gave up
    store.check_integrity()


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
