"""``replaykv store stats|verify|gc`` through ``store_cli.main``."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from replaykv.cache.file_store import DirectoryStore
from replaykv.cache.keys import key_hex
from replaykv.cache.pack_store import PACK_RECORD, PackStore
from replaykv.cache.store import STORE_HEADER
from replaykv.cache.store_cli import main
from replaykv.cache.stores import make_store
from tests.cache.conftest import FakeClock


def k(i: int) -> bytes:
    return hashlib.sha256(b"cli-%d" % i).digest()


def _fill(root: Path, n: int, clock: FakeClock | None = None) -> DirectoryStore:
    store = DirectoryStore(root, 1 << 30, clock=clock or FakeClock())
    for i in range(n):
        assert store.put(k(i), bytes([i]) * 1000)
        if clock is not None:
            clock.advance(60)
    return store


def _corrupt(root: Path, key: bytes) -> Path:
    h = key_hex(key)
    path = root / "entries" / h[:2] / h[2:4] / f"{h}.kv"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    return path


def test_stats_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(tmp_path, 3)
    assert main(["stats", "--cache-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["entries"] == 3 and out["bytes_resident"] == 3 * (STORE_HEADER.size + 1000)
    assert out["quarantine_files"] == 0
    assert main(["stats", "--cache-dir", str(tmp_path)]) == 0
    assert "entries: 3" in capsys.readouterr().out


def test_verify_reports_then_quarantines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(tmp_path, 4)
    path = _corrupt(tmp_path, k(2))
    assert main(["verify", "--cache-dir", str(tmp_path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["checked"], out["ok"], out["quarantined"]) == (4, 3, 0)
    assert out["bad"] == [{"file": path.name, "reason": "bad_digest"}]
    assert path.exists()  # report only
    assert main(["verify", "--cache-dir", str(tmp_path), "--quarantine", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["quarantined"] == 1
    assert not path.exists() and len(list((tmp_path / "quarantine").iterdir())) == 1
    assert main(["verify", "--cache-dir", str(tmp_path)]) == 0
    assert "bad_count: 0" in capsys.readouterr().out


def test_gc_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(tmp_path, 5, clock=FakeClock(0.0))  # mtimes in 1970: everything is past retention
    assert (
        main(
            [
                "gc",
                "--cache-dir",
                str(tmp_path),
                "--json",
                "--retention-hours",
                "1e9",
                "--capacity-bytes",
                str(2 * (STORE_HEADER.size + 1000)),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert (out["evicted"], out["expired"], out["entries_after"]) == (3, 0, 2)
    assert sorted(DirectoryStore(tmp_path, 1 << 30).indexed_keys()) == sorted([k(3), k(4)])
    assert main(["gc", "--cache-dir", str(tmp_path), "--json"]) == 0  # 72 h default retention
    assert json.loads(capsys.readouterr().out)["expired"] == 2


def test_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default store: none there
    assert main(["stats", "--cache-dir", str(tmp_path / "missing")]) == 2
    assert "no store" in capsys.readouterr().err
    assert main(["frobnicate", "--cache-dir", str(tmp_path)]) == 2
    assert main(["stats"]) == 2
    assert main(["gc", "--cache-dir", str(tmp_path), "--capacity-bytes", "lots"]) == 2


def test_a_pack_store_through_the_same_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeClock(time.time() - 3 * 3600)  # the batch was written 3 h ago, k(3) now
    store = PackStore(tmp_path, 1 << 30, clock=clock, pack_bytes=0)  # a pack per batch
    assert store.put_many([(k(i), bytes([i]) * 1000) for i in range(3)]) == [True] * 3
    clock.advance(3 * 3600)
    assert store.put(k(3), b"newer")
    assert main(["stats", "--cache-dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "pack" and out["entries"] == 4
    path, offset = store.pack_of(k(1)) or ("", 0)
    raw = bytearray(Path(path).read_bytes())
    raw[offset + PACK_RECORD.size + 5] ^= 0xFF
    written = os.stat(path).st_mtime
    Path(path).write_bytes(bytes(raw))
    os.utime(path, (written, written))  # the damage is not an access
    assert main(["verify", "--cache-dir", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["checked"], report["ok"]) == (4, 3) and report["bad"][0]["reason"] == "bad_digest"
    assert main(["verify", "--cache-dir", str(tmp_path), "--quarantine", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["quarantined"] == 1
    assert main(["verify", "--cache-dir", str(tmp_path), "--json"]) == 0
    capsys.readouterr()
    # gc with a 2 h retention: what is left of the batch (its pack's mtime: 3 h ago) expires.
    assert main(["gc", "--cache-dir", str(tmp_path), "--retention-hours", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["entries_before"], out["expired"], out["entries_after"]) == (3, 2, 1)
    assert PackStore(tmp_path, 1 << 30).indexed_keys() == [k(3)]


def test_make_store_keeps_the_format_on_disk(tmp_path: Path) -> None:
    assert isinstance(make_store(None, tmp_path / "new", 1 << 20), PackStore)
    _fill(tmp_path / "old", 1)
    assert isinstance(make_store(None, tmp_path / "old", 1 << 20), DirectoryStore)
    with pytest.raises(ValueError, match="holds a 'file' store"):
        make_store("pack", tmp_path / "old", 1 << 20)
    with pytest.raises(ValueError, match="one of"):
        make_store("sqlite", tmp_path / "x", 1 << 20)
    (tmp_path / "old" / "packs").mkdir()
    with pytest.raises(ValueError, match="both"):
        make_store(None, tmp_path / "old", 1 << 20)
    assert main(["stats", "--cache-dir", str(tmp_path / "old")]) == 2
