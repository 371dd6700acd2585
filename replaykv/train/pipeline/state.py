"""What a pipeline run writes: one Hugging Face-format model gathered from the stages (stage
checkpoints and the final weights), each stage's resumable state, and the run's report.

Resumable state: every stage writes OUT/train_state/pipeline/stage{i}-of-{P}.pt (its own
weights and router biases, its AdamW state, its shadows, the counters and the plan it ran)
every `checkpoint_every` steps and when it stops;
`--resume` continues from these exactly when every stage's file is there and the plan is the
same, else from a stage checkpoint with fresh AdamW moments (the cold resume).

Not for: the step (:mod:`.run`).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from replaykv.model.checkpoint import load_model
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.pipeline.mesh import Mesh
from replaykv.train.pipeline.plan import RESIDUAL_FIELDS, StagePlan
from replaykv.train.pipeline.stage import StageModule
from replaykv.train.recipes import Recipe
from replaykv.train.setup import fresh_model, make_model
from replaykv.train.stages import cold_start, read_stage, save_export, write_stage

if TYPE_CHECKING:
    from replaykv.train.pipeline.run import PipelineArgs, TracedStage

REPORT = "pipeline.json"
STATE_DIR = "train_state/pipeline"


COUNTERS = ("step", "tokens", "seconds", "stage_seconds", "cold_from")


def state_path(out: Path, stage: int, stages: int) -> Path:
    return out / STATE_DIR / f"stage{stage}-of-{stages}.pt"


def plan_signature(plan: StagePlan, recipe: Recipe, micro_batches: int) -> dict[str, Any]:
    """What a resumable state must agree on with the run that continues it."""
    return {
        "recipe": recipe.name,
        "recipe_digest": recipe.digest(),
        "starts": list(plan.starts),
        "payload": plan.payload,
        "micro_batches": micro_batches,
    }


def starting_model(
    args: PipelineArgs, recipe: Recipe, out: Path, stage: int
) -> tuple[DeepseekV41ForCausalLM, dict[str, Any], dict[str, Any] | None]:
    """The weights every stage starts from (the same on every rank), the counters, and this
    stage's resumable state when `--resume` finds every stage's (then the weights come from it)."""
    if args.resume:
        paths = [state_path(out, i, args.stages) for i in range(args.stages)]
        if all(p.exists() for p in paths):
            state = torch.load(paths[stage], map_location="cpu", weights_only=False)
            return fresh_model(recipe), {k: state[k] for k in COUNTERS}, state
        cold = cold_start(recipe, out, None)
        if cold is None:
            raise FileNotFoundError(
                f"nothing to resume: no pipeline state in {out / STATE_DIR} for {args.stages} stages "
                f"and no stage checkpoint of recipe {recipe.name!r} in {out}"
            )
        info = read_stage(cold) or {}
        model = load_model(cold, dtype="float32")
        assert isinstance(model, DeepseekV41ForCausalLM)
        counters = {
            "step": int(info["step"]),
            "tokens": int(info["tokens"]),
            "seconds": float(info["seconds"]),
            "stage_seconds": dict(info.get("stage_seconds", {})),
            "cold_from": int(info["step"]),
        }
        return model.train(), counters, None
    counters = {"step": 0, "tokens": 0, "seconds": 0.0, "stage_seconds": {}, "cold_from": None}
    return make_model(recipe, args.init), counters, None


def restore_stage_state(
    module: StageModule, opt: torch.optim.Optimizer, state: dict[str, Any], signature: dict[str, Any]
) -> None:
    """Load this stage's resumable state, refusing one written by a different plan."""
    if state["plan"] != signature:
        raise ValueError(
            f"the pipeline state was written by another plan ({state['plan']}), not {signature}: "
            "resume with the same --pipeline-stages, --stage-boundaries, --pipeline-payload and "
            "--micro-batches, or remove train_state/pipeline/"
        )
    module.model.load_state_dict(state["model"])
    module.shadows.load_state_dict(state["shadows"])
    opt.load_state_dict(state["optimizer"])


def save_stage_state(
    out: Path,
    module: StageModule,
    opt: torch.optim.Optimizer,
    stages: int,
    signature: dict[str, Any],
    counters: dict[str, Any],
) -> None:
    """Atomically write this stage's resumable state."""
    path = state_path(out, module.stage, stages)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    record = {
        "model": module.model.state_dict(),
        "shadows": module.shadows.state_dict(),
        "optimizer": opt.state_dict(),
        "plan": signature,
        **{k: counters[k] for k in COUNTERS},
    }
    torch.save(record, tmp)
    os.replace(tmp, path)


def write_checkpoint(
    module: StageModule,
    plan: StagePlan,
    recipe: Recipe,
    directory: Path,
    mesh: Mesh,
    stage_info: dict[str, Any] | None,
) -> None:
    """Gather every stage's state dict on stage 0 and write one Hugging Face-format model (the
    shards of a stage hold the same weights: the first shard's pipeline writes it)."""
    if mesh.shard == 0:
        own = {k: v.detach().cpu() for k, v in module.model.state_dict().items()}
        parts: list[Any] = [None] * plan.stages if mesh.rank == 0 else []
        dist.gather_object(own, parts if mesh.rank == 0 else None, dst=0, group=mesh.column)
        if mesh.rank == 0:
            merged: dict[str, torch.Tensor] = {}
            for part in parts:
                merged.update(part)
            full = fresh_model(recipe)
            full.load_state_dict(merged, strict=True)
            if stage_info is None:
                save_export(full, directory)
            else:
                write_stage(full, directory, recipe, stage_info)
    dist.barrier()


def write_report(
    mesh: Mesh,
    args: PipelineArgs,
    plan: StagePlan,
    module: StageModule,
    pipe: TracedStage,
    times: list[float],
    busy: list[float],
    log: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """Stage 0 writes OUT/pipeline.json: the plan, bytes per boundary, step times, the bubble
    fraction measured (1 - busy time / step time, per stage) and each stage's shared-state trace
    of the last step (the first shard's pipeline, under context parallelism)."""
    if mesh.shard != 0:
        return None
    rank = mesh.stage
    mine = {
        "stage": rank,
        "median_step_seconds": statistics.median(times) if times else None,
        "median_busy_seconds": statistics.median(busy) if busy else None,
        "trace": module.trace.events,
        "sent": _boundary_bytes(module, plan, rank),
    }
    gathered: list[Any] = [None] * plan.stages if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0, group=mesh.column)
    if rank != 0:
        return None
    step_s = max(g["median_step_seconds"] or 0.0 for g in gathered)
    report = {
        "recipe": args.get_recipe().name,
        "stages": plan.stages,
        "context_parallel": mesh.shards,
        "micro_batches": args.micro_batches,
        "schedule": args.schedule,
        "boundaries": list(plan.starts[1:]),
        "plan": plan.describe(),
        "median_step_seconds": step_s,
        "bubble_fraction": {
            g["stage"]: (1.0 - g["median_busy_seconds"] / step_s) if step_s else None for g in gathered
        },
        "ideal_bubble_fraction": (plan.stages - 1) / (args.micro_batches + plan.stages - 1),
        "stage_reports": gathered,
        "log": log,
    }
    Path(args.out, REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _boundary_bytes(module: StageModule, plan: StagePlan, rank: int) -> dict[str, Any] | None:
    """Bytes one micro-batch sends over this stage's outgoing boundary, by field, next to the
    residual alone (what a pipeline of a model without CSA2 would send)."""
    sent = plan.sent(rank)
    by_field = module.last_sent
    if sent is None or by_field is None:
        return None
    return {
        "boundary_layer": sent.layer,
        "fields": by_field,
        "residual_bytes": sum(by_field[f] for f in RESIDUAL_FIELDS),
        "payload_bytes": sum(by_field.values()),
    }
