"""What the engine logs when things go wrong: a failing cache commit (one error line while it
persists, one warning on recovery; the requests themselves still answer) and a crashed engine
thread (one error line with the traceback; queued and later requests end with an error)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from replaykv.engine import Request, SamplingParams
from replaykv.engine.api import EngineError
from tests.engine.conftest import make_engine, prompt_of

LOGGER = "replaykv.engine.engine"


def run(engine: Any, seed: int) -> Any:
    return engine.submit(Request(prompt_of(seed, 20), SamplingParams(max_tokens=3, temperature=0.0))).result(60)


def test_a_failing_commit_is_logged_once_then_its_recovery(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tmp_path)
    try:
        real, fails = engine.cache.commit, [3]

        def flaky(*args: Any, **kw: Any) -> Any:
            if fails[0] > 0:
                fails[0] -= 1
                raise OSError(28, "No space left on device")
            return real(*args, **kw)

        engine.cache.commit = flaky
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            answers = [run(engine, s) for s in range(4)]
        assert all(len(a.token_ids) == 3 for a in answers)  # write-back is best effort
        assert fails == [0] and engine.metrics.commit_errors.value == 3
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, caplog.messages
        assert "committing a request's cache failed" in errors[0].getMessage()
        assert "No space left on device" in errors[0].getMessage()
        recovered = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(recovered) == 1 and "OSError" in recovered[0].getMessage(), caplog.messages
    finally:
        engine.shutdown()


def test_a_crashed_engine_thread_is_logged_and_requests_fail(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine()
    try:
        assert len(run(engine, 0).token_ids) == 3

        def broken() -> None:
            raise RuntimeError("a kernel failed")

        engine._step = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger=LOGGER), pytest.raises(EngineError, match="a kernel failed"):
            run(engine, 1)
        crash = [r for r in caplog.records if "the engine thread failed" in r.getMessage()]
        assert len(crash) == 1 and crash[0].exc_info is not None, caplog.messages
        assert "a kernel failed" in str(crash[0].exc_info[1])
        with pytest.raises(EngineError, match="not running"):
            run(engine, 2)
    finally:
        engine.shutdown()
