"""Continuation stages: after a recipe's own stages, each continuation runs as a one-phase recipe
from the previous stage's checkpoint, bit for bit the run a pilot of the same settings makes,
the same on a machine that has only the previous stage's checkpoint; its checkpoint carries the
whole recipe's stage record; such a run made elsewhere installs as the stage only when its
recipe and starting weights are the stage's; `replaykv train --resume` goes on into them."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil

import pytest

from replaykv.train import cli, loop, stages
from replaykv.train.continuation import (
    CONTINUE_DIR,
    _recipe_differences,
    adopt_run,
    furthest_stage,
    in_continuations,
    train_continuations,
)
from replaykv.train.recipes import Continuation, Mixture, Phase, small, tiny


def _recipe():  # type: ignore[no-untyped-def]
    mix = Mixture(text=0.5, passkey=0.5, multihop=0.0, chain=0.0, extract=0.0, tool=0.0)
    copy = Mixture(text=0.5, copy=0.5, passkey=0.0, multihop=0.0, chain=0.0, extract=0.0, tool=0.0)
    return dataclasses.replace(
        tiny(),
        phases=(Phase("base", 4, 64, 2, mix),),
        warmup=1,
        quick_eval=None,
        checkpoint_every=2,
        stages=(2, 4),
        continuations=(
            Continuation(Phase("more", 3, 64, 2, copy), lr=2e-3, seed=4242, warmup=1),
            Continuation(
                Phase("again", 2, 64, 2, mix, cycle=((64, 2, 1), (96, 2, None))), lr=1e-3, seed=4243, warmup=1
            ),
        ),
    )


def _weights(directory):  # type: ignore[no-untyped-def]
    return (directory / "model.safetensors").read_bytes()


def test_a_continuation_stage_is_the_one_phase_run_from_the_stage_before(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = _recipe()
    assert recipe.stage_count == 4 and recipe.final_step == 9
    out = tmp_path / "run"
    loop.train(recipe, out, corpus=corpus, progress=False, stages=1, evaluate_at_end=False)
    assert not in_continuations(recipe, out)  # its own stage 2 is still to run
    loop.train(recipe, out, resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    assert in_continuations(recipe, out)
    own_end = tmp_path / "stage2"
    shutil.copytree(out / "stage", own_end)

    third = train_continuations(recipe, out, stages=1, corpus=corpus, progress=False)
    info = stages.read_stage(out / "stage")
    assert info is not None and (info["stage"], info["stages"], info["step"]) == (3, 4, 7) == (
        3,
        4,
        third.steps,
    )
    assert info["recipe"] == "tiny" and info["recipe_digest"] == recipe.digest()
    assert (
        info["continuation"] == "tiny-stage3" and info["continuation_digest"] == recipe.continued(0).digest()
    )
    assert info["tokens"] == json.loads((own_end / "stage.json").read_text())["tokens"] + 3 * 2 * 64
    assert sorted(info["stage_seconds"], key=int) == ["1", "2", "3"]
    card = (out / "stage" / "MODEL_CARD.md").read_text()
    assert "stage 3 of 4" in card and "step 7 of 9" in card and "`tiny-stage3`" in card

    # The same recipe run as a pilot does: a one-phase run from stage 2's checkpoint.
    pilot = loop.train(
        recipe.continued(0),
        tmp_path / "pilot",
        init=own_end,
        corpus=corpus,
        progress=False,
        evaluate_at_end=False,
    )
    assert pilot.steps == 3 and _weights(tmp_path / "pilot" / "stage") == _weights(out / "stage")
    # ... which, made elsewhere, installs as stage 3 once its recipe and start are checked.
    adopted = tmp_path / "adopted"
    shutil.copytree(own_end, adopted / "stage")
    with pytest.raises(ValueError, match="weights are not those of stage 2"):
        adopt_run(recipe, adopted, tmp_path / "pilot", out / "stage")
    record = adopt_run(recipe, adopted, tmp_path / "pilot", own_end)
    assert {k: record[k] for k in ("stage", "step", "tokens", "continuation")} == {
        k: info[k] for k in ("stage", "step", "tokens", "continuation")
    }
    assert _weights(adopted / "stage") == _weights(out / "stage")
    with pytest.raises(ValueError, match="another recipe than stage 4"):
        adopt_run(recipe, adopted, tmp_path / "pilot", adopted / "stage")
    logged = [
        json.loads(line) for line in (out / CONTINUE_DIR / "3" / "train_log.jsonl").read_text().splitlines()
    ]
    rates = {r["step"]: r["lr"] for r in logged if "lr" in r}
    assert rates[1] == pytest.approx(2e-3) and rates[3] == pytest.approx(2e-3)  # warmup 1, then kept

    # A bare machine with stage 3's checkpoint alone runs the same stage 4.
    shipped = tmp_path / "shipped"
    shutil.copytree(out / "stage", shipped)
    last = train_continuations(recipe, out, corpus=corpus, progress=False)
    bare = train_continuations(recipe, tmp_path / "bare", from_stage=shipped, corpus=corpus, progress=False)
    assert last.steps == bare.steps == 9
    assert _weights(tmp_path / "bare" / "stage") == _weights(out / "stage")
    assert furthest_stage(recipe, out).stage == 4  # type: ignore[union-attr]
    # Nothing is left to run.
    again = train_continuations(recipe, out, corpus=corpus, progress=False)
    assert again.steps == 9 and again.losses == []


def test_train_resume_goes_on_into_the_continuations(tmp_path, corpus, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    recipe = _recipe()
    out = tmp_path / "run"
    loop.train(recipe, out, corpus=corpus, progress=False, evaluate_at_end=False)
    monkeypatch.setattr(cli, "get_recipe", lambda name: recipe)
    monkeypatch.setattr(loop, "load_corpus", lambda max_files=None: corpus)
    argv = ["--recipe", "tiny", "--out", str(out), "--resume", "--no-progress", "--precision", "float32"]
    assert cli.main([*argv, "--steps", "5"]) == 2  # a continuation runs whole
    assert cli.main([*argv, "--stages", "1"]) == 0
    assert stages.read_stage(out / "stage")["stage"] == 3  # type: ignore[index]


def test_a_continuation_starts_from_the_last_own_stage_or_later() -> None:
    recipe = _recipe()
    with pytest.raises(FileNotFoundError, match="start from stage 2's checkpoint"):
        train_continuations(recipe, "/nonexistent/out")
    with pytest.raises(ValueError, match="lr must be positive"):
        Continuation(Phase("x", 3, 64, 2), lr=0.0, seed=1)
    with pytest.raises(ValueError, match="warmup must be shorter"):
        Continuation(Phase("x", 3, 64, 2), lr=1e-3, seed=1, warmup=3)
    with pytest.raises(ValueError, match="its rate is `lr`"):
        Continuation(Phase("x", 3, 64, 2, lr=1e-3), lr=1e-3, seed=1, warmup=1)
    with pytest.raises(ValueError, match=r"min_lr must lie in \[0, lr\]"):
        Continuation(Phase("x", 3, 64, 2), lr=1e-3, seed=1, warmup=1, min_lr=2e-3)


def test_a_continuation_keeps_its_rate_or_cools_down_to_min_lr() -> None:
    phase = Phase("x", 20, 64, 2)
    kept = dataclasses.replace(_recipe(), continuations=(Continuation(phase, 1e-3, 1, 4),)).continued(0)
    assert [kept.lr_at(k) for k in (4, 10, 19)] == [1e-3, 1e-3, 1e-3]
    cool = dataclasses.replace(_recipe(), continuations=(Continuation(phase, 1e-3, 1, 4, 1e-4),)).continued(0)
    rates = [cool.lr_at(k) for k in range(4, 20)]
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in itertools.pairwise(rates))


def test_small_continues_after_its_own_stages_with_the_same_digest() -> None:
    recipe = small()
    assert recipe.digest() == dataclasses.replace(recipe, continuations=()).digest()
    assert recipe.stage_count == len(recipe.stage_ends) + len(recipe.continuations)
    for i, c in enumerate(recipe.continuations):
        sub = recipe.continued(i)
        assert sub.name == f"small-stage{len(recipe.stage_ends) + i + 1}" and sub.phases == (c.phase,)
        assert (sub.lr, sub.min_lr, sub.seed, sub.warmup, sub.stages, sub.bar) == (
            c.lr,
            c.lr if c.min_lr is None else c.min_lr,
            c.seed,
            c.warmup,
            (),
            None,
        )
    assert len({c.seed for c in recipe.continuations} | {recipe.seed}) == len(recipe.continuations) + 1


def test_a_run_differs_from_a_stage_only_in_what_it_uses() -> None:
    recipe = _recipe()
    want = dataclasses.asdict(recipe.continued(1))
    ran = json.loads(json.dumps(want))
    ran["name"], ran["checkpoint_every"] = "pilot", 99
    # with a cycle, the phase's own row shape is unused
    ran["phases"][0].update(seq_len=512, batch=8, micro_batch=4)
    assert _recipe_differences(want, ran) == []
    ran["phases"][0]["cycle"][1][0] = 128
    assert _recipe_differences(want, ran) == ["phases.0.cycle.1.0"]
    plain = dataclasses.asdict(recipe.continued(0))
    ran = json.loads(json.dumps(plain))
    ran["phases"][0]["seq_len"] = 512
    del ran["phases"][0]["answer_weight"]  # a field the run's recipe.json lacks holds its default
    assert _recipe_differences(plain, ran) == ["phases.0.seq_len"]
