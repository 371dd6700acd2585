"""Held-out health of stage checkpoints and pilot states, side by side: bits per byte on
held-out text and pass-key retrieval at a few depths of a short prompt (the recipe's quick
evaluation, widened). It shows whether a pilot or a stage that taught one skill cost the model
its text or its keys.

    python scripts/probe_health.py replaykv/weights/small ~/.cache/replaykv/pilot/x/lr0.0005/stage \\
        --state ~/.cache/replaykv/train/v41-small   # a run's saved training state, scored too
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from replaykv.train.data import load_corpus
from replaykv.train.evaluate import evaluate, summarize
from replaykv.train.recipes import small

sys.path.insert(0, str(Path(__file__).parent))
from probe_lookups import load_scored


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stages", nargs="+", help="stage checkpoint directories")
    p.add_argument(
        "--state", action="append", default=[], help="STAGE=RUN: score RUN's train_state on STAGE's config"
    )
    p.add_argument("--keys-per-depth", type=int, default=6)
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    quick = small().quick_eval
    assert quick is not None
    spec = dataclasses.replace(quick, passkey_per_depth=args.keys_per_depth, text_sequences=args.texts)
    corpus = load_corpus()
    runs = [(s, None) for s in args.stages] + [tuple(x.split("=", 1)) for x in args.state]
    for stage, state in runs:
        model = load_scored(stage, state)
        with torch.inference_mode():
            r = evaluate(model, corpus["heldout"], spec)
        print(json.dumps({"stage": stage, "state": state, **summarize(r)}), flush=True)


if __name__ == "__main__":
    main()
