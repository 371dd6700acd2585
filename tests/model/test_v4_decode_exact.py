"""DeepSeek-V4 `tiny` (the benchmarks' model, real 128-token window): decode steps and ragged
chunks reproduce the one-shot prefill rows bit for bit, across heavily compressed (dense) entries
and the router's softplus, whose rows are padded to whole vector runs (layers.rowwise)."""

from __future__ import annotations

import torch

from replaykv.model.init import init_weights
from replaykv.model.presets import v4_tiny
from replaykv.model.v4 import DeepseekV4ForCausalLM
from tests.model.test_v4_vs_transformers import run_chunks


def test_decode_and_chunks_reproduce_one_shot_rows() -> None:
    model = init_weights(DeepseekV4ForCausalLM(v4_tiny()).eval(), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    s = 300  # two heavily compressed entries (ratio 128) and a quarter of them visible at decode
    ids = torch.randint(0, model.config.vocab_size, (1, s), generator=torch.Generator().manual_seed(5))

    one = run_chunks(model, ids, [s])
    assert torch.equal(run_chunks(model, ids, [s - 50] + [1] * 50), one)  # across entry 2's completion at 255
    assert torch.equal(run_chunks(model, ids, [100, 37, 3, 111, 1, 48]), one)


def test_a_training_forward_after_an_inference_forward_records_autograd() -> None:
    """Tables the model keeps across calls (RoPE's pair swap, an mHC site's scales) are built as
    normal tensors even inside inference mode, so a later forward with autograd can save them."""
    from replaykv.cache.views import advance, allocate_view
    from replaykv.model.spec import ModelSpec

    model = init_weights(DeepseekV4ForCausalLM(v4_tiny()), seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    spec = ModelSpec.from_config(model.config)
    with torch.inference_mode():
        model(ids, allocate_view(spec, 1, 40))
    for p in model.parameters():
        p.requires_grad_(p.dim() == 1)  # only the vectors (mHC scales among them) learn
    view = allocate_view(spec, 1, 40)
    model(ids, view).float().square().mean().backward()
    advance(view, 40)
    hc = model.model.layers[0].attn_hc
    assert hc.scale.grad is not None and bool(hc.scale.grad.abs().sum() > 0)
