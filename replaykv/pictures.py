"""Generated images: a rendered digit, a simple shape, or a short word, drawn with PIL from a
seeded generator, each with the question it is asked with and the answer a model that reads
images should give. The acceptance harness's image suffix, the contrastive training pairs and
the planner's loader measurement draw them (no download anywhere).

The same generator state always draws the same pixels (for one Pillow version: its bundled
font draws the text), so a contract's seed fixes its images, and with them their content digests.

Not for: placing images in prompts (see :mod:`replaykv.accept.cases`) or decoding uploaded images
(see :mod:`replaykv.images`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("digit", "shape", "text")
SHAPES = ("circle", "square", "triangle")
WORDS = ("CAT", "SUN", "MAP", "KEY", "BOX", "RED", "TOP", "ZIP")
COLORS = {"red": (200, 30, 30), "green": (30, 150, 40), "blue": (30, 60, 200), "black": (10, 10, 10)}


@dataclass(frozen=True)
class Picture:
    """One generated image: RGB pixels [H, W, 3] uint8, its kind, question and expected answer."""

    pixels: np.ndarray
    kind: str
    question: str
    answer: str


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def draw_picture(rng: np.random.Generator, kind: str | None = None) -> Picture:
    """A picture of `kind` (None: chosen by `rng`) on a light background, drawn from `rng` alone."""
    from PIL import Image, ImageDraw

    kind = kind or KINDS[int(rng.integers(len(KINDS)))]
    if kind not in KINDS:
        raise ValueError(f"unknown picture kind {kind!r}; choose one of {list(KINDS)}")
    color_name = list(COLORS)[int(rng.integers(len(COLORS)))]
    color = COLORS[color_name]
    background = tuple(int(v) for v in rng.integers(215, 256, size=3))
    if kind == "text":
        width, height = 168, 84
    else:
        width = height = 112
    img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    if kind == "digit":
        digit = str(int(rng.integers(10)))
        draw.text((width / 2, height / 2), digit, fill=color, font=_font(80), anchor="mm")
        question, answer = "What digit is in the image?", digit
    elif kind == "shape":
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        r = int(rng.integers(28, 44))
        cx, cy = (int(v) for v in rng.integers(r + 4, width - r - 4, size=2))
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            draw.ellipse(box, fill=color)
        elif shape == "square":
            draw.rectangle(box, fill=color)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
        question, answer = "What shape is in the image, and what color?", f"a {color_name} {shape}"
    else:
        word = WORDS[int(rng.integers(len(WORDS)))]
        draw.text((width / 2, height / 2), word, fill=color, font=_font(40), anchor="mm")
        question, answer = "What word is written in the image?", word
    return Picture(np.asarray(img, dtype=np.uint8).copy(), kind, question, answer)
