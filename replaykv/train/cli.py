"""`replaykv train`: train, resume or evaluate a recipe into an output directory.

    replaykv train --recipe small --out models/v41-small
    replaykv train --recipe small --out models/v41-small --resume          # continue after a stop
    replaykv train --recipe adapt --out models/v41-small-adapted --init models/v41-small
    replaykv train --recipe small --out models/v41-small --eval-only       # re-measure, rewrite card
    replaykv train --recipe small --out models/v41-small --resume --stages 1 --ship   # one stage
    replaykv train --recipe small --out /tmp/v41-small --device cuda --shard-size 16MiB   # on a GPU
    replaykv train --recipe tiny --out /tmp/pp --pipeline-stages 2 --micro-batches 4 --schedule 1f1b
    replaykv train --recipe small --out /tmp/pp --pipeline-stages 3 --stage-boundaries 4,8 --print-plan
    replaykv train --recipe tiny --out /tmp/clip --contrastive --processes 2 --pairs 4 --steps 10
    replaykv train --recipe small --out /tmp/clip --contrastive --init replaykv/weights/small

The process re-executes itself with glibc keeping freed memory (:mod:`replaykv.malloc`).

Dispatch only (the options are in :mod:`replaykv.train.cli_options`); the work is in :mod:`replaykv.train.loop` (:mod:`replaykv.train.pipeline.run` with
``--pipeline-stages``, :mod:`replaykv.train.multimodal.run` with ``--contrastive``). Not for:
serving the result.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from replaykv.cli_parser import usage_error
from replaykv.train.cli_options import (
    CONTRASTIVE_ONLY,
    CONTRASTIVE_OPTIONS,
    PIPELINE_UNSUPPORTED,
    build_parser,
    given_options,
)
from replaykv.train.recipes import Recipe, get_recipe


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:
        from replaykv.malloc import reexec_keeping_freed_memory

        reexec_keeping_freed_memory()
    import torch

    from replaykv.train.continuation import in_continuations, train_continuations
    from replaykv.train.loop import evaluate_only, train

    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = get_recipe(args.recipe)
    if args.contrastive:
        return _contrastive(recipe, args, given_options(argv))
    stray = [f"--{name.replace('_', '-')}" for name in CONTRASTIVE_ONLY if getattr(args, name)]
    if stray:
        verb = "applies" if len(stray) == 1 else "apply"
        return usage_error(f"{', '.join(stray)} {verb} only with --contrastive")
    if args.pipeline_stages is not None or args.print_plan or args.context_parallel > 1:
        return _pipeline(recipe, args)
    try:
        if args.bar or args.bar_traced:
            return _bar(recipe, args)
        if args.eval_only:
            evaluate_only(recipe, args.out, args.device, args.init)
            print(f"wrote {args.out}/metrics.json and MODEL_CARD.md")
            return 0
        shared: dict[str, Any] = {
            "stages": args.stages,
            "from_stage": args.from_stage,
            "ship": args.ship,
            "device": args.device,
            "progress": not args.no_progress,
            "micro_batch": args.micro_batch,
            "kernels": args.kernels,
            "precision": args.precision,
            "shard_bytes": args.shard_size,
        }
        if args.resume and in_continuations(recipe, args.out, args.from_stage):
            if args.steps is not None:
                return usage_error(f"--steps: {recipe.name}'s continuation stages run whole (use --stages)")
            result = train_continuations(recipe, args.out, **shared)
        else:
            result = train(
                recipe, args.out, resume=args.resume, max_steps=args.steps, init=args.init, **shared
            )
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = result.tokens / result.seconds if result.seconds else 0.0
    done = "exported" if result.exported else f"stopped at step {result.steps} (continue with --resume)"
    print(
        f"{recipe.name}: {result.steps} steps, {result.tokens:,} tokens, {result.seconds:.0f} s ({rate:,.0f} tokens/s); {done}"
    )
    return 0


def _pipeline(recipe: Recipe, args: argparse.Namespace) -> int:
    from replaykv.model.presets_v41 import get_preset_v41
    from replaykv.train.pipeline.plan import StagePlan
    from replaykv.train.pipeline.run import PipelineArgs, PipelineError, launch

    stages = args.pipeline_stages or 1
    try:
        bounds = tuple(int(x) for x in args.stage_boundaries.split(",")) if args.stage_boundaries else None
    except ValueError:
        print(
            f"error: --stage-boundaries takes comma-separated layers, got {args.stage_boundaries!r}",
            file=sys.stderr,
        )
        return 2
    try:
        plan = StagePlan.build(get_preset_v41(recipe.preset), stages, bounds, args.pipeline_payload)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_plan:
        print(plan.describe())
        if args.context_parallel > 1:
            print(
                f"each stage in {args.context_parallel} sequence shards (context parallelism): "
                f"{stages * args.context_parallel} processes; a group crosses a boundary as each shard's part"
            )
        return 0
    given = [f"--{name.replace('_', '-')}" for name in PIPELINE_UNSUPPORTED if getattr(args, name)]
    if given:
        print(f"error: {', '.join(given)} not implemented with --pipeline-stages", file=sys.stderr)
        return 2
    micro = args.micro_batches or stages
    if args.schedule == "1f1b" and micro < stages:
        print(f"error: the 1f1b schedule needs at least {stages} micro-batches, got {micro}", file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else ("cuda" if torch_cuda() else "cpu")
    run = PipelineArgs(
        recipe.name,
        args.out,
        stages,
        micro,
        args.schedule,
        bounds,
        steps=args.steps,
        init=args.init,
        resume=args.resume,
        device=device,
        threads=args.threads,
        kernels=args.kernels,
        precision=args.precision,
        stage_count=args.stages,
        payload=args.pipeline_payload,
        context=args.context_parallel,
    )
    try:
        report = launch(run)
    except (FileExistsError, FileNotFoundError, ValueError, NotImplementedError, PipelineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report is not None:
        print(
            f"{recipe.name}: {stages} stage(s) x {args.context_parallel} shard(s), {micro} micro-batches "
            f"({args.schedule}); median step "
            f"{report['median_step_seconds']:.2f} s; report in {args.out}/pipeline.json"
        )
    return 0


def _contrastive(recipe: Recipe, args: argparse.Namespace, given: dict[str, str]) -> int:
    import os
    from pathlib import Path

    from replaykv.model.presets_v41 import PRESETS_V41
    from replaykv.train.multimodal.run import REPORT, VISION_DIR, ContrastiveArgs, ContrastiveError, launch

    refused = [flag for dest, flag in given.items() if dest not in CONTRASTIVE_OPTIONS]
    if refused:
        return usage_error(f"{', '.join(refused)} not implemented with --contrastive")
    if args.device.startswith("cuda") and not torch_cuda():
        return usage_error(f"--device {args.device}: no CUDA device is available")
    if args.device not in ("auto", "cpu", "cuda"):
        return usage_error(
            f"--device {args.device}: the contrastive stage takes auto, cpu or cuda (one GPU per process)"
        )
    preset = f"{recipe.preset}-vision"
    if preset not in PRESETS_V41:
        vision = sorted(name for name in PRESETS_V41 if name.endswith("-vision"))
        return usage_error(
            f"--contrastive: recipe {recipe.name!r} trains preset {recipe.preset!r}, which has no "
            f"vision variant {preset!r} (presets with a tower: {', '.join(vision)})"
        )
    if args.init is not None:
        if not (Path(args.init) / "config.json").is_file():
            return usage_error(f"--init {args.init}: not a model directory (no config.json)")
        try:
            mismatch = _text_mismatch(args.init, preset)
        except (KeyError, TypeError, ValueError) as e:
            return usage_error(f"--init {args.init}: unreadable config.json ({e})")
        if mismatch:
            return usage_error(
                f"--init {args.init}: its weights do not fit preset {preset!r} of recipe {recipe.name!r} "
                f"({mismatch})"
            )
    started = int(os.environ.get("WORLD_SIZE", "0"))  # torchrun's processes, when it started us
    if started and args.processes not in (None, started):
        return usage_error(f"--processes {args.processes}, but torchrun started {started} processes")
    run = ContrastiveArgs(
        preset=preset,
        out=args.out,
        processes=args.processes or started or 2,
        steps=args.steps or ContrastiveArgs.steps,
        pairs=args.pairs or ContrastiveArgs.pairs,
        overlap=not args.blocking_gathers,
        init=args.init,
        threads=args.threads,
        device=args.device if args.device != "auto" else ("cuda" if torch_cuda() else "cpu"),
    )
    try:
        report = launch(run)
    except (FileNotFoundError, ValueError, ContrastiveError) as e:
        return usage_error(str(e))
    if report is None:  # a torchrun process other than rank 0
        return 0
    steps, median = report["steps"], report["median"]
    gathers = "blocking" if args.blocking_gathers else "overlapped"
    print(
        f"{recipe.name} contrastive ({preset}): {len(steps)} steps, {run.processes} processes x "
        f"{run.pairs} pairs, final loss {steps[-1]['loss']:.4f}; median exposed gather ({gathers}): "
        f"image {median['image_gather'] * 1e3:.2f} ms, text {median['text_gather'] * 1e3:.2f} ms; "
        f"wrote {Path(args.out) / REPORT}, the export and {Path(args.out) / VISION_DIR}/"
    )
    return 0


def _text_mismatch(init: str, preset: str) -> str | None:
    """What keeps `init`'s weights out of `preset`'s model (its language model's, and its tower's if
    it has one; shapes compared on the meta device, nothing loaded), or None when they fit."""
    import torch

    from replaykv.model.checkpoint import build_model, load_config
    from replaykv.model.presets_v41 import get_preset_v41

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in build_model(get_preset_v41(preset)).state_dict().items()}
        have = {k: tuple(v.shape) for k, v in build_model(load_config(init)).state_dict().items()}
    for key, shape in have.items():
        if key not in want and not key.startswith("model.vision."):
            return f"the preset has no {key}"
        if key in want and want[key] != shape:  # a tower of another shape does not load either
            return f"{key} is {list(shape)} in it, {list(want[key])} in the preset"
    absent = [k for k in want if not k.startswith("model.vision.") and k not in have]
    return f"it has no {absent[0]}" if absent else None


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bar(recipe: Recipe, args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from replaykv.train.setup import resolve_device
    from replaykv.train.stages import STAGE_DIR, evaluate_stage, ship_stage, shipped_dir

    try:
        lengths = tuple(int(x) for x in args.bar_lengths.split(",")) if args.bar_lengths else None
    except ValueError:
        print(
            f"error: --bar-lengths takes comma-separated integers, got {args.bar_lengths!r}", file=sys.stderr
        )
        return 2
    directory = Path(args.from_stage) if args.from_stage else Path(args.out) / STAGE_DIR
    if args.bar_traced and recipe.bar is not None:
        recipe = replace(recipe, bar=replace(recipe.bar, trace_hops=True, trace_chains=True))
    result = evaluate_stage(recipe, directory, resolve_device(args.device), lengths)
    print(f"{directory}: rung {result['rung']}; wrote bar.json, MODEL_CARD.md, stage.json")
    target = shipped_dir(recipe)
    if args.ship and target is not None:
        ship_stage(directory, target)
        print(f"copied to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
