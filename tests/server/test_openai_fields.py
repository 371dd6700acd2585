"""The OpenAI request fields agent frameworks send: n, best_of, echo, penalties, min_p, logit
bias, tools and tool_choice, response_format, and the fields accepted without effect; each
through the official client against the live server (fake engine), plus the tool format's own
rules."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx2 as httpx
import pytest

from replaykv.server.tools import Function, call_text, forced_opening, parse_calls, system_line, with_tools
from tests.server.conftest import ALICE, LiveServer
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import MODEL, TOK, client, post

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a key up",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
FN = [Function("lookup", ("key",))]
USER = [{"role": "user", "content": "What is the value of abc?"}]


def test_the_tools_line_is_the_trained_one() -> None:
    # replaykv/train/tasks.py, the tool task: the system line the model learnt
    assert system_line(FN) == 'Tools: lookup(key) returns JSON. Call it as {"tool": "lookup", "key": K}.'
    assert with_tools([("user", "q")], FN)[0] == ("system", system_line(FN))
    assert with_tools([("system", "Be brief."), ("user", "q")], FN)[0] == ("system", system_line(FN) + "\nBe brief.")
    assert call_text("lookup", '{"key": "abc"}') == '{"tool": "lookup", "key": "abc"}'
    with pytest.raises(ValueError, match="not JSON"):
        call_text("lookup", "{oops")


def test_parse_calls() -> None:
    one = parse_calls(' {"tool": "lookup", "key": "abc"}', FN)
    assert one is not None and one[0]["function"] == {"name": "lookup", "arguments": '{"key": "abc"}'}
    assert one[0]["type"] == "function" and one[0]["id"].startswith("call_")
    two = '{"tool": "lookup", "key": "a"}\n{"tool": "lookup", "key": "b"}'
    assert len(parse_calls(two, FN) or []) == 2 and len(parse_calls(two, FN, parallel=False) or []) == 1
    for text in ("4711", '{"tool": "other", "key": "a"}', '{"tool": "lookup", "key": "a"} and more', "", "[1]"):
        assert parse_calls(text, FN) is None, text
    assert forced_opening("required", FN) == '{"tool": "lookup", '
    assert forced_opening("auto", FN) == "" and forced_opening("none", FN) == ""
    assert forced_opening("required", [*FN, Function("add", ("a", "b"))]) == '{"tool": "'


def test_n_choices_with_seeds(live: LiveServer, fake: FakeEngine) -> None:
    r = client(live).completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=3, seed=10)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [q.sampling.seed for q in fake.requests] == [10, 11, 12]
    assert r.usage is not None and r.usage.completion_tokens == 15 and r.usage.prompt_tokens == 6
    assert len(r.usage.model_extra["replaykv"]["choices"]) == 3  # type: ignore[index]
    chat = client(live).chat.completions.create(model=MODEL, messages=USER, max_tokens=8, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
    stream = list(client(live).chat.completions.create(model=MODEL, messages=USER, max_tokens=8, n=2, stream=True))
    got = {i: "".join(c.choices[0].delta.content or "" for c in stream if c.choices and c.choices[0].index == i)
           for i in (0, 1)}  # fmt: skip
    assert got == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    finishes = [c.choices[0] for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1]


def test_best_of_ranks_by_mean_logprob(live: LiveServer, fake: FakeEngine) -> None:
    r = post(live, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "best_of": 3, "n": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and len(fake.requests) == 3
    assert all(q.sampling.logprobs == 0 for q in fake.requests)  # asked for, to rank by
    assert r.json()["choices"][0]["logprobs"] is None  # not returned: the client did not ask
    assert r.json()["usage"]["completion_tokens"] == 12  # every candidate counts


def test_echo(live: LiveServer, fake: FakeEngine) -> None:
    r = client(live).completions.create(model=MODEL, prompt="Hello", max_tokens=5, echo=True)
    assert r.choices[0].text == "Hello" + "ok 6 "
    ids = TOK.encode("Hey")
    s = list(client(live).completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, stream=True))
    assert s[0].choices[0].text == "Hey" and "".join(c.choices[0].text for c in s) == "Hey" + "ok 3 "


def test_sampling_fields_reach_the_engine(live: LiveServer, fake: FakeEngine) -> None:
    client(live).chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"65": 5.0, "66": -100},
        extra_body={"min_p": 0.05, "repetition_penalty": 1.2},
    )
    sp = fake.requests[-1].sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.repetition_penalty) == (0.5, -0.5, 0.05, 1.2)
    assert sp.logit_bias == ((65, 5.0), (66, -100.0))


def test_ignored_fields_are_accepted_and_named(
    live: LiveServer, fake: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, "store": True, "metadata": {"run": "7"},
            "user": "u1", "service_tier": "auto", "parallel_tool_calls": False}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="replaykv.server"):
        r = post(live, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.headers["x-replaykv-ignored-fields"] == "store, metadata, service_tier, user"
    assert any("accepted without effect: store, metadata, service_tier, user" in m for m in caplog.messages)


def test_tool_call_round_trip(live: LiveServer, fake: FakeEngine) -> None:
    fake.reply = b'{"tool": "lookup", "key": "abc"}'
    r = client(live).chat.completions.create(model=MODEL, messages=USER, tools=[LOOKUP], max_tokens=40)  # type: ignore[list-item]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"key": "abc"}  # type: ignore[union-attr]
    prompt = TOK.decode(list(fake.requests[-1].prompt_ids))
    assert 'Tools: lookup(key) returns JSON. Call it as {"tool": "lookup", "key": K}.' in prompt
    # the next turn: the call and its result rendered as the model was trained
    fake.reply = b"4711"
    history: list[Any] = [*USER, choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"abc": 4711}'}]  # fmt: skip
    again = client(live).chat.completions.create(model=MODEL, messages=history, tools=[LOOKUP], max_tokens=40)  # type: ignore[list-item]
    assert again.choices[0].message.content == "4711" and again.choices[0].finish_reason == "stop"
    prompt = TOK.decode(list(fake.requests[-1].prompt_ids))
    assert '{"tool": "lookup", "key": "abc"}' in prompt and '{"abc": 4711}' in prompt


def test_tool_call_streamed_and_forced(live: LiveServer, fake: FakeEngine) -> None:
    fake.reply = b'{"tool": "lookup", "key": "abc"}'
    chunks = list(client(live).chat.completions.create(
        model=MODEL, messages=USER, tools=[LOOKUP], max_tokens=40, stream=True))  # type: ignore[list-item]  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)  # held back, then sent as a call
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].function is not None and calls[0].function.name == "lookup"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # plain text is streamed as soon as it cannot be a call
    fake.reply = b"no call needed"
    text = list(client(live).chat.completions.create(
        model=MODEL, messages=USER, tools=[LOOKUP], max_tokens=40, stream=True))  # type: ignore[list-item]  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in text if c.choices) == "no call needed"
    # tool_choice required: the answer starts with the call's opening, the model writes the rest
    fake.reply = b'"key": "xyz"}'
    forced = client(live).chat.completions.create(
        model=MODEL, messages=USER, tools=[LOOKUP], tool_choice="required", max_tokens=40)  # type: ignore[list-item]  # fmt: skip
    opening = [TOK.special_ids["<|assistant|>"], *TOK.encode('{"tool": "lookup", ')]
    assert list(fake.requests[-1].prompt_ids[-len(opening) :]) == opening
    (call,) = forced.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"key": "xyz"}  # type: ignore[union-attr]
    # tool_choice none: the text stays text
    fake.reply = b'{"tool": "lookup", "key": "abc"}'
    off = client(live).chat.completions.create(
        model=MODEL, messages=USER, tools=[LOOKUP], tool_choice="none", max_tokens=40)  # type: ignore[list-item]  # fmt: skip
    assert off.choices[0].message.content == '{"tool": "lookup", "key": "abc"}'


def test_response_format_is_checked_and_reported(live: LiveServer, fake: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": schema}}
    for reply, valid in ((b'{"year": 1999}', True), (b'{"year": "x"}', False), (b"not json", False)):
        fake.reply = reply
        r = post(live, "/v1/chat/completions", {"model": MODEL, "messages": USER, "response_format": fmt})
        assert r.status_code == 200, r.text
        (report,) = r.json()["usage"]["replaykv"]["response_format"]
        assert report["valid"] is valid and report["type"] == "json_schema" and (report["error"] is None) == valid
    fake.reply = b"[1, 2]"
    r = post(live, "/v1/chat/completions", {"model": MODEL, "messages": USER, "response_format": {"type": "json_object"}})
    assert r.json()["usage"]["replaykv"]["response_format"][0]["error"] == "JSON list, not an object"


# The bodies sgl-router 0.3.2 (`python -m sglang_router.launch_router --policy cache_aware`)
# forwarded to a worker for `{"model", "messages", "max_tokens": 4}` and `{"model", "prompt",
# "max_tokens": 4}`: it re-serialises every request with SGLang's extension fields.
ROUTED_CHAT = {
    "messages": USER, "model": MODEL, "logprobs": False, "max_completion_tokens": 4, "stream": False,
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
    "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
}  # fmt: skip
ROUTED_COMPLETION = {
    "model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False, "no_stop_trim": False,
    "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
}  # fmt: skip


def test_what_sgl_router_forwards_is_served(live: LiveServer, fake: FakeEngine) -> None:
    for path, body in (("/v1/chat/completions", ROUTED_CHAT), ("/v1/completions", ROUTED_COMPLETION)):
        r = post(live, path, body)
        assert r.status_code == 200, r.text
        assert "X-Replaykv-Ignored-Fields" not in r.headers
    assert not fake.requests[-1].sampling.no_stop_trim
    r = post(live, "/v1/completions", {**ROUTED_COMPLETION, "no_stop_trim": True})
    assert r.status_code == 200 and fake.requests[-1].sampling.no_stop_trim
    for path, body, field in (
        ("/v1/completions", {**ROUTED_COMPLETION, "skip_special_tokens": False}, "skip_special_tokens"),
        ("/v1/completions", {**ROUTED_COMPLETION, "return_hidden_states": True}, "return_hidden_states"),
        ("/v1/chat/completions", {**ROUTED_CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {**ROUTED_CHAT, "chat_template_kwargs": {"enable_thinking": True}},
         "chat_template_kwargs"),
    ):  # fmt: skip
        r = post(live, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "not supported" in r.json()["error"]["message"]
    headers = {"Authorization": f"Bearer {ALICE}"}
    for path in ("/model_info", "/server_info"):  # the names sgl-router asks for at start-up
        r = httpx.get(live.url + path, headers=headers, timeout=10)
        assert r.status_code == 200, (path, r.text)
    assert httpx.get(live.url + "/model_info", headers=headers, timeout=10).json()["is_generation"] is True
