"""Random initialisation of a model built from a config (for presets without weights and tests).

Follows transformers' scheme: normal(0, 0.02) matrices, unit norms, zero sinks, biases and
position biases, ones for mHC scales; hash-routing tables are drawn uniformly. The image path's
LayerNorms start at (1, 0), its biases at 0 and its span vectors like the embeddings. Training recipes
draw the embeddings at their own scale and the grouped output projection at 1/sqrt(fan-in)
(`Recipe.embed_std`, `Recipe.o_proj_fan_in`, :mod:`replaykv.train.recipes`).
"""

from __future__ import annotations

import torch
from torch import nn

from replaykv.model.layers import HyperConnection, HyperHead, RMSNorm
from replaykv.model.moe import Router


@torch.no_grad()
def init_weights(
    model: nn.Module,
    seed: int = 0,
    std: float = 0.02,
    embed_std: float | None = None,
    o_proj_fan_in: bool = False,
) -> nn.Module:
    """Initialise `model` in place from `seed`: every matrix normal(0, `std`), embedding tables
    normal(0, `embed_std`) (None: `std`), with `o_proj_fan_in` both halves of every attention's
    output projection (`o_a_proj`, `o_b_proj`) normal(0, in_features^-1/2), the rest as the
    module docstring says. The options rescale only the tensors they name: every other tensor
    is drawn the same with or without them."""
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = std
            if embed_std is not None and isinstance(module, nn.Embedding):
                scale = embed_std
            elif o_proj_fan_in and name.endswith(("o_a_proj", "o_b_proj")) and isinstance(module, nn.Linear):
                scale = module.in_features**-0.5
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * scale)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, HyperConnection):
            module.fn.copy_(torch.randn(module.fn.shape, generator=gen) * std)
            module.base.zero_()
            module.scale.fill_(1.0)
        elif isinstance(module, HyperHead):
            module.hc_fn.copy_(torch.randn(module.hc_fn.shape, generator=gen) * std)
            module.hc_base.zero_()
            module.hc_scale.fill_(1.0)
        elif isinstance(module, Router):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            if module.hashed:
                n_experts = module.weight.shape[0]
                module.tid2eid.copy_(torch.randint(0, n_experts, module.tid2eid.shape, generator=gen))
            else:
                module.e_score_correction_bias.zero_()
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "position_bias")):
            p.zero_()
        elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith(("image_start", "image_newline", "image_end")):
            p.copy_(torch.randn(p.shape, generator=gen) * (std if embed_std is None else embed_std))
    return model
