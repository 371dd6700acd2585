"""bench/bench_indexer.py runs its variants on a small block and checks they score alike."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_indexer

import replaykv.model.attention as attention
from replaykv.model import native


def test_every_variant_is_timed_and_the_slice_setting_is_restored() -> None:
    out = bench_indexer.main(["--queries", "4", "--entries", "300", "--slices", "7,64", "--repeats", "2"])
    native_variant = {"native scores + top-64"} if native.enabled() else set()
    assert set(out) == {"one piece", "slices of 7", "slices of 64", "top-64"} | native_variant
    assert all(lo <= med for lo, med in out.values())
    assert attention.INDEX_SLICE == 4096
