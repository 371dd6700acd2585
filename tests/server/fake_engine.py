"""A small deterministic stand-in for the engine, for the server tests.

It implements :class:`EngineAPI` with a prefix "cache" per salt (the longest common prefix with
any earlier prompt + output of the same salt counts as cached), a fixed greedy reply derived
from the prompt, optional per-token delays (to test streaming and disconnects), and switches
that make `submit` raise QueueFull. Not for: anything the real engine computes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from replaykv.engine.api import (
    Accounting,
    Delta,
    EngineAPI,
    InvalidRequest,
    QueueFull,
    Request,
    RequestHandle,
    Result,
)

LAYERS = 4
END_ID = 262  # <|end|> of the byte tokenizer


class FakeHandle(RequestHandle):
    def __init__(self, deltas: list[Delta], delay_s: float) -> None:
        self.deltas = deltas
        self.delay_s = delay_s
        self.cancelled = threading.Event()
        self.done = threading.Event()

    def __iter__(self) -> Iterator[Delta]:
        for d in self.deltas:
            if self.cancelled.is_set():
                return
            time.sleep(self.delay_s)
            yield d
        self.done.set()

    async def _agen(self) -> AsyncIterator[Delta]:
        for d in self.deltas:
            if self.cancelled.is_set():
                return
            await asyncio.sleep(self.delay_s)
            yield d
        self.done.set()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._agen()

    def result(self, timeout: float | None = None) -> Result:
        ids: list[int] = []
        text = ""
        last = Delta()
        for d in self:
            ids += d.token_ids
            text += d.text
            last = d
        return Result(ids, text, last.finish_reason or "length", last.accounting)

    def cancel(self) -> None:
        self.cancelled.set()


class FakeEngine(EngineAPI):
    """Replies with the bytes of "ok <n>" repeated (n = the prompt length), one token per delta."""

    def __init__(self, max_context: int = 256, vocab_size: int = 512, delay_s: float = 0.0) -> None:
        self._max_context = max_context
        self.vocab_size = vocab_size
        self.delay_s = delay_s
        self.queue_full = False
        self.requests: list[Request] = []
        self.handles: list[FakeHandle] = []
        self.seen: dict[bytes, list[tuple[int, ...]]] = {}
        self.calls: list[str] = []
        self.reply: bytes | None = None  # a fixed answer (ends with "stop") instead of "ok <n>"
        self.lock = threading.Lock()

    @property
    def model_name(self) -> str:
        return "fake-model"

    @property
    def max_context(self) -> int:
        return self._max_context

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.handles.clear()
            self.seen.clear()
            self.calls.clear()
            self.queue_full = False
            self.delay_s = 0.0
            self.reply = None

    def _cached(self, salt: bytes, prompt: tuple[int, ...]) -> int:
        best = 0
        for seq in self.seen.get(salt, []):
            n = 0
            for a, b in zip(seq, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1)

    def submit(self, request: Request) -> FakeHandle:
        if self.queue_full:
            raise QueueFull("the queue is full (fake)", retry_after_s=2.5)
        prompt = request.prompt_ids
        bad = [i for i in prompt if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        sp = request.sampling
        if len(prompt) + sp.max_tokens > self._max_context:
            raise InvalidRequest("prompt + max_tokens is over the context")
        reply = list(f"ok {len(prompt)} ".encode()) * (1 + sp.max_tokens // 4)
        out = reply[: sp.max_tokens]
        finish = "length"
        if self.reply is not None:
            out = list(self.reply)[: sp.max_tokens]
            finish = "stop" if len(out) == len(self.reply) else "length"
        elif END_ID in sp.stop_token_ids and sp.max_tokens > 6:
            out, finish = out[:6], "stop"
        with self.lock:
            cached = self._cached(request.salt, prompt)
            self.seen.setdefault(request.salt, []).append(prompt + tuple(out))
            self.requests.append(request)
        acc = Accounting(
            path="hit" if cached else "cold",
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            replayed_tokens=min(cached, 3),
            prefill_work=LAYERS * (len(prompt) - cached),
            full_prefill_work=LAYERS * len(prompt),
            window_floors=(0,),
            snapshot_hit=bool(cached),
        )
        deltas = [Delta((t,), bytes([t]).decode()) for t in out[:-1]]
        deltas.append(Delta((out[-1],), bytes([out[-1]]).decode(), True, finish, acc))
        handle = FakeHandle(deltas, self.delay_s)
        self.handles.append(handle)
        return handle

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("replaykv_fake_requests", "Requests the fake engine admitted.", len(self.requests))

    def cache_stats(self) -> dict[str, Any]:
        return {"tenants": len(self.seen), "sequences": sum(len(v) for v in self.seen.values())}

    def flush_writeback(self) -> None:
        self.calls.append("flush_writeback")

    def flush_swa_pool(self) -> None:
        self.calls.append("flush_swa_pool")

    def flush_all(self) -> None:
        self.calls.append("flush_all")
        with self.lock:
            self.seen.clear()

    def shutdown(self) -> None:
        self.calls.append("shutdown")
