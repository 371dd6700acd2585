"""The image–caption contrastive stage, with both feature gathers hidden behind computation.

Features. An image's feature is the mean of its tower grid vectors through `image_proj`; a
caption's is the mean of the language model's final hidden states over its tokens through
`text_proj`; both L2-normalised. (`image_proj` trains with the tower, `text_proj` with the LM.)

Loss. The pairwise sigmoid loss over the global batch of N pairs,

    L = (1/N) Σ_i Σ_j softplus(-z_ij · (s · t_i·v_j + b)),   z_ij = +1 if i = j else -1,

with fixed scale s and bias b. Each term couples one caption and one image and nothing else, so
the gradient of the captions' features depends only on the images' features and vice versa
(a softmax over the batch would couple every caption to every other one through its
normaliser). A process with the local pairs [r·n, (r+1)·n) therefore computes

* ``loss_text`` = the terms of its captions against every image (gathered, no gradient): its
  captions' exact gradient, and
* ``loss_image`` = the terms of every caption (gathered, no gradient) against its images: its
  images' exact gradient,

and no gradient ever crosses processes except the usual parameter all-reduce. The step
(:func:`contrastive_step`) runs in three phases: vision forward; the image-feature gather is
issued and the text forward runs while it travels; then ``loss_text``, the text-feature gather
is issued and the text backward runs while it travels; then ``loss_image`` and the vision
backward. With ``overlap=False`` each gather is waited for where it is issued (the blocking
form), so the time a gather is exposed can be measured against the overlapped one.

Not for: the three-phase LM step with images in the prompt (:mod:`.phases`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replaykv.cache.views import allocate_view
from replaykv.images import PreparedImage
from replaykv.model.layers import hc_collapse
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.model.vision import VisionTower
from replaykv.train.paths import CacheGuard


@dataclass(frozen=True)
class ContrastiveConfig:
    """Feature width and the loss's fixed scale and bias (a sigmoid loss's usual start)."""

    dim: int = 64
    scale: float = 10.0
    bias: float = -10.0


def image_features(tower: VisionTower, proj: nn.Linear, images: list[PreparedImage]) -> torch.Tensor:
    """[n, dim]: each image's grid vectors averaged, projected, normalised."""
    dev = proj.weight.device
    pooled = torch.stack(
        [tower.grid_features(im.pixels(torch.float32, dev)).flatten(0, 1).mean(0) for im in images]
    )
    return F.normalize(proj(pooled.to(proj.weight.dtype)), dim=-1)


def text_features(
    model: DeepseekV41ForCausalLM, proj: nn.Linear, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[n, dim]: the final hidden states (after the last collapse and norm) averaged over each
    caption's tokens, projected, normalised."""
    spec = ModelSpec.from_config(model.config)
    b, length = ids.shape
    guard = CacheGuard()
    view = guard.track(allocate_view(spec, b, length, ids.device, model.lm_head.weight.dtype))
    with guard:
        step = model.step(view, length)
        state = model.run_layers(model.embed(ids), range(len(model.model.layers)), step, view)
        hidden = model.model.norm(hc_collapse(state.streams, state.pre_mix)).float()
    m = mask.to(hidden.dtype)[..., None]
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
    return F.normalize(proj(pooled.to(proj.weight.dtype)), dim=-1)


def pair_loss(
    text: torch.Tensor,
    images: torch.Tensor,
    text_from: int,
    image_from: int,
    total: int,
    cfg: ContrastiveConfig,
) -> torch.Tensor:
    """(1/total) Σ over the pairs of `text` [a, d] (global rows text_from + [0, a)) and `images`
    [c, d] (global rows image_from + [0, c)) of softplus(-z·(s·t·v + b))."""
    logits = cfg.scale * (text.float() @ images.float().T) + cfg.bias
    rows = torch.arange(text.shape[0], device=text.device)[:, None] + text_from
    cols = torch.arange(images.shape[0], device=text.device)[None, :] + image_from
    z = torch.where(rows == cols, 1.0, -1.0)
    return F.softplus(-z * logits).sum() / total


@dataclass
class GatherTimes:
    """Seconds a step spent waiting for each gather (exposed, not covered by computation), and
    the phases' wall times."""

    image_gather: float = 0.0
    text_gather: float = 0.0
    vision_forward: float = 0.0
    language_model: float = 0.0
    vision_backward: float = 0.0


class _Gather:
    """An all-gather of a [n, d] tensor over the world, async or blocking."""

    def __init__(self, t: torch.Tensor, world: int, overlap: bool, group: Any = None) -> None:
        self.parts = [torch.empty_like(t) for _ in range(world)]
        self.work = dist.all_gather(self.parts, t.contiguous(), group=group, async_op=overlap)

    def wait(self) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        if self.work is not None:
            self.work.wait()
        return torch.cat(self.parts), time.perf_counter() - t0


def contrastive_step(
    model: DeepseekV41ForCausalLM,
    text_proj: nn.Linear,
    tower: VisionTower,
    image_proj: nn.Linear,
    ids: torch.Tensor,
    mask: torch.Tensor,
    images: list[PreparedImage],
    cfg: ContrastiveConfig,
    overlap: bool = True,
    times: GatherTimes | None = None,
) -> torch.Tensor:
    """One process's forward and backward for its n pairs (the module docstring's schedule).

    Gradients land in the parameters (sum them over processes as for any data-parallel step).
    Without an initialised process group this is the single-process computation. Returns the
    global batch's loss (the same on every process)."""
    times = times if times is not None else GatherTimes()
    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    n = ids.shape[0]
    total, first = n * world, rank * n
    # phase 1: vision forward, then the image-feature gather in flight
    t0 = time.perf_counter()
    v = image_features(tower, image_proj, images)
    image_gather = _Gather(v.detach(), world, overlap) if distributed else None
    t1 = time.perf_counter()
    # phase 2: the language model's forward (the image gather travels) and backward (the text
    # gather travels); no vision computation
    t = text_features(model, text_proj, ids, mask)
    if image_gather is not None:
        all_v, times.image_gather = image_gather.wait()
    else:
        all_v = v.detach()
    loss_text = pair_loss(t, all_v, first, 0, total, cfg)
    text_gather = _Gather(t.detach(), world, overlap) if distributed else None
    loss_text.backward()
    if text_gather is not None:
        all_t, times.text_gather = text_gather.wait()
    else:
        all_t = t.detach()
    t2 = time.perf_counter()
    # phase 3: vision backward
    loss_image = pair_loss(all_t, v, 0, first, total, cfg)
    loss_image.backward()
    t3 = time.perf_counter()
    times.vision_forward, times.language_model, times.vision_backward = t1 - t0, t2 - t1, t3 - t2
    value = loss_text.detach().clone()
    if distributed:
        dist.all_reduce(value)
    return value


def sum_gradients(*modules: nn.Module) -> None:
    """All-reduce (sum) every gradient of `modules` over the world (data parallelism)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for module in modules:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
