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
