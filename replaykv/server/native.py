"""SGLang's native endpoints, for scripts written against an SGLang server.

``GET /health_generate`` (generates one token; 200, or 503 when the engine cannot),
``GET /get_model_info``, ``GET /get_server_info`` (the settings, secrets redacted, and the
replay switches), ``GET /version``, ``POST /tokenize`` and ``POST /detokenize`` (one text or
token list, or a batch of them). SGLang's ``POST /flush_cache`` corresponds to the admin key's
``POST /admin/flush_all`` (every cached state) and ``/admin/flush_swa_pool`` (window snapshots
only): flushing is an admin action here.

With API keys configured, the tokenizer and server-info endpoints need a tenant's key like
``/v1``; ``/health_generate`` and ``/version`` stay open as ``/health`` and ``/metrics`` do.

Not for: the OpenAI routes (:mod:`replaykv.server.app`) or SGLang's ``/generate``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

import replaykv
from replaykv.engine.api import EngineError, Request, SamplingParams
from replaykv.server.tenants import DEFAULT_TENANT, tenant_salt

if TYPE_CHECKING:
    from replaykv.server.service import Service

log = logging.getLogger("replaykv.server")

AUTHENTICATED_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/get_model_info", "/get_server_info", "/model_info", "/server_info"}
)
"""Native paths that need an API key when keys are configured (the others are open)."""
HEALTH_GENERATE_TIMEOUT_S = 20.0

TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``add_special_tokens`` puts the beginning-of-text token first."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: one list of token ids, or a batch of lists."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[TokenId] | list[list[TokenId]]


def add_native_routes(app: FastAPI, svc: Service, server_args: Mapping[str, Any]) -> None:
    """Register the endpoints above on `app`; `server_args` is what /get_server_info shows."""
    from replaykv.server.errors import ApiError

    engine = svc.engine

    def check_model(model: str | None) -> None:
        if model is not None:
            svc.check_model(model)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": replaykv.__version__}

    @app.get("/get_model_info")
    @app.get("/model_info")  # the newer name, which sgl-router asks for
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": svc.settings.model_dir,
            "tokenizer_path": svc.settings.model_dir,
            "served_model_name": svc.model_name,
            "is_generation": True,
            "max_model_len": engine.max_context,
            "vocab_size": svc.tokenizer.vocab_size,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        # the served values last: the settings hold None where the engine chose (e.g. the name)
        return {**server_args, "version": replaykv.__version__, "served_model_name": svc.model_name,
                "max_model_len": engine.max_context}  # fmt: skip

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        bos = svc.tokenizer.bos_id
        prompt = (bos if bos is not None else 0,)
        request = Request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                          salt=tenant_salt(DEFAULT_TENANT), request_id="health-generate")  # fmt: skip
        handle = None
        try:
            handle = engine.submit(request)
            result = await asyncio.to_thread(handle.result, HEALTH_GENERATE_TIMEOUT_S)
        except (EngineError, TimeoutError, RuntimeError) as e:
            if handle is not None:
                handle.cancel()
            log.warning("health_generate: the engine did not generate a token: %s", e)
            return JSONResponse({"status": "unhealthy", "error": str(e) or type(e).__name__}, status_code=503)
        if len(result.token_ids) != 1:
            log.warning("health_generate: generated %d tokens, expected 1 (%s)",
                        len(result.token_ids), result.finish_reason)  # fmt: skip
            return JSONResponse({"status": "unhealthy", "error": f"finish reason {result.finish_reason}"},
                                status_code=503)  # fmt: skip
        return JSONResponse({"status": "ok", "model": svc.model_name})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        ids = [svc.encode(t, "prompt", bos=body.add_special_tokens) for t in texts]
        if isinstance(body.prompt, str):
            return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": engine.max_context}
        return {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": engine.max_context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        batch = bool(body.tokens) and isinstance(body.tokens[0], list)
        lists: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment,list-item]
        vocab = svc.tokenizer.vocab_size
        for ids in lists:
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})",
                               "tokens", "invalid_value")  # fmt: skip
        texts = [svc.tokenizer.decode(ids) for ids in lists]
        return {"text": texts if batch else texts[0]}
