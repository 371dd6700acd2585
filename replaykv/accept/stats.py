"""Statistics of paired comparisons: bootstrap intervals, the exact McNemar test, a top-k KL
estimate and latency percentiles.

Every comparison is paired: the same prompt (and repeat) in the baseline and the candidate arm.
Intervals are 95% percentile-bootstrap intervals of the mean over prompts, resampled with a
fixed seed, so a report is reproducible. Pass/fail outcomes also get the exact two-sided
McNemar test (a binomial test on the discordant pairs).

KL from top-k log-probabilities (what an OpenAI-compatible endpoint returns): over the baseline's
k most likely tokens R plus one bucket for everything else,
    KL ≈ Σ_{i∈R} p_i log(p_i / q_i) + p_rest log(p_rest / q_rest),
where q_i is the candidate's probability when i is in its own top-k and otherwise the largest
value it can have (no more than the candidate's least likely listed token, nor than the mass it
left unlisted); p_rest, q_rest are the masses outside R. Coarse-graining never increases KL and
the unlisted q_i are upper bounds, so the estimate errs low (a lower bound when the candidate
lists R) and tightens as k grows; it needs no vocabulary size, so any endpoint can be measured.
Not for: deciding pass or fail (see :mod:`replaykv.accept.criteria`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

EPS = 1e-12


def _bootstrap(values: Sequence[float], stat: str, n_boot: int, seed: int) -> dict[str, float]:
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    f = np.mean if stat == "mean" else np.median
    if x.size == 0:
        return {"n": 0, stat: math.nan, "lower95": math.nan, "upper95": math.nan}
    point = float(f(x))
    if x.size == 1 or np.all(x == x[0]):
        return {"n": int(x.size), stat: point, "lower95": point, "upper95": point}
    rng = np.random.default_rng(seed)
    draws = f(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return {"n": int(x.size), stat: point, "lower95": float(lo), "upper95": float(hi)}


def bootstrap_mean(values: Sequence[float], n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Mean of `values` with its 95% percentile-bootstrap interval (NaN when empty)."""
    return _bootstrap(values, "mean", n_boot, seed)


def bootstrap_median(values: Sequence[float], n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Median of `values` with its 95% percentile-bootstrap interval (NaN when empty)."""
    return _bootstrap(values, "median", n_boot, seed)


def mcnemar_exact(base: Sequence[bool], cand: Sequence[bool]) -> dict[str, float]:
    """Exact two-sided McNemar test of paired pass/fail outcomes: b = baseline-only passes (new
    failures), c = candidate-only passes; p = P(|B - n/2| >= |b - n/2|) under Binomial(b + c, 1/2)."""
    b = sum(1 for x, y in zip(base, cand, strict=True) if x and not y)
    c = sum(1 for x, y in zip(base, cand, strict=True) if y and not x)
    n = b + c
    if n == 0:
        return {"new_failures": b, "new_passes": c, "p_value": 1.0}
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return {"new_failures": b, "new_passes": c, "p_value": min(1.0, 2 * tail)}


def topk_kl(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """KL(p || q) estimated from two top-k log-probability maps (see the module docstring)."""
    if not p_top:
        return math.nan
    q_listed = sum(math.exp(v) for v in q_top.values())
    q_min = min((math.exp(v) for v in q_top.values()), default=1.0)
    q_unlisted_each = max(EPS, min(q_min, 1.0 - q_listed))
    kl, p_mass, q_mass = 0.0, 0.0, 0.0
    for tok, lp in p_top.items():
        p = math.exp(lp)
        q = math.exp(q_top[tok]) if tok in q_top else q_unlisted_each
        kl += p * (math.log(max(p, EPS)) - math.log(max(q, EPS)))
        p_mass += p
        q_mass += q
    p_rest, q_rest = max(0.0, 1.0 - p_mass), max(EPS, 1.0 - q_mass)
    if p_rest > EPS:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


def top1(top: dict[str, float]) -> str | None:
    """The most likely token of a top-k map (ties: the first listed, which is the lower id)."""
    return max(top.items(), key=lambda kv: kv[1])[0] if top else None


def percentile(values: Sequence[float], q: float) -> float:
    x = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.percentile(x, q)) if x else math.nan
