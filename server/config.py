"""The front end's configuration, built once from the CLI and frozen."""

from __future__ import annotations

from dataclasses import dataclass

from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES


@dataclass(slots=True, frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None = the engine's ModelInfo.served_model_name
    api_key: str | None = None  # when set, /v1/*, /tokenize, /detokenize and /debug/profile need it
    enable_per_request_metrics: bool = False
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    log_format: str = "auto"  # auto (JSON unless stderr is a terminal) | json | console
    log_level: str = "info"
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies are a 413
    # --shutdown-timeout: on SIGTERM, how long requests in flight get to finish before they are
    # ended with a 503 (an SSE error event when streaming); new ones get 503 meanwhile.
    shutdown_timeout_s: float = 30.0
    # Output parsing for chat (stages.text.parsers), named and switched on as in `vllm serve`.
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning_content split out
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" works
    # --trust-request-chat-template: a request's own chat_template is rendered (in the sandbox)
    trust_request_chat_template: bool = False
