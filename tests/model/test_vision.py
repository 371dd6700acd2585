"""The image path: the tower against a naive reference, the resize plan, spans placed in
one-shot and chunked prefill against the dense text reference, and checkpoints with a tower."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from replaykv.cache.views import advance, allocate_view
from replaykv.images import (
    ImageError,
    PreparedImage,
    image_span_length,
    plan_resize,
    prepare_image,
    span_layout,
)
from replaykv.model.checkpoint import build_model, load_model, save_pretrained
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny_vision
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.model.vision import DeepseekV41VisionConfig
from tests.model.v41_reference import reference_logits
from tests.model.vision_reference import naive_span, reference_logits_with_images

TOL = 1e-4


def vision_model(seed: int = 0) -> DeepseekV41ForCausalLM:
    """`v41-tiny-vision`, float32, quantisers off, with an image bias unlike the text bias."""
    model = init_weights(build_model(v41_tiny_vision().replace(kv_quant=False)), seed=seed).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.e_score_correction_bias.copy_(
            torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.05
        )
        gate.e_score_correction_bias_vl.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=gen))
    return model


def picture(seed: int, size: tuple[int, int] = (70, 50)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def model() -> DeepseekV41ForCausalLM:
    return vision_model()


def test_tower_equals_the_naive_reference(model: DeepseekV41ForCausalLM) -> None:
    image = prepare_image(picture(1, (100, 60)), model.config.vision_config)
    assert model.model.vision is not None
    with torch.no_grad():
        got = model.model.vision.span(image)
    ref = naive_span(model, image.canvas)
    assert got.shape == ref.shape == (image.span_length, model.config.hidden_size)
    assert (got - ref).abs().max().item() <= 1e-5


def test_span_layout_and_length() -> None:
    layout = span_layout(2, 3)
    assert len(layout) == image_span_length(2, 3) == 2 * (3 + 1) + 2
    assert layout == ["start"] + (["image"] * 3 + ["newline"]) * 2 + ["end"]


@pytest.mark.parametrize(
    "size",
    [(10, 10), (84, 84), (100, 60), (700, 40), (30, 900), (4000, 3000)],
)
def test_resize_plan_fits_the_budget_in_whole_patches(size: tuple[int, int]) -> None:
    vc = v41_tiny_vision().vision_config
    assert vc is not None
    gh, gw, h, w = plan_resize(size[0], size[1], vc)
    assert h % vc.patch_size == 0 and w % vc.patch_size == 0
    cell = vc.patch_size * vc.downsample_ratio
    assert (gh, gw) == (
        -(-(h // vc.patch_size) // vc.downsample_ratio),
        -(-(w // vc.patch_size) // vc.downsample_ratio),
    )
    assert image_span_length(gh, gw) <= vc.max_image_tokens
    assert h * w >= min(vc.min_pixels, cell * cell) or image_span_length(gh, gw) > vc.max_image_tokens - 2 * (
        gw + 1
    )
    if size[0] > 4 * size[1]:
        assert gw > gh  # a wide image stays wide


def test_released_resize_plan() -> None:
    """The released plan: a 544² minimum is 39 patches -> 13 × 13 tokens, 184 positions; a large
    image shrinks to at most 1024 positions."""
    vc = DeepseekV41VisionConfig()
    assert plan_resize(544, 544, vc)[:2] == (13, 13)
    assert image_span_length(13, 13) == 184
    gh, gw, _, _ = plan_resize(4096, 3072, vc)
    assert image_span_length(gh, gw) <= 1024 and gw >= gh


def test_digest_names_the_pixels_not_the_encoding() -> None:
    vc = v41_tiny_vision().vision_config
    assert vc is not None
    pixels = picture(2)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    bmp = io.BytesIO()
    Image.fromarray(pixels).save(bmp, format="BMP")
    a, b = prepare_image(png.getvalue(), vc), prepare_image(bmp.getvalue(), vc)
    assert a.digest == b.digest and torch.equal(a.canvas, b.canvas)
    changed = pixels.copy()
    changed[0, 0, 0] ^= 0xFF
    assert prepare_image(changed, vc).digest != a.digest
    with pytest.raises(ImageError, match="not an image"):
        prepare_image(b"this is text, not a picture", vc)


def _prompt(
    model: DeepseekV41ForCausalLM, n: int, images: list[tuple[int, PreparedImage]], seed: int
) -> list[int]:
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    for start, image in images:
        ids[start : start + image.span_length] = [model.config.image_token_id] * image.span_length
    return ids


def _reference(
    model: DeepseekV41ForCausalLM, ids: list[int], spans: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    emb = model.model.embed_tokens.weight.detach().float()[torch.tensor(ids)].clone()
    rows = torch.zeros(len(ids), dtype=torch.bool)
    for start, vec in spans:
        emb[start : start + vec.shape[0]] = vec
        rows[start : start + vec.shape[0]] = True
    return reference_logits(model, ids, inputs=emb, image_rows=rows)[0]


def _run(
    model: DeepseekV41ForCausalLM, ids: list[int], spans: list[tuple[int, torch.Tensor]], chunks: list[int]
) -> torch.Tensor:
    view = allocate_view(ModelSpec.from_config(model.config), 1, len(ids))
    x = torch.tensor([ids])
    outs, pos = [], 0
    with torch.no_grad():
        for c in chunks:
            outs.append(model(x[:, pos : pos + c], view, spans=spans))
            advance(view, c)
            pos += c
    return torch.cat(outs, dim=1)[0]


# (name, span starts, prompt length): the tiny model's window is 8 positions, its images here 10.
PLACES = {
    "prefix": ([3], 48),
    "suffix": ([36], 48),
    "across_window": ([20, 31], 48),  # two images, the second starting one window after the first
}


@pytest.mark.parametrize("place", sorted(PLACES))
def test_one_shot_and_chunked_prefill_with_images_equal_the_reference(
    model: DeepseekV41ForCausalLM, place: str
) -> None:
    starts, n = PLACES[place]
    vc = model.config.vision_config
    images = [(s, prepare_image(picture(10 + i), vc)) for i, s in enumerate(starts)]
    ids = _prompt(model, n, images, seed=5)
    assert model.model.vision is not None
    with torch.no_grad():
        spans = [(s, model.model.vision.span(im)) for s, im in images]
    ref = reference_logits_with_images(model, ids, [(s, im.canvas) for s, im in images])  # naive tower too
    one = _run(model, ids, spans, [n])
    assert (one - ref).abs().max().item() <= TOL
    # chunk boundaries inside every span and at the window's edge
    chunked = _run(model, ids, spans, [5, 17, 1, 9, 16])
    assert torch.equal(chunked, one)
    # the placeholder embeddings would be another model input: the check can fail
    placeholder = _reference(model, ids, [])
    assert (placeholder - ref).abs().max().item() > 100 * TOL


def test_the_image_bias_routes_image_positions(model: DeepseekV41ForCausalLM) -> None:
    vc = model.config.vision_config
    image = prepare_image(picture(3), vc)
    ids = _prompt(model, 24, [(4, image)], seed=6)
    assert model.model.vision is not None
    with torch.no_grad():
        spans = [(4, model.model.vision.span(image))]
    got = _run(model, ids, spans, [24])
    emb = model.model.embed_tokens.weight.detach().float()[torch.tensor(ids)].clone()
    emb[4 : 4 + image.span_length] = spans[0][1]
    text_bias = reference_logits(model, ids, inputs=emb)[0]  # image rows routed as text
    assert (got - text_bias).abs().max().item() > 100 * TOL


def test_a_checkpoint_with_a_tower_saves_and_loads(tmp_path: Path, model: DeepseekV41ForCausalLM) -> None:
    save_pretrained(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config.replace(kv_quant=False) == model.config  # kv_quant is not a config.json field
    assert DeepseekV41Config.from_json(tmp_path / "config.json").vision_config == model.config.vision_config
    image = prepare_image(picture(4), model.config.vision_config)
    with torch.no_grad():
        assert torch.equal(loaded.model.vision.span(image), model.model.vision.span(image))


def test_vision_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        DeepseekV41VisionConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="unknown vision_config fields"):
        DeepseekV41VisionConfig.from_dict({"hidden_sizes": 3})
    with pytest.raises(ValueError, match="image_token_id"):
        v41_tiny_vision().replace(image_token_id=10**6)
