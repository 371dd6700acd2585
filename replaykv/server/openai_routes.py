"""``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming or not.

For: turning a validated body into engine requests (one per choice), and their results into
OpenAI responses: image parts (checked, decoded off the event loop, placed as spans;
:mod:`replaykv.server.image_parts`), ``n`` choices (``best_of`` ranked by mean token
log-probability), ``echo``, log-probabilities, token ids, tool calls
(:mod:`replaykv.server.tools`), the ``response_format`` report
(:mod:`replaykv.server.response_format`) and usage (on a stream only with
``stream_options.include_usage``, in a last chunk without choices). Streamed choices interleave,
each chunk naming its ``index``; a choice that may still turn into a tool call is held back
until it is known, then sent as one ``tool_calls`` delta or as content.

Not for: validation rules (:mod:`replaykv.server.schemas`) or the engine calls themselves
(:mod:`replaykv.server.service`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from replaykv.engine.api import Accounting, RequestHandle, TokenLogprob
from replaykv.images import PreparedImage, PromptImage
from replaykv.server import schemas
from replaykv.server.chat import ChatTemplateError, Content, JinjaChatTemplate
from replaykv.server.errors import ApiError
from replaykv.server.image_parts import decode_images, image_parts, message_content, place
from replaykv.server.response_format import conformance
from replaykv.server.service import Collected, Service, sse
from replaykv.server.tools import (
    FINISH_TOOL_CALLS,
    Function,
    call_text,
    forced_opening,
    may_become_call,
    parse_calls,
    with_tools,
)

log = logging.getLogger("replaykv.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache"}


def add_openai_routes(app: FastAPI, svc: Service, default_max_tokens: int) -> None:
    """Register both endpoints on `app`."""

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, http: HttpRequest) -> Response:
        svc.check_model(body.model)
        ids = (
            svc.encode(body.prompt, "prompt", bos=True) if isinstance(body.prompt, str) else list(body.prompt)
        )
        max_tokens = svc.budget(len(ids), body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        rid = svc.new_id("cmpl")
        headers = svc.note_ignored(body, rid)
        count = body.candidates
        ranked = count > body.n  # best_of: the engine reports logprobs to rank by
        lps_k = body.logprobs if body.logprobs is not None else (0 if ranked else None)
        handles = svc.submit(http, body, ids, max_tokens, rid, count, logprobs=lps_k)
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else svc.tokenizer.decode(ids)
        if body.stream:
            events = _stream_completion(svc, http, handles, rid, body, len(ids), echo)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
            )
        got = await svc.collect(http, handles)
        order = sorted(range(count), key=lambda i: -got[i].mean_logprob)[: body.n] if ranked else range(count)
        choices = []
        for index, i in enumerate(order):
            g = got[i]
            lp = svc.completion_logprobs(g.logprobs) if body.logprobs is not None else None
            choices.append(schemas.completion_choice(index, echo + g.text, g.finish, lp))
        use = schemas.usage(len(ids), sum(len(g.ids) for g in got), [got[i].accounting for i in order])
        response = schemas.completion(rid, svc.model_name, choices, use)
        _with_ids(response, body, ids, [got[i].ids for i in order])
        return JSONResponse(response, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, http: HttpRequest) -> Response:
        svc.check_model(body.model)
        if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
            raise ApiError(
                400, "give max_tokens or max_completion_tokens, not two different values", "max_tokens"
            )
        functions = [Function.of(t.function.name, t.function.parameters) for t in body.tools or ()]
        found = image_parts(body.messages, svc.vision, svc.image_limits, svc.model_name)
        prepared: list[PreparedImage] = []
        if found and svc.vision is not None:  # decoding is CPU work: off the event loop
            prepared = await run_in_threadpool(decode_images, found, svc.vision, svc.image_limits)
        ids, images = _chat_prompt(svc, body, functions, prepared)
        choice = body.tool_choice_name
        opening = forced_opening(choice, functions)
        ids += svc.encode(opening, "tool_choice")
        max_tokens = svc.budget(len(ids), body.requested_max_tokens, default_max_tokens, "messages")
        rid = svc.new_id("chatcmpl")
        headers = svc.note_ignored(body, rid)
        handles = svc.submit(
            http,
            body,
            ids,
            max_tokens,
            rid,
            body.n,
            svc.template.stop_token_ids(svc.tokenizer),
            svc.template.stop_strings(svc.tokenizer),
            logprobs=body.logprobs_k,
            images=images,
        )
        answers = _ChatAnswers(svc, body, rid, functions, opening)
        if body.stream:
            events = answers.stream(http, handles, len(ids))
            return StreamingResponse(
                events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
            )
        got = await svc.collect(http, handles)
        choices = [answers.choice(i, g) for i, g in enumerate(got)]
        use = schemas.usage(
            len(ids), sum(len(g.ids) for g in got), [g.accounting for g in got], answers.reports(got)
        )
        response = schemas.chat_completion(rid, svc.model_name, choices, use)
        _with_ids(response, body, ids, [g.ids for g in got])
        return JSONResponse(response, headers=headers)


def _chat_prompt(
    svc: Service,
    body: schemas.ChatCompletionRequest,
    functions: list[Function],
    prepared: list[PreparedImage],
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """Prompt ids of the request's messages, tool calls and tools, and the prompt's images
    (`prepared`: the request's images in order, decoded)."""
    messages: list[tuple[str, Content]] = []
    first_image = 0
    for i, m in enumerate(body.messages):
        text = m.text
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, "only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            try:
                calls = [call_text(c.function.name, c.function.arguments) for c in m.tool_calls]
            except ValueError as e:
                raise ApiError(400, str(e), f"messages[{i}].tool_calls", "invalid_value") from e
            text = "\n".join([*([text] if text else []), *calls])
        svc.encode(text, f"messages[{i}].content")
        if m.image_count:  # a user message: text pieces and image slots
            messages.append((m.role, message_content(m, svc.vision, prepared, first_image)))
            first_image += m.image_count
        else:
            messages.append((m.role, text))
    template = svc.template
    try:
        if isinstance(template, JinjaChatTemplate) and "tools" in template.source and body.tools:
            tools = [t.model_dump() for t in body.tools]
            ids, starts = template.render_with_images(messages, svc.tokenizer, tools=tools)
        else:
            ids, starts = template.render_with_images(with_tools(messages, functions), svc.tokenizer)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from e
    return ids, place(prepared, starts)


def _with_ids(
    response: dict[str, Any], body: schemas._Sampling, prompt: list[int], outs: Sequence[list[int]]
) -> None:
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt
        for choice, out in zip(response["choices"], outs, strict=True):
            choice["token_ids"] = out


async def _stream_completion(
    svc: Service,
    http: HttpRequest,
    handles: list[RequestHandle],
    rid: str,
    body: schemas.CompletionRequest,
    n_prompt: int,
    echo: str,
) -> AsyncIterator[str]:
    name, with_usage, want_lps = svc.model_name, body.include_usage, body.logprobs is not None
    n = len(handles)
    offsets, counts = [len(echo)] * n, [0] * n
    accs: list[Accounting | None] = [None] * n
    ended = False

    def chunk(i: int, text: str, finish: str | None, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> str:
        lp = None
        if want_lps:
            lp = svc.completion_logprobs(tuple(lps), offsets[i])
            offsets[i] += sum(len(t) for t in lp["tokens"])
        out = schemas.completion(
            rid, name, [schemas.completion_choice(i, text, finish, lp)], None, with_usage=with_usage
        )
        if body.return_token_ids:
            out["choices"][0]["token_ids"] = list(ids)
        return sse(out)

    try:
        if echo:
            for i in range(n):
                yield chunk(i, echo, None, (), ())
        async for i, d in svc.merged(handles):
            counts[i] += len(d.token_ids)
            if d.finished:
                if d.error or d.finish_reason == "error":
                    msg = f"generation failed: {d.error or 'engine error'}"
                    yield sse(schemas.error_body(msg, "server_error", None, "engine_error"))
                    continue
                accs[i] = d.accounting
                yield chunk(i, d.text, d.finish_reason or "stop", d.token_ids, d.logprobs)
            elif d.text or ((body.return_token_ids or want_lps) and d.token_ids):
                yield chunk(i, d.text, None, d.token_ids, d.logprobs)
        if with_usage:
            use = schemas.usage(n_prompt, sum(counts), accs)
            yield sse(schemas.completion(rid, name, [], use))
        ended = True
        yield DONE
    finally:
        if not ended:
            svc.gone(http, handles)


class _ChatAnswers:
    """How the choices of one chat request become messages, chunks and reports."""

    def __init__(
        self,
        svc: Service,
        body: schemas.ChatCompletionRequest,
        rid: str,
        functions: list[Function],
        opening: str,
    ) -> None:
        self.svc, self.body, self.rid, self.functions, self.opening = svc, body, rid, functions, opening
        self.parse = body.tool_choice_name not in (None, "none")

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        if not self.parse:
            return None
        calls = parse_calls(text, self.functions, self.body.parallel_tool_calls)
        if calls is None and self.opening:
            log.warning(
                "%s: tool_choice %r asked for a tool call, but the answer is not one; returned as text",
                self.rid,
                self.body.tool_choice_name,
            )
        return calls

    def choice(self, index: int, got: Collected) -> dict[str, Any]:
        text = self.opening + got.text
        calls = self.calls(text)
        message = schemas.chat_message(None, calls) if calls else schemas.chat_message(text)
        lp = self.svc.chat_logprobs(got.logprobs) if self.body.logprobs_k is not None else None
        return schemas.chat_choice(index, message, FINISH_TOOL_CALLS if calls else got.finish, lp)

    def reports(self, texts: Sequence[Collected | str]) -> list[dict[str, Any]] | None:
        """The response_format conformance of each choice (None without response_format)."""
        rf = self.body.response_format
        if rf is None:
            return None
        out = []
        for i, got in enumerate(texts):
            text = got if isinstance(got, str) else self.opening + got.text
            report = {
                "index": i,
                **conformance(rf.type, rf.json_schema.schema_ if rf.json_schema else None, text),
            }
            if not report["valid"]:
                log.warning(
                    "%s: choice %d does not match response_format %s: %s",
                    self.rid,
                    i,
                    rf.type,
                    report["error"],
                )
            out.append(report)
        return out

    async def stream(
        self, http: HttpRequest, handles: list[RequestHandle], n_prompt: int
    ) -> AsyncIterator[str]:
        svc, body, name = self.svc, self.body, self.svc.model_name
        with_usage, want_lps = body.include_usage, body.logprobs_k is not None
        n = len(handles)
        texts = [self.opening] * n  # each choice's whole answer so far
        holding = [self.parse] * n  # may still become a tool call: nothing sent yet
        held: list[tuple[list[int], list[TokenLogprob]]] = [([], []) for _ in range(n)]
        counts = [0] * n
        accs: list[Accounting | None] = [None] * n
        ended = False

        def chunk(
            i: int, delta: dict[str, Any], finish: str | None, ids: Sequence[int], lps: Sequence[TokenLogprob]
        ) -> str:
            lp = svc.chat_logprobs(tuple(lps)) if want_lps else None
            out = schemas.chat_chunk(self.rid, name, i, delta, finish, None, lp, with_usage)
            if body.return_token_ids:
                out["choices"][0]["token_ids"] = list(ids)
            return sse(out)

        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, None, (), ())
            async for i, d in svc.merged(handles):
                counts[i] += len(d.token_ids)
                if d.finished and (d.error or d.finish_reason == "error"):
                    msg = f"generation failed: {d.error or 'engine error'}"
                    yield sse(schemas.error_body(msg, "server_error", None, "engine_error"))
                    continue
                texts[i] += d.text
                if d.finished:
                    accs[i] = d.accounting
                ids, lps = list(d.token_ids), list(d.logprobs)
                if holding[i]:
                    held[i][0].extend(ids)
                    held[i][1].extend(lps)
                    if not d.finished and may_become_call(texts[i]):
                        continue
                    holding[i] = False
                    ids, lps = held[i]
                    calls = self.calls(texts[i]) if d.finished else None
                    if calls:
                        deltas = [{"index": j, **c} for j, c in enumerate(calls)]
                        yield chunk(i, {"tool_calls": deltas}, FINISH_TOOL_CALLS, ids, lps)
                        continue
                    text = texts[i]  # everything held back, the opening included
                else:
                    text = d.text
                if d.finished:
                    yield chunk(i, {"content": text} if text else {}, d.finish_reason or "stop", ids, lps)
                elif text or ((body.return_token_ids or want_lps) and ids):
                    yield chunk(i, {"content": text}, None, ids, lps)
            if with_usage:
                use = schemas.usage(n_prompt, sum(counts), accs, self.reports(texts))
                yield sse(schemas.chat_chunk(self.rid, name, None, None, None, use, with_usage=True))
            else:
                self.reports(texts)  # logged
            ended = True
            yield DONE
        finally:
            if not ended:
                svc.gone(http, handles)
