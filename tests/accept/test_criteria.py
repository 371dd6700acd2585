"""Every acceptance metric and verdict rule on hand-built records whose values are worked out
here, independently of :mod:`replaykv.accept.criteria`: a worked example per metric, a contract
that passes at the hand value and one that must fail just past it, the no-data rule, and the
shipped example contract gating on records that break each of its criteria in turn."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from replaykv.accept.contract import EXAMPLE, Contract, Criterion, load_contract, parse_contract
from replaykv.accept.criteria import cell_table, load_table, metric, pair_up, verdicts
from replaykv.accept.run import Record
from replaykv.accept.stats import percentile
from replaykv.accept.targets import Observation

LN = math.log


def dist(*probs: float) -> dict[str, float]:
    """A whole next-token distribution over tokens "0", "1", ... as a logprob map."""
    assert sum(probs) == pytest.approx(1.0)
    return {str(i): LN(p) for i, p in enumerate(probs)}


def kl(p: tuple[float, ...], q: tuple[float, ...]) -> float:
    return sum(a * LN(a / b) for a, b in zip(p, q, strict=True))


def rec(case: str, arm: str, state: str = "cold", *, phase: str = "quality", task: str = "passkey",
        ids: list[int] | None = None, top: list[dict[str, float]] | None = None,
        outcome: dict[str, Any] | None = None, snapshot_hit: bool | None = None, ttft: float = 0.0,
        latency: float = 0.0, error: str | None = None, path: str | None = None,
        expected: str | None = None, offset: int = 0, repeat: int = 0) -> Record:  # fmt: skip
    ids = [7] if ids is None else ids
    top = [dist(0.5, 0.5)] * len(ids) if top is None else top
    obs = Observation(ids=ids, chosen=[0.0] * len(ids), top=top, snapshot_hit=snapshot_hit,
                      ttft_s=ttft, latency_s=latency, error=error, path=path)  # fmt: skip
    cell = {"task": task, "cut": "end", "length": 512, "suffix": "short", "output": "short"}
    return Record(case=case, cell=cell, index=0, arm=arm, state=state, phase=phase, cut=10,
                  offset=offset, repeat=repeat, expected_path=expected, obs=obs,
                  outcome=outcome or {})  # fmt: skip


def contract(*criteria: dict[str, Any]) -> Contract:
    return parse_contract(
        {"name": "t", "stage": "encoder_replay", "bootstrap": 500, "criteria": list(criteria)}
    )


def verdict(records: list[Record], **crit: Any) -> dict[str, Any]:
    (v,) = verdicts(contract({"name": "c", **crit}), pair_up(records), records)
    return v


def value(records: list[Record], **crit: Any) -> float:
    return float(verdict(records, **crit)["value"])


def passes_at_and_fails_past(records: list[Record], expected: float, **crit: Any) -> None:
    """The criterion's value is the hand value; it passes with its threshold there (up to
    rounding), fails a little past it, and its margin is the signed distance."""
    step = 1e-3 if verdict(records, threshold=0.0, **crit)["direction"] == "<=" else -1e-3
    lenient = step * 1e-6
    v = verdict(records, threshold=expected + lenient, **crit)
    assert v["value"] == pytest.approx(expected, rel=1e-9, abs=1e-12) and v["passed"]
    assert v["margin"] == pytest.approx(0.0, abs=1e-8)
    bad = verdict(records, threshold=expected - step, **crit)
    assert not bad["passed"] and bad["margin"] == pytest.approx(-0.001, rel=1e-5) and bad["note"] == ""
    good = verdict(records, threshold=expected + step, **crit)
    assert good["passed"] and good["margin"] == pytest.approx(0.001, rel=1e-5)


# ------------------------------------------------------------- success, validity, new failures
# case:          a     b     c     d     e (candidate outcome missing: not a pair)
# base success   T     T     T     F     T
# cand success   T     F     F     T     -
#   difference   0     1     1    -1        -> success drop 1/4, new failures 2 (b, c), new passes 1
# base valid     T     T     T     T     T
# cand valid     F     T     F     T     -   -> validity drop 2/4, validity new failures 2
SUCC = {"a": (True, True), "b": (True, False), "c": (True, False), "d": (False, True)}
VALID = {"a": (True, False), "b": (True, True), "c": (True, False), "d": (True, True)}


def outcomes() -> list[Record]:
    out = []
    for case in "abcd":
        out.append(rec(case, "baseline", outcome={"success": SUCC[case][0], "valid": VALID[case][0]}))
        out.append(
            rec(case, "candidate", "miss", outcome={"success": SUCC[case][1], "valid": VALID[case][1]})
        )
    out.append(rec("e", "baseline", outcome={"success": True, "valid": True}))
    out.append(rec("e", "candidate", "miss", outcome={}))
    return out


def test_success_drop_is_baseline_minus_candidate_over_the_pairs_with_both_outcomes() -> None:
    recs = outcomes()
    st = metric(Criterion("s", "success_drop", 0.0), pair_up(recs), recs, seed=0, n_boot=500)
    assert st["n"] == 4 and st["point"] == pytest.approx(0.25)
    assert st["baseline"] == pytest.approx(0.75) and st["candidate"] == pytest.approx(0.5)
    # McNemar on 3 discordant pairs (2 one way, 1 the other): p = 2 * (1 + 3) / 8, capped at 1
    assert st["new_failures"] == 2 and st["new_passes"] == 1 and st["p_value"] == 1.0
    passes_at_and_fails_past(recs, 0.25, metric="success_drop", statistic="point")
    # the default statistic is the upper bound of the interval, which lies above the point
    v = verdict(recs, metric="success_drop", threshold=0.25)
    assert v["statistic"] == "upper95" and v["value"] > 0.25 and not v["passed"]


def test_validity_drop_reads_validity_not_success() -> None:
    recs = outcomes()
    passes_at_and_fails_past(recs, 0.5, metric="validity_drop", statistic="point")
    st = verdict(recs, metric="validity_drop", threshold=1.0)["stats"]
    assert st["baseline"] == pytest.approx(1.0) and st["candidate"] == pytest.approx(0.5)


def test_new_failures_counts_baseline_only_successes_within_the_task_filter() -> None:
    recs = outcomes()
    passes_at_and_fails_past(recs, 2.0, metric="new_failures")
    # a tool case the candidate breaks, and one it fixes: one new failure among the tool cases
    recs += [rec("t1", "baseline", task="tool", outcome={"success": True}),
             rec("t1", "candidate", "hit", task="tool", outcome={"success": False}),
             rec("t2", "baseline", task="tool", outcome={"success": False}),
             rec("t2", "candidate", "hit", task="tool", outcome={"success": True})]  # fmt: skip
    passes_at_and_fails_past(recs, 1.0, metric="new_failures", tasks=["tool"])
    passes_at_and_fails_past(recs, 3.0, metric="new_failures")
    assert not verdict(recs, metric="new_failures", tasks=["tool"], threshold=0)["passed"]


# --------------------------------------------------------------------- KL, first KL, top-1
P0, Q0 = (0.5, 0.25, 0.25), (0.25, 0.5, 0.25)  # position 0 of case x: top-1 "0" against "1"
P1 = (0.7, 0.2, 0.1)  # position 1: the same distribution in both arms
P2, Q2 = (0.6, 0.3, 0.1), (0.5, 0.3, 0.2)  # position 2: the first divergent token, top-1 agrees
P3, Q3 = (0.1, 0.8, 0.1), (0.8, 0.1, 0.1)  # position 3: after the divergence, never compared
R0, S0 = (0.9, 0.05, 0.05), (0.6, 0.2, 0.2)  # case y, its only position


def logits() -> list[Record]:
    return [
        rec("x", "baseline", ids=[0, 0, 0, 1], top=[dist(*P0), dist(*P1), dist(*P2), dist(*P3)]),
        rec("x", "candidate", "miss", ids=[0, 0, 1, 1], top=[dist(*Q0), dist(*P1), dist(*Q2), dist(*Q3)]),
        rec("y", "baseline", ids=[0], top=[dist(*R0)]),
        rec("y", "candidate", "shift", ids=[0], top=[dist(*S0)]),
        # a hit-state pair outside the miss/shift filter, far apart
        rec("z", "baseline", ids=[0], top=[dist(0.98, 0.01, 0.01)]),
        rec("z", "candidate", "hit", ids=[1], top=[dist(0.01, 0.98, 0.01)]),
    ]


def test_kl_first_is_the_first_generated_tokens_kl_averaged_over_prompts() -> None:
    recs = logits()
    (x, y, _) = pair_up(recs)
    assert (x.compared, x.first_divergence, x.exact) == (3, 2, False) and y.exact
    expected = (kl(P0, Q0) + kl(R0, S0)) / 2
    passes_at_and_fails_past(recs, expected, metric="kl_first", states=["miss", "shift"], statistic="point")
    # kl_mean over the same pairs: x averages its three compared positions first
    mean = ((kl(P0, Q0) + 0.0 + kl(P2, Q2)) / 3 + kl(R0, S0)) / 2
    assert value(
        recs, metric="kl_mean", states=["miss", "shift"], statistic="point", threshold=1
    ) == pytest.approx(mean)
    assert value(recs, metric="kl_first", states=["hit"], statistic="point", threshold=1) == pytest.approx(
        kl((0.98, 0.01, 0.01), (0.01, 0.98, 0.01))
    )


def test_top1_agreement_is_the_share_of_compared_tokens_with_the_same_top_token() -> None:
    recs = logits()
    # x: positions 0..2 compared, top-1 differs at 0 only -> 2/3; y: 1/1 -> mean 5/6
    passes_at_and_fails_past(recs, 5 / 6, metric="top1_agreement", states=["miss", "shift"],
                             statistic="point")  # fmt: skip
    passes_at_and_fails_past(recs, (5 / 6 * 2 + 0.0) / 3, metric="top1_agreement", statistic="point")
    v = verdict(recs, metric="top1_agreement", states=["miss", "shift"], threshold=5 / 6)
    assert v["direction"] == ">=" and v["statistic"] == "lower95" and v["value"] < 5 / 6 and not v["passed"]


# ---------------------------------------------------------------------------- SWA pool misses
def test_pool_miss_rate_is_the_hit_states_lookups_that_found_no_snapshot() -> None:
    recs = []
    for i, found in enumerate((True, False, True, True, None)):  # None: the target did not say
        recs += [rec(f"h{i}", "baseline"), rec(f"h{i}", "candidate", "hit", snapshot_hit=found)]
    # miss-state lookups find nothing by construction and do not count
    recs += [rec("m", "baseline"), rec("m", "candidate", "miss", snapshot_hit=False)]
    st = metric(Criterion("p", "pool_miss_rate", 0.0), pair_up(recs), recs, seed=0, n_boot=10)
    assert st["n"] == 4
    passes_at_and_fails_past(recs, 0.25, metric="pool_miss_rate")
    passes_at_and_fails_past(recs, 0.25, metric="pool_miss_rate", states=["hit"])


# --------------------------------------------------------------------------- latency ratios
def loads() -> list[Record]:
    out = []
    # load:1 -> 101 requests per arm; baseline TTFT 0..100 s (p99 = 99), candidate twice that
    for i in range(101):
        out.append(rec(f"l{i}", "baseline", "miss", phase="load:1", ttft=float(i), latency=1.0))
        out.append(rec(f"l{i}", "candidate", "miss", phase="load:1", ttft=2.0 * i, latency=1.2))
    # load:2 -> constant TTFT 10 / 15 s; end to end 2 / 3 s
    for i in range(4):
        out.append(rec(f"m{i}", "baseline", "miss", phase="load:2", ttft=10.0, latency=2.0))
        out.append(rec(f"m{i}", "candidate", "miss", phase="load:2", ttft=15.0, latency=3.0))
    # a failed request and a quality record are not load measurements
    out.append(rec("bad", "candidate", "miss", phase="load:2", ttft=1e6, latency=1e6, error="boom"))
    out.append(rec("q", "candidate", "miss", ttft=1e6, latency=1e6))
    return out


def test_ttft_p99_ratio_is_the_worst_candidate_over_baseline_p99_over_the_levels() -> None:
    recs = loads()
    v = verdict(recs, metric="ttft_p99_ratio", threshold=2.0)
    assert v["stats"]["per_level"] == {"load:1": pytest.approx(2.0), "load:2": pytest.approx(1.5)}
    passes_at_and_fails_past(recs, 2.0, metric="ttft_p99_ratio")


def test_e2e_p99_ratio_reads_end_to_end_latency() -> None:
    recs = loads()
    v = verdict(recs, metric="e2e_p99_ratio", threshold=2.0)
    assert v["stats"]["per_level"] == {"load:1": pytest.approx(1.2), "load:2": pytest.approx(1.5)}
    passes_at_and_fails_past(recs, 1.5, metric="e2e_p99_ratio")
    # a task filter keeps only that task's load requests: none here
    assert verdict(recs, metric="e2e_p99_ratio", tasks=["tool"], threshold=10)["note"] == "no data"


def test_percentile_interpolates_linearly_and_skips_missing_values() -> None:
    assert percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)
    assert percentile([1.0, 2.0, 3.0, 4.0, math.nan], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert math.isnan(percentile([], 50))


# ----------------------------------------------------------------------------- verdict rules
@pytest.mark.parametrize(
    "crit",
    [
        {"metric": "success_drop", "states": ["shift"]},
        {"metric": "validity_drop", "tasks": ["extract"]},
        {"metric": "new_failures", "tasks": ["tool"]},
        {"metric": "kl_mean", "states": ["hit"]},
        {"metric": "kl_first", "states": ["hit"]},
        {"metric": "top1_agreement", "states": ["hit"]},
        {"metric": "exact_match", "states": ["hit"]},
        {"metric": "prefill_work_ratio", "states": ["hit"]},
        {"metric": "pool_miss_rate"},
        {"metric": "state_reached"},
        {"metric": "ttft_p99_ratio"},
        {"metric": "e2e_p99_ratio"},
    ],
)
def test_a_metric_with_no_data_fails(crit: dict[str, Any]) -> None:
    recs = outcomes()  # miss-state passkey pairs only, no load runs, no paths, no snapshot flags
    for threshold in (-1e9, 0.0, 1e9):
        v = verdict(recs, threshold=threshold, **crit)
        assert math.isnan(v["value"]) and not v["passed"] and v["note"] == "no data"


def test_every_criterion_gets_its_own_verdict_and_the_directions_are_opposite() -> None:
    recs = outcomes() + logits()
    c = contract({"name": "drop", "metric": "success_drop", "statistic": "point", "threshold": 0.3},
                 {"name": "top1", "metric": "top1_agreement", "statistic": "point", "threshold": 0.96,
                  "states": ["miss", "shift"]})  # fmt: skip
    got = {v["name"]: v for v in verdicts(c, pair_up(recs), recs)}
    # drop: the logits() records carry no outcomes, so only a..d count: 0.25 <= 0.3
    assert got["drop"]["passed"] and got["drop"]["margin"] == pytest.approx(0.05)
    # top1 over a..e (agree: identical default maps) and x, y: (5 + 2/3 + 1) / 7
    expected = (5 + 2 / 3 + 1) / 7
    assert got["top1"]["value"] == pytest.approx(expected)
    assert not got["top1"]["passed"] and got["top1"]["margin"] == pytest.approx(expected - 0.96)


def example_records(break_: str | None) -> list[Record]:
    """Records on which every criterion of the shipped example passes, except the one named."""
    out = []
    for i, task in enumerate(("passkey", "tool", "extract")):
        ok = {"success": True, "valid": True}
        out.append(rec(f"c{i}", "baseline", task=task, outcome=ok, path="cold", expected="cold"))
        out.append(rec(f"c{i}", "candidate", "hit", task=task, outcome=ok, snapshot_hit=break_ != "pool",
                       path="hit", expected="hit"))  # fmt: skip
        cand = {"success": not (break_ == "success" or (break_ == "tool" and task == "tool")),
                "valid": not (break_ == "valid" and task == "extract")}  # fmt: skip
        top = [dist(0.9, 0.05, 0.05) if break_ != "top1" else dist(0.05, 0.9, 0.05)]
        if break_ == "kl":
            top = [dist(0.6, 0.2, 0.2)]
        reached = "bounded" if break_ != "state" else "exact"
        out.append(rec(f"c{i}", "candidate", "miss", task=task, outcome=cand, top=top, path=reached,
                       expected="bounded"))  # fmt: skip
        work = 40 if break_ != "work" else 60
        out[-1].obs.prefill_work, out[-1].obs.full_prefill_work = work, 100
        out[-2].obs.top = out[-3].obs.top = [dist(0.9, 0.05, 0.05)]
    slow = 1.3 if break_ == "latency" else 1.1
    for level in ("load:1", "load:2"):
        out.append(rec("l", "baseline", "miss", phase=level, latency=1.0, ttft=0.1))
        out.append(rec("l", "candidate", "miss", phase=level, latency=slow, ttft=0.1))
    return out


@pytest.mark.parametrize(
    ("break_", "failing"),
    [
        (None, []),
        ("state", ["states-forced"]),
        ("pool", ["hit-snapshot-found"]),
        ("kl", ["miss-kl"]),
        ("top1", ["miss-kl", "miss-top1"]),
        ("success", ["miss-success-budget", "tool-no-new-failures"]),
        ("tool", ["miss-success-budget", "tool-no-new-failures"]),
        ("valid", ["extract-validity"]),
        ("work", ["miss-work"]),
        ("latency", ["p99-latency"]),
    ],
)
def test_the_shipped_example_contract_fails_exactly_the_broken_criteria(
    break_: str | None, failing: list[str]
) -> None:
    c = load_contract(EXAMPLE)
    c = dataclasses.replace(c, bootstrap=200)
    recs = example_records(break_)
    got = verdicts(c, pair_up(recs), recs)
    assert sorted(v["name"] for v in got if not v["passed"]) == failing
    assert all(not math.isnan(v["value"]) for v in got)


# ------------------------------------------------------------------------- report tables
def test_cell_table_groups_by_cell_and_state() -> None:
    recs = outcomes() + logits()
    for r in recs:
        r.offset = 4 if r.case in "ab" else 0
    rows = {(r["cell"], r["state"]): r for r in cell_table(pair_up(recs))}
    cell = "passkey/end/512/short/short"
    assert set(rows) == {(cell, "miss"), (cell, "shift"), (cell, "hit")}
    miss = rows[(cell, "miss")]  # a, b, c, d, e, x (a missing outcome counts as no success)
    assert miss["n"] == 6
    assert miss["success_baseline"] == pytest.approx(4 / 6) and miss["success_candidate"] == pytest.approx(
        2 / 6
    )
    assert miss["exact"] == pytest.approx(5 / 6) and miss["first_divergence"] == pytest.approx(2.0)
    assert miss["top1"] == pytest.approx((5 + 2 / 3) / 6) and miss["offset"] == pytest.approx(8 / 6)
    assert miss["kl"] == pytest.approx((kl(P0, Q0) + kl(P2, Q2)) / 3 / 6)
    assert math.isnan(miss["reached"]) and rows[(cell, "hit")]["first_divergence"] == pytest.approx(0.0)


def test_load_table_percentiles_errors_and_throughput() -> None:
    recs = loads()
    recs[0].obs.ids = [1, 2, 3, 4, 5]  # 4 tokens after the first in 1 s - 0 s
    rows = {(r["level"], r["arm"]): r for r in load_table(recs)}
    assert set(rows) == {("1", "baseline"), ("1", "candidate"), ("2", "baseline"), ("2", "candidate")}
    b1, c2 = rows[("1", "baseline")], rows[("2", "candidate")]
    assert b1["n"] == 101 and b1["errors"] == 0 and b1["ttft_p99"] == pytest.approx(99.0)
    assert b1["ttft_p50"] == pytest.approx(50.0) and b1["ttft_p95"] == pytest.approx(95.0)
    assert b1["decode_tok_s"] == pytest.approx(4.0)
    assert c2["n"] == 5 and c2["errors"] == 1 and c2["e2e_p99"] == pytest.approx(3.0)
    assert c2["ttft_p50"] == pytest.approx(15.0) and math.isnan(c2["decode_tok_s"])
