"""Score a checkpoint's pass-key cells of the shipping bar with other `index_topk` values: how many
held-out keys each query's compressed-entry selection finds, with the weights unchanged.

    python scripts/probe_index_topk.py replaykv/weights/small --length 2048 \
        --cells passkey@0.25,passkey@0.5 --cases 20 --topk 64,256,512

Teacher-forced exact match per cell (the bar's cases, replaykv.train.bar.bar_cases). Prints one
line per (topk, cell). One torch thread unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import time

import torch

from replaykv.model.checkpoint import load_config, load_model
from replaykv.train.bar import bar_cases, score_cases
from replaykv.train.data import load_corpus
from replaykv.train.recipes import BarSpec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--cells", default="passkey@0.25,passkey@0.5")
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--topk", default="64,512")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = BarSpec(cases=args.cases, offsets=())
    base = load_config(args.model)
    cases = bar_cases(load_corpus()["heldout"], spec, args.length, base.sliding_window)
    for topk in (int(x) for x in args.topk.split(",")):
        model = load_model(args.model, config=base.replace(index_topk=topk)).eval()
        for cell in args.cells.split(","):
            t0 = time.perf_counter()
            with torch.inference_mode():
                r = score_cases(model, cases[cell], spec)["forced"]
            print(
                f"index_topk {topk}, {args.length} tokens, {cell}: {r['k']}/{r['n']} ({time.perf_counter() - t0:.0f} s)"
            )


if __name__ == "__main__":
    main()
