"""kill -9 of a writer at random points: a fresh store never serves a partial entry, keeps every
entry the writer was told is stored, and sweeps orphans.

The writer prints ``stored <i>`` after each acknowledged put; the test kills it after a random
number of those lines (the writer is then somewhere in a later put), so what the fresh store must
hold never depends on how the two processes were scheduled."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from replaykv.cache.file_store import DirectoryStore

REPO = Path(__file__).resolve().parents[2]

# The child writes entries i = start, start+1, ... forever; key and payload both follow from i.
_WRITER = r"""
import hashlib, os, sys, time
from replaykv.cache.file_store import DirectoryStore

root, start, stall = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "stall"
if stall:  # hang inside the first temp-file fsync so the kill lands mid-publish for sure
    real_fsync = os.fsync
    def slow_fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            print("in-fsync", flush=True)
            time.sleep(60)
        return real_fsync(fd)
    os.fsync = slow_fsync
store = DirectoryStore(root, 1 << 40)
print("ready", flush=True)
i = start
while True:
    key = hashlib.sha256(b"crash-%d" % i).digest()
    seed = hashlib.sha256(b"body-%d" % i).digest()
    size = 1000 + (int.from_bytes(seed[:4], "little") % (1 << 20))
    if store.put(key, (seed * (size // 32 + 1))[:size]):
        print(f"stored {i}", flush=True)
    i += 1
"""


def _expected(i: int) -> bytes:
    import hashlib

    seed = hashlib.sha256(b"body-%d" % i).digest()
    size = 1000 + (int.from_bytes(seed[:4], "little") % (1 << 20))
    return (seed * (size // 32 + 1))[:size]


def _key(i: int) -> bytes:
    import hashlib

    return hashlib.sha256(b"crash-%d" % i).digest()


def kill_writer(script: str, args: list[str], stored: int = 0, wait_for: bytes | None = None) -> list[int]:
    """Run ``script`` in a child (it prints ``ready`` once its store is open, then ``stored <i>``
    after each acknowledged write), wait for the line ``wait_for`` when given (the child stalled
    where the test wants it) or for ``stored`` acknowledgements, then SIGKILL it. Returns the
    acknowledged indices."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, env=env, cwd=REPO)
    acked: list[int] = []
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        if wait_for is not None:
            assert child.stdout.readline().startswith(wait_for)  # threads may print it together
        while len(acked) < stored:
            word, _, rest = child.stdout.readline().strip().partition(b" ")
            assert word == b"stored", word
            acked += [int(x) for x in rest.split()]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return acked


def _run_and_kill(root: Path, start: int, stored: int = 0, stall: bool = False) -> list[int]:
    args = [str(root), str(start), "stall" if stall else "go"]
    return kill_writer(_WRITER, args, stored, b"in-fsync" if stall else None)


def _check_fresh_store(root: Path, max_i: int, acked: tuple[int, ...] = ()) -> DirectoryStore:
    tmp_before = [p for p in (root / "entries").rglob("*.tmp")]
    store = DirectoryStore(root, 1 << 40)
    assert store.orphans_swept == len(tmp_before)
    assert not list((root / "entries").rglob("*.tmp"))
    by_key = {_key(i): i for i in range(max_i)}
    for key in store.indexed_keys():
        got = store.get(key)
        assert got == _expected(by_key[key])  # complete and exact, never partial
    for i in acked:  # every acknowledged write survives the kill
        assert store.contains(_key(i)), i
    assert store.stats()["quarantined"] == 0
    assert store.verify().bad == []
    store.check_integrity()
    return store


def test_kill_during_publish_leaves_only_an_orphan(tmp_path: Path) -> None:
    _run_and_kill(tmp_path, 0, stall=True)
    assert len(list((tmp_path / "entries").rglob("*.tmp"))) == 1
    store = _check_fresh_store(tmp_path, 10)
    assert len(store) == 0 and store.orphans_swept == 1


def test_sigkill_at_random_points(tmp_path: Path) -> None:
    rng = random.Random(20260517)
    acked: set[int] = set()
    for r in range(5):
        # Overlapping ranges: later rounds also replace entries earlier rounds published.
        acked.update(_run_and_kill(tmp_path, start=r * 20, stored=rng.randint(1, 12)))
        store = _check_fresh_store(tmp_path, 100_000, tuple(sorted(acked)))
    assert len(store) >= len(acked) > 0
