"""``--store-capacity`` / ``REPLAYKV_STORE_CAPACITY``: bytes with units or a share of the store's
file system, down to ``EngineConfig.store_capacity_bytes``; bad values are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from replaykv.cache.stores import parse_capacity
from replaykv.server.settings import SettingsError, build_parser, load_settings


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 << 30), ("2G", 2 << 30), ("500MB", 500_000_000), ("123456", 123456), ("64 KiB", 64 << 10)],
)
def test_sizes_with_units(text: str, expected: int) -> None:
    assert parse_capacity(text) == expected


@pytest.mark.parametrize("text", ["abc", "0", "-5G", "150%", "2 parsecs"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_capacity(text)


def test_flag_and_environment_reach_the_engine_config(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    flag = load_settings(["--cache-dir", store, "--store-capacity", "2MiB"], environ={})
    assert flag.engine_config().store_capacity_bytes == 2 << 20
    env = load_settings(["--cache-dir", store], environ={"REPLAYKV_STORE_CAPACITY": "500MB"})
    assert env.engine_config().store_capacity_bytes == 500_000_000
    share = load_settings(["--cache-dir", store, "--store-capacity", "0.5"], environ={})
    total = shutil.disk_usage(tmp_path).total  # the store's directory does not exist yet
    assert share.engine_config().store_capacity_bytes == int(total * 0.5)
    default = load_settings(["--cache-dir", store], environ={})
    assert default.engine_config().store_capacity_bytes == 16 << 30
    with pytest.raises(SettingsError, match=r"not a capacity"):
        load_settings(["--store-capacity", "lots"], environ={})
    assert "--store-capacity" in build_parser().format_help()
