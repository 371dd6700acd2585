"""Errors in OpenAI's shape, and how request-validation and engine errors map onto them.

For: :class:`ApiError` (status, message, ``param``, ``code``, extra headers) and the mapping of
pydantic validation errors (a 400 naming the field) and engine errors (``InvalidRequest`` → 400,
``QueueFull`` → 429 with ``Retry-After``, the engine down → 503) to it. Not for: deciding what
is valid (:mod:`replaykv.server.schemas`, the engine).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from replaykv.engine.api import EngineError, QueueFull
from replaykv.server import schemas

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


def validation_error(exc: RequestValidationError) -> ApiError:
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
    "content": (
        'must be a string, null, or a list of {"type": "text", "text": ...} and '
        '{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} parts'
    ),
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


def engine_error(exc: EngineError) -> ApiError:
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
