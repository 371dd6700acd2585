"""Does an attention layer's output carry the character the answer needs? A logit lens.

    python scripts/probe_lens.py STAGE [--state PILOT_ARM_DIR] --kind chain
    python scripts/probe_lens.py STAGE [--state PILOT_ARM_DIR] --kind copy --alphabet lower

At the position that predicts one character, each layer's attention output on that row (what
the block adds before the mHC mixes) goes through the final norm and the output projection on
its own, and the right character is ranked among its class (0: first; a layer whose output
says nothing about it: about half the class). `--kind chain`: the chain task's first lookup,
teacher forced (`scripts/probe_recency.py`'s cases, where q is assigned two or more times and
its latest value is a name), ranked among the 26 lower-case letters. `--kind copy`, the
control: the sixth character of a 16-character string written twice in held-out filler (half
of the repeats 10-60 bytes after the first, half about 250), ranked among `--alphabet`. The
lens ignores the layers after the block, so a low rank says the output holds the character in
the output projection's terms; a rank near chance in a layer that attends to the right
position says what it reads there is not the character. With `--kind copy` each layer that
reads compressed entries also gets the attention mass (largest head, mean head) on the earlier
copy of the character to write; `scripts/probe_recency.py` gives the chain's masses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import load_corpus
from replaykv.train.rows import COPY_ALPHABETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_attention import LastRowAttention
from probe_lookups import cases_of, load_scored
from probe_recency import CHAIN, assignments

LOWER = COPY_ALPHABETS["lower"]


def copy_first(length: int) -> int:
    """Where `copy_rows` writes a string's first copy."""
    return length // 2 - 56


def chain_rows(length: int, n: int) -> Iterator[tuple[list[int], int]]:
    """(ids up to the first lookup, the right letter) of chain cases whose q is assigned two or
    more times and whose first lookup is a name."""
    for case in cases_of("chain", CHAIN, length, n, load_corpus()["heldout"]):
        prompt = list(case.prompt)
        q = case.answer_text.split(" = ")[0]
        if sum(name == q for name, _, _ in assignments(prompt, case.meta["records"])) < 2:
            continue
        at = case.meta["questions"][0][0]
        if case.answer[at] in LOWER:
            yield prompt + list(case.answer[:at]), int(case.answer[at])


def copy_rows(length: int, n: int, alphabet: np.ndarray) -> Iterator[tuple[list[int], int]]:
    """(ids up to a repeat's sixth character, that character) of strings written twice, the
    first copy at `length // 2 - 56`."""
    heldout = load_corpus()["heldout"]
    for c in range(n):
        rng = np.random.default_rng([9, c])
        ids = heldout.window(rng, length, False).copy()
        text = alphabet[rng.integers(0, len(alphabet), 16)]
        first = copy_first(length)
        repeat = first + 16 + (int(rng.integers(10, 60)) if c % 2 == 0 else 250)
        repeat = min(repeat, length - 16)
        ids[first : first + 16] = text
        ids[repeat : repeat + 16] = text
        yield [int(x) for x in ids[: repeat + 6]], int(ids[repeat + 6])


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage")
    p.add_argument("--state", help="a pilot arm's directory: score its saved training state's weights")
    p.add_argument("--kind", choices=("chain", "copy"), default="chain")
    p.add_argument("--alphabet", choices=tuple(COPY_ALPHABETS), default="lower", help="--kind copy's strings")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--cases", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(2)
    model = load_scored(args.stage, args.state)
    spec = ModelSpec.from_config(model.config)
    outs: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Any:
        def hook(module: Any, inputs: Any, output: torch.Tensor) -> None:
            outs[layer] = output[0, -1].float()

        return hook

    handles = [layer.self_attn.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    attention = LastRowAttention(model) if args.kind == "copy" else None
    source = copy_first(args.length) + 6  # --kind copy: the earlier copy of the character to write
    masses: dict[int, list[tuple[float, float]]] = {}
    alphabet = LOWER if args.kind == "chain" else COPY_ALPHABETS[args.alphabet]
    cls = torch.from_numpy(alphabet.astype(np.int64))
    rows = (
        chain_rows(args.length, args.cases)
        if args.kind == "chain"
        else copy_rows(args.length, args.cases, alphabet)
    )
    weight = model.lm_head.weight.float()
    ranks: dict[int, list[int]] = {}
    final: list[int] = []
    for ids, right in rows:
        view = allocate_view(spec, 1, len(ids), torch.device("cpu"), torch.float32)
        logits = model(torch.tensor([ids]), view, logits_rows="last")[0, -1].float()
        final.append(int((logits[cls] > logits[right]).sum()))
        for layer, out in outs.items():
            lens = model.model.norm(out[None])[0].float() @ weight.T
            ranks.setdefault(layer, []).append(int((lens[cls] > lens[right]).sum()))
        if attention is not None:
            for layer in attention.joint:
                m = attention.mass(layer, source, source + 1)
                masses.setdefault(layer, []).append((float(m.max()), float(m.mean())))
    for h in handles:
        h.remove()
    if attention is not None:
        attention.remove()
    n = len(final)
    print(
        f"{args.kind}: {n} cases; rank of the right character among {len(alphabet)} (0: first; "
        f"chance {(len(alphabet) - 1) / 2:.1f}); the model's own logits: mean rank {np.mean(final):.1f}, "
        f"first {sum(r == 0 for r in final)}/{n}"
    )
    for layer in sorted(ranks):
        got = ranks[layer]
        mass = ""
        if layer in masses:
            top, mean = np.mean(masses[layer], 0)
            mass = f" | mass on the earlier copy: largest head {top:.3f}, mean head {mean:.3f}"
        print(
            f"layer {layer:2d} attention output: mean rank {np.mean(got):4.1f}, first {sum(r == 0 for r in got)}/{n}"
            + mass
        )


if __name__ == "__main__":
    main()
