"""Decode steps on one or two intra-op threads, from the main thread and from a second thread (where
the engine runs them), side by side in one process.

    python bench/bench_decode_threads.py [--context 4096] [--steps 47] [--rounds 3]

Tiny DeepSeek-V4 (random weights, the transformers comparison's checkpoint), one prompt prefilled
once; every variant decodes `--steps` tokens from a copy of that cache, the variants interleaved
in each round; prints min and median ms per step per variant. The decode rows of the variants are
checked to be the same bits. Run it with and without `OMP_WAIT_POLICY=passive` to see how much of
a second thread's cost is OpenMP workers spinning.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_v4_vs_transformers import make_checkpoint

from replaykv.cache.views import advance, allocate_view
from replaykv.engine.oneshot import prefill
from replaykv.model.checkpoint import load_model
from replaykv.model.spec import ModelSpec

VARIANTS = (
    ("main thread", False, 2),
    ("main thread", False, 1),
    ("second thread", True, 2),
    ("second thread", True, 1),
)


def decode(model: Any, base: Any, steps: int, threads: int) -> tuple[float, torch.Tensor]:
    """ms per step of `steps` greedy steps from a copy of `base` on `threads` threads; the logits."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        view = copy.deepcopy(base)
        nxt = torch.tensor([[5]])
        rows = []
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = model(nxt, view, logits_rows="last")
            advance(view, 1)
            nxt = logits[:, -1:].argmax(-1)
            rows.append(logits)
        return (time.perf_counter() - t0) / steps * 1000, torch.cat(rows, 1)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=47)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    threads_before = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp) / "tiny-v4")
        model = load_model(Path(tmp) / "tiny-v4")
    ids = torch.randint(0, 256, (1, args.context), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        base = allocate_view(ModelSpec.from_config(model.config), 1, args.context + args.steps + 2)
        prefill(model, ids, base, logits_rows="last")
    times: dict[str, list[float]] = {}
    reference = None
    try:
        for _ in range(args.rounds):
            for where, other, threads in VARIANTS:
                out: list[tuple[float, torch.Tensor]] = []
                if other:
                    th = threading.Thread(target=lambda o=out, n=threads: o.append(decode(model, base, args.steps, n)))
                    th.start()
                    th.join()
                else:
                    out.append(decode(model, base, args.steps, threads))
                ms, rows = out[0]
                if reference is None:
                    reference = rows
                elif not torch.equal(rows, reference):
                    raise SystemExit(f"{where}, {threads} threads: decode rows differ")
                times.setdefault(f"{where}, {threads} thread{'s' if threads > 1 else ''}", []).append(ms)
    finally:
        torch.set_num_threads(threads_before)
    for name, runs in times.items():
        print(f"{name:>24}: min {min(runs):.2f} ms, median {statistics.median(runs):.2f} ms per step")
    return times


if __name__ == "__main__":
    main()
