"""Does a checkpoint count the hops of a traced multi-hop answer?

    python scripts/probe_counts.py STAGE [--state PILOT_ARM_DIR] [--length 512] [--cases 16]

Traced answers (`2: B (1) -> C (0)`, `replaykv.train.tasks.traced_hops`) split into their parts,
teacher forced, per number of links: the question's number copied at the answer's start, each
code, each count (the links left after a code: one less than the number before it) and each
decision after a count (go on with ` -> `, or close), and whole answers. Held-out multi-hop task
cases (`scripts/probe_lookups.py`'s, four distractors) at `--length` tokens, then held-out
traced recall rows (`replaykv.train.rows.traced_recall_row`, the same answers inside one window;
`--recall-rows` rows of 512 bytes, seed 777). `--state` reads the weights of a pilot arm's
saved training state (`train_state/state.pt`) into the STAGE checkpoint's model, to score a run
between its exports. Two torch threads.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import load_corpus
from replaykv.train.rows import traced_recall_row

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_lookups import cases_of, load_scored
from probe_recall import predicted_rows

TRACED = re.compile(rb"\nFollow (\d) links from [A-Z0-9]{4}: (\d): ((?:[A-Z0-9]{4} \(\d\)(?: -> )?)+)\n")
STEP = len("CODE (1) -> ")  # bytes from one code of a traced answer to the next


def tally(cells: dict[int, dict[str, Any]], hops: int, right: np.ndarray, start: int, end: int) -> None:
    """Add one answer whose bytes [start, end) were predicted right where `right` says (its
    number at `start`, its first code two bytes later, the closing byte at `end`)."""
    cell = cells.setdefault(
        hops,
        {"n": 0, "number": 0, "codes": np.zeros(hops), "counts": np.zeros(hops), "decisions": np.zeros(hops)},
    )
    cell["n"] += 1
    cell["number"] += bool(right[start])
    cell["whole"] = cell.get("whole", 0) + bool(right[start : end + 1].all())
    at = start + len("2: ")
    for k in range(hops):
        cell["codes"][k] += bool(right[at : at + 4].all())
        cell["counts"][k] += bool(right[at + len("CODE (")])
        cell["decisions"][k] += bool(right[at + len("CODE (1)")])
        at += STEP


@torch.inference_mode()
def task_cells(model: Any, length: int, cases: int, heldout: Any) -> dict[int, dict[str, Any]]:
    spec = ModelSpec.from_config(model.config)
    cells: dict[int, dict[str, Any]] = {}
    for hops in (1, 2, 3):
        for case in cases_of(
            "multihop", {"hops": hops, "distractors": 4, "trace": True}, length, cases, heldout
        ):
            p = len(case.prompt)
            ids = torch.tensor([[*case.prompt, *case.answer]])
            view = allocate_view(spec, 1, ids.shape[1], torch.device("cpu"), torch.float32)
            pred = model(ids[:, :-1], view)[0].argmax(-1)
            right = np.concatenate([[False], (pred == ids[0, 1:]).numpy()])  # byte i predicted right
            tally(cells, hops, right, p, ids.shape[1] - 1)
    return cells


def recall_cells(model: Any, rows: int, heldout: Any) -> dict[int, dict[str, Any]]:
    cells: dict[int, dict[str, Any]] = {}
    for ids, pred, text in predicted_rows(model, heldout, rows, traced_recall_row):
        right = np.concatenate([[False], pred[:-1] == ids[1:]])
        for q in TRACED.finditer(text):
            tally(cells, int(q.group(1)), right, q.start(2), q.end(3))
    return cells


def show(title: str, cells: dict[int, dict[str, Any]]) -> None:
    print(title, flush=True)
    for hops, c in sorted(cells.items()):
        parts = " ".join(f"{k} {c[k].astype(int).tolist()}" for k in ("codes", "counts", "decisions"))
        print(
            f"  {hops} link(s), {c['n']} answers: number {c['number']}, {parts}, whole {c['whole']}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage")
    p.add_argument("--state", help="a pilot arm's directory: score its saved training state's weights")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--cases", type=int, default=16)
    p.add_argument("--recall-rows", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(2)
    model = load_scored(args.stage, args.state)
    heldout = load_corpus()["heldout"]
    show(f"multi-hop task cases @ {args.length}", task_cells(model, args.length, args.cases, heldout))
    show("traced recall rows (inside one window)", recall_cells(model, args.recall_rows, heldout))


if __name__ == "__main__":
    main()
