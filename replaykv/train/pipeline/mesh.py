"""The process grid of a pipeline run: P stages × CP sequence shards, one process each.

Global rank = stage · CP + shard. Each shard column (the same shard of every stage) is one
pipeline, with its own process group for the schedule's transfers; each stage row (every
shard of one stage) exchanges window halos and group entries (:mod:`replaykv.train.context`)
and sums its gradients. Process groups are created by every rank in the same order, as
torch.distributed requires. Not for: what the stages compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class Mesh:
    """Stage `stage` and shard `shard` of a `stages` × `shards` grid."""

    stages: int
    shards: int
    rank: int
    column: Any = field(default=None, repr=False)  # the pipeline of this shard
    row: Any = field(default=None, repr=False)  # the shards of this stage

    @property
    def stage(self) -> int:
        return self.rank // self.shards

    @property
    def shard(self) -> int:
        return self.rank % self.shards

    def global_rank(self, stage: int, shard: int | None = None) -> int:
        return stage * self.shards + (self.shard if shard is None else shard)

    def row_ranks(self) -> list[int]:
        return [self.global_rank(self.stage, j) for j in range(self.shards)]

    def column_ranks(self, shard: int | None = None) -> list[int]:
        return [self.global_rank(i, shard) for i in range(self.stages)]

    @classmethod
    def build(cls, stages: int, shards: int, rank: int) -> Mesh:
        mesh = cls(stages, shards, rank)
        for j in range(shards):
            group = dist.new_group(mesh.column_ranks(j)) if shards > 1 else dist.group.WORLD
            if j == mesh.shard:
                mesh.column = group
        for i in range(stages):
            group = (
                dist.new_group([mesh.global_rank(i, j) for j in range(shards)])
                if stages > 1
                else dist.group.WORLD
            )
            if i == mesh.stage:
                mesh.row = group
        return mesh
