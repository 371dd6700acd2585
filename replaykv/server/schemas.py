"""The OpenAI-compatible request bodies (strict, unknown fields refused) and response shapes.

Requests are pydantic models with ``extra="forbid"`` and ``strict=True``: an unknown field, a
string where a number belongs, ``true`` as a token id or a NaN temperature are all 400s (the
app turns validation errors into OpenAI's error shape). OpenAI options this server cannot
honour (``n`` > 1, ``echo``, ``best_of``, ``suffix``, penalties, ``logit_bias``) are accepted
only at their neutral value and otherwise refused with a message naming them. Log-probabilities
of generated tokens are served (completions ``logprobs``: k; chat ``logprobs`` + ``top_logprobs``;
k ≤ 20), under the model's distribution before temperature / top-k / top-p; token names are
unique (bytes that are not ASCII read ``bytes:\\xNN``, specials by name).
``cache_salt`` (and ``salt``, ``tenant``) is refused: the server derives the cache salt from
the API key, so a client can never pick another tenant's. ``user`` is accepted and ignored.

Extensions beyond OpenAI (vLLM's names): ``top_k`` (0 or -1 = off), ``ignore_eos``,
``stop_token_ids`` (token ids that end the request, beside end-of-text) and ``return_token_ids`` (the response then carries ``prompt_token_ids`` and each choice, or each
streamed chunk, its ``token_ids``). Each response's
``usage`` carries ``prompt_tokens_details.cached_tokens`` and a ``replaykv`` object (path,
replayed tokens, prefill work).

Not for: validation that needs the engine (context length, token ids beyond the vocabulary;
see :mod:`replaykv.server.app`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from replaykv.engine.api import Accounting, TokenLogprob

SERVER_SIDE_FIELDS = ("cache_salt", "salt", "tenant")
"""Fields a client might send to choose a cache namespace; always refused (400)."""

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # field → the only values accepted (OpenAI options this server does not implement)
    _NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @classmethod
    def _only_neutral(cls, value: Any, name: str) -> Any:
        allowed = cls._NEUTRAL[name]
        if value not in allowed:
            shown = " or ".join("null" if a is None else repr(a) for a in allowed)
            raise ValueError(f"not supported by this server (only {shown} is accepted)")
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, lt=2**31)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None

    _NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "n": (1,),
        "presence_penalty": (0.0,),
        "frequency_penalty": (0.0,),
        "logit_bias": (None, {}),
    }

    @field_validator("n", "presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        return cls._only_neutral(value, str(info.field_name))

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: `prompt` is a string (BOS is put first) or a list of token ids."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_Sampling._NEUTRAL,
        "echo": (False,),
        "best_of": (None, 1),
        "suffix": (None,),
    }

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _neutral_c(cls, value: Any, info: ValidationInfo) -> Any:
        return cls._only_neutral(value, str(info.field_name))


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered by the chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token for the engine (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------------------------
# responses (plain dicts: they are built on the streaming hot path)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, acc: Accounting | None) -> dict[str, Any]:
    """OpenAI usage plus ``prompt_tokens_details.cached_tokens`` and the ``replaykv`` extension
    (the engine's prompt count wins over the server's when it reports one)."""
    cached = acc.cached_tokens if acc is not None else 0
    if acc is not None:
        prompt_tokens = acc.prompt_tokens
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if acc is not None:
        out["replaykv"] = {
            "path": acc.path,
            "cached_tokens": acc.cached_tokens,
            "replayed_tokens": acc.replayed_tokens,
            "prefill_work": acc.prefill_work,
            "full_prefill_work": acc.full_prefill_work,
            "snapshot_hit": acc.snapshot_hit,
            "window_floors": list(acc.window_floors),
            "reasons": list(acc.reasons),
        }
    return out


def completion_logprobs(
    lps: Sequence[TokenLogprob], name: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of `lps` (``text_offset`` counts token names
    from `offset`)."""
    tokens = [name(lp.token_id) for lp in lps]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{name(i): v for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(
    lps: Sequence[TokenLogprob], name: Callable[[int], str], raw: Callable[[int], list[int]]
) -> dict[str, Any]:
    """The chat ``logprobs`` object of `lps`."""
    return {
        "content": [
            {
                "token": name(lp.token_id),
                "logprob": lp.logprob,
                "bytes": raw(lp.token_id),
                "top_logprobs": [{"token": name(i), "logprob": v, "bytes": raw(i)} for i, v in lp.top],
            }
            for lp in lps
        ]
    }


def completion(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    use: dict[str, Any] | None,
    chunk: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A text completion, or one chunk of a streamed one (``usage`` only where given)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if use is not None or not chunk:
        out["usage"] = use
    return out


def chat_completion(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    use: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": use,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None,
    use: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chat chunk; ``delta=None`` gives the usage-only chunk (``choices: []``)."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out
