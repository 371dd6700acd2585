"""Fixtures of the server tests: a live uvicorn server on a free loopback port, in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from replaykv.engine.api import EngineAPI
from replaykv.server import bind, create_app
from replaykv.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine

ALICE, BOB, ADMIN = "key-alice", "key-bob", "admin-secret"


class LiveServer:
    """`create_app(engine, settings)` served by uvicorn on 127.0.0.1:<free port> until `stop`."""

    def __init__(self, engine: EngineAPI, settings: ServerSettings) -> None:
        self.engine = engine
        self.app = create_app(engine, settings)
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def auth_settings(**kw: Any) -> ServerSettings:
    return ServerSettings(api_keys={ALICE: "alice", BOB: "bob"}, admin_key=ADMIN, **kw)


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(fake: FakeEngine) -> Iterator[LiveServer]:
    """A server with two tenants' API keys and an admin key over the fake engine."""
    with LiveServer(fake, auth_settings()) as live:
        yield live


@pytest.fixture
def live(server: LiveServer, fake: FakeEngine) -> LiveServer:
    fake.reset()
    return server
