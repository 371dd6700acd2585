"""Images in a prompt: decoding, V4.1's resize plan, content digests and the span layout.

An image enters a prompt as one span of positions (architecture reference §8)::

    [IMAGE_START] + ([IMAGE] × w + [NEWLINE]) × h + [IMAGE_END]      h·(w+1) + 2 positions

every one carrying the config's ``image_token_id``; the model tells the positions apart from
the grid (h, w), and tells images apart only by their pixels. So everything that names cached
state must see the image's content: :attr:`PreparedImage.digest` is a SHA-256 of the canvas the
tower reads (after the resize plan), and prefix keys hash it with the span's place
(:mod:`replaykv.cache.keys`). The same pixels sent as PNG or as JPEG-free RGB give one digest;
one changed pixel gives another.

The resize plan (DeepSeek's image processor, described in the architecture reference):
upscale to ``min_pixels``, round both sides up to whole patches, shrink while the span costs
more than ``max_image_tokens`` positions, then fit the image into that box keeping its aspect
ratio and pad the rest gray (127). The tower reads the canvas normalised with mean = std = 0.5.

Limits a server applies before any decoding work (:class:`ImageLimits`) raise
:class:`ImageError` with a message for the client. Not for: the tower itself
(:mod:`replaykv.model.vision`) or HTTP parsing (:mod:`replaykv.server`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from replaykv.model.vision import DeepseekV41VisionConfig

__all__ = [
    "ImageError",
    "ImageLimits",
    "PreparedImage",
    "PromptImage",
    "check_placement",
    "decode_data_url",
    "image_span_length",
    "plan_resize",
    "prepare_image",
    "span_layout",
]

PAD_VALUE = 127
"""Gray the resize plan pads with (DeepSeek's processor)."""

_DIGEST_DOMAIN = b"replaykv.image.v1"


class ImageError(ValueError):
    """An image that cannot be used (not an image, too large, a remote URL); the message says
    why in words a client can act on."""


@dataclass(frozen=True)
class ImageLimits:
    """What a server accepts per image before decoding (bytes) and after (pixels), and per request."""

    max_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 16 * 1024 * 1024
    max_images: int = 8


def image_span_length(grid_h: int, grid_w: int) -> int:
    """Positions one image takes in the prompt: h·(w + 1) + 2."""
    return grid_h * (grid_w + 1) + 2


def span_layout(grid_h: int, grid_w: int) -> list[str]:
    """The role of every position of a span, in order: "start", "image", "newline", "end"."""
    rows = (["image"] * grid_w + ["newline"]) * grid_h
    return ["start", *rows, "end"]


def _grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    """LLM-token grid of a canvas: patches per side, grouped ratio × ratio (a partial group counts)."""
    return math.ceil(height // patch / ratio), math.ceil(width // patch / ratio)


def plan_resize(width: int, height: int, vision: DeepseekV41VisionConfig) -> tuple[int, int, int, int]:
    """The canvas of an image of `width` × `height` pixels: (grid_h, grid_w, canvas_h, canvas_w).

    The canvas sides are whole patches; the span of the grid costs at most
    ``vision.max_image_tokens`` positions.
    """
    patch, ratio = vision.patch_size, vision.downsample_ratio
    if width <= 0 or height <= 0:
        raise ImageError(f"an image needs a positive size; got {width}×{height}")
    w, h = float(width), float(height)
    if vision.max_wh_ratio is not None and w > h * vision.max_wh_ratio:
        w = h * vision.max_wh_ratio
    if w * h < vision.min_pixels:
        up = math.sqrt(vision.min_pixels / (w * h))
        w, h = math.floor(w * up), math.floor(h * up)
    canvas_w, canvas_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    budget = vision.max_image_tokens
    gh, gw = _grid(canvas_h, canvas_w, patch, ratio)
    if image_span_length(gh, gw) > budget:
        # Shrink both sides by one scale, in whole cells of patch × ratio pixels, to the largest
        # grid that fits; a very thin image collapses to one row or one column.
        cell = patch * ratio
        aspect = h / w
        best: tuple[int, int] | None = None
        for cols in range(max(1, budget - 3), 0, -1):
            rows = max(1, math.floor(cols * aspect))
            if image_span_length(rows, cols) <= budget:
                best = (rows, cols)
                break
        if best is None:
            raise ImageError(f"no grid fits an image of {width}×{height} in {budget} positions")
        rows, cols = best
        while image_span_length(rows, cols) > budget and rows > 1:
            rows -= 1
        canvas_h, canvas_w = rows * cell, cols * cell
        gh, gw = rows, cols
    return gh, gw, canvas_h, canvas_w


@dataclass(frozen=True)
class PreparedImage:
    """An image after the resize plan: the uint8 RGB canvas [3, H, W] the tower reads, its
    LLM-token grid and its content digest (32 bytes)."""

    canvas: torch.Tensor = field(repr=False)
    grid: tuple[int, int]
    digest: bytes
    source_size: tuple[int, int] = (0, 0)  # (width, height) before the plan

    @property
    def span_length(self) -> int:
        return image_span_length(*self.grid)

    @property
    def nbytes(self) -> int:
        return int(self.canvas.numel())

    def pixels(self, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
        """The canvas normalised for the tower: (x / 255 - 0.5) / 0.5, [3, H, W]."""
        x = self.canvas.to(device=device, dtype=torch.float32)
        return ((x / 255.0 - 0.5) / 0.5).to(dtype)


@dataclass(frozen=True)
class PromptImage:
    """An image placed in a prompt: its span covers positions [start, start + span_length)."""

    start: int
    image: PreparedImage

    @property
    def end(self) -> int:
        return self.start + self.image.span_length

    @property
    def key_part(self) -> tuple[int, int, bytes]:
        """(start, length, digest): what prefix keys hash for this image."""
        return self.start, self.image.span_length, self.image.digest


def check_placement(ids: Sequence[int], images: Sequence[PromptImage], image_token_id: int) -> None:
    """Raise :class:`ImageError` unless every image's span lies inside `ids`, overlaps no other,
    and covers only positions carrying `image_token_id` (the message names the image)."""
    end = 0
    for i, im in enumerate(sorted(images, key=lambda im: im.start)):
        if im.start < end or im.start < 0 or im.end > len(ids):
            raise ImageError(
                f"image {i}: its span [{im.start}, {im.end}) overlaps another or leaves the prompt of "
                f"{len(ids)} tokens"
            )
        if any(t != image_token_id for t in ids[im.start : im.end]):
            raise ImageError(
                f"image {i}: positions [{im.start}, {im.end}) must all carry the image token id {image_token_id}"
            )
        end = im.end


def _digest(canvas: np.ndarray) -> bytes:
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(struct.pack("<QQQ", *canvas.shape))
    h.update(np.ascontiguousarray(canvas, dtype=np.uint8).tobytes())
    return h.digest()


def prepare_image(
    source: bytes | Any, vision: DeepseekV41VisionConfig, limits: ImageLimits | None = None
) -> PreparedImage:
    """Decode `source` (encoded bytes, a PIL image or an RGB uint8 array [H, W, 3]) and apply
    the resize plan. Raises :class:`ImageError` for anything that is not a usable image."""
    from PIL import Image, UnidentifiedImageError

    limits = limits or ImageLimits()
    img: Any
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > limits.max_bytes:
            raise ImageError(f"the image is {len(data)} bytes; at most {limits.max_bytes} are accepted")
        if not data:
            raise ImageError("the image is empty (0 bytes)")
        Image.MAX_IMAGE_PIXELS = None  # our own pixel limit applies, before the pixels are decoded
        try:
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width * height > limits.max_pixels:
                raise ImageError(
                    f"the image is {width}×{height} = {width * height} pixels; at most "
                    f"{limits.max_pixels} are accepted"
                )
            img.load()
        except ImageError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise ImageError(
                "the data is not an image in a format that can be decoded (PNG, JPEG, GIF, BMP, WebP, ...)"
            ) from exc
    elif isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[2] != 3 or source.dtype != np.uint8:
            raise ImageError(f"an image array must be uint8 [H, W, 3]; got {source.dtype} {source.shape}")
        img = Image.fromarray(source, "RGB")
    else:
        img = source
    width, height = img.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"the image is {width}×{height} = {width * height} pixels; at most {limits.max_pixels} are accepted"
        )
    img = img.convert("RGB")
    gh, gw, canvas_h, canvas_w = plan_resize(width, height, vision)
    scale = min(canvas_w / width, canvas_h / height)
    fit_w = max(1, min(canvas_w, round(width * scale)))
    fit_h = max(1, min(canvas_h, round(height * scale)))
    fitted = img.resize((fit_w, fit_h), Image.Resampling.BICUBIC)
    canvas_img = Image.new("RGB", (canvas_w, canvas_h), (PAD_VALUE,) * 3)
    canvas_img.paste(fitted, ((canvas_w - fit_w) // 2, (canvas_h - fit_h) // 2))
    canvas = np.asarray(canvas_img, dtype=np.uint8).transpose(2, 0, 1).copy()  # [3, H, W]
    return PreparedImage(torch.from_numpy(canvas), (gh, gw), _digest(canvas), (width, height))


def decode_data_url(url: str, limits: ImageLimits | None = None) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL. Any other URL is refused: servers here
    have no network, so a remote image cannot be fetched."""
    limits = limits or ImageLimits()
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ImageError(
            f"only data: URLs are accepted for images (nothing is fetched from the network); "
            f"got a {scheme!r} URL"
        )
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("a data: URL needs a ',' between its media type and its data")
    parts = head.split(";")
    media = parts[0].strip().lower()
    if media and not media.startswith("image/"):
        raise ImageError(f"the data: URL's media type is {media!r}, not an image type")
    if "base64" not in [p.strip().lower() for p in parts[1:]]:
        raise ImageError("image data: URLs must be base64-encoded (data:image/png;base64,...)")
    if len(payload) > 4 * (limits.max_bytes // 3 + 2):
        raise ImageError(f"the image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data: URL's base64 payload does not decode ({exc})") from exc
