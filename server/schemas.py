"""OpenAI request bodies (with vLLM's extras) and their translation into engine requests.

msgspec Structs rather than pydantic models: msgspec is already a dependency of the project
(the stages use it for typed messages), it validates ranges and types while it decodes, in one
pass over the raw bytes, and it costs a fraction of pydantic's time per request on the hot path.
Checks that span several fields live in each request's `validate` method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from server.errors import APIError
from stages.api import ChatPrompt, SamplingParams, TextPrompt, TokensPrompt

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
TopK = Annotated[int, Meta(ge=-1)]
LogprobCount = Annotated[int, Meta(ge=0, le=20)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
TokenId = Annotated[int, Meta(ge=0)]

_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields that chat and text completions share."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extras
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = None
    priority: int = 0
    prompt_logprobs: LogprobCount | None = None  # vLLM: top-k logprobs of every prompt token

    def _validate_common(self, max_tokens: int | None, vocab_size: int) -> None:
        if self.n != 1:
            raise APIError("n > 1 is not supported: only one choice per request", param="n")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options can only be set when stream is true", param="stream_options"
            )
        if isinstance(self.stop, list) and not all(self.stop):
            raise APIError("stop strings must not be empty", param="stop")
        if self.stop == "":
            raise APIError("stop strings must not be empty", param="stop")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise APIError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                param="min_tokens",
            )
        for key in self.logit_bias or {}:
            if not key.isdigit() or int(key) >= vocab_size:
                raise APIError(
                    f"logit_bias keys must be token ids below {vocab_size}, got {key!r}",
                    param="logit_bias",
                )
        _check_token_ids(self.stop_token_ids or (), vocab_size, "stop_token_ids")

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        defaults = SamplingParams()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=_or(self.temperature, defaults.temperature),
            top_p=_or(self.top_p, defaults.top_p),
            top_k=_or(self.top_k, defaults.top_k),
            min_p=_or(self.min_p, defaults.min_p),
            presence_penalty=_or(self.presence_penalty, defaults.presence_penalty),
            frequency_penalty=_or(self.frequency_penalty, defaults.frequency_penalty),
            repetition_penalty=_or(self.repetition_penalty, defaults.repetition_penalty),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        # vLLM's rule: per-chunk usage only when the final usage chunk was asked for too.
        return (
            self.include_usage
            and self.stream_options is not None
            and (self.stream_options.continuous_usage_stats)
        )


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: only the first call the model writes
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM: False drops reasoning_content from the response

    @property
    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def validate(self, vocab_size: int) -> None:
        self._validate_common(self.effective_max_tokens, vocab_size)
        for index, message in enumerate(self.messages):
            _check_message(index, message)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(
                f"response_format type {self.response_format.get('type')!r} is not supported; "
                "only 'text' is",
                param="response_format",
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].get("role") != "assistant":
            raise APIError(
                "continue_final_message needs the last message to be from the assistant",
                param="continue_final_message",
            )
        self._validate_tools()

    def _validate_tools(self) -> None:
        for index, tool in enumerate(self.tools or ()):
            function = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(function, dict)
                or not (isinstance(function.get("name"), str))
            ):
                raise APIError(
                    "each tool must be {'type': 'function', 'function': {'name': ...}}",
                    param=f"tools[{index}]",
                )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if self.tool_choice is None or self.tool_choice in ("none", "auto"):
            return
        # "required" and a named function force the output's shape, which needs guided decoding.
        raise APIError(
            f"tool_choice {self.tool_choice!r} is not supported (it needs guided decoding); "
            "use 'auto' or 'none'",
            param="tool_choice",
        )

    def tool_call_parser(self, parser: str | None, enable_auto_tool_choice: bool) -> str | None:
        """The tool-call parser this request's output goes through (None: tools are not parsed).

        As in vLLM, tools with tool_choice "auto" (the default once tools are given) need the
        server started with --enable-auto-tool-choice and a --tool-call-parser."""
        if not self.tools or self.tool_choice == "none":
            return None
        if not enable_auto_tool_choice or parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return parser

    def prompt(self) -> ChatPrompt:
        return ChatPrompt(
            messages=[_normalize_message(m) for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
        )

    def sampling_params(self) -> SamplingParams:
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        sampling = self._sampling(self.effective_max_tokens, logprobs)
        return dataclasses.replace(sampling, prompt_logprobs=self.prompt_logprobs)


class CompletionRequest(_GenerationRequest, kw_only=True):
    # One prompt: a string, a one-string list, or token ids (msgspec allows one array type in a
    # union, so the list's element kinds are checked in `validate`).
    prompt: str | list[str | int]
    logprobs: LogprobCount | None = None
    echo: bool = False
    add_special_tokens: bool = True

    def validate(self, vocab_size: int) -> None:
        self._validate_common(self.max_tokens, vocab_size)
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise APIError("prompt must not be empty", param="prompt")
            return
        if not self.prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise APIError("only one prompt per request is supported", param="prompt")
            if not self.prompt[0]:
                raise APIError("prompt must not be empty", param="prompt")
            return
        token_ids = [p for p in self.prompt if isinstance(p, int)]
        if len(token_ids) != len(self.prompt):
            raise APIError(
                "prompt must be a string, a list of one string, or a list of token ids",
                param="prompt",
            )
        _check_token_ids(token_ids, vocab_size, "prompt")

    def prompt_value(self) -> TextPrompt | TokensPrompt:
        if isinstance(self.prompt, str):
            return TextPrompt(self.prompt, add_special_tokens=self.add_special_tokens)
        if isinstance(self.prompt[0], str):
            return TextPrompt(self.prompt[0], add_special_tokens=self.add_special_tokens)
        return TokensPrompt([int(p) for p in self.prompt])

    def sampling_params(self) -> SamplingParams:
        sampling = self._sampling(self.max_tokens, self.logprobs)
        wanted = [self.prompt_logprobs]
        if self.echo and self.logprobs is not None:
            # echo with logprobs returns the prompt's logprobs ahead of the completion's
            wanted.append(self.logprobs)
        counts = [k for k in wanted if k is not None]
        return dataclasses.replace(sampling, prompt_logprobs=max(counts) if counts else None)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize body: either `prompt` or `messages` (+ the chat template's options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        for index, message in enumerate(self.messages or ()):
            _check_message(index, message)

    def prompt_value(self) -> ChatPrompt | TextPrompt:
        if self.messages is not None:
            return ChatPrompt(
                messages=[_normalize_message(m) for m in self.messages],
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                chat_template_kwargs=self.chat_template_kwargs,
                tools=self.tools,
            )
        add_special_tokens = True if self.add_special_tokens is None else self.add_special_tokens
        return TextPrompt(self.prompt or "", add_special_tokens=add_special_tokens)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None

    def validate(self, vocab_size: int) -> None:
        _check_token_ids(self.tokens, vocab_size, "tokens")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise APIError(
                f"token id {token_id} is outside the vocabulary [0, {vocab_size})",
                param=f"{param}[{index}]",
            )


def _check_message(index: int, message: dict[str, Any]) -> None:
    param = f"messages[{index}]"
    role = message.get("role")
    if role not in _CHAT_ROLES:
        raise APIError(
            f"{param}.role must be one of {sorted(_CHAT_ROLES)}, got {role!r}",
            param=f"{param}.role",
        )
    content = message.get("content")
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return
        raise APIError(f"{param}.content is required", param=f"{param}.content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise APIError(
            f"{param}.content must be a string or a list of content parts", param=f"{param}.content"
        )
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not (isinstance(part.get("text"), str))
        ):
            raise APIError(
                f"{param}.content: only text content parts are supported", param=f"{param}.content"
            )


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """Text content parts become one string (as vLLM does), which every chat template reads."""
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": "\n".join(part["text"] for part in content)}
    return message
