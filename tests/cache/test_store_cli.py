"""``replaykv store stats|verify|gc`` through ``store_cli.main``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from replaykv.cache.keys import key_hex
from replaykv.cache.store import STORE_HEADER, DirectoryStore
from replaykv.cache.store_cli import main
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


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--cache-dir", str(tmp_path / "missing")]) == 2
    assert "no store" in capsys.readouterr().err
    assert main(["frobnicate", "--cache-dir", str(tmp_path)]) == 2
    assert main(["stats"]) == 2
    assert main(["gc", "--cache-dir", str(tmp_path), "--capacity-bytes", "lots"]) == 2
