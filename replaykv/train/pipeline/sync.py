"""Collectives of a pipeline step besides the schedule's own transfers: the shadow indexers'
gradient aggregation and parameter sync, and gradient clipping over all stages.

Not for: the schedule (:mod:`.run`) or checkpoints (:mod:`.state`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from replaykv.train.pipeline.mesh import Mesh
from replaykv.train.pipeline.plan import StagePlan
from replaykv.train.pipeline.stage import ShadowIndexer, StageModule, indexer_of, key_parameters


def shadow_groups(plan: StagePlan, mesh: Mesh) -> dict[int, Any]:
    """One process group per shared component and shard column: its owner stage and the stages
    with a replica. Every rank creates every group, in the same order (torch.distributed's
    rule); this rank keeps its column's."""
    groups: dict[int, Any] = {}
    for j in range(mesh.shards):
        for s in plan.config.kv_sources:
            reps = plan.replicas(s)
            if reps:
                group = dist.new_group(sorted(mesh.global_rank(i, j) for i in {plan.stage_of(s), *reps}))
                if j == mesh.shard:
                    groups[s] = group
    return groups


def component(module: StageModule, plan: StagePlan, source: int) -> list[torch.Tensor] | None:
    """This rank's copy of source's key projection: the owner's own, or its shadow."""
    if module.stage == plan.stage_of(source):
        return key_parameters(indexer_of(module.model, source))
    if str(source) in module.shadows:
        shadow = module.shadows[str(source)]
        assert isinstance(shadow, ShadowIndexer)
        return key_parameters(shadow)
    return None


def aggregate_shadows(module: StageModule, plan: StagePlan, groups: dict[int, Any]) -> None:
    for s, group in groups.items():
        params = component(module, plan, s)
        if params is None:
            continue
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)


def sync_shadows(module: StageModule, plan: StagePlan, groups: dict[int, Any], mesh: Mesh) -> None:
    for s, group in groups.items():
        params = component(module, plan, s)
        if params is None:
            continue
        for p in params:
            dist.broadcast(p.data, src=mesh.global_rank(plan.stage_of(s)), group=group)


def sum_over_shards(module: StageModule, mesh: Mesh) -> None:
    """Context parallelism: every shard of a stage ends with the sum of their gradients."""
    if mesh.shards == 1:
        return
    for p in [*module.model.parameters(), *module.shadows.parameters()]:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=mesh.row)


def clip_gradients(module: StageModule, plan: StagePlan, max_norm: float, mesh: Mesh) -> float:
    """torch.nn.utils.clip_grad_norm_ over every stage's own parameters (shadows excluded), with
    its arithmetic: the float32 norm of the per-tensor norms in the model's parameter order
    (stage after stage), then one clamped coefficient."""
    grads = [p.grad for p in module.model.parameters() if p.grad is not None]
    local = torch._foreach_norm(grads, 2.0) if grads else []
    parts: list[Any] = [None] * plan.stages
    dist.all_gather_object(parts, [n.detach().cpu() for n in local], group=mesh.column)
    norms = [n for part in parts for n in part]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return float(total)


def own_tensors(module: StageModule, grads: bool) -> dict[str, torch.Tensor]:
    """This stage's own gradients, or its whole state (parameters and router biases), float32
    on the CPU."""
    if grads:
        named = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    else:
        named = dict(module.model.state_dict())
    return {n: t.detach().float().cpu().clone() for n, t in named.items()}
