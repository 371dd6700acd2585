"""One block of the lightning indexer at long context: scoring in one piece against scoring in
slices (`attention.INDEX_SLICE`), the top-k, and the native kernel that does both in one pass
(`replaykv.model.native`), timed side by side in one process.

    python bench/bench_indexer.py [--queries 32] [--entries 32768] [--slices 1024,2048,4096]
        [--repeats 15] [--threads 1]

The block is what `Indexer.select` scores for 32 queries of tiny V4 (4 index heads × 32 dims,
top-64) against `--entries` compressed entries. Variants run interleaved; min and median of
`--repeats` runs each, in ms. Every variant's scores are checked equal to the one-piece scores;
the native kernel's picks are compared with the top-k of those scores (it prints the share that
agree: its dot products may round an ulp apart).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import replaykv.model.attention as attention
from replaykv.model import native
from replaykv.model.compressor import topk_lowest_index
from replaykv.model.presets import v4_tiny


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--entries", type=int, default=32768)
    ap.add_argument("--slices", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = v4_tiny()
    indexer = attention.Indexer(cfg, ratio=4)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.queries, cfg.index_n_heads, cfg.index_head_dim, generator=gen)
    w = torch.randn(1, args.queries, cfg.index_n_heads, generator=gen)
    keys = torch.randn(1, args.entries, cfg.index_head_dim, generator=gen)
    whole = args.entries + 1
    variants = {"one piece": whole, **{f"slices of {n}": int(n) for n in args.slices.split(",") if n}}
    saved = attention.INDEX_SLICE
    fused = f"native scores + top-{cfg.index_topk}"
    names = [*variants, f"top-{cfg.index_topk}", *([fused] if native.usable(q) else [])]
    times: dict[str, list[float]] = {name: [] for name in names}
    lim = torch.full((1, args.queries), args.entries)
    agree = 1.0
    try:
        attention.INDEX_SLICE = whole
        ref = attention.sliced_scores(indexer._scores, q, w, keys)
        for _ in range(args.repeats):
            for name, size in variants.items():
                attention.INDEX_SLICE = size
                t0 = time.perf_counter()
                got = attention.sliced_scores(indexer._scores, q, w, keys)
                times[name].append(time.perf_counter() - t0)
                if not torch.equal(got, ref):
                    raise SystemExit(f"{name}: scores differ from the one-piece scores")
            t0 = time.perf_counter()
            picks = topk_lowest_index(ref, cfg.index_topk)
            times[f"top-{cfg.index_topk}"].append(time.perf_counter() - t0)
            if fused in times:
                t0 = time.perf_counter()
                got = native.index_topk(q, w, keys, lim, cfg.index_topk)
                times[fused].append(time.perf_counter() - t0)
                agree = (got == picks).float().mean().item()
    finally:
        attention.INDEX_SLICE = saved
    out = {k: (min(v) * 1e3, statistics.median(v) * 1e3) for k, v in times.items()}
    print(f"{args.queries} queries × {args.entries} entries, {args.threads} thread(s), {args.repeats} runs")
    for name, (lo, med) in out.items():
        print(f"  {name:>22}: min {lo:.2f} ms, median {med:.2f} ms")
    if fused in out:
        print(f"  native picks equal to the top-k of the one-piece scores: {agree:.2%}")
    return out


if __name__ == "__main__":
    main()
