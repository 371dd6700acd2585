"""Score a checkpoint on easier forms of the bar's multi-hop and chain cells: where between "finds
a pass key" and "follows two links" a model stands.

    python scripts/probe_lookups.py replaykv/weights/small --length 1024 --cases 20

Seven cells of held-out cases (filler from held-out files, seed 555, not the bar's): multi-hop
with one link and four distractors (chance 1/5), with two links and four distractors (the bar's
form, chance 1/6), a chain of one copy inside one window (chance 1/4) and of six copies over three
windows (the bar's form, chance 1/4), one link with its record inside the question's window
(chance 1/5), two links answered with both codes (`2: B (1) -> C (0)`, chance of the last code 1/6) and the
bar's chains answered with the lines behind the value (`q = y = x = 123`, chance 1/4).
Teacher-forced and greedy exact match per cell, as the bar scores them
(replaykv.train.bar.score_cases), without bounded replay. One torch thread unless --threads says
otherwise; --only TEXT scores the cells whose label holds TEXT; --kv-quant off scores the weights
with the KV fake-quantisers (FP8 window, FP4 entries and index keys) bypassed; --state ARM_DIR
scores a pilot arm's saved training state (the model argument gives its config). --choice adds, for
the multi-hop cells, a measure finer than exact match: the teacher-forced log-likelihood of every
record's answer B after the prompt, a case counted when the true answer ranks first (chance one
over the number of records). --steps splits the traced cells by step, teacher forced: each
step's code, name or value, and the joins with the closing <|end|>; for the chain cell it also
counts what each wrong lookup wrote instead (see chain_miss) and how many answers a name's
latest line in the whole program would give (see latest_rule).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.cache.views import advance, allocate_view
from replaykv.model.checkpoint import load_config, load_model
from replaykv.model.spec import ModelSpec
from replaykv.train.bar import score_cases
from replaykv.train.data import load_corpus
from replaykv.train.recipes import BarSpec
from replaykv.train.state import STATE
from replaykv.train.tasks import TOKENIZER, TaskSample, generate

CELLS: tuple[tuple[str, str, dict[str, Any], float], ...] = (
    ("multihop, 1 link", "multihop", {"hops": 1, "distractors": 4}, 1 / 5),
    ("multihop, 2 links (bar)", "multihop", {"hops": 2, "distractors": 4}, 1 / 6),
    ("chain, 1 copy in a window", "chain", {"n_vars": 4, "steps": 1, "span": 128}, 1 / 4),
    ("chain, 6 copies (bar)", "chain", {"n_vars": 4, "steps": 6, "span": 384}, 1 / 4),
    # The record ends 60 tokens before the prompt's end: read at full resolution in the window.
    ("multihop, 1 link inside the last window", "multihop", {"hops": 1, "distractors": 4, "tail": 60}, 1 / 5),
)
# The bar's two links answered with both codes, `2: B (1) -> C (0)` (tasks.multihop's `trace`), and its
# chains with the lines behind the value, `q = y = x = 123` (tasks.chain's `trace`); the chance
# stated is the last code's or value's.
TRACE_CELLS: tuple[tuple[str, str, dict[str, Any], float], ...] = (
    ("multihop, 1 link, hops written", "multihop", {"hops": 1, "distractors": 4, "trace": True}, 1 / 5),
    ("multihop, 2 links, hops written", "multihop", {"hops": 2, "distractors": 4, "trace": True}, 1 / 6),
    ("chain, 6 copies, lines written", "chain", {"n_vars": 4, "steps": 6, "span": 384, "trace": True}, 1 / 4),
)
SEED = 555


def load_scored(stage: str, state: str | None = None, config: Any = None) -> Any:
    """The STAGE checkpoint's model in float32 for scoring (under `config` if given); with
    `state`, a pilot arm's directory, the weights of its saved training state
    (`train_state/state.pt`), to score a run between its exports."""
    model = load_model(stage, config=config).float().eval()
    if state:
        model.load_state_dict(torch.load(Path(state) / STATE, weights_only=False)["model"])
    return model


def cases_of(task: str, controls: dict[str, Any], length: int, n: int, corpus: Any) -> list[TaskSample]:
    got: list[TaskSample] = []
    controls = dict(controls)
    if "tail" in controls:
        controls["evidence_end"] = length - controls.pop("tail")
    for i in range(3 * n):
        if len(got) == n:
            break
        sample = generate(task, np.random.default_rng([SEED, i]), corpus, length, **controls)
        if sample is not None:
            got.append(sample)
    return got


def score_cell(
    model: Any, cell: tuple[str, str, dict[str, Any], float], length: int, n: int, corpus: Any
) -> dict[str, Any]:
    """One cell at one length: teacher-forced and greedy hits of `n` cases, printed as it ends."""
    label, task, controls, chance = cell
    t0 = time.perf_counter()
    r = score_cases(model, cases_of(task, controls, length, n, corpus), BarSpec(offsets=(), batch=4))
    forced, greedy, total = r["forced"]["k"], r["greedy"]["k"], r["forced"]["n"]
    print(
        f"{label} @ {length}: forced {forced}/{total}, greedy {greedy}/{total} "
        f"(chance {chance:.0%}; {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return {"forced": forced, "greedy": greedy, "n": total, "chance": chance}


def record_answers(case: TaskSample) -> list[tuple[int, ...]]:
    """Every record's answer B (its bytes and <|end|>) in a multi-hop prompt, the true one first."""
    end = TOKENIZER.special_ids["<|end|>"]
    found = [bytes(case.prompt[a:b]).split(b" -> ")[1] for a, b in case.meta["records"]]
    true = case.answer_text.encode()
    return [(*true, end)] + [(*b, end) for b in found if b != true]


@torch.no_grad()
def choice_cell(
    model: Any, cell: tuple[str, str, dict[str, Any], float], length: int, n: int, corpus: Any
) -> dict[str, Any]:
    """One multi-hop cell: how often the true answer is the likeliest of the records' answers."""
    label, task, controls, _ = cell
    t0 = time.perf_counter()
    spec = ModelSpec.from_config(model.config)
    device = next(model.parameters()).device
    hits, chance = 0, 0.0
    cases = cases_of(task, controls, length, n, corpus)
    for case in cases:
        answers = record_answers(case)
        p_len = len(case.prompt)
        view = allocate_view(spec, 1, p_len + max(map(len, answers)), device, model.lm_head.weight.dtype)
        first = (
            model(torch.tensor([case.prompt], device=device), view, logits_rows="last")[0, -1]
            .float()
            .log_softmax(-1)
        )
        advance(view, p_len)
        scores = []
        for a in answers:  # each answer continues its own copy of the prompt's cache
            rest = (
                model(torch.tensor([a[:-1]], device=device), copy.deepcopy(view))[0].float().log_softmax(-1)
            )
            scores.append(float(first[a[0]]) + sum(float(rest[i, t]) for i, t in enumerate(a[1:])))
        hits += int(max(range(len(scores)), key=scores.__getitem__) == 0)
        chance += 1 / len(answers)
    chance /= max(len(cases), 1)
    print(
        f"{label} @ {length}: likeliest of the records' answers {hits}/{len(cases)} "
        f"(chance {chance:.0%}; {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return {"choice": hits, "n": len(cases), "chance": chance}


@torch.inference_mode()
def steps_cell(
    model: Any, cell: tuple[str, str, dict[str, Any], float], length: int, n: int, corpus: Any
) -> dict[str, Any]:
    """One traced cell, teacher forced, split by what an answer is made of: how many cases get
    each step's name, code or value right (of those whose answer has that step), and how many get
    every joining ` -> ` / ` = ` and the closing <|end|> right (a model that stops after one step fails only the latter)."""
    label, task, controls, _ = cell
    sep = " -> " if task == "multihop" else " = "
    spec = ModelSpec.from_config(model.config)
    device = next(model.parameters()).device
    cases = cases_of(task, controls, length, n, corpus)
    by_step: list[int] = []
    having: list[int] = []  # how many answers have a step k at all
    misses: Counter[str] = Counter()  # a chain's wrong lookups, by what was written instead
    joins = 0
    for case in cases:
        p_len = len(case.prompt)
        ids = torch.tensor([[*case.prompt, *case.answer]], device=device)
        view = allocate_view(spec, 1, ids.shape[1], device, model.lm_head.weight.dtype)
        pred = model(ids[:, :-1], view)[0, p_len - 1 :].argmax(-1)
        right = (pred == ids[0, p_len:]).tolist()
        parts = case.answer_text.split(sep)
        at, ok_join = 0, True
        for k, part in enumerate(parts):
            if k >= len(by_step):
                by_step.append(0)
                having.append(0)
            by_step[k] += all(right[at : at + len(part)])
            having[k] += 1
            if task == "chain" and k and not all(right[at : at + len(part)]):
                written = TOKENIZER.decode(pred[at : at + len(part)].tolist())
                misses[chain_miss(case, parts[k - 1], part, written)] += 1
            at += len(part)
            end = at + (len(sep) if k + 1 < len(parts) else 1)  # the join, or <|end|>
            ok_join &= all(right[at:end])
            at = end
        joins += ok_join
    steps = ", ".join(f"{k + 1}: {v}/{h}" for k, (v, h) in enumerate(zip(by_step, having, strict=True)))
    print(
        f"{label} @ {length}, teacher forced by step: {steps}; joins and end {joins}/{len(cases)}", flush=True
    )
    if misses:
        print(f"{label} @ {length}, wrong lookups: " + ", ".join(f"{k} {v}" for k, v in misses.most_common()))
    if task == "chain":
        rule = sum(latest_rule(case) == case.answer_text for case in cases)
        print(
            f"{label} @ {length}: a name's latest line in the whole program would write {rule}/{len(cases)}"
        )
    return {"steps": by_step, "having": having, "joins": joins, "n": len(cases), "misses": dict(misses)}


def chain_lines(case: TaskSample) -> list[list[str]]:
    """A chain case's statements in prompt order, each as [name, value]."""
    return [TOKENIZER.decode(list(case.prompt[lo:hi])).split(" = ") for lo, hi in case.meta["records"]]


def latest_rule(case: TaskSample) -> str:
    """The traced chain answer a model would write that took every name's latest line in the
    whole program, where the task asks for its latest line before the line found last."""
    lines = chain_lines(case)
    trace = [case.answer_text.split(" = ")[0]]
    while not trace[-1].isdigit() and len(trace) <= len(lines):
        trace.append([v for n, v in lines if n == trace[-1]][-1])
    return " = ".join(trace)


def chain_miss(case: TaskSample, name: str, value: str, written: str) -> str:
    """What a wrong lookup of a traced chain answer wrote instead of `value` (teacher forced,
    so each byte follows the right ones): `a slip` (a literal whose first digit is right and a
    later one wrong: the line was found, the copy failed), `another value of the name` (an earlier
    or later assignment of the name looked up), `another line's value`, or `in no line`."""
    lines = chain_lines(case)
    if value.isdigit() and written[:1] == value[:1]:
        return "a slip"
    if written in {v for n, v in lines if n == name}:
        return "another value of the name"
    if written in {v for _, v in lines}:
        return "another line's value"
    return "in no line"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="", help="score only the cells whose label holds this text")
    p.add_argument("--kv-quant", choices=("config", "on", "off"), default="config")
    p.add_argument("--choice", action="store_true", help="also rank the records' answers (multi-hop cells)")
    p.add_argument(
        "--steps", action="store_true", help="also split the traced cells by step (teacher forced)"
    )
    p.add_argument("--state", help="a pilot arm's directory: score its saved training state's weights")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    quant = {"on": True, "off": False}.get(args.kv_quant)
    model = load_scored(args.model, args.state, load_config(args.model, kv_quant=quant))
    heldout = load_corpus()["heldout"]
    for cell in (c for c in CELLS + TRACE_CELLS if args.only in c[0]):
        score_cell(model, cell, args.length, args.cases, heldout)
        if args.choice and cell[1] == "multihop" and not cell[2].get("trace"):
            choice_cell(model, cell, args.length, args.cases, heldout)
        if args.steps and cell[2].get("trace"):
            steps_cell(model, cell, args.length, args.cases, heldout)


if __name__ == "__main__":
    main()
