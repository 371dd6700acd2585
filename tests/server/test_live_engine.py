"""The server over the real engine (preset 'tiny', random weights, CPU): multi-turn cache hits,
replay off equals a cold server token for token, bounded replay after a pool flush, engine-side
errors as 4xx, and the `replaykv serve` command itself."""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from replaykv.engine.engine import Engine
from replaykv.server.settings import load_settings
from tests.server.conftest import LiveServer
from tests.server.test_api import parse_prometheus

REPO = Path(__file__).resolve().parents[2]
REPLAY_OFF = ["--disable-encoder-swa-bounded-replay", "--disable-decoder-swa-bounded-replay"]
REPLAY_ON = ["--enable-encoder-swa-bounded-replay", "--enable-decoder-swa-bounded-replay"]
QUESTIONS = ["What does a sliding window keep?", "And the global KV?", "Why replay 128 tokens?"]


def start(tmp: Path, *flags: str) -> LiveServer:
    settings = load_settings(["--preset", "tiny", "--cache-dir", str(tmp), *flags], environ={})
    return LiveServer(Engine(settings.engine_config()), settings.server()).start()


def stop(live: LiveServer) -> None:
    live.stop()
    live.engine.shutdown()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[LiveServer]]:
    started: list[LiveServer] = []
    yield started
    for live in started:
        stop(live)


def chat(live: LiveServer, key: str, messages: list[Any], **kw: Any) -> Any:
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=60)
    return c.chat.completions.create(
        model=live.engine.model_name,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
        **kw,
    )


def test_three_turns_hit_and_equal_a_cold_server(tmp_path: Path, servers: list[LiveServer]) -> None:
    warm = start(tmp_path / "warm", *REPLAY_OFF, "--api-key", "ka=alice", "--api-key", "kb=bob")
    servers.append(warm)
    messages: list[Any] = [{"role": "system", "content": "Answer briefly."}]
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        r = chat(warm, "ka", messages)
        turns.append((list(messages), r))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    cached = [r.usage.prompt_tokens_details.cached_tokens for _, r in turns]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached
    assert [r.usage.model_extra["replaykv"]["replayed_tokens"] for _, r in turns] == [0, 0, 0]
    # the paired check: another tenant sending alice's turn-2 prompt does not hit
    other = chat(warm, "kb", turns[1][0])
    assert other.usage.prompt_tokens_details.cached_tokens == 0

    # a cold server: a fresh engine and store, each turn under a tenant of its own (never a hit)
    cold = start(tmp_path / "cold", *REPLAY_OFF, *[f"--api-key=k{i}=t{i}" for i in range(3)])
    servers.append(cold)
    for i, (prompt, r) in enumerate(turns):
        c = chat(cold, f"k{i}", prompt)
        assert c.usage.prompt_tokens_details.cached_tokens == 0
        assert c.choices[0].model_extra["token_ids"] == r.choices[0].model_extra["token_ids"], f"turn {i + 1}"
        assert c.choices[0].message.content == r.choices[0].message.content
        assert c.usage.prompt_tokens == r.usage.prompt_tokens
    assert other.choices[0].model_extra["token_ids"] == turns[1][1].choices[0].model_extra["token_ids"]


def test_bounded_replay_after_a_pool_flush_and_streaming(tmp_path: Path, servers: list[LiveServer]) -> None:
    live = start(tmp_path, "--admin-key", "adm", *REPLAY_ON)
    servers.append(live)
    messages: list[Any] = [{"role": "user", "content": "Tell me about windows, " * 3}]
    first = chat(live, "x", messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "go on"},
    ]
    r = httpx.post(f"{live.url}/admin/flush_swa_pool", headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200
    second = chat(live, "x", messages)
    ext = second.usage.model_extra["replaykv"]
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert ext["path"] == "bounded" and ext["replayed_tokens"] > 0 and not ext["snapshot_hit"], ext
    whole = chat(live, "x", messages)
    chunks = list(chat(live, "x", messages, stream=True, stream_options={"include_usage": True}))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    assert streamed == whole.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    stats = httpx.get(f"{live.url}/admin/cache_stats", headers={"Authorization": "Bearer adm"})
    assert stats.status_code == 200 and stats.json()["caching"] is True
    samples = parse_prometheus(httpx.get(f"{live.url}/metrics").text)
    assert (
        samples['replaykv_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}'] >= 4
    )


def test_engine_side_errors_are_4xx(tmp_path: Path, servers: list[LiveServer]) -> None:
    live = start(
        tmp_path, "--context-length", "64", "--max-running-requests", "1", "--max-queued-requests", "1"
    )
    servers.append(live)
    name = live.engine.model_name

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{live.url}/v1/completions", json={"model": name, **body}, timeout=60)

    r = post({"prompt": [1, 2, 512], "max_tokens": 2})  # 512 = the tiny model's vocabulary size
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]
    assert post({"prompt": "x" * 70}).status_code == 400
    assert post({"prompt": "x" * 40, "max_tokens": 30}).status_code == 400
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: post({"prompt": "hi", "max_tokens": 40}), range(4)))
    busy = [c for c in codes if c.status_code == 429]
    assert busy and all(c.headers["Retry-After"].isdigit() for c in busy), [c.status_code for c in codes]
    assert all(c.status_code in (200, 429) for c in codes)


def test_serve_command(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "replaykv",
        "serve",
        "--preset",
        "tiny",
        "--port",
        "0",
        "--cache-dir",
        str(tmp_path),
        "--api-key",
        "k1=alice",
        "--admin-key",
        "adm",
        "--log-level",
        "warning",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAYKV_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
    )
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "print(r.choices[0].message.content" in line:
                break
        out = "".join(lines)
        assert "RANDOM weights" in out and "preset 'tiny'" in out, out
        assert (
            "encoder bounded replay off (default; --enable-encoder-swa-bounded-replay to turn it on), "
            "decoder bounded replay off (default; --enable-decoder-swa-bounded-replay to turn it on)"
        ) in out, out
        m = re.search(r"serving at (http://127\.0\.0\.1:\d+)", out)
        assert m, out
        url = m.group(1)
        assert f"curl {url}/v1/chat/completions" in out and "Bearer YOUR_API_KEY" in out
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=60)
        # Random weights may draw the end-of-text token early; ignore_eos keeps the count exact.
        r = c.completions.create(
            model="tiny-random-seed0",
            prompt="Hello",
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="k2", max_retries=0).models.list()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_logprobs_match_the_engine_and_streaming(tmp_path: Path, servers: list[LiveServer]) -> None:
    live = start(tmp_path / "lp", *REPLAY_OFF)
    servers.append(live)
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = [256, *b"The window keeps the last tokens; the global KV keeps the rest."]
    kw: dict[str, Any] = {"model": live.engine.model_name, "max_tokens": 6, "temperature": 0}
    r = c.completions.create(prompt=prompt, logprobs=5, extra_body={"return_token_ids": True}, **kw)
    lp = r.choices[0].logprobs
    ids = r.choices[0].model_extra["token_ids"]
    assert lp is not None and len(lp.tokens) == len(ids) == len(lp.token_logprobs) == 6
    tok = live.engine.tokenizer
    for i, chosen, top in zip(ids, lp.token_logprobs, lp.top_logprobs or [], strict=True):
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one, with its own logprob
        assert next(iter(top)) == tok.token_text(i) and chosen == pytest.approx(values[0])
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
    # the engine's own values for the same request
    from replaykv.engine.api import Request, SamplingParams

    res = live.engine.generate(
        Request(tuple(prompt), SamplingParams(max_tokens=6, temperature=0, logprobs=5))
    )
    assert [x.token_id for x in res.logprobs] == ids
    assert [x.logprob for x in res.logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    # streamed chunks carry the same logprobs
    streamed: list[float] = []
    for ch in c.completions.create(prompt=prompt, logprobs=5, stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.token_logprobs or []
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    # chat: logprobs + top_logprobs, and no logprobs unless asked
    msgs: list[Any] = [{"role": "user", "content": "Which tokens does bounded replay run?"}]
    rc = c.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **kw)
    content = rc.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:
        assert t.bytes and (len(t.bytes) > 1 or tok.token_text(t.bytes[0]) == t.token)
    assert c.chat.completions.create(messages=msgs, **kw).choices[0].logprobs is None


def test_a_bare_api_key_does_not_share_the_unauthenticated_tenant(
    tmp_path: Path, servers: list[LiveServer]
) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell me about sliding windows. " * 10}]
    cache = tmp_path / "cache"
    open_run = start(cache)
    first = chat(open_run, "anything", messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert chat(open_run, "anything", messages).usage.prompt_tokens_details.cached_tokens > 0
    stop(open_run)
    keyed = start(cache, "--api-key", "solo")
    servers.append(keyed)
    assert chat(keyed, "solo", messages).usage.prompt_tokens_details.cached_tokens == 0
    assert chat(keyed, "solo", messages).usage.prompt_tokens_details.cached_tokens > 0
    servers.remove(keyed)
    stop(keyed)
    shared = start(cache, "--api-key", "solo=default")
    servers.append(shared)
    assert chat(shared, "solo", messages).usage.prompt_tokens_details.cached_tokens > 0
