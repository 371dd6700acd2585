"""What the tests of the lookup losses share: the tiny V4.1 model and lookup rows of the corpus
with at least two records each."""

from __future__ import annotations

import numpy as np
import torch

from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.data import Evidence, lookup_row

LENGTH = 256


def tiny_model() -> DeepseekV41ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(v41_tiny())
    init_weights(model, seed=0)
    return model


def lookup_rows(corpus, n: int = 2) -> tuple[torch.Tensor, tuple[tuple[Evidence, ...], ...]]:  # type: ignore[no-untyped-def]
    """ids [n, LENGTH] and each row's `Evidence`, from rows with a question whose record has a
    rival (the contrastive form needs one)."""
    rng = np.random.default_rng(3)
    ids, evidence = [], []
    while len(ids) < n:
        row, _, _, found = lookup_row(rng, corpus["train"], LENGTH)
        if found and len(found[0].records) > 1:
            ids.append(torch.from_numpy(row))
            evidence.append(tuple(found))
    return torch.stack(ids), tuple(evidence)
