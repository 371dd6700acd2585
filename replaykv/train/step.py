"""One training step's gradient: forward and backward of a batch in micro-batches, the loss parts
weighted so that the accumulated gradient is the whole batch's, the gradient budgets, and what a
step whose gradient is not finite does.

Every loss a phase adds (the paths' language-model losses, the indexer KL, the evidence-attention
loss) normally joins one gradient, which the loop clips to `Recipe.grad_clip` as a whole. With
`Phase.evidence_clip` > 0 the evidence-attention loss gets a budget of its own: its gradient is
accumulated apart, clipped to that norm, and added to the rest after the rest is clipped to
`Recipe.grad_clip`, so that a large evidence gradient cannot shrink the language-model update
(one clip over the sum scales both down together: at an evidence gradient of norm 60 against a
language-model gradient of norm 3, the language model keeps a twentieth of its step). The price
is a second backward pass through each micro-batch's graph.

Not for: the optimiser step, the schedule or checkpoints (:mod:`replaykv.train.loop`), the paths'
losses (:mod:`replaykv.train.paths`), the losses themselves (:mod:`replaykv.train.distill`,
:mod:`replaykv.train.evidence`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.data import Batch
from replaykv.train.distill import IndexerDistillation
from replaykv.train.evidence import EvidenceAttention
from replaykv.train.keys import RecordKeys
from replaykv.train.paths import path_losses
from replaykv.train.recipes import Phase, Recipe
from replaykv.train.state import log_record


def accumulate_gradients(
    model: DeepseekV41ForCausalLM,
    spec: ModelSpec,
    batch: Batch,
    phase: Phase,
    recipe: Recipe,
    distill: IndexerDistillation,
    device: torch.device,
    micro_batch: int | None = None,
    evidence: EvidenceAttention | None = None,
    keys: RecordKeys | None = None,
) -> dict[str, float]:
    """Forward and backward of one batch in micro-batches; returns the logged loss parts.

    Each micro-batch's path losses are weighted by its share of the batch's loss targets, so the
    accumulated gradient is that of the whole batch's mean losses (up to summation order). With
    `evidence` (installed when a phase has `evidence_loss` > 0) and `phase.evidence_loss` > 0,
    the full path's evidence-attention loss of each micro-batch's questions is added at that
    weight, averaged over micro-batches. With `phase.evidence_clip` > 0 as well, the gradients
    leave here already clipped (the rest to `recipe.grad_clip`, the evidence part to
    `phase.evidence_clip`, then summed; their norms before clipping are logged as
    `grad_norm_rest` and `grad_norm_evidence`), so the loop's clip at `recipe.grad_clip +
    phase.evidence_clip` leaves them as they are. With `keys` and `phase.record_keys` > 0, the
    record-key loss of each micro-batch's records (see :mod:`replaykv.train.keys`) joins the rest
    at that weight, averaged over micro-batches.
    """
    size = phase.batch
    micro = max(1, min(size, micro_batch or phase.micro_batch or size))
    ids, targets = batch.ids.to(device), batch.targets.to(device)
    p = batch.prompt_len
    counts = {"full": targets[:, 1:].sum(), "follow": targets[:, p:].sum()}
    logged: dict[str, float] = {}
    n_micro = -(-size // micro)
    teach = evidence is not None and phase.evidence_loss > 0
    budgets = _Budgets(model) if teach and phase.evidence_clip > 0 else None
    for i0 in range(0, size, micro):
        rows = slice(i0, min(size, i0 + micro))
        if teach:
            assert evidence is not None
            evidence.arm(
                batch.evidence[rows],
                ids.shape[1],
                phase.evidence_contrast,
                phase.evidence_tail,
                phase.evidence_layers,
                phase.evidence_keyed_layers,
            )
        if keys is not None and phase.record_keys > 0:
            keys.arm(batch.evidence[rows], ids[rows])
        parts = path_losses(
            model,
            spec,
            ids[rows],
            targets[rows],
            p,
            batch.cut,
            full=phase.paths.full > 0,
            follow_up=phase.paths.decoder_replay > 0,
        )
        total = torch.zeros((), device=device)
        for name, value in parts.items():
            share = (
                targets[rows, 1:].sum() / counts["full"]
                if name == "full"
                else targets[rows, p:].sum() / counts["follow"]
            )
            weight = phase.paths.full if name == "full" else phase.paths.decoder_replay
            total = total + weight * share * value
            logged[name] = logged.get(name, 0.0) + float(share * value.detach())
        logged["loss"] = logged.get("loss", 0.0) + float(total.detach())
        kl = distill.pop()
        if kl is not None:
            total = total + recipe.indexer_loss * kl / n_micro
            logged["indexer_kl"] = logged.get("indexer_kl", 0.0) + float(kl.detach()) / n_micro
        read = keys.pop() if keys is not None else None
        if read is not None:
            total = total + phase.record_keys * read / n_micro
            logged["record_keys"] = logged.get("record_keys", 0.0) + float(read.detach()) / n_micro
        found = evidence.pop() if evidence is not None else None
        if found is not None:
            logged["evidence"] = logged.get("evidence", 0.0) + float(found.detach()) / n_micro
            if budgets is not None:
                total.backward(retain_graph=True)
                budgets.take("rest")
                (phase.evidence_loss * found / n_micro).backward()
                budgets.take("evidence")
                continue
            total = total + phase.evidence_loss * found / n_micro
        total.backward()
        if budgets is not None:
            budgets.take("rest")
    if budgets is not None:
        norms = budgets.release({"rest": recipe.grad_clip, "evidence": phase.evidence_clip})
        logged.update({f"grad_norm_{name}": norm for name, norm in norms.items()})
    return logged


# Non-finite gradients in a row after which a run stops: one is skipped (its batch is spent with
# no update), a run of them means the weights or a loss are broken, not one batch.
NONFINITE_LIMIT = 3


def skip_nonfinite(
    out: Path, step: int, phase: Phase, parts: dict[str, float], run: int, kernels: str, bar: Any
) -> None:
    """Log a step whose gradient was not finite (its optimiser step skipped); raise once `run`
    such steps in a row reach `NONFINITE_LIMIT`, naming the loss parts and a known cause."""
    log_record(out, {"step": step, "phase": phase.name, "skipped": "non-finite gradient", **parts})
    bar.write(f"step {step}: non-finite gradient, optimiser step skipped; loss parts {parts}")
    if run < NONFINITE_LIMIT:
        return
    hint = ""
    if kernels == "fused" and phase.evidence_loss > 0 and phase.evidence_clip > 0:
        hint = (
            "; Phase.evidence_clip backpropagates twice through the fused kernels' compiled "
            "attention block, whose second backward has given NaN: use --kernels eager"
        )
    raise FloatingPointError(
        f"steps {step - run + 1}-{step} of phase {phase.name!r} gave non-finite gradients "
        f"(loss parts {parts}); no update was applied, the saved state is the last checkpoint's{hint}"
    )


class _Budgets:
    """Gradients accumulated apart by part, then clipped each to its own norm and summed into
    the parameters' `.grad`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.parts: dict[str, list[torch.Tensor | None]] = {}

    def take(self, name: str) -> None:
        """Move the parameters' current `.grad` into part `name`'s accumulator."""
        acc = self.parts.setdefault(name, [None] * len(self.params))
        for i, q in enumerate(self.params):
            if q.grad is None:
                continue
            held = acc[i]
            acc[i] = q.grad if held is None else held.add_(q.grad)
            q.grad = None

    def release(self, clips: dict[str, float]) -> dict[str, float]:
        """Clip each part to its norm in `clips`, sum them into `.grad`; each part's norm before."""
        norms: dict[str, float] = {}
        for name, acc in self.parts.items():
            grads = [g for g in acc if g is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            scale = torch.clamp(clips[name] / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
            for g in grads:
                g.mul_(scale.to(g.device))
            norms[name] = float(norm)
        for i, q in enumerate(self.params):
            for acc in self.parts.values():
                part = acc[i]
                if part is not None:
                    q.grad = part if q.grad is None else q.grad.add_(part)
        return norms
