"""SGLang's native endpoints over the real engine (preset 'tiny', random weights, CPU):
/version, /get_model_info, /get_server_info (secrets redacted), /health_generate, /tokenize and
/detokenize (single and batch, round trip, bad ids, wrong model), and which need an API key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

import replaykv
from replaykv.engine.engine import Engine
from replaykv.server.settings import load_settings
from tests.server.conftest import LiveServer

KEY = "native-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp: Path = tmp_path_factory.mktemp("native")
    argv = ["--preset", "tiny", "--cache-dir", str(tmp), "--api-key", f"{KEY}=alice", "--admin-key", "adm-secret",
            "--swa-pool", "redis", "--redis-url", "redis://:hunter2@127.0.0.1:1/0"]  # fmt: skip
    settings = load_settings(argv, environ={})
    # the engine itself runs on the in-memory pool: only /get_server_info reads the Redis URL
    engine_settings = load_settings(["--preset", "tiny", "--cache-dir", str(tmp)], environ={})
    server = LiveServer(Engine(engine_settings.engine_config()), settings.server()).start()
    yield server
    server.stop()
    server.engine.shutdown()


def get(live: LiveServer, path: str, **kw: object) -> httpx.Response:
    return httpx.get(live.url + path, timeout=60, **kw)  # type: ignore[arg-type]


def post(live: LiveServer, path: str, body: object, auth: bool = True) -> httpx.Response:
    return httpx.post(live.url + path, json=body, headers=AUTH if auth else {}, timeout=60)


def test_version_and_health_generate_are_open(live: LiveServer) -> None:
    r = get(live, "/version")
    assert r.status_code == 200 and r.json() == {"version": replaykv.__version__}
    r = get(live, "/health_generate")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "model": live.engine.model_name}


def test_model_and_server_info_need_a_key_and_redact_secrets(live: LiveServer) -> None:
    for path in ("/get_model_info", "/get_server_info"):
        r = get(live, path)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    info = get(live, "/get_model_info", headers=AUTH).json()
    assert info["served_model_name"] == live.engine.model_name
    assert info["max_model_len"] == live.engine.max_context and info["is_generation"] is True
    assert info["vocab_size"] > 256
    server = get(live, "/get_server_info", headers=AUTH)
    assert server.status_code == 200
    text, args = server.text, server.json()
    assert KEY not in text and "adm-secret" not in text and "hunter2" not in text, text
    assert args["api_keys"] == 1 and args["admin_endpoints"] is True
    assert args["redis_url"] == "redis://:***@127.0.0.1:1/0"
    assert args["enable_encoder_swa_bounded_replay"] is False
    assert args["enable_decoder_swa_bounded_replay"] is False
    assert args["preset"] == "tiny" and args["version"] == replaykv.__version__
    assert args["served_model_name"] == live.engine.model_name and args["max_model_len"] == live.engine.max_context


def test_tokenize_detokenize_round_trip_single_and_batch(live: LiveServer) -> None:
    assert post(live, "/tokenize", {"prompt": "hi"}, auth=False).status_code == 401
    assert post(live, "/detokenize", {"tokens": [1]}, auth=False).status_code == 401
    text = "Sliding windows keep 128 tokens."
    one = post(live, "/tokenize", {"prompt": text})
    assert one.status_code == 200, one.text
    body = one.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == live.engine.max_context
    bare = post(live, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert body["tokens"] == [body["tokens"][0], *bare["tokens"]] and bare["count"] == body["count"] - 1
    back = post(live, "/detokenize", {"tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"text": text}

    texts = ["one", "two words", ""]
    batch = post(live, "/tokenize", {"prompt": texts, "add_special_tokens": False}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]] and batch["count"][2] == 0
    single = [post(live, "/tokenize", {"prompt": t, "add_special_tokens": False}).json()["tokens"] for t in texts]
    assert batch["tokens"] == single
    assert post(live, "/detokenize", {"tokens": batch["tokens"]}).json() == {"text": texts}
    assert post(live, "/detokenize", {"tokens": []}).json() == {"text": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/detokenize", {"tokens": [10**6]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": [[1], [10**6]]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "stray": 1}, 400, "stray"),
        ("/tokenize", {"prompt": "x", "model": "not-this-one"}, 404, "not-this-one"),
        ("/detokenize", {"tokens": [1], "model": "not-this-one"}, 404, "not-this-one"),
    ],
)
def test_bad_input_is_a_4xx_with_a_message(live: LiveServer, path: str, body: object, status: int, needle: str) -> None:
    r = post(live, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"] + str(r.json()["error"]["param"]), r.text


def test_the_named_model_is_accepted(live: LiveServer) -> None:
    r = post(live, "/tokenize", {"prompt": "x", "model": live.engine.model_name})
    assert r.status_code == 200, r.text


def test_health_generate_is_503_and_logged_when_the_engine_cannot_generate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(["--preset", "tiny", "--cache-dir", str(tmp_path)], environ={})
    engine = Engine(settings.engine_config())
    server = LiveServer(engine, settings.server()).start()
    try:
        assert get(server, "/health_generate").status_code == 200
        engine.shutdown()
        with caplog.at_level("WARNING", logger="replaykv.server"):
            r = get(server, "/health_generate")
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "unhealthy" and "not running" in r.json()["error"]
        assert any("did not generate a token" in m for m in caplog.messages), caplog.messages
    finally:
        server.stop()
