"""Admission control, request validation, configuration validation and cancellation."""

from __future__ import annotations

import time

import pytest
import torch

import replaykv.engine.engine as engine_module
from replaykv.engine import (
    Engine,
    EngineConfig,
    EngineError,
    InvalidRequest,
    QueueFull,
    Request,
    SamplingParams,
)
from replaykv.replay import ReplayFlags
from tests.engine.conftest import NO_CACHE, make_engine, prompt_of

LONG = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def wait_until(condition, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_queue_full_then_cancel_frees_slots() -> None:
    engine = make_engine(max_batch=1, max_queue=1)
    try:
        running = engine.submit(Request(tuple(prompt_of(1, 6)), LONG))
        next(iter(running))  # admitted and decoding
        waiting = engine.submit(Request(tuple(prompt_of(2, 6)), LONG))
        with pytest.raises(QueueFull, match="max_queue 1") as info:
            engine.submit(Request(tuple(prompt_of(3, 6)), SHORT))
        assert info.value.retry_after_s > 0 and info.value.status == 429
        assert engine.queue_depth() == 1 and engine.running() == 1

        waiting.cancel()  # never admitted
        running.cancel()  # holds the only slot
        assert waiting.result(timeout=30).finish_reason == "cancelled"
        stopped = running.result(timeout=30)
        assert stopped.finish_reason == "cancelled" and 1 <= len(stopped.token_ids) < 60
        wait_until(lambda: engine.running() == 0)
        done = engine.generate(Request(tuple(prompt_of(3, 6)), SHORT))  # the slot is free again
        assert done.finish_reason == "length" and len(done.token_ids) == 2
        assert 'replaykv_requests_rejected_total{reason="queue_full"} 1.0' in engine.metrics_text()
    finally:
        engine.shutdown()


def test_cancel_after_admission_and_row_reuse(cold_engine: Engine) -> None:
    """Cancelled while it holds a slot (usually still prefilling: 30 rows at 5 per step)."""
    handle = cold_engine.submit(Request(tuple(prompt_of(4, 30)), LONG))
    wait_until(lambda: cold_engine.running() == 1)
    handle.cancel()
    assert handle.result(timeout=30).finish_reason == "cancelled"
    wait_until(lambda: cold_engine.running() == 0)
    again = cold_engine.generate(Request(tuple(prompt_of(5, 7)), SHORT))
    assert again.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ((), SHORT, "prompt is empty"),
        ((1, 512), SHORT, r"token ids must be integers in \[0, 512\)"),
        ((1, -3), SHORT, "token ids"),
        (
            tuple(range(90)),
            SamplingParams(max_tokens=10),
            r"at most 86 fit \(max_context 96 - max_tokens 10\)",
        ),
        ((1, 2), SamplingParams(max_tokens=0), "max_tokens"),
        ((1, 2), SamplingParams(temperature=-1.0), "temperature"),
        ((1, 2), SamplingParams(top_p=0.0), "top_p"),
        ((1, 2), SamplingParams(top_k=-1), "top_k"),
        ((1, 2), SamplingParams(stop=("",)), "stop strings"),
        ((1, 2), SamplingParams(stop_token_ids=(600,)), "stop_token_ids"),
    ],
)
def test_invalid_requests(
    cold_engine: Engine, prompt: tuple[int, ...], sampling: SamplingParams, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        cold_engine.submit(Request(prompt, sampling))
    assert info.value.status == 400


def test_prompt_logprobs_with_decoder_replay(cold_engine: Engine) -> None:
    on = ReplayFlags(enable_decoder_swa_bounded_replay=True)
    with pytest.raises(InvalidRequest, match="--enable-decoder-swa-bounded-replay"):
        cold_engine.submit(Request((1, 2, 3), SHORT, replay=on, prompt_logprobs=True))
    # with the fallback the request runs the full path (decoder replay off)
    result = cold_engine.generate(
        Request(tuple(prompt_of(6, 20)), SHORT, replay=on, prompt_logprobs=True, full_path_fallback=True)
    )
    acc = result.accounting
    assert acc is not None and acc.prefill_work == acc.full_prefill_work


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(speculative_decoding=True), "speculative decoding"),
        (dict(swa_pool="disk"), "swa_pool must be one of"),
        (dict(swa_pool="redis"), "redis_url"),
        (dict(max_batch=0), "max_batch"),
        (dict(prefill_token_budget=0), "prefill_token_budget"),
        (dict(swa_miss_strategy="guess"), "swa_miss_strategy"),
        (dict(write_policy="v5"), "write_policy"),
        (dict(preset="nope"), "unknown preset"),
        (dict(dtype="int8"), "dtype"),
        (dict(model_dir="/nonexistent/model"), "not a directory"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"preset": "tiny", **NO_CACHE, **overrides})


def test_speculative_decoding_allowed_without_encoder_replay() -> None:
    cfg = EngineConfig(
        preset="tiny", speculative_decoding=True, enable_encoder_swa_bounded_replay=False, **NO_CACHE
    )
    assert cfg.speculative_decoding and not cfg.enable_encoder_swa_bounded_replay
    with pytest.raises(ValueError, match="speculative decoding"):  # the same with encoder replay on
        EngineConfig(
            preset="tiny", speculative_decoding=True, enable_encoder_swa_bounded_replay=True, **NO_CACHE
        )


def test_chunk_size_must_hold_whole_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="chunk_size"):
        make_engine(tmp_path, chunk_size=15)


def test_shutdown_ends_requests_in_flight() -> None:
    engine = make_engine(max_batch=1)
    running = engine.submit(Request(tuple(prompt_of(7, 6)), LONG))
    queued = engine.submit(Request(tuple(prompt_of(8, 6)), LONG))
    next(iter(running))
    engine.shutdown()
    assert running.result(timeout=30).finish_reason == "cancelled"
    assert queued.result(timeout=30).finish_reason == "cancelled"
    with pytest.raises(EngineError, match="not running"):
        engine.submit(Request((1, 2), SHORT))
    engine.shutdown()  # idempotent


def test_a_failing_request_does_not_stop_the_others(
    cold_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FailingSampler(engine_module.Sampler):
        def sample(self, logits: torch.Tensor) -> int:
            if self.params.seed == 666 and self.calls_made():
                raise RuntimeError("injected sampling fault")
            return super().sample(logits)

        def calls_made(self) -> bool:
            self.calls = getattr(self, "calls", 0) + 1
            return self.calls > 1  # the first token (end of prefill) is fine, decode fails

    monkeypatch.setattr(engine_module, "Sampler", FailingSampler)
    bad = cold_engine.submit(
        Request(tuple(prompt_of(9, 5)), SamplingParams(max_tokens=6, seed=666, ignore_eos=True))
    )
    good = cold_engine.submit(
        Request(tuple(prompt_of(10, 5)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    )
    with pytest.raises(EngineError, match="injected sampling fault"):
        bad.result(timeout=60)
    assert len(good.result(timeout=60).token_ids) == 6
    assert cold_engine.generate(Request((1, 2, 3), SHORT)).finish_reason == "length"
