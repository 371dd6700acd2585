"""Held-out evaluation: bits per byte on held-out text and per-task exact match on the full path
and with bounded replay, with Wilson 95% intervals; and the model card that reports them.

A task case is scored by teacher forcing: the answer is correct when the argmax at every
answer position is the answer token, which is exactly when greedy decoding reproduces it.

    full     a plain prefill of the prompt (every layer, every row), then the answer as decode
    bounded  the engine's defaults (encoder bounded replay + decoder replay): an earlier request
             cached the global KV of [0, cut) and its window snapshot is gone; the follow-up
             replays [cut - W, cut) and decodes the answer. cut = evidence end + offset (rounded
             down to the global-KV alignment), so offset W puts the evidence just before the
             replay boundary and larger offsets leave it to the global KV alone.

"worst" is the offset with the lowest accuracy, "avg" pools every offset (the cases repeat
across offsets, so that interval is optimistic). Not for: training (see :mod:`replaykv.train.loop`).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from replaykv.cache.views import advance, allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Corpus, CorpusInfo
from replaykv.train.paths import follow_up_plan, fork_view, run_plan
from replaykv.train.recipes import EvalSpec, Recipe
from replaykv.train.tasks import TASKS, TOKENIZER, TaskSample, generate


def wilson(k: int, n: int, z: float = 1.96) -> dict[str, float]:
    """Accuracy k/n with its Wilson score interval."""
    if n == 0:
        return {"k": 0, "n": 0, "acc": float("nan"), "lo": float("nan"), "hi": float("nan")}
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return {"k": k, "n": n, "acc": p, "lo": max(0.0, mid - half), "hi": min(1.0, mid + half)}


def eval_controls(task: str, window: int) -> dict[str, Any]:
    """Fixed difficulty of the held-out cases (the card states them)."""
    return {
        "multihop": {"hops": 2, "distractors": 4},
        "chain": {"n_vars": 4, "steps": 6, "span": 3 * window},
        "tool": {"rounds": 2},
    }.get(task, {})


def eval_cases(heldout: Corpus, spec: EvalSpec, window: int) -> list[TaskSample]:
    """The held-out task cases: their own seed, filler from held-out files only."""
    cases: list[TaskSample] = []
    for t, task in enumerate(TASKS):
        if task == "passkey":
            plan = [{"depth": d} for d in spec.passkey_depths for _ in range(spec.passkey_per_depth)]
        else:
            plan = [eval_controls(task, window)] * spec.cases
        for i, controls in enumerate(plan):
            rng = np.random.default_rng([spec.seed, t, i])
            sample = generate(task, rng, heldout, spec.prompt_len, **controls)
            if sample is not None:
                cases.append(sample)
    return cases


@torch.inference_mode()
def bits_per_byte(model: Any, heldout: Corpus, spec: EvalSpec) -> dict[str, float]:
    """Mean cross-entropy in bits over the byte targets of held-out windows (even: code, odd:
    prose), with a normal 95% interval over the windows."""
    device = next(model.parameters()).device
    mspec = ModelSpec.from_config(model.config)
    rng = np.random.default_rng([spec.seed, 1000])
    windows = [heldout.window(rng, spec.text_len, prose=bool(i % 2)) for i in range(spec.text_sequences)]
    per_seq: list[float] = []
    for i in range(0, len(windows), spec.batch):
        ids = torch.from_numpy(np.stack(windows[i : i + spec.batch])).to(device)
        view = allocate_view(mspec, ids.shape[0], ids.shape[1], device, model.lm_head.weight.dtype)
        logits = model(ids, view)[:, :-1]
        ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        is_byte = (ids[:, 1:] < 256).float()
        per_seq += ((ce * is_byte).sum(1) / is_byte.sum(1).clamp(min=1) / math.log(2)).tolist()
    arr = np.array(per_seq)
    half = 1.96 * arr.std(ddof=1) / math.sqrt(len(arr)) if len(arr) > 1 else float("nan")
    return {
        "bpb": float(arr.mean()),
        "lo": float(arr.mean() - half),
        "hi": float(arr.mean() + half),
        "n": len(arr),
    }


def prompt_and_answer(group: list[TaskSample], p_len: int, a_max: int) -> torch.Tensor:
    """[B, p_len + a_max] ids: each case's prompt (all `p_len` long), then its answer, eos after."""
    ids = torch.full((len(group), p_len + a_max), TOKENIZER.eos_id, dtype=torch.long)
    for r, c in enumerate(group):
        ids[r, :p_len] = torch.tensor(c.prompt)
        ids[r, p_len : p_len + len(c.answer)] = torch.tensor(c.answer)
    return ids


@torch.inference_mode()
def task_accuracy(model: Any, cases: list[TaskSample], spec: EvalSpec) -> dict[str, Any]:
    """Per task: full path, each bounded-replay offset, worst offset and the pooled average."""
    device = next(model.parameters()).device
    mspec = ModelSpec.from_config(model.config)
    align, p_len = mspec.group_alignment, spec.prompt_len
    full: dict[str, list[bool]] = {}
    at_offset: dict[str, dict[int, list[bool]]] = {}
    depth_full: dict[str, list[bool]] = {}
    depth_bounded: dict[str, list[bool]] = {}
    for i in range(0, len(cases), spec.batch):
        group = cases[i : i + spec.batch]
        a_max = max(len(c.answer) for c in group)
        ids = prompt_and_answer(group, p_len, a_max).to(device)
        view = allocate_view(mspec, len(group), p_len + a_max, device, model.lm_head.weight.dtype)
        first = model(ids[:, :p_len], view, logits_rows="last")
        advance(view, p_len)
        rest = model(ids[:, p_len : p_len + a_max - 1], view) if a_max > 1 else first[:, :0]
        preds = torch.cat([first, rest], 1).argmax(-1)  # [B, a_max]: predictions of answer tokens
        for r, c in enumerate(group):
            n_ans = len(c.answer)
            ok = bool((preds[r, :n_ans] == ids[r, p_len : p_len + n_ans]).all())
            full.setdefault(c.task, []).append(ok)
            depth = c.meta.get("depth") if c.task == "passkey" else None
            if depth is not None:
                depth_full.setdefault(f"{depth:.2f}", []).append(ok)
            row_ids = ids[r : r + 1, : p_len + n_ans - 1]
            for off in spec.offsets:
                cut = min(c.evidence[1] + off, p_len - 1) // align * align
                if cut <= 0:
                    continue
                up = follow_up_plan(mspec, p_len, p_len + n_ans - 1, cut)
                logits, _ = run_plan(model, up, row_ids, fork_view(view, slice(r, r + 1)))
                r0 = up.logits_rows[0]
                got = logits[0, p_len - 1 - r0 : p_len - 1 - r0 + n_ans].argmax(-1)
                hit = bool((got == ids[r, p_len : p_len + n_ans]).all())
                at_offset.setdefault(c.task, {}).setdefault(off, []).append(hit)
                if depth is not None:
                    depth_bounded.setdefault(f"{depth:.2f}", []).append(hit)
    out: dict[str, Any] = {}
    for task in TASKS:
        if task not in full:
            continue
        res: dict[str, Any] = {"full": wilson(sum(full[task]), len(full[task]))}
        by_off = {o: wilson(sum(v), len(v)) for o, v in sorted(at_offset.get(task, {}).items())}
        if by_off:
            res["offsets"] = {str(o): v for o, v in by_off.items()}
            worst = min(by_off, key=lambda o: (by_off[o]["acc"], o))
            res["worst"] = {"offset": worst, **by_off[worst]}
            pooled = [h for v in at_offset[task].values() for h in v]
            res["avg"] = wilson(sum(pooled), len(pooled))
        out[task] = res
    if depth_full:
        out["passkey_by_depth"] = {
            d: {
                "full": wilson(sum(v), len(v)),
                **(
                    {"avg": wilson(sum(depth_bounded[d]), len(depth_bounded[d]))}
                    if d in depth_bounded
                    else {}
                ),
            }
            for d, v in sorted(depth_full.items())
        }
    return out


def evaluate(model: Any, heldout: Corpus, spec: EvalSpec) -> dict[str, Any]:
    """Everything the card reports, for one model."""
    was_training = model.training
    model.eval()
    mspec = ModelSpec.from_config(model.config)
    cases = eval_cases(heldout, spec, mspec.sliding_window)
    chance: dict[str, list[float]] = {}
    for c in cases:
        chance.setdefault(c.task, []).append(c.chance)
    result = {
        "spec": asdict(spec),
        "spec_digest": spec.digest(),
        "heldout": heldout.info.fingerprint,  # the same cases need the same held-out files
        "text": bits_per_byte(model, heldout, spec),
        "tasks": task_accuracy(model, cases, spec),
        "chance": {t: float(np.mean(v)) for t, v in chance.items()},
    }
    model.train(was_training)
    return result


# ---------------------------------------------------------------------------- the model card
def summarize(metrics: dict[str, Any]) -> dict[str, Any]:
    """An `evaluate` result in one line: held-out bits per byte and each task's full-path accuracy."""
    tasks = {t: round(r["full"]["acc"], 3) for t, r in metrics["tasks"].items() if "full" in r}
    return {"bpb": round(metrics["text"]["bpb"], 4), **tasks}


def _cell(r: dict[str, Any] | None) -> str:
    if not r or not r.get("n"):
        return "—"
    return f"{100 * r['acc']:.1f} [{100 * r['lo']:.1f}, {100 * r['hi']:.1f}] (n={r['n']})"


def render_card(
    title: str,
    config: Any,
    recipe: Recipe,
    corpus: CorpusInfo,
    training: dict[str, Any],
    metrics: dict[str, dict[str, Any]],
    reproduce: str,
) -> str:
    """MODEL_CARD.md: data, steps, wall time, held-out bits per byte and the task table for each
    model in `metrics` (labels such as "base" and "adapted"), with 95% intervals."""
    labels = list(metrics)
    any_m = next(iter(metrics.values()))
    spec = any_m["spec"]
    lines = [
        f"# {title}",
        "",
        f"A DeepSeek-V4.1-shaped byte-level model (`{recipe.preset}`: {config.num_hidden_layers} layers, "
        f"hidden {config.hidden_size}, window {config.sliding_window}, compress ratios "
        f"{list(config.compress_ratios)}, decoder after layer {config.decoder_cut}, "
        f"{config.n_routed_experts} experts top-{config.num_experts_per_tok}) trained by `replaykv train` "
        "on one machine. It is small: the numbers below are measured, whatever they are.",
        "",
        "## Data",
        "",
        f"- Text: the Python {corpus.python} standard library (`.py` sources and their docstrings), "
        f"{corpus.files} training files, {corpus.code_bytes:,} code bytes and {corpus.prose_bytes:,} "
        f"docstring bytes; fingerprint `{corpus.fingerprint[:16]}`. About 5% of files (by path hash) "
        "are held out.",
        "- Generated tasks (chat format with the tokenizer's specials, loss on answers only): passkey "
        "retrieval, multi-hop code lookups, variable-tracking chains, sentence-to-JSON extraction and "
        "tool-call loops (see `replaykv/train/tasks.py`).",
    ]
    for p in recipe.phases:
        mix = ", ".join(f"{k} {v:g}" for k, v in p.mixture.weights.items() if v)
        lines.append(
            f"- Phase `{p.name}`: {p.steps} steps of {p.describe()} tokens; mixture {mix}; "
            f"paths: full {p.paths.full:g}, decoder replay {p.paths.decoder_replay:g}, "
            f"bounded replay probability {p.paths.bounded_prob:g}; answer tokens weigh {p.answer_weight:g}."
        )
    hours = training.get("seconds", 0.0) / 3600
    medians = training.get("median_step_seconds") or {}
    typical = sum(p.steps * medians[p.name] for p in recipe.phases if p.name in medians) / 3600
    steady = (
        f" (the sum of step times; each phase's median logged step × its steps gives {typical:.2f} h, "
        "which leaves out steps that ran while the process was stopped or the machine busy)"
        if medians
        else ""
    )
    lines += [
        "",
        "## Training",
        "",
        f"- Recipe `{recipe.name}` (digest `{recipe.digest()}`), seed {recipe.seed}, AdamW lr {recipe.lr:g} → "
        f"{recipe.min_lr:g} (warmup {recipe.warmup}, cosine), weight decay {recipe.weight_decay:g} on matrices, "
        f"clip {recipe.grad_clip:g}; indexer KL weight {recipe.indexer_loss:g}; aux-loss-free router "
        f"balancing rate {recipe.router_bias_rate:g}.",
        f"- Steps: {training.get('steps')}, tokens: {training.get('tokens', 0):,}, wall time "
        f"{hours:.2f} h{steady} on {training.get('device', '?')} ({training.get('threads', '?')} threads, torch "
        f"{training.get('torch', '?')}, {training.get('cpu_kernels', '?')} CPU kernels), "
        f"final training loss {training.get('final_loss', float('nan')):.3f}.",
        f"- Reproduce: `{reproduce}`",
        "",
        "## Held-out results",
        "",
        f"Prompts of {spec['prompt_len']} tokens; bounded replay cut offsets {tuple(spec['offsets'])} "
        "tokens after the evidence (the engine's defaults: encoder bounded replay + decoder replay). "
        "Cells: exact-match accuracy % [Wilson 95% interval] (n).",
        "",
        "| held-out bits per byte | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
        "| text (code + docstrings) | "
        + " | ".join(
            f"{m['text']['bpb']:.3f} [{m['text']['lo']:.3f}, {m['text']['hi']:.3f}]" for m in metrics.values()
        )
        + " |",
        "",
    ]
    cols = [(path, lab) for path in ("full", "worst", "avg") for lab in labels]
    names = {"full": "full prefill", "worst": "bounded, worst offset", "avg": "bounded, avg over offsets"}
    lines.append("| task (chance) | " + " | ".join(f"{names[p]} ({lab})" for p, lab in cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    for task in TASKS:
        if task not in any_m["tasks"]:
            continue
        chance = any_m["chance"].get(task, 0.0)
        cells = []
        for path, lab in cols:
            r = metrics[lab]["tasks"].get(task, {}).get(path)
            cell = _cell(r)
            if path == "worst" and r and r.get("n"):
                cell += f" @+{r['offset']}"
            cells.append(cell)
        lines.append(f"| {task} ({100 * chance:.2g}%) | " + " | ".join(cells) + " |")
    depth = any_m["tasks"].get("passkey_by_depth")
    if depth:
        lines += ["", "Passkey by depth of the key in the context:", ""]
        dcols = [(p, lab) for p in ("full", "avg") for lab in labels]
        lines.append("| depth | " + " | ".join(f"{names[p]} ({lab})" for p, lab in dcols) + " |")
        lines.append("|---|" + "---|" * len(dcols))
        for d in depth:
            row = [
                _cell(metrics[lab]["tasks"].get("passkey_by_depth", {}).get(d, {}).get(p)) for p, lab in dcols
            ]
            lines.append(f"| {d} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Task difficulty: passkey 5-digit key; multihop 2 hops among 4 distractor records; chain 4 "
        "variables, 6 copies spread over 3 windows; extract 4 fields; tool 2 lookup rounds.",
        "",
    ]
    return "\n".join(lines)
