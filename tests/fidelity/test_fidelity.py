"""The fidelity harness measures what it claims: paths that equal the exact one read 0 / 100%,
a deliberately broken replay moves every figure, the decode rows are the rows a one-shot
prefill of prompt + continuation scores, KL and the first divergence are computed as defined,
turn-by-turn sessions with the snapshot kept reproduce one pass exactly, and the command writes
its JSON, tables and plot."""

from __future__ import annotations

import json
import math

import pytest
import torch

from replaykv.accept.stats import bootstrap_median
from replaykv.engine.oneshot import score
from replaykv.fidelity.cli import BEGIN, END
from replaykv.fidelity.cli import main as fidelity_main
from replaykv.fidelity.drift import session, turn_bounds
from replaykv.fidelity.prompts import Prompt, cut_for, prompts
from replaykv.fidelity.study import StudySpec, resolve_offset, token_fidelity
from replaykv.fidelity.traces import Trace, compare, trace
from replaykv.model.checkpoint import build_model
from replaykv.model.init import init_weights
from replaykv.model.presets import get_preset
from replaykv.train.data import load_corpus


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return init_weights(build_model(get_preset("v41-tiny")), seed=3).eval()


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(5)).tolist()


def test_decode_rows_are_the_rows_of_one_prefill_of_prompt_and_continuation(model, ids) -> None:  # type: ignore[no-untyped-def]
    exact = trace(model, ids, 0, "exact", 10)
    ref = torch.log_softmax(score(model, ids + exact.continuation[:-1]), dim=-1)
    assert exact.logprobs.shape == ref.shape
    assert torch.allclose(exact.logprobs, ref, atol=1e-5)
    assert exact.continuation == ref[len(ids) - 1 :].argmax(dim=-1).tolist()  # greedy


@pytest.mark.parametrize("cut", [40, 63, 100])
def test_paths_equal_to_the_exact_one_read_zero_and_full_agreement(model, ids, cut: int) -> None:  # type: ignore[no-untyped-def]
    exact = trace(model, ids, 0, "exact", 10)
    c = compare(exact, trace(model, ids, cut, "recovery", exact.continuation), len(ids))
    assert c["prompt"]["rows"] == len(ids) - 1 - cut and c["continuation"]["rows"] == 10
    for part in ("prompt", "continuation"):
        assert c[part]["kl_max"] < 1e-6 and c[part]["top1"] == 1.0
    assert c["first_divergence"] is None
    # decoder replay over a prompt no longer than W runs every decoder row: the exact path
    short = ids[:8]
    ex_short = trace(model, short, 0, "exact", 6)
    d = compare(ex_short, trace(model, short, 4, "decoder", ex_short.continuation), len(short))
    assert d["prompt"]["kl_max"] < 1e-6 and d["continuation"]["kl_max"] < 1e-6 and d["first_divergence"] is None


def test_a_broken_replay_moves_the_figures(model, ids) -> None:  # type: ignore[no-untyped-def]
    exact = trace(model, ids, 0, "exact", 10)
    bounded, broken = [], []
    for cut in (40, 64, 90):
        b = compare(exact, trace(model, ids, cut, "bounded", exact.continuation), len(ids))
        x = compare(exact, trace(model, ids, cut, "broken", exact.continuation), len(ids))
        assert b["prompt"]["kl_mean"] > 1e-5  # bounded replay is approximate ...
        bounded.append(b["prompt"]["kl_mean"])
        broken.append(x["prompt"]["kl_mean"])
    assert min(broken) > 1e-4 and sum(broken) > 1.5 * sum(bounded)  # ... the broken one far more so


def test_kl_and_first_divergence_follow_their_definitions() -> None:
    gen = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(6, 5, generator=gen), dim=-1)
    other = torch.log_softmax(torch.randn(4, 5, generator=gen), dim=-1)
    other[0] = float("nan")  # a row the path did not compute
    # a prompt of 4 tokens: rows 0..2 are prompt rows, rows 3..5 the continuation (greedy tokens)
    exact = Trace(0, ref, ref[3:].argmax(dim=-1).tolist())
    got = Trace(2, other, [])
    c = compare(exact, got, prompt_len=4)
    for i in range(4):
        p, q = ref[2 + i].exp(), other[i].exp()
        naive = sum(float(p[v] * (math.log(p[v]) - math.log(q[v]))) for v in range(5)) if i else None
        assert (c["kl"][i] is None) if naive is None else c["kl"][i] == pytest.approx(naive, rel=1e-5)
    firsts = [j for j in range(3) if int(other[1 + j].argmax()) != exact.continuation[j]]
    assert c["first_divergence"] == (firsts[0] if firsts else None)
    assert c["prompt"]["rows"] == 0 and c["continuation"]["rows"] == 3


def test_sessions_in_turns_with_the_snapshot_kept_reproduce_one_pass(model, ids) -> None:  # type: ignore[no-untyped-def]
    bounds = turn_bounds(len(ids), 5)
    assert bounds == [30, 60, 90, 120, 150]
    kept = session(model, ids, bounds, keep_snapshot=True, answer=(7, 8))
    missed = session(model, ids, bounds, keep_snapshot=False, answer=(7, 8))
    assert [t["path"] for t in kept["turns_detail"]] == ["cold"] + ["hit"] * 4
    assert [t["path"] for t in missed["turns_detail"]] == ["cold"] + ["bounded"] * 4
    assert all(t["global_kv_rel_error"] == 0 and t["kl_last_row"] < 1e-6 for t in kept["turns_detail"])
    assert kept["answer_turns"] == kept["answer_one_pass"]
    errs = [t["global_kv_rel_error"] for t in missed["turns_detail"]]
    assert errs[0] == 0 and min(errs[1:]) > 1e-3  # every later turn writes from an approximate state
    with pytest.raises(ValueError, match="aligned turns"):
        turn_bounds(10, 6)


def test_offsets_cuts_and_medians() -> None:
    assert [resolve_offset(x, 128) for x in ("0", "W-1", "W+1", "2W+1", "-3", "deep")] == [0, 127, 129, 257, -3, "deep"]
    for bad in ("x", "W*2", "", "1.5"):
        with pytest.raises(ValueError, match="offset"):
            resolve_offset(bad, 128)
    p = Prompt("text", 300, 0, tuple(range(300)), anchor=100)
    assert cut_for(p, 128) == 228 and cut_for(p, "deep") == 284 and cut_for(p, 200) is None and cut_for(p, -100) is None
    m = bootstrap_median([1.0, 2.0, 3.0, 4.0, 100.0])
    assert m["median"] == 3.0 and m["lower95"] <= 3.0 <= m["upper95"] and m["n"] == 5
    assert bootstrap_median([])["n"] == 0


def test_held_out_prompts_anchor_at_their_evidence() -> None:
    heldout = load_corpus(max_files=30)["heldout"]
    for family in ("passkey", "chain", "text"):
        ps = prompts(heldout, family, 512, 3, 32)
        assert len(ps) == 3 and all(len(p.ids) == 512 and 0 < p.anchor <= 512 for p in ps)
        assert ps == prompts(heldout, family, 512, 3, 32)  # deterministic
    key = prompts(heldout, "passkey", 512, 1, 32)[0]
    digits = bytes(key.answer[:-1]).decode()
    assert digits.isdigit() and digits in bytes(t for t in key.ids[: key.anchor] if t < 256).decode(errors="replace")


def test_token_fidelity_grid_and_summaries(model) -> None:  # type: ignore[no-untyped-def]
    heldout = load_corpus(max_files=30)["heldout"]
    spec = StudySpec(("passkey", "text"), (160,), 2, ("0", "W", "deep"), ("bounded", "recovery"), 4)
    out = token_fidelity(model, heldout, spec)
    assert {c["path"] for c in out["cells"]} == {"bounded", "recovery"}
    rec = [r for r in out["summary"] if r["path"] == "recovery" and r["family"] == "all" and r["offset"] == "all"]
    assert rec[0]["kl_prompt"]["median"] < 1e-6 and rec[0]["diverged"]["k"] == 0
    assert rec[0]["top1_continuation"]["median"] == 1.0 and rec[0]["first_divergence"]["median"] == 4


def test_the_command_writes_json_tables_and_plot(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    doc = tmp_path / "fidelity.md"
    doc.write_text(f"# Fidelity\n\nintro\n\n{BEGIN}\nold\n{END}\n\ntail\n")
    rc = fidelity_main([
        "--preset", "v41-tiny", "--out", str(tmp_path / "out"), "--lengths", "160", "--prompts", "1",
        "--answer-prompts", "1", "--drift-prompts", "1", "--turns", "2", "--continuation", "3",
        "--families", "passkey,text", "--offsets", "0,W", "--corpus-files", "30", "--quiet", "--write", str(doc),
    ])  # fmt: skip
    assert rc == 0
    result = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert {"tokens", "answers", "drift", "environment", "model", "command"} <= set(result)
    assert (tmp_path / "out" / "decay.png").stat().st_size > 1000
    text = doc.read_text()
    assert "old" not in text and "### Per-token fidelity" in text and text.endswith("tail\n")
    assert fidelity_main(["--preset", "v41-tiny", "--out", str(tmp_path / "x"), "--parts", "nope"]) == 2
    assert "--parts" in capsys.readouterr().err
    assert fidelity_main(["--preset", "v41-tiny", "--out", str(tmp_path / "x"), "--offsets", "W*2"]) == 2
    assert "offset 'W*2'" in capsys.readouterr().err
