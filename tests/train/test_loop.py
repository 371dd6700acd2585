"""Training: the tiny recipe lowers the loss; a resumed run continues exactly like an
uninterrupted one; gradients flow through the cache-writing forward (checked against finite
differences) and through the replay paths, whose forward matches the engine's; the export loads.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import signal

import pytest
import torch

from replaykv.cache.views import advance, allocate_view
from replaykv.engine.runner import execute
from replaykv.engine.scenario import score_after_cut
from replaykv.model.checkpoint import load_model
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.replay import CacheState, plan_prefill
from replaykv.train import cli, loop, setup
from replaykv.train.data import MixtureSampler
from replaykv.train.distill import IndexerDistillation
from replaykv.train.loop import accumulate_gradients, evaluate_only, train
from replaykv.train.paths import (
    REPLAY_FLAGS,
    CacheGuard,
    follow_up_plan,
    fork_view,
    full_plan,
    path_losses,
    run_plan,
    weighted_ce,
)
from replaykv.train.recipes import EvalSpec, Mixture, Paths, Phase, tiny
from replaykv.train.state import median_step_seconds


def _mini(steps: int = 4, **changes):  # type: ignore[no-untyped-def]
    mix = Mixture(text=0.5, passkey=0.5, multihop=0.0, chain=0.0, extract=0.0, tool=0.0)
    base = dataclasses.replace(
        tiny(), phases=(Phase("base", steps, 64, 2, mix),), warmup=1, quick_eval=None, checkpoint_every=2
    )
    return dataclasses.replace(base, **changes)


def test_tiny_recipe_loss_falls(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = dataclasses.replace(tiny(), quick_eval=None)
    result = train(recipe, tmp_path, corpus=corpus, progress=False, evaluate_at_end=False)
    assert result.steps == recipe.total_steps and result.tokens == recipe.total_tokens
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 1.0, result.losses
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    log = [r for r in records if "tokens_per_s" in r]
    assert [r["step"] for r in log] == list(range(1, recipe.total_steps + 1))
    assert [r for r in records if "stage_end" in r] == [
        {"step": recipe.total_steps, "stage_end": 1, "stage_seconds": pytest.approx(result.seconds)}
    ]
    assert all(r["tokens_per_s"] > 0 and r["indexer_kl"] is not None for r in log)


def test_resume_continues_identically(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = _mini()
    whole = train(recipe, tmp_path / "a", corpus=corpus, progress=False, evaluate_at_end=False)
    first = train(recipe, tmp_path / "b", max_steps=2, corpus=corpus, progress=False)
    assert first.steps == 2 and not first.exported
    with pytest.raises(FileExistsError):
        train(recipe, tmp_path / "b", corpus=corpus, progress=False)
    rest = train(recipe, tmp_path / "b", resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    assert first.losses + rest.losses == whole.losses
    a = torch.load(tmp_path / "a/train_state/state.pt", weights_only=False)
    b = torch.load(tmp_path / "b/train_state/state.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    biases = [v for k, v in a["model"].items() if k.endswith("e_score_correction_bias")]
    assert any(bool(v.abs().sum() > 0) for v in biases)  # router balancing moved them


def test_sigterm_saves_the_state_and_resumes_identically(tmp_path, corpus, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    recipe = _mini(steps=5, checkpoint_every=10)
    whole = train(recipe, tmp_path / "a", corpus=corpus, progress=False, evaluate_at_end=False)
    calls = {"n": 0}
    real = loop.accumulate_gradients

    def kill_during_third_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "accumulate_gradients", kill_during_third_step)
    first = train(recipe, tmp_path / "b", corpus=corpus, progress=False)
    monkeypatch.setattr(loop, "accumulate_gradients", real)
    assert first.steps == 3 and not first.exported  # the step in flight finished, then it stopped
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed again
    state = torch.load(tmp_path / "b/train_state/state.pt", weights_only=False)
    assert state["step"] == 3  # saved though 3 is no multiple of checkpoint_every
    rest = train(recipe, tmp_path / "b", resume=True, corpus=corpus, progress=False, evaluate_at_end=False)
    assert first.losses + rest.losses == whole.losses


def test_export_card_and_cli(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    spec = EvalSpec(
        prompt_len=96, cases=1, passkey_depths=(1.0,), passkey_per_depth=1, offsets=(8,), text_sequences=2,
        text_len=32, batch=2,
    )  # fmt: skip
    recipe = _mini(steps=2, final_eval=spec)
    result = train(recipe, tmp_path, corpus=corpus, progress=False)
    assert result.exported
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md", "metrics.json"} <= names
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "bits per byte" in card and "| passkey" in card and "worst offset" in card
    assert f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} CPU kernels" in card
    assert "answer tokens weigh 1." in card
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["training"]["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    medians = metrics["training"]["median_step_seconds"]
    assert set(medians) == {p.name for p in recipe.phases} and all(t > 0 for t in medians.values())
    assert "median logged step × its steps" in card
    assert metrics["tasks"]["passkey"]["full"]["n"] == 1 and "8" in metrics["tasks"]["passkey"]["offsets"]
    model = load_model(tmp_path)
    view = allocate_view(ModelSpec.from_config(model.config), 1, 8)
    assert torch.isfinite(model(torch.arange(8)[None], view)).all()
    # Re-evaluating the export rewrites the same metrics (same held-out cases, bf16 weights).
    (tmp_path / "MODEL_CARD.md").unlink()
    again = evaluate_only(recipe, tmp_path, corpus=corpus)["base"]
    assert (tmp_path / "MODEL_CARD.md").exists() and again["heldout"] == metrics["heldout"]
    assert again["tasks"]["passkey"]["full"]["n"] == 1
    # The command line refuses to overwrite a run.
    assert cli.main(["--recipe", "tiny", "--out", str(tmp_path), "--steps", "1", "--no-progress"]) == 2


def test_adaptation_from_an_export_reports_base_and_adapted(tmp_path, corpus) -> None:  # type: ignore[no-untyped-def]
    """The adapt flow: a base export, then replay-adaptation steps (decoder replay and bounded
    replay at a cut in every step) from it, whose card puts both models side by side."""
    spec = EvalSpec(
        prompt_len=96, cases=1, passkey_depths=(1.0,), passkey_per_depth=1, offsets=(0, 8), text_sequences=2,
        text_len=32, batch=2,
    )  # fmt: skip
    base = train(_mini(steps=2, final_eval=spec), tmp_path / "base", corpus=corpus, progress=False)
    assert base.exported
    mix = Mixture(text=0.25, passkey=0.75, multihop=0.0, chain=0.0, extract=0.0, tool=0.0)
    paths = Paths(full=0.5, decoder_replay=1.0, bounded_prob=1.0, boundary_prob=1.0)
    adapt = _mini(
        name="adapt-mini",
        phases=(Phase("adapt", 2, 96, 2, mix, paths=paths),),
        init_from="base",
        seed=7,
        final_eval=spec,
    )
    with pytest.raises(ValueError, match="--init"):
        train(adapt, tmp_path / "no-init", corpus=corpus, progress=False)
    result = train(adapt, tmp_path / "adapted", init=tmp_path / "base", corpus=corpus, progress=False)
    assert result.exported and all(math.isfinite(x) for x in result.losses)
    log = [json.loads(line) for line in (tmp_path / "adapted/train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "step" in r and "loss" in r]
    # Every step carried the follow-up's loss under bounded replay at its cut (decoder replay on).
    assert len(steps) == 2 and all(r["bounded"] > 0 and r["full"] > 0 for r in steps), steps
    metrics = json.loads((tmp_path / "adapted/metrics.json").read_text())
    assert metrics["tasks"]["passkey"]["full"]["n"] == 1 and set(metrics["tasks"]["passkey"]["offsets"]) == {
        "0",
        "8",
    }
    card = (tmp_path / "adapted/MODEL_CARD.md").read_text()
    assert "full prefill (base)" in card and "full prefill (adapted)" in card
    assert "bounded, worst offset (adapted)" in card and "--init base" in card
    # The base row of the card is the base export's own evaluation (same cases, reused).
    base_metrics = json.loads((tmp_path / "base/metrics.json").read_text())
    assert base_metrics["text"]["bpb"] == pytest.approx(
        float(card.split("| text (code + docstrings) | ")[1].split(" ")[0]), abs=5e-4
    )
    # The adapted weights moved away from the base's.
    a, b = load_model(tmp_path / "adapted"), load_model(tmp_path / "base")
    assert any(
        not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def _model(quant: bool = False, seed: int = 1) -> DeepseekV41ForCausalLM:
    return init_weights(DeepseekV41ForCausalLM(v41_tiny().replace(kv_quant=quant)), seed=seed)


@pytest.mark.parametrize(("path", "cut"), [("full", 0), ("decoder", 0), ("bounded", 12)])
def test_grad_through_cache_writing_forward_matches_finite_differences(path: str, cut: int) -> None:
    # Every entry selected and every expert used: no discrete choice can flip under the
    # perturbation, so the loss is smooth and a central difference checks the whole backward
    # pass (in-place cache writes, forked global KV, window floors, decoder replay rows).
    cfg = v41_tiny().replace(kv_quant=False, num_experts_per_tok=4, index_topk=64, candidate_topk_blocks=64)
    model = init_weights(DeepseekV41ForCausalLM(cfg), seed=1)
    spec = ModelSpec.from_config(cfg)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 40))
    targets = torch.ones_like(ids, dtype=torch.bool)

    def loss() -> torch.Tensor:
        return path_losses(model, spec, ids, targets, 30, cut, full=True, follow_up=True)[path]

    loss().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    gen = torch.Generator().manual_seed(1)
    direction = [torch.randn(p.shape, generator=gen) * 0.02 for p in params]  # the weights' scale
    analytic = sum(float((p.grad * d).sum()) for p, d in zip(params, direction, strict=True))
    eps = 1e-2
    with torch.no_grad():
        for p, d in zip(params, direction, strict=True):
            p.add_(eps * d)
        up = float(loss())
        for p, d in zip(params, direction, strict=True):
            p.sub_(2 * eps * d)
        down = float(loss())
        for p, d in zip(params, direction, strict=True):
            p.add_(eps * d)
    assert analytic == pytest.approx((up - down) / (2 * eps), rel=0.01)


def test_replay_paths_match_the_engine_and_carry_gradients() -> None:
    torch.manual_seed(0)
    model = _model(quant=True)
    spec = ModelSpec.from_config(model.config)
    w, p_len, cut, length = spec.sliding_window, 40, 20, 48
    ids = torch.randint(0, 256, (1, length))
    # Forward: the bounded follow-up equals the engine's scenario (snapshot dropped), ...
    ref, _ = score_after_cut(model, ids[0, :p_len].tolist(), cut, REPLAY_FLAGS, keep_snapshot=False)
    view = allocate_view(spec, 1, length)
    with torch.no_grad():
        model(ids, view)
        plan = follow_up_plan(spec, p_len, p_len, cut)
        logits, _ = run_plan(model, plan, ids[:, :p_len], fork_view(view))
        r0 = plan.logits_rows[0]
        assert torch.allclose(logits[0], ref[r0 - cut :], atol=1e-5)
        # ... and its decode rows equal decoding token by token with the window floor at cut - W.
        ext = follow_up_plan(spec, p_len, length, cut)
        logits, _ = run_plan(model, ext, ids, fork_view(view))
        dec_view = fork_view(view)
        steps = [
            execute(model, plan_prefill(CacheState(p_len, cut), spec, REPLAY_FLAGS), ids[:, :p_len], dec_view)
        ]
        for t in range(p_len, length - 1):
            dec_view.window_floor = torch.full_like(dec_view.positions, cut - w)
            steps.append(model(ids[:, t : t + 1], dec_view))
            advance(dec_view, 1)
        decoded = torch.cat([s[:, -1:] for s in steps], 1)
        assert torch.allclose(logits[:, p_len - 1 - r0 : length - 1 - r0], decoded, atol=1e-4)
    # Backward: the bounded loss reaches the decoder, the encoder and, through the cached global
    # KV, the compressors of the earlier request's forward; the indexer KL reaches the indexers.
    distill = IndexerDistillation(model, rows=8)
    targets = torch.ones_like(ids, dtype=torch.bool)
    losses = path_losses(model, spec, ids, targets, p_len, cut, full=False, follow_up=True)
    kl = distill.pop()
    assert set(losses) == {"bounded"} and kl is not None
    (losses["bounded"] + kl).backward()
    distill.remove()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in (
        "model.layers.9.self_attn.q_b_proj.weight",  # decoder
        "model.layers.0.self_attn.kv_proj.weight",  # encoder window
        "model.layers.2.self_attn.compressor.kv_proj.weight",  # global KV of [0, cut)
        "model.layers.2.self_attn.indexer.q_b_proj.weight",  # indexer (KL only)
        "model.layers.2.self_attn.indexer.k_proj.weight",
    ):
        g = grads[name]
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
    assert "select" not in vars(model.model.layers[2].self_attn.indexer)  # the patches are gone


def test_cache_guard_is_what_makes_replay_backward_work() -> None:
    model = _model()
    spec = ModelSpec.from_config(model.config)
    ids = torch.randint(0, 256, (1, 32))
    plan = follow_up_plan(spec, 28, 32, 12)
    view = allocate_view(spec, 1, 32)
    _, _ = run_plan(model, full_plan(spec, 32), ids, view)
    logits, _ = run_plan(model, plan, ids, fork_view(view))
    with pytest.raises(RuntimeError, match="inplace"):
        logits.sum().backward()
    guard = CacheGuard()
    view = guard.track(allocate_view(spec, 1, 32))
    with guard:
        run_plan(model, full_plan(spec, 32), ids, view)
        logits, _ = run_plan(model, plan, ids, guard.track(fork_view(view)))
    logits.sum().backward()


def test_a_training_step_leaves_no_graph_behind() -> None:
    # Without the indexer distillation the indexers select under autograd (`relu_` saves its
    # own output): nothing of a step's graph may outlive its backward.
    model = _model()
    spec = ModelSpec.from_config(model.config)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    targets = torch.ones(2, 48)

    def graph_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)

    def one_step() -> None:
        losses = path_losses(model, spec, ids, targets, 40, 20, follow_up=True)
        sum(losses.values()).backward()  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)

    one_step()
    before = graph_tensors()
    for _ in range(3):
        one_step()
    assert graph_tensors() == before


def test_micro_batches_accumulate_the_whole_batch_gradient(corpus) -> None:  # type: ignore[no-untyped-def]
    recipe = _mini()
    phase = dataclasses.replace(
        recipe.phases[0], paths=Paths(full=0.5, decoder_replay=1.0, bounded_prob=1.0), batch=4
    )
    recipe = dataclasses.replace(recipe, phases=(phase,))
    spec = ModelSpec.from_config(v41_tiny())
    batch = MixtureSampler(corpus["train"], recipe, spec.sliding_window).batch(0)
    assert batch.cut > 0
    grads, logged = [], []
    for micro in (None, 1):
        model = _model(quant=True)
        distill = IndexerDistillation(model, rows=8)
        logged.append(
            accumulate_gradients(model, spec, batch, phase, recipe, distill, torch.device("cpu"), micro)
        )
        distill.remove()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert set(logged[0]) == {"loss", "full", "bounded", "indexer_kl"}
    assert logged[0]["loss"] == pytest.approx(logged[1]["loss"], rel=1e-5)
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-3, atol=1e-6), name


def test_weighted_ce_is_the_weighted_mean_of_the_token_losses() -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    weights = torch.tensor([[0.0, 1.0, 1.0, 50.0, 50.0], [1.0, 0.0, 0.0, 1.0, 50.0]])
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    expected = (per_token * weights).sum() / weights.sum()
    assert torch.allclose(weighted_ce(logits, targets, weights), expected)
    as_bool = weights > 0
    assert torch.allclose(weighted_ce(logits, targets, as_bool), per_token[as_bool].mean())


def test_mhc_mixes_get_their_own_rate_without_weight_decay() -> None:
    model = _model(quant=False)
    recipe = dataclasses.replace(tiny(), hc_lr_scale=0.1)
    opt = setup.make_optimizer(model, recipe)
    hc = {id(p) for m in model.modules() if isinstance(m, setup.HC_MODULES) for p in m.parameters()}
    assert hc and sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    setup.set_lr(opt, 2e-3)
    for group in opt.param_groups:
        ids = {id(p) for p in group["params"]}
        if ids & hc:
            assert ids == hc and group["weight_decay"] == 0.0 and group["lr"] == pytest.approx(2e-4)
        else:
            assert group["lr"] == 2e-3
            assert group["weight_decay"] == (
                recipe.weight_decay if all(p.dim() >= 2 for p in group["params"]) else 0
            )
    with pytest.raises(ValueError, match="hc_lr_scale"):
        dataclasses.replace(recipe, hc_lr_scale=0.0)


def test_a_fresh_model_draws_its_embeddings_and_output_projections_at_the_recipe_scales() -> None:
    recipe = dataclasses.replace(tiny(), embed_std=0.7)
    assert recipe.o_proj_fan_in
    model = setup.fresh_model(recipe, seed=3)
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.7, rel=0.02)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.02)  # matrices keep 0.02
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_a_proj, layer.self_attn.o_b_proj):
            assert proj.weight.std().item() == pytest.approx(proj.in_features**-0.5, rel=0.05)
    plain = init_weights(DeepseekV41ForCausalLM(v41_tiny()), seed=3)
    assert plain.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert plain.model.layers[0].self_attn.o_b_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # the scales change only the tensors they name: every other tensor is drawn the same, and
    # the rescaled ones are the same draws times their scale
    same = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            assert torch.allclose(p, same[name] * (0.7 / 0.02)), name
        elif "o_a_proj" in name or "o_b_proj" in name:
            assert torch.allclose(p, same[name] * (p.shape[1] ** -0.5 / 0.02)), name
        else:
            assert torch.equal(p, same[name]), name
    off = setup.fresh_model(dataclasses.replace(recipe, o_proj_fan_in=False), seed=3)
    for name, p in off.named_parameters():
        if "embed_tokens" not in name:
            assert torch.equal(p, same[name]), name
    with pytest.raises(ValueError, match="embed_std"):
        dataclasses.replace(recipe, embed_std=0.0)


def test_median_step_seconds_counts_each_step_once_and_skips_pauses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    recipe = _mini(steps=4)
    tokens = recipe.phases[0].batch * recipe.phases[0].seq_len
    log = [
        {"step": 1, "phase": "base", "tokens_per_s": tokens / 2.0},
        {"step": 2, "phase": "base", "tokens_per_s": tokens / 50.0},  # redone after a resume
        {"step": 2, "eval": {"bpb": 3.0}},
        {"step": 2, "phase": "base", "tokens_per_s": tokens / 3.0},
        {"step": 3, "phase": "base", "tokens_per_s": tokens / 900.0},  # stopped mid-step
        {"step": 4, "phase": "base", "tokens_per_s": tokens / 2.5},
    ]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    assert median_step_seconds(tmp_path, recipe) == {"base": pytest.approx(2.75)}
    assert median_step_seconds(tmp_path / "missing", recipe) == {}
