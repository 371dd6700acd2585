"""Schema-driven fuzzing of both endpoints: bodies built from the request models' own fields
(valid values, near misses and arbitrary JSON, plus unknown fields and raw bytes) must never
get a 5xx, and every 4xx must be in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from replaykv.server.schemas import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import ALICE, LiveServer

MODEL = "fake-model"
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
TEXT = st.text(max_size=40)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]) | ANY_JSON},
    optional={
        "content": TEXT
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
        | ANY_JSON,
        "name": TEXT | ANY_JSON,
    },
)
TYPED: dict[str, st.SearchStrategy[Any]] = {  # plausible values per field; any field also gets ANY_JSON
    "model": st.just(MODEL),
    "prompt": TEXT | st.lists(st.integers(-3, 600), max_size=30),
    "messages": st.lists(MESSAGE, max_size=4),
    "max_tokens": st.integers(-3, 300),
    "max_completion_tokens": st.integers(-3, 300),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 100),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": TEXT | st.lists(TEXT, max_size=6),
    "seed": st.integers(-5, 2**64),
    "logprobs": st.none() | st.booleans() | st.integers(0, 5),
    "return_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
}


BASE = {
    CompletionRequest: {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    ChatCompletionRequest: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


def bodies(model: type[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies from the model's own fields: a valid body with some fields replaced (typed values or
    arbitrary JSON) or dropped, or a random subset of fields; now and then an unknown field."""
    fields = {name: TYPED.get(name, ANY_JSON) | ANY_JSON for name in model.model_fields}
    overlay = st.fixed_dictionaries({}, optional=fields)
    few = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names})
    )
    typed = st.fixed_dictionaries({}, optional={n: TYPED[n] for n in fields if n in TYPED and n != "model"})
    drop = st.sets(st.sampled_from(sorted(BASE[model])), max_size=1)
    mutated = st.tuples(few, drop).map(
        lambda t: {k: v for k, v in {**BASE[model], **t[0]}.items() if k not in t[1]}
    )
    plausible = typed.map(lambda b: {**BASE[model], **b})
    unknown = st.dictionaries(
        st.sampled_from(["cache_salt", "tools", "bogus"]) | st.text(max_size=6),
        ANY_JSON,
        min_size=1,
        max_size=1,
    )
    return st.one_of(
        plausible,
        mutated,
        overlay,
        st.tuples(mutated, unknown).map(lambda t: {**t[0], **t[1]}),
    )


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


def check(http: httpx.Client, path: str, content: bytes) -> None:
    r = http.post(path, content=content)
    event(f"status {r.status_code}")
    assert r.status_code < 500, (content[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    else:
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize(
    ("path", "model"),
    [("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)],
)
def test_fuzzed_bodies_never_5xx(http: httpx.Client, path: str, model: type[Any]) -> None:
    @FUZZ
    @given(body=bodies(model))
    def run(body: dict[str, Any]) -> None:
        check(http, path, json.dumps(body).encode())

    run()


@FUZZ
@given(raw=st.binary(max_size=80) | st.text(max_size=80).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_fuzzed_raw_bytes_never_5xx(http: httpx.Client, raw: bytes) -> None:
    check(http, "/v1/chat/completions", raw)


@pytest.mark.parametrize(
    ("path", "model"),
    [("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)],
)
def test_fuzzer_covers_the_openapi_spec(http: httpx.Client, path: str, model: type[Any]) -> None:
    """The fuzzed bodies are built from exactly the fields the served OpenAPI spec documents."""
    spec = http.get("/openapi.json").json()
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert set(schema["properties"]) == set(model.model_fields)
    assert schema.get("additionalProperties") is False  # unknown fields are refused, as fuzzed
