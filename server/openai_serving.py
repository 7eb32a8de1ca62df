"""What the routes share: `OpenAIServing` holds the engine, config and metrics and runs a
generation request from body to response, as vLLM's serving classes do; app.py's handlers fetch
it per request."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import msgspec
import structlog
from quart import Response, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from server.config import ServerConfig
from server.drain import Drain
from server.errors import APIError
from server.limits import BodyReads, body_too_large, check_json_depth
from server.lora import LoraAdapters
from server.metrics import ServerMetrics
from server.render import token_in_request
from server.schemas import ChatCompletionRequest, check_max_logprobs
from server.serving import (
    Choice,
    ChoiceGroup,
    ResponseContext,
    ServerLoad,
    Tracker,
    close_choices,
    start,
)
from server.vllm_configs import SERVED_BACKEND
from stages.api import (
    ChatPrompt,
    EngineClient,
    EngineError,
    GenerateRequest,
    SamplingParams,
    TokensPrompt,
)

log = structlog.get_logger("server")

RequestT = TypeVar("RequestT", bound=msgspec.Struct)
T = TypeVar("T")
StreamBuilder = Callable[[ResponseContext, list[Choice]], AsyncIterator[bytes]]
Collector = Callable[[ResponseContext, list[Choice]], Awaitable[dict[str, Any]]]

EXTENSION = "pipeline_serve"
# Tokenizing megabytes of text takes seconds, and parsing and checking a large body tens of
# milliseconds: such work runs in this many worker threads, off the event loop.
WORKER_THREADS = 2
INLINE_BODY_BYTES = 64 * 1024  # bodies up to this size are parsed on the loop, in microseconds


def server_version() -> str:
    try:
        return version("pipeline-serve")
    except PackageNotFoundError:
        return "unknown"


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json")


def is_json_media_type(mimetype: str) -> bool:
    """`application/json` or `application/*+json` (parameters already stripped, lowercase); no
    Content-Type at all counts as JSON, as FastAPI (and so vLLM) reads it."""
    if not mimetype:
        return True
    kind, _, subtype = mimetype.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


async def read_body() -> bytes:
    """The raw JSON body; APIError 415 for a body of another media type, 413 for one over
    --max-request-body-bytes.

    text/plain, form-encoded and multipart are what a web page can make a browser post to any
    origin without a CORS preflight; parsed as JSON they would let any page drive the server
    (FastAPI refuses them since CVE-2021-32677)."""
    if not is_json_media_type(request.mimetype):
        raise APIError(
            f"Unsupported Content-Type {request.mimetype!r}: the body must be JSON "
            "(application/json)",
            status=415,
            code="unsupported_media_type",
        )
    serving = openai_serving()
    limit = serving.config.max_request_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit, request.content_length)
    with serving.body_reads.reading(request.remote_addr or "an unknown address"):
        try:
            # Quart cuts a chunked body off at the limit too, and at the body timeout.
            return await request.get_data(cache=False, as_text=False, parse_form_data=False)
        except RequestEntityTooLarge:
            raise body_too_large(limit) from None
        except RequestTimeout:
            raise APIError(
                f"The request body did not arrive within {serving.config.request_body_timeout_s:g}"
                " s (--request-body-timeout)",
                status=408,
            ) from None


class UnknownFields:
    """Body fields no schema knows stay ignored (as in vLLM), but each name is logged once per
    process at debug, so a client's misspelt or newer field can be found. Off unless the server
    logs at debug: finding them parses the body's keys a second time."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # bodies are parsed on the loop and in worker threads

    def note(self, raw: bytes, kind: type[msgspec.Struct]) -> None:
        if not self.enabled:
            return
        try:
            fields = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        except msgspec.MsgspecError:
            return
        known = kind.__struct_encode_fields__
        unknown = [name for name in fields if name not in known]
        # an object field's own keys too, named by their path (`structured_outputs.bogus`)
        nested: dict[str, frozenset[str]] = getattr(kind, "NESTED_KEYS", {})
        for name, keys in nested.items():
            try:
                inner = msgspec.json.decode(fields.get(name, b"null"), type=dict[str, msgspec.Raw])
            except msgspec.MsgspecError:  # absent, null, or not an object (decode refused it)
                continue
            unknown += [f"{name}.{key}" for key in inner if key not in keys]
        with self._lock:
            new = [name for name in unknown if name not in self._logged]
            self._logged.update(new)
        for name in new:
            log.debug("unknown request field ignored", field=name, schema=kind.__name__)


def decode(raw: bytes, kind: type[RequestT], unknown: UnknownFields | None = None) -> RequestT:
    """The JSON body as `kind`; APIError 400 for one nested too deep or malformed."""
    check_json_depth(raw)
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.MsgspecError as error:
        raise APIError.from_decode(error) from error
    if unknown is not None:
        unknown.note(raw, kind)
    return body


def openai_serving() -> OpenAIServing:
    """The state of the app handling the current request (create_app stored it)."""
    serving: OpenAIServing = current_app.extensions[EXTENSION]
    return serving


class OpenAIServing:
    """One app's engine, config and what follows from them, and the steps of a generation."""

    __slots__ = (
        "_workers",
        "api_key",
        "beam_groups",
        "body_reads",
        "config",
        "drain",
        "engine",
        "fingerprint",
        "load",
        "lora_adapters",
        "metrics",
        "served_model_name",
        "served_model_names",
        "unknown_fields",
    )

    def __init__(self, engine: EngineClient, config: ServerConfig, drain: Drain) -> None:
        self.engine = engine
        self.config = config
        self.drain = drain
        self.body_reads = BodyReads(config.max_body_reads_per_client)
        self.served_model_name = config.served_model_name or engine.model_info.served_model_name
        self.served_model_names = (self.served_model_name, *config.served_model_aliases)
        self.lora_adapters = LoraAdapters.of(
            self.served_model_names, config.enable_lora, config.lora_modules
        )
        self.metrics = ServerMetrics(
            engine.stats, self.served_model_name, engine.model_info.num_engines
        )
        self.metrics.structured_outputs(config.structured_outputs_backend, SERVED_BACKEND)
        self.fingerprint = f"pipeline-serve-{server_version()}"
        self.api_key = config.api_key.encode() if config.api_key is not None else None
        self.unknown_fields = UnknownFields(config.log_level == "debug")
        self.beam_groups = itertools.count(1)  # ids of beam search requests, for the scheduler
        self.load = ServerLoad()  # generation requests in flight (GET /load)
        self._workers: anyio.CapacityLimiter | None = None  # made in the loop, at first use

    async def in_worker(self, work: Callable[[], T]) -> T:
        """`work()` in a worker thread, WORKER_THREADS at a time (the rest wait their turn), so
        that the event loop serves every other request meanwhile. Not cancelled midway: a client
        that leaves frees its thread only when the work is done, so the bound holds."""
        if self._workers is None:
            self._workers = anyio.CapacityLimiter(WORKER_THREADS)
        return await anyio.to_thread.run_sync(work, limiter=self._workers)

    def check_model(self, name: str | None) -> str:
        """The name responses report (the first served name, as in vLLM) for a request's
        `model`, which may be any of the served names, or a LoRA adapter's (reported as is)."""
        if name is None or name in self.served_model_names:
            return self.served_model_name
        if self.lora_adapters.get(name) is not None:
            return name
        raise APIError(
            f"The model `{name}` does not exist.",
            status=404,
            param="model",
            code="model_not_found",
        )

    def check_priority(self, priority: int) -> None:
        """Under fcfs a priority would be ignored: refused instead (vLLM's documented answer)."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise APIError(
                f"Got priority {priority} but Priority scheduling is not enabled: start the "
                "server with --scheduling-policy priority",
                param="priority",
            )

    def request_id_for(self, body_request_id: str | None, prefix: str) -> str:
        """vLLM's response id: the prefix, then the X-Request-Id header, the body's request_id
        or a new one (`chatcmpl-<id>`, `cmpl-<id>`)."""
        base = request.headers.get("X-Request-Id") or body_request_id or uuid.uuid4().hex
        return f"{prefix}-{base}"

    def with_template_defaults(self, prompt: T) -> T:
        """A chat prompt with --default-chat-template-kwargs under its own chat_template_kwargs
        (the request's win, as in vLLM); other prompts as they are."""
        defaults = self.config.default_chat_template_kwargs
        if not defaults or not isinstance(prompt, ChatPrompt):
            return prompt
        kwargs = {**defaults, **(prompt.chat_template_kwargs or {})}
        return msgspec.structs.replace(prompt, chat_template_kwargs=kwargs)

    def sampling_of(self, body: Any) -> SamplingParams:
        """The body's sampling parameters, with the generation config's defaults for those the
        body leaves unset (vLLM's default_sampling_params)."""
        sampling: SamplingParams = body.sampling_params()
        if sampling.beam is not None:  # beams are ranked on the model's own distribution
            return sampling
        defaults = {
            name: value
            for name, value in self.config.default_sampling_params.items()
            if getattr(body, name) is None
        }
        return msgspec.structs.replace(sampling, **defaults) if defaults else sampling

    def chat_prompt(self, body: ChatCompletionRequest) -> ChatPrompt | TokensPrompt:
        """The chat body's prompt (the ids a prefill server forwarded in kv_transfer_params,
        when it did); a 400 for a template of its own unless the server trusts it."""
        body.check_chat_template(self.config.trust_request_chat_template)
        reused = body.reused_prompt_ids
        if reused is not None:
            return TokensPrompt(reused)
        return body.prompt(self.config.exclude_tools_when_tool_choice_none)

    def chat_parsers(self, body: ChatCompletionRequest) -> tuple[str | None, str | None]:
        """The server's reasoning parser (none for reasoning_effort "none", whose output vLLM
        leaves whole as content), and its tool-call parser where the tools need it."""
        config = self.config
        tool_call_parser = body.tool_call_parser(
            config.tool_call_parser, config.enable_auto_tool_choice
        )
        reasoning_parser = None if body.reasoning_effort == "none" else config.reasoning_parser
        return reasoning_parser, tool_call_parser

    async def generation_route(
        self,
        schema: Any,
        id_prefix: str,
        prompts_of: Callable[[Any], list[Any]],
        stream_builder: Callable[..., Any] | None,  # None: the schema refuses `stream`
        collector: Callable[..., Any],
        parsers_of: Callable[[Any], tuple[str | None, str | None]] = lambda body: (None, None),
        raw: bytes | None = None,
    ) -> Response:
        """Decode and validate the body (`raw`, when the route has read it already), build the
        engine requests (one per prompt), answer streaming or not."""
        body, model, generate_requests = await self.parse_generation(
            schema, id_prefix, prompts_of, parsers_of, raw
        )
        if self.config.enable_log_requests:
            for generate_request in generate_requests:
                log.info(
                    "request received",
                    request_id=generate_request.request_id,
                    prompt=msgspec.to_builtins(generate_request.prompt),
                    params=msgspec.to_builtins(generate_request.sampling),
                )
        return await self.generate(
            generate_requests,
            model,
            body.stream,
            body.n,
            lambda ctx, choices: stream_builder(ctx, body, choices),  # type: ignore[misc]
            lambda ctx, choices: collector(ctx, body, choices),
            with_prompt_text=getattr(body, "return_prompt_text", None) is True,  # chat only
        )

    async def parse_generation(
        self,
        schema: Any,
        id_prefix: str,
        prompts_of: Callable[[Any], list[Any]],
        parsers_of: Callable[[Any], tuple[str | None, str | None]] = lambda body: (None, None),
        raw: bytes | None = None,
    ) -> tuple[Any, str, list[GenerateRequest]]:
        """(the body, the model it names, the engine request of each of its prompts, in order);
        APIError for a body that is refused."""
        arrival_ns = time.monotonic_ns()
        if raw is None:
            raw = await read_body()
        vocab_size = self.engine.model_info.vocab_size

        def parse() -> tuple[Any, str, list[Any], SamplingParams, tuple[str | None, str | None]]:
            body = decode(raw, schema, self.unknown_fields)
            model = self.check_model(body.model)
            body.validate(vocab_size)
            self.check_priority(body.priority)
            check_max_logprobs(body, self.config.max_logprobs, vocab_size)
            prompts = [self.with_template_defaults(prompt) for prompt in prompts_of(body)]
            return body, model, prompts, self.sampling_of(body), parsers_of(body)

        # A large body (thousands of messages, say) takes a while to parse and check.
        parsed = parse() if len(raw) <= INLINE_BODY_BYTES else await self.in_worker(parse)
        body, model, prompts, sampling, (reasoning_parser, tool_call_parser) = parsed
        request_id = self.request_id_for(body.request_id, id_prefix)
        generate_requests = [
            GenerateRequest(
                # the prompts of a batch share the response's id, as the choices of n > 1 do
                request_id=request_id,
                prompt=prompt,
                sampling=sampling,
                priority=body.priority,
                arrival_ns=arrival_ns,
                reasoning_parser=reasoning_parser,
                tool_call_parser=tool_call_parser,
                cache_salt=body.cache_salt,
                stream_interval=body.stream_interval,
                return_prompt_token_ids=body.wants_prompt_token_ids,
                lora=self.lora_adapters.get(model),
            )
            for prompt in prompts
        ]
        return body, model, generate_requests

    async def render_route(
        self,
        schema: Any,
        id_prefix: str,
        prompts_of: Callable[[Any], list[Any]],
        parsers_of: Callable[[Any], tuple[str | None, str | None]] = lambda body: (None, None),
    ) -> list[dict[str, Any]]:
        """What the engine would generate from: the body checked and rendered as for a real
        request (and refused with the same errors), in vLLM's shape of a token-in request, one
        per prompt."""
        body, model, generate_requests = await self.parse_generation(
            schema, id_prefix, prompts_of, parsers_of
        )
        if not self.engine.ready:
            raise APIError.from_engine(self.engine.not_ready_error)
        try:
            rendered = [await self.engine.render(request) for request in generate_requests]
        except EngineError as error:
            raise APIError.from_engine(error) from error
        return [
            token_in_request(body, model, request, info)
            for request, info in zip(generate_requests, rendered, strict=True)
        ]

    async def generate(
        self,
        generate_requests: list[GenerateRequest],
        model: str,
        stream: bool,
        n: int,
        stream_builder: StreamBuilder,
        collector: Collector,
        with_prompt_text: bool = False,
    ) -> Response:
        if not self.engine.ready:
            raise APIError.from_engine(self.engine.not_ready_error)
        config = self.config
        first_request = generate_requests[0]
        ctx = ResponseContext(
            request_id=first_request.request_id,
            model=model,
            created=int(time.time()),
            system_fingerprint=self.fingerprint,
            # One choice's figures are not the request's: left out for several choices, as vLLM
            # leaves them out for n > 1.
            include_request_metrics=config.enable_per_request_metrics
            and n * len(generate_requests) == 1,
            reasoning=first_request.reasoning_parser is not None,
            prompt_tokens_details=config.enable_prompt_tokens_details,
            force_include_usage=config.enable_force_include_usage,
            return_tokens_as_token_ids=config.return_tokens_as_token_ids,
            response_role=config.response_role,
        )
        ticket = self.load.enter()
        try:
            choices = await self.start_all_choices(generate_requests, n)
        except BaseException:
            ticket.release()
            raise
        for choice in choices:
            choice.ticket = ticket
        if with_prompt_text:
            # The text of the tokens the model was fed: the chat template's output, truncated
            # as the request asked. Decoding a long prompt takes a while: off the loop.
            prompt_ids = list(choices[0].first.prompt_token_ids or ())
            try:
                text = await self.in_worker(lambda: self.engine.detokenize(prompt_ids))
            except BaseException:
                await close_choices(choices)
                raise
            ctx = dataclasses.replace(ctx, prompt_text=text)
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

    async def start_all_choices(
        self, generate_requests: list[GenerateRequest], n: int
    ) -> list[Choice]:
        """The n choices of each prompt, numbered prompt by prompt (vLLM's index: prompt i's
        choice j is i * n + j); if any prompt fails to start, the others are closed."""
        started = await asyncio.gather(
            *(
                self.start_choices(request, n, prompt_index)
                for prompt_index, request in enumerate(generate_requests)
            ),
            return_exceptions=True,
        )
        choices = [c for result in started if not isinstance(result, BaseException) for c in result]
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            await close_choices(choices)
            raise failed[0]
        return choices

    async def start_choices(
        self, generate_request: GenerateRequest, n: int, prompt_index: int = 0
    ) -> list[Choice]:
        """n engine requests, one per choice (as vLLM fans out n > 1); a seed gives choice i
        seed + i, so the choices differ and the whole response still repeats."""
        requests = [generate_request]
        seed = generate_request.sampling.seed
        beam = generate_request.sampling.beam
        if beam is not None:
            # One search for all: its choices share a group and take the hypotheses in order.
            group = next(self.beam_groups)
            requests = [
                msgspec.structs.replace(
                    generate_request,
                    sampling=msgspec.structs.replace(
                        generate_request.sampling,
                        beam=msgspec.structs.replace(beam, group=group, index=i),
                    ),
                )
                for i in range(n)
            ]
        else:
            for i in range(1, n):
                sampling = msgspec.structs.replace(
                    generate_request.sampling, seed=None if seed is None else seed + i
                )
                requests.append(msgspec.structs.replace(generate_request, sampling=sampling))
        log_outputs = self.config.enable_log_outputs
        choice_group = ChoiceGroup(self.metrics, len(requests))
        trackers = [
            Tracker(
                self.metrics,
                r.request_id,
                r.arrival_ns,
                log_outputs,
                r.sampling.max_tokens,
                choice_group,
            )
            for r in requests
        ]
        started = await asyncio.gather(
            *(start(self.engine, r, self.drain) for r in requests), return_exceptions=True
        )
        choices = [
            Choice(prompt_index * n + i, result[0], result[1], trackers[i], prompt_index)
            for i, result in enumerate(started)
            if not isinstance(result, BaseException)
        ]
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            await close_choices(choices)
            raise failed[0]
        return choices
