"""Training in stages and the shipping bar: a stage checkpoint is written at each stage end, a
run without its full state continues from it (fresh moments, re-warm-up, the same data steps);
the bar's cases sit where their cells say, its teacher-forced scoring agrees with the card's and
with greedy generation, and its rung rule passes and fails on hand-built cells."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from replaykv.model.checkpoint import weight_files
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train import loop, stages
from replaykv.train.bar import BarSpec, bar_cases, meets, rung, score_cases
from replaykv.train.evaluate import task_accuracy, wilson
from replaykv.train.recipes import SMALL_DECAY_END, EvalSpec, Mixture, Phase, small, tiny


def test_decay_end_keeps_the_rates_of_the_steps_before_an_extension() -> None:
    extended = small()
    first_plan = dataclasses.replace(
        extended,
        phases=extended.phases[:-1],
        stages=tuple(e for e in extended.stage_ends if e <= SMALL_DECAY_END),
        decay_end=None,
    )
    assert first_plan.total_steps == SMALL_DECAY_END < extended.total_steps
    for step in (0, 99, 100, 1000, 3989, SMALL_DECAY_END - 1):
        assert extended.lr_at(step) == first_plan.lr_at(step)
    assert extended.lr_at(SMALL_DECAY_END - 2) > extended.min_lr
    assert extended.lr_at(SMALL_DECAY_END) == extended.lr_at(extended.total_steps - 1) == extended.min_lr
    with pytest.raises(ValueError, match="decay_end"):
        dataclasses.replace(extended, decay_end=extended.warmup)


def test_a_phase_with_its_own_rate_ramps_to_it_and_keeps_it() -> None:
    base = small()
    end = base.total_steps
    extra = dataclasses.replace(base.phases[-1], name="own", steps=100, cycle=(), lr=5e-4)
    again = dataclasses.replace(extra, name="again", lr=1e-4)
    recipe = dataclasses.replace(base, phases=(*base.phases, extra, again), stages=())
    for step in (0, 100, SMALL_DECAY_END, end - 1):  # the steps before keep their rates
        assert recipe.lr_at(step) == base.lr_at(step)
    ramp = [recipe.lr_at(end + k) for k in range(base.rewarmup + 1)]
    assert ramp == sorted(ramp) and base.min_lr < ramp[0] < ramp[-2] < 5e-4 == ramp[-1]
    assert ramp[0] == pytest.approx(base.min_lr + (5e-4 - base.min_lr) / (base.rewarmup + 1))
    assert recipe.lr_at(end + 99) == 5e-4
    assert recipe.lr_at(end + 100) == pytest.approx(5e-4 + (1e-4 - 5e-4) / (base.rewarmup + 1))
    assert recipe.lr_at(end + 100 + base.rewarmup) == recipe.lr_at(end + 199) == 1e-4
    with pytest.raises(ValueError, match="lr must be positive"):
        dataclasses.replace(extra, lr=0.0)


def _staged():  # type: ignore[no-untyped-def]
    mix = Mixture(text=0.5, passkey=0.5, multihop=0.0, chain=0.0, extract=0.0, tool=0.0)
    return dataclasses.replace(
        tiny(),
        phases=(Phase("base", 6, 64, 2, mix),),
        warmup=1,
        quick_eval=None,
        checkpoint_every=2,
        stages=(3, 6),
        rewarmup=2,
    )


def _log(out):  # type: ignore[no-untyped-def]
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_non_finite_gradients_skip_their_steps_then_stop_the_run(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    """A stage checkpoint with one NaN in the output projection: every step's gradient is NaN, so
    the loop applies none of them, logs each as skipped and stops after `NONFINITE_LIMIT` in a row
    with an error that names them, instead of training on."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from replaykv.train.step import NONFINITE_LIMIT

    recipe = _staged()
    loop.train(recipe, tmp_path / "first", corpus=corpus, progress=False, stages=1, evaluate_at_end=False)
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "first" / "stage", broken)
    (path,) = [f for f in weight_files(broken) if "lm_head.weight" in load_file(f)]
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors["lm_head.weight"][5, 0] = float("nan")
    save_file(tensors, path, metadata=meta)
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"steps 4-6 of phase 'base' gave non-finite gradients"):
        loop.train(
            recipe, out, resume=True, from_stage=broken, corpus=corpus, progress=False, evaluate_at_end=False
        )
    skipped = [r["step"] for r in _log(out) if r.get("skipped") == "non-finite gradient"]
    assert NONFINITE_LIMIT == 3 and skipped == [4, 5, 6]
    assert not (out / "stage").exists()  # no stage checkpoint from the broken steps


def test_a_stage_checkpoint_lets_a_bare_machine_continue(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = _staged()
    out = tmp_path / "run"
    first = loop.train(recipe, out, corpus=corpus, progress=False, stages=1, evaluate_at_end=False)
    assert first.steps == 3 and not first.exported
    info = stages.read_stage(out / "stage")
    assert info is not None and (info["stage"], info["step"], info["recipe"]) == (1, 3, "tiny")
    assert info["recipe_digest"] == recipe.digest() and info["stage_seconds"]["1"] > 0
    # The exact continuation, for reference.
    exact = tmp_path / "exact"
    shutil.copytree(out, exact)
    warm = loop.train(recipe, exact, resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    # A machine with the committed stage only: no train_state/, fresh moments, ramped rate.
    shutil.rmtree(out / "train_state")
    cold = loop.train(recipe, out, resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    assert cold.steps == warm.steps == 6
    records = _log(out)
    assert any(r.get("cold_resume") for r in records)
    rates = {r["step"]: r["lr"] for r in records if "lr" in r and r["step"] > 3}
    assert rates[4] == pytest.approx(recipe.lr_at(3) / 3) and rates[5] == pytest.approx(
        recipe.lr_at(4) * 2 / 3
    )
    assert rates[6] == pytest.approx(recipe.lr_at(5))
    final = stages.read_stage(out / "stage")
    assert final is not None and (final["stage"], final["step"]) == (2, 6)
    # The same data steps as the exact run, so the losses are close but the moments differ.
    exact_loss = {r["step"]: r["loss"] for r in _log(exact) if "loss" in r}
    cold_loss = {r["step"]: r["loss"] for r in records if "loss" in r and r["step"] > 3}
    assert abs(cold_loss[4] - exact_loss[4]) < 0.5
    shipped = tmp_path / "weights"
    stages.ship_stage(out / "stage", shipped)
    assert (shipped / "model.safetensors").read_bytes() == (out / "stage" / "model.safetensors").read_bytes()


def test_a_sharded_stage_checkpoint_ships_over_a_single_file_one_and_a_bare_machine_continues_from_it(
    tmp_path,
    corpus,  # type: ignore[no-untyped-def]
) -> None:
    recipe = _staged()
    out = tmp_path / "run"
    loop.train(
        recipe, out, corpus=corpus, progress=False, stages=1, evaluate_at_end=False, shard_bytes=1 << 20
    )
    files = weight_files(out / "stage")
    assert len(files) >= 2 and all(f.stat().st_size <= 1 << 20 for f in files)
    shipped = tmp_path / "weights"
    shipped.mkdir()
    (shipped / "model.safetensors").write_bytes(b"an earlier single-file checkpoint")
    (shipped / "bar.json").write_text('{"rung": 1, "stage": {"stage": 0}}')
    stages.ship_stage(out / "stage", shipped)
    assert not (shipped / "model.safetensors").exists() and not (shipped / "bar.json").exists()
    card = (shipped / "MODEL_CARD.md").read_text()
    assert "stage 1 of 2" in card and "Not scored on the shipping bar yet" in card
    assert [f.name for f in weight_files(shipped)] == [f.name for f in files]
    bare = loop.train(
        recipe, tmp_path / "bare", resume=True, from_stage=shipped, corpus=corpus, progress=False,
        evaluate_at_end=False,
    )  # fmt: skip
    assert bare.steps == 6 and any(r.get("cold_resume") == str(shipped) for r in _log(tmp_path / "bare"))


def test_resume_with_nothing_to_resume_says_so(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        loop.train(_staged(), tmp_path / "none", resume=True, corpus=corpus, progress=False)


def test_stages_must_end_at_the_recipe_end() -> None:
    with pytest.raises(ValueError, match="stages"):
        dataclasses.replace(_staged(), stages=(3, 5))
    with pytest.raises(ValueError, match="stages"):
        dataclasses.replace(_staged(), stages=(4, 3, 6))


def _model() -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(v41_tiny())
    init_weights(model, seed=3)
    return model.eval()


SPEC = BarSpec(
    rung1_lengths=(144,),
    rung2_lengths=(192,),
    cases=3,
    tail_depths=(("before last W", 34), ("inside last W", 26)),
    offsets=(0, 8),
)


def test_bar_cases_put_the_key_where_the_cell_says(corpus) -> None:  # type: ignore[no-untyped-def]
    cells = bar_cases(corpus["heldout"], SPEC, 144, window=8)
    assert set(cells) == {
        "passkey@0", "passkey@0.25", "passkey@0.5", "passkey@0.75",
        "passkey@before last W", "passkey@inside last W", "multihop", "chain",
    }  # fmt: skip
    assert all(len(v) == 3 and all(len(c.prompt) == 144 for c in v) for v in cells.values())
    assert all(c.evidence[1] == 144 - 34 for c in cells["passkey@before last W"])
    assert all(c.evidence[1] == 144 - 26 for c in cells["passkey@inside last W"])
    start, late = cells["passkey@0"], cells["passkey@0.75"]
    assert max(c.evidence[0] for c in start) < min(c.evidence[0] for c in late)


def test_a_traced_bar_asks_the_same_cases_for_every_step(corpus) -> None:  # type: ignore[no-untyped-def]
    traced_spec = dataclasses.replace(SPEC, trace_hops=True)
    plain = bar_cases(corpus["heldout"], SPEC, 144, window=8)["multihop"]
    traced = bar_cases(corpus["heldout"], traced_spec, 144, window=8)["multihop"]
    assert [c.prompt for c in traced] == [c.prompt for c in plain] and len(plain) == 3
    for t, p in zip(traced, plain, strict=True):  # two links: `2: B (1) -> C (0)`, the plain answer C
        assert t.answer_text.startswith("2: ") and t.answer_text.endswith(f" -> {p.answer_text} (0)")
        assert len(t.answer_text) == 23
        assert t.chance == p.chance
    assert traced_spec.digest() != SPEC.digest()
    chains = dataclasses.replace(SPEC, trace_chains=True)
    plain = bar_cases(corpus["heldout"], SPEC, 144, window=8)["chain"]
    traced = bar_cases(corpus["heldout"], chains, 144, window=8)["chain"]
    assert [c.prompt for c in traced] == [c.prompt for c in plain] and len(plain) == 3
    for t, p in zip(traced, plain, strict=True):  # `q = ... = 123` where the plain answer is 123
        assert t.answer_text.endswith(" = " + p.answer_text) and t.chance == p.chance
    assert len({SPEC.digest(), traced_spec.digest(), chains.digest()}) == 3


def test_bar_scoring_agrees_with_the_card_and_with_greedy_generation(corpus) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    cells = bar_cases(corpus["heldout"], SPEC, 144, window=8)
    cases = [c for v in cells.values() for c in v]
    ours = score_cases(model, cases, SPEC)
    card = EvalSpec(
        prompt_len=144, cases=0, passkey_depths=(), passkey_per_depth=0, offsets=(0, 8),
        text_sequences=0, text_len=0, batch=4,
    )  # fmt: skip
    theirs = task_accuracy(model, cases, card)
    full = sum(r["full"]["k"] for t, r in theirs.items() if t != "passkey_by_depth")
    assert ours["forced"]["k"] == full and ours["forced"]["n"] == len(cases)
    worst_k = {o: sum(r["offsets"][str(o)]["k"] for t, r in theirs.items() if "offsets" in r) for o in (0, 8)}
    assert {int(o): v["k"] for o, v in ours["bounded"].items()} == worst_k
    # Greedy reproduces an answer exactly when every teacher-forced argmax is right (no JSON here).
    assert ours["greedy"]["k"] == ours["forced"]["k"]


def _cells(acc: float, n: int = 40, lo_margin: float = 0.25) -> dict:  # type: ignore[type-arg]
    k = round(acc * n)
    keys = [f"passkey@{d:g}" for d in SPEC.depths] + [f"passkey@{label}" for label, _ in SPEC.tail_depths]
    out = {key: {"forced": wilson(k, n), "greedy": wilson(k, n), "chance": 1e-5} for key in keys}
    for t in ("multihop", "chain"):
        out[t] = {"forced": wilson(round(n * (0.25 + lo_margin)), n), "chance": 0.25}
    return out


def test_the_rung_rule() -> None:
    spec = dataclasses.replace(SPEC, cases=40)
    assert meets(_cells(0.975), spec) and not meets(_cells(0.925), spec)
    assert not meets(_cells(0.975, lo_margin=0.0), spec)  # chains at chance
    weak = _cells(0.975)
    weak["passkey@inside last W"]["greedy"] = wilson(30, 40)
    assert not meets(weak, spec)
    assert not meets(_cells(1.0, n=20), spec)  # too few cases per cell
    short = _cells(1.0)
    del short["passkey@0.5"]
    assert not meets(short, spec)
    assert rung({"144": _cells(1.0), "192": _cells(1.0)}, spec) == 2
    assert rung({"144": _cells(1.0), "192": _cells(0.5)}, spec) == 1
    assert rung({"144": _cells(0.5), "192": _cells(1.0)}, spec) == 0
    assert rung({"192": _cells(1.0)}, spec) == 0


def test_a_stage_scored_on_the_bar_records_its_rung_and_card(tmp_path, corpus, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    recipe = dataclasses.replace(_staged(), bar=dataclasses.replace(SPEC, cases=2))
    out = tmp_path / "run"
    loop.train(recipe, out, corpus=corpus, progress=False, stages=1, evaluate_at_end=False)
    monkeypatch.setattr("replaykv.train.data.load_corpus", lambda max_files=None: corpus)
    result = stages.evaluate_stage(recipe, out / "stage", torch.device("cpu"), lengths=(144,))
    assert result["rung"] == 0 and set(result["lengths"]) == {"144"}  # a 3-step model
    info = stages.read_stage(out / "stage")
    assert info is not None and info["rung"] == 0 and info["bar_digest"] == result["spec_digest"]
    card = (out / "stage" / "MODEL_CARD.md").read_text()
    assert "stage 1 of 2" in card and "passkey@inside last W" in card and "Rung reached: **0**" in card
    saved = json.loads((out / "stage" / "bar.json").read_text())
    assert saved["lengths"]["144"]["passkey@0"]["forced"]["n"] == 2
    # `--bar-traced`: the same stage on the bar with step-by-step multi-hop and chain answers
    from replaykv.train import cli

    monkeypatch.setattr(cli, "get_recipe", lambda name: recipe)
    assert cli.main(["--recipe", "tiny", "--out", str(out), "--bar-traced", "--bar-lengths", "144"]) == 0
    traced = json.loads((out / "stage" / "bar.json").read_text())
    assert traced["spec"]["trace_hops"] and traced["spec"]["trace_chains"] and not saved["spec"]["trace_hops"]
    assert traced["spec_digest"] != saved["spec_digest"] == result["spec_digest"]
    assert stages.read_stage(out / "stage")["bar_digest"] == traced["spec_digest"]  # type: ignore[index]
    # a checkpoint scored before it was installed as a stage (an adopted pilot's) keeps its score
    record = {"stage": 2, "step": 9, "tokens": 99, "seconds": 1.0}
    shutil.copytree(out / "stage", tmp_path / "carried.tmp")
    info = stages.install_stage(tmp_path / "carried.tmp", tmp_path / "carried", recipe, record)
    assert info["rung"] == 0 and info["bar_digest"] == traced["spec_digest"]
    carried = json.loads((tmp_path / "carried" / "bar.json").read_text())
    assert carried["lengths"] == traced["lengths"] and carried["stage"]["step"] == 9
    assert "Rung reached: **0**" in (tmp_path / "carried" / "MODEL_CARD.md").read_text()
    # a bar.json of another bar is dropped, and the card says the stage is not scored
    shutil.copytree(out / "stage", tmp_path / "other.tmp")
    (tmp_path / "other.tmp" / "bar.json").write_text(json.dumps({**traced, "spec_digest": "0" * 16}))
    info = stages.install_stage(tmp_path / "other.tmp", tmp_path / "other", recipe, record)
    assert "rung" not in info and not (tmp_path / "other" / "bar.json").exists()
    assert "Not scored on the shipping bar yet" in (tmp_path / "other" / "MODEL_CARD.md").read_text()


def test_train_resume_with_no_state_is_one_error_line(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from replaykv.train import cli

    assert cli.main(["--recipe", "tiny", "--out", str(tmp_path / "none"), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: nothing to resume")


def test_a_phase_selects_its_own_index_topk_and_its_stage_checkpoint_records_it(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    from replaykv.model.checkpoint import load_config
    from replaykv.train.setup import index_topk_in_force

    base = _staged()
    early = dataclasses.replace(base.phases[0], steps=3, index_topk=2)
    late = dataclasses.replace(base.phases[0], name="late", steps=3)  # the preset's (v41-tiny: 4)
    recipe = dataclasses.replace(base, phases=(early, late))
    seen: list[int | None] = []
    real = loop.accumulate_gradients

    def spy(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(index_topk_in_force(model))
        return real(model, *args, **kwargs)

    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "accumulate_gradients", spy)
        loop.train(recipe, out, corpus=corpus, progress=False, stages=1, evaluate_at_end=False)
        assert load_config(out / "stage").index_topk == 2  # stage 1 ended in the early phase
        loop.train(recipe, out, resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    assert seen == [2, 2, 2, 4, 4, 4]
    assert load_config(out / "stage").index_topk == 4 == v41_tiny().index_topk
    with pytest.raises(ValueError, match="index_topk"):
        dataclasses.replace(early, index_topk=0)


def test_the_card_lists_stage_times_in_stage_order() -> None:
    info = {
        "stage": 10,
        "stages": 14,
        "step": 5150,
        "tokens": 1,
        "seconds": 3600.0,
        "stage_seconds": {"1": 60.0, "10": 600.0, "2": 120.0, "9": 540.0},
    }
    card = stages.stage_card(small(), info, None, [])
    assert "stage 1: 1 min, stage 2: 2 min, stage 9: 9 min, stage 10: 10 min;" in card
