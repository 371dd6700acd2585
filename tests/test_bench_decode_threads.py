"""bench/bench_decode_threads.py times every variant and finds their decode rows the same bits."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_decode_threads


def test_every_variant_is_timed_and_the_thread_count_is_restored() -> None:
    before = torch.get_num_threads()
    out = bench_decode_threads.main(["--context", "150", "--steps", "3", "--rounds", "1"])
    assert set(out) == {
        "main thread, 2 threads",
        "main thread, 1 thread",
        "second thread, 2 threads",
        "second thread, 1 thread",
    }
    assert all(len(v) == 1 and v[0] > 0 for v in out.values())
    assert torch.get_num_threads() == before
