"""What the tests of the lookup losses share: the tiny V4.1 model, lookup rows of the corpus
with at least two records each, and the check that a loss reaches a KV source's compressor."""

from __future__ import annotations

import numpy as np
import torch

from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.rows import Evidence, lookup_row

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


def assert_reaches_compressor(attn) -> None:  # type: ignore[no-untyped-def]
    """Some parameter of `attn`'s compressor (a KV source's) has a nonzero gradient."""
    assert attn.compressor is not None
    assert any(float(p.grad.abs().sum()) > 0 for p in attn.compressor.parameters() if p.grad is not None)
