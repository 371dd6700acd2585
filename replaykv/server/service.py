"""The OpenAI handlers' shared state and the calls they make on the engine.

For: checking the model name, encoding text, the token budget, building engine requests from a
request body (one per choice: ``n`` / ``best_of``, seeds ``seed + i``), draining handles (all
choices at once, cancelled when the client goes away) and merging several streams of deltas.
Not for: response shapes (:mod:`replaykv.server.schemas`) or routing
(:mod:`replaykv.server.openai_routes`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest

from replaykv.engine.api import (
    Accounting,
    Delta,
    EngineAPI,
    Request,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)
from replaykv.images import PromptImage
from replaykv.server import schemas
from replaykv.server.chat import ChatTemplate
from replaykv.server.errors import CLIENT_GONE, ApiError
from replaykv.server.image_parts import engine_vision
from replaykv.server.metrics import ServerMetrics
from replaykv.server.settings import ServerSettings
from replaykv.server.tenants import DEFAULT_TENANT, tenant_salt
from replaykv.tokenizer import load_tokenizer

log = logging.getLogger("replaykv.server")


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Collected:
    """A finished request as the non-streaming endpoints answer it."""

    text: str
    ids: list[int]
    finish: str
    accounting: Accounting | None
    logprobs: list[TokenLogprob]

    @property
    def mean_logprob(self) -> float:
        """Mean log-probability of the tokens (what ``best_of`` ranks by); -inf with none."""
        return (
            sum(lp.logprob for lp in self.logprobs) / len(self.logprobs) if self.logprobs else float("-inf")
        )


class Service:
    """Engine, tokenizer, chat template, served name, image path and limits, and HTTP counters
    of one app."""

    def __init__(self, engine: EngineAPI, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.tokenizer = load_tokenizer(settings.model_dir)
        self.template = ChatTemplate.load(settings.model_dir)
        self.model_name = settings.model_name or engine.model_name
        self.vision = engine_vision(engine)
        self.image_limits = settings.image_limits

    # ---- request building -------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                "model",
                "model_not_found",
            )

    def encode(self, text: str, param: str, bos: bool = False) -> list[int]:
        try:
            return self.tokenizer.encode(text, bos=bos)
        except UnicodeEncodeError as e:
            raise ApiError(
                400, f"`{param}` is not valid Unicode text ({e.reason})", param, "invalid_value"
            ) from e

    def budget(self, n_prompt: int, requested: int | None, default: int, param: str) -> int:
        """max_tokens for a prompt of `n_prompt` tokens within the engine's context."""
        ctx = self.engine.max_context
        if n_prompt >= ctx:
            raise ApiError(
                400,
                f"the prompt is {n_prompt} tokens; this model's context is {ctx} tokens and the prompt "
                "must leave room for at least one new token",
                param,
                "context_length_exceeded",
            )
        if requested is None:
            return min(default, ctx - n_prompt)
        if n_prompt + requested > ctx:
            raise ApiError(
                400,
                f"{n_prompt} prompt tokens + max_tokens {requested} = {n_prompt + requested} is over this "
                f"model's context of {ctx} tokens; lower max_tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def note_ignored(self, body: schemas._Sampling, rid: str) -> dict[str, str]:
        """Log the accepted-but-ignored fields of `body`; the response header naming them."""
        ignored = body.ignored_fields
        if not ignored:
            return {}
        log.info("%s: accepted without effect: %s", rid, ", ".join(ignored))
        return {"X-Replaykv-Ignored-Fields": ", ".join(ignored)}

    def submit(
        self,
        http: HttpRequest,
        body: schemas._Sampling,
        ids: list[int],
        max_tokens: int,
        rid: str,
        count: int = 1,
        stop_ids: tuple[int, ...] = (),
        stop_strings: tuple[str, ...] = (),
        logprobs: int | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> list[RequestHandle]:
        """`count` engine requests for `ids` (choice i seeded ``seed + i``) with the prompt's
        `images`; all or none."""
        tenant: str = http.scope.get("state", {}).get("tenant", DEFAULT_TENANT)
        salt = tenant_salt(tenant)
        handles: list[RequestHandle] = []
        try:
            for i in range(count):
                sampling = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=max(body.top_k, 0),
                    seed=None if body.seed is None else (body.seed + i) % 2**63,
                    stop=body.stop_list + stop_strings,
                    stop_token_ids=tuple(stop_ids) + tuple(body.stop_token_ids or ()),
                    ignore_eos=body.ignore_eos,
                    no_stop_trim=body.no_stop_trim,
                    logprobs=logprobs,
                    min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    logit_bias=body.logit_bias_pairs,
                )
                request = Request(
                    tuple(ids),
                    sampling,
                    salt=salt,
                    request_id=f"{rid}-{i}" if count > 1 else rid,
                    images=images,
                )
                handles.append(self.engine.submit(request))  # raises QueueFull / InvalidRequest
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    # ---- running -------------------------------------------------------------------------------

    async def collect(self, http: HttpRequest, handles: list[RequestHandle]) -> list[Collected]:
        """Drain every handle; cancel them all if the client goes away or one fails."""

        async def drain(handle: RequestHandle) -> Collected:
            text: list[str] = []
            ids: list[int] = []
            lps: list[TokenLogprob] = []
            async for d in handle:
                text.append(d.text)
                ids += d.token_ids
                lps += d.logprobs
                if d.finished:
                    if d.error or d.finish_reason == "error":
                        raise ApiError(
                            500, f"generation failed: {d.error or 'engine error'}", code="engine_error"
                        )
                    return Collected("".join(text), ids, d.finish_reason or "stop", d.accounting, lps)
            raise ApiError(500, "the engine ended the request without a result", code="engine_error")

        task: asyncio.Future[list[Collected]] = asyncio.ensure_future(
            asyncio.gather(*(drain(h) for h in handles))
        )
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await http.is_disconnected():
                    self.gone(http, handles)
                    task.cancel()
                    raise ApiError(CLIENT_GONE, "client disconnected")
        except BaseException:
            for h in handles:
                h.cancel()
            task.cancel()
            raise

    async def merged(self, handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) of all handles as they come; each handle's last delta is its
        finished one. Closing the iterator early cancels what is still running."""
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            try:
                async for d in handle:
                    await queue.put((i, d))
            except Exception as e:  # handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        running = len(tasks)
        try:
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def gone(self, http: HttpRequest, handles: list[RequestHandle]) -> None:
        for h in handles:
            h.cancel()
        self.metrics.disconnects.inc()
        http.scope.setdefault("state", {})["client_gone"] = True

    def chat_logprobs(self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
        return schemas.chat_logprobs(lps, self.tokenizer.token_text, self.tokenizer.token_bytes)

    def completion_logprobs(
        self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...], offset: int = 0
    ) -> dict[str, Any]:
        return schemas.completion_logprobs(lps, self.tokenizer.token_text, offset)
