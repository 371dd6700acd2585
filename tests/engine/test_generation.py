"""Greedy generation through the engine against plain loops over the model: one request at a
time (chunked prefill, with and without decoder replay) and many at once (continuous batching,
row compaction, slot reuse)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replaykv.engine import Engine, EngineConfig, Request, SamplingParams, generate
from replaykv.engine.oneshot import greedy_generate
from replaykv.model.checkpoint import save_pretrained
from tests.engine.conftest import NO_CACHE, make_engine, prompt_of, reference_greedy

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_greedy_equals_plain_loop(cold_engine: Engine) -> None:
    for seed, n in ((1, 3), (2, 12), (3, 31)):
        prompt = prompt_of(seed, n)
        result = cold_engine.generate(Request(tuple(prompt), GREEDY))
        assert result.token_ids == greedy_generate(cold_engine.model, prompt, 5), (seed, n)
        assert result.finish_reason == "length"
        acc = result.accounting
        assert acc is not None and acc.path == "cold" and acc.cached_tokens == 0
        assert acc.prompt_tokens == n and acc.prefill_work == acc.full_prefill_work
        assert result.ttft_s > 0 and result.latency_s >= result.ttft_s


def test_decoder_replay_prefill_in_pieces_equals_one_piece() -> None:
    """With decoder replay on, the decoder segment (last W rows) is run in budget-sized pieces fed
    by kept encoder rows; it must give what the unchunked plan gives."""
    engine = make_engine(enable_decoder_swa_bounded_replay=True, prefill_token_budget=3)
    try:
        prompt = prompt_of(4, 23)
        result = engine.generate(Request(tuple(prompt), GREEDY))
        assert result.token_ids == reference_greedy(engine.model, prompt, 5, decoder_replay=True)
        acc = result.accounting
        assert acc is not None and acc.prefill_work < acc.full_prefill_work  # the decoder ran 8 rows
        assert acc.window_floors == (0, 23 - 8)
    finally:
        engine.shutdown()


def test_concurrent_requests_match_solo_runs(cold_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five requests of different lengths and budgets on three slots: admission as slots free,
    prefill pieces interleaved with batched decode steps at different positions, rows moved when
    requests finish. Each gets what it gets alone."""
    moves: list[str] = []

    def counting(name: str, original: Callable[[int, int], None]) -> Callable[[int, int], None]:
        def wrapper(a: int, b: int) -> None:
            moves.append(name)
            original(a, b)

        return wrapper

    for name in ("_move_row", "_swap_rows"):
        monkeypatch.setattr(cold_engine, name, counting(name, getattr(cold_engine, name)))
    cases = [(10, 17, 6), (11, 4, 3), (12, 29, 7), (13, 9, 2), (14, 22, 4)]
    handles = []
    for seed, n, max_tokens in cases:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        handles.append(cold_engine.submit(Request(tuple(prompt_of(seed, n)), params)))
    results = [h.result(timeout=120) for h in handles]
    for (seed, n, max_tokens), result in zip(cases, results, strict=True):
        alone = greedy_generate(cold_engine.model, prompt_of(seed, n), max_tokens)
        assert result.token_ids == alone, (seed, n)
    assert cold_engine.running() == 0 and cold_engine.queue_depth() == 0
    assert moves, "the schedule was meant to move rows (compaction after a decode row finished)"


def test_streaming_sync_and_async(cold_engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    handle = cold_engine.submit(Request(tuple(prompt_of(5, 9)), params))
    deltas = list(handle)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1]) and deltas[-1].accounting is not None
    streamed = [t for d in deltas for t in d.token_ids]
    assert streamed == handle.result().token_ids and len(streamed) == 4

    async def consume() -> list[int]:
        h = cold_engine.submit(Request(tuple(prompt_of(5, 9)), params))
        return [t async for d in h for t in d.token_ids]

    assert asyncio.run(consume()) == streamed


def test_generate_helper_tokenizes_text(cold_engine: Engine) -> None:
    result = generate(cold_engine, "Hi!", max_tokens=3, temperature=0, ignore_eos=True)
    bos = cold_engine.tokenizer.bos_id
    assert result.token_ids == greedy_generate(cold_engine.model, [bos, *b"Hi!"], 3)
    assert result.accounting is not None and result.accounting.prompt_tokens == 4


def test_engine_from_checkpoint_directory(cold_engine: Engine, tmp_path: Path) -> None:
    save_pretrained(cold_engine.model, tmp_path / "tiny")
    engine = Engine(
        EngineConfig(model_dir=str(tmp_path / "tiny"), kv_quant=False, max_context=64, **NO_CACHE)
    )
    try:
        assert engine.model_name == "tiny"
        prompt = Request(tuple(prompt_of(6, 9)), GREEDY)
        assert engine.generate(prompt).token_ids == cold_engine.generate(prompt).token_ids
    finally:
        engine.shutdown()


def test_decode_steps_run_on_their_own_thread_count_with_the_same_bits() -> None:
    """`decode_threads` sets the intra-op threads of decode steps only (prefill keeps torch's
    setting, restored after every step), and the tokens and their logprobs are the same bits as
    with torch's setting throughout."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompt = prompt_of(8, 150)
    results, seen = [], []
    try:
        for threads in (1, 0):
            engine = make_engine(decode_threads=threads, max_context=192)
            calls: list[tuple[int, int]] = []
            engine.model.model.layers[0].self_attn.register_forward_pre_hook(
                lambda mod, args, calls=calls: calls.append((args[0].shape[1], torch.get_num_threads()))
            )
            try:
                results.append(engine.generate(Request(tuple(prompt), sampling)))
            finally:
                engine.shutdown()
            seen.append(calls)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    one, default = results
    assert one.token_ids == default.token_ids
    assert [(t.token_id, t.logprob) for t in one.logprobs] == [(t.token_id, t.logprob) for t in default.logprobs]
    assert {n for rows, n in seen[0] if rows == 1} == {1} and {n for rows, n in seen[0] if rows > 1} == {2}
    assert {n for _, n in seen[1]} == {2}
