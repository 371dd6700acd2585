"""Image content parts in the chat API, over the real engine (preset 'v41-tiny-vision', random
weights, CPU) and the official `openai` client: an image as a data URL is answered, its span is
counted in usage, the next turn re-sending it reuses the cached prefix past the image, another
image reuses only the chunks before it, and every bad image is a 400 that names the problem.
The template's placement of image slots is checked on ids directly."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image, ImageDraw

from replaykv.engine.config import EngineConfig
from replaykv.engine.engine import Engine
from replaykv.images import ImageLimits
from replaykv.server.chat import BUILTIN_TEMPLATE, ChatTemplateError, ImageSlot, JinjaChatTemplate
from replaykv.server.settings import ServerSettings, SettingsError, load_settings
from replaykv.tokenizer import ByteTokenizer
from tests.server.conftest import ALICE, LiveServer
from tests.server.fake_engine import FakeEngine

IMAGE_ID = 511  # the preset's image token id
CHUNK = 16  # global-KV chunk of the test engine: small, so chunks lie before the image
MAX_BYTES, MAX_PIXELS, MAX_IMAGES = 20_000, 200 * 200, 3
SYSTEM = {"role": "system", "content": "You describe pictures in a few words."}
TOK = ByteTokenizer()


def png(picture: Image.Image) -> bytes:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def shapes(fill: str = "red") -> bytes:
    """A 100 × 90 drawing (a 3 × 3 grid: a span of 14 positions)."""
    picture = Image.new("RGB", (100, 90), "white")
    draw = ImageDraw.Draw(picture)
    draw.ellipse((10, 10, 60, 70), fill=fill)
    draw.rectangle((50, 40, 95, 85), fill="blue")
    return png(picture)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def ask(url: str, question: str = "What is in this picture?") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": "Look: "}, image_part(url), {"type": "text", "text": question}],
    }


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = EngineConfig(
        preset="v41-tiny-vision",
        store_dir=str(tmp_path_factory.mktemp("store")),
        chunk_size=CHUNK,
        max_batch=2,
    )
    settings = ServerSettings(
        max_image_bytes=MAX_BYTES, max_image_pixels=MAX_PIXELS, max_images_per_request=MAX_IMAGES
    )
    live = LiveServer(Engine(config), settings).start()
    yield live
    live.stop()
    live.engine.shutdown()


def client(live: LiveServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=120)


def chat(live: LiveServer, messages: list[Any], **kw: Any) -> Any:
    return client(live).chat.completions.create(
        model=live.engine.model_name,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
        **kw,
    )


def image_run(ids: list[int]) -> tuple[int, int]:
    """(start, end) of the one run of image-token ids in a prompt."""
    where = [i for i, t in enumerate(ids) if t == IMAGE_ID]
    assert where and where == list(range(where[0], where[-1] + 1)), where
    return where[0], where[-1] + 1


def refused(live: LiveServer, messages: list[Any]) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, messages)
    assert e.value.status_code == 400
    return str(e.value.body["message"] if isinstance(e.value.body, dict) else e.value.message)


def test_template_places_image_slots_and_reports_their_starts() -> None:
    slot = ImageSlot(0, 5, IMAGE_ID)
    messages: list[Any] = [("system", "s"), ("user", ("a", slot, "b"))]
    ids, starts = BUILTIN_TEMPLATE.render_with_images(messages, TOK)
    assert ids[starts[0] : starts[0] + 5] == [IMAGE_ID] * 5 and ids.count(IMAGE_ID) == 5
    assert ids[starts[0] - 1] == ord("a") and ids[starts[0] + 5] == ord("b")
    later = [*messages, ("assistant", "ok"), ("user", ("c", ImageSlot(1, 3, IMAGE_ID)))]
    ids2, starts2 = BUILTIN_TEMPLATE.render_with_images(later, TOK)
    assert ids2[: len(ids)] == ids and starts2[0] == starts[0] and starts2[1] > len(ids)


def test_a_jinja_template_places_image_slots_where_the_content_goes() -> None:
    source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>"
    template = JinjaChatTemplate(source, {})
    ids, starts = template.render_with_images([("user", ("x", ImageSlot(0, 4, IMAGE_ID), "y"))], TOK)
    assert ids[starts[0] - 1 : starts[0] + 5] == [ord("x"), *[IMAGE_ID] * 4, ord("y")]
    rewrites = JinjaChatTemplate("{% for m in messages %}{{ m.content | length }}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match="images cannot be placed"):
        rewrites.render_with_images([("user", ("x", ImageSlot(0, 4, IMAGE_ID)))], TOK)


def test_an_image_is_answered_and_the_next_turn_reuses_its_prefix(vision_server: LiveServer) -> None:
    messages: list[Any] = [SYSTEM, ask(data_url(shapes()))]
    first = chat(vision_server, messages)
    ids = first.model_extra["prompt_token_ids"]
    start, end = image_run(ids)
    assert end - start == 14  # 3 × 3 grid: 3·(3+1) + 2
    assert first.usage.prompt_tokens == len(ids)
    assert first.usage.prompt_tokens_details.image_tokens == 14
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].message.content is not None
    vision_server.engine.flush_writeback()

    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And which colours?"},
    ]
    second = chat(vision_server, messages)
    ids2 = second.model_extra["prompt_token_ids"]
    assert ids2[: len(ids)] == ids  # the same ids and span: the earlier turn's prefix
    assert second.usage.prompt_tokens_details.image_tokens == 14
    assert second.usage.prompt_tokens_details.cached_tokens >= end  # reused past the image

    # the same text with another image: only the chunks wholly before the image are reused
    other = chat(vision_server, [SYSTEM, ask(data_url(shapes(fill="green")))])
    assert other.model_extra["prompt_token_ids"] == ids  # the same ids; the pixels differ
    assert start >= CHUNK
    assert other.usage.prompt_tokens_details.cached_tokens == start // CHUNK * CHUNK


def test_a_streamed_answer_reports_image_tokens(vision_server: LiveServer) -> None:
    chunks = list(
        chat(
            vision_server,
            [ask(data_url(shapes("yellow")))],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.image_tokens == 14


def noise_png(side: int) -> bytes:
    rng = np.random.default_rng(0)
    return png(Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB"))


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://example.com/cat.png", "only data: URLs are accepted"),
        ("data:image/png;base64,@@not base64@@", "base64 payload does not decode"),
        (data_url(b"these bytes are no picture"), "not an image"),
        (data_url(b"%PDF-1.4", "application/pdf"), "not an image type"),
        (data_url(noise_png(120)), f"larger than {MAX_BYTES} bytes"),
        (data_url(png(Image.new("RGB", (300, 300), "gray"))), f"at most {MAX_PIXELS} are accepted"),
    ],
    ids=["remote", "bad-base64", "not-an-image", "pdf", "too-many-bytes", "too-many-pixels"],
)
def test_bad_images_are_400_naming_the_problem(vision_server: LiveServer, url: str, expected: str) -> None:
    message = refused(vision_server, [ask(url)])
    assert expected in message and "messages[0].content[1].image_url.url" in message, message


def test_malformed_requests_are_400(vision_server: LiveServer) -> None:
    url = data_url(shapes())
    too_many = [{"role": "user", "content": [image_part(url)] * (MAX_IMAGES + 1)}]
    assert f"at most {MAX_IMAGES} are accepted per request" in refused(vision_server, too_many)
    unknown = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    assert "type 'input_audio'" in refused(vision_server, unknown)
    no_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    assert 'image part without "image_url"' in refused(vision_server, no_url)
    as_assistant = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image_part(url)]}]
    assert "user messages only" in refused(vision_server, as_assistant)


def test_a_text_only_model_refuses_images(live: LiveServer, fake: FakeEngine) -> None:
    texts: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with_image: list[Any] = [ask(data_url(shapes()))]
    c = client(live, ALICE)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=live.engine.model_name, messages=with_image, max_tokens=2)
    assert "has no vision tower" in str(e.value) and fake.requests == []
    r = c.chat.completions.create(
        model=live.engine.model_name, messages=texts, max_tokens=2
    )  # text parts: as before
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.image_tokens == 0


def test_image_limits_come_from_flags_and_the_environment() -> None:
    argv = ["--preset", "tiny", "--max-image-bytes", "1000", "--max-image-pixels", "4096"]
    settings = load_settings(argv, environ={"REPLAYKV_MAX_IMAGES_PER_REQUEST": "2"})
    assert settings.server().image_limits == ImageLimits(1000, 4096, 2)
    assert load_settings([], environ={}).server().image_limits == ImageLimits()
    with pytest.raises(SettingsError, match="--max-images-per-request"):
        load_settings(["--max-images-per-request", "0"], environ={})
