"""The OpenAI-compatible HTTP app: requests in, engine `Request`s out, results back as JSON or SSE.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (engine text + HTTP counters), SGLang's
native endpoints (:mod:`replaykv.server.native`) and, with the admin key,
``POST /admin/flush_swa_pool``, ``POST /admin/flush_all``, ``GET /admin/cache_stats``.

Every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Bad input is
always a 4xx: malformed JSON, wrong types, unknown fields, unsupported options → 400; missing or
unknown API key → 401; admin endpoints with a tenant's key, or with no admin key configured →
403; unknown model or route → 404; body over the size limit → 413; the engine's
``InvalidRequest`` → 400; ``QueueFull`` → 429 with ``Retry-After`` (whole seconds, rounded up).
Only a fault of the server itself is a 5xx.

Authentication runs before anything reads the body (an ASGI gate in front of the router): the
``Authorization: Bearer`` key picks the tenant, and the tenant's salt goes into the engine
request. The client never names a tenant or a salt. The gate then reads the body, counting
bytes as they arrive, and answers 413 at the limit whether the client sent `Content-Length` or a
chunked body. A client that disconnects (streaming or not) cancels its engine request.

Not for: reading settings (:mod:`replaykv.server.settings`), rendering chat
(:mod:`replaykv.server.chat`) or anything the engine does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replaykv.engine.api import (
    EngineAPI,
    EngineError,
    QueueFull,
    Request,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)
from replaykv.server import schemas
from replaykv.server.chat import ChatTemplate, ChatTemplateError
from replaykv.server.metrics import HttpMetrics
from replaykv.server.native import AUTHENTICATED_PATHS, add_native_routes
from replaykv.server.settings import ServerSettings
from replaykv.server.tenants import DEFAULT_TENANT, tenant_salt
from replaykv.tokenizer import load_tokenizer

log = logging.getLogger("replaykv.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
CLIENT_GONE = 499  # nginx's code for "the client closed the connection"; only in metrics
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers) if headers is not None else None

    def response(self) -> JSONResponse:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return JSONResponse(
            schemas.error_body(self.message, kind, self.param, self.code), self.status, self.headers
        )


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _lookup(candidates: dict[str, str], key: str) -> str | None:
    """The value under `key`, comparing every candidate in constant time."""
    found = None
    for k, v in candidates.items():
        if hmac.compare_digest(k.encode(), key.encode()):
            found = v
    return found


class _Gate:
    """ASGI middleware in front of the router: size limit, authentication, HTTP metrics."""

    def __init__(
        self, app: ASGIApp, settings: ServerSettings, metrics: HttpMetrics, routes: set[str]
    ) -> None:
        self.app, self.settings, self.metrics, self.routes = app, settings, metrics, routes

    def _check(self, scope: Scope) -> ApiError | str:
        """The tenant of this request, or the error to answer instead."""
        path: str = scope["path"]
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.settings.max_request_bytes:
            return ApiError(
                413, f"the body is over {self.settings.max_request_bytes} bytes", code="too_large"
            )
        key = _bearer(scope)
        if path.startswith("/admin"):
            if self.settings.admin_key is None:
                return ApiError(403, "admin endpoints are disabled: start the server with --admin-key")
            if key is not None and hmac.compare_digest(key.encode(), self.settings.admin_key.encode()):
                return "admin"
            if key is not None and _lookup(dict(self.settings.api_keys), key) is not None:
                return ApiError(403, "this API key may not use admin endpoints", code="not_admin")
            return ApiError(
                401, "admin endpoints need `Authorization: Bearer <admin key>`", code="invalid_api_key"
            )
        needs_key = path.startswith("/v1") or path in AUTHENTICATED_PATHS
        if not needs_key or not self.settings.auth_enabled:
            return DEFAULT_TENANT
        if key is None:
            return ApiError(
                401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        tenant = _lookup(dict(self.settings.api_keys), key)
        if tenant is None:
            return ApiError(401, "incorrect API key", code="invalid_api_key")
        return tenant

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            verdict = self._check(scope)
            body = None
            if not isinstance(verdict, ApiError):
                body = await _read_body(receive, self.settings.max_request_bytes)
            if isinstance(verdict, ApiError):
                await verdict.response()(scope, receive, send_status)
            elif body is None:
                too_large = f"the body is over {self.settings.max_request_bytes} bytes"
                await ApiError(413, too_large, code="too_large").response()(scope, receive, send_status)
            else:
                scope.setdefault("state", {})["tenant"] = verdict
                await self.app(scope, _replay_body(body, receive), send_status)
        finally:
            self.metrics.in_flight.dec()
            label = getattr(scope.get("route"), "path", None)
            if label is None:  # refused before routing
                label = scope["path"] if scope["path"] in self.routes else "unmatched"
            if scope.get("state", {}).get("client_gone"):
                status[0] = CLIENT_GONE
            self.metrics.observe(label, scope["method"], status[0], time.perf_counter() - t0)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, counted as it arrives; None as soon as it passes `limit` bytes.

    The count is of bytes received, whatever `Content-Length` or `Transfer-Encoding` say, so a
    chunked body cannot grow past the limit in memory. A client that disconnects mid-body gives
    the bytes so far (the router then sees the disconnect on its next receive).
    """
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the buffered body over once, then waits on the connection."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _param(loc: tuple[Any, ...]) -> str | None:
    """A validation location as OpenAI's `param`: ``messages[0].role`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and not any(c in part for c in "[-(") and part not in _TYPE_TAGS:
            out += ("." if out else "") + part
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return ApiError(400, f"the body is not valid JSON ({detail})", code="invalid_json")
    param = _param(loc)
    if param is None:
        if isinstance(first.get("input"), bytes) or kind == "missing":
            return ApiError(
                400, "send a JSON object body with `Content-Type: application/json`", code="invalid_body"
            )
        return ApiError(400, "the body must be a JSON object", code="invalid_body")
    if kind == "extra_forbidden":
        name = str(loc[-1])
        if name in schemas.SERVER_SIDE_FIELDS and len(loc) == 2:
            return ApiError(
                400,
                f"`{name}` cannot be set by a client: the server derives the cache salt from your API key",
                param,
                "server_side_field",
            )
        return ApiError(400, f"unknown field `{param}`", param, "unknown_field")
    if kind == "missing":
        return ApiError(400, f"missing required field `{param}`", param, "missing_field")
    tags = [p for p in loc if isinstance(p, str) and p != "body" and _param((p,)) is None]
    field = next((str(p) for p in reversed(loc) if isinstance(p, str) and _param((p,)) == p), "")
    if tags and field in _UNION_HINTS:  # one of several accepted shapes: name them all
        return ApiError(400, f"`{param}` {_UNION_HINTS[field]}", param, "invalid_value")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return ApiError(400, f"`{param}`: {msg}{more}", param, "invalid_value")


_UNION_HINTS = {
    "prompt": "must be a string or a non-empty list of token ids (integers >= 0)",
    "stop": "must be a string or a list of at most 4 non-empty strings",
    "content": 'must be a string, null, or a list of {"type": "text", "text": ...} parts',
}


def _engine_error(exc: EngineError) -> ApiError:
    status = getattr(exc, "status", 500)
    if isinstance(exc, QueueFull):
        retry = max(1, math.ceil(exc.retry_after_s))
        return ApiError(
            429, str(exc) or "the server is busy", None, "rate_limit_exceeded", {"Retry-After": str(retry)}
        )
    if type(exc) is EngineError:  # the engine itself is down (shut down or failed): not the client's fault
        status = 503
    if status >= 500:
        log.error("engine error: %s", exc)
    code = "engine_unavailable" if status == 503 else "invalid_request" if status == 400 else "engine_error"
    return ApiError(status, str(exc) or type(exc).__name__, None, code)


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Service:
    """The handlers' shared state: engine, tokenizer, chat template, names and counters."""

    def __init__(self, engine: EngineAPI, settings: ServerSettings, metrics: HttpMetrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.tokenizer = load_tokenizer(settings.model_dir)
        self.template = ChatTemplate.load(settings.model_dir)
        self.model_name = settings.model_name or engine.model_name

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

    def submit(
        self,
        http: HttpRequest,
        body: schemas._Sampling,
        ids: list[int],
        max_tokens: int,
        prefix: str,
        stop_ids: tuple[int, ...] = (),
        stop_strings: tuple[str, ...] = (),
        logprobs: int | None = None,
    ) -> tuple[str, RequestHandle]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=body.stop_list + stop_strings,
            stop_token_ids=tuple(stop_ids) + tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
        tenant: str = http.scope.get("state", {}).get("tenant", DEFAULT_TENANT)
        request = Request(tuple(ids), sampling, salt=tenant_salt(tenant), request_id=rid)
        return rid, self.engine.submit(request)  # raises QueueFull / InvalidRequest

    # ---- running -------------------------------------------------------------------------------

    async def collect(self, http: HttpRequest, handle: RequestHandle) -> Collected:
        """Drain `handle` (text, token ids, finish reason, accounting, logprobs); cancel it if the
        client goes away."""

        async def drain() -> Collected:
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

        task: asyncio.Future[Collected] = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await http.is_disconnected():
                    self._gone(http, handle)
                    task.cancel()
                    raise ApiError(CLIENT_GONE, "client disconnected")
        except asyncio.CancelledError:
            self._gone(http, handle)
            task.cancel()
            raise

    def chat_logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        return schemas.chat_logprobs(lps, self.tokenizer.token_text, self.tokenizer.token_bytes)

    def _gone(self, http: HttpRequest, handle: RequestHandle) -> None:
        handle.cancel()
        self.metrics.disconnects.inc()
        http.scope.setdefault("state", {})["client_gone"] = True

    async def stream(
        self,
        http: HttpRequest,
        handle: RequestHandle,
        rid: str,
        chat: bool,
        body: schemas._Sampling,
        n_prompt: int,
        want_lps: bool = False,
    ) -> AsyncIterator[str]:
        """SSE events of `handle`; a client that stops reading cancels it."""
        name, n, ended, offset = self.model_name, 0, False, 0

        def chunk(
            text: str | None,
            finish: str | None,
            use: dict[str, Any] | None,
            ids: tuple[int, ...] = (),
            lps: tuple[TokenLogprob, ...] = (),
        ) -> dict[str, Any]:
            nonlocal offset
            if chat:
                delta = None if text is None else ({"content": text} if text or finish is None else {})
                lp = self.chat_logprobs(lps) if want_lps and text is not None else None
                out = schemas.chat_chunk(rid, name, delta, finish, use, lp)
            else:
                lp = None
                if want_lps and text is not None:
                    lp = schemas.completion_logprobs(lps, self.tokenizer.token_text, offset)
                    offset += sum(len(t) for t in lp["tokens"])
                out = schemas.completion(rid, name, text or "", finish, use, chunk=True, logprobs=lp)
                if text is None:
                    out["choices"] = []
            if body.return_token_ids and out["choices"]:
                out["choices"][0]["token_ids"] = list(ids)
            return out

        try:
            if chat:
                yield _data(schemas.chat_chunk(rid, name, {"role": "assistant", "content": ""}, None, None))
            async for d in handle:
                n += len(d.token_ids)
                if d.finished:
                    if d.error or d.finish_reason == "error":
                        msg = f"generation failed: {d.error or 'engine error'}"
                        yield _data(schemas.error_body(msg, "server_error", None, "engine_error"))
                    else:
                        use = schemas.usage(n_prompt, n, d.accounting)
                        last_use = None if body.include_usage else use
                        yield _data(
                            chunk(d.text, d.finish_reason or "stop", last_use, d.token_ids, d.logprobs)
                        )
                        if body.include_usage:
                            yield _data(chunk(None, None, use))
                    ended = True
                    break
                if d.text or ((body.return_token_ids or want_lps) and d.token_ids):
                    yield _data(chunk(d.text, None, None, d.token_ids, d.logprobs))
            ended = True
            yield "data: [DONE]\n\n"
        finally:
            if not ended:
                self._gone(http, handle)


@dataclass(frozen=True)
class Collected:
    """A finished request as the non-streaming endpoints answer it."""

    text: str
    ids: list[int]
    finish: str
    accounting: Any
    logprobs: list[TokenLogprob]


def _with_ids(
    response: dict[str, Any], body: schemas._Sampling, prompt: list[int], out: list[int]
) -> dict[str, Any]:
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt
        response["choices"][0]["token_ids"] = out
    return response


def create_app(engine: EngineAPI, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` under `settings` (the engine's lifetime is the caller's)."""
    metrics = HttpMetrics()
    svc = _Service(engine, settings, metrics)
    app = FastAPI(
        title="replaykv",
        summary="OpenAI-compatible server of DeepSeek-V4.1's KV-cache system",
        version="0.1.0",
    )
    app.state.service = svc
    app.state.http_metrics = metrics

    @app.exception_handler(ApiError)
    async def _on_api_error(_: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: HttpRequest, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(http: HttpRequest, exc: StarletteHTTPException) -> Response:
        message = {
            404: f"no such route: {http.method} {http.url.path}",
            405: f"{http.method} is not allowed on {http.url.path}",
        }
        return ApiError(
            exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=exc.headers
        ).response()

    @app.exception_handler(EngineError)
    async def _on_engine(_: HttpRequest, exc: EngineError) -> Response:
        return _engine_error(exc).response()

    @app.exception_handler(Exception)
    async def _on_crash(_: HttpRequest, exc: Exception) -> Response:
        log.exception("internal error")
        return ApiError(
            500, f"internal server error ({type(exc).__name__})", code="internal_error"
        ).response()

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, http: HttpRequest) -> Response:
        svc.check_model(body.model)
        ids = (
            svc.encode(body.prompt, "prompt", bos=True) if isinstance(body.prompt, str) else list(body.prompt)
        )
        max_tokens = svc.budget(len(ids), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        rid, handle = svc.submit(http, body, ids, max_tokens, "cmpl", logprobs=body.logprobs)
        if body.stream:
            events = svc.stream(http, handle, rid, False, body, len(ids), body.logprobs is not None)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        got = await svc.collect(http, handle)
        lp = None
        if body.logprobs is not None:
            lp = schemas.completion_logprobs(got.logprobs, svc.tokenizer.token_text)
        response = schemas.completion(
            rid, svc.model_name, got.text, got.finish, schemas.usage(len(ids), len(got.ids), got.accounting),
            logprobs=lp,
        )  # fmt: skip
        return JSONResponse(_with_ids(response, body, ids, got.ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, http: HttpRequest) -> Response:
        svc.check_model(body.model)
        if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
            raise ApiError(
                400, "give max_tokens or max_completion_tokens, not two different values", "max_tokens"
            )
        messages = [(m.role, m.text) for m in body.messages]
        for i, (_, text) in enumerate(messages):
            svc.encode(text, f"messages[{i}].content")
        try:
            ids = svc.template.render(messages, svc.tokenizer)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), e.param, "invalid_value") from e
        max_tokens = svc.budget(len(ids), body.requested_max_tokens, settings.default_max_tokens, "messages")
        stop_ids, stop_strings = (
            svc.template.stop_token_ids(svc.tokenizer),
            svc.template.stop_strings(svc.tokenizer),
        )
        rid, handle = svc.submit(
            http, body, ids, max_tokens, "chatcmpl", stop_ids, stop_strings, logprobs=body.logprobs_k
        )
        if body.stream:
            events = svc.stream(http, handle, rid, True, body, len(ids), body.logprobs_k is not None)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        got = await svc.collect(http, handle)
        use = schemas.usage(len(ids), len(got.ids), got.accounting)
        lp = svc.chat_logprobs(got.logprobs) if body.logprobs_k is not None else None
        response = schemas.chat_completion(rid, svc.model_name, got.text, got.finish, use, lp)
        return JSONResponse(_with_ids(response, body, ids, got.ids))

    def model_card() -> dict[str, Any]:
        return {
            "id": svc.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "replaykv",
            "max_model_len": engine.max_context,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        svc.check_model(model)
        return model_card()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": svc.model_name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = await run_in_threadpool(engine.metrics_text)
        if text and not text.endswith("\n"):
            text += "\n"
        return PlainTextResponse(
            text + metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.post("/admin/flush_swa_pool")
    async def flush_swa_pool() -> dict[str, Any]:
        await run_in_threadpool(engine.flush_swa_pool)
        return {"status": "ok", "flushed": "swa_pool"}

    @app.post("/admin/flush_writeback")
    async def flush_writeback() -> dict[str, Any]:
        await run_in_threadpool(engine.flush_writeback)
        return {"status": "ok", "flushed": "writeback"}

    @app.post("/admin/flush_all")
    async def flush_all() -> dict[str, Any]:
        await run_in_threadpool(engine.flush_all)
        return {"status": "ok", "flushed": "all"}

    @app.get("/admin/cache_stats")
    async def cache_stats() -> Response:
        stats = await run_in_threadpool(engine.cache_stats)
        return JSONResponse(jsonable_encoder(stats, custom_encoder={bytes: lambda b: b.hex()}))

    add_native_routes(app, svc, settings.server_args)
    app.add_middleware(
        _Gate, settings=settings, metrics=metrics, routes={getattr(r, "path", "") for r in app.routes}
    )
    return app
