"""Images through the ledgers: prefix keys that see image content, isolation between images,
and every replay path rebuilding image rows from the image, never from its placeholder ids.

The model is `v41-tiny-vision` (window 8, decoder cut 6) with random weights, quantisers off;
its images here take 10 positions (a 2 × 3 grid). References are driven layer by layer as
architecture reference §13 describes (tests/test_replay_reference.py's semantics), with the
span vectors placed by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replaykv.cache.keys import KeyNamespace, PrefixKeyBuilder, chunk_keys, prefix_key
from replaykv.cache.views import allocate_view
from replaykv.engine import Engine, EngineConfig
from replaykv.engine.api import Request, SamplingParams
from replaykv.engine.scenario import image_spans, score_after_cut
from replaykv.images import PreparedImage, PromptImage, prepare_image
from replaykv.model.spec import ModelSpec
from replaykv.replay import ReplayFlags
from tests.model.vision_reference import reference_logits_with_images
from tests.test_replay_reference import naive_bounded

W = 8
TOL = 1e-4


def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (50, 70, 3), dtype=np.uint8)


def make_engine(tmp: Path, **overrides: Any) -> Engine:
    cfg: dict[str, Any] = dict(
        preset="v41-tiny-vision", seed=0, kv_quant=False, max_context=128, max_batch=2,
        prefill_token_budget=7, store_dir=str(tmp / "store"), chunk_size=16,
        device_pool_bytes=1 << 20, swa_pool="memory", swa_pool_capacity_bytes=1 << 24,
    )  # fmt: skip
    return Engine(EngineConfig(**{**cfg, **overrides}))


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = make_engine(tmp_path, enable_decoder_swa_bounded_replay=False)  # answers comparable to one shot
    yield e
    e.shutdown()


def with_images(n: int, images: list[tuple[int, PreparedImage]], seed: int, image_id: int = 511) -> list[int]:
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    for start, image in images:
        ids[start : start + image.span_length] = [image_id] * image.span_length
    return ids


def ask(engine: Engine, ids: list[int], images: list[tuple[int, PreparedImage]], **flags: Any) -> Any:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)
    replay = ReplayFlags(**flags) if flags else None
    request = Request(
        tuple(ids), sampling, images=tuple(PromptImage(s, im) for s, im in images), replay=replay
    )
    result = engine.generate(request)
    engine.flush_writeback()
    return result


# ---------------------------------------------------------------------------------- keys
def test_keys_see_the_image_not_its_placeholder_ids() -> None:
    ns = KeyNamespace("cfg", "weights", 1, ("fp8",), (0, 2), 16, b"")
    ids = [5] * 10 + [511] * 10 + [6] * 20
    a, b = (bytes([i]) * 32 for i in (1, 2))
    with_a = PrefixKeyBuilder(ns, ids, [(10, 10, a)])
    with_b = PrefixKeyBuilder(ns, ids, [(10, 10, b)])
    again = PrefixKeyBuilder(ns, ids, [(10, 10, a)])
    assert with_a.chunk_keys() == again.chunk_keys()
    assert with_a.chunk_keys()[0] != with_b.chunk_keys()[0]  # the span starts in chunk 0
    assert with_a.prefix_key(40) != with_b.prefix_key(40)
    assert with_a.prefix_key(9) == with_b.prefix_key(9) == prefix_key(ns, ids[:9])  # before the image
    # the same image one position later is another prompt
    assert PrefixKeyBuilder(ns, ids, [(11, 9, a)]).chunk_keys() != with_a.chunk_keys()
    # text-only sequences keep the keys they always had
    assert PrefixKeyBuilder(ns, ids).chunk_keys() == chunk_keys(ns, ids)
    with pytest.raises(ValueError, match="overlap"):
        PrefixKeyBuilder(ns, ids, [(10, 10, a), (15, 10, b)])


# ---------------------------------------------------------------------------------- isolation
def test_same_text_with_another_image_never_hits(engine: Engine) -> None:
    vc = engine.model.config.vision_config
    first, other = prepare_image(picture(1), vc), prepare_image(picture(2), vc)
    ids = with_images(60, [(0, first)], seed=3)
    cold = ask(engine, ids, [(0, first)])
    assert cold.accounting.path == "cold" and cold.accounting.image_tokens == 10
    longer = [*ids, 7, 8, 9]
    switched = ask(engine, longer, [(0, other)])
    assert switched.accounting.cached_tokens == 0
    same = ask(engine, longer, [(0, first)])
    assert same.accounting.cached_tokens == 60 and same.accounting.path == "hit"
    model = engine.model
    check_top(same, one_shot_last(model, longer, image_spans(model, [PromptImage(0, first)])))


def test_an_image_later_in_the_prompt_keeps_the_text_before_it(engine: Engine) -> None:
    vc = engine.model.config.vision_config
    first, other = prepare_image(picture(1), vc), prepare_image(picture(2), vc)
    ids = with_images(60, [(35, first)], seed=4)
    ask(engine, ids, [(35, first)])
    switched = ask(engine, [*ids, 7], [(35, other)])
    assert switched.accounting.cached_tokens == 32  # chunks [0, 32) hold text only


# ---------------------------------------------------------------------------------- replay
def naive(
    model: Any, ids: list[int], spans: list[tuple[int, torch.Tensor]], cut: int, decoder: bool
) -> torch.Tensor:
    """Last-row logits of the follow-up after a lost snapshot (§13), span vectors placed on
    every embedded row: the earlier request's [0, cut), the replay [s, cut) and the new rows."""
    return naive_bounded(model, ids, cut, decoder, spans)[-1]


def one_shot_last(model: Any, ids: list[int], spans: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    view = allocate_view(ModelSpec.from_config(model.config), 1, len(ids), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids]), view, logits_rows="last", spans=spans)[0, -1]


def check_top(result: Any, ref: torch.Tensor, wrong: torch.Tensor | None = None) -> None:
    """The answer's top log-probabilities equal `ref`'s, and (when given) not `wrong`'s."""
    ref, got = torch.log_softmax(ref, -1), dict(result.logprobs[0].top)
    for token, lp in got.items():
        assert lp == pytest.approx(float(ref[token]), abs=TOL)
    if wrong is not None:
        wrong = torch.log_softmax(wrong, -1)
        assert max(abs(lp - float(wrong[t])) for t, lp in got.items()) > 100 * TOL


# (image start, earlier prompt length, follow-up length, tokens the two share, cut the cache gives)
CASES = {
    # the replay span [24, 32) covers image rows [24, 31)
    "inside_replay_span": (21, 32, 36, 32, 32),
    # the cut at the chunk boundary 32 splits the image [26, 36): replayed rows [26, 32) and new
    # rows [32, 36) are image rows; with decoder replay the decoder's rows [34, 42) start in it
    "straddling_the_cut": (26, 40, 42, 37, 32),
    # the image ends before the replay span: nothing needs its vectors, the tower does not run
    "before_replay_span": (3, 32, 36, 32, 32),
}


@pytest.mark.parametrize("decoder", [False, True], ids=["decoder-replay-off", "decoder-replay-on"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_over_image_rows_uses_the_image(tmp_path: Path, case: str, decoder: bool) -> None:
    """The earlier prompt is cached, its window snapshot lost, the feature cache empty; the
    follow-up takes bounded replay. Its answer equals the §13 reference with the image's vectors
    on every replayed and new row, and differs from the reference with placeholder embeddings
    there (so replaying from placeholders fails this test). With the snapshot kept, the
    follow-up continues from it (cached prefill) and equals the one-shot forward."""
    start, n_first, n, shared, cut = CASES[case]
    engine = make_engine(tmp_path, enable_decoder_swa_bounded_replay=decoder)
    try:
        model = engine.model
        image = prepare_image(picture(5), model.config.vision_config)
        ids = with_images(n, [(start, image)], seed=6)
        first = ids[:shared] + with_images(n_first - shared, [], seed=7)
        ask(engine, first, [(start, image)])
        engine.flush_swa_pool()
        engine.features.clear()
        follow = ask(engine, ids, [(start, image)])
        acc = follow.accounting
        assert (acc.path, acc.cached_tokens) == ("bounded", cut), acc
        in_span = start + image.span_length > cut - W
        assert acc.images_encoded == (1 if in_span else 0)
        spans = image_spans(model, [PromptImage(start, image)])
        check_top(
            follow,
            naive(model, ids, spans, cut, decoder),
            naive(model, ids, [], cut, decoder) if in_span else None,
        )
    finally:
        engine.shutdown()


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_prefill_with_images_equals_one_shot(tmp_path: Path, case: str) -> None:
    start, n_first, n, shared, _ = CASES[case]
    engine = make_engine(tmp_path, enable_decoder_swa_bounded_replay=False)
    try:
        model = engine.model
        image = prepare_image(picture(5), model.config.vision_config)
        ids = with_images(n, [(start, image)], seed=6)
        ask(engine, ids[:n_first] if shared == n_first else ids[:shared], [(start, image)])
        follow = ask(engine, ids, [(start, image)])
        assert follow.accounting.path == "hit" and follow.accounting.cached_tokens > 0
        assert follow.accounting.images_encoded == 0  # start + n_first: vectors came from the cache
        # the independent references: the naive tower and the dense text model
        check_top(follow, reference_logits_with_images(model, ids, [(start, image.canvas)])[-1])
    finally:
        engine.shutdown()


def test_the_scenario_scorer_keeps_the_semantics_with_images(tmp_path: Path) -> None:
    """`replaykv score --cut H` with an image across the cut: the bounded path's last row equals
    the §13 reference; the snapshot, exact, truncate and full paths equal the one-shot forward."""
    engine = make_engine(tmp_path)
    model = engine.model
    engine.shutdown()
    image = prepare_image(picture(5), model.config.vision_config)
    ids = with_images(42, [(26, image)], seed=6)
    images = [PromptImage(26, image)]
    spans = image_spans(model, images)
    for decoder in (False, True):
        flags = ReplayFlags(enable_decoder_swa_bounded_replay=decoder)
        logits, plan = score_after_cut(model, ids, 32, flags, keep_snapshot=False, images=images)
        assert plan.path == "bounded"
        ref = naive(model, ids, spans, 32, decoder)
        assert (logits[-1] - ref).abs().max().item() <= TOL
    view = allocate_view(ModelSpec.from_config(model.config), 1, len(ids), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        one_shot = model(torch.tensor([ids]), view, spans=spans)[0, 32:]
    no_dec = ReplayFlags(enable_decoder_swa_bounded_replay=False)
    logits, plan = score_after_cut(model, ids, 32, no_dec, True, images)
    assert plan.path == "hit"
    assert (logits - one_shot).abs().max().item() <= TOL
    # the exact paths rebuild image rows from layer 0 too: every row equals the one-shot forward
    for strategy in ("exact", "truncate", "full"):
        flags = ReplayFlags(enable_decoder_swa_bounded_replay=False, swa_miss_strategy=strategy)
        logits, plan = score_after_cut(model, ids, 32, flags, keep_snapshot=False, images=images)
        assert plan.path == strategy
        assert (logits - one_shot).abs().max().item() <= TOL, strategy
    with pytest.raises(ValueError, match="image token id"):
        score_after_cut(model, ids, 32, ReplayFlags(), True, [PromptImage(20, image)])


def test_the_feature_cache_serves_repeats_and_rebuilding_gives_the_same_answer(tmp_path: Path) -> None:
    first = make_engine(tmp_path / "a")
    none = make_engine(tmp_path / "b", image_feature_cache_bytes=0)
    try:
        image = prepare_image(picture(8), first.model.config.vision_config)
        ids = with_images(30, [(4, image)], seed=9)
        a1 = ask(first, ids, [(4, image)])
        a2 = ask(first, ids[:20] + with_images(10, [], seed=10), [(4, image)])
        assert (a1.accounting.images_encoded, a2.accounting.images_encoded) == (1, 0)
        assert first.features.stats.hits == 1
        b1 = ask(none, ids, [(4, image)])
        assert b1.accounting.images_encoded == 1 and len(none.features) == 0
        assert a1.token_ids == b1.token_ids and a1.logprobs[0].logprob == b1.logprobs[0].logprob
    finally:
        first.shutdown()
        none.shutdown()


def test_bad_image_requests_are_refused(tmp_path: Path) -> None:
    engine = make_engine(tmp_path)
    text_only = Engine(
        EngineConfig(preset="v41-tiny", kv_quant=False, max_context=64, store_dir=None, swa_pool=None)
    )
    try:
        image = prepare_image(picture(1), engine.model.config.vision_config)
        ids = with_images(30, [(4, image)], seed=1)
        from replaykv.engine.api import InvalidRequest

        with pytest.raises(InvalidRequest, match="image token id"):
            engine.submit(Request(tuple(ids), images=(PromptImage(5, image),)))
        with pytest.raises(InvalidRequest, match="leaves the prompt"):
            engine.submit(Request(tuple(ids), images=(PromptImage(25, image),)))
        with pytest.raises(InvalidRequest, match="overlaps"):
            engine.submit(Request(tuple(ids), images=(PromptImage(4, image), PromptImage(8, image))))
        with pytest.raises(InvalidRequest, match="no vision tower"):
            text_only.submit(Request(tuple(i % 300 for i in ids), images=(PromptImage(4, image),)))
    finally:
        engine.shutdown()
        text_only.shutdown()
