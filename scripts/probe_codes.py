"""Where does a lookup's code live in the hidden states? A linear read-out per layer.

    python scripts/probe_codes.py replaykv/weights/small --rows 60

A lookup beyond the window needs the asked code A in two places: in the question's last row,
which forms the query, and in the record `A -> B` near B, which the compressed entries keep
(the window no longer reaches A from there). This probe runs held-out lookup rows
(replaykv.train.rows.lookup_row on held-out filler, seed 4242, 1,024 tokens), takes each
layer's attention input (normed) at chosen rows, and fits a linear classifier per layer (36
classes: upper case and digits; 70% of the cases to fit, 30% to score; chance 0.03) for one
character of A:

* `question -> A[3]`, `question -> A[0]`: at the question's last row (the space after `A:`),
  A's last and first characters, 2 and 5 rows back;
* `record B[0] -> A[3]`, `record B[0] -> A[0]`: at the record's first answer byte, 5 and 8 back;
* `record A[3] -> A[3]`: a row's own byte, the read-out's ceiling.

The printed figure is the held-out share the classifier gets right. One torch thread unless
--threads says otherwise.
"""

from __future__ import annotations

import argparse
import re
import time

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.checkpoint import load_model
from replaykv.model.spec import ModelSpec
from replaykv.train.data import load_corpus
from replaykv.train.rows import lookup_row

ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
RECORD = re.compile(rb"\n([A-Z0-9]{4}) -> ([A-Z0-9]{4})\n")
QUESTION = re.compile(rb"\nFollow \d links from ([A-Z0-9]{4}): ")
LENGTH = 1024
SEED = 4242


def read_out(x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> float:
    """Held-out accuracy of a 36-way linear softmax classifier fitted on 70% of (x [N, H], y [N])."""
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    fit, test = order[: int(0.7 * len(y))], order[int(0.7 * len(y)) :]
    mean, std = x[fit].mean(0), x[fit].std(0) + 1e-5
    x = (x - mean) / std
    w = torch.zeros(x.shape[1], len(ALPHABET), requires_grad=True)
    b = torch.zeros(len(ALPHABET), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x[fit] @ w + b, y[fit]) + 1e-3 * (w**2).sum()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(((x[test] @ w + b).argmax(-1) == y[test]).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).float().eval()
    spec = ModelSpec.from_config(model.config)
    heldout = load_corpus()["heldout"]
    blocks = [layer.self_attn for layer in model.model.layers]
    inputs: dict[int, torch.Tensor] = {}
    for block in blocks:
        block.register_forward_pre_hook(lambda m, a: inputs.__setitem__(m.layer, a[0].detach()[0]))
    cells = ("question -> A[3]", "question -> A[0]", "record B[0] -> A[3]", "record B[0] -> A[0]",
             "record A[3] -> A[3]")  # fmt: skip
    feats: dict[str, list[torch.Tensor]] = {c: [] for c in cells}  # [layers, hidden] per case
    labels: dict[str, list[int]] = {c: [] for c in cells}
    rng = np.random.default_rng(SEED)
    t0 = time.perf_counter()
    for _ in range(args.rows):
        ids = lookup_row(rng, heldout, LENGTH)[0]
        view = allocate_view(spec, 1, LENGTH, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            model(torch.from_numpy(ids)[None], view, logits_rows="none")
        text = bytes(int(t) if t < 256 else 0 for t in ids)
        at: list[tuple[str, int, int]] = []
        for m in QUESTION.finditer(text):
            code, row = m.group(1), m.end() - 1
            at += [("question -> A[3]", row, code[3]), ("question -> A[0]", row, code[0])]
        for m in RECORD.finditer(text):
            code, b0 = m.group(1), m.start(2)
            at += [("record B[0] -> A[3]", b0, code[3]), ("record B[0] -> A[0]", b0, code[0])]
            at.append(("record A[3] -> A[3]", m.start(1) + 3, code[3]))
        for cell, row, char in at:
            feats[cell].append(torch.stack([inputs[k][row] for k in range(len(blocks))]))
            labels[cell].append(ALPHABET.index(char))
    print(f"{args.rows} rows in {time.perf_counter() - t0:.0f} s; chance {1 / len(ALPHABET):.2f}", flush=True)
    for cell in cells:
        x, y = torch.stack(feats[cell]).float(), torch.tensor(labels[cell])
        accs = " ".join(f"{read_out(x[:, k], y):.2f}" for k in range(len(blocks)))
        print(f"{cell} ({len(y)} cases), layers 0-{len(blocks) - 1}: {accs}", flush=True)


if __name__ == "__main__":
    main()
