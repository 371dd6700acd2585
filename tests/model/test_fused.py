"""The training-only fused forms (replaykv.model.fused) and the step settings that turn them on:
the same losses and gradients as the eager layers, active only where autograd records, and an
eager fallback, with a warning, where torch.compile cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

import replaykv.model.fused as fused
from replaykv.model.attention import joint_attention
from replaykv.model.init import init_weights
from replaykv.model.layers import HyperConnection, RMSNorm, hc_collapse, hc_expand
from replaykv.model.presets_v41 import v41_small, v41_tiny
from replaykv.model.spec import ModelSpec
from replaykv.model.step import build_step
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.paths import path_losses
from replaykv.train.speed import StepSettings, choose_precision


def _site(seed: int = 0) -> tuple[HyperConnection, RMSNorm]:
    cfg = v41_small()
    g = torch.Generator().manual_seed(seed)
    hc, norm = HyperConnection(cfg), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.05)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
    return hc, norm


def assert_near(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    """|a - b| within `rel` of |b| (float32 sums in another order)."""
    err = float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-30))
    assert err <= rel, f"relative difference {err:.2e} > {rel:.0e}"


def _grads(params: list[torch.Tensor], loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, params))


def test_a_fused_site_equals_the_eager_mixes_collapse_norm_and_expand_with_their_gradients() -> None:
    hc, norm = _site()
    g = torch.Generator().manual_seed(1)
    streams = torch.randn(2, 5, 4, 256, generator=g, dtype=torch.float32, requires_grad=True)
    out = torch.randn(2, 5, 256, generator=g, dtype=torch.float32, requires_grad=True)
    pre_prev = torch.rand(2, 5, 4, generator=g, dtype=torch.float32)
    weights = [torch.randn(shape, generator=g, dtype=torch.float32) for shape in ((2, 5, 4), (2, 5, 4, 4))]

    def loss(parts: tuple[torch.Tensor, ...], new: torch.Tensor) -> torch.Tensor:
        pre, post, comb, x = parts
        return (
            (pre * weights[0]).sum()
            + (comb * weights[1]).sum()
            + x.pow(2).sum()
            + new.pow(3).sum()
            + post.sum()
        )

    params = [streams, out, hc.fn, hc.base, hc.scale, norm.weight]
    pre, post, comb = hc.mixes(streams)
    eager = (pre, post, comb, norm(hc_collapse(streams, pre_prev)))
    eager_new = hc_expand(streams, out, post, comb)
    eager_grads = _grads(params, loss(eager, eager_new))
    with fused.fused_training():
        assert fused.active(streams)
        parts = fused.mix_collapse(hc, norm, streams, pre_prev)
        new = fused.expand(streams, out, parts[1], parts[2])
    for a, b in zip(parts, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new, eager_new, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(params, loss(parts, new)), eager_grads, strict=True):
        assert_near(a, b, 1e-5)


def test_the_fused_forms_are_active_only_inside_the_switch_and_where_autograd_records() -> None:
    streams = torch.zeros(1, 2, 4, 8, requires_grad=True)
    assert not fused.active(streams)
    with fused.fused_training():
        assert fused.active(streams)
        assert not fused.active(streams.detach())
        with torch.no_grad():
            assert not fused.active(streams)
        with fused.fused_training(False):
            assert not fused.active(streams)
    assert not fused.enabled()


def test_dense_scoring_of_small_sparse_prefixes_equals_the_per_query_gathers() -> None:
    """Training scores a block's selected entries densely while few are visible; blocks with
    many visible entries keep the gathers: both kinds occur here (64-query blocks, 4 selected,
    dense up to 32 visible)."""
    g = torch.Generator().manual_seed(3)
    b, s, h, d, w, ratio, k = 2, 160, 4, 16, 8, 1, 4
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float32, requires_grad=True)
    win = torch.randn(b, w - 1 + s, d, generator=g, dtype=torch.float32, requires_grad=True)
    entries = torch.randn(b, s, d, generator=g, dtype=torch.float32, requires_grad=True)
    sinks = torch.randn(h, generator=g, dtype=torch.float32)
    limit = torch.arange(s) + 1  # entries visible to query i: [0, i]
    rows = [torch.randperm(int(n), generator=g)[:k] for n in limit.repeat(b)]
    sel = torch.stack([torch.nn.functional.pad(r, (0, k - len(r)), value=-1) for r in rows]).view(b, s, k)
    step = build_step(torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), s, {}, True)
    weight = torch.randn(b, s, h, d, generator=g, dtype=torch.float32)

    def value_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        o = joint_attention(q, win, step, w, sinks, entries, ratio, sel)
        return o, _grads([q, win, entries], (o * weight).sum())

    ref, ref_grads = value_and_grads()
    with fused.fused_training():
        out, grads = value_and_grads()
    assert_near(out, ref, 1e-6)
    for a, b_ in zip(grads, ref_grads, strict=True):
        assert_near(a, b_, 1e-5)


def test_a_training_step_with_the_fused_forms_has_the_eager_losses_and_gradients() -> None:
    """The whole tiny V4.1 model, the full path and the follow-up under decoder replay. Every
    visible entry is selected, so float rounding cannot flip a top-k choice (the dense and the
    gathered scoring of selections are compared on their own above)."""
    cfg = v41_tiny().replace(index_topk=64, candidate_topk_blocks=64)
    model = init_weights(DeepseekV41ForCausalLM(cfg), seed=0).train()
    spec = ModelSpec.from_config(cfg)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, 96), generator=g)
    targets = torch.ones(2, 96, dtype=torch.bool)
    params = [p for p in model.parameters() if p.requires_grad]

    def run() -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        losses = path_losses(model, spec, ids, targets, 80, 0, full=True, follow_up=True)
        return losses, list(torch.autograd.grad(sum(losses.values()), params, allow_unused=True))

    ref_losses, ref_grads = run()
    with fused.fused_training():
        losses, grads = run()
    assert set(losses) == {"full", "decoder"}
    for name in losses:
        torch.testing.assert_close(losses[name], ref_losses[name], rtol=1e-6, atol=0)
    compared = 0
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert_near(a, b, 1e-3)  # small gradients (mHC bias, norms) differ by up to ~2e-4
            compared += 1
    assert compared > 100


def test_where_torch_compile_cannot_run_training_warns_once_and_continues_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(fn: object, **kwargs: object) -> object:
        def fail(*args: object) -> object:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

        return fail

    monkeypatch.setattr(fused, "_state", {"on": False, "broken": False, "compiled": {}})
    monkeypatch.setattr(torch, "compile", no_compiler)
    hc, norm = _site()
    streams = torch.randn(1, 3, 4, 256, dtype=torch.float32, requires_grad=True)
    pre_prev = torch.rand(1, 3, 4, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="replaykv.model.fused"), fused.fused_training():
        x = fused.mix_collapse(hc, norm, streams, pre_prev)[3]
        assert not fused.active(streams)  # the layers take their eager forms from now on
    assert "No working C++ compiler" in caplog.text and "continues eagerly" in caplog.text
    torch.testing.assert_close(x, norm(hc_collapse(streams, pre_prev)), rtol=1e-5, atol=1e-6)


def test_step_settings_resolve_and_reject_unknown_names() -> None:
    cpu = torch.device("cpu")
    assert choose_precision("float32", cpu) == "float32"
    assert choose_precision("bf16", cpu) == "bf16"
    assert choose_precision("auto", cpu) in ("float32", "bf16")
    assert StepSettings.resolve("eager", "float32", cpu).name == "eager"
    assert StepSettings("fused", "bf16").name == "fused-bf16"
    with pytest.raises(ValueError, match="precision"):
        choose_precision("fp8", cpu)
    with pytest.raises(ValueError, match="kernels"):
        StepSettings("triton", "float32")
    assert not torch.are_deterministic_algorithms_enabled()
    with StepSettings("fused", "bf16").applied(cpu):
        assert fused.enabled() and torch.is_autocast_enabled("cpu")
        assert (
            torch.are_deterministic_algorithms_enabled()
            and torch.is_deterministic_algorithms_warn_only_enabled()
        )
    assert not fused.enabled() and not torch.is_autocast_enabled("cpu")
    assert not torch.are_deterministic_algorithms_enabled()  # the earlier setting back
