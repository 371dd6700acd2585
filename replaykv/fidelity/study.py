"""The fidelity study's grid: prompts × cut offsets × paths at each context length, in two
measurements, and their aggregates.

`token_fidelity`: per prompt the exact path's greedy continuation once (cold prefill, every
layer over every row), then each replay path at each cut, compared row by row
(:func:`replaykv.fidelity.traces.compare`); per cell the KL and top-1 summaries, the first
greedy divergence and the mean KL per distance-from-the-cut bucket.

`answers`: per task prompt and path, teacher-forced exact match of the reference answer (every
answer token the argmax; for exact-match scoring this is the same verdict as greedy generation),
on the full path and on each replay path at each cut; aggregated per task as accuracy with
Wilson intervals, the bounded paths at their worst offset and averaged over offsets, and paired
differences against the full path (exact McNemar test, paired-bootstrap interval).

Aggregates are medians over prompts with 95% percentile-bootstrap intervals of the median
(fixed seed: a rerun reproduces them). Not for: per-prompt measurement (see
:mod:`replaykv.fidelity.traces`) or rendering (see :mod:`replaykv.fidelity.report`).
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from replaykv.accept.stats import bootstrap_mean, bootstrap_median, mcnemar_exact
from replaykv.fidelity.prompts import FAMILIES, Prompt, cut_for, prompts
from replaykv.fidelity.traces import PATHS, REPLAY_PATHS, compare, trace
from replaykv.model.spec import ModelSpec
from replaykv.train.data import Corpus
from replaykv.train.evaluate import wilson

BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Left edges of the distance-from-the-cut buckets (a row r is at distance r - cut)."""
DEFAULT_OFFSETS = ("0", "1", "W-1", "W", "W+1", "37", "2W+1", "deep")


def resolve_offset(label: str, window: int) -> int | str:
    """An offset label as tokens after the anchor: a sum of terms, each an integer, "W" or
    "kW" ("0", "W-1", "2W+1", "-5"), or "deep"."""
    text = label.strip().replace(" ", "")
    if text == "deep":
        return "deep"
    terms = re.findall(r"([+-]?)(\d*)(W?)", text)
    if not text or "".join(sign + num + w for sign, num, w in terms) != text:
        raise ValueError(f"offset {label!r} is not an integer, a sum of integers and multiples of W, or 'deep'")
    total = 0
    for sign, num, w in terms:
        if not num and not w:
            continue
        value = (int(num) if num else 1) * (window if w else 1)
        total += -value if sign == "-" else value
    return total


@dataclass(frozen=True)
class StudySpec:
    families: tuple[str, ...] = FAMILIES
    lengths: tuple[int, ...] = (1024, 2048)
    prompts: int = 8
    offsets: tuple[str, ...] = DEFAULT_OFFSETS
    paths: tuple[str, ...] = REPLAY_PATHS
    continuation: int = 64
    replay_span: int | None = None
    boot_seed: int = 0

    def __post_init__(self) -> None:
        bad = [f for f in self.families if f not in FAMILIES]
        if bad:
            raise ValueError(f"unknown prompt families {bad}; choose from {FAMILIES}")
        bad = [p for p in self.paths if p not in PATHS or p == "exact"]
        if bad:
            raise ValueError(f"unknown or reference paths {bad}; compare any of {sorted(set(PATHS) - {'exact'})}")
        if self.prompts < 1 or self.continuation < 1 or not self.lengths:
            raise ValueError("prompts, continuation and lengths must be positive")


def _buckets(kl: list[float | None], first_row: int, cut: int) -> dict[str, float]:
    sums: dict[int, list[float]] = defaultdict(list)
    for i, v in enumerate(kl):
        if v is None:
            continue
        d = first_row + i - cut
        edge = max(e for e in BUCKETS if e <= d)
        sums[edge].append(v)
    return {str(e): float(statistics.fmean(v)) for e, v in sorted(sums.items())}


def _grid(
    model: Any, heldout: Corpus, spec: StudySpec, families: Sequence[str]
) -> list[tuple[int, Prompt, list[tuple[str, int]]]]:
    """Each prompt with its (offset label, cut) pairs; odd cuts are kept (architecture §13.7)."""
    window = spec.replay_span or ModelSpec.from_config(model.config).sliding_window
    out = []
    for length in spec.lengths:
        for family in families:
            for p in prompts(heldout, family, length, spec.prompts, window):
                cuts = [(label, cut_for(p, resolve_offset(label, window))) for label in spec.offsets]
                out.append((length, p, [(label, cut) for label, cut in cuts if cut is not None]))
    return out


def token_fidelity(
    model: Any, heldout: Corpus, spec: StudySpec, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Per-cell comparisons of every replay path with the exact path, and their aggregates."""
    cells: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for length, p, cuts in _grid(model, heldout, spec, spec.families):
        exact = trace(model, list(p.ids), 0, "exact", spec.continuation, spec.replay_span)
        for label, cut in cuts:
            for path in spec.paths:
                got = trace(model, list(p.ids), cut, path, exact.continuation, spec.replay_span)
                c = compare(exact, got, len(p.ids))
                cells.append(
                    {
                        "length": length,
                        "family": p.family,
                        "prompt": p.index,
                        "offset": label,
                        "cut": cut,
                        "anchor": p.anchor,
                        "path": path,
                        "prompt_rows": c["prompt"],
                        "continuation": c["continuation"],
                        "first_divergence": c["first_divergence"],
                        "continuation_len": c["continuation_len"],
                        "kl_by_distance": _buckets(c["kl"], c["first_row"], cut),
                    }
                )
        if progress is not None:
            progress(f"{length} {p.family} #{p.index}: {len(cuts)} cuts, {time.perf_counter() - t0:.0f} s")
    return {
        "spec": asdict(spec),
        "seconds": time.perf_counter() - t0,
        "cells": cells,
        "summary": summarize(cells, spec.boot_seed),
        "decay": decay(cells),
    }


def _first_div(cell: dict[str, Any]) -> float:
    f = cell["first_divergence"]
    return float(cell["continuation_len"] if f is None else f)


def summarize(cells: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per (length, family, offset, path), with "all" for either over its values:
    medians with bootstrap intervals of KL and top-1 agreement (prompt rows after the cut and
    continuation rows), the first greedy divergence (no divergence counts as the continuation's
    length) and the share of cells whose greedy continuation diverged at all."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for c in cells:
        for family in (c["family"], "all"):
            for offset in (c["offset"], "all"):
                groups[(c["length"], family, offset, c["path"])].append(c)
    out = []
    for (length, family, offset, path), cs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        diverged = sum(1 for c in cs if c["first_divergence"] is not None)
        out.append(
            {
                "length": length,
                "family": family,
                "offset": offset,
                "path": path,
                "cells": len(cs),
                "kl_prompt": bootstrap_median([c["prompt_rows"]["kl_mean"] for c in cs], seed=seed),
                "kl_continuation": bootstrap_median([c["continuation"]["kl_mean"] for c in cs], seed=seed),
                "top1_prompt": bootstrap_median([c["prompt_rows"]["top1"] for c in cs], seed=seed),
                "top1_continuation": bootstrap_median([c["continuation"]["top1"] for c in cs], seed=seed),
                "first_divergence": bootstrap_median([_first_div(c) for c in cs], seed=seed),
                "diverged": wilson(diverged, len(cs)),
            }
        )
    return out


def decay(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (length, path): the median over cells of the mean KL in each distance bucket."""
    groups: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        for edge, v in c["kl_by_distance"].items():
            groups[(c["length"], c["path"])][edge].append(v)
    return [
        {
            "length": length,
            "path": path,
            "buckets": {e: float(np.median(v)) for e, v in sorted(b.items(), key=lambda kv: int(kv[0]))},
        }
        for (length, path), b in sorted(groups.items())
    ]


def answer_correct(model: Any, p: Prompt, cut: int, path: str, replay_span: int | None) -> bool:
    """Teacher-forced exact match of the reference answer on `path` at `cut` (0: cold)."""
    got = trace(model, list(p.ids), cut, path, list(p.answer), replay_span)
    rows = got.logprobs[len(p.ids) - 1 - got.first_row :]
    return bool((rows.argmax(dim=-1) == torch.tensor(p.answer)).all())


def answers(
    model: Any, heldout: Corpus, spec: StudySpec, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Per task prompt: the full path's verdict and each replay path's at each cut; then per
    task and length the accuracy table (see the module docstring)."""
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    tasks = [f for f in spec.families if f != "text"]
    for length, p, cuts in _grid(model, heldout, spec, tasks):
        full = answer_correct(model, p, 0, "exact", spec.replay_span)
        verdicts = {
            path: {label: answer_correct(model, p, cut, path, spec.replay_span) for label, cut in cuts}
            for path in spec.paths
        }
        rows.append({"length": length, "task": p.family, "prompt": p.index, "full": full, "paths": verdicts})
        if progress is not None:
            progress(f"answers {length} {p.family} #{p.index}: {time.perf_counter() - t0:.0f} s")
    return {"spec": asdict(spec), "seconds": time.perf_counter() - t0, "rows": rows, "table": answer_table(rows, spec)}


def paired_difference(base: list[bool], cand: list[bool], seed: int = 0) -> dict[str, Any]:
    """candidate − baseline success, paired per prompt: the mean difference with its 95%
    paired-bootstrap interval, and the exact McNemar test."""
    diff = bootstrap_mean([float(c) - float(b) for b, c in zip(base, cand, strict=True)], seed=seed)
    return {"diff": diff["mean"], "lower95": diff["lower95"], "upper95": diff["upper95"], **mcnemar_exact(base, cand)}


def answer_table(rows: list[dict[str, Any]], spec: StudySpec) -> list[dict[str, Any]]:
    """Accuracy per (length, task, arm) with Wilson intervals and the paired difference against
    the full path. Arms: full; each path at its worst offset (lowest accuracy); each path
    averaged over offsets (every prompt × offset pair, paired with the prompt's full verdict)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["length"], r["task"])].append(r)
        groups[(r["length"], "all")].append(r)
    out = []
    for (length, task), rs in sorted(groups.items()):
        base = [r["full"] for r in rs]
        out.append({"length": length, "task": task, "arm": "full", **wilson(sum(base), len(base))})
        for path in spec.paths:
            labels = sorted({lab for r in rs for lab in r["paths"][path]})
            per: dict[str, tuple[list[bool], list[bool]]] = {}
            for lab in labels:
                pairs = [(r["full"], r["paths"][path][lab]) for r in rs if lab in r["paths"][path]]
                per[lab] = ([a for a, _ in pairs], [b for _, b in pairs])
            if not per:
                continue
            worst = min(per, key=lambda lab: (sum(per[lab][1]) / max(1, len(per[lab][1])), lab))
            b, c = per[worst]
            arm = {"length": length, "task": task, "arm": f"{path} worst ({worst})"}
            out.append({**arm, **wilson(sum(c), len(c)), "vs_full": paired_difference(b, c, spec.boot_seed)})
            ab = [x for lab in labels for x in per[lab][0]]
            ac = [x for lab in labels for x in per[lab][1]]
            arm = {"length": length, "task": task, "arm": f"{path} mean over offsets"}
            out.append({**arm, **wilson(sum(ac), len(ac)), "vs_full": paired_difference(ab, ac, spec.boot_seed)})
    return out
