"""Held-out prompts for the fidelity study: each task family of the training data and plain
text, at a given context length, each with an anchor the cut offsets are measured from.

Task prompts come from :func:`replaykv.train.tasks.generate` with their own seed and filler from
held-out files only; their anchor is the end of the evidence the answer depends on, so a cut at
anchor + W puts the evidence just before the replay start and anchor + W + 1 one token further
out. Plain text is a window of held-out text; its anchor is the middle of the prompt. The
"deep" offset is a cut near the end of the prompt (a long cached prefix, a short new suffix).
Not for: the bar's cases (see :mod:`replaykv.train.bar`), which these do not reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replaykv.train.data import Corpus
from replaykv.train.evaluate import eval_controls
from replaykv.train.tasks import TASKS, generate

FAMILIES = (*TASKS, "text")
SEED = 60617  # neither training (recipe seeds) nor the bar (77773) nor the card (99991) uses it
DEEP_SUFFIX = 16  # the "deep" cut leaves this many prompt tokens after it


@dataclass(frozen=True)
class Prompt:
    family: str
    length: int
    index: int
    ids: tuple[int, ...]
    anchor: int
    answer: tuple[int, ...] = ()  # the task's reference answer (empty for text)


def prompts(heldout: Corpus, family: str, length: int, count: int, window: int) -> list[Prompt]:
    """`count` prompts of `length` tokens of one family (fewer when draws do not fit)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown prompt family {family!r}; choose from {FAMILIES}")
    f = FAMILIES.index(family)
    out: list[Prompt] = []
    for i in range(count * 4):
        if len(out) == count:
            break
        rng = np.random.default_rng([SEED, length, f, i])
        if family == "text":
            ids = tuple(int(t) for t in heldout.window(rng, length, prose=bool(i % 2)))
            out.append(Prompt(family, length, i, ids, length // 2))
            continue
        controls = dict(eval_controls(family, window))
        if family == "passkey":
            controls["depth"] = float(rng.uniform(0.1, 0.6))
        sample = generate(family, rng, heldout, length, **controls)
        if sample is not None:
            out.append(Prompt(family, length, i, sample.prompt, sample.evidence[1], sample.answer))
    return out


def cut_for(prompt: Prompt, offset: int | str) -> int | None:
    """The cut of `prompt` at `offset` tokens after its anchor ("deep": near the prompt's end);
    None when it falls outside (0, S). Odd cuts stay odd (architecture §13.7)."""
    s = len(prompt.ids)
    cut = s - DEEP_SUFFIX if offset == "deep" else prompt.anchor + int(offset)
    return cut if 0 < cut < s else None
