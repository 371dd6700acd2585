"""The engine's public API: requests, sampling, results and the calls a server (or a script) makes.

The server depends only on this module; the engine implements it. Not for: scheduling logic
(see :mod:`replaykv.engine.engine`).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from replaykv.images import PromptImage
from replaykv.replay import ReplayFlags


class EngineError(Exception):
    """Base of the errors the engine reports to callers (the server maps them to HTTP codes)."""

    status = 500


class InvalidRequest(EngineError):
    """The request cannot be served as asked (too long, bad token ids, bad options): 400."""

    status = 400


class QueueFull(EngineError):
    """Admission control refused the request: 429 with Retry-After seconds."""

    status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 = greedy. seed makes sampling reproducible per request.

    The logits pass through, in this order: logit_bias, repetition_penalty (prompt and output
    tokens: a positive logit divided by it, a negative one multiplied), presence and frequency
    penalties (output tokens), then temperature, min_p, top-k and top-p. Greedy requests take the
    argmax after the first three.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep the stop token or string that ended the output in it
    logprobs: int | None = None  # None: none; k >= 0: each emitted token's logprob + the k most likely
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability (0 = off)
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (1 = off)
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of an emitted token under the distribution it was drawn from (the
    model's, before temperature / top-k / top-p), and the `k` most likely tokens, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Request:
    """One generation request. `salt` is the tenant salt the server derived from the API key (a
    client never chooses it). `replay` overrides the engine's replay switches for experiments.
    `images`: the prompt's images, each over a span of positions that carry the model's image
    token id (the model needs a vision tower)."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    salt: bytes = b""
    request_id: str = ""
    replay: ReplayFlags | None = None
    prompt_logprobs: bool = False
    full_path_fallback: bool = False
    images: tuple[PromptImage, ...] = ()


@dataclass(frozen=True)
class Accounting:
    """What the cache and replay did for a request (returned with the result, exported as metrics)."""

    path: str  # cold / hit / bounded / exact / truncate / full
    prompt_tokens: int
    cached_tokens: int  # global-KV hit tokens that were not recomputed
    replayed_tokens: int
    prefill_work: int  # layer×tokens actually run
    full_prefill_work: int  # layer×tokens of a cold full prefill of the same prompt
    window_floors: tuple[int, ...]
    snapshot_hit: bool
    reasons: tuple[str, ...] = ()
    image_tokens: int = 0  # prompt positions inside image spans
    images_encoded: int = 0  # images the tower ran for (the others were not needed, or cached)


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed result: new token ids (and their text), or the final summary."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    accounting: Accounting | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them


@dataclass
class Result:
    """A finished request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    accounting: Accounting | None = None
    ttft_s: float = 0.0
    latency_s: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class EngineAPI(abc.ABC):
    """What the server calls. Thread-safe; `submit` never blocks on the model."""

    @abc.abstractmethod
    def submit(self, request: Request) -> RequestHandle:
        """Admit a request (raises QueueFull / InvalidRequest) and return its handle."""

    def generate(self, request: Request) -> Result:
        """Submit and wait for the whole result."""
        return self.submit(request).result()

    @abc.abstractmethod
    def collect(self) -> Iterator[Metric]:
        """Every engine and ledger metric family (``prometheus_client``'s custom-collector
        protocol: an engine registers into a ``CollectorRegistry`` as it is)."""

    def metrics_text(self) -> str:
        """``collect()`` in the Prometheus text format 0.0.4."""
        return generate_latest(self).decode()

    @abc.abstractmethod
    def cache_stats(self) -> dict[str, Any]:
        """Per-ledger statistics (admin endpoint)."""

    @abc.abstractmethod
    def flush_writeback(self) -> None:
        """Wait until the write-back of every finished request is done (a sync point for
        harnesses and tests; admin endpoint)."""

    @abc.abstractmethod
    def flush_swa_pool(self) -> None:
        """Drop every window snapshot (the next turns take the miss path)."""

    @abc.abstractmethod
    def flush_all(self) -> None:
        """Drop every cached state: device pool, SWA pool and persistent store."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine thread and flush write-back."""

    @property
    @abc.abstractmethod
    def model_name(self) -> str: ...

    @property
    @abc.abstractmethod
    def max_context(self) -> int: ...

    @property
    def model_identity(self) -> dict[str, str]:
        """What a report names the served model by (an engine that knows more adds
        `weights_sha256` and `config_digest`)."""
        return {"model": self.model_name}


class RequestHandle(abc.ABC):
    """A submitted request: stream its deltas, wait for it, or cancel it."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Delta]: ...

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Delta]: ...

    @abc.abstractmethod
    def result(self, timeout: float | None = None) -> Result: ...

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop generating (a client went away); frees the request's resources."""
