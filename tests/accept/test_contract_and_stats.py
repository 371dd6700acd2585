"""The contract parser (errors name the field; the digest moves with any threshold) and the
statistics (bootstrap, exact McNemar, top-k KL against the full KL)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from scipy import stats

from replaykv.accept.cases import build_cases, cells
from replaykv.accept.contract import EXAMPLE, ContractError, load_contract, parse_contract
from replaykv.accept.stats import bootstrap_mean, mcnemar_exact, topk_kl

BASE: dict[str, Any] = {
    "name": "t",
    "stage": "encoder_replay",
    "criteria": [{"name": "kl", "metric": "kl_mean", "threshold": 0.1}],
}


def test_the_shipped_example_parses_and_covers_the_matrix() -> None:
    c = load_contract(EXAMPLE)
    assert c.stage == "encoder_replay" and c.criteria
    m = c.matrix
    assert set(m.tasks) == {"passkey", "multihop", "chain", "code_edit", "extract", "tool"}
    assert {"start", "window_before", "window_after", "end"} <= set(m.cuts)
    assert set(m.suffixes) == {"empty", "short", "long"} and set(m.outputs) == {
        "short",
        "long",
        "multi_turn",
    }
    assert len(m.concurrency) == 3


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"stage": "yolo"}, "stage"),
        ({"criteria": []}, "criteria"),
        ({"criteria": [{"name": "x", "metric": "vibes", "threshold": 1}]}, "metric"),
        ({"criteria": [{"name": "x", "metric": "kl_mean", "threshold": 1, "states": ["warm"]}]}, "states"),
        ({"matrix": {"tasks": ["poetry"]}}, "matrix.tasks"),
        ({"matrix": {"lengths": [100]}}, "matrix.lengths"),
        ({"matrix": {"concurrency": [0]}}, "matrix.concurrency"),
        ({"matrix": {"bogus": 1}}, "matrix: unknown"),
        ({"sampling": {"temperature": 0.7}}, "repeats"),
        ({"surprise": 1}, "unknown top-level"),
    ],
)
def test_bad_contracts_name_the_field(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(ContractError, match=needle):
        parse_contract({**BASE, **patch})


def test_the_digest_moves_with_a_threshold(tmp_path: Any) -> None:
    a = parse_contract(BASE)
    b = parse_contract({**BASE, "criteria": [{"name": "kl", "metric": "kl_mean", "threshold": 0.2}]})
    assert (
        a.digest() != b.digest()
        and a.digest() == parse_contract(yaml.safe_load(yaml.safe_dump(BASE))).digest()
    )


def test_one_factor_at_a_time_cells() -> None:
    c = parse_contract({**BASE, "matrix": {"tasks": ["passkey"], "cuts": ["end", "start"], "lengths": [512, 1024],
                                           "suffixes": ["short", "image"], "outputs": ["short", "long"]}})  # fmt: skip
    got = [(x.cut, x.length, x.suffix, x.output) for x in cells(c.matrix)]
    assert got == [("end", 512, "short", "short"), ("start", 512, "short", "short"),
                   ("end", 1024, "short", "short"), ("end", 512, "image", "short"),
                   ("end", 512, "short", "long")]  # fmt: skip
    fact = parse_contract({**BASE, "matrix": {**c.to_dict()["matrix"], "design": "factorial"}})
    assert len(cells(fact.matrix)) == 2 * 2 * 2 * 2


def test_cases_place_their_cuts() -> None:
    from replaykv.train.data import load_corpus

    c = parse_contract({**BASE, "matrix": {"tasks": ["passkey"], "cuts": ["end", "boundary", "window_before",
                        "window_after", "start"], "lengths": [512], "suffixes": ["short", "empty", "long"],
                        "outputs": ["short", "multi_turn"], "shifts": [-130, 130]}})  # fmt: skip
    cases = build_cases(c, load_corpus(splits=("heldout",))["heldout"], window=128)
    by = {(x.cell.cut, x.cell.suffix, x.cell.output): x for x in cases}
    s = len(by[("end", "short", "short")].prompt)
    assert s == 512 and by[("end", "short", "short")].cut == 512 - 24
    assert by[("end", "empty", "short")].cut == 511 and by[("end", "long", "short")].cut == 512 - 280
    b = by[("boundary", "short", "short")]
    assert b.cut - 128 == b.evidence[1]  # the evidence ends where the replay span begins
    assert (
        by[("window_before", "short", "short")].cut == 127
        and by[("window_after", "short", "short")].cut == 129
    )
    assert by[("start", "short", "short")].cut == 64
    mt = by[("end", "short", "multi_turn")]
    assert mt.prompt[: mt.cut][-len(mt.sample.answer) :] == mt.sample.answer  # the cut ends turn 1
    e = by[("end", "short", "short")]
    labels = dict(e.shifts)
    assert labels["-130"] == e.cut - 130 and labels["chunk-1"] == 255 and "+130" not in labels  # past the end


def test_bootstrap_and_mcnemar() -> None:
    st = bootstrap_mean([0.0, 1.0] * 50, n_boot=4000, seed=1)
    assert st["mean"] == 0.5 and 0.39 < st["lower95"] < 0.45 and 0.55 < st["upper95"] < 0.61
    assert bootstrap_mean([])["n"] == 0 and math.isnan(bootstrap_mean([])["mean"])
    # 8 discordant pairs all one way: p = 2 * (1/2)^8
    t = mcnemar_exact([True] * 8 + [False] * 4, [False] * 8 + [False] * 4)
    assert t["new_failures"] == 8 and t["p_value"] == pytest.approx(2 / 256)
    assert mcnemar_exact([True, False], [True, False])["p_value"] == 1.0


@pytest.mark.parametrize("b, c", [(0, 0), (8, 0), (3, 5), (7, 2), (20, 31), (1, 0), (60, 40)])
def test_mcnemar_equals_scipys_exact_binomial_test(b: int, c: int) -> None:
    base = [True] * b + [False] * c + [True] * 3 + [False] * 2  # concordant pairs do not count
    cand = [False] * b + [True] * c + [True] * 3 + [False] * 2
    got = mcnemar_exact(base, cand)
    assert (got["new_failures"], got["new_passes"]) == (b, c)
    want = 1.0 if b + c == 0 else stats.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue
    assert got["p_value"] == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bootstrap_interval_agrees_with_scipys_percentile_bootstrap(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    x = rng.gamma(2.0, 1.5, size=60)  # skewed, as KL values are
    ours = bootstrap_mean(x.tolist(), n_boot=20000, seed=seed)
    theirs = stats.bootstrap((x,), np.mean, n_resamples=20000, method="percentile", confidence_level=0.95,
                             random_state=np.random.default_rng(seed)).confidence_interval  # fmt: skip
    width = theirs.high - theirs.low
    assert ours["mean"] == pytest.approx(float(x.mean()))
    # different resamples: the end points agree to within Monte Carlo error (a few % of the width)
    assert (
        abs(ours["lower95"] - theirs.low) < 0.04 * width and abs(ours["upper95"] - theirs.high) < 0.04 * width
    )


def _top(lp: torch.Tensor, k: int) -> dict[str, float]:
    v, i = torch.topk(lp, k)
    return {str(int(a)): float(b) for a, b in zip(i, v, strict=True)}


def test_topk_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_below() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.log_softmax(torch.randn(64, generator=g) * 2, -1).double()
        q = torch.log_softmax(torch.randn(64, generator=g) * 2, -1).double()
        full = float((p.exp() * (p - q)).sum())
        assert topk_kl(_top(p, 64), _top(q, 64)) == pytest.approx(full, rel=1e-6)
        assert topk_kl(_top(p, 20), _top(q, 20)) <= full + 1e-9
    same = _top(torch.log_softmax(torch.randn(64, generator=g), -1), 20)
    assert topk_kl(same, same) == pytest.approx(0.0, abs=1e-12)


def test_code_edit_cases() -> None:
    import numpy as np

    from replaykv.accept.cases import code_edit
    from replaykv.train.data import load_corpus
    from replaykv.train.tasks import TOKENIZER, score

    heldout = load_corpus(splits=("heldout",))["heldout"]
    for seed in range(5):
        s = code_edit(np.random.default_rng(seed), heldout, 512)
        assert s is not None and len(s.prompt) == 512
        a, b = s.evidence
        snippet = TOKENIZER.decode(list(s.prompt[a:b]))
        var, new = s.answer_text.split(" = ")
        assert snippet.startswith("\ndef ") and f"    {var} = " in snippet and new not in snippet
        assert score(s, s.answer_text) and not score(s, s.answer_text + "0")
    at = code_edit(np.random.default_rng(0), heldout, 512, evidence_end=300)
    assert at is not None and at.evidence[1] == 300
    c = parse_contract({**BASE, "matrix": {"tasks": ["code_edit"], "cuts": ["boundary"], "lengths": [512]}})
    (case,) = build_cases(c, heldout, window=128)[:1]
    assert case.cut - 128 == case.evidence[1]
