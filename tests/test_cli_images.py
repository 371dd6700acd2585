"""`replaykv generate --image`: the images go before the prompt text as the server's helper
places them, the greedy continuation is printed, and a bad file or a text-only model is exit 2
with a message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from replaykv.cli import main
from replaykv.images import prepare_image
from replaykv.model.presets import get_preset
from replaykv.server.image_parts import VisionPath, raw_prompt
from replaykv.tokenizer import ByteTokenizer

PRESET = "v41-tiny-vision"


@pytest.fixture
def picture(tmp_path: Path) -> Path:
    image = Image.new("RGB", (100, 90), "white")
    ImageDraw.Draw(image).ellipse((10, 10, 60, 70), fill="red")
    path = tmp_path / "shapes.png"
    image.save(path)
    return path


def test_generate_with_an_image_prints_the_continuation(
    picture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "generate",
        "--preset",
        PRESET,
        "--image",
        str(picture),
        "--prompt",
        "What is it?",
        "--max-tokens",
        "3",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    vision = VisionPath.of(get_preset(PRESET))
    assert vision is not None
    ids, placed = raw_prompt(
        ByteTokenizer(), vision, [prepare_image(picture.read_bytes(), vision.config)], "What is it?"
    )
    assert (
        placed[0].start == 1 and ids[1 : placed[0].end] == [vision.image_token_id] * 14
    )  # BOS, then the span
    assert f"{picture} (3×3 grid)" in out and f"{len(ids)} prompt tokens (14 in images) + 3 new tokens" in out
    found = re.search(r"output: .*  \(token ids \[([0-9, ]*)\]\)", out)
    assert found is not None and len(found.group(1).split(", ")) == 3, out


def test_generate_refuses_a_file_that_is_not_an_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "notes.png"
    junk.write_bytes(b"plain text, not a picture")
    assert main(["generate", "--preset", PRESET, "--image", str(junk)]) == 2
    err = capsys.readouterr().err
    assert f"--image {junk}" in err and "not an image" in err
    assert main(["generate", "--preset", PRESET, "--image", str(tmp_path / "missing.png")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_generate_refuses_images_for_a_text_only_model(
    picture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--preset", "tiny", "--image", str(picture)]) == 2
    assert "has no vision tower" in capsys.readouterr().err


def test_score_with_an_image_keeps_the_replay_semantics(tmp_path: Path, picture: Path) -> None:
    """`replaykv score --cut H --image FILE@START` writes what the scenario scorer computes with
    the image placed (an image straddling the cut, bounded replay with decoder replay on)."""
    import json

    import numpy as np
    import torch

    from replaykv.engine.scenario import score_after_cut
    from replaykv.images import PromptImage
    from replaykv.model.checkpoint import build_model, load_model, save_pretrained
    from replaykv.model.init import init_weights
    from replaykv.replay import ReplayFlags

    config = get_preset(PRESET)
    save_pretrained(init_weights(build_model(config), seed=2), tmp_path / "model")
    image = prepare_image(picture.read_bytes(), config.vision_config)
    ids = [65 + i % 20 for i in range(48)]
    start = 26
    ids[start : start + image.span_length] = [config.image_token_id] * image.span_length
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    out = tmp_path / "logits.npy"
    args = ["score", "--model", str(tmp_path / "model"), "--input-ids", str(tmp_path / "ids.json"),
            "--out", str(out), "--cut", "32", "--swa-miss-strategy", "bounded", "--decoder-replay", "on",
            "--image", f"{picture}@{start}"]  # fmt: skip
    assert main(args) == 0
    got = np.load(out)
    model = load_model(tmp_path / "model")
    flags = ReplayFlags(enable_decoder_swa_bounded_replay=True, swa_miss_strategy="bounded")
    want, plan = score_after_cut(
        model, ids, 32, flags, keep_snapshot=False, images=[PromptImage(start, image)]
    )
    assert plan.path == "bounded"
    assert np.allclose(got, want.numpy(), atol=1e-6, equal_nan=True)
    without, _ = score_after_cut(model, ids, 32, flags, keep_snapshot=False)
    assert not torch.allclose(torch.from_numpy(got)[-1], without[-1], atol=1e-3)
    bad = [*args[:-1], f"{picture}@3"]
    assert main(bad) == 2
