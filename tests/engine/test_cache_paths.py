"""Multi-turn conversations through the cache ledgers: a full hit continues exactly where the
last turn ended, a flushed SWA pool makes the next turn replay (bounded), tenants never share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replaykv.engine import Engine, Request, Result, SamplingParams
from tests.engine.conftest import make_engine, prompt_of
from tests.test_replay_reference import NaiveConversation

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
NEW_TOKENS = (19, 7, 6)  # user tokens added by each turn


@pytest.fixture(scope="module")
def cached_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """All three ledgers on, decoder replay off (a hit then equals a cold prefill)."""
    engine = make_engine(tmp_path_factory.mktemp("cache"), enable_decoder_swa_bounded_replay=False)
    yield engine
    engine.shutdown()


def converse(
    engine: Engine, seed: int, flush_pool: bool = False, prompts: list[list[int]] | None = None
) -> list[Result]:
    """Three turns: each prompt is the previous prompt + its output + new user tokens."""
    prompt: list[int] = []
    results = []
    for turn, new in enumerate(NEW_TOKENS):
        prompt = prompt + prompt_of(seed * 10 + turn, new)
        if prompts is not None:
            prompts.append(prompt)
        results.append(engine.generate(Request(tuple(prompt), PARAMS)))
        prompt = prompt + results[-1].token_ids
        engine.flush_writeback()  # the next turn should find this one's write-back
        if flush_pool:
            engine.flush_swa_pool()
    return results


def test_three_turns_hit_and_equal_cold(cached_engine: Engine, cold_engine: Engine) -> None:
    warm = converse(cached_engine, seed=1)
    cold = converse(cold_engine, seed=1)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    first = warm[0].accounting
    assert first is not None and first.path == "cold" and first.cached_tokens == 0
    for r, new in zip(warm[1:], NEW_TOKENS[1:], strict=True):
        acc = r.accounting
        assert acc is not None
        assert acc.path == "hit" and acc.snapshot_hit and acc.replayed_tokens == 0
        # the previous turn's prompt and all of its output but the last token were processed
        assert acc.cached_tokens == acc.prompt_tokens - new - 1
        assert acc.prefill_work < acc.full_prefill_work
    assert cached_engine.cache is not None
    cached_engine.cache.check_integrity()


def test_flushed_pool_takes_bounded_replay(tmp_path: Path) -> None:
    """Encoder and decoder replay on: the replayed rows and the decoder tail run in pieces, and
    every token of every turn is what a naive layer-by-layer reference of the same conversation
    (tests/test_replay_reference.py: one view across turns, each snapshot lost) picks."""
    engine = make_engine(
        tmp_path, enable_encoder_swa_bounded_replay=True, enable_decoder_swa_bounded_replay=True
    )
    prompts: list[list[int]] = []
    try:
        results = converse(engine, seed=2, flush_pool=True, prompts=prompts)
    finally:
        engine.shutdown()
    reference = NaiveConversation(engine.model, len(prompts[-1]) + PARAMS.max_tokens)
    cut = 0
    for turn, (prompt, r) in enumerate(zip(prompts, results, strict=True)):
        acc = r.accounting
        assert acc is not None and len(r.token_ids) == PARAMS.max_tokens
        if turn:
            assert acc.path == "bounded" and not acc.snapshot_hit
            assert acc.replayed_tokens == 8  # one window (W = 8) below the hit
            assert any("snapshot" in reason for reason in acc.reasons)
            # the hit is everything the last turn computed: its prompt and its output but the last token
            assert acc.cached_tokens == cut
        assert r.token_ids == reference.turn(prompt, acc.cached_tokens, PARAMS.max_tokens), f"turn {turn}"
        cut = len(prompt) + len(r.token_ids) - 1


def test_tenants_do_not_share(cached_engine: Engine) -> None:
    prompt = prompt_of(30, 21)
    first = cached_engine.generate(Request(tuple(prompt), PARAMS, salt=b"tenant-a"))
    cached_engine.flush_writeback()
    follow = tuple(prompt + first.token_ids + prompt_of(31, 5))
    same = cached_engine.generate(Request(follow, PARAMS, salt=b"tenant-a"))
    other = cached_engine.generate(Request(follow, PARAMS, salt=b"tenant-b"))
    assert same.accounting is not None and same.accounting.cached_tokens > 0
    assert same.accounting.path == "hit"
    assert other.accounting is not None and other.accounting.cached_tokens == 0
    assert other.accounting.path == "cold"
    assert same.token_ids == other.token_ids  # decoder replay off: a hit equals a cold prefill


@pytest.mark.parametrize("strategy", ["exact", "truncate", "full"])
def test_other_miss_strategies_equal_cold(tmp_path: Path, cold_engine: Engine, strategy: str) -> None:
    """Decoder replay off: exact rebuilds the snapshot's state (one segment per layer, run in
    pieces), truncate without an earlier snapshot and full recompute: all equal a cold prefill."""
    engine = make_engine(tmp_path, enable_decoder_swa_bounded_replay=False, swa_miss_strategy=strategy)
    try:
        warm = converse(engine, seed=3, flush_pool=True)
    finally:
        engine.shutdown()
    cold = converse(cold_engine, seed=3)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    for r in warm[1:]:
        acc = r.accounting
        assert acc is not None and acc.path == strategy and not acc.snapshot_hit
        assert (acc.cached_tokens > 0) == (strategy == "exact")
