"""Fixtures for the engine tests: tiny V4.1 engines (random weights, seed 0, window 8, KV
quantisers off so that exactness can be asserted) and plain reference loops over the model.

Engines are shared per module where the tests only submit requests (building one costs about a
second); tests that flush caches or need particular limits build their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from replaykv.cache.views import advance, allocate_view
from replaykv.engine import Engine, EngineConfig
from replaykv.engine.scenario import prefill_as_request
from replaykv.model.spec import ModelSpec
from replaykv.replay import ReplayFlags

BASE: dict[str, Any] = dict(
    preset="tiny",
    seed=0,
    kv_quant=False,
    max_context=96,
    max_batch=3,
    prefill_token_budget=5,  # small: prompts are prefilled in several pieces between decode steps
)
NO_CACHE: dict[str, Any] = dict(swa_pool=None, store_dir=None, device_pool_bytes=0)


def make_engine(tmp: Path | None = None, **overrides: Any) -> Engine:
    """A tiny engine; with `tmp`, all three ledgers on (store under tmp, 16-token chunks)."""
    caches: dict[str, Any] = NO_CACHE if tmp is None else dict(
        store_dir=str(tmp / "store"), chunk_size=16, device_pool_bytes=1 << 20, swa_pool="memory",
        swa_pool_capacity_bytes=1 << 24,
    )  # fmt: skip
    return Engine(EngineConfig(**{**BASE, **caches, **overrides}))


def prompt_of(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen).tolist()


def reference_greedy(model: Any, prompt: list[int], n: int, decoder_replay: bool = False) -> list[int]:
    """Cold prefill in one piece (runner.execute of the cold plan), then a plain decode loop."""
    spec = ModelSpec.from_config(model.config)
    view = allocate_view(spec, 1, len(prompt) + n)
    flags = ReplayFlags(enable_decoder_swa_bounded_replay=decoder_replay)
    out: list[int] = []
    with torch.inference_mode():
        logits, _ = prefill_as_request(model, torch.tensor([prompt]), view, flags)
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), view, logits_rows="last")
            advance(view, 1)
    return out


@pytest.fixture(scope="module")
def cold_engine() -> Iterator[Engine]:
    """No caches, decoder replay off: every request is a cold full prefill."""
    engine = make_engine(enable_decoder_swa_bounded_replay=False)
    yield engine
    engine.shutdown()
