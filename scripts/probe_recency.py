"""Does any layer read a name's latest assignment rather than an earlier one?

    python scripts/probe_recency.py STAGE [--state PILOT_ARM_DIR] [--length 512] [--cases 24]

A traced chain answer (`q = y = x = 123`, `replaykv.train.tasks.chain`'s `trace`) starts with a
lookup that only recency decides: of the two to four lines that assign q, the latest gives q's
value. For held-out chain task cases (`scripts/probe_lookups.py`'s seed and filler; four names,
six copies over 384 bytes, the bar's cell) the prompt and the answer's `q = ` are prefilled and,
at the position that predicts the first lookup, every layer that reads compressed entries is
measured as it computes: the attention mass (largest over heads, and mean over heads) on each of
q's assignment lines' value (the name or literal after `=`, the bytes the answer copies; the
whole line with `--part line`), summed over the window's keys and the entries that cover those
bytes, out of the layer's one softmax over window, sink and entries. Printed per layer: the mean mass on q's latest line, the mean on an
earlier line of q, the mean on a line of another name, and in how many cases the latest line gets
more than every earlier line of q (a layer that orders by place: all of them; one that reads the
first: none). Then the answers' first lookups, teacher forced, with the probability the model
gives there to the right name or literal, to each other name of the program and to each
lower-case letter the program does not name (a model that copies what it attends to puts the
second above the third; one that suppresses it, below). `--state` reads a pilot arm's saved
training state into the STAGE model (as `scripts/probe_counts.py` does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import load_corpus
from replaykv.train.tasks import VALUE_AT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_attention import LastRowAttention
from probe_lookups import cases_of, load_scored

CHAIN = {"n_vars": 4, "steps": 6, "span": 384, "trace": True}


def assignments(prompt: list[int], records: tuple[tuple[int, int], ...]) -> list[tuple[str, int, int]]:
    """(name assigned, lo, hi) of each statement line, in the program's order."""
    out = []
    for lo, hi in records:
        line = bytes(prompt[lo:hi]).decode()
        out.append((line.split(" = ")[0], lo, hi))
    return out


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage")
    p.add_argument("--state", help="a pilot arm's directory: score its saved training state's weights")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--part", choices=("value", "line"), default="value", help="what of each line is measured")
    p.add_argument("--show", action="store_true", help="print each program, its answer and the top guesses")
    args = p.parse_args()
    torch.set_num_threads(2)
    model = load_scored(args.stage, args.state)
    spec = ModelSpec.from_config(model.config)
    probe = LastRowAttention(model)
    stats: dict[int, dict[str, list[float]]] = {}
    used = first_right = 0
    # probability at the first lookup: the right value, per other name of the program, per
    # lower-case letter the program does not name
    p_right: list[float] = []
    p_named: list[float] = []
    p_absent: list[float] = []
    for case in cases_of("chain", CHAIN, args.length, args.cases, load_corpus()["heldout"]):
        prompt = list(case.prompt)
        lines = assignments(prompt, case.meta["records"])
        q = case.answer_text.split(" = ")[0]
        mine = [(lo, hi) for name, lo, hi in lines if name == q]
        if len(mine) < 2:
            continue
        used += 1
        at = case.meta["questions"][0][0]  # the first lookup's offset in the answer
        ids = torch.tensor([prompt + list(case.answer[:at])])
        view = allocate_view(spec, 1, ids.shape[1], torch.device("cpu"), torch.float32)
        logits = model(ids, view, logits_rows="last")
        first_right += int(logits[0, -1].argmax()) == case.answer[at]
        probs = logits[0, -1].float().softmax(-1)
        named = {ord(name) for name, _, _ in lines if len(name) == 1} - {case.answer[at]}
        absent = set(range(ord("a"), ord("z") + 1)) - named - {case.answer[at]}
        p_right.append(float(probs[case.answer[at]]))
        p_named.append(float(probs[sorted(named)].mean()))
        p_absent.append(float(probs[sorted(absent)].mean()))
        if args.show:
            top = probs.topk(3)
            guesses = ", ".join(
                f"{chr(int(i)) if i < 128 else int(i)!r} {float(v):.2f}" for v, i in zip(*top, strict=True)
            )
            program = " | ".join(bytes(prompt[lo:hi]).decode() for _, lo, hi in lines)
            print(f"{program}  ->  {case.answer_text!r}; predicted {guesses}", flush=True)
        for layer in probe.joint:
            got = stats.setdefault(
                layer, {k: [] for k in ("latest", "earlier", "other", "wins", "latest_mean")}
            )
            masses = [
                probe.mass(layer, lo + (VALUE_AT if args.part == "value" else 0), hi) for lo, hi in mine
            ]
            latest, earlier = masses[-1], masses[:-1]
            others = [
                probe.mass(layer, lo + (VALUE_AT if args.part == "value" else 0), hi)
                for name, lo, hi in lines
                if name != q
            ]
            got["latest"].append(float(latest.max()))
            got["latest_mean"].append(float(latest.mean()))
            got["earlier"].append(float(np.mean([float(m.max()) for m in earlier])))
            got["other"].append(float(np.mean([float(m.max()) for m in others])) if others else 0.0)
            best = torch.stack(earlier).max(0).values
            got["wins"].append(float(bool((latest > best).any())))
    probe.remove()
    print(
        f"chain cases @ {args.length} with q assigned 2+ times: {used}; first lookup right (forced): {first_right}"
    )
    print(
        f"first lookup's probability: the right value {np.mean(p_right):.3f}, each other name of the "
        f"program {np.mean(p_named):.3f}, each lower-case letter it does not name {np.mean(p_absent):.3f}"
    )
    print(
        "layer  latest (max head)  (mean head)  earlier q line  other name  latest beats earlier (some head)"
    )
    for layer, got in sorted(stats.items()):
        print(
            f"{layer:5d}  {np.mean(got['latest']):17.3f}  {np.mean(got['latest_mean']):11.3f}  "
            f"{np.mean(got['earlier']):14.3f}  {np.mean(got['other']):10.3f}  {int(sum(got['wins']))}/{used}"
        )


if __name__ == "__main__":
    main()
