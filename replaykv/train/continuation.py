"""Continuation stages (:attr:`Recipe.continuations`): where a resumed run stands among them, running
the next ones, and the stage checkpoint each one leaves.

Stage S after the recipe's own stages is ``recipe.continued(i)`` (a one-phase recipe), trained by
:func:`replaykv.train.loop.train` into OUT/continue/S/ from stage S - 1's checkpoint with fresh
AdamW moments. The furthest stage checkpoint of the recipe is the start: OUT/stage/ or, when it
holds an earlier stage or none, the committed one (or `from_stage` when given). When stage S ends
its export replaces OUT/stage/ under a stage record of the whole recipe: stage S of
`Recipe.stage_count`, the global step, tokens and step times of every stage so far, the
continuation's name and digest. An interrupted continuation resumes exactly from
OUT/continue/S/train_state/ on the same machine; on another it starts again from stage S - 1.

Not for: the recipe's own stages (:mod:`replaykv.train.loop`), scoring and shipping a stage
(:mod:`replaykv.train.stages`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

from replaykv.train.data import Corpus
from replaykv.train.loop import TrainResult, train
from replaykv.train.recipe_spec import Recipe
from replaykv.train.setup import fresh_model, set_index_topk
from replaykv.train.stages import (
    STAGE_DIR,
    install_stage,
    read_stage,
    ship_stage,
    shipped_dir,
    write_stage,
)
from replaykv.train.state import STATE, saved_progress

CONTINUE_DIR = "continue"


@dataclass(frozen=True)
class StagePoint:
    """A stage checkpoint of a recipe: where it is and its stage.json record."""

    directory: Path
    info: dict[str, Any]

    @property
    def stage(self) -> int:
        return int(self.info["stage"])


def furthest_stage(recipe: Recipe, out: Path, from_stage: str | Path | None = None) -> StagePoint | None:
    """The recipe's stage checkpoint with the highest stage number among OUT/stage/ and
    `from_stage` (None: the recipe's committed one); None when neither holds one of this
    recipe."""
    candidates = [out / STAGE_DIR]
    if from_stage is not None:
        candidates.append(Path(from_stage))
    elif shipped_dir(recipe) is not None:
        candidates.append(shipped_dir(recipe))  # type: ignore[arg-type]
    best: StagePoint | None = None
    for c in candidates:
        info = read_stage(c)
        if info is None or info.get("recipe") != recipe.name:
            continue
        point = StagePoint(c, info)
        if best is None or point.stage > best.stage:
            best = point
    return best


def in_continuations(recipe: Recipe, out: str | Path, from_stage: str | Path | None = None) -> bool:
    """Whether a resumed run of `recipe` into `out` goes on in its continuation stages: it has
    some, OUT holds no unfinished state of the recipe's own stages, and its furthest stage
    checkpoint is the last of its own stages or later."""
    out = Path(out)
    if not recipe.continuations:
        return False
    progress = saved_progress(out / STATE)
    if progress is not None and progress[0] == recipe.name and progress[1] < recipe.total_steps:
        return False
    point = furthest_stage(recipe, out, from_stage)
    return point is not None and point.stage >= len(recipe.stage_ends)


def train_continuations(
    recipe: Recipe,
    out: str | Path,
    stages: int | None = None,
    from_stage: str | Path | None = None,
    ship: bool = False,
    device: str = "auto",
    progress: bool = True,
    kernels: str = "fused",
    precision: str = "float32",
    shard_bytes: int | None = None,
    micro_batch: int | None = None,
    corpus: dict[str, Corpus] | None = None,
) -> TrainResult:
    """Run the continuation stages after the furthest stage checkpoint (at most `stages` of them;
    None: all), each into OUT/continue/S/, its checkpoint then installed in OUT/stage/ (and with
    `ship`, in the package directory). Returns the last stage's run, in global figures: its
    global step, the tokens and step seconds of every stage so far. Stops early, its state
    saved, on SIGTERM."""
    out = Path(out)
    own = len(recipe.stage_ends)
    point = furthest_stage(recipe, out, from_stage)
    if point is None or point.stage < own:
        raise FileNotFoundError(
            f"recipe {recipe.name!r}: its continuation stages start from stage {own}'s checkpoint, "
            f"and {out / STAGE_DIR} holds " + (f"stage {point.stage}" if point else "none")
        )
    result: TrainResult | None = None
    done = 0
    while point.stage < recipe.stage_count and (stages is None or done < stages):
        number = point.stage + 1
        sub = recipe.continued(number - own - 1)
        work = out / CONTINUE_DIR / str(number)
        resume = (work / STATE).exists()
        # a fresh compile, as on a machine that runs this stage alone: the compiled kernels'
        # variants depend on the row shapes that came before
        torch._dynamo.reset()
        run = train(
            sub,
            work,
            resume=resume,
            device=device,
            init=None if resume else point.directory,
            progress=progress,
            evaluate_at_end=False,
            kernels=kernels,
            precision=precision,
            shard_bytes=shard_bytes,
            micro_batch=micro_batch,
            corpus=corpus,
        )
        info = point.info
        result = TrainResult(
            int(info["step"]) + run.steps,
            int(info["tokens"]) + run.tokens,
            float(info["seconds"]) + run.seconds,
            run.losses,
            out,
            False,
        )
        if run.steps < sub.total_steps:  # SIGTERM: the state is saved
            return result
        ended = _ended_stage(sub, work, shard_bytes)
        record = {
            "stage": number,
            "step": result.steps,
            "tokens": result.tokens,
            "seconds": result.seconds,
            "stage_seconds": {**info.get("stage_seconds", {}), str(number): run.seconds},
            "final_loss": ended["final_loss"],
            "continuation": sub.name,
            "continuation_digest": sub.digest(),
        }
        tmp = out / (STAGE_DIR + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(work / STAGE_DIR, tmp)
        install_stage(tmp, out / STAGE_DIR, recipe, record)
        if ship and shipped_dir(recipe) is not None:
            ship_stage(out / STAGE_DIR, shipped_dir(recipe))  # type: ignore[arg-type]
        print(
            f"stage {number} of {recipe.name} ended at step {result.steps}: checkpoint in {out / STAGE_DIR}"
        )
        point = StagePoint(out / STAGE_DIR, read_stage(out / STAGE_DIR) or record)
        done += 1
    if result is None:
        return TrainResult(
            int(point.info["step"]), int(point.info["tokens"]), float(point.info["seconds"]), [], out, False
        )
    return result


def _ended_stage(sub: Recipe, work: Path, shard_bytes: int | None) -> dict[str, Any]:
    """stage.json of the finished continuation run in `work`, written from its saved state when
    the run stopped between saving the state and writing the checkpoint."""
    info = read_stage(work / STAGE_DIR)
    if info is not None:
        return info
    state = torch.load(work / STATE, map_location="cpu", weights_only=False)
    model = fresh_model(sub)
    model.load_state_dict(state["model"])
    set_index_topk(model, sub.phases[-1].index_topk)
    meta = {k: state[k] for k in ("step", "tokens", "seconds", "stage_seconds")}
    return write_stage(
        model, work / STAGE_DIR, sub, {"stage": 1, **meta, "final_loss": float("nan")}, shard_bytes
    )
