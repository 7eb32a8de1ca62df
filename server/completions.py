"""/v1/completions responses: one `text_completion`, or `text_completion` chunks (text chunks,
the last of them with the finish, optional usage chunk, [DONE]; without `system_fingerprint`, as vLLM streams them);
`echo` puts the prompt first. Per-request `metrics` are placed as in chat.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from server.logprobs import CompletionLogprobs, merge, prompt_logprobs_body
from server.schemas import CompletionRequest
from server.serving import (
    Choice,
    ResponseContext,
    finish_event,
    gather_choices,
    sse,
    sse_stream,
    total_usage,
    usage_event,
)
from stages.api import EngineClient, RequestOutput, TextPrompt


def _body(
    ctx: ResponseContext,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    chunk: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    if not chunk:
        body["system_fingerprint"] = ctx.system_fingerprint
    if usage is not None:
        body["usage"] = usage
    return body


def _choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


class _Echo:
    """The prompt's text (and its logprobs) that `echo` puts ahead of the completion."""

    def __init__(
        self,
        engine: EngineClient,
        request: CompletionRequest,
        choice: Choice,
        as_ids: bool,
    ) -> None:
        prompt = request.prompt_values()[choice.prompt_index]
        first = choice.first
        prompt_ids = first.prompt_token_ids or ()
        if isinstance(prompt, TextPrompt):
            self.text = prompt.text
        else:
            self.text = engine.detokenize(prompt.token_ids)
        self.logprobs: dict[str, Any] | None = None
        if request.logprobs is not None:
            first_token = (prompt_ids[0], engine.detokenize(prompt_ids[:1])) if prompt_ids else None
            self.logprobs = CompletionLogprobs(
                request.top_logprob_count(request.logprobs), 0, as_ids
            ).prompt_entries(first_token, first.prompt_logprobs or ())


class _TokenIds:
    """With return_token_ids (vLLM's shape): a stream's first chunk of a choice carries its
    `prompt_token_ids`, and each chunk the `token_ids` since the last one (a token whose text is
    held back goes with the next chunk, so the chunks' ids add up to the whole output)."""

    def __init__(self, request: CompletionRequest, first: RequestOutput) -> None:
        self.wanted = bool(request.return_token_ids)
        self._prompt: list[int] | None = list(first.prompt_token_ids or ())
        self._pending: list[int] = []

    def add(self, token_ids: Sequence[int]) -> None:
        if self.wanted:
            self._pending.extend(token_ids)

    def take(self, choice: dict[str, Any]) -> dict[str, Any]:
        if self.wanted:
            if self._prompt is not None:
                choice["prompt_token_ids"], self._prompt = self._prompt, None
            choice["token_ids"], self._pending = self._pending, []
        return choice


def stream_completion(
    ctx: ResponseContext,
    engine: EngineClient,
    request: CompletionRequest,
    choices: Sequence[Choice],
) -> AsyncGenerator[bytes, None]:
    include_usage, continuous_usage = ctx.include_usage(request.stream_options)
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)

    def usage() -> bytes:
        return usage_event(_body(ctx, [], total_usage(choices, ctx)), ctx, choices[0].tracker)

    async def events(choice: Choice) -> AsyncIterator[bytes]:
        tracker, index = choice.tracker, choice.index

        def usage_now() -> dict[str, int] | None:
            return tracker.usage if continuous_usage else None

        text_offset = 0
        ids = _TokenIds(request, choice.first)
        if request.echo:
            echo = _Echo(engine, request, choice, as_ids)
            text_offset = len(echo.text)
            echoed = ids.take(_choice(index, echo.text, echo.logprobs))
            yield sse(_body(ctx, [echoed], usage_now()))
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs(
                request.top_logprob_count(request.logprobs), text_offset, as_ids
            )
        async for output in choice.chain():
            ids.add(output.token_ids)
            entries = None
            if logprobs is not None and output.logprobs:
                entries = logprobs.entries(output.logprobs)
            # As vLLM streams it, the last token's text and the finish travel in one chunk.
            if output.finish_reason is not None:
                piece = ids.take(
                    _choice(index, output.text, entries, output.finish_reason, output.stop_reason)
                )
                finish = _body(ctx, [piece], usage_now())
                yield finish_event(finish, ctx, tracker, include_usage)
            elif output.text or output.logprobs:
                piece = ids.take(_choice(index, output.text, entries))
                yield sse(_body(ctx, [piece], usage_now()))

    return sse_stream(choices, events, usage if include_usage else None, ctx.request_id)


async def _collect_choice(
    ctx: ResponseContext, engine: EngineClient, request: CompletionRequest, choice: Choice
) -> dict[str, Any]:
    texts: list[str] = []
    logprobs: dict[str, Any] | None = None
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)
    if request.echo:
        echo = _Echo(engine, request, choice, as_ids)
        texts.append(echo.text)
        logprobs = echo.logprobs
    builder = None
    if request.logprobs is not None:
        builder = CompletionLogprobs(
            request.top_logprob_count(request.logprobs), len(texts[0]) if texts else 0, as_ids
        )
    token_ids: list[int] = []
    async for output in choice.chain():
        texts.append(output.text)
        token_ids.extend(output.token_ids)
        if builder is not None:
            logprobs = merge(logprobs, builder.entries(output.logprobs or ()))
    tracker = choice.tracker
    body = _choice(
        choice.index, "".join(texts), logprobs, tracker.finish_reason, tracker.stop_reason
    )
    # vLLM's keys are there, null, when not asked for (clients read them as attributes)
    body["prompt_token_ids"] = body["token_ids"] = None
    if request.return_token_ids:
        body["prompt_token_ids"] = list(choice.first.prompt_token_ids or ())
        body["token_ids"] = token_ids
    body["prompt_logprobs"] = (
        None
        if request.prompt_logprobs is None
        else prompt_logprobs_body(choice.first.prompt_logprobs or (), request.prompt_logprobs)
    )
    return body


async def collect_completion(
    ctx: ResponseContext,
    engine: EngineClient,
    request: CompletionRequest,
    choices: Sequence[Choice],
) -> dict[str, Any]:
    bodies = await gather_choices(
        choices, lambda choice: _collect_choice(ctx, engine, request, choice)
    )
    response = _body(ctx, bodies, total_usage(choices, ctx), chunk=False)
    if ctx.include_request_metrics:
        response["metrics"] = choices[0].tracker.metrics_body()
    return response
