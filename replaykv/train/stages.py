"""Stage checkpoints: what a stage of a recipe leaves behind, how a run on a machine without
the full training state continues from one, and how a stage is measured against the shipping
bar and shipped.

A stage checkpoint is a directory holding the export (config.json, model.safetensors in bf16
with router biases and mHC parameters in float32, tokenizer files) and stage.json:

    recipe, recipe_digest, stages   which recipe and how many stages it has
    stage, step, tokens, seconds    where the run stood at the stage's end
    stage_seconds                   the sum of step times of each stage so far
    final_loss                      mean training loss over the stage's last 20 steps
    rung, bar_digest                the rung it reached on the bar (after `--bar`), else absent

The package directory of a recipe (`replaykv/weights/<Recipe.ship_as>/`) holds the last committed
stage; `serve` loads it by default only once its rung is ≥ 1. Not for: the training loop itself
(see :mod:`replaykv.train.loop`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from replaykv.model.checkpoint import (
    INDEX_FILE,
    cast_model,
    has_weights,
    load_model,
    save_pretrained,
    weight_files,
)
from replaykv.tokenizer import ByteTokenizer
from replaykv.train.recipes import Recipe

STAGE_DIR = "stage"
STAGE_FILE = "stage.json"
BAR_FILE = "bar.json"
MAX_EXPORT_BYTES = 30 * 1024 * 1024
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"


def shipped_dir(recipe: Recipe) -> Path | None:
    """The package directory this recipe's committed stage checkpoints live in, if any."""
    return WEIGHTS_DIR / recipe.ship_as if recipe.ship_as else None


def read_stage(directory: str | Path) -> dict[str, Any] | None:
    """stage.json of a stage checkpoint, or None when `directory` holds none."""
    path = Path(directory) / STAGE_FILE
    if not (path.is_file() and has_weights(directory)):
        return None
    return dict(json.loads(path.read_text()))


def save_export(model: nn.Module, directory: Path, shard_bytes: int | None = None) -> None:
    """The shipped form of `model` in `directory`: bf16 safetensors (float32 where every export
    keeps it; in shards of at most `shard_bytes` when given), config.json and the tokenizer
    files; warns past the 30 MiB budget."""
    from replaykv.train.setup import index_topk_in_force

    shipped: Any = cast_model(copy.deepcopy(model).cpu(), torch.bfloat16)
    topk = index_topk_in_force(model)
    if topk is not None and topk != shipped.config.index_topk:  # a phase's setting (Phase.index_topk)
        shipped.config = shipped.config.replace(index_topk=topk)
    save_pretrained(shipped, directory, shard_bytes)
    ByteTokenizer().save(directory)
    size = sum(f.stat().st_size for f in weight_files(directory))
    if size > MAX_EXPORT_BYTES:
        print(f"warning: the weights in {directory} are {size / 2**20:.1f} MiB, over the 30 MiB budget")


def write_stage(
    model: nn.Module, directory: Path, recipe: Recipe, info: dict[str, Any], shard_bytes: int | None = None
) -> dict[str, Any]:
    """Write a stage checkpoint (bf16 export, tokenizer, stage.json) into `directory`, replacing
    what was there; returns the stage.json record. The files are written beside and renamed in,
    so an interrupted write leaves the previous checkpoint whole."""
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_export(model, tmp, shard_bytes)
    return install_stage(tmp, directory, recipe, info)


def install_stage(tmp: Path, directory: Path, recipe: Recipe, info: dict[str, Any]) -> dict[str, Any]:
    """Write stage.json (the recipe's name and digest, its stage count, torch, then `info`) and a
    card into `tmp`, which holds an export, and rename it to `directory` in place of the
    checkpoint there; returns the stage.json record. The card is unscored until `--bar` scores
    the stage, unless `tmp` came with a bar.json of the recipe's own bar (`--bar-traced` too),
    scored on these very weights (a pilot's checkpoint scored before it was adopted): then that
    result is the stage's, its rung goes into the record and the card shows it."""
    record = {
        "recipe": recipe.name,
        "recipe_digest": recipe.digest(),
        "stages": recipe.stage_count,
        "torch": torch.__version__,
        **info,
    }
    result = _carried_bar(tmp, recipe)
    table: list[str] = []
    if result is None:
        (tmp / BAR_FILE).unlink(missing_ok=True)
    else:
        from replaykv.train.bar import bar_table

        record.update(rung=result["rung"], bar_digest=result["spec_digest"])
        result["stage"] = {k: record.get(k) for k in ("stage", "step", "tokens", "seconds", "recipe_digest")}
        (tmp / BAR_FILE).write_text(json.dumps(result, indent=2) + "\n")
        table = bar_table(result)
    (tmp / STAGE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    (tmp / "MODEL_CARD.md").write_text(stage_card(recipe, record, result, table))
    directory.parent.mkdir(parents=True, exist_ok=True)
    old = directory.with_name(directory.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old.exists():
        shutil.rmtree(old)
    return record


def _carried_bar(tmp: Path, recipe: Recipe) -> dict[str, Any] | None:
    """The bar.json in `tmp` when it scored `recipe`'s bar, plain or traced; else None."""
    path = tmp / BAR_FILE
    if recipe.bar is None or not path.exists():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    traced = replace(recipe.bar, trace_hops=True, trace_chains=True)
    return result if result.get("spec_digest") in (recipe.bar.digest(), traced.digest()) else None


def ship_stage(source: Path, target: Path) -> None:
    """Copy a stage checkpoint's files into the package directory `target`. Files of the
    previous checkpoint that the new one lacks go: weights sharded otherwise, and a bar.json
    that scored another stage (the new stage's card then says it is not scored yet)."""
    target.mkdir(parents=True, exist_ok=True)
    for stale in [*target.glob("model*.safetensors"), target / INDEX_FILE, target / BAR_FILE]:
        if not (source / stale.name).exists():
            stale.unlink(missing_ok=True)
    for f in source.iterdir():
        if f.is_file():
            shutil.copy2(f, target / f.name)


def cold_start(recipe: Recipe, out: Path, source: str | Path | None) -> Path | None:
    """The stage checkpoint a run without its full state continues from: `source` when given,
    else OUT/stage/, else the recipe's committed one; None when there is none."""
    candidates = [Path(source)] if source is not None else [out / STAGE_DIR]
    if source is None and shipped_dir(recipe) is not None:
        candidates.append(shipped_dir(recipe))  # type: ignore[arg-type]
    for c in candidates:
        info = read_stage(c)
        if info is not None:
            if info.get("recipe") != recipe.name:
                raise ValueError(f"{c} is a stage of recipe {info.get('recipe')!r}, not {recipe.name!r}")
            return c
    if source is not None:
        raise FileNotFoundError(f"{source} holds no stage checkpoint ({STAGE_FILE} + safetensors weights)")
    return None


def cold_config(recipe: Recipe, directory: Path) -> Any:
    """The config a cold resume from the stage checkpoint in `directory` trains with: the
    recipe's preset, which may differ from the checkpoint's config.json in settings that shape
    no parameter (e.g. `index_topk`); a difference that shapes one fails when the weights load.
    Prints the fields that differ."""
    from replaykv.model.checkpoint import load_config
    from replaykv.model.presets_v41 import get_preset_v41

    preset = get_preset_v41(recipe.preset)
    saved = load_config(directory)
    changed = {
        k: (v, getattr(preset, k))
        for k, v in saved.to_dict().items()
        if k in preset.to_dict() and preset.to_dict()[k] != v and k not in ("dtype", "torch_dtype")
    }
    if changed:
        text = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
        print(
            f"note: {directory}'s config differs from preset {recipe.preset!r}; training with the preset's: {text}"
        )
    return preset


def rewarmed_lr(recipe: Recipe, step: int, cold_from: int | None) -> float:
    """The schedule's rate at `step`, ramped over `recipe.rewarmup` steps after a cold resume at
    step `cold_from` (None: no ramp)."""
    lr = recipe.lr_at(step)
    if cold_from is not None and recipe.rewarmup > 0 and step - cold_from < recipe.rewarmup:
        lr *= (step - cold_from + 1) / (recipe.rewarmup + 1)
    return lr


def evaluate_stage(
    recipe: Recipe,
    directory: str | Path,
    device: torch.device,
    lengths: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Score the stage checkpoint in `directory` on the recipe's bar (at `lengths`, default every
    length of the bar), write bar.json and MODEL_CARD.md there and the rung into stage.json."""
    from replaykv.train.bar import bar_table, evaluate_bar
    from replaykv.train.data import load_corpus

    directory = Path(directory)
    info = read_stage(directory)
    if info is None:
        raise FileNotFoundError(f"{directory} holds no stage checkpoint ({STAGE_FILE} + safetensors weights)")
    if recipe.bar is None:
        raise ValueError(f"recipe {recipe.name!r} has no shipping bar")
    corpus = load_corpus(max_files=recipe.corpus_files)
    model = load_model(directory, dtype="float32").to(device)
    result = evaluate_bar(model, corpus["heldout"], recipe.bar, lengths)
    result["stage"] = {k: info.get(k) for k in ("stage", "step", "tokens", "seconds", "recipe_digest")}
    (directory / BAR_FILE).write_text(json.dumps(result, indent=2) + "\n")
    info.update(rung=result["rung"], bar_digest=result["spec_digest"])
    (directory / STAGE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (directory / "MODEL_CARD.md").write_text(stage_card(recipe, info, result, bar_table(result)))
    return result


def stage_card(recipe: Recipe, info: dict[str, Any], result: dict[str, Any] | None, table: list[str]) -> str:
    """MODEL_CARD.md of a stage checkpoint: what it is, how far training got, the bar's table
    (`result` None: not scored yet)."""
    stage_times = ", ".join(
        f"stage {k}: {v / 60:.0f} min"
        for k, v in sorted(info.get("stage_seconds", {}).items(), key=lambda kv: int(kv[0]))
    )
    lines = [
        f"# replaykv {recipe.preset}: recipe `{recipe.name}`, stage {info['stage']} of {info['stages']}",
        "",
        f"A DeepSeek-V4.1-shaped byte-level model trained by `replaykv train --recipe {recipe.name}` "
        f"(digest `{info.get('recipe_digest')}`) to step {info['step']:,} of {recipe.final_step:,} "
        f"({info['tokens']:,} tokens; sum of step times {info['seconds'] / 3600:.2f} h: {stage_times}; "
        f"torch {info.get('torch', '?')}). Mean training loss over the stage's last 20 steps: "
        f"{info.get('final_loss', float('nan')):.3f}.",
        "",
    ]
    if info.get("continuation"):
        lines += [
            f"A continuation stage: recipe `{info['continuation']}` (digest "
            f"`{info.get('continuation_digest')}`), one phase trained from stage {info['stage'] - 1}'s "
            "checkpoint with fresh optimiser moments.",
            "",
        ]
    if result is None:
        lines += [
            "Not scored on the shipping bar yet (`replaykv train --recipe "
            f"{recipe.name} --out DIR --bar`); until it is, `replaykv serve` does not load it unless "
            "named with --model.",
            "",
        ]
        return "\n".join(lines)
    lines += [
        f"Rung {result['rung']} of the shipping bar"
        + (
            " — below rung 1 this checkpoint is here so that training can continue on another machine "
            "(`replaykv train --recipe small --out DIR --resume`); `replaykv serve` does not load it "
            "unless named with --model."
            if result["rung"] < 1
            else "."
        ),
        "",
        "Held-out cases (their own seed, filler from held-out files), accuracy % [Wilson 95%] (n). "
        "Chance is a blind guess among the answers the prompt offers.",
        "",
        *table,
        "",
    ]
    return "\n".join(lines)
