"""The front end's configuration, built once from the CLI and frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.limits import (
    DEFAULT_MAX_BODY_READS_PER_CLIENT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
)
from stages.lora import LoraModule


@dataclass(slots=True, frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None  # vLLM's --uds: serve on this Unix domain socket, not host:port
    served_model_name: str | None = None  # None = the engine's ModelInfo.served_model_name
    # --served-model-name's further names: accepted as `model` and listed by /v1/models;
    # responses report the first name, as vLLM's do.
    served_model_aliases: tuple[str, ...] = ()
    api_key: str | None = None  # when set, /v1/*, /tokenize, /detokenize and /debug/profile need it
    enable_per_request_metrics: bool = False
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    log_format: str = "auto"  # auto (JSON unless stderr is a terminal) | json | console
    log_level: str = "info"
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies are a 413
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S  # slower bodies are a 408
    max_body_reads_per_client: int = DEFAULT_MAX_BODY_READS_PER_CLIENT  # more at once: 429
    # --shutdown-timeout: on SIGTERM, how long requests in flight get to finish before they are
    # ended with a 503 (an SSE error event when streaming); new ones get 503 meanwhile.
    shutdown_timeout_s: float = 30.0
    # Output parsing for chat (stages.text.parsers), named and switched on as in `vllm serve`.
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning_content split out
    # --structured-outputs-config's backend as asked (vLLM's names); llguidance compiles them all
    structured_outputs_backend: str = "auto"
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" works
    # Chat: the role of the reply when add_generation_prompt is set (vLLM's --response-role),
    # and template variables a request's chat_template_kwargs override.
    response_role: str = "assistant"
    default_chat_template_kwargs: dict[str, Any] | None = None
    # What a request leaves unset samples with (temperature, top_p, top_k, min_p,
    # repetition_penalty): the generation config's, as stages.config.generation_defaults reads it.
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = 20  # most logprobs / top_logprobs / prompt_logprobs a request gets; -1: any
    return_tokens_as_token_ids: bool = False  # the default of the request field
    # Streams get usage (every chunk's and a final chunk) without stream_options.include_usage.
    enable_force_include_usage: bool = False
    enable_request_id_headers: bool = False  # answer X-Request-Id: the request's or a new one
    enable_tokenizer_info_endpoint: bool = False  # vLLM's GET /tokenizer_info (off: 404)
    # vLLM's --scheduling-policy: "fcfs" serves by arrival and refuses a request's priority,
    # "priority" admits by (priority, arrival) and preempts the lowest priority first
    scheduling_policy: str = "fcfs"
    enable_log_requests: bool = False  # a log line per request: its prompt and parameters
    enable_log_outputs: bool = False  # and one per response: its text and token ids
    # CORS, as vLLM's (Starlette's) middleware; None: no CORS headers at all.
    allowed_origins: tuple[str, ...] | None = None
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # the prefix a proxy serves the app under (ASGI root_path)
    ssl_keyfile: str | None = None  # HTTPS with both
    ssl_certfile: str | None = None
    uvicorn_log_level: str = "info"  # Hypercorn's loggers (vLLM's flag name)
    # --trust-request-chat-template: a request's own chat_template is rendered (in the sandbox)
    trust_request_chat_template: bool = False
    # vLLM's --exclude-tools-when-tool-choice-none: a request with tool_choice "none" renders
    # without its tools
    exclude_tools_when_tool_choice_none: bool = False
    # LoRA: --enable-lora, the adapters of --lora-modules (checked at start), and vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING (read once, at start): /v1/load_lora_adapter and
    # /v1/unload_lora_adapter exist.
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    allow_runtime_lora_updating: bool = False
