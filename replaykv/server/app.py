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

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replaykv.engine.api import EngineAPI, EngineError
from replaykv.server.errors import CLIENT_GONE, ApiError, engine_error, validation_error
from replaykv.server.metrics import ServerMetrics, encode
from replaykv.server.native import AUTHENTICATED_PATHS, add_native_routes
from replaykv.server.openai_routes import add_openai_routes
from replaykv.server.service import Service
from replaykv.server.settings import ServerSettings
from replaykv.server.tenants import DEFAULT_TENANT

log = logging.getLogger("replaykv.server")


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
        self, app: ASGIApp, settings: ServerSettings, metrics: ServerMetrics, routes: set[str]
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


def create_app(engine: EngineAPI, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` under `settings` (the engine's lifetime is the caller's)."""
    metrics = ServerMetrics(engine)
    svc = Service(engine, settings, metrics)
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
        return validation_error(exc).response()

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
        return engine_error(exc).response()

    @app.exception_handler(Exception)
    async def _on_crash(_: HttpRequest, exc: Exception) -> Response:
        log.exception("internal error")
        return ApiError(
            500, f"internal server error ({type(exc).__name__})", code="internal_error"
        ).response()

    add_openai_routes(app, svc, settings.default_max_tokens)

    def model_card() -> dict[str, Any]:
        return {
            "id": svc.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "replaykv",
            "max_model_len": engine.max_context,
            **{k: v for k, v in engine.model_identity.items() if k != "model"},
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
    async def prometheus(request: HttpRequest) -> Response:
        # Collecting reads every tier's stats under their locks: off the event loop.
        body, content_type = await run_in_threadpool(
            encode, metrics.registry, request.headers.get("accept"), request.query_params.getlist("name[]")
        )
        return Response(body, media_type=content_type)

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
