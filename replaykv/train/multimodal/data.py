"""Image–caption pairs generated on the spot (no download) and an image store that counts reads.

A pair is a rendered digit, a simple shape or a short word (:func:`replaykv.pictures.
draw_picture`) with its caption ("the digit 7", "a red circle", "the word CAT"), drawn from a
seeded generator, so a seed fixes a batch. Images are kept PNG-encoded in an
:class:`ImageStore`, the stand-in for the storage a loader reads from: every
:meth:`ImageStore.read` is counted per image, which is what context-parallel loading is
checked against (each image read once per step).

Not for: the images of the acceptance harness (same drawings, its own questions).
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from replaykv.images import PreparedImage, prepare_image
from replaykv.model.vision import DeepseekV41VisionConfig
from replaykv.pictures import draw_picture

BOS, PAD = 256, 257  # the byte tokenizer's <|bos|> and <|eos|> (a caption's padding)


def caption_of(kind: str, answer: str) -> str:
    if kind == "digit":
        return f"the digit {answer}"
    if kind == "text":
        return f"the word {answer}"
    return answer


class ImageStore:
    """PNG-encoded images by id; `read` returns the bytes and counts the read."""

    def __init__(self) -> None:
        self._data: dict[int, bytes] = {}
        self.reads: Counter[int] = Counter()

    def put(self, image_id: int, pixels: np.ndarray) -> None:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        self._data[image_id] = buf.getvalue()

    def read(self, image_id: int) -> bytes:
        self.reads[image_id] += 1
        return self._data[image_id]

    def nbytes(self, image_id: int) -> int:
        return len(self._data[image_id])

    def __len__(self) -> int:
        return len(self._data)


@dataclass
class PairBatch:
    """`ids` [B, L] captions (bos, bytes, padding), `mask` [B, L] true on caption tokens, and
    the images of the same rows (prepared: resized, digested)."""

    ids: torch.Tensor
    mask: torch.Tensor
    images: list[PreparedImage]
    captions: list[str]


def make_pairs(
    seed: int, count: int, vision: DeepseekV41VisionConfig, length: int = 24, store: ImageStore | None = None
) -> PairBatch:
    """`count` pairs drawn from `seed`; their images go through `store` (written, then read
    once each) when one is given."""
    rng = np.random.default_rng(seed)
    ids = torch.full((count, length), PAD, dtype=torch.long)
    mask = torch.zeros(count, length, dtype=torch.bool)
    images, captions = [], []
    for i in range(count):
        pic = draw_picture(rng)
        caption = caption_of(pic.kind, pic.answer)
        tokens = [BOS, *caption.encode()][:length]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = True
        if store is not None:
            store.put(i, pic.pixels)
            images.append(prepare_image(store.read(i), vision))
        else:
            images.append(prepare_image(pic.pixels, vision))
        captions.append(caption)
    return PairBatch(ids, mask, images, captions)
