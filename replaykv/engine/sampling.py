"""Picking the next token and deciding when a request stops.

For: checking :class:`~replaykv.engine.api.SamplingParams` against the model, a per-request
:class:`Sampler` (logit bias, repetition / presence / frequency penalties, greedy, temperature,
min-p, top-k, top-p, drawn from a torch.Generator seeded from
``seed`` so a seeded request is reproducible whatever it is batched with) and a per-request
:class:`OutputStream` that turns sampled ids into streamed text: stop token ids (and eos unless
``ignore_eos``), stop strings found in the decoded text, ``max_tokens``.

Output conventions: a stop token ends the request and appears neither in the ids nor in the
text; a stop string ends it with the text cut just before the stop string (the ids keep every
token sampled up to it). Text that may still turn into a stop string, or a multi-byte
character still missing bytes, is held back until it can no longer change.
Not for: running the model or scheduling (see :mod:`replaykv.engine.engine`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence

import torch

from replaykv.engine.api import SamplingParams, TokenLogprob


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError with a message naming the field when the values cannot be served."""
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1; got {params.max_tokens!r}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {params.temperature}")
    if not (0.0 < params.top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1]; got {params.top_p}")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off); got {params.top_k!r}")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None; got {params.seed!r}")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise ValueError(f"stop strings must be non-empty strings; got {params.stop!r}")
    if params.logprobs is not None and (
        not isinstance(params.logprobs, int) or not 0 <= params.logprobs <= vocab_size
    ):
        raise ValueError(f"logprobs must be an integer in [0, {vocab_size}] or None; got {params.logprobs!r}")
    bad = [t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}")
    if not (0.0 <= params.min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1] (0 = off); got {params.min_p}")
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off); got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise ValueError(f"{name} must be in [-2, 2]; got {value}")
    bad_bias = [t for t, b in params.logit_bias if not 0 <= t < vocab_size or not math.isfinite(b)]
    if bad_bias:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}) with finite values; got {bad_bias[:5]}")


class Sampler:
    """Draws next tokens for one request from float32 logits [vocab] (on any device).

    `prompt` (the request's prompt ids) feeds the repetition penalty; every sampled token is
    counted for the presence and frequency penalties.
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._prompt = tuple(prompt) if params.repetition_penalty != 1.0 else ()
        # per-vocabulary state, built on the first call (vocabulary size and device from the logits)
        self._seen: torch.Tensor | None = None  # bool: in the prompt or the output
        self._counts: torch.Tensor | None = None  # float: occurrences in the output
        self._pending: list[int] = []  # tokens drawn before the state exists

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0 or self.params.top_k == 1

    @property
    def _adjusts(self) -> bool:
        p = self.params
        return bool(p.logit_bias) or p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)

    def observe(self, token: int) -> None:
        """Count `token` as output (the penalties read it); `sample` calls it for what it draws."""
        if self._counts is None:
            self._pending.append(token)
            return
        self._counts[token] += 1
        self._seen[token] = True  # type: ignore[index]

    def _state(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._seen is None or self._counts is None:
            self._seen = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
            if self._prompt:
                self._seen[torch.tensor(self._prompt, device=x.device)] = True
            self._counts = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
            for t in self._pending:
                self.observe(t)
            self._pending.clear()
        return self._seen, self._counts

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` after logit bias and the penalties (a float32 copy; `logits` is untouched)."""
        p = self.params
        x = logits.detach().float().clone()
        seen, counts = self._state(x)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=x.device)
            x.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=x.device))
        if p.repetition_penalty != 1.0:
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, penalised, x)
        if p.presence_penalty or p.frequency_penalty:
            x -= (counts > 0).to(x.dtype) * p.presence_penalty + counts * p.frequency_penalty
        return x

    def sample(self, logits: torch.Tensor) -> int:
        token = self._draw(self.adjusted(logits) if self._adjusts else logits)
        if self._adjusts:
            self.observe(token)
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(logits.argmax().item())
        x = logits.detach().float().cpu() / self.params.temperature
        if self.params.min_p > 0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < self.params.min_p * probs.max(), float("-inf"))
        k = self.params.top_k
        if 0 < k < x.shape[-1]:
            kth = torch.topk(x, k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.params.top_p < 1.0:
            order = torch.argsort(x, descending=True)
            probs = torch.softmax(x[order], dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
            drop = before >= self.params.top_p  # keeps the smallest set reaching top_p (never empty)
            x[order[drop]] = float("-inf")
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`token`'s log-probability under float32 `logits` [vocab] and the `k` most likely tokens
    (ties broken by the lower id, so the list is the same on every run)."""
    lp = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        # top-k without sorting the vocabulary: every id at or above the k-th value, in id order,
        # then a stable sort by value (equal values keep the lower id first)
        kth = torch.topk(lp, k).values[-1]
        ids = torch.nonzero(lp >= kth).flatten()
        order = ids[torch.argsort(-lp[ids], stable=True)][:k]
        top = tuple(zip(order.tolist(), lp[order].tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), top)


class OutputStream:
    """The visible output of one request, built token by token.

    ``push(token)`` returns (ids to emit, text to emit, finish reason or None). ``sampled`` keeps
    every sampled id (stop tokens included): the model has processed all but the last of them.
    """

    def __init__(
        self, params: SamplingParams, decode: Callable[[list[int]], str], eos_ids: Sequence[int]
    ) -> None:
        self.params = params
        self._decode = decode
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_ids)
        self._stop_ids = frozenset(stop_ids)
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.sampled: list[int] = []
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        self.finish_reason: str | None = None

    def push(self, token: int) -> tuple[tuple[int, ...], str, str | None]:
        if self.finish_reason is not None:
            raise RuntimeError("the request already finished")
        self.sampled.append(token)
        keep = self.params.no_stop_trim  # the stop token or string stays in the output
        if token in self._stop_ids:
            if not keep:
                return (), self._emit(self._full_text(), final=True), self._finish("stop")
            self.token_ids.append(token)
            return (token,), self._emit(self._full_text(), final=True), self._finish("stop")
        self.token_ids.append(token)
        full = self._full_text()
        if self.params.stop:
            found = self._find_stop(full)
            if found is not None:
                cut, length = found
                end = cut + length if keep else cut
                return (token,), self._emit(full[:end], final=True), self._finish("stop")
        if len(self.sampled) >= self.params.max_tokens:
            return (token,), self._emit(full, final=True), self._finish("length")
        return (token,), self._emit(full, final=False), None

    def _full_text(self) -> str:
        return self._decode(self.token_ids)

    def _finish(self, reason: str) -> str:
        self.finish_reason = reason
        return reason

    def _find_stop(self, full: str) -> tuple[int, int] | None:
        """(where the first stop string starts, its length): the earliest, the longest there."""
        start = max(0, len(self.text) - self._max_stop)
        hits = [(i, -len(s)) for s in self.params.stop if (i := full.find(s, start)) >= 0]
        if not hits:
            return None
        at, neg = min(hits)
        return at, -neg

    def _emit(self, full: str, final: bool) -> str:
        end = len(full)
        if not final:
            while end > len(self.text) and full[end - 1] == "\ufffd":  # bytes of a character may follow
                end -= 1
            end -= self._held_for_stop(full[:end])
        if end <= len(self.text):
            return ""
        piece = full[len(self.text) : end]
        self.text = full[:end]
        return piece

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins a stop string (it may still become one)."""
        for n in range(min(self._max_stop - 1, len(text) - len(self.text)), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self.params.stop):
                return n
        return 0
