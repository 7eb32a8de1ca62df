"""/v1/chat/completions responses: one `chat.completion`, or `chat.completion.chunk`s as vLLM
streams them (role chunk, content chunks, finish chunk, optional usage chunk, [DONE]).

Per-request `metrics` ride on the non-streaming response; when streaming, on the usage chunk if
`stream_options.include_usage` asked for one, otherwise on the finish chunk, so a client gets
them either way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from server.logprobs import chat_logprobs
from server.schemas import ChatCompletionRequest
from server.serving import (
    ResponseContext,
    Tracker,
    chain,
    finish_event,
    guarded_stream,
    sse,
    usage_body,
    usage_event,
)
from stages.api import RequestOutput, TokenLogprob


def _chunk(
    ctx: ResponseContext, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.system_fingerprint,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def _choice(
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def stream_chat(
    ctx: ResponseContext,
    request: ChatCompletionRequest,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    tracker: Tracker,
) -> AsyncGenerator[bytes, None]:
    top_n = request.top_logprobs or 0

    def usage_now() -> dict[str, int] | None:
        return tracker.usage if request.continuous_usage else None

    async def body() -> AsyncIterator[bytes]:
        async for output in chain(first, outputs, tracker):
            if output is first:
                role = _choice({"role": "assistant", "content": ""})
                no_output_yet = usage_body(tracker.num_prompt_tokens, 0)
                yield sse(_chunk(ctx, [role], no_output_yet if request.continuous_usage else None))
            if output.text or output.logprobs:
                logprobs = chat_logprobs(output.logprobs, top_n) if output.logprobs else None
                content = _choice({"content": output.text}, logprobs)
                yield sse(_chunk(ctx, [content], usage_now()))
            if output.finish_reason is not None:
                choice = _choice({}, None, output.finish_reason, output.stop_reason)
                finish = _chunk(ctx, [choice], usage_now())
                yield finish_event(finish, ctx, tracker, request.include_usage)
        if request.include_usage:
            yield usage_event(_chunk(ctx, [], tracker.usage), ctx, tracker)

    return guarded_stream(body(), outputs, tracker, ctx.request_id)


async def collect_chat(
    ctx: ResponseContext,
    request: ChatCompletionRequest,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    tracker: Tracker,
) -> dict[str, Any]:
    texts: list[str] = []
    entries: list[TokenLogprob] = []
    async for output in chain(first, outputs, tracker):
        texts.append(output.text)
        entries.extend(output.logprobs or ())
    logprobs = chat_logprobs(entries, request.top_logprobs or 0) if request.logprobs else None
    response: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.system_fingerprint,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(texts)},
                "logprobs": logprobs,
                "finish_reason": tracker.finish_reason,
                "stop_reason": tracker.stop_reason,
            }
        ],
        "usage": tracker.usage,
    }
    if ctx.include_request_metrics:
        response["metrics"] = tracker.metrics_body()
    return response
