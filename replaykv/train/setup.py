"""What a training run starts from: the device, the model (fresh from the recipe's preset or an
exported checkpoint), AdamW with its parameter groups and the learning rate per group, and the
aux-loss-free router balancing that runs beside the optimiser.

Not for: the loop itself (see :mod:`replaykv.train.loop`) or its saved state
(:mod:`replaykv.train.state`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from replaykv.model.attention import Indexer
from replaykv.model.attention_v41 import IndexerV41
from replaykv.model.checkpoint import load_model
from replaykv.model.init import init_weights
from replaykv.model.layers import HyperConnection, HyperHead
from replaykv.model.moe import RouterV41
from replaykv.model.presets_v41 import get_preset_v41
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.recipes import Recipe


class RouterBalance:
    """Aux-loss-free load balancing (DeepSeek-V3): after each optimiser step every router's
    `e_score_correction_bias` moves by `rate` towards equal expert load (up for experts picked
    less than average, down for more), from the picks counted in that step's training forwards."""

    def __init__(self, model: nn.Module, rate: float) -> None:
        self.rate = rate
        self.counts: dict[RouterV41, torch.Tensor] = {}
        self.paused = False  # True: forwards that are not training steps (a schedule's dry run)
        self._handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, RouterV41)
        ]

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        if not torch.is_grad_enabled() or self.paused:
            return
        assert isinstance(module, RouterV41)
        n = module.e_score_correction_bias.shape[0]
        c = torch.bincount(output[0].reshape(-1), minlength=n).float()
        self.counts[module] = self.counts.get(module, torch.zeros_like(c)) + c

    @torch.no_grad()
    def update(self) -> None:
        for router, c in self.counts.items():
            router.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
        self.counts.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_model(recipe: Recipe, init: str | Path | None) -> DeepseekV41ForCausalLM:
    """The recipe's preset with random weights (seeded), or the checkpoint `init` in float32."""
    if recipe.init_from is not None:
        if init is None:
            raise ValueError(
                f"recipe {recipe.name!r} starts from the {recipe.init_from!r} export; pass --init DIR"
            )
        model = load_model(init, dtype="float32")
        if not isinstance(model, DeepseekV41ForCausalLM):
            raise ValueError(f"{init} is not a DeepSeek-V4.1 checkpoint")
        return model.train()
    return fresh_model(recipe, seed=recipe.seed)


def fresh_model(recipe: Recipe, seed: int | None = None) -> DeepseekV41ForCausalLM:
    """The recipe's preset, randomly initialised with `seed` (None: left for a state dict)."""
    model = DeepseekV41ForCausalLM(get_preset_v41(recipe.preset))
    if seed is not None:
        torch.manual_seed(seed)
        init_weights(model, seed=seed, embed_std=recipe.embed_std, o_proj_fan_in=recipe.o_proj_fan_in)
    return model.train()


def _indexers(model: nn.Module) -> list[Indexer | IndexerV41]:
    return [m for m in model.modules() if isinstance(m, (Indexer, IndexerV41))]


def set_index_topk(model: nn.Module, topk: int | None, default: int | None = None) -> None:
    """Make every indexer in `model` select `topk` compressed entries per query (None: `default`,
    else the model config's `index_topk`); a phase's setting (`Phase.index_topk`)."""
    config: Any = getattr(model, "config", None)
    value = topk if topk is not None else default if default is not None else int(config.index_topk)
    for m in _indexers(model):
        m.topk = value


def index_topk_in_force(model: nn.Module) -> int | None:
    """The `index_topk` the model's indexers select with now (None: it has no indexer)."""
    values = {m.topk for m in _indexers(model)}
    if len(values) > 1:
        raise RuntimeError(f"the indexers disagree on index_topk: {sorted(values)}")
    return values.pop() if values else None


HC_MODULES = (HyperConnection, HyperHead)


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norms, sinks, biases and mixes are left alone);
    the mHC mixing parameters run at ``recipe.hc_lr_scale`` times the rate, without decay. Each
    group's ``lr_scale`` multiplies the schedule's rate (see :func:`set_lr`)."""
    hc_ids = {id(p) for m in model.modules() if isinstance(m, HC_MODULES) for p in m.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {
            "params": [p for p in params if id(p) not in hc_ids and p.dim() >= 2],
            "weight_decay": recipe.weight_decay,
        },
        {"params": [p for p in params if id(p) not in hc_ids and p.dim() < 2], "weight_decay": 0.0},
        {
            "params": [p for p in params if id(p) in hc_ids],
            "weight_decay": 0.0,
            "lr_scale": recipe.hc_lr_scale,
        },
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=recipe.lr, betas=recipe.betas, eps=1e-8)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate `lr` times each parameter group's ``lr_scale`` (default 1)."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
