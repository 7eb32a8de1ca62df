"""The Quart app: OpenAI routes plus vLLM's /health, /ping, /version, /tokenize, /detokenize,
/metrics, the /render endpoints and /reset_prefix_cache.
Handlers are module-level; what they share is the app's `OpenAIServing` (server.openai_serving)."""

from __future__ import annotations

import secrets
import uuid

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Blueprint, Quart, Response, current_app, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from server.chat import collect_batch_chat, collect_chat, stream_chat
from server.completions import collect_completion, stream_completion
from server.config import ServerConfig
from server.cors import install_cors
from server.drain import Drain, install_drain
from server.errors import APIError, error_body, error_type_for, retry_after_header
from server.lora_routes import lora_routes
from server.metrics import orca_header
from server.openai_serving import (
    EXTENSION,
    OpenAIServing,
    decode,
    json_response,
    openai_serving,
    read_body,
    server_version,
)
from server.openapi import openapi_document, request_body
from server.schemas import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from stages.api import EngineClient, EngineError

log = structlog.get_logger("server")

routes = Blueprint("openai", __name__)
tokenizer_info_routes = Blueprint("tokenizer_info", __name__)  # --enable-tokenizer-info-endpoint


def create_app(engine: EngineClient, config: ServerConfig) -> Quart:
    app = Quart(__name__)
    # Generation streams for as long as it takes; Quart's default cuts responses at 60 s.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_body_bytes
    app.config["BODY_TIMEOUT"] = config.request_body_timeout_s
    drain = Drain(config.shutdown_timeout_s)
    app.extensions[EXTENSION] = OpenAIServing(engine, config, drain)
    if config.allowed_origins is not None:
        install_cors(app, config)  # first, so that preflights need no API key
    app.register_blueprint(routes)
    if config.allow_runtime_lora_updating:  # as in vLLM: else these routes do not exist
        app.register_blueprint(lora_routes)
    if config.enable_tokenizer_info_endpoint:
        app.register_blueprint(tokenizer_info_routes)
    install_drain(app, drain)  # 503 with Retry-After while the server drains
    return app


# What --api-key guards besides /v1/*: what reads the model or the engine (as in vLLM, whose
# /tokenize and /detokenize need the key) or changes the engine's state; /health, /ping,
# /version and /metrics stay open to probes.
_KEYED_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/invocations",
        "/debug/profile",
        "/reset_prefix_cache",
    }
)


def needs_api_key(path: str) -> bool:
    """Whether --api-key guards the path."""
    return path.startswith("/v1/") or path in _KEYED_PATHS


# The hooks and error handlers are the app's, so they also cover requests no route matched.
@routes.before_app_request
async def authorize() -> None:
    api_key = openai_serving().api_key
    if api_key is None or not needs_api_key(request.path):
        return
    # RFC 9110: the auth scheme is case-insensitive ("bearer" is as good as "Bearer").
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key):
        raise APIError("Invalid API key", status=401, code="invalid_api_key")


_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations"})


@routes.after_app_request
async def orca_load_report(response: Response) -> Response:
    """vLLM's ORCA load report: a generation request with `endpoint-load-metrics-format: TEXT`
    (or JSON) gets the engine's KV cache use and waiting count in `endpoint-load-metrics`."""
    metrics_format = request.headers.get("endpoint-load-metrics-format")
    if metrics_format is not None and request.path in _GENERATION_PATHS:
        header = orca_header(metrics_format, openai_serving().engine.stats())
        if header is not None:
            response.headers["endpoint-load-metrics"] = header
    return response


@routes.after_app_request
async def echo_request_id(response: Response) -> Response:
    """vLLM's --enable-request-id-headers: X-Request-Id, the request's or a new one, on every
    response; none without the flag."""
    if openai_serving().config.enable_request_id_headers:
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return response


@routes.app_errorhandler(APIError)
async def api_error(error: APIError) -> Response:
    response = json_response(error.body(), error.status)
    if error.retry_after_s is not None:
        response.headers["Retry-After"] = retry_after_header(error.retry_after_s)
    return response


@routes.app_errorhandler(HTTPException)
async def http_error(error: HTTPException) -> Response:
    status = error.code or 500
    response = json_response(
        error_body(error.description or error.name, error_type_for(status)), status
    )
    if isinstance(error, MethodNotAllowed) and error.valid_methods:
        response.headers["Allow"] = ", ".join(error.valid_methods)
    return response


@routes.app_errorhandler(Exception)
async def internal_error(error: Exception) -> Response:
    log.exception("request failed", path=request.path)
    return json_response(error_body(f"internal error: {error}", "InternalServerError"), 500)


@routes.post("/v1/chat/completions")
@request_body(ChatCompletionRequest)
async def chat_completions(raw: bytes | None = None) -> Response:
    serving = openai_serving()
    return await serving.generation_route(
        ChatCompletionRequest,
        "chatcmpl",
        lambda body: [serving.chat_prompt(body)],
        stream_chat,
        collect_chat,
        serving.chat_parsers,
        raw,
    )


@routes.post("/v1/chat/completions/batch")
@request_body(BatchChatCompletionRequest)
async def batch_chat_completions() -> Response:
    """vLLM's: several conversations in one request, one choice each (no streaming)."""
    serving = openai_serving()
    return await serving.generation_route(
        BatchChatCompletionRequest,
        "chatcmpl",
        lambda body: [serving.chat_prompt(c) for c in body.conversations()],
        None,
        collect_batch_chat,
        serving.chat_parsers,
    )


@routes.post("/v1/completions")
@request_body(CompletionRequest)
async def completions(raw: bytes | None = None) -> Response:
    serving = openai_serving()
    engine = serving.engine
    return await serving.generation_route(
        CompletionRequest,
        "cmpl",
        lambda body: body.prompt_values(),
        lambda ctx, body, choices: stream_completion(ctx, engine, body, choices),
        lambda ctx, body, choices: collect_completion(ctx, engine, body, choices),
        raw=raw,
    )


@routes.post("/invocations")
async def invocations() -> Response:
    """SageMaker's entry point (vLLM's): a chat body (it has `messages`) or a text completion's
    (it has `prompt`), answered as its own route would."""
    raw = await read_body()
    try:
        keys = msgspec.json.decode(raw, type=dict[str, msgspec.Raw]).keys()
    except msgspec.MsgspecError as error:
        raise APIError.from_decode(error) from error
    if "messages" in keys:
        return await chat_completions(raw)
    if "prompt" in keys:
        return await completions(raw)
    raise APIError(
        "/invocations takes a chat completion (with `messages`) or a completion (with `prompt`)",
        param="messages",
    )


@routes.get("/load")
async def server_load() -> Response:
    """vLLM's: the generation requests in flight (streams until their last chunk)."""
    return json_response({"server_load": openai_serving().load.in_flight})


def _model_card(serving: OpenAIServing, name: str) -> dict[str, object]:
    """A served name's card; a LoRA adapter's names its directory as `root` and the base model's
    name as `parent` (vLLM's shape)."""
    info = serving.engine.model_info
    adapter = serving.lora_adapters.by_name.get(name)
    return {
        "id": name,
        "object": "model",
        "created": info.created,
        "owned_by": "pipeline-serve",
        "root": info.model_path if adapter is None else adapter.request.path,
        "parent": None if adapter is None else adapter.parent,
        "max_model_len": info.max_model_len,
    }


# The prompt a request would generate from, rendered by the render stage as for generation, and
# nothing generated; as in vLLM, chat answers one request and text completions a list of them.
@routes.post("/v1/chat/completions/render")
@request_body(ChatCompletionRequest)
async def render_chat_completion() -> Response:
    serving = openai_serving()
    (rendered,) = await serving.render_route(
        ChatCompletionRequest,
        "chatcmpl",
        lambda body: [serving.chat_prompt(body)],
        serving.chat_parsers,
    )
    return json_response(rendered)


@routes.post("/v1/completions/render")
@request_body(CompletionRequest)
async def render_completion() -> Response:
    serving = openai_serving()
    rendered = await serving.render_route(CompletionRequest, "cmpl", lambda b: b.prompt_values())
    return json_response(rendered)


@routes.get("/v1/models")
async def models() -> Response:
    serving = openai_serving()
    names = [*serving.served_model_names, *serving.lora_adapters.by_name]
    cards = [_model_card(serving, name) for name in names]
    return json_response({"object": "list", "data": cards})


@routes.get("/v1/models/<path:model_id>")
async def model(model_id: str) -> Response:
    """The card of a served name, the first or a further --served-model-name or an adapter's (the
    OpenAI client's `models.retrieve`); 404 for any other name. A path, since Hugging Face names have a
    slash in them (`HuggingFaceTB/SmolLM2-135M`)."""
    serving = openai_serving()
    serving.check_model(model_id)
    return json_response(_model_card(serving, model_id))


# vLLM's /ping (SageMaker's probe) answers as /health, to GET and POST alike.
@routes.route("/ping", methods=["GET", "POST"])
@routes.get("/health")
async def health() -> Response:
    engine = openai_serving().engine
    if engine.ready:
        return Response(b"", status=200)
    raise APIError.from_engine(engine.not_ready_error)


@routes.get("/openapi.json")
async def openapi() -> Response:
    """This document: every route, with the JSON Schema of each request body."""
    api_key = openai_serving().api_key
    return json_response(
        openapi_document(
            current_app,
            "pipeline-serve",
            server_version(),
            needs_api_key if api_key is not None else None,
        )
    )


@routes.get("/version")
async def server_version_route() -> Response:
    # vLLM's document, and which kernels run the model (a CPU ISA level, torch or triton)
    kernels = openai_serving().engine.model_info.kernels
    return json_response({"version": server_version(), "kernels": kernels})


# Both parse, check and (de)tokenize in a worker thread: a body of megabytes takes seconds.
@routes.post("/tokenize")
@request_body(TokenizeRequest)
async def tokenize() -> Response:
    serving = openai_serving()
    engine = serving.engine
    raw = await read_body()

    def work() -> tuple[list[int], list[str] | None]:
        body = decode(raw, TokenizeRequest, serving.unknown_fields)
        serving.check_model(body.model)
        body.validate(serving.config.trust_request_chat_template)
        tokens = engine.tokenize(serving.with_template_defaults(body.prompt_value()))
        return tokens, engine.token_strings(tokens) if body.return_token_strs else None

    try:
        tokens, token_strs = await serving.in_worker(work)
    except EngineError as error:
        raise APIError.from_engine(error) from error
    return json_response(
        {
            "count": len(tokens),
            "max_model_len": engine.model_info.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,  # null unless return_token_strs, as in vLLM
        }
    )


@tokenizer_info_routes.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    """vLLM's (--enable-tokenizer-info-endpoint): the tokenizer's class, special tokens and chat
    template; without the flag the route does not exist, as in vLLM."""
    return json_response(openai_serving().engine.tokenizer_info())


@routes.post("/detokenize")
@request_body(DetokenizeRequest)
async def detokenize() -> Response:
    serving = openai_serving()
    engine = serving.engine
    raw = await read_body()

    def work() -> str:
        body = decode(raw, DetokenizeRequest, serving.unknown_fields)
        serving.check_model(body.model)
        body.validate(engine.model_info.vocab_size)
        return engine.detokenize(body.tokens)

    try:
        text = await serving.in_worker(work)
    except EngineError as error:
        raise APIError.from_engine(error) from error
    return json_response({"prompt": text})


@routes.post("/reset_prefix_cache")
async def reset_prefix_cache() -> Response:
    """vLLM's: every cached prefix block no request holds is dropped, before any request sent
    after the answer is scheduled; 200 with an empty body."""
    engine = openai_serving().engine
    try:
        await engine.reset_prefix_cache()
    except EngineError as error:
        raise APIError.from_engine(error) from error
    return Response(b"", status=200)


@routes.get("/metrics")
async def prometheus_metrics() -> Response:
    return Response(openai_serving().metrics.render(), status=200, content_type=CONTENT_TYPE_LATEST)


@routes.get("/debug/profile")
async def profile() -> Response:
    """Each stage's trace spans since the last call (columns) and every process's CPU seconds,
    for `pipeline-bench serve --profile`. Engines without traces answer 404."""
    engine = openai_serving().engine
    read_traces = getattr(engine, "read_traces", None)
    cpu_seconds = getattr(engine, "cpu_seconds", None)
    if read_traces is None or cpu_seconds is None:
        raise APIError("this engine keeps no traces", 404, "NotFoundError")
    spans = {
        stage: {name: records[name].tolist() for name in records.dtype.names}
        for stage, records in read_traces().items()
    }
    return json_response({"stages": spans, "cpu_seconds": cpu_seconds()})
