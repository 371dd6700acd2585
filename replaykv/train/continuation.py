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
A run of the same one-phase recipe made elsewhere (a pilot arm of scripts/pilot_lookups.py) can
be installed as stage S instead (`adopt_run`) once its settings and starting weights are checked.

Not for: the recipe's own stages (:mod:`replaykv.train.loop`), scoring and shipping a stage
(:mod:`replaykv.train.stages`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

from replaykv.model.checkpoint import weight_files
from replaykv.train.data import Corpus
from replaykv.train.loop import TrainResult, train
from replaykv.train.recipe_spec import Mixture, Paths, Phase, Recipe
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
    last: list[float] = []
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
        if run.steps < sub.total_steps:  # SIGTERM: the state is saved
            info = point.info
            return TrainResult(
                int(info["step"]) + run.steps,
                int(info["tokens"]) + run.tokens,
                float(info["seconds"]) + run.seconds,
                run.losses,
                out,
                False,
            )
        record = _install_next(recipe, out, point, number, work, _ended_stage(sub, work, shard_bytes))
        if ship and shipped_dir(recipe) is not None:
            ship_stage(out / STAGE_DIR, shipped_dir(recipe))  # type: ignore[arg-type]
        print(
            f"stage {number} of {recipe.name} ended at step {record['step']}: checkpoint in {out / STAGE_DIR}"
        )
        point = StagePoint(out / STAGE_DIR, record)
        last = run.losses
        done += 1
    info = point.info
    return TrainResult(int(info["step"]), int(info["tokens"]), float(info["seconds"]), last, out, False)


def _install_next(
    recipe: Recipe, out: Path, point: StagePoint, number: int, run: Path, ended: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """Install the checkpoint of the finished one-phase run in `run` (its own stage record
    `ended`) in OUT/stage/ as stage `number`, the one after `point`, under the recipe's record:
    the global step, tokens and seconds of every stage so far; returns that record."""
    info = point.info
    sub = recipe.continued(number - len(recipe.stage_ends) - 1)
    record = {
        "stage": number,
        "step": int(info["step"]) + int(ended["step"]),
        "tokens": int(info["tokens"]) + int(ended["tokens"]),
        "seconds": float(info["seconds"]) + float(ended["seconds"]),
        "stage_seconds": {**info.get("stage_seconds", {}), str(number): float(ended["seconds"])},
        "final_loss": ended["final_loss"],
        "continuation": sub.name,
        "continuation_digest": sub.digest(),
        **extra,
    }
    tmp = out / (STAGE_DIR + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(run / STAGE_DIR, tmp)
    return install_stage(tmp, out / STAGE_DIR, recipe, record)


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


def adopt_run(recipe: Recipe, out: str | Path, run: str | Path, started_from: str | Path) -> dict[str, Any]:
    """Install the finished run in `run` (its recipe.json and stage/ checkpoint, as
    :func:`replaykv.train.loop.train` writes them) as the next stage of `recipe` in OUT/stage/,
    as `train_continuations` would have: only if its recipe equals that continuation's
    (`Recipe.continued`) in every field but its name and save interval (a field its recipe.json
    lacks counting as the default), it ran every step, and the weights it started from
    (`started_from`) are the furthest stage checkpoint's, byte for byte. Returns the record."""
    out, run = Path(out), Path(run)
    own = len(recipe.stage_ends)
    point = furthest_stage(recipe, out)
    if point is None or not own <= point.stage < recipe.stage_count:
        raise ValueError(
            f"recipe {recipe.name!r}: no continuation stage follows the furthest stage checkpoint"
        )
    number = point.stage + 1
    sub = recipe.continued(number - own - 1)
    differ = _recipe_differences(asdict(sub), json.loads((run / "recipe.json").read_text()))
    if differ:
        raise ValueError(
            f"{run} ran another recipe than stage {number} ({sub.name}): {', '.join(differ)} differ"
        )
    ended = read_stage(run / STAGE_DIR)
    if ended is None or int(ended["step"]) != sub.total_steps:
        raise ValueError(f"{run} holds no checkpoint of its last step ({sub.total_steps})")
    if _weights_digest(Path(started_from)) != _weights_digest(point.directory):
        raise ValueError(f"{started_from}'s weights are not those of stage {point.stage} ({point.directory})")
    return _install_next(recipe, out, point, number, run, ended, adopted_from=str(run))


def _recipe_differences(want: Any, ran: Any, where: str = "") -> list[str]:
    """Fields of `ran` (a recipe.json) that differ from `want` (asdict of a recipe), names and the
    save interval aside; a field `ran` lacks must hold its dataclass default in `want`. A phase
    with a cycle of row shapes never uses its own seq_len, batch and micro_batch (`Phase.at`), so
    where both cycles are given those three are not compared."""
    if isinstance(want, dict) and isinstance(ran, dict):
        differ = []
        skip = {"name", "checkpoint_every"}
        if want.get("cycle") and ran.get("cycle"):
            skip |= {"seq_len", "batch", "micro_batch"}
        for key, value in want.items():
            if key in skip:
                continue
            if key not in ran:
                if key not in _DEFAULTS or json.dumps(_DEFAULTS[key]) != json.dumps(value):
                    differ.append(where + key)
            else:
                differ += _recipe_differences(value, ran[key], f"{where}{key}.")
        return differ
    if isinstance(want, (list, tuple)) and isinstance(ran, list) and len(want) == len(ran):
        return [
            d
            for i, (a, b) in enumerate(zip(want, ran, strict=True))
            for d in _recipe_differences(a, b, f"{where}{i}.")
        ]
    return [] if json.loads(json.dumps(want)) == ran else [where.rstrip(".")]


# The defaults of every field a recipe.json holds, for fields added after it was written.
_DEFAULTS: dict[str, Any] = {
    name: f.default
    for cls in (Recipe, Phase, Mixture, Paths)
    for name, f in cls.__dataclass_fields__.items()
    if f.default is not MISSING
}


def _weights_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for f in weight_files(directory):
        h.update(f.read_bytes())
    return h.hexdigest()
