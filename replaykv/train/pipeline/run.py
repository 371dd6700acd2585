"""Pipeline-parallel training: `replaykv train --pipeline-stages P` on torch.distributed.

One process per stage (gloo on CPU, NCCL on GPUs), launched by `torchrun --nproc-per-node P`
or by the built-in spawner (:func:`launch`). The schedules are torch.distributed.pipelining's
(`ScheduleGPipe`, `Schedule1F1B`) over :class:`~replaykv.train.pipeline.stage.StageModule`;
what they lack for CSA2 is added around them:

* the extended payload and the shadow indexers (:mod:`replaykv.train.pipeline.plan`);
* gradient aggregation and parameter sync of the shadows: after each step's backward the
  replicas' gradients are summed with the owner's over a process group of the stages holding
  the component, the owner's optimizer steps, and the owner's values are broadcast back;
* gradient clipping by the norm over every stage's own parameters (an all-reduce of the
  squared norms: the same clip as a single process);
* the indexer KL of every stage carried into the backward (:class:`~.stage.AuxLoss`);
* checkpoints: the stages' state dicts are gathered on stage 0 into one Hugging Face-format
  model (stage checkpoints at the recipe's stage ends, and OUT/ at the end), which a
  single-process run and `replaykv serve` load unchanged; a pipeline run starts from any such
  checkpoint (`--init`, or `--resume` from a stage checkpoint: fresh AdamW moments and the
  recipe's re-warm-up, as a single-process cold resume).

Pipeline runs train the recipe's full path (every layer over every row); phases that put loss
on the follow-up paths (decoder or bounded replay) are refused by name. Not for: the stage plan
(:mod:`.plan`) or one stage's forward (:mod:`.stage`).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from replaykv.train.context import ContextShards
from replaykv.train.data import MixtureSampler, load_corpus
from replaykv.train.pipeline.loss import ShardLoss, WeightedLoss, shard_batch
from replaykv.train.pipeline.mesh import Mesh
from replaykv.train.pipeline.plan import RESIDUAL_FIELDS, StagePlan
from replaykv.train.pipeline.stage import StageModule
from replaykv.train.pipeline.state import (
    REPORT,
    plan_signature,
    restore_stage_state,
    save_stage_state,
    starting_model,
    write_checkpoint,
    write_report,
)
from replaykv.train.pipeline.sync import (
    aggregate_shadows,
    clip_gradients,
    component,
    own_tensors,
    shadow_groups,
    sum_over_shards,
    sync_shadows,
)
from replaykv.train.recipes import Recipe, get_recipe
from replaykv.train.setup import (
    RouterBalance,
    make_optimizer,
    resolve_device,
    set_index_topk,
    set_lr,
)
from replaykv.train.spawn import spawn
from replaykv.train.speed import StepSettings
from replaykv.train.stages import STAGE_DIR, rewarmed_lr

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class PipelineArgs:
    """Everything a stage process needs (picklable: the spawner sends it to each process)."""

    recipe: str
    out: str
    stages: int
    micro_batches: int
    schedule: str = "1f1b"
    boundaries: tuple[int, ...] | None = None
    steps: int | None = None
    init: str | None = None
    resume: bool = False
    device: str = "cpu"
    threads: int | None = None
    kernels: str = "eager"
    precision: str = "float32"
    stage_count: int | None = None  # stop after this many stage ends (as `--stages`)
    payload: str = "exact"  # how a group's state crosses a boundary (see plan.py)
    context: int = 1  # sequence shards per stage (context parallelism; processes = stages × context)
    save: bool = True
    # Test hooks: a recipe object instead of a name, and a path prefix each rank writes its
    # first step's gradients, its copy of every shared key projection after each step and its
    # final float32 parameters to (PREFIX.rankR).
    recipe_obj: Recipe | None = None
    dump_to: str | None = None

    @property
    def processes(self) -> int:
        return self.stages * self.context

    def get_recipe(self) -> Recipe:
        return self.recipe_obj if self.recipe_obj is not None else get_recipe(self.recipe)


class PipelineError(RuntimeError):
    """A stage process failed; the message is its error's last line."""


class TracedStage(PipelineStage):
    """A PipelineStage that times its forward and backward chunks and records the shared-state
    trace after each backward."""

    def __init__(self, module: StageModule, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self.stage_module = module
        self.busy = 0.0

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self.stage_module.micro = fwd_chunk_id
        try:
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.stage_module.micro = -1
        self.busy += time.perf_counter() - t0
        # Only the last stage's output is used by the schedule (for the loss); the schedule
        # keeps what this returns in a local until its next forward, past the backward.
        return out if self.is_last else None

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """The schedule keeps a send's handle (and the handle its tensor) until its next batch of
        transfers, after the micro-batch's backward; the shared-state fields are therefore sent
        from a copy (a send buffer) so that the state itself goes with the backward."""
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if len(ops) <= len(RESIDUAL_FIELDS):
            return ops
        return ops[: len(RESIDUAL_FIELDS)] + [
            dist.P2POp(op.op, op.tensor.clone(), op.peer, op.group, op.tag)
            for op in ops[len(RESIDUAL_FIELDS) :]
        ]

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.busy += time.perf_counter() - t0
        self.stage_module.trace.record("backward", bwd_chunk_id)
        return out


def launch(args: PipelineArgs) -> dict[str, Any] | None:
    """Run the pipeline: in this process when torchrun started it (RANK / WORLD_SIZE set), else
    in `args.processes` spawned processes. Returns stage 0's report (None on other torchrun ranks)."""
    _check_recipe(args.get_recipe(), args.context)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != args.processes:
            raise ValueError(
                f"torchrun started {world} processes for {args.stages} pipeline stages x {args.context} shards"
            )
        return worker(int(os.environ["RANK"]), args)
    return spawn(worker, args, args.processes, Path(args.out) / REPORT, PipelineError, "pipeline stage")


def _check_recipe(recipe: Recipe, context: int = 1) -> None:
    if context > 1:
        from replaykv.model.presets_v41 import get_preset_v41
        from replaykv.model.spec import ModelSpec

        spec = ModelSpec.from_config(get_preset_v41(recipe.preset))
        for phase in recipe.phases:
            shard, rest = divmod(phase.seq_len, context)
            if rest or shard % spec.group_alignment or shard < spec.sliding_window - 1:
                raise ValueError(
                    f"phase {phase.name!r} of recipe {recipe.name!r}: {phase.seq_len} tokens do not split into "
                    f"{context} shards of equal length, each a multiple of {spec.group_alignment} (the "
                    f"compression ratios) and at least {spec.sliding_window - 1} (the window's reach)"
                )
    for phase in recipe.phases:
        if phase.paths.decoder_replay > 0:
            raise NotImplementedError(
                f"pipeline-parallel training of the follow-up paths (decoder replay, bounded replay) is "
                f"not implemented: phase {phase.name!r} of recipe {recipe.name!r} puts loss on them; "
                "train it in one process"
            )
        if phase.record_keys > 0:
            raise NotImplementedError(
                f"the record-key loss (Phase.record_keys) of phase {phase.name!r} of recipe "
                f"{recipe.name!r} is not implemented under pipeline or context parallelism; train it "
                "in one process"
            )
        if phase.evidence_loss > 0:
            raise NotImplementedError(
                f"the evidence-attention loss (Phase.evidence_loss) of phase {phase.name!r} of recipe "
                f"{recipe.name!r} is not implemented under pipeline or context parallelism; train it "
                "in one process"
            )


def worker(rank: int, args: PipelineArgs) -> dict[str, Any] | None:
    """One stage's process: the whole training loop of that stage."""
    recipe = args.get_recipe()
    _check_recipe(recipe, args.context)
    dev = resolve_device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=args.processes)
    try:
        return _train(rank, args, recipe, dev)
    finally:
        dist.destroy_process_group()


def _train(rank: int, args: PipelineArgs, recipe: Recipe, dev: torch.device) -> dict[str, Any] | None:
    world = args.processes
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(max(1, threads // world))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = StepSettings.resolve(args.kernels, args.precision, dev)
    mesh = Mesh.build(args.stages, args.context, rank)
    model, counters, resumed = starting_model(args, recipe, out, mesh.stage)
    plan = StagePlan.build(model.config, args.stages, args.boundaries, args.payload)
    first, last = mesh.stage == 0, mesh.stage == args.stages - 1
    corpus = load_corpus(max_files=recipe.corpus_files) if first or last else None
    scale = recipe.indexer_loss / args.micro_batches
    rows = recipe.indexer_rows if recipe.indexer_loss > 0 else 0
    shards = ContextShards(mesh.shard, mesh.shards, mesh.row, mesh.row_ranks()) if mesh.shards > 1 else None
    module = StageModule(model, plan, mesh.stage, rows, scale, shards).to(dev)
    balance = RouterBalance(module.model, recipe.router_bias_rate)
    module.balance = balance
    opt = make_optimizer(module.model, recipe)
    signature = plan_signature(plan, recipe, args.micro_batches)
    if resumed is not None:
        restore_stage_state(module, opt, resumed, signature)
    groups = shadow_groups(plan, mesh)
    pipe = TracedStage(module, mesh.stage, args.stages, dev, group=mesh.column)
    loss_fn: WeightedLoss | ShardLoss = WeightedLoss() if shards is None else ShardLoss()
    schedule = SCHEDULES[args.schedule](pipe, args.micro_batches, loss_fn=loss_fn, scale_grads=False)
    from replaykv.model.spec import ModelSpec

    spec = ModelSpec.from_config(model.config)
    sampler = (
        MixtureSampler(corpus["train"], recipe, spec.sliding_window, spec.group_alignment) if corpus else None
    )
    step, tokens, seconds = counters["step"], counters["tokens"], counters["seconds"]
    stage_seconds: dict[str, float] = counters["stage_seconds"]
    end = recipe.total_steps if args.steps is None else min(args.steps, recipe.total_steps)
    if args.stage_count is not None:
        ahead = [e for e in recipe.stage_ends if e > step]
        end = min(end, ahead[min(args.stage_count, len(ahead)) - 1] if ahead else step)
    dump: dict[str, Any] = {"grads": None, "keys": [], "params": None}
    times: list[float] = []
    busy: list[float] = []
    log: list[dict[str, Any]] = []
    while step < end:
        t0 = time.perf_counter()
        phase = recipe.phase_at(step)
        set_index_topk(module, phase.index_topk, default=model.config.index_topk)  # the stage and its shadows
        batch = sampler.batch(step) if sampler is not None else None
        lr = rewarmed_lr(recipe, step, counters["cold_from"])
        set_lr(opt, lr)
        opt.zero_grad(set_to_none=True)
        module.shadows.zero_grad(set_to_none=True)
        module.trace.events.clear()
        pipe.busy = 0.0
        losses: list[torch.Tensor] = []
        with settings.applied(dev):
            ids = target = None
            if batch is not None:
                ids, target = batch.ids.to(dev), batch.targets.to(dev)
                if last:
                    loss_fn.total = target[:, 1:].sum()
                    if isinstance(loss_fn, WeightedLoss):
                        loss_fn.weight = phase.paths.full
                if shards is not None:
                    ids, target = shard_batch(ids, target, shards)
            if first and last:
                schedule.step(ids, target=target, losses=losses, return_outputs=False)
            elif first:
                schedule.step(ids, return_outputs=False)
            elif last:
                schedule.step(target=target, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        sum_over_shards(module, mesh)
        aggregate_shadows(module, plan, groups)
        if args.dump_to is not None and dump["grads"] is None:
            dump["grads"] = own_tensors(module, grads=True)
        grad_norm = clip_gradients(module, plan, recipe.grad_clip, mesh)
        opt.step()
        if mesh.shards > 1:  # expert loads over the whole sequence
            for counts in balance.counts.values():
                dist.all_reduce(counts, group=mesh.row)
        balance.update()
        sync_shadows(module, plan, groups, mesh)
        if args.dump_to is not None:
            copies = {s: component(module, plan, s) for s in groups}
            dump["keys"].append(
                {s: [t.detach().clone() for t in c] for s, c in copies.items() if c is not None}
            )
        step += 1
        dt = time.perf_counter() - t0
        times.append(dt)
        busy.append(pipe.busy)
        stats = torch.tensor(
            [float(sum(float(x.detach()) for x in losses)), float(phase.seq_len * phase.batch)]
        )
        dist.all_reduce(stats)  # only the last stage holds losses; stage 0 logs
        if batch is not None and first:
            tokens += batch.tokens
        seconds += dt
        key = str(recipe.stage_at(step - 1))
        stage_seconds[key] = stage_seconds.get(key, 0.0) + dt
        record = {
            "step": step,
            "phase": phase.name,
            "lr": lr,
            "loss": float(stats[0]),
            "grad_norm": grad_norm,
            "seconds": dt,
        }
        log.append(record)
        if mesh.rank == 0:
            print(f"pipeline step {step}: loss {record['loss']:.4f}, {dt:.2f} s", flush=True)
        counters.update(step=step, tokens=tokens, seconds=seconds, stage_seconds=stage_seconds)
        if args.save and mesh.shard == 0 and (step % recipe.checkpoint_every == 0 or step == end):
            save_stage_state(out, module, opt, args.stages, signature, counters)
        if args.save and step in recipe.stage_ends:
            write_checkpoint(
                module,
                plan,
                recipe,
                out / STAGE_DIR,
                mesh,
                {
                    "stage": recipe.stage_ends.index(step) + 1,
                    "step": step,
                    "tokens": tokens,
                    "seconds": seconds,
                    "stage_seconds": stage_seconds,
                    "final_loss": statistics.fmean(r["loss"] for r in log[-20:]),
                },
            )
    balance.remove()
    if args.dump_to is not None:
        dump["params"] = own_tensors(module, grads=False)
        torch.save(dump, f"{args.dump_to}.rank{rank}")
    if args.save and step >= recipe.total_steps and log:
        write_checkpoint(module, plan, recipe, out, mesh, None)  # the export, at the recipe's end
    return write_report(mesh, args, plan, module, pipe, times, busy, log)
