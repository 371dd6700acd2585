"""``replaykv route`` (sgl-router) in front of two live replicas (tiny preset, real engines):
a conversation's turns stay on the replica holding its window snapshot, streams pass through,
and when that replica goes away the next turn is answered by the other one, unchanged."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
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

REPO = Path(__file__).resolve().parents[2]
REPLAY_OFF = ["--disable-encoder-swa-bounded-replay", "--disable-decoder-swa-bounded-replay"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def replica(tmp: Path) -> LiveServer:
    settings = load_settings(["--preset", "tiny", "--cache-dir", str(tmp), *REPLAY_OFF], environ={})
    return LiveServer(Engine(settings.engine_config()), settings.server()).start()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[str, list[LiveServer]]]:
    replicas = [replica(tmp_path / "a"), replica(tmp_path / "b")]
    port = free_port()
    cmd = [sys.executable, "-c", "from replaykv.cli import main; raise SystemExit(main())", "route", "--port", str(port), "--metrics-port", str(free_port()),
           "--health-check-interval", "30", "--log-level", "warn",
           *(arg for r in replicas for arg in ("--replica", r.url))]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    router = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a hang guard
        while True:
            assert router.poll() is None, router.stdout.read().decode()[-3000:] if router.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the router did not come up"
            time.sleep(0.2)
        yield url, replicas
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(router.pid, signal.SIGKILL)
        router.wait(30)
        for r in replicas:
            r.stop()
            r.engine.shutdown()


def chat(url: str, messages: list[Any], **kw: Any) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model="tiny-random-seed0", messages=messages, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True}, **kw,
    )  # fmt: skip


def served(replicas: list[LiveServer]) -> list[int]:
    return [r.engine.metrics.submitted.value for r in replicas]  # type: ignore[attr-defined]


def test_turns_stay_on_their_replica_and_move_when_it_fails(routed: tuple[str, list[LiveServer]]) -> None:
    url, replicas = routed
    messages: list[Any] = [{"role": "user", "content": "What does a sliding window keep? " * 4}]
    answers = []
    for turn in range(3):
        r = chat(url, messages)
        answers.append(r)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And then, part {turn}?"}]  # fmt: skip
        if turn:  # the turn found the last one's global KV and window snapshot: the same replica
            ext = r.usage.model_extra["replaykv"]
            assert ext["path"] == "hit" and ext["snapshot_hit"], ext
    counts = served(replicas)
    assert sorted(counts) == [0, 3], counts
    home = counts.index(3)
    streamed = list(chat(url, messages, stream=True))  # streams pass through
    assert any(c.choices and c.choices[0].delta.content for c in streamed)
    replicas[home].stop()
    # the next request itself finds the replica gone: its circuit opens, the retry goes elsewhere
    moved = chat(url, messages)
    assert served(replicas)[1 - home] == 1
    cold = replicas[1 - home].engine  # the other replica answers cold; replay off: equal to a hit
    direct = LiveServer(cold, load_settings(["--preset", "tiny"], environ={}).server()).start()
    try:
        again = chat(direct.url, messages)
    finally:
        direct.stop()
    assert moved.choices[0].message.content == again.choices[0].message.content
