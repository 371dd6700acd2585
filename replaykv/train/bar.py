"""The shipping bar of a trained model: held-out pass-key retrieval at every depth of contexts of
several lengths, multi-hop lookups and local chains, scored two ways, and the rung it reaches.

Cases come from :attr:`BarSpec.seed`, a seed no training batch uses, with filler from held-out
files only. Each case is scored

    teacher forced  the argmax at every answer position is the answer token (prompt prefilled on
                    the full path, answer fed as decode steps)
    greedy          the model generates from the prompt alone, feeding back its own argmax, for
                    up to len(answer) + 8 tokens; the text before <|end|> is scored with
                    :func:`replaykv.train.tasks.score` (JSON answers compare parsed)
    bounded         teacher forced under the engine's defaults (encoder bounded replay +
                    decoder replay) at each cut offset after the evidence; "worst" is the offset
                    with the lowest accuracy

Depths: fractions of the filler (0 is the start, 1 the end), plus two tail positions counted in
tokens from the prompt's end: the key ending just before the last W tokens (reachable only
through the global KV from the question) and inside them. Every cell has a Wilson 95% interval.

Rung 1: teacher-forced and greedy pass-key accuracy ≥ 95% in every depth cell of every rung-1
length, and multi-hop and chain accuracy clearly above chance (the interval's lower end above
the chance level) at those lengths. Rung 2: the same at the rung-2 lengths. Not for: training
(see :mod:`replaykv.train.loop`) or the model card's layout (see :mod:`replaykv.train.evaluate`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import advance, allocate_view
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Corpus
from replaykv.train.evaluate import eval_controls, prompt_and_answer, wilson
from replaykv.train.paths import follow_up_plan, fork_view, run_plan
from replaykv.train.recipes import BarSpec
from replaykv.train.tasks import TOKENIZER, TaskSample, generate, score

BAR_TASKS = ("passkey", "multihop", "chain")


def bar_cases(heldout: Corpus, spec: BarSpec, length: int, window: int) -> dict[str, list[TaskSample]]:
    """The held-out cases of one length, keyed by cell ("passkey@0.25", "multihop", ...)."""
    cells: dict[str, list[TaskSample]] = {}
    plans: list[tuple[str, str, dict[str, Any]]] = [
        *((f"passkey@{d:g}", "passkey", {"depth": d}) for d in spec.depths),
        *((f"passkey@{label}", "passkey", {"evidence_end": length - n}) for label, n in spec.tail_depths),
        ("multihop", "multihop", {**eval_controls("multihop", window), "trace": spec.trace_hops}),
        ("chain", "chain", {**eval_controls("chain", window), "trace": spec.trace_chains}),
    ]
    for c, (cell, task, controls) in enumerate(plans):
        got: list[TaskSample] = []
        for i in range(spec.cases * 3):  # a draw that does not fit is skipped
            if len(got) == spec.cases:
                break
            rng = np.random.default_rng([spec.seed, length, c, i])
            sample = generate(task, rng, heldout, length, **controls)
            if sample is not None and (
                "evidence_end" not in controls or sample.evidence[1] == controls["evidence_end"]
            ):
                got.append(sample)
        cells[cell] = got
    return cells


@torch.inference_mode()
def score_cases(model: Any, cases: list[TaskSample], spec: BarSpec) -> dict[str, Any]:
    """Teacher-forced, greedy and bounded-replay accuracy of cases sharing one prompt length."""
    device = next(model.parameters()).device
    mspec = ModelSpec.from_config(model.config)
    align = mspec.group_alignment
    end_id = TOKENIZER.special_ids["<|end|>"]
    forced: list[bool] = []
    greedy: list[bool] = []
    bounded: dict[int, list[bool]] = {o: [] for o in spec.offsets}
    for i in range(0, len(cases), spec.batch):
        group = cases[i : i + spec.batch]
        p_len = len(group[0].prompt)
        a_max = max(len(c.answer) for c in group)
        n_gen = a_max + 8
        ids = prompt_and_answer(group, p_len, a_max).to(device)
        view = allocate_view(mspec, len(group), p_len + n_gen, device, model.lm_head.weight.dtype)
        first = model(ids[:, :p_len], view, logits_rows="last")  # [B, 1, V]
        advance(view, p_len)
        gen_view = copy.deepcopy(view)
        rest = model(ids[:, p_len : p_len + a_max - 1], view) if a_max > 1 else first[:, :0]
        preds = torch.cat([first, rest], 1).argmax(-1)  # [B, a_max]
        tokens = [first[:, -1].argmax(-1)]
        ended = tokens[0] == end_id
        for _ in range(n_gen - 1):
            if bool(ended.all()):  # every row has closed its answer
                break
            step = model(tokens[-1][:, None], gen_view)
            advance(gen_view, 1)
            tokens.append(step[:, -1].argmax(-1))
            ended |= tokens[-1] == end_id
        generated = torch.stack(tokens, 1).tolist()  # [B, n_gen]
        for r, c in enumerate(group):
            n_ans = len(c.answer)
            forced.append(bool((preds[r, :n_ans] == ids[r, p_len : p_len + n_ans]).all()))
            out = generated[r]
            text = bytes(t for t in out[: out.index(end_id)] if t < 256) if end_id in out else None
            greedy.append(text is not None and score(c, text.decode("utf-8", "replace")))
            row_ids = ids[r : r + 1, : p_len + n_ans - 1]
            for off in spec.offsets:
                cut = min(c.evidence[1] + off, p_len - 1) // align * align
                up = follow_up_plan(mspec, p_len, p_len + n_ans - 1, cut)
                logits, _ = run_plan(model, up, row_ids, fork_view(view, slice(r, r + 1)))
                r0 = up.logits_rows[0]
                got = logits[0, p_len - 1 - r0 : p_len - 1 - r0 + n_ans].argmax(-1)
                bounded[off].append(bool((got == ids[r, p_len : p_len + n_ans]).all()))
    by_off = {o: wilson(sum(v), len(v)) for o, v in bounded.items() if v}
    res: dict[str, Any] = {
        "forced": wilson(sum(forced), len(forced)),
        "greedy": wilson(sum(greedy), len(greedy)),
    }
    if by_off:
        worst = min(by_off, key=lambda o: (by_off[o]["acc"], o))
        res["bounded"] = {str(o): v for o, v in by_off.items()}
        res["worst"] = {"offset": worst, **by_off[worst]}
    return res


def evaluate_bar(
    model: Any, heldout: Corpus, spec: BarSpec, lengths: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """Every cell at every length (default: both rungs' and the extra lengths), and the rung."""
    was_training = model.training
    model.eval()
    lengths = lengths or (*spec.rung1_lengths, *spec.rung2_lengths, *spec.extra_lengths)
    results: dict[str, Any] = {}
    for length in lengths:
        cells = bar_cases(heldout, spec, length, ModelSpec.from_config(model.config).sliding_window)
        results[str(length)] = {
            cell: {**score_cases(model, cases, spec), "chance": float(np.mean([c.chance for c in cases]))}
            for cell, cases in cells.items()
            if cases
        }
    model.train(was_training)
    return {"spec": asdict(spec), "spec_digest": spec.digest(), "heldout": heldout.info.fingerprint,
            "lengths": results, "rung": rung(results, spec)}  # fmt: skip


def meets(cells: dict[str, Any], spec: BarSpec) -> bool:
    """Whether one length's cells meet the bar (see the module docstring)."""
    keys = [k for k in cells if k.startswith("passkey@")]
    if len(keys) != len(spec.depths) + len(spec.tail_depths):
        return False
    keys_ok = all(
        cells[k][way]["n"] >= spec.cases and cells[k][way]["acc"] >= spec.pass_rate
        for k in keys
        for way in ("forced", "greedy")
    )
    above = all(t in cells and cells[t]["forced"]["lo"] > cells[t]["chance"] for t in ("multihop", "chain"))
    return keys_ok and above


def rung(results: dict[str, Any], spec: BarSpec) -> int:
    """0, 1 or 2: the highest rung whose every length was measured and met."""
    reached = 0
    for level, lengths in ((1, spec.rung1_lengths), (2, spec.rung2_lengths)):
        if all(str(n) in results and meets(results[str(n)], spec) for n in lengths):
            reached = level
        else:
            break
    return reached


def bar_table(result: dict[str, Any]) -> list[str]:
    """Markdown rows: one per length and cell, accuracy % [Wilson 95%] (n) for each way."""

    def cell(r: dict[str, Any] | None) -> str:
        if not r or not r.get("n"):
            return "—"
        return f"{100 * r['acc']:.1f} [{100 * r['lo']:.1f}, {100 * r['hi']:.1f}] (n={r['n']})"

    lines = [
        "| length | cell (chance) | teacher forced | greedy | bounded, worst offset |",
        "|---:|---|---|---|---|",
    ]
    for length, cells in result["lengths"].items():
        for name, r in cells.items():
            worst = r.get("worst")
            w = f"{cell(worst)} @+{worst['offset']}" if worst else "—"
            lines.append(
                f"| {length} | {name} ({100 * r['chance']:.2g}%) | {cell(r['forced'])} | {cell(r['greedy'])} | {w} |"
            )
    lines.append("")
    lines.append(f"Rung reached: **{result['rung']}** (bar spec digest `{result['spec_digest']}`).")
    return lines
