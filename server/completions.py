"""/v1/completions responses: one `text_completion`, or `text_completion` chunks (text chunks,
finish chunk, optional usage chunk, [DONE]); `echo` puts the prompt first. Per-request `metrics`
are placed as in chat.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from server.logprobs import CompletionLogprobs, merge, prompt_logprobs_body
from server.schemas import CompletionRequest
from server.serving import (
    ResponseContext,
    Tracker,
    chain,
    finish_event,
    guarded_stream,
    sse,
    usage_event,
)
from stages.api import EngineClient, RequestOutput, TextPrompt


def _body(
    ctx: ResponseContext, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.system_fingerprint,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def _choice(
    text: str,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


class _Echo:
    """The prompt's text (and its logprobs) that `echo` puts ahead of the completion."""

    def __init__(
        self, engine: EngineClient, request: CompletionRequest, first: RequestOutput
    ) -> None:
        prompt = request.prompt_value()
        prompt_ids = first.prompt_token_ids or ()
        if isinstance(prompt, TextPrompt):
            self.text = prompt.text
        else:
            self.text = engine.detokenize(prompt.token_ids)
        self.logprobs: dict[str, Any] | None = None
        if request.logprobs is not None:
            first_text = engine.detokenize(prompt_ids[:1]) if prompt_ids else ""
            self.logprobs = CompletionLogprobs(request.logprobs).prompt_entries(
                first_text, first.prompt_logprobs or ()
            )


def stream_completion(
    ctx: ResponseContext,
    engine: EngineClient,
    request: CompletionRequest,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    tracker: Tracker,
) -> AsyncGenerator[bytes, None]:
    def usage_now() -> dict[str, int] | None:
        return tracker.usage if request.continuous_usage else None

    async def body() -> AsyncIterator[bytes]:
        text_offset = 0
        if request.echo:
            echo = _Echo(engine, request, first)
            text_offset = len(echo.text)
            yield sse(_body(ctx, [_choice(echo.text, echo.logprobs)], usage_now()))
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs(request.logprobs, text_offset)
        async for output in chain(first, outputs, tracker):
            if output.text or output.logprobs:
                entries = logprobs.entries(output.logprobs or ()) if logprobs is not None else None
                yield sse(_body(ctx, [_choice(output.text, entries)], usage_now()))
            if output.finish_reason is not None:
                choice = _choice("", None, output.finish_reason, output.stop_reason)
                finish = _body(ctx, [choice], usage_now())
                yield finish_event(finish, ctx, tracker, request.include_usage)
        if request.include_usage:
            yield usage_event(_body(ctx, [], tracker.usage), ctx, tracker)

    return guarded_stream(body(), outputs, tracker, ctx.request_id)


async def collect_completion(
    ctx: ResponseContext,
    engine: EngineClient,
    request: CompletionRequest,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    tracker: Tracker,
) -> dict[str, Any]:
    texts: list[str] = []
    logprobs: dict[str, Any] | None = None
    if request.echo:
        echo = _Echo(engine, request, first)
        texts.append(echo.text)
        logprobs = echo.logprobs
    builder = None
    if request.logprobs is not None:
        builder = CompletionLogprobs(request.logprobs, len(texts[0]) if texts else 0)
    async for output in chain(first, outputs, tracker):
        texts.append(output.text)
        if builder is not None:
            logprobs = merge(logprobs, builder.entries(output.logprobs or ()))
    choice = _choice("".join(texts), logprobs, tracker.finish_reason, tracker.stop_reason)
    if request.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_body(
            first.prompt_logprobs or (), request.prompt_logprobs
        )
    response = _body(ctx, [choice], tracker.usage)
    if ctx.include_request_metrics:
        response["metrics"] = tracker.metrics_body()
    return response
