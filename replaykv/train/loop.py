"""The training loop: AdamW with warmup + cosine, gradient clipping, a fixed seed, a progress bar
with loss and tokens/s, periodic held-out evaluation, checkpoint + resume, and the final export
(bf16 safetensors in Hugging Face layout, tokenizer.json, metrics.json and MODEL_CARD.md).

Besides the language-model loss on the recipe's paths, two pieces of DeepSeek's recipe keep the
sparse machinery alive: the indexer KL (see :class:`replaykv.train.distill.IndexerDistillation`)
and aux-loss-free expert balancing (:class:`RouterBalance`). Everything random is a function of
(seed, step), and the optimiser, step, RNG states and router biases are checkpointed, so a
resumed run continues exactly as an uninterrupted one.

Output directory layout:

    OUT/config.json, model.safetensors, tokenizer.json   the export (the shipped checkpoint)
    OUT/MODEL_CARD.md, metrics.json, recipe.json         what it is and how it scored
    OUT/train_log.jsonl                                  one line per logged step / eval
    OUT/train_state/state.pt                             resumable state (not for shipping)
    OUT/stage/                                           the last finished stage's checkpoint:
                                                         the export's files + stage.json

A recipe runs in stages (:attr:`Recipe.stages`). At the end of each the loop writes a stage
checkpoint: the weights in bf16 (router biases and mHC parameters in float32, as every export)
and stage.json (recipe, digest, stage, step, tokens, seconds per stage). `--resume` continues
from OUT/train_state/ exactly when it is there; otherwise from a stage checkpoint (OUT/stage/,
or the one committed under replaykv/weights/) with fresh AdamW moments and `Recipe.rewarmup`
steps of re-warm-up: the data and the schedule continue where the stage ended. The stages after
a recipe's own (`Recipe.continuations`) each run this loop as a one-phase recipe of their own
(:mod:`replaykv.train.continuation`).

Not for: the data (see :mod:`replaykv.train.data`), the forward paths (see
:mod:`replaykv.train.paths`), a step's gradient and its budgets (:mod:`replaykv.train.step`),
the model and optimiser set-up (:mod:`replaykv.train.setup`) or the saved state
(:mod:`replaykv.train.state`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._functorch.config
from torch import nn
from tqdm import tqdm

from replaykv.model.checkpoint import has_weights, load_model
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Corpus, MixtureSampler, load_corpus
from replaykv.train.distill import IndexerDistillation
from replaykv.train.evaluate import evaluate, render_card, summarize
from replaykv.train.evidence import EvidenceAttention
from replaykv.train.keys import LR_SCALE, RecordKeys
from replaykv.train.recipes import Recipe
from replaykv.train.setup import (
    RouterBalance,
    fresh_model,
    make_model,
    make_optimizer,
    resolve_device,
    set_index_topk,
    set_lr,
)
from replaykv.train.speed import StepSettings
from replaykv.train.stages import (
    STAGE_DIR,
    cold_config,
    cold_start,
    read_stage,
    rewarmed_lr,
    save_export,
    ship_stage,
    shipped_dir,
    write_stage,
)
from replaykv.train.state import (
    STATE,
    StopOnSigterm,
    log_record,
    median_step_seconds,
    save_state,
    set_rng_state,
)
from replaykv.train.step import accumulate_gradients, skip_nonfinite


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    losses: list[float]
    out: Path
    exported: bool


def train(
    recipe: Recipe,
    out: str | Path,
    resume: bool = False,
    device: str = "auto",
    max_steps: int | None = None,
    init: str | Path | None = None,
    corpus: dict[str, Corpus] | None = None,
    progress: bool = True,
    evaluate_at_end: bool = True,
    micro_batch: int | None = None,
    checkpoint_seconds: float = 300.0,
    stages: int | None = None,
    from_stage: str | Path | None = None,
    ship: bool = False,
    kernels: str = "fused",
    precision: str = "float32",
    shard_bytes: int | None = None,
) -> TrainResult:
    """Run (or continue) `recipe` into `out`. `max_steps` stops after that global step (a prefix of
    the same run: the schedule is the recipe's); the export happens when the recipe completes.
    `micro_batch` overrides the phases' gradient-accumulation size (memory, not results).
    Besides every ``recipe.checkpoint_every`` steps, the state is saved when ``checkpoint_seconds``
    of wall time have passed since the last save, and when the process receives SIGTERM (it then
    stops after the current step); neither changes the results, only how much a kill loses.

    `stages` stops after that many stage ends in this call. At each stage end the stage
    checkpoint goes to OUT/stage/ (and, with `ship`, to the recipe's package directory). With
    `resume` and no OUT/train_state/, the run continues from a stage checkpoint (`from_stage`,
    else OUT/stage/, else the committed one) with fresh optimiser moments.

    `kernels` and `precision` choose how a step computes (`replaykv.train.speed`): the same
    training up to float rounding. `shard_bytes` writes stage checkpoints and the export in
    safetensors shards of at most that size (for channels that limit a file's size)."""
    out = Path(out)
    state_path = out / STATE
    if state_path.exists() and not resume:
        raise FileExistsError(f"{state_path} exists: pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device)
    settings = StepSettings.resolve(kernels, precision, dev)
    budgets = any(ph.evidence_loss > 0 and ph.evidence_clip > 0 for ph in recipe.phases)
    if budgets and settings.kernels == "fused" and settings.precision != "float32":
        raise NotImplementedError(
            "Phase.evidence_clip with the fused kernels under bf16 products: the compiled "
            "attention block's backward gives NaN when run a second time over its graph; "
            "use --precision float32 or --kernels eager"
        )
    corpus = corpus if corpus is not None else load_corpus(max_files=recipe.corpus_files)
    continuing = resume and state_path.exists()
    cold = cold_start(recipe, out, from_stage) if resume and not continuing else None
    if resume and not continuing and cold is None:
        raise FileNotFoundError(
            f"nothing to resume: no {state_path} and no stage checkpoint of recipe {recipe.name!r} "
            f"(looked in {out / STAGE_DIR}" + (f" and {shipped_dir(recipe)})" if recipe.ship_as else ")")
        )
    # A resumed run takes its weights from the state, so it needs no --init checkpoint.
    if cold is not None:
        model = load_model(cold, dtype="float32", config=cold_config(recipe, cold)).train()
    else:
        model = fresh_model(recipe) if continuing else make_model(recipe, init)
    model = model.to(dev)
    spec = ModelSpec.from_config(model.config)
    opt = make_optimizer(model, recipe)
    keys = None  # the record-key read-out: its heads live in the state, not in the export
    if any(ph.record_keys > 0 for ph in recipe.phases):
        layers = {ph.record_key_layers for ph in recipe.phases if ph.record_keys > 0}
        if len(layers) > 1:
            raise ValueError(f"recipe {recipe.name!r}: its phases read record keys of different layers")
        keys = RecordKeys(model, layers.pop()).to(dev)
        opt.add_param_group({"params": list(keys.parameters()), "weight_decay": 0.0, "lr_scale": LR_SCALE})
    step, seconds, tokens = 0, 0.0, 0
    stage_seconds: dict[str, float] = {}
    cold_from: int | None = None
    if cold is not None:
        info = read_stage(cold) or {}
        if info.get("recipe_digest") != recipe.digest():
            print(
                f"note: {cold} was trained by recipe digest {info.get('recipe_digest')}, not {recipe.digest()}"
            )
        step, seconds, tokens = int(info["step"]), float(info["seconds"]), int(info["tokens"])
        stage_seconds = dict(info.get("stage_seconds", {}))
        cold_from = step
        torch.manual_seed(recipe.seed + step)
        log_record(out, {"step": step, "cold_resume": str(cold), "stage": info.get("stage")})
    elif continuing:
        state = torch.load(state_path, map_location=dev, weights_only=False)
        if state["recipe"] != recipe.name:
            raise ValueError(f"{state_path} belongs to recipe {state['recipe']!r}, not {recipe.name!r}")
        model.load_state_dict(state["model"])
        if keys is not None:
            if "record_keys" not in state:
                raise ValueError(f"{state_path} holds no record-key heads, which this recipe trains")
            keys.load_state_dict(state["record_keys"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        step, seconds, tokens = state["step"], state["seconds"], state["tokens"]
        stage_seconds = dict(state.get("stage_seconds", {}))
        cold_from = state.get("cold_from")
    else:
        torch.manual_seed(recipe.seed)
    log_record(out, {"step": step, "kernels": settings.kernels, "precision": settings.precision})
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")  # what this code runs
    sampler = MixtureSampler(corpus["train"], recipe, spec.sliding_window, spec.group_alignment)
    distill = IndexerDistillation(model, recipe.indexer_rows if recipe.indexer_loss > 0 else 0)
    evidence = EvidenceAttention(model) if any(ph.evidence_loss > 0 for ph in recipe.phases) else None
    held = contextlib.ExitStack()
    if budgets:
        # its own budget backpropagates twice through a graph, which compiled backwards that
        # donate their buffers refuse (the fused kernels compile some functions)
        held.enter_context(torch._functorch.config.patch(donated_buffer=False))
    balance = RouterBalance(model, recipe.router_bias_rate)
    end = recipe.total_steps if max_steps is None else min(max_steps, recipe.total_steps)
    if stages is not None:
        ahead = [e for e in recipe.stage_ends if e > step]
        end = min(end, ahead[min(stages, len(ahead)) - 1] if ahead and stages > 0 else step)
    losses: list[float] = []
    nonfinite = 0  # steps in a row whose gradient was not finite
    stop = StopOnSigterm()
    last_save = time.monotonic()
    bar = tqdm(total=end, initial=step, disable=not progress, desc=f"train {recipe.name}", unit="step")
    try:
        while step < end:
            t0 = time.perf_counter()
            phase = recipe.phase_at(step)
            set_index_topk(model, phase.index_topk)
            batch = sampler.batch(step)
            lr = rewarmed_lr(recipe, step, cold_from)
            set_lr(opt, lr)
            opt.zero_grad(set_to_none=True)
            with settings.applied(dev):
                parts = accumulate_gradients(
                    model, spec, batch, phase, recipe, distill, dev, micro_batch, evidence, keys
                )
            clip = recipe.grad_clip + (phase.evidence_clip if phase.evidence_loss > 0 else 0.0)
            params = [*model.parameters(), *(keys.parameters() if keys is not None else ())]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            if math.isfinite(grad_norm):
                opt.step()
                balance.update()
                nonfinite = 0
            else:
                nonfinite += 1
                skip_nonfinite(out, step + 1, phase, parts, nonfinite, settings.kernels, bar)
            step += 1
            tokens += batch.tokens
            dt = time.perf_counter() - t0
            seconds += dt
            key = str(recipe.stage_at(step - 1))
            stage_seconds[key] = stage_seconds.get(key, 0.0) + dt
            losses.append(parts["loss"])
            bar.update(1)
            bar.set_postfix(loss=f"{parts['loss']:.3f}", tok_s=f"{batch.tokens / dt:,.0f}", lr=f"{lr:.2e}")
            if step % recipe.log_every == 0 or step == end:
                record = {"step": step, "phase": phase.name, "lr": lr, **parts, "grad_norm": grad_norm}
                record.update({"tokens_per_s": batch.tokens / dt, "seconds": seconds, "tokens": tokens})
                log_record(out, record)
            if recipe.quick_eval is not None and recipe.eval_every and step % recipe.eval_every == 0:
                quick = evaluate(model, corpus["heldout"], recipe.quick_eval)
                log_record(out, {"step": step, "eval": summarize(quick)})
                bar.write(f"step {step}: " + json.dumps(summarize(quick)))
            due = time.monotonic() - last_save >= checkpoint_seconds
            if step % recipe.checkpoint_every == 0 or step == end or due or stop.requested:
                meta = {
                    "step": step,
                    "seconds": seconds,
                    "tokens": tokens,
                    "recipe": recipe.name,
                    "stage_seconds": stage_seconds,
                    "cold_from": cold_from,
                }
                if keys is not None:
                    meta["record_keys"] = keys.state_dict()
                save_state(state_path, model, opt, meta)
                last_save = time.monotonic()
            if step in recipe.stage_ends:
                stage = recipe.stage_ends.index(step) + 1
                info = {"stage": stage, "step": step, "tokens": tokens, "seconds": seconds}
                info["stage_seconds"] = stage_seconds
                info["final_loss"] = float(np.mean(losses[-20:]))
                write_stage(model, out / STAGE_DIR, recipe, info, shard_bytes)
                if ship and shipped_dir(recipe) is not None:
                    ship_stage(out / STAGE_DIR, shipped_dir(recipe))  # type: ignore[arg-type]
                log_record(
                    out, {"step": step, "stage_end": stage, "stage_seconds": stage_seconds[str(stage)]}
                )
                bar.write(f"stage {stage} ended at step {step}: checkpoint in {out / STAGE_DIR}")
            if stop.requested:
                bar.write(f"SIGTERM: state saved at step {step}; resume with --resume")
                break
    finally:
        held.close()
        stop.restore()
        bar.close()
        distill.remove()
        if evidence is not None:
            evidence.remove()
        if keys is not None:
            keys.remove()
        balance.remove()
    exported = False
    if step >= recipe.total_steps and evaluate_at_end:
        training = {
            "steps": step,
            "tokens": tokens,
            "seconds": seconds,
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "kernels": settings.kernels,
            "precision": settings.precision,
            # The torch build and the vector kernels it picked set the float rounding.
            "torch": torch.__version__,
            "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "final_loss": float(np.mean(losses[-20:] or [np.nan])),
            "median_step_seconds": median_step_seconds(out, recipe),
        }
        export(model, out, recipe, corpus, training, init, shard_bytes)
        exported = True
    return TrainResult(step, tokens, seconds, losses, out, exported)


def export(
    model: nn.Module,
    out: Path,
    recipe: Recipe,
    corpus: dict[str, Corpus],
    training: dict[str, Any],
    init: str | Path | None = None,
    shard_bytes: int | None = None,
) -> dict[str, Any]:
    """Final evaluation, then the bf16 checkpoint, tokenizer, metrics and model card in `out`.

    With `init` (the base model of an adaptation run) the base is evaluated on the same cases,
    or its metrics.json reused when it was made with the same evaluation, and the card shows both.
    """
    metrics: dict[str, dict[str, Any]] = {}
    spec = recipe.final_eval
    if init is not None and spec is not None:
        base_file = Path(init) / "metrics.json"
        base = json.loads(base_file.read_text()) if base_file.exists() else None
        same = base is not None and base.get("spec_digest") == spec.digest()
        if not (same and base is not None and base.get("heldout") == corpus["heldout"].info.fingerprint):
            base_model = load_model(init, dtype="float32").to(next(model.parameters()).device)
            base = evaluate(base_model, corpus["heldout"], spec)
        metrics["base"] = base
    if spec is not None:
        metrics["adapted" if init is not None else "base"] = evaluate(model, corpus["heldout"], spec)
    save_export(model, out, shard_bytes)
    own = metrics.get("adapted", metrics.get("base"))
    (out / "metrics.json").write_text(json.dumps({**(own or {}), "training": training}, indent=2) + "\n")
    if metrics:
        reproduce = f"replaykv train --recipe {recipe.name} --out {out.name}"
        if init is not None:
            reproduce += f" --init {Path(init).name}"
        title = f"replaykv {recipe.preset} ({recipe.name})"
        card = render_card(title, model.config, recipe, corpus["train"].info, training, metrics, reproduce)
        (out / "MODEL_CARD.md").write_text(card)
    return metrics


def evaluate_only(
    recipe: Recipe,
    out: str | Path,
    device: str = "auto",
    init: str | Path | None = None,
    corpus: dict[str, Corpus] | None = None,
) -> dict[str, Any]:
    """Re-evaluate the export in `out` (or its training state when there is no export yet) and
    rewrite metrics.json and MODEL_CARD.md."""
    out = Path(out)
    dev = resolve_device(device)
    corpus = corpus if corpus is not None else load_corpus(max_files=recipe.corpus_files)
    state: dict[str, Any] = {}
    if has_weights(out):
        model = load_model(out, dtype="float32").to(dev)
    elif (out / STATE).exists():
        state = torch.load(out / STATE, map_location=dev, weights_only=False)
        model = fresh_model(recipe).to(dev)
        model.load_state_dict(state["model"])
    else:
        raise FileNotFoundError(f"{out} holds neither an export nor {STATE}")
    previous = (
        json.loads((out / "metrics.json").read_text()).get("training", {})
        if (out / "metrics.json").exists()
        else {}
    )
    training = previous or {k: state.get(k) for k in ("step", "tokens", "seconds")}
    training.setdefault("steps", state.get("step"))
    training.setdefault("median_step_seconds", median_step_seconds(out, recipe))
    return export(model, out, recipe, corpus, training, init)
