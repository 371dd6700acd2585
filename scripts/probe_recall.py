"""Does a checkpoint pick a record by its code inside one window?

    python scripts/probe_recall.py replaykv/weights/small --rows 40
    python scripts/probe_recall.py replaykv/weights/small --rows 40 --kind program

Held-out recall rows (`replaykv.train.rows.recall_row`: blocks of four link records `A -> B`,
then a one-link and a two-link question about them, each block inside the 128-token window;
seed 777, 512 bytes a row) scored by teacher forcing: per question, whether the answer's four
bytes are the argmax, and per byte index the share right. The answer's first byte is the
lookup (chance 1/4: the block's four records' answers); the other three continue a code the
model has seen, a copy. The first byte's argmax is also classified as the right record's, another
record's of the row, or no record's answer. With `--kind program`, held-out program rows
(`replaykv.train.rows.program_row`: short chain programs each followed by `print(q):` and its
traced answer `q = y = 123`, inside one window), per number of lookups in the answer: whole
answers right (teacher forced) and each lookup right (its name or value after `q = `, the
latest assignment of the name before the line found last); `--kind recency` the same for
their recency form (names assigned again and again, the asked one more than once). One torch
thread unless --threads says otherwise; `--state` scores a pilot arm's saved training state.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Corpus, load_corpus
from replaykv.train.rows import program_row, recall_row

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_lookups import load_scored

SEED = 777
LENGTH = 512
QUESTION = re.compile(rb"\nFollow (\d) links from ([A-Z0-9]{4}): ([A-Z0-9]{4})\n")
RECORD = re.compile(rb"\n([A-Z0-9]{4}) -> ([A-Z0-9]{4})\n")
PRINT = re.compile(rb"\nprint\(([a-z])\): ([a-z0-9 =]+)\n")


def predicted_rows(
    model: Any, heldout: Corpus, rows: int, build: Callable[..., Any]
) -> Iterator[tuple[np.ndarray, np.ndarray, bytes]]:
    """Held-out rows of `build` (seed SEED, LENGTH bytes): each row's ids, the argmax at every
    position (pred[i] predicts ids[i + 1]) and its text."""
    spec = ModelSpec.from_config(model.config)
    rng = np.random.default_rng(SEED)
    for _ in range(rows):
        ids = build(rng, heldout, LENGTH)[0]
        view = allocate_view(spec, 1, LENGTH, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            pred = model(torch.from_numpy(ids)[None], view)[0].argmax(-1).numpy()  # [L]
        yield ids, pred, bytes(int(i) if i < 256 else 0 for i in ids)


def score(model: Any, heldout: Corpus, rows: int) -> dict[int, dict[str, Any]]:
    """Per number of links: questions, whole answers right, per-byte share right and the first
    byte's argmax by kind (right, another record's answer, none)."""
    out: dict[int, dict[str, Any]] = {
        h: {"n": 0, "right": 0, "bytes": np.zeros(4), "first": {"right": 0, "another record": 0, "none": 0}}
        for h in (1, 2)
    }
    for ids, pred, text in predicted_rows(model, heldout, rows, recall_row):
        answers = {m.group(2)[0] for m in RECORD.finditer(text)}
        for q in QUESTION.finditer(text):
            cell, a = out[int(q.group(1))], q.start(3)
            hit = pred[a - 1 : a + 3] == ids[a : a + 4]
            cell["n"] += 1
            cell["right"] += int(hit.all())
            cell["bytes"] += hit
            kind = "right" if hit[0] else ("another record" if int(pred[a - 1]) in answers else "none")
            cell["first"][kind] += 1
    return out


def score_programs(
    model: Any, heldout: Corpus, rows: int, recency: bool = False
) -> dict[int, dict[str, Any]]:
    """Per number of lookups in the answer: questions, whole answers right and each lookup
    right (teacher forced: the argmax of every byte of the name or value it writes); program
    rows, or with `recency` their recency form."""
    out: dict[int, dict[str, Any]] = {}
    build = functools.partial(program_row, recency=recency)
    for ids, pred, text in predicted_rows(model, heldout, rows, build):
        right = np.concatenate([[False], pred[:-1] == ids[1:]])  # byte i predicted right
        for q in PRINT.finditer(text):
            names = q.group(2).split(b" = ")
            cell = out.setdefault(len(names) - 1, {"n": 0, "right": 0, "steps": np.zeros(len(names) - 1)})
            cell["n"] += 1
            cell["right"] += int(right[q.start(2) + 1 : q.end(2)].all())
            at = q.start(2) + len(names[0])
            for k, name in enumerate(names[1:]):
                at += 3  # " = "
                cell["steps"][k] += bool(right[at : at + len(name)].all())
                at += len(name)
    return dict(sorted(out.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--state", help="a pilot arm's directory: score its saved training state's weights")
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kind", choices=("recall", "program", "recency"), default="recall")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_scored(args.model, args.state)
    t0 = time.perf_counter()
    if args.kind in ("program", "recency"):
        scored = score_programs(model, load_corpus()["heldout"], args.rows, args.kind == "recency")
        for lookups, cell in scored.items():
            steps = " ".join(f"{int(v)}" for v in cell["steps"])
            print(
                f"{lookups} lookup(s): {cell['right']}/{cell['n']} whole answers; by lookup {steps}",
                flush=True,
            )
        print(f"{time.perf_counter() - t0:.0f} s")
        return
    for hops, cell in score(model, load_corpus()["heldout"], args.rows).items():
        n = cell["n"]
        print(
            f"{hops} link{'s' if hops > 1 else ''}: {cell['right']}/{n} whole answers (chance 1/4); "
            f"bytes right "
            + " ".join(f"{b / n:.2f}" for b in cell["bytes"])
            + "; first byte "
            + ", ".join(f"{k} {v}" for k, v in cell["first"].items()),
            flush=True,
        )
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
