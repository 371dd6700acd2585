"""The OpenAI-compatible request bodies (strict, unknown fields refused) and response shapes.

Requests are pydantic models with ``extra="forbid"`` and ``strict=True``: an unknown field, a
string where a number belongs, ``true`` as a token id or a NaN temperature are all 400s (the
app turns validation errors into OpenAI's error shape). Served: ``n`` (≤ 16 choices),
``best_of`` (completions; the choices with the highest mean token log-probability), ``echo``
(completions, not with ``logprobs``), ``seed``, ``stop``, ``logit_bias``, ``presence_penalty``,
``frequency_penalty`` and, as vLLM names them, ``min_p`` and ``repetition_penalty``; ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (see :mod:`replaykv.server.tools`);
``response_format`` (checked, not enforced: :mod:`replaykv.server.response_format`).
:data:`IGNORED_FIELDS` (``store``, ``metadata``, ``service_tier``, …) are accepted, have no effect
here, and are named in the log and in the ``X-Replaykv-Ignored-Fields`` response header.
``suffix`` is refused unless null (insertion is not implemented). Log-probabilities
of generated tokens are served (completions ``logprobs``: k; chat ``logprobs`` + ``top_logprobs``;
k ≤ 20), under the model's distribution before temperature / top-k / top-p; token names are
unique (bytes that are not ASCII read ``bytes:\\xNN``, specials by name).
``cache_salt`` (and ``salt``, ``tenant``) is refused: the server derives the cache salt from
the API key, so a client can never pick another tenant's.

SGLang's extensions, which its router (sgl-router) forwards with every request:
``no_stop_trim`` (served: the stop token or string stays in the output), ``skip_special_tokens``
and ``spaces_between_special_tokens`` (true only), ``return_hidden_states`` (false only); in
chat, ``separate_reasoning`` and ``stream_reasoning`` (no reasoning parser runs, so they change
nothing), ``continue_final_message`` (false only) and ``chat_template_kwargs`` (empty only).

A chat message's ``content`` may be a list of ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": ...}}``
parts (images in user messages, for a model with a vision tower; :mod:`replaykv.server.image_parts`).

Extensions beyond OpenAI (vLLM's names): ``top_k`` (0 or -1 = off), ``ignore_eos``,
``stop_token_ids`` (token ids that end the request, beside end-of-text) and ``return_token_ids`` (the response then carries ``prompt_token_ids`` and each choice, or each
streamed chunk, its ``token_ids``). Each response's
``usage`` carries ``prompt_tokens_details.cached_tokens`` and a ``replaykv`` object (path,
replayed tokens, prefill work; docs/server.md lists its fields). A stream carries usage only
when ``stream_options.include_usage`` asks for it: in one last chunk with no choices.

Not for: validation that needs the engine (context length, token ids beyond the vocabulary;
see :mod:`replaykv.server.app`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from replaykv.engine.api import Accounting, TokenLogprob
from replaykv.server.response_format import check_schema

SERVER_SIDE_FIELDS = ("cache_salt", "salt", "tenant")
"""Fields a client might send to choose a cache namespace; always refused (400)."""

IGNORED_FIELDS = ("store", "metadata", "service_tier", "user", "prompt_cache_key", "safety_identifier")
"""OpenAI fields accepted for compatibility that change nothing here (logged, never a 400)."""

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 1024


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
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    # accepted, no effect here (IGNORED_FIELDS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None
    # SGLang's extensions, which sgl-router forwards with every request (SGLANG_FIELDS)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_hidden_states: bool = False

    _NEUTRAL_SAMPLING: ClassVar[dict[str, tuple[Any, ...]]] = {
        "skip_special_tokens": (True,),
        "spaces_between_special_tokens": (True,),
        "return_hidden_states": (False,),
    }

    @field_validator("skip_special_tokens", "spaces_between_special_tokens", "return_hidden_states")
    @classmethod
    def _neutral_sglang(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls._NEUTRAL_SAMPLING[str(info.field_name)]
        if value not in allowed:
            raise ValueError(f"not supported by this server (only {allowed[0]!r} is accepted)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in value.items():
            if not key.isdigit() or int(key) >= 2**31:
                raise ValueError(f"keys must be token ids written as decimal strings; got {key!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"values must be in [-100, 100]; got {bias} for token {key}")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The :data:`IGNORED_FIELDS` this request set (to log and report)."""
        return tuple(f for f in IGNORED_FIELDS if f in self.model_fields_set)

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
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    _NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": (None,)}

    @field_validator("suffix")
    @classmethod
    def _neutral_c(cls, value: Any, info: ValidationInfo) -> Any:
        return cls._only_neutral(value, str(info.field_name))

    @model_validator(mode="after")
    def _combinations(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError("best_of", "best_of must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise PydanticCustomError(
                "best_of", "best_of > n cannot be streamed (the best are known at the end)"
            )
        if self.echo and self.logprobs is not None:
            raise PydanticCustomError(
                "echo",
                "echo with logprobs would return the prompt's log-probabilities, which this server does "
                "not compute; drop one of them",
            )
        return self

    @property
    def candidates(self) -> int:
        """How many completions to generate (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n


class TextPart(_Body):
    type: Literal["text"]
    text: str


IMAGE_DETAILS = ("auto", "low", "high")


class ImageURL(_Body):
    """OpenAI's ``image_url`` object. Only ``data:image/...;base64,`` URLs are served (the server
    fetches nothing); ``detail`` is accepted and changes nothing (the model's resize plan is fixed)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
PART_TYPES = ("text", "image_url")


def _check_parts(value: Any) -> Any:
    """Name the first malformed content part in words (pydantic's union errors would only say
    that none of the accepted shapes matched)."""
    if not isinstance(value, list):
        return value
    for j, part in enumerate(value):
        where = f"part {j}"
        if not isinstance(part, dict):
            raise ValueError(f'{where} must be an object {{"type": ..., ...}}')
        kind = part.get("type")
        if kind not in PART_TYPES:
            shown = "no type" if kind is None else f"type {kind!r}"
            raise ValueError(
                f"{where} has {shown}; the part types served are {' and '.join(map(repr, PART_TYPES))}"
            )
        extra = sorted(set(part) - {"type", kind})
        if extra:
            raise ValueError(f"{where} ({kind}) has unknown fields {extra}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f'{where} is a text part without a string "text"')
        if kind == "image_url":
            image = part.get("image_url")
            if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
                raise ValueError(
                    f'{where} is an image part without "image_url": {{"url": "data:image/...;base64,..."}}'
                )
            extra = sorted(set(image) - {"url", "detail"})
            if extra:
                raise ValueError(f"{where}: image_url has unknown fields {extra}")
            if image.get("detail") not in (None, *IMAGE_DETAILS):
                raise ValueError(f"{where}: image_url.detail must be one of {list(IMAGE_DETAILS)} or null")
    return value


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=dict)
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "response_format", "json_schema is required with type json_schema, and only with it"
            )
        if self.json_schema is not None:
            try:
                check_schema(self.json_schema.schema_)
            except ValueError as e:
                raise PydanticCustomError("response_format", str(e)) from e
        return self


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _check_parts(value)

    @property
    def text(self) -> str:
        """The content's text (image parts left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def image_count(self) -> int:
        if not isinstance(self.content, list):
            return 0
        return sum(isinstance(part, ImagePart) for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered by the chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # SGLang: a reasoning parser's switches; none runs here, so there is nothing to separate
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _no_continue(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by this server (only false is accepted)")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("not supported by this server (only null or {} is accepted)")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "tool function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError(
                "tool_choice", f"tool_choice names {choice.function.name!r}, which is not among tools"
            )
        if choice == "required" and not names:
            raise PydanticCustomError("tool_choice", "tool_choice 'required' needs tools")
        if names and self.response_format is not None and self.response_format.type != "text":
            raise PydanticCustomError(
                "response_format", "response_format JSON modes cannot be combined with tools"
            )
        return self

    @property
    def tool_choice_name(self) -> str | None:
        """tool_choice as one string: "none" / "auto" / "required" / a function name (None: no tools)."""
        if not self.tools or self.tool_choice == "none":
            return "none" if self.tools else None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

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


def accounting(acc: Accounting) -> dict[str, Any]:
    """The ``usage.replaykv`` object of one engine request (fields listed in docs/server.md)."""
    return {
        "path": acc.path,
        "cached_tokens": acc.cached_tokens,
        "replayed_tokens": acc.replayed_tokens,
        "prefill_work": acc.prefill_work,
        "full_prefill_work": acc.full_prefill_work,
        "snapshot_hit": acc.snapshot_hit,
        "window_floors": list(acc.window_floors),
        "reasons": list(acc.reasons),
    }


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    accs: Sequence[Accounting | None],
    response_format: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """OpenAI usage plus ``prompt_tokens_details`` (``cached_tokens``, and ``image_tokens``: the
    prompt positions inside image spans, which ``prompt_tokens`` counts too) and the ``replaykv``
    extension.

    `accs`: one accounting per generated choice. The prompt counts once (the first choice's
    engine count wins over the server's); with several choices ``replaykv`` is the first one's
    with ``choices`` (each choice's object) added. `response_format`: one conformance report
    per choice.
    """
    first = accs[0] if accs else None
    if first is not None:
        prompt_tokens = first.prompt_tokens
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": first.cached_tokens if first is not None else 0,
            "image_tokens": first.image_tokens if first is not None else 0,
        },
    }
    if first is not None:
        ext = accounting(first)
        if len(accs) > 1:
            ext["choices"] = [accounting(a) if a is not None else None for a in accs]
        if response_format is not None:
            ext["response_format"] = list(response_format)
        out["replaykv"] = ext
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


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(
    rid: str,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any] | None,
    with_usage: bool = True,
) -> dict[str, Any]:
    """A text completion, or one chunk of a streamed one: a chunk carries ``usage`` only with
    `with_usage` (``include_usage``), null until the usage-only chunk."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if with_usage or use is not None:
        out["usage"] = use
    return out


def chat_message(text: str | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_choice(
    index: int, message: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chat_chunk(
    rid: str,
    model: str,
    index: int | None,
    delta: dict[str, Any] | None,
    finish_reason: str | None,
    use: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chat chunk of choice `index`; ``index=None`` gives the usage-only chunk
    (``choices: []``). With `with_usage` (``include_usage``) every chunk carries ``usage``
    (null until the last one), as OpenAI streams it."""
    choices = (
        []
        if index is None or delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if with_usage or use is not None:
        out["usage"] = use
    return out
