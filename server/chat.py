"""/v1/chat/completions responses: one `chat.completion`, or `chat.completion.chunk`s as vLLM
streams them (role chunk, the `echo` chunk, content chunks, the last of them with the finish,
optional usage chunk, [DONE]; no chunk carries `system_fingerprint`, as none of vLLM's does).

Per-request `metrics` (of a request with one choice) ride on the non-streaming response; when
streaming, on the usage chunk if `stream_options.include_usage` asked for one, otherwise on the
finish chunk, so a client gets them either way.

With a reasoning parser the reasoning goes out as `reasoning_content` (and `reasoning`, its newer
name in vLLM; both, as vLLM writes both); with a tool-call parser each call streams as `tool_calls`
entries as vLLM streams them (the first with index, id, type and function name, the next ones
with pieces of its arguments as the model writes them), and the finish reason of a request that
called tools is "tool_calls".
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from server.logprobs import chat_logprobs, prompt_logprobs_body
from server.schemas import BatchChatCompletionRequest, ChatCompletionRequest
from server.serving import (
    Choice,
    ResponseContext,
    finish_event,
    gather_choices,
    sse,
    sse_stream,
    total_usage,
    usage_body,
    usage_event,
)
from stages.api import RequestOutput, TokenLogprob, ToolCall, ToolCallDelta
from stages.text.parsers import forced_tool_calls, new_tool_call_id


def _chunk(
    ctx: ResponseContext, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def _choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _tool_call_piece(piece: ToolCallDelta) -> dict[str, Any]:
    """A call's streamed entry: its opening (id, type, name) or a piece of its arguments."""
    if not piece.id:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    function = {"name": piece.name, "arguments": piece.arguments}
    return {"index": piece.index, "id": piece.id, "type": "function", "function": function}


class _Calls:
    """The tool calls a request made so far (only the first when parallel_tool_calls is false).

    With a forced tool_choice the output is the calls' JSON (its grammar saw to that): the text is
    held back and becomes the calls when the request finishes (a streamed named call goes out
    piece by piece instead, in stream_chat). A named function is called with
    the text as its arguments and finishes with "stop", as OpenAI answers a forced function;
    "required" parses vLLM's list of {"name", "parameters"} and finishes with "tool_calls".
    """

    def __init__(self, request: ChatCompletionRequest) -> None:
        self.limit = 1 if request.parallel_tool_calls is False else None
        self.calls: list[ToolCall] = []  # as far as written
        self.forced = request.forced_tool
        self.named = request.named_tool
        self._held: list[str] = []

    def hold(self, text: str) -> str:
        """The content to send now: all of it, or none while a forced call's JSON is written."""
        if self.forced is None:
            return text
        self._held.append(text)
        return ""

    def release(self, finish_reason: str | None = None) -> tuple[list[ToolCallDelta], str]:
        """At the finish of a forced call: (the calls taken, content when the text held no calls).
        A call cut by max_tokens is no call, and its partial JSON no content (OpenAI's and
        vLLM's answer: finish_reason "length", no tool_calls, empty content)."""
        if self.forced is None:
            return [], ""
        if finish_reason == "length":
            return [], ""
        text = "".join(self._held)
        calls = forced_tool_calls(text, self.forced)
        if calls is None:
            return [], text
        return self.take(
            [ToolCallDelta(i, call.id, call.name, call.arguments) for i, call in enumerate(calls)]
        ), ""

    def take(self, pieces: Sequence[ToolCallDelta]) -> list[ToolCallDelta]:
        """The pieces to pass on (those of the calls within the limit), added to their calls."""
        taken = [p for p in pieces if self.limit is None or p.index < self.limit]
        for piece in taken:
            if piece.id:
                self.calls.append(ToolCall(piece.id, piece.name, piece.arguments))
            else:
                call = self.calls[piece.index]
                self.calls[piece.index] = ToolCall(
                    call.id, call.name, call.arguments + piece.arguments
                )
        return taken

    def finish_reason(self, reason: str | None) -> str | None:
        if self.calls and self.named is not None:
            return reason
        return "tool_calls" if self.calls and reason in ("stop", "length") else reason


def _response_role(ctx: ResponseContext, request: ChatCompletionRequest) -> str:
    """--response-role after a generation prompt; else the role of the message continued."""
    if request.add_generation_prompt:
        return ctx.response_role
    return str(request.messages[-1].get("role"))


def stream_chat(
    ctx: ResponseContext, request: ChatCompletionRequest, choices: Sequence[Choice]
) -> AsyncGenerator[bytes, None]:
    top_n = request.top_logprob_count(request.top_logprobs or 0)
    with_sampled = request.logprob_token_ids is not None
    include_usage, continuous_usage = ctx.include_usage(request.stream_options)
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)
    response_role = _response_role(ctx, request)

    def usage() -> bytes:
        return usage_event(_chunk(ctx, [], total_usage(choices, ctx)), ctx, choices[0].tracker)

    # A named tool_choice streams its call as OpenAI does: the first delta opens the call (id,
    # name), the following ones carry pieces of its arguments as the model writes them.
    named = request.named_tool
    echo = request.echo_text(response_role)

    async def events(choice: Choice) -> AsyncIterator[bytes]:
        tracker, index = choice.tracker, choice.index
        calls = _Calls(request)
        call_open = False

        def usage_now() -> dict[str, int] | None:
            return tracker.usage if continuous_usage else None

        ids = _TokenIds(request.return_token_ids)
        async for output in choice.chain():
            if output is choice.first:
                no_output_yet = (
                    usage_body(tracker.num_prompt_tokens, 0) if continuous_usage else None
                )
                for event in _opening(
                    ctx, request, output, index, response_role, echo, no_output_yet
                ):
                    yield event
            ids.add(output.token_ids)
            delta: dict[str, Any] = {}
            if output.reasoning and request.include_reasoning:
                delta["reasoning_content"] = delta["reasoning"] = output.reasoning
            text = output.text if named else calls.hold(output.text)
            if named and (text or not call_open):
                function = {"arguments": text}
                piece: dict[str, Any] = {"index": 0, "function": function}
                if not call_open:
                    piece.update(id=new_tool_call_id(), type="function")
                    function["name"] = named
                    call_open = True
                delta["tool_calls"] = [piece]
                text = ""
            if text or (output.logprobs and not delta):
                delta["content"] = text
            if output.tool_calls:
                taken = calls.take(output.tool_calls)
                if taken:
                    delta["tool_calls"] = [_tool_call_piece(piece) for piece in taken]
            pieces: list[dict[str, Any]] = []
            if delta or output.logprobs:
                logprobs = (
                    chat_logprobs(output.logprobs, top_n, as_ids, with_sampled)
                    if output.logprobs
                    else None
                )
                pieces.append(ids.take(_choice(index, delta, logprobs)))
            if output.finish_reason is None:
                for piece in pieces:
                    yield sse(_chunk(ctx, [piece], usage_now()))
                continue
            last = _finish_piece(pieces, output, index, calls, ids, named)
            for piece in pieces:
                yield sse(_chunk(ctx, [piece], usage_now()))
            yield finish_event(_chunk(ctx, [last], usage_now()), ctx, tracker, include_usage)

    return sse_stream(choices, events, usage if include_usage else None, ctx.request_id)


def _opening(
    ctx: ResponseContext,
    request: ChatCompletionRequest,
    first: RequestOutput,
    index: int,
    role: str,
    echo: str,
    usage: dict[str, int] | None,
) -> list[bytes]:
    """The events that open a choice's stream: the role's chunk (with vLLM's extras about the
    prompt), then the echoed text's when the request echoes."""
    opening = _chunk(ctx, [_choice(index, {"role": role, "content": ""})], usage)
    events = [sse(_with_prompt(opening, ctx, request, first))]
    if echo:
        events.append(sse(_chunk(ctx, [_choice(index, {"content": echo})], usage)))
    return events


def _finish_piece(
    pieces: list[dict[str, Any]],
    output: RequestOutput,
    index: int,
    calls: _Calls,
    ids: _TokenIds,
    named: str | None,
) -> dict[str, Any]:
    """The choice piece that carries a choice's finish, taken off the end of `pieces` (its last
    output's, to which a forced call's held text is added first, as the calls or as content).
    As vLLM streams it, the last piece carries the finish (an empty delta when the last token
    brought no text), so no chunk repeats the usage of the one before."""
    forced, held = calls.release(output.finish_reason) if named is None else ([], "")
    if forced:
        delta = {"tool_calls": [_tool_call_piece(piece) for piece in forced]}
        pieces.append(ids.take(_choice(index, delta)))
    elif held:
        pieces.append(ids.take(_choice(index, {"content": held})))
    last = pieces.pop() if pieces else ids.take(_choice(index, {}))
    last["finish_reason"] = calls.finish_reason(output.finish_reason)
    last["stop_reason"] = output.stop_reason
    return last


async def _collect_choice(
    ctx: ResponseContext, request: ChatCompletionRequest, choice: Choice
) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls = _Calls(request)
    entries: list[TokenLogprob] = []
    token_ids: list[int] = []
    async for output in choice.chain():
        token_ids.extend(output.token_ids)
        texts.append(calls.hold(output.text))
        reasoning.append(output.reasoning)
        calls.take(output.tool_calls)
        entries.extend(output.logprobs or ())
    texts.append(calls.release(choice.tracker.finish_reason)[1])
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)
    logprobs = (
        chat_logprobs(
            entries,
            request.top_logprob_count(request.top_logprobs or 0),
            as_ids,
            request.logprob_token_ids is not None,
        )
        if request.logprobs
        else None
    )
    role = _response_role(ctx, request)
    content: str | None = request.echo_text(role) + "".join(texts)
    message: dict[str, Any] = {"role": role, "content": content}
    if calls.calls:
        # OpenAI's shape: content null when the reply is only calls
        message["content"] = content if content and content.strip() else None
        message["tool_calls"] = [_tool_call(call) for call in calls.calls]
    if ctx.reasoning and request.include_reasoning:
        message["reasoning_content"] = message["reasoning"] = "".join(reasoning) or None
    tracker = choice.tracker
    body = {
        "index": choice.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": calls.finish_reason(tracker.finish_reason),
        "stop_reason": tracker.stop_reason,
    }
    # vLLM's keys are there, null, when not asked for (clients read them as attributes)
    body["token_ids"] = token_ids if request.return_token_ids else None
    return body


async def collect_batch_chat(
    ctx: ResponseContext, request: BatchChatCompletionRequest, choices: Sequence[Choice]
) -> dict[str, Any]:
    """vLLM's /v1/chat/completions/batch answer: one chat.completion whose choice i answers
    conversation i; usage sums every conversation's prompt and completion."""
    conversations = request.conversations()
    bodies = await gather_choices(
        choices,
        lambda choice: _collect_choice(ctx, conversations[choice.prompt_index], choice),
    )
    return _response(ctx, request, choices, bodies, with_prompt=False)


async def collect_chat(
    ctx: ResponseContext, request: ChatCompletionRequest, choices: Sequence[Choice]
) -> dict[str, Any]:
    bodies = await gather_choices(choices, lambda choice: _collect_choice(ctx, request, choice))
    return _response(ctx, request, choices, bodies)


def _response(
    ctx: ResponseContext,
    request: ChatCompletionRequest,
    choices: Sequence[Choice],
    bodies: list[dict[str, Any]],
    with_prompt: bool = True,
) -> dict[str, Any]:
    """The chat.completion of `bodies`; `with_prompt`: the extras about the one prompt."""
    response: dict[str, Any] = {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.system_fingerprint,
        "choices": bodies,
        "usage": total_usage(choices, ctx),
    }
    response["prompt_logprobs"] = (
        None
        if request.prompt_logprobs is None
        else prompt_logprobs_body(choices[0].first.prompt_logprobs or (), request.prompt_logprobs)
    )
    response["prompt_token_ids"] = response["prompt_text"] = None
    if ctx.include_request_metrics:
        response["metrics"] = choices[0].tracker.metrics_body()
    return _with_prompt(response, ctx, request, choices[0].first) if with_prompt else response


def _with_prompt(
    body: dict[str, Any], ctx: ResponseContext, request: ChatCompletionRequest, first: RequestOutput
) -> dict[str, Any]:
    """vLLM's extras about the prompt, on the response (or a stream's first chunk):
    `prompt_token_ids` with return_token_ids, `prompt_text` with return_prompt_text."""
    if request.return_token_ids:
        body["prompt_token_ids"] = list(first.prompt_token_ids or ())
    if request.return_prompt_text:
        body["prompt_text"] = ctx.prompt_text
    return body


class _TokenIds:
    """With return_token_ids, each streamed choice carries the ids of the tokens since the last
    one (vLLM's `token_ids`): a token whose text is held back goes out with the next chunk, so the
    chunks' ids add up to the whole output."""

    def __init__(self, wanted: bool | None) -> None:
        self.wanted = bool(wanted)
        self._pending: list[int] = []

    def add(self, token_ids: Sequence[int]) -> None:
        if self.wanted:
            self._pending.extend(token_ids)

    def take(self, choice: dict[str, Any]) -> dict[str, Any]:
        if self.wanted:
            choice["token_ids"], self._pending = self._pending, []
        return choice
