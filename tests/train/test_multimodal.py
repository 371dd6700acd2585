"""Multimodal training systems on `v41-tiny-vision` (float32): the three-phase step against one
autograd graph, and the contrastive stage with overlapped and blocking gathers in two gloo
processes against one process on the whole batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from replaykv.images import PromptImage
from replaykv.model.checkpoint import build_model, load_model
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny_vision
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.train.multimodal.contrastive import (
    ContrastiveConfig,
    contrastive_step,
    image_features,
    pair_loss,
    text_features,
)
from replaykv.train.multimodal.data import ImageStore, make_pairs
from replaykv.train.multimodal.phases import PhaseTimes, lm_loss, split_tower, three_phase_step
from replaykv.train.multimodal.run import ContrastiveArgs, build, launch, projections

TOL = 1e-5


def vision_model() -> DeepseekV41ForCausalLM:
    model = init_weights(build_model(v41_tiny_vision().replace(kv_quant=False)), seed=3)
    gen = torch.Generator().manual_seed(4)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.e_score_correction_bias_vl.copy_(
            torch.randn(gate.e_score_correction_bias_vl.shape, generator=gen)
        )
    return model.float().train()


def grads_of(*named: tuple[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}{k}": p.grad.detach().clone()
        for prefix, module in named
        for k, p in module.named_parameters()
        if p.grad is not None
    }


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOL, worst


def test_three_phase_step_equals_one_autograd_graph() -> None:
    joint = vision_model()
    vc = joint.config.vision_config
    pairs = make_pairs(11, 2, vc)
    images = [[PromptImage(5, pairs.images[0])], [PromptImage(20, pairs.images[1])]]
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    for row, ims in enumerate(images):
        for im in ims:
            ids[row, im.start : im.end] = joint.config.image_token_id
    targets = torch.ones_like(ids, dtype=torch.float32)
    split_model = copy.deepcopy(joint)

    assert joint.model.vision is not None
    spans = [[(im.start, joint.model.vision.span(im.image)) for im in row] for row in images]
    loss = lm_loss(joint, ids, targets, spans)
    loss.backward()
    expected = grads_of(("", joint))

    lm, tower = split_tower(split_model)
    assert not any(k.startswith("model.vision.") for k, _ in lm.named_parameters())
    times = PhaseTimes()
    got_loss = three_phase_step(lm, tower, ids, targets, images, times)
    got = grads_of(("", lm), ("model.vision.", tower))
    assert abs(float(got_loss) - float(loss.detach())) <= TOL
    assert_close(got, expected)
    assert times.vision_forward > 0 and times.vision_backward > 0
    with pytest.raises(ValueError, match="without a vision tower"):
        three_phase_step(joint, tower, ids, targets, images)


def test_three_phase_step_without_images_is_the_text_step() -> None:
    model = vision_model()
    lm, tower = split_tower(model)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    targets = torch.ones_like(ids, dtype=torch.float32)
    loss = three_phase_step(lm, tower, ids, targets, [[], []])
    assert all(p.grad is None for p in tower.parameters())
    plain = vision_model()
    plain.model.vision = None
    expected = lm_loss(plain, ids, targets, [])
    assert abs(float(loss) - float(expected.detach())) <= TOL


def full_batch(args: ContrastiveArgs) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole global batch, one autograd graph over both feature sides."""
    model = build(args)
    text_proj, image_proj = projections(model, args.dim, args.seed)
    lm, tower = split_tower(model)
    vc = model.config.vision_config
    batch = make_pairs(args.seed * 100_003, args.pairs * args.processes, vc)
    t = text_features(lm, text_proj, batch.ids, batch.mask)
    v = image_features(tower, image_proj, batch.images)
    loss = pair_loss(t, v, 0, 0, t.shape[0], ContrastiveConfig(dim=args.dim))
    loss.backward()
    return float(loss), grads_of(
        ("lm.", lm), ("text_proj.", text_proj), ("tower.", tower), ("image_proj.", image_proj)
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "blocking"])
def test_contrastive_gathers_equal_one_process_on_the_whole_batch(tmp_path: Path, overlap: bool) -> None:
    args = ContrastiveArgs(
        preset="v41-tiny-vision", out=str(tmp_path / "run"), processes=2, steps=1, pairs=2, overlap=overlap,
        dump_gradients=True,
    )  # fmt: skip
    report = launch(args)
    assert report is not None and len(report["steps"]) == 1
    dumped = torch.load(tmp_path / "run" / "gradients.pt", weights_only=True)
    loss, expected = full_batch(args)
    assert abs(float(dumped["loss"]) - loss) <= TOL
    assert_close(dumped["grads"], expected)
    step = report["steps"][0]
    assert step["image_gather"] >= 0 and step["text_gather"] >= 0
    # the export serves: the tower is back in the model, with the trained weights
    served = load_model(tmp_path / "run")
    assert served.model.vision is not None
    assert (tmp_path / "run" / "vision" / "vision.safetensors").exists()


def test_the_single_process_step_is_the_full_batch_computation() -> None:
    args = ContrastiveArgs(preset="v41-tiny-vision", out="", processes=1, pairs=3)
    loss, expected = full_batch(args)
    model = build(args)
    text_proj, image_proj = projections(model, args.dim, args.seed)
    lm, tower = split_tower(model)
    batch = make_pairs(0, 3, model.config.vision_config)
    got = contrastive_step(
        lm, text_proj, tower, image_proj, batch.ids, batch.mask, batch.images, ContrastiveConfig()
    )
    assert abs(float(got) - loss) <= TOL
    assert_close(
        grads_of(("lm.", lm), ("text_proj.", text_proj), ("tower.", tower), ("image_proj.", image_proj)),
        expected,
    )


def test_generated_pairs_are_seeded_and_reads_are_counted() -> None:
    vc = v41_tiny_vision().vision_config
    store = ImageStore()
    a = make_pairs(1, 3, vc, store=store)
    b = make_pairs(1, 3, vc)
    assert a.captions == b.captions and [im.digest for im in a.images] == [im.digest for im in b.images]
    assert dict(store.reads) == {0: 1, 1: 1, 2: 1}
