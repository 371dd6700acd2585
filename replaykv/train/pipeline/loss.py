"""The loss of a pipeline run, computed by its last stage per micro-batch: the full path's
weighted cross-entropy, whole rows (:class:`WeightedLoss`) or sequence shards
(:class:`ShardLoss`, with :func:`shard_batch` cutting a batch into this shard's part).

Not for: the losses of one process (see :mod:`replaykv.train.paths`).
"""

from __future__ import annotations

import torch

from replaykv.train.context import ContextShards
from replaykv.train.paths import weighted_ce


class ShardLoss:
    """The full-path loss of one micro-batch's shard of positions: target [B, S, 2] holds each
    position's next token id and that token's loss weight (0 after the sequence's end), and the
    sum is normalised by the whole batch's weight, so the shards' losses sum to the batch loss."""

    def __init__(self) -> None:
        self.total = torch.ones(())

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        logits = output[0]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), target[..., 0].reshape(-1).long(), reduction="none"
        )
        return (ce * target[..., 1].reshape(-1).to(ce.dtype)).sum() / self.total


class WeightedLoss:
    """The full-path loss of one micro-batch weighted by its share of the whole batch's target
    weight, as the single-process step weighs it (the same expression, so the same rounding):
    the micro-batches' losses sum to the batch loss (`scale_grads=False`)."""

    def __init__(self) -> None:
        self.total = torch.ones(())  # the batch's target weight, set before each step
        self.weight = 1.0  # the phase's weight of the full path

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        logits, ids = output
        share = target[:, 1:].sum() / self.total
        value = weighted_ce(logits[:, :-1], ids[:, 1:], target[:, 1:])
        return torch.zeros((), device=logits.device) + self.weight * share * value


def shard_batch(
    ids: torch.Tensor, targets: torch.Tensor, shards: ContextShards
) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's positions of a batch: its token ids, and per position the next token's id
    and loss weight (the loss's target under context parallelism)."""
    b, length = ids.shape
    if length % shards.size:
        raise ValueError(f"a sequence of {length} tokens does not split into {shards.size} equal shards")
    n = length // shards.size
    nxt = torch.zeros(b, length, 2, dtype=torch.float32, device=ids.device)
    nxt[:, :-1, 0] = ids[:, 1:].float()
    nxt[:, :-1, 1] = targets[:, 1:].float()
    part = slice(shards.index * n, (shards.index + 1) * n)
    return ids[:, part].contiguous(), nxt[:, part].contiguous()
