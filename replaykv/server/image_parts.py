"""Images in prompts: chat image parts and image files → prompt ids with image spans.

For: what the chat endpoint and ``replaykv generate --image`` share, so that one image gives the
same ids either way. :class:`VisionPath` is what a prompt needs of a model with a vision tower
(its vision config and image token id); :func:`image_parts` checks a request's image parts
(user messages only, at most ``max_images``, a model that reads images) before anything is
decoded; :func:`decode_images` decodes them under the server's :class:`ImageLimits` (``data:``
URLs only: the server fetches nothing); :func:`message_content` turns a message into template
content with an :class:`ImageSlot` per image, and :func:`place` the rendered starts into the
engine's :class:`PromptImage` objects. :func:`raw_prompt` is the prompt without a chat template
(BOS, the images, the text), as ``replaykv generate`` builds it.

Every problem is an :class:`ApiError` 400 whose message names it and whose ``param`` names the
part (``messages[1].content[0].image_url.url``).

Not for: decoding pixels, the resize plan or digests (:mod:`replaykv.images`), the chat template
itself (:mod:`replaykv.server.chat`) or running the tower (the engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replaykv.images import (
    ImageError,
    ImageLimits,
    PreparedImage,
    PromptImage,
    decode_data_url,
    prepare_image,
)
from replaykv.server.chat import Content, ImageSlot, encode_content
from replaykv.server.errors import ApiError
from replaykv.server.schemas import ChatMessage, ImagePart, TextPart
from replaykv.tokenizer import Tokenizer

if TYPE_CHECKING:
    from replaykv.model.vision import DeepseekV41VisionConfig


@dataclass(frozen=True)
class VisionPath:
    """What a prompt needs of a model that reads images: how its images are planned (`config`)
    and the token id every position of a span carries."""

    config: DeepseekV41VisionConfig
    image_token_id: int

    @classmethod
    def of(cls, model_config: Any) -> VisionPath | None:
        """The image path of a model config (a ``DeepseekV41Config``); None for a text-only one."""
        vision = getattr(model_config, "vision_config", None)
        token = getattr(model_config, "image_token_id", None)
        if vision is None or token is None:
            return None
        return cls(vision, int(token))

    def slot(self, index: int, image: PreparedImage) -> ImageSlot:
        return ImageSlot(index, image.span_length, self.image_token_id)


def engine_vision(engine: object) -> VisionPath | None:
    """The image path of an engine whose model has a vision tower; None for a text-only model
    (and for an engine that names no model, such as a test double)."""
    if getattr(engine, "vision", None) is None:
        return None
    return VisionPath.of(getattr(getattr(engine, "model", None), "config", None))


@dataclass(frozen=True)
class FoundImage:
    """An image part of a request: where it is (message i, part j) and its URL."""

    message: int
    part: int
    url: str

    @property
    def param(self) -> str:
        return f"messages[{self.message}].content[{self.part}].image_url.url"


def image_parts(
    messages: Sequence[ChatMessage], vision: VisionPath | None, limits: ImageLimits, model_name: str
) -> list[FoundImage]:
    """Every image part of `messages` in order, checked before anything is decoded: images only
    in user messages, at most ``limits.max_images``, and a model with a vision tower."""
    found: list[FoundImage] = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, ImagePart):
                continue
            if message.role != "user":
                raise ApiError(
                    400,
                    f"messages[{i}] is a {message.role!r} message; image parts are accepted in user messages only",
                    f"messages[{i}].content[{j}]",
                    "invalid_value",
                )
            found.append(FoundImage(i, j, part.image_url.url))
    if found and vision is None:
        first = found[0]
        raise ApiError(
            400,
            f"the model `{model_name}` has no vision tower and reads text only; send the message "
            "without image parts",
            f"messages[{first.message}].content[{first.part}]",
            "images_not_supported",
        )
    if len(found) > limits.max_images:
        raise ApiError(
            400,
            f"the request has {len(found)} images; at most {limits.max_images} are accepted per request",
            "messages",
            "too_many_images",
        )
    return found


def decode_images(
    found: Sequence[FoundImage], vision: VisionPath, limits: ImageLimits
) -> list[PreparedImage]:
    """Decode and plan every found image (CPU work: call it off the event loop)."""
    prepared: list[PreparedImage] = []
    for image in found:
        try:
            prepared.append(prepare_image(decode_data_url(image.url, limits), vision.config, limits))
        except ImageError as e:
            raise ApiError(400, f"{image.param}: {e}", image.param, "invalid_image") from e
    return prepared


def message_content(
    message: ChatMessage, vision: VisionPath | None, images: Sequence[PreparedImage], first: int
) -> Content:
    """`message`'s content for the template: its text, or, with image parts, its text pieces
    (adjacent text parts joined) and a slot per image. `first`: the request-wide index of the
    message's first image, the index into `images`."""
    if not isinstance(message.content, list) or vision is None or not message.image_count:
        return message.text
    pieces: list[str | ImageSlot] = []
    index = first
    for part in message.content:
        if isinstance(part, TextPart):
            if pieces and isinstance(pieces[-1], str):
                pieces[-1] += part.text
            else:
                pieces.append(part.text)
        else:
            pieces.append(vision.slot(index, images[index]))
            index += 1
    return tuple(pieces)


def place(images: Sequence[PreparedImage], starts: Mapping[int, int]) -> tuple[PromptImage, ...]:
    """The engine's prompt images: image k at its rendered first position ``starts[k]``."""
    missing = [k for k in range(len(images)) if k not in starts]
    if missing:
        raise ApiError(
            400,
            f"the chat template did not place images {missing} in the prompt",
            "messages",
            "invalid_value",
        )
    return tuple(PromptImage(starts[k], image) for k, image in enumerate(images))


def raw_prompt(
    tokenizer: Tokenizer, vision: VisionPath, images: Sequence[PreparedImage], text: str
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """A prompt without a chat template: BOS, then the images in order, then `text`."""
    ids = tokenizer.encode("", bos=True)
    starts: dict[int, int] = {}
    content: Content = (*(vision.slot(k, image) for k, image in enumerate(images)), text)
    encode_content(content, tokenizer, ids, starts)
    return ids, place(images, starts)
