"""The three-phase training step: the vision tower outside the language model's parameter tree.

A step with images runs in three phases:

1. **vision forward**: the tower turns each image into its span vectors; the graph is kept;
2. **language model forward and backward**: the LM runs on its ids with the span vectors
   placed as *leaves* (detached copies that collect gradients), exactly as a text-only step
   runs: no vision computation, so the LM keeps its text-only parallel strategy (pipeline
   stages, context shards) unchanged;
3. **vision backward**: the leaves' gradients are pushed back through the kept tower graph.

The tower is a separate module with its own parameters (its own optimizer groups and checkpoint
file, :class:`VisionTrainer`); the LM is built without a tower. The gradients equal those of one
autograd graph over tower and LM (tests/train/test_multimodal.py). A step without images is a
text-only step: phases 1 and 3 do nothing.

Not for: the contrastive stage (:mod:`.contrastive`), loading images (:mod:`.data`,
:mod:`.sharded`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from replaykv.cache.views import allocate_view
from replaykv.images import PromptImage
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.model.vision import VisionTower
from replaykv.train.paths import CacheGuard, RowSpans, full_plan, run_plan, weighted_ce


@dataclass
class PhaseTimes:
    """Seconds spent in each phase of the last step."""

    vision_forward: float = 0.0
    language_model: float = 0.0
    vision_backward: float = 0.0


@dataclass
class VisionPass:
    """Phase 1's output: the span vectors with their tower graph (`vectors`) and the leaves the
    LM reads (`leaves`), per row, in the rows' image order."""

    vectors: list[list[torch.Tensor]] = field(default_factory=list)
    leaves: list[list[torch.Tensor]] = field(default_factory=list)
    starts: list[list[int]] = field(default_factory=list)

    def spans(self) -> RowSpans:
        return [list(zip(st, lv, strict=True)) for st, lv in zip(self.starts, self.leaves, strict=True)]


def vision_forward(tower: VisionTower, images: list[list[PromptImage]]) -> VisionPass:
    """Phase 1: every row's images through the tower; leaves for the LM."""
    out = VisionPass()
    for row in images:
        vecs = [tower.span(im.image) for im in row]
        out.vectors.append(vecs)
        out.leaves.append([v.detach().requires_grad_(True) for v in vecs])
        out.starts.append([im.start for im in row])
    return out


def vision_backward(vision: VisionPass) -> None:
    """Phase 3: the leaves' gradients back through the tower graph."""
    outs, grads = [], []
    for vecs, leaves in zip(vision.vectors, vision.leaves, strict=True):
        for v, leaf in zip(vecs, leaves, strict=True):
            if leaf.grad is not None:
                outs.append(v)
                grads.append(leaf.grad)
    if outs:
        torch.autograd.backward(outs, grads)


def lm_loss(
    model: DeepseekV41ForCausalLM, ids: torch.Tensor, targets: torch.Tensor, spans: RowSpans
) -> torch.Tensor:
    """The full-path next-token loss of rows `ids` [B, L] (weights `targets`), images placed."""
    spec = ModelSpec.from_config(model.config)
    b, length = ids.shape
    guard = CacheGuard()
    view = guard.track(allocate_view(spec, b, length, ids.device, model.lm_head.weight.dtype))
    with guard:
        logits, _ = run_plan(model, full_plan(spec, length), ids, view, spans=spans)
    return weighted_ce(logits[:, :-1], ids[:, 1:], targets[:, 1:])


def three_phase_step(
    model: DeepseekV41ForCausalLM,
    tower: VisionTower,
    ids: torch.Tensor,
    targets: torch.Tensor,
    images: list[list[PromptImage]],
    times: PhaseTimes | None = None,
) -> torch.Tensor:
    """One step's forward and backward in three phases; gradients land in `model`'s and
    `tower`'s parameters. Returns the loss (detached)."""
    if getattr(model.model, "vision", None) is not None:
        raise ValueError(
            "the language model must be built without a vision tower (the tower trains beside it)"
        )
    times = times if times is not None else PhaseTimes()
    t0 = time.perf_counter()
    vision = vision_forward(tower, images)
    t1 = time.perf_counter()
    loss = lm_loss(model, ids, targets, vision.spans())
    loss.backward()
    t2 = time.perf_counter()
    vision_backward(vision)
    t3 = time.perf_counter()
    times.vision_forward, times.language_model, times.vision_backward = t1 - t0, t2 - t1, t3 - t2
    return loss.detach()


class VisionTrainer:
    """The tower's own optimizer and checkpoint file, beside the LM's.

    `save` writes ``vision.safetensors`` (the tower's tensors under their ``model.vision.``
    names, so a serving checkpoint is the LM's file plus this one) and ``vision_optimizer.pt``.
    """

    def __init__(self, tower: VisionTower, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        self.tower = tower
        decay = [p for n, p in tower.named_parameters() if p.dim() >= 2]
        plain = [p for n, p in tower.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}], lr=lr
        )

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, directory: str) -> None:
        from pathlib import Path

        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {f"model.vision.{k}": v.detach().contiguous() for k, v in self.tower.state_dict().items()}
        save_file(state, str(out / "vision.safetensors"))
        torch.save(self.optimizer.state_dict(), out / "vision_optimizer.pt")

    def load(self, directory: str) -> None:
        from pathlib import Path

        from safetensors.torch import load_file

        src = Path(directory)
        state = load_file(str(src / "vision.safetensors"))
        self.tower.load_state_dict({k.removeprefix("model.vision."): v for k, v in state.items()})
        self.optimizer.load_state_dict(torch.load(src / "vision_optimizer.pt", weights_only=True))


def split_tower(model: DeepseekV41ForCausalLM) -> tuple[DeepseekV41ForCausalLM, VisionTower]:
    """Take the tower out of `model`'s parameter tree: returns (the same model, now without it;
    the tower). The config keeps its `vision_config` (the router still routes image rows with
    the image bias, and an export describes the whole model); :func:`join_tower` puts it back."""
    tower = model.model.vision
    if tower is None:
        raise ValueError("the model has no vision tower")
    model.model.vision = None
    return model, tower


def join_tower(model: DeepseekV41ForCausalLM, tower: VisionTower) -> DeepseekV41ForCausalLM:
    """The serving model: the tower back under ``model.vision`` (saved with the text weights)."""
    model.model.vision = tower
    return model
