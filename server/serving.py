"""What chat and text completions share: starting a request on the engine, watching its outputs
for the server's metrics, SSE framing, usage, and closing the engine's stream (which aborts)."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from server.drain import Drain
from server.errors import APIError
from server.metrics import ServerMetrics
from server.request_metrics import request_metrics_body
from stages.api import EngineClient, EngineError, GenerateRequest, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from server.schemas import StreamOptions

log = structlog.get_logger("server")

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True, frozen=True)
class ResponseContext:
    """The fields every response and chunk of one request repeats."""

    request_id: str
    model: str
    created: int
    system_fingerprint: str
    include_request_metrics: bool
    reasoning: bool = False  # a reasoning parser runs on this request's output
    prompt_tokens_details: bool = False  # final usage says how many prompt tokens were cached
    force_include_usage: bool = False  # --enable-force-include-usage
    return_tokens_as_token_ids: bool = False  # the server's default for the request field
    response_role: str = "assistant"  # --response-role
    prompt_text: str | None = None  # the prompt's tokens as text, when the request asked for it

    def include_usage(self, stream_options: StreamOptions | None) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk, and whether every chunk carries usage
        (vLLM's should_include_usage: the flag forces both)."""
        if self.force_include_usage:
            return True, True
        if stream_options is None or not stream_options.include_usage:
            return False, False
        # vLLM's rule: per-chunk usage only when the final usage chunk was asked for too.
        return True, bool(stream_options.continuous_usage_stats)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        return self.return_tokens_as_token_ids if requested is None else requested


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def usage_body(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


class ChoiceGroup:
    """The n choices of one request, for the metrics vLLM takes per request once all of them
    have finished (request_params_n, request_max_num_generation_tokens)."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self._metrics = metrics
        self._n = n
        self._left = n
        self._most_tokens = 0

    def finished(self, num_output_tokens: int, engine: int) -> None:
        """One choice finished (on data-parallel replica `engine`: the last one's counts)."""
        self._left -= 1
        self._most_tokens = max(self._most_tokens, num_output_tokens)
        if self._left == 0:
            self._metrics.observe_request(self._n, self._most_tokens, engine)


class Tracker:
    """Follows one request's outputs: usage so far, finish, and the server-wide metrics."""

    def __init__(
        self,
        metrics: ServerMetrics,
        request_id: str,
        arrival_ns: int,
        log_outputs: bool = False,
        max_tokens: int | None = None,  # the request's, after defaults (None: the room left)
        group: ChoiceGroup | None = None,  # None: a request of one choice
    ) -> None:
        self._metrics = metrics
        self._request_id = request_id
        self._arrival_ns = arrival_ns
        self._max_tokens = max_tokens
        self._group = ChoiceGroup(metrics, 1) if group is None else group
        self._last_output_ns: int | None = None
        # --enable-log-outputs: the text and token ids, logged when the request finishes
        self._output: tuple[list[str], list[int]] | None = ([], []) if log_outputs else None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.request_metrics: RequestMetrics | None = None
        self.num_reasoning_tokens = 0  # known at the finish (with a reasoning parser)
        self._engine = 0  # the data-parallel replica serving it, for the metrics' label

    def see(self, output: RequestOutput) -> None:
        now_ns = time.monotonic_ns()
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self._engine = engine = output.engine
        if self._last_output_ns is None:
            self._metrics.observe_first_output(
                output.num_prompt_tokens, (now_ns - self._arrival_ns) / 1e9, engine
            )
            gap_s = None
        else:
            gap_s = (now_ns - self._last_output_ns) / 1e9
        self._metrics.observe_tokens(len(output.token_ids), gap_s, engine)
        self._last_output_ns = now_ns
        if self._output is not None:
            self._output[0].append(output.text)
            self._output[1].extend(output.token_ids)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.request_metrics = output.metrics
            self.num_reasoning_tokens = output.num_reasoning_tokens
            self._finish(output.finish_reason)

    def abandon(self) -> None:
        """The client left (or the stream failed) before the engine finished the request."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self._finish("abort")

    @property
    def usage(self) -> dict[str, int]:
        return usage_body(self.num_prompt_tokens, self.num_output_tokens)

    def metrics_body(self) -> dict[str, Any] | None:
        return None if self.request_metrics is None else request_metrics_body(self.request_metrics)

    def _finish(self, reason: str) -> None:
        log.info(
            "request finished",
            request_id=self._request_id,
            finish_reason=reason,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
        )
        if self._output is not None:
            texts, token_ids = self._output
            log.info(
                "response generated",
                request_id=self._request_id,
                output="".join(texts),
                output_token_ids=token_ids,
                finish_reason=reason,
            )
        self._metrics.observe_finish(
            reason,
            (time.monotonic_ns() - self._arrival_ns) / 1e9,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.request_metrics,
            self._max_tokens,
            self._engine,
        )
        self._group.finished(self.num_output_tokens, self._engine)


async def close_outputs(outputs: AsyncIterator[Any]) -> None:
    """Leaving the engine's stream early is how a request is aborted (stages.api)."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()


async def start(
    engine: EngineClient, request: GenerateRequest, drain: Drain
) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """Waits for the first output, so that errors the engine finds in the prompt (too long, bad
    template) are answered with their own status instead of a 200 stream that carries an error.
    The outputs pass through `drain`, which can end them when the server stops."""
    outputs = drain.track(aiter(engine.generate(request)))
    try:
        first = await anext(outputs)
    except EngineError as error:
        await close_outputs(outputs)
        raise APIError.from_engine(error) from error
    except StopAsyncIteration as error:
        raise APIError("the engine ended the request without any output", status=500) from error
    except BaseException:
        await close_outputs(outputs)
        raise
    return first, outputs


async def chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput], tracker: Tracker
) -> AsyncIterator[RequestOutput]:
    tracker.see(first)
    yield first
    if first.finish_reason is not None:
        return
    async for output in rest:
        tracker.see(output)
        yield output
        if output.finish_reason is not None:
            return


def finish_event(
    chunk: dict[str, Any], ctx: ResponseContext, tracker: Tracker, include_usage: bool
) -> bytes:
    """The chunk with finish_reason; it carries the per-request metrics when no usage chunk follows."""
    if ctx.include_request_metrics and not include_usage:
        chunk["metrics"] = tracker.metrics_body()
    return sse(chunk)


def usage_event(chunk: dict[str, Any], ctx: ResponseContext, tracker: Tracker) -> bytes:
    """The final usage chunk (stream_options.include_usage), with the per-request metrics."""
    if ctx.include_request_metrics:
        chunk["metrics"] = tracker.metrics_body()
    return sse(chunk)


def stream_error(error: Exception, request_id: str) -> bytes:
    """An error after the 200 went out becomes an SSE error event (the client then sees [DONE])."""
    if isinstance(error, EngineError):
        api_error = APIError.from_engine(error)
    elif isinstance(error, APIError):
        api_error = error
    else:
        log.exception("stream failed", request_id=request_id)
        api_error = APIError(f"internal error: {error}", status=500)
    return sse(api_error.body())


class LoadTicket:
    """One generation request in flight (vLLM's server load counts them), released when its
    choices close, however the response ends."""

    __slots__ = ("__weakref__", "open")

    def __init__(self) -> None:
        self.open = True

    def release(self) -> None:
        self.open = False


class ServerLoad:
    """vLLM's GET /load: how many generation requests are in flight. Weak, as Drain's set is, so
    that a response dropped before its body was read leaves no count behind."""

    def __init__(self) -> None:
        self._tickets: weakref.WeakSet[LoadTicket] = weakref.WeakSet()

    def enter(self) -> LoadTicket:
        ticket = LoadTicket()
        self._tickets.add(ticket)
        return ticket

    @property
    def in_flight(self) -> int:
        return sum(1 for ticket in self._tickets if ticket.open)


@dataclass(slots=True)
class Choice:
    """One of a request's `n` choices: its engine stream (first output already read) and its
    tracker. Each choice is an engine request of its own."""

    index: int
    first: RequestOutput
    outputs: AsyncIterator[RequestOutput]
    tracker: Tracker
    prompt_index: int = 0  # which of a text completion's prompts it continues
    ticket: LoadTicket | None = None  # the request's place in the server load

    def chain(self) -> AsyncIterator[RequestOutput]:
        return chain(self.first, self.outputs, self.tracker)


def total_usage(choices: Sequence[Choice], ctx: ResponseContext) -> dict[str, Any]:
    """Each prompt counted once, the completions of every choice summed (as vLLM counts n > 1
    and batched prompts); with prompt_tokens_details, the prompt tokens the prefix cache held;
    with a reasoning parser, the completion tokens inside the reasoning (as vLLM's
    completion_tokens_details)."""
    prompt_tokens = {c.prompt_index: c.tracker.num_prompt_tokens for c in reversed(choices)}
    usage: dict[str, Any] = usage_body(
        sum(prompt_tokens.values()), sum(c.tracker.num_output_tokens for c in choices)
    )
    if ctx.reasoning:
        reasoning_tokens = sum(c.tracker.num_reasoning_tokens for c in choices)
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    if ctx.prompt_tokens_details:
        first_choices = {c.prompt_index: c for c in reversed(choices)}.values()
        metrics = [c.tracker.request_metrics for c in first_choices]
        usage["prompt_tokens_details"] = {
            "cached_tokens": sum(m.num_cached_prompt_tokens for m in metrics if m is not None),
            "created_cache_tokens": sum(
                m.num_cache_creation_tokens for m in metrics if m is not None
            ),
        }
    return usage


async def close_choices(choices: Sequence[Choice]) -> None:
    for choice in choices:
        choice.tracker.abandon()
        if choice.ticket is not None:
            choice.ticket.release()
        await close_outputs(choice.outputs)


async def gather_choices(
    choices: Sequence[Choice], collect: Callable[[Choice], Awaitable[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Each choice's response body, collected side by side."""
    if len(choices) == 1:
        return [await collect(choices[0])]
    return list(await asyncio.gather(*(collect(choice) for choice in choices)))


_END = object()
# Pieces of each choice's stream held for a client that reads slower than they come: past it a
# choice waits, and its output waits in the engine (which bounds it: --max-unread-tokens).
INTERLEAVED_PIECES = 8


async def _interleave(streams: Sequence[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The pieces of several streams as each is ready (one per choice when n > 1)."""
    queue: asyncio.Queue[Any] = asyncio.Queue(INTERLEAVED_PIECES * len(streams))

    async def pump(stream: AsyncIterator[bytes]) -> None:
        # a cancellation (the response ended) goes through: nothing waits for this queue then
        try:
            async for piece in stream:
                await queue.put(piece)
        except Exception as error:
            await queue.put(error)
        await queue.put(_END)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await close_outputs(stream)


def sse_stream(
    choices: Sequence[Choice],
    events: Callable[[Choice], AsyncIterator[bytes]],
    usage: Callable[[], bytes] | None,
    request_id: str,
) -> AsyncGenerator[bytes, None]:
    """The SSE body of a streamed response: each choice's `events` (interleaved when n > 1),
    the usage chunk, then [DONE]; a failure becomes an error event, and the engine's streams are
    closed however the response ends (a disconnect included), which aborts what still runs."""

    async def body() -> AsyncIterator[bytes]:
        if len(choices) == 1:
            async for piece in events(choices[0]):
                yield piece
        else:
            async for piece in _interleave([events(choice) for choice in choices]):
                yield piece
        if usage is not None:
            yield usage()

    if len(choices) == 1 and usage is None:  # the common case, one generator fewer per token
        return guarded_stream(events(choices[0]), choices, request_id)
    return guarded_stream(body(), choices, request_id)


async def guarded_stream(
    body: AsyncIterator[bytes], choices: Sequence[Choice], request_id: str
) -> AsyncGenerator[bytes, None]:
    """Frames `body` as an SSE stream that always ends with [DONE], turns failures into an error
    event, and closes the engine's streams however the response ends (a disconnect included)."""
    try:
        async for piece in body:
            yield piece
    except Exception as error:
        yield stream_error(error, request_id)
    finally:
        await close_outputs(body)
        await close_choices(choices)
    yield SSE_DONE
