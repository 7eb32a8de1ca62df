"""OpenAI request bodies (with vLLM's extras) and their translation into engine requests.

msgspec Structs rather than pydantic models: msgspec is already a dependency of the project
(the stages use it for typed messages), it validates ranges and types while it decodes, in one
pass over the raw bytes, and it costs a fraction of pydantic's time per request on the hot path.
Checks that span several fields live in each request's `validate` method.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import structlog
from msgspec import Meta

from server.errors import APIError
from server.limits import check_json_depth
from stages.api import (
    BeamSearchParams,
    ChatPrompt,
    SamplingParams,
    StructuredOutput,
    TextPrompt,
    TokensPrompt,
)

log = structlog.get_logger("server")
_warned: set[tuple[str, str]] = set()


def _warn_once(event: str, param: str) -> None:
    """A warning the first time a kind of request is served differently from what it asked
    (vLLM's warning_once): per request it would flood the log."""
    if (event, param) not in _warned:
        _warned.add((event, param))
        log.warning(event, param=param)


Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
# Every integer has the stages' int64 range at most: one past it would pass the schema and then
# fail to pack into the request record, a 500 instead of the 400 that names it.
INT64_MAX = 2**63 - 1
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
# at most --max-logprobs (check_max_logprobs); -1: the whole vocabulary, as in vLLM
LogprobCount = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
WHOLE_VOCABULARY = -1
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
# vLLM's logprob_token_ids: 1 to 128 ids (its MAX_LOGPROB_TOKEN_IDS)
LogprobTokenIds = Annotated[list[TokenId], Meta(min_length=1, max_length=128)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]  # the stages carry it as int32
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # vLLM's range: the sampler's int64
# vLLM's cache_salt: 1 to 128 characters, none of which a cache backend's key could trip on
CacheSalt = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]*$")]

MAX_CHOICES = 16  # n: each choice is an engine request of its own
# A text completion's prompts are engine requests of their own too: bounded as n is, so that one
# body cannot fill the waiting queue (a body is at most --max-request-body-bytes besides).
MAX_BATCH_PROMPTS = 256
MAX_BATCH_CHOICES = 256  # prompts x n
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words
# vLLM's StructuredOutputsParams: one of these kinds, and options that shape its grammar. Of the
# options, the grammar is always as disable_any_whitespace makes it (stages.text.structured's
# JSON on one line) and there is one backend, nothing to fall back to (disable_fallback); the
# others are refused when set, as this server does not apply them.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OUTPUT_REFUSED = ("disable_additional_properties", "whitespace_pattern")
STRUCTURED_OUTPUT_OPTIONS = (
    "disable_fallback",
    "disable_any_whitespace",
    *STRUCTURED_OUTPUT_REFUSED,
)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields that chat and text completions share."""

    _REUSES_PROMPT_IDS = False  # kv_transfer_params' prompt_token_ids taken as the prompt

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
    seed: Seed | None = None
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
    priority: Priority = 0
    prompt_logprobs: LogprobCount | None = None  # vLLM: top-k logprobs of every prompt token
    allowed_token_ids: list[TokenId] | None = None  # vLLM: sample only among these
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None  # -1: fit
    # vLLM: logprobs name tokens "token_id:N"; None: --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    bad_words: list[str] | None = None  # vLLM: words the output must not contain
    spaces_between_special_tokens: bool = True  # vLLM: kept special tokens stand apart
    truncation_side: Literal["left", "right"] | None = None  # which end truncation cuts
    return_token_ids: bool | None = None  # vLLM: prompt_token_ids and each choice's token_ids
    # vLLM: the logprobs of these tokens at each position, in place of the top ones
    logprob_token_ids: LogprobTokenIds | None = None
    cache_salt: CacheSalt | None = None  # vLLM: only requests with the same salt share the cache
    # vLLM: tokens each streamed output gathers (its first and last go at once); never below
    # --stream-interval
    stream_interval: PositiveInt | None = None
    # Beam search (vLLM's): n beams, whose finished hypotheses are the n choices, best first.
    # length_penalty and early_stopping have no effect without it (as in vLLM).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # vLLM: tokens the reasoning may take before its end tag is forced (chat, with a reasoning
    # parser); -1: unlimited
    thinking_token_budget: Annotated[int, Meta(le=INT64_MAX)] | None = None
    # Fields this server refuses (`_refuse_unsupported` says why): OpenAI's best_of, vLLM's
    best_of: PositiveInt | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (one of them per request)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutput | None:
        """The one shape the output must take, if any was asked for (APIError when the fields
        are malformed or more than one is set)."""
        found = [
            spec
            for spec in (
                _response_format(self.response_format),
                _structured_outputs(self.structured_outputs),
                _guided(self),
            )
            if spec is not None
        ]
        if len(found) > 1:
            raise APIError(
                "only one kind of structured output may be asked for "
                f"(found {', '.join(spec.param for spec in found)})",
                param=found[1].param,
            )
        return found[0] if found else None

    def _refuse_unsupported(self) -> None:
        """vLLM's fields that this server cannot honour: each a 400 that says so, never a 200
        that ignores it."""
        if self.thinking_token_budget is not None and self.thinking_token_budget < -1:
            raise APIError(
                "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
                param="thinking_token_budget",
            )
        if self.best_of is not None and self.best_of != 1:
            raise APIError(
                "best_of is not supported: this server does not rank candidates by likelihood; "
                "use n for several choices, or use_beam_search for the most likely ones",
                param="best_of",
            )
        if self.vllm_xargs:
            raise APIError(
                "vllm_xargs is not supported: this server has no custom logits processors to "
                "read them",
                param="vllm_xargs",
            )
        reused = "prompt_token_ids" if self._REUSES_PROMPT_IDS else None
        if {key for key in self.kv_transfer_params or {} if key != reused}:
            raise APIError(
                "kv_transfer_params is not supported: this server has no KV connector",
                param="kv_transfer_params",
            )

    @property
    def asks_logprobs(self) -> bool:
        return False

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by the model's raw log-probabilities and returns whole
        hypotheses: a field that would reshape the distribution, or asks for what a sampled
        token brings (logprobs), is refused rather than ignored."""
        if not self.use_beam_search:
            return
        reshaping = {
            "temperature": self.temperature not in (None, 0.0, 1.0),
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "min_tokens": self.min_tokens > 0,
            "logprobs": self.asks_logprobs,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "logprob_token_ids": self.logprob_token_ids is not None,
            "thinking_token_budget": self.thinking_token_budget not in (None, -1),
        }
        for name, refused in reshaping.items():
            if refused:
                raise APIError(
                    f"{name} cannot be used with beam search: beams are ranked by the model's "
                    "own log-probabilities (temperature may only be 0 or 1)",
                    param=name,
                )
        structured = self.structured()
        if structured is not None:
            raise APIError(
                "structured outputs cannot be used with beam search", param=structured.param
            )

    def _validate_common(self, max_tokens: int | None, vocab_size: int) -> None:
        self._resolve_whole_vocabulary(vocab_size)
        self._refuse_unsupported()
        self._check_beam_search()
        if self.n > MAX_CHOICES:
            raise APIError(f"n must be at most {MAX_CHOICES}", param="n")
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
        _check_logit_bias(self.logit_bias or {}, vocab_size)
        _check_token_ids(self.stop_token_ids or (), vocab_size, "stop_token_ids")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise APIError("allowed_token_ids must not be empty", param="allowed_token_ids")
        _check_token_ids(self.allowed_token_ids or (), vocab_size, "allowed_token_ids")
        _check_token_ids(self.logprob_token_ids or (), vocab_size, "logprob_token_ids")
        if self.truncate_prompt_tokens == 0:
            raise APIError(
                "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
            )

    def _resolve_whole_vocabulary(self, vocab_size: int) -> None:
        """A logprob count of -1 becomes the vocabulary's size, before --max-logprobs bounds it
        (vLLM's order: -1 passes only a server started with --max-logprobs -1)."""
        for name in self._LOGPROB_COUNTS:
            if getattr(self, name) == WHOLE_VOCABULARY:
                setattr(self, name, vocab_size)

    _LOGPROB_COUNTS: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)
    # object fields whose keys are checked as the body's own are (server.openai_serving's
    # UnknownFields): a key outside these is ignored, and logged
    NESTED_KEYS: ClassVar[dict[str, frozenset[str]]] = {
        "structured_outputs": frozenset(STRUCTURED_OUTPUT_KINDS + STRUCTURED_OUTPUT_OPTIONS)
    }

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        defaults = SamplingParams()
        given = tuple(self.logprob_token_ids) if self.logprob_token_ids else None
        if given is not None:
            logprobs = len(given)  # their logprobs take the top-k's place
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
            logprob_token_ids=given,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured=self.structured(),
            allowed_token_ids=tuple(self.allowed_token_ids)
            if self.allowed_token_ids is not None
            else None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            bad_words=tuple(w for w in self.bad_words or () if w.strip()),
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            thinking_token_budget=None
            if self.thinking_token_budget in (None, -1)
            else self.thinking_token_budget,
            # The choices' group and places are set as each becomes an engine request.
            beam=BeamSearchParams(self.n, 0, 0, self.length_penalty, self.early_stopping)
            if self.use_beam_search
            else None,
        )

    def top_logprob_count(self, asked: int) -> int:
        """How many alternatives each logprob entry lists: those asked for, or every token of
        logprob_token_ids (which take their place, as in vLLM)."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else asked

    @property
    def wants_prompt_token_ids(self) -> bool:
        """Whether the response shows the prompt's tokens (the engine then sends them)."""
        return bool(self.return_token_ids)


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    _LOGPROB_COUNTS = ("prompt_logprobs", "top_logprobs")
    # vLLM's decode-side reuse: kv_transfer_params' prompt_token_ids are the prompt, untokenized
    _REUSES_PROMPT_IDS = True
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: only the first call the model writes
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM: False drops reasoning_content from the response
    echo: bool = False  # vLLM: the reply starts with the last message's content (same role)
    chat_template: str | None = None  # vLLM: the request's own (--trust-request-chat-template)
    reasoning_effort: ReasoningEffort | None = None  # vLLM: a chat template variable
    return_prompt_text: bool | None = None  # vLLM: the response carries the prompt's text
    add_special_tokens: bool = False  # vLLM: BOS ahead of the template's text

    def echo_text(self, role: str) -> str:
        """What `echo` puts ahead of the reply: the last message's content (text parts joined by
        newlines) when its role is the reply's `role` (server.chat's: the assistant's start with
        continue_final_message), else nothing, as vLLM."""
        last = self.messages[-1]
        if not self.echo or last.get("role") != role:
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            return "\n".join(str(part.get("text", "")) for part in content)
        return str(content)

    @property
    def request_chat_template(self) -> str | None:
        return _request_chat_template(self.chat_template, self.chat_template_kwargs)

    @property
    def wants_prompt_token_ids(self) -> bool:
        return bool(self.return_token_ids or self.return_prompt_text)

    def check_chat_template(self, trusted: bool) -> None:
        _check_chat_template(self.chat_template, self.chat_template_kwargs, trusted)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: the request's, and vLLM's `reasoning_effort` (which
        also sets `enable_thinking`, unless the request set it)."""
        kwargs = _template_variables(self.chat_template_kwargs)
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None

    @property
    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def asks_logprobs(self) -> bool:
        return self.logprobs

    def validate(self, vocab_size: int) -> None:
        self._validate_common(self.effective_max_tokens, vocab_size)
        for index, message in enumerate(self.messages):
            _check_message(index, message)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise APIError(
                "when using `logprob_token_ids`, `logprobs` must be set to true.",
                param="logprob_token_ids",
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
        self.structured()  # after the tools: a forced tool_choice reads them
        set_aside = _GenerationRequest.structured(self) if self.forced_tool else None
        if set_aside is not None:
            _warn_once(
                "structured output set aside: tool_choice forces a tool call, whose schema "
                "shapes the output",
                param=set_aside.param,
            )
        self._check_reused_prompt_ids(vocab_size)

    def _check_reused_prompt_ids(self, vocab_size: int) -> None:
        ids = (self.kv_transfer_params or {}).get("prompt_token_ids")
        if ids is None:
            return
        # bool is an int subclass, hence the exact type check (vLLM's)
        if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
            raise APIError(
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
                "non-negative integers.",
                param="kv_transfer_params.prompt_token_ids",
            )
        if outside := [t for t in ids if t >= vocab_size]:
            raise APIError(
                f"Token id {outside[0]} is out of vocabulary",
                param="kv_transfer_params.prompt_token_ids",
            )

    @property
    def reused_prompt_ids(self) -> list[int] | None:
        """vLLM's decode-side reuse (disaggregated serving): the prompt's ids, as the prefill
        server tokenized them, given in kv_transfer_params; None with echo, which renders the
        messages (as vLLM ignores them then)."""
        ids = (self.kv_transfer_params or {}).get("prompt_token_ids")
        return None if ids is None or self.echo else list(ids)

    def _validate_tools(self) -> None:
        if self.tools == []:
            raise APIError(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely.",
                param="tools",
            )
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
            _check_function_fields(function, f"tools[{index}].function")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if self.tool_choice is None or self.tool_choice in ("none", "auto", "required"):
            return
        if isinstance(self.tool_choice, str):
            raise APIError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                f"{self.tool_choice!r}",
                param="tool_choice",
            )
        function = self.tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if self.tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                "a named tool_choice must be {'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )

    def _tool(self, name: str) -> dict[str, Any] | None:
        for tool in self.tools or ():
            if tool["function"]["name"] == name:
                return tool["function"]
        return None

    @property
    def forced_tool(self) -> str | None:
        """The function the model must call (tool_choice names one), "required" (it must call
        at least one), or None; the output is then JSON that the server turns into tool_calls."""
        if self.tool_choice == "required" and self.tools:
            return "required"
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"])
        return None

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice forces (None for none, or for "required")."""
        return self.forced_tool if self.forced_tool != "required" else None

    def structured(self) -> StructuredOutput | None:
        forced = self.forced_tool
        if forced is None:
            return super().structured()
        # A forced call's output is the call: response_format (or another structured output)
        # shapes content, which such a reply does not have, so the call's schema takes the
        # place of it, as in vLLM (validate logs it). The other is still checked.
        super().structured()
        if forced == "required":
            # vLLM's shape: a JSON list of {"name", "parameters"}, one entry per call. Each
            # tool's $defs move to the root, where its "#/$defs/..." references point.
            definitions: dict[str, Any] = {}
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": _hoist_definitions(
                            _parameters_schema(t["function"]), definitions
                        ),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools or ()
            ]
            schema: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": calls},
            }
            if definitions:
                schema["$defs"] = definitions
        else:
            function = self._tool(forced)
            if function is None:
                raise APIError(
                    f"tool_choice names {forced!r}, which is not among the tools",
                    param="tool_choice",
                )
            schema = _parameters_schema(function)
        return StructuredOutput("json", json.dumps(schema), param="tool_choice")

    def tool_call_parser(self, parser: str | None, enable_auto_tool_choice: bool) -> str | None:
        """The tool-call parser this request's output goes through (None: tools are not parsed).

        As in vLLM, tools with tool_choice "auto" (the default once tools are given) need the
        server started with --enable-auto-tool-choice and a --tool-call-parser."""
        if not self.tools or self.tool_choice == "none" or self.forced_tool is not None:
            return None
        if not enable_auto_tool_choice or parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return parser

    def prompt(self, exclude_tools_when_none: bool = False) -> ChatPrompt:
        """The prompt the template renders; with `exclude_tools_when_none` (vLLM's
        --exclude-tools-when-tool-choice-none), a tool_choice of "none" leaves the tools out."""
        excluded = exclude_tools_when_none and self.tool_choice == "none"
        return ChatPrompt(
            messages=self.messages,  # content parts reach the engine, which formats them
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.template_kwargs(),
            tools=None if excluded else self.tools,
            chat_template=self.request_chat_template,
            add_special_tokens=self.add_special_tokens,
        )

    def sampling_params(self) -> SamplingParams:
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        sampling = self._sampling(self.effective_max_tokens, logprobs)
        return msgspec.structs.replace(sampling, prompt_logprobs=self.prompt_logprobs)


class BatchChatCompletionRequest(ChatCompletionRequest, kw_only=True):
    """vLLM's /v1/chat/completions/batch body: the chat fields, `messages` a list of
    conversations, each answered by one choice (its index). As in vLLM: no streaming, tools,
    beam search or n > 1."""

    messages: Annotated[  # type: ignore[assignment]
        list[Annotated[list[dict[str, Any]], Meta(min_length=1)]], Meta(min_length=1)
    ]

    def conversation(self, index: int) -> ChatCompletionRequest:
        """The chat request of one conversation, every other field as the batch gives it."""
        fields = {name: getattr(self, name) for name in self.__struct_fields__}
        fields["messages"] = self.messages[index]
        return ChatCompletionRequest(**fields)

    def conversations(self) -> list[ChatCompletionRequest]:
        return [self.conversation(i) for i in range(len(self.messages))]

    def validate(self, vocab_size: int) -> None:
        unsupported = {
            "stream": self.stream,
            "tools": self.tools is not None,
            "use_beam_search": self.use_beam_search,
            "n": self.n != 1,
            # the response's prompt extras are of one prompt
            "prompt_logprobs": self.prompt_logprobs is not None,
            "return_prompt_text": bool(self.return_prompt_text),
            # one pre-tokenized prompt cannot serve several conversations (vLLM's words)
            "kv_transfer_params['prompt_token_ids']": "prompt_token_ids"
            in (self.kv_transfer_params or {}),
        }
        for name, given in unsupported.items():
            if given:
                raise APIError(
                    f"Batch chat completions do not support `{name}`"
                    + (" > 1" if name == "n" else "")
                    + " (as in vLLM)",
                    param=name,
                )
        if len(self.messages) > MAX_BATCH_PROMPTS:
            raise APIError(
                f"at most {MAX_BATCH_PROMPTS} conversations per request, got {len(self.messages)}",
                param="messages",
            )
        for index, conversation in enumerate(self.conversations()):
            try:
                conversation.validate(vocab_size)
            except APIError as error:
                # name the conversation: messages[2] of the first is messages[0][2] here
                where = f"messages[{index}]"
                if error.param is not None and error.param.startswith("messages"):
                    error.param = where + error.param.removeprefix("messages")
                if error.message.startswith("messages"):
                    error.message = where + error.message.removeprefix("messages")
                raise


class CompletionRequest(_GenerationRequest, kw_only=True):
    _LOGPROB_COUNTS = ("prompt_logprobs", "logprobs")
    # A string, or a list of strings, token ids or lists of token ids (msgspec allows one array
    # type in a union, so the list's element kinds are checked in `validate`).
    prompt: str | list[Any] | None = None
    # vLLM's prompt embeddings (base64 tensors): refused when given, this server feeds the model
    # tokens only; an empty one counts as no prompt, as in vLLM
    prompt_embeds: Any = None
    logprobs: LogprobCount | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None  # refused, as vLLM does

    @property
    def effective_max_tokens(self) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def asks_logprobs(self) -> bool:
        return self.logprobs is not None

    def validate(self, vocab_size: int) -> None:
        if self.suffix is not None:
            raise APIError("suffix is not currently supported", param="suffix")
        if self.thinking_token_budget not in (None, -1):
            raise APIError(
                "thinking_token_budget is not supported on completions here: it needs the "
                "reasoning parser that chat completions run (--reasoning-parser)",
                param="thinking_token_budget",
            )
        self._validate_common(self.effective_max_tokens, vocab_size)
        if self.logprob_token_ids is not None and self.logprobs is None:
            raise APIError(
                "when using `logprob_token_ids`, `logprobs` must be set.",
                param="logprob_token_ids",
            )
        self.structured()
        if self.prompt_embeds:
            raise APIError(
                "prompt_embeds is not supported: this server feeds the model token ids (give "
                "prompt as text or token ids)",
                param="prompt_embeds",
            )
        prompts = self._prompt_items()
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise APIError(
                f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompts)}",
                param="prompt",
            )
        if len(prompts) * self.n > MAX_BATCH_CHOICES:
            raise APIError(
                f"prompts x n must be at most {MAX_BATCH_CHOICES}, got {len(prompts) * self.n}",
                param="n",
            )
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise APIError(EMPTY_PROMPT, param="prompt")
            if isinstance(prompt, list):
                param = "prompt" if prompt is self.prompt else f"prompt[{index}]"
                _check_token_ids(prompt, vocab_size, param)

    def _prompt_items(self) -> list[str | list[int]]:
        """The prompts of the request: one string, or OpenAI's list of strings, token ids or
        lists of token ids (each a prompt of its own); APIError 400 for another shape."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:  # None or []
            raise APIError(EMPTY_PROMPT, param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(p) for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
        raise APIError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids",
            param="prompt",
        )

    def prompt_values(self) -> list[TextPrompt | TokensPrompt]:
        """Each prompt of the request (validate has checked their shape), in order."""
        return [
            TextPrompt(p, add_special_tokens=self.add_special_tokens)
            if isinstance(p, str)
            else TokensPrompt([int(t) for t in p])
            for p in self._prompt_items()
        ]

    def sampling_params(self) -> SamplingParams:
        sampling = self._sampling(self.effective_max_tokens, self.logprobs)
        wanted = [self.prompt_logprobs]
        if self.echo and self.logprobs is not None:
            # echo with logprobs returns the prompt's logprobs ahead of the completion's
            wanted.append(self.logprobs)
        counts = [k for k in wanted if k is not None]
        return msgspec.structs.replace(sampling, prompt_logprobs=max(counts) if counts else None)


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
    return_token_strs: bool = False  # vLLM: each token's vocabulary entry besides its id
    chat_template: str | None = None  # vLLM: the request's own (--trust-request-chat-template)

    def validate(self, trusted_chat_template: bool) -> None:
        """As chat completions: a template of the request's own only where the server trusts
        it (--trust-request-chat-template)."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        for index, message in enumerate(self.messages or ()):
            _check_message(index, message)
        _check_chat_template(self.chat_template, self.chat_template_kwargs, trusted_chat_template)

    def prompt_value(self) -> ChatPrompt | TextPrompt:
        if self.messages is not None:
            return ChatPrompt(
                messages=self.messages,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                chat_template_kwargs=_template_variables(self.chat_template_kwargs) or None,
                tools=self.tools,
                chat_template=_request_chat_template(self.chat_template, self.chat_template_kwargs),
                add_special_tokens=bool(self.add_special_tokens),  # vLLM's chat default: off
            )
        add_special_tokens = True if self.add_special_tokens is None else self.add_special_tokens
        return TextPrompt(self.prompt or "", add_special_tokens=add_special_tokens)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None

    def validate(self, vocab_size: int) -> None:
        _check_token_ids(self.tokens, vocab_size, "tokens")


def check_max_logprobs(
    body: ChatCompletionRequest | CompletionRequest, max_logprobs: int, vocab_size: int
) -> None:
    """vLLM's check of --max-logprobs (-1: the whole vocabulary) against what a request asks
    for, sampled (top_logprobs, or logprobs on completions) and prompt logprobs alike."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    if isinstance(body, ChatCompletionRequest):
        sampled = ("top_logprobs", body.top_logprobs)
    else:
        sampled = ("logprobs", body.logprobs)
    for param, count in (sampled, ("prompt_logprobs", body.prompt_logprobs)):
        if count is not None and count > limit:
            kind = "prompt" if param == "prompt_logprobs" else "sample"
            raise APIError(
                f"Requested {kind} logprobs of {count}, which is greater than max allowed: {limit}",
                param=param,
            )


def _request_chat_template(chat_template: str | None, kwargs: dict[str, Any] | None) -> str | None:
    """The template a request brings, as `chat_template` or (as vLLM also reads it) in
    `chat_template_kwargs`."""
    if chat_template is not None:
        return chat_template
    given = (kwargs or {}).get("chat_template")
    return given if isinstance(given, str) else None


def _check_chat_template(
    chat_template: str | None, kwargs: dict[str, Any] | None, trusted: bool
) -> None:
    """As vLLM: a request's own template runs only on a server that trusts its clients."""
    brought = chat_template is not None or (kwargs or {}).get("chat_template") is not None
    if brought and not trusted:
        raise APIError(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    if brought and _request_chat_template(chat_template, kwargs) is None:
        raise APIError(
            "chat_template_kwargs.chat_template must be a string",
            param="chat_template_kwargs",
        )


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs less the template itself (`_request_chat_template`)."""
    return {k: v for k, v in (kwargs or {}).items() if k != "chat_template"}


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_logit_bias(logit_bias: dict[str, float], vocab_size: int) -> None:
    """Every bad key named at once, in vLLM's words: first those that are not integers, then
    those outside the vocabulary."""
    not_integers = [key for key in logit_bias if not _is_integer(key)]
    if not_integers:
        raise APIError(
            "logit_bias contains key(s) that cannot be converted to integer token IDs: "
            f"{not_integers!r}",
            param="logit_bias",
        )
    outside = [int(key) for key in logit_bias if not 0 <= int(key) < vocab_size]
    if outside:
        raise APIError(
            f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            param="logit_bias",
        )


def _is_integer(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise APIError(  # vLLM's words, then the bound
                f"Token id {token_id} is out of vocabulary (ids are below {vocab_size})",
                param=f"{param}[{index}]",
            )


def _check_message(index: int, message: dict[str, Any]) -> None:
    param = f"messages[{index}]"
    role = message.get("role")
    # Any role string goes to the chat template, as vLLM's custom message type lets it (a
    # template decides what "narrator" means); only a missing or non-string role is refused.
    if not isinstance(role, str) or not role:
        raise APIError(
            f"{param}.role must be a non-empty string, got {role!r}", param=f"{param}.role"
        )
    _check_tool_call_arguments(message.get("tool_calls"), param)
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


def _check_tool_call_arguments(calls: Any, param: str) -> None:
    """An assistant's tool-call arguments are JSON text, which the chat template gets parsed
    (as vLLM parses them: text that is not JSON is a 400)."""
    for index, call in enumerate(calls if isinstance(calls, list) else ()):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str) and arguments:
            where = f"{param}.tool_calls[{index}].function.arguments"
            check_json_depth(arguments, where)
            try:
                json.loads(arguments)
            except json.JSONDecodeError as error:
                raise APIError(f"{where} is not valid JSON: {error}", param=where) from error


def _check_function_fields(function: dict[str, Any], param: str) -> None:
    """A tool's parameters are a JSON Schema object, its description text, as vLLM's
    FunctionDefinition has them."""
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(
            f"{param}.parameters must be a JSON Schema object, got {type(parameters).__name__}",
            param=f"{param}.parameters",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(f"{param}.description must be a string", param=f"{param}.description")


def _hoist_definitions(parameters: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """`parameters` without its `$defs`, which join `definitions` (the root schema's); a name
    two tools define differently is a 400, as in vLLM (one root cannot hold both)."""
    own = parameters.get("$defs")
    if not isinstance(own, dict):
        return parameters
    for name, definition in own.items():
        if name in definitions and definitions[name] != definition:
            raise APIError(
                f"Tool definition '{name}' has multiple schemas, which is not supported.",
                param="tools",
            )
        definitions[name] = definition
    return {key: value for key, value in parameters.items() if key != "$defs"}


def _parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        check_json_depth(value, param)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise APIError(f"{param} is not valid JSON: {error}", param=param) from error
    if not isinstance(value, (dict, bool)):
        raise APIError(f"{param} must be a JSON schema object", param=param)
    return json.dumps(value)


def _response_format(body: dict[str, Any] | None) -> StructuredOutput | None:
    if body is None:
        return None
    kind = body.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind == "json_schema":
        spec = body.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        param = "response_format.json_schema.schema"
        return StructuredOutput("json", _schema_text(spec["schema"], param), param=param)
    if kind == "structural_tag":
        return _structural_tag(body, "response_format")
    raise APIError(
        "response_format type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
        f"got {kind!r}",
        param="response_format.type",
    )


def _structural_tag(value: Any, param: str) -> StructuredOutput:
    """vLLM's structural tag: {structures: [{begin, schema, end}], triggers} (render compiles
    it, and says what is wrong with one that does not compile). xgrammar's newer form, a
    `format` tree, has no llguidance equivalent here: a 400."""
    if isinstance(value, str):
        check_json_depth(value, param)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise APIError(f"{param} is not valid JSON: {error}", param=param) from error
    if not isinstance(value, dict):
        raise APIError(f"{param} must be a structural tag object", param=param)
    if "format" in value and "structures" not in value:
        raise APIError(
            "structural tags in the `format` form (xgrammar's) are not supported; give "
            "`structures` ({begin, schema, end}) and `triggers`",
            param=param,
        )
    tag = {"structures": value.get("structures"), "triggers": value.get("triggers")}
    return StructuredOutput("structural_tag", json.dumps(tag), param=param)


def _structured_outputs(body: dict[str, Any] | None) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: {json | regex | choice | grammar | json_object |
    structural_tag}."""
    if body is None:
        return None
    for option in STRUCTURED_OUTPUT_REFUSED:
        if body.get(option) not in (None, False):
            raise APIError(
                f"structured_outputs.{option} is not supported by this server",
                param=f"structured_outputs.{option}",
            )
    given = [key for key in STRUCTURED_OUTPUT_KINDS if body.get(key) not in (None, False)]
    if len(given) != 1:
        raise APIError(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
            "structural_tag",
            param="structured_outputs",
        )
    key = given[0]
    if key == "structural_tag":
        return _structural_tag(body[key], "structured_outputs.structural_tag")
    return _spec(key, body[key], f"structured_outputs.{key}")


def _guided(request: _GenerationRequest) -> StructuredOutput | None:
    given = [
        (key, value)
        for key, value in (
            ("json", request.guided_json),
            ("regex", request.guided_regex),
            ("choice", request.guided_choice),
            ("grammar", request.guided_grammar),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise APIError(
            "only one of guided_json, guided_regex, guided_choice, guided_grammar may be set",
            param=f"guided_{given[1][0]}",
        )
    return _spec(given[0][0], given[0][1], f"guided_{given[0][0]}") if given else None


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json", _schema_text(value, param), param=param)
    if kind == "json_object":
        return StructuredOutput("json_object", param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(f"{param} must be a non-empty list of strings", param=param)
        return StructuredOutput("choice", json.dumps(value), param=param)
    if not isinstance(value, str) or not value:
        raise APIError(f"{param} must be a non-empty string", param=param)
    return StructuredOutput(kind, value, param=param)
