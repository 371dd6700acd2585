"""From records to metrics, per-cell tables and verdicts.

Pairs: each candidate request of the quality pass with the baseline's cold request of the same
case and repeat (the cold path is the reference). Per pair:

    success / valid      the outcomes of both (paired differences, McNemar); None when a case is
                         not scored (image cases), which then count in no success metric
    compared tokens      the generated positions whose context is the same in both arms: up to
                         and including the first position where the tokens differ
    kl, kl_first, top1   over the compared tokens (:func:`replaykv.accept.stats.topk_kl`)
    exact                whether the whole outputs are equal; first_divergence (None if equal)

A criterion passes when its statistic (point, or a bound of the 95% interval) is on the right
side of its threshold; the margin is the distance, positive when it passes. A metric with no
data fails ("no data"), so a contract cannot pass by measuring nothing.
Not for: rendering (see :mod:`replaykv.accept.report`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from replaykv.accept.contract import Contract, Criterion
from replaykv.accept.run import Record
from replaykv.accept.stats import bootstrap_mean, mcnemar_exact, percentile, top1, topk_kl


@dataclass
class Pair:
    base: Record
    cand: Record
    kl: float
    kl_first: float
    top1: float
    exact: bool
    first_divergence: int | None
    compared: int


def pair_up(records: list[Record]) -> list[Pair]:
    """Candidate quality records paired with the baseline's cold record of the same case."""
    ref = {(r.case, r.repeat): r for r in records if r.arm == "baseline" and r.phase == "quality"}
    out = []
    for c in records:
        if c.arm != "candidate" or c.phase != "quality":
            continue
        b = ref.get((c.case, c.repeat))
        if b is None:
            continue
        bi, ci = b.obs.ids, c.obs.ids
        n = min(len(bi), len(ci))
        div = next((j for j in range(n) if bi[j] != ci[j]), None)
        if div is None and len(bi) != len(ci):
            div = n
        upto = min(len(b.obs.top), len(c.obs.top), n if div is None else div + 1)
        kls = [topk_kl(b.obs.top[j], c.obs.top[j]) for j in range(upto)]
        agree = [top1(b.obs.top[j]) == top1(c.obs.top[j]) for j in range(upto)]
        out.append(
            Pair(
                base=b,
                cand=c,
                kl=sum(kls) / len(kls) if kls else math.nan,
                kl_first=kls[0] if kls else math.nan,
                top1=sum(agree) / len(agree) if agree else math.nan,
                exact=bi == ci,
                first_divergence=div,
                compared=upto,
            )
        )
    return out


def _select(pairs: list[Pair], crit: Criterion) -> list[Pair]:
    return [
        p
        for p in pairs
        if (not crit.states or p.cand.state in crit.states)
        and (not crit.tasks or p.cand.cell["task"] in crit.tasks)
        and (not crit.suffixes or p.cand.cell["suffix"] in crit.suffixes)
    ]


def _latency_ratio(records: list[Record], crit: Criterion, attr: str) -> dict[str, Any]:
    """The worst candidate / baseline p99 over the load levels."""
    levels: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.phase.startswith("load:") and r.obs.error is None:
            if crit.tasks and r.cell["task"] not in crit.tasks:
                continue
            if crit.suffixes and r.cell["suffix"] not in crit.suffixes:
                continue
            levels[r.phase][r.arm].append(getattr(r.obs, attr))
    ratios = {}
    for phase, arms in levels.items():
        b, c = percentile(arms["baseline"], 99), percentile(arms["candidate"], 99)
        if b > 0 and not math.isnan(c):
            ratios[phase] = c / b
    value = max(ratios.values()) if ratios else math.nan
    return {"value": value, "per_level": ratios}


def metric(
    crit: Criterion, pairs: list[Pair], records: list[Record], seed: int, n_boot: int
) -> dict[str, Any]:
    """The statistics of one criterion's metric over its selection."""
    sel = _select(pairs, crit)
    m = crit.metric
    if m in ("success_drop", "validity_drop", "new_failures"):
        key = "success" if m != "validity_drop" else "valid"
        raw = [(p.base.outcome.get(key), p.cand.outcome.get(key)) for p in sel]
        both = [(bool(x), bool(y)) for x, y in raw if x is not None and y is not None]
        test = mcnemar_exact([x for x, _ in both], [y for _, y in both])
        if m == "new_failures":
            return {"n": len(both), "point": float(test["new_failures"]) if both else math.nan, **test}
        diffs = [float(x) - float(y) for x, y in both]
        st = bootstrap_mean(diffs, n_boot, seed)
        base_rate = sum(x for x, _ in both) / len(both) if both else math.nan
        cand_rate = sum(y for _, y in both) / len(both) if both else math.nan
        return {**st, "point": st["mean"], "baseline": base_rate, "candidate": cand_rate, **test}
    if m in ("kl_mean", "kl_first", "top1_agreement", "exact_match"):
        attr = {"kl_mean": "kl", "kl_first": "kl_first", "top1_agreement": "top1", "exact_match": "exact"}[m]
        st = bootstrap_mean([float(getattr(p, attr)) for p in sel], n_boot, seed)
        return {**st, "point": st["mean"]}
    if m == "prefill_work_ratio":
        work = sum(p.cand.obs.prefill_work or 0 for p in sel)
        full = sum(p.cand.obs.full_prefill_work or 0 for p in sel)
        return {"n": len(sel), "point": work / full if full else math.nan}
    if m == "pool_miss_rate":
        hits = [
            p.cand.obs.snapshot_hit
            for p in sel
            if p.cand.state == "hit" and p.cand.obs.snapshot_hit is not None
        ]
        return {"n": len(hits), "point": 1 - sum(hits) / len(hits) if hits else math.nan}
    if m == "state_reached":
        got = [p.cand.reached for p in sel if p.cand.reached is not None]
        return {"n": len(got), "point": sum(got) / len(got) if got else math.nan}
    if m in ("ttft_p99_ratio", "e2e_p99_ratio"):
        out = _latency_ratio(records, crit, "ttft_s" if m == "ttft_p99_ratio" else "latency_s")
        return {"n": len(out["per_level"]), "point": out["value"], "per_level": out["per_level"]}
    raise ValueError(f"unknown metric {m!r}")


def verdicts(contract: Contract, pairs: list[Pair], records: list[Record]) -> list[dict[str, Any]]:
    """Every criterion with its value, interval, threshold, margin and pass/fail."""
    out = []
    for crit in contract.criteria:
        st = metric(crit, pairs, records, contract.sampling.seed, contract.bootstrap)
        value = st.get(crit.stat, st.get("point", math.nan))
        value = float(value) if value is not None else math.nan
        if math.isnan(value):
            passed, margin, note = False, math.nan, "no data"
        else:
            margin = crit.threshold - value if crit.direction == "<=" else value - crit.threshold
            passed, note = margin >= 0, ""
        out.append(
            {
                "name": crit.name,
                "metric": crit.metric,
                "states": list(crit.states),
                "tasks": list(crit.tasks),
                "suffixes": list(crit.suffixes),
                "statistic": crit.stat,
                "direction": crit.direction,
                "threshold": crit.threshold,
                "value": value,
                "margin": margin,
                "passed": passed,
                "note": note,
                "stats": st,
            }
        )
    return out


def cell_table(pairs: list[Pair]) -> list[dict[str, Any]]:
    """Per cell and candidate state: cases, success (baseline / candidate), KL, top-1 agreement,
    exact outputs, the mean first divergent token of the outputs that diverge, state reached,
    mean cut offset."""
    groups: dict[tuple[str, str], list[Pair]] = defaultdict(list)
    for p in pairs:
        c = p.cand.cell
        key = f"{c['task']}/{c['cut']}/{c['length']}/{c['suffix']}/{c['output']}"
        groups[(key, p.cand.state)].append(p)
    rows = []
    for (key, state), ps in sorted(groups.items()):
        reached = [p.cand.reached for p in ps if p.cand.reached is not None]
        rows.append(
            {
                "cell": key,
                "state": state,
                "n": len(ps),
                "success_baseline": _rate([p.base.outcome.get("success", False) for p in ps]),
                "success_candidate": _rate([p.cand.outcome.get("success", False) for p in ps]),
                "kl": _mean([p.kl for p in ps]),
                "top1": _mean([p.top1 for p in ps]),
                "exact": sum(p.exact for p in ps) / len(ps),
                "first_divergence": _mean(
                    [float(p.first_divergence) for p in ps if p.first_divergence is not None]
                ),
                "reached": sum(reached) / len(reached) if reached else math.nan,
                "offset": _mean([float(p.cand.offset) for p in ps]),
            }
        )
    return rows


def _rate(outcomes: list[Any]) -> float:
    """Share of True among the scored outcomes (None: not scored, e.g. image cases; a missing
    outcome counts as no success); NaN if none is scored."""
    scored = [bool(v) for v in outcomes if v is not None]
    return sum(scored) / len(scored) if scored else math.nan


def _mean(values: list[float]) -> float:
    x = [v for v in values if not math.isnan(v)]
    return sum(x) / len(x) if x else math.nan


def load_table(records: list[Record]) -> list[dict[str, Any]]:
    """Per load level and arm: requests, errors, success, TTFT and end-to-end percentiles, decode
    tokens/s and prefill tokens/s (prompt tokens over TTFT)."""
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        if r.phase.startswith("load:"):
            groups[(r.phase.split(":", 1)[1], r.arm)].append(r)
    rows = []
    for (level, arm), rs in groups.items():
        ok = [r for r in rs if r.obs.error is None]
        ttft = [r.obs.ttft_s for r in ok]
        e2e = [r.obs.latency_s for r in ok]
        dec = [(len(r.obs.ids) - 1) / (r.obs.latency_s - r.obs.ttft_s) for r in ok
               if len(r.obs.ids) > 1 and r.obs.latency_s > r.obs.ttft_s]  # fmt: skip
        pre = [r.prompt_tokens / r.obs.ttft_s for r in ok if r.obs.ttft_s > 0]
        rows.append(
            {
                "level": level,
                "arm": arm,
                "n": len(rs),
                "errors": len(rs) - len(ok),
                "success": _rate([r.outcome.get("success", False) for r in ok]),
                "ttft_p50": percentile(ttft, 50),
                "ttft_p95": percentile(ttft, 95),
                "ttft_p99": percentile(ttft, 99),
                "e2e_p50": percentile(e2e, 50),
                "e2e_p95": percentile(e2e, 95),
                "e2e_p99": percentile(e2e, 99),
                "decode_tok_s": percentile(dec, 50),
                "prefill_tok_s": percentile(pre, 50),
                "replayed_tokens": sum(r.obs.replayed_tokens or 0 for r in ok),
            }
        )
    return rows
