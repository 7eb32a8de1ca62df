"""What the routes share: `OpenAIServing` holds the engine, config and metrics and runs a
generation request from body to response, as vLLM's serving classes do; app.py's handlers fetch
it per request."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import msgspec
from quart import Response, current_app, g, request

from server.config import ServerConfig
from server.drain import Drain
from server.errors import APIError
from server.metrics import ServerMetrics
from server.schemas import ChatCompletionRequest
from server.serving import Choice, ResponseContext, Tracker, close_choices, start
from stages.api import EngineClient, EngineError, GenerateRequest

RequestT = TypeVar("RequestT", bound=msgspec.Struct)
StreamBuilder = Callable[[ResponseContext, list[Choice]], AsyncIterator[bytes]]
Collector = Callable[[ResponseContext, list[Choice]], Awaitable[dict[str, Any]]]

EXTENSION = "pipeline_serve"


def server_version() -> str:
    try:
        return version("pipeline-serve")
    except PackageNotFoundError:
        return "unknown"


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json")


async def decode_body(kind: type[RequestT]) -> RequestT:
    raw = await request.get_data(as_text=False)
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.MsgspecError as error:
        raise APIError.from_decode(error) from error


def openai_serving() -> OpenAIServing:
    """The state of the app handling the current request (create_app stored it)."""
    serving: OpenAIServing = current_app.extensions[EXTENSION]
    return serving


class OpenAIServing:
    """One app's engine, config and what follows from them, and the steps of a generation."""

    __slots__ = (
        "bearer",
        "config",
        "drain",
        "engine",
        "fingerprint",
        "metrics",
        "served_model_name",
    )

    def __init__(self, engine: EngineClient, config: ServerConfig, drain: Drain) -> None:
        self.engine = engine
        self.config = config
        self.drain = drain
        self.served_model_name = config.served_model_name or engine.model_info.served_model_name
        self.metrics = ServerMetrics(engine.stats, self.served_model_name)
        self.fingerprint = f"pipeline-serve-{server_version()}"
        self.bearer = f"Bearer {config.api_key}".encode() if config.api_key is not None else None

    def check_model(self, name: str | None) -> str:
        if name is None or name == self.served_model_name:
            return self.served_model_name
        raise APIError(
            f"The model `{name}` does not exist.",
            status=404,
            param="model",
            code="model_not_found",
        )

    def request_id_for(self, body_request_id: str | None, prefix: str) -> str:
        request_id = (
            request.headers.get("X-Request-Id") or body_request_id or f"{prefix}-{uuid.uuid4().hex}"
        )
        g.request_id = request_id
        return request_id

    def chat_parsers(self, body: ChatCompletionRequest) -> tuple[str | None, str | None]:
        """The server's reasoning parser, and its tool-call parser where the tools need it."""
        config = self.config
        tool_call_parser = body.tool_call_parser(
            config.tool_call_parser, config.enable_auto_tool_choice
        )
        return config.reasoning_parser, tool_call_parser

    async def generation_route(
        self,
        schema: Any,
        id_prefix: str,
        prompt_of: Callable[[Any], Any],
        stream_builder: Callable[..., Any],
        collector: Callable[..., Any],
        parsers_of: Callable[[Any], tuple[str | None, str | None]] = lambda body: (None, None),
    ) -> Response:
        """Decode and validate the body, build the engine request, answer streaming or not."""
        arrival_ns = time.monotonic_ns()
        body = await decode_body(schema)
        model = self.check_model(body.model)
        body.validate(self.engine.model_info.vocab_size)
        reasoning_parser, tool_call_parser = parsers_of(body)
        generate_request = GenerateRequest(
            request_id=self.request_id_for(body.request_id, id_prefix),
            prompt=prompt_of(body),
            sampling=body.sampling_params(),
            priority=body.priority,
            arrival_ns=arrival_ns,
            reasoning_parser=reasoning_parser,
            tool_call_parser=tool_call_parser,
        )
        return await self.generate(
            generate_request,
            model,
            body.stream,
            body.n,
            lambda ctx, choices: stream_builder(ctx, body, choices),
            lambda ctx, choices: collector(ctx, body, choices),
        )

    async def generate(
        self,
        generate_request: GenerateRequest,
        model: str,
        stream: bool,
        n: int,
        stream_builder: StreamBuilder,
        collector: Collector,
    ) -> Response:
        if not self.engine.ready:
            raise APIError.from_engine(self.engine.not_ready_error)
        config = self.config
        ctx = ResponseContext(
            request_id=generate_request.request_id,
            model=model,
            created=int(time.time()),
            system_fingerprint=self.fingerprint,
            include_request_metrics=config.enable_per_request_metrics,
            reasoning=generate_request.reasoning_parser is not None,
            prompt_tokens_details=config.enable_prompt_tokens_details,
        )
        choices = await self.start_choices(generate_request, n)
        if stream:
            return Response(
                stream_builder(ctx, choices),
                content_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            return json_response(await collector(ctx, choices))
        except EngineError as error:
            raise APIError.from_engine(error) from error
        finally:
            await close_choices(choices)

    async def start_choices(self, generate_request: GenerateRequest, n: int) -> list[Choice]:
        """n engine requests, one per choice (as vLLM fans out n > 1); a seed gives choice i
        seed + i, so the choices differ and the whole response still repeats."""
        requests = [generate_request]
        seed = generate_request.sampling.seed
        for i in range(1, n):
            sampling = msgspec.structs.replace(
                generate_request.sampling, seed=None if seed is None else seed + i
            )
            requests.append(msgspec.structs.replace(generate_request, sampling=sampling))
        trackers = [Tracker(self.metrics, r.request_id, r.arrival_ns) for r in requests]
        started = await asyncio.gather(
            *(start(self.engine, r, self.drain) for r in requests), return_exceptions=True
        )
        choices = [
            Choice(i, result[0], result[1], trackers[i])
            for i, result in enumerate(started)
            if not isinstance(result, BaseException)
        ]
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            await close_choices(choices)
            raise failed[0]
        return choices
