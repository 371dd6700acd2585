"""Does a checkpoint continue a string it saw earlier, inside and beyond the window?

    python scripts/probe_copies.py replaykv/weights/small --length 1024 --cases 16

A lookup beyond the window and a copy beyond the window both go through the compressed entries;
this probe tells them apart. Held-out filler (seed 777) gets a random 16-character string (upper
case and digits, the copy rows' alphabet) written twice, the repeat `gap` bytes after the first
copy ends; each of the repeat's characters is scored by teacher forcing (argmax hit and
negative log-likelihood, per character index), for gaps inside the 128-token window and two
ranges beyond it. A model that finds the earlier copy by the characters it has just read
predicts the repeat from its second or third character on; the first is a guess (chance 1/36).
`--alphabet lower` writes the strings in lower-case letters instead, the alphabet of a chain's
names, which the copy rows of `codes` never draw; `--alphabet letters` in upper case, lower case
and digits mixed, and each line then also splits its hits between lower-case characters and the
rest (characters 2-16). One torch thread unless --threads says otherwise;
`--state` scores a pilot arm's saved training state.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Corpus, load_corpus
from replaykv.train.rows import COPY_ALPHABET, COPY_ALPHABETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_lookups import load_scored

SEED = 777
SIZE = 16
GAPS = ((10, 60), (200, 400), (500, 800))  # inside the window; beyond it; far beyond it
ALPHABETS = {"copy": COPY_ALPHABET, "lower": COPY_ALPHABETS["lower"], "letters": COPY_ALPHABETS["letters"]}
LOWER = COPY_ALPHABETS["lower"]


def score_gap(
    model: Any, heldout: Corpus, length: int, n: int, gap: tuple[int, int], alphabet: np.ndarray
) -> None:
    """Per character index of the repeat: the share of cases whose argmax is right and the mean
    negative log-likelihood (nats), printed on one line."""
    spec = ModelSpec.from_config(model.config)
    hits, nll = np.zeros(SIZE), np.zeros(SIZE)
    # characters 2-16 by class, lower case and the rest: hits, count, nats
    split = {True: [0, 0, 0.0], False: [0, 0, 0.0]}
    for i in range(n):
        rng = np.random.default_rng([SEED, i, gap[0]])
        ids = heldout.window(rng, length, False).copy()
        g = int(rng.integers(*gap))
        text = alphabet[rng.integers(0, len(alphabet), SIZE)].astype(np.int64)
        first = int(rng.integers(0, length - g - 2 * SIZE - 8))
        repeat = first + SIZE + g
        ids[first : first + SIZE] = text
        ids[repeat : repeat + SIZE] = text
        row = torch.from_numpy(ids)[None]
        view = allocate_view(spec, 1, length, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            logp = torch.log_softmax(model(row, view)[0].float(), -1)  # [L, V]
        for k in range(SIZE):
            t = repeat + k
            hit, cost = int(int(logp[t - 1].argmax()) == ids[t]), -float(logp[t - 1, ids[t]])
            hits[k] += hit
            nll[k] += cost
            if k:
                cls = split[bool(np.isin(ids[t], LOWER))]
                cls[0] += hit
                cls[1] += 1
                cls[2] += cost
    print(
        f"gap {gap[0]}-{gap[1]} ({n} cases): hit "
        + " ".join(f"{h / n:.2f}" for h in hits)
        + " | nats "
        + " ".join(f"{x / n:.2f}" for x in nll)
        + "".join(
            f" | {name} {h}/{c} ({x / c:.2f} nats)"
            for name, (h, c, x) in (("lower case", split[True]), ("others", split[False]))
            if c and split[True][1] and split[False][1]
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--state", help="a pilot arm's directory: score its saved training state's weights")
    p.add_argument("--alphabet", choices=tuple(ALPHABETS), default="copy")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--cases", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_scored(args.model, args.state)
    heldout = load_corpus()["heldout"]
    t0 = time.perf_counter()
    for gap in GAPS:
        score_gap(model, heldout, args.length, args.cases, gap, ALPHABETS[args.alphabet])
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
