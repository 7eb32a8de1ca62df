"""The Quart app: OpenAI routes plus vLLM's /health, /version, /tokenize, /detokenize, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from server.chat import collect_chat, stream_chat
from server.completions import collect_completion, stream_completion
from server.config import ServerConfig
from server.errors import APIError, error_body, error_type_for
from server.metrics import ServerMetrics
from server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.serving import Choice, ResponseContext, Tracker, close_choices, start
from stages.api import EngineClient, EngineError, GenerateRequest

log = structlog.get_logger("server")

RequestT = TypeVar("RequestT", bound=msgspec.Struct)
StreamBuilder = Callable[[ResponseContext, list[Choice]], AsyncIterator[bytes]]
Collector = Callable[[ResponseContext, list[Choice]], Awaitable[dict[str, Any]]]


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


def create_app(engine: EngineClient, config: ServerConfig) -> Quart:
    app = Quart(__name__)
    # Generation streams for as long as it takes; Quart's default cuts responses at 60 s.
    app.config["RESPONSE_TIMEOUT"] = None
    served_model_name = config.served_model_name or engine.model_info.served_model_name
    metrics = ServerMetrics(engine.stats, served_model_name)
    fingerprint = f"pipeline-serve-{server_version()}"
    bearer = f"Bearer {config.api_key}".encode() if config.api_key is not None else None

    def check_model(name: str | None) -> str:
        if name is None or name == served_model_name:
            return served_model_name
        raise APIError(
            f"The model `{name}` does not exist.",
            status=404,
            param="model",
            code="model_not_found",
        )

    def request_id_for(body_request_id: str | None, prefix: str) -> str:
        request_id = (
            request.headers.get("X-Request-Id") or body_request_id or f"{prefix}-{uuid.uuid4().hex}"
        )
        g.request_id = request_id
        return request_id

    async def generate(
        generate_request: GenerateRequest,
        model: str,
        stream: bool,
        n: int,
        stream_builder: StreamBuilder,
        collector: Collector,
    ) -> Response:
        if not engine.ready:
            raise APIError("the engine is not ready yet", status=503)
        ctx = ResponseContext(
            request_id=generate_request.request_id,
            model=model,
            created=int(time.time()),
            system_fingerprint=fingerprint,
            include_request_metrics=config.enable_per_request_metrics,
            reasoning=generate_request.reasoning_parser is not None,
            prompt_tokens_details=config.enable_prompt_tokens_details,
        )
        choices = await start_choices(generate_request, n)
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

    async def start_choices(generate_request: GenerateRequest, n: int) -> list[Choice]:
        """n engine requests, one per choice (as vLLM fans out n > 1); a seed gives choice i
        seed + i, so the choices differ and the whole response still repeats."""
        requests = [generate_request]
        seed = generate_request.sampling.seed
        for i in range(1, n):
            sampling = dataclasses.replace(
                generate_request.sampling, seed=None if seed is None else seed + i
            )
            requests.append(dataclasses.replace(generate_request, sampling=sampling))
        trackers = [Tracker(metrics, r.request_id, r.arrival_ns) for r in requests]
        started = await asyncio.gather(
            *(start(engine, r) for r in requests), return_exceptions=True
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

    @app.before_request
    async def authorize() -> None:
        if bearer is None or not request.path.startswith("/v1/"):
            return
        given = request.headers.get("Authorization", "").encode()
        if not secrets.compare_digest(given, bearer):
            raise APIError("Invalid API key", status=401, code="invalid_api_key")

    @app.after_request
    async def echo_request_id(response: Response) -> Response:
        request_id = g.get("request_id") or request.headers.get("X-Request-Id")
        if request_id:
            response.headers["X-Request-Id"] = request_id
        return response

    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        return json_response(error.body(), error.status)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        response = json_response(
            error_body(error.description or error.name, error_type_for(status)), status
        )
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            response.headers["Allow"] = ", ".join(error.valid_methods)
        return response

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        log.exception("request failed", path=request.path)
        return json_response(error_body(f"internal error: {error}", "InternalServerError"), 500)

    async def generation_route(
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
        model = check_model(body.model)
        body.validate(engine.model_info.vocab_size)
        reasoning_parser, tool_call_parser = parsers_of(body)
        generate_request = GenerateRequest(
            request_id=request_id_for(body.request_id, id_prefix),
            prompt=prompt_of(body),
            sampling=body.sampling_params(),
            priority=body.priority,
            arrival_ns=arrival_ns,
            reasoning_parser=reasoning_parser,
            tool_call_parser=tool_call_parser,
        )
        return await generate(
            generate_request,
            model,
            body.stream,
            body.n,
            lambda ctx, choices: stream_builder(ctx, body, choices),
            lambda ctx, choices: collector(ctx, body, choices),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generation_route(
            ChatCompletionRequest,
            "chatcmpl",
            lambda body: body.prompt(),
            stream_chat,
            collect_chat,
            lambda body: (
                config.reasoning_parser,
                body.tool_call_parser(config.tool_call_parser, config.enable_auto_tool_choice),
            ),
        )

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generation_route(
            CompletionRequest,
            "cmpl",
            lambda body: body.prompt_value(),
            lambda ctx, body, choices: stream_completion(ctx, engine, body, choices),
            lambda ctx, body, choices: collect_completion(ctx, engine, body, choices),
        )

    @app.get("/v1/models")
    async def models() -> Response:
        info = engine.model_info
        card = {
            "id": served_model_name,
            "object": "model",
            "created": info.created,
            "owned_by": "pipeline-serve",
            "root": info.model_path,
            "parent": None,
            "max_model_len": info.max_model_len,
        }
        return json_response({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        if engine.ready:
            return Response(b"", status=200)
        return json_response(
            error_body("the engine is not ready yet", error_type_for(503)), status=503
        )

    @app.get("/version")
    async def server_version_route() -> Response:
        return json_response({"version": server_version()})

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await decode_body(TokenizeRequest)
        check_model(body.model)
        body.validate()
        try:
            tokens = engine.tokenize(body.prompt_value())
        except EngineError as error:
            raise APIError.from_engine(error) from error
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": engine.model_info.max_model_len,
                "tokens": tokens,
            }
        )

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await decode_body(DetokenizeRequest)
        check_model(body.model)
        body.validate(engine.model_info.vocab_size)
        try:
            text = engine.detokenize(body.tokens)
        except EngineError as error:
            raise APIError.from_engine(error) from error
        return json_response({"prompt": text})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), status=200, content_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/profile")
    async def profile() -> Response:
        """Each stage's trace spans since the last call (columns) and every process's CPU seconds,
        for `pipeline-bench serve --profile`. Engines without traces answer 404."""
        read_traces = getattr(engine, "read_traces", None)
        cpu_seconds = getattr(engine, "cpu_seconds", None)
        if read_traces is None or cpu_seconds is None:
            raise APIError("this engine keeps no traces", 404, "NotFoundError")
        spans = {
            stage: {name: records[name].tolist() for name in records.dtype.names}
            for stage, records in read_traces().items()
        }
        return json_response({"stages": spans, "cpu_seconds": cpu_seconds()})

    return app
