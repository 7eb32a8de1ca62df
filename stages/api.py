"""What the HTTP front end asks of the engine, and what it gets back. Torch-free.

The server builds a `GenerateRequest` from a validated OpenAI request and iterates
`EngineClient.generate`, which yields one `RequestOutput` per engine step that produced something
for the request, the last one with `finish_reason` set. Leaving the iteration early (a client that
disconnects) aborts the request in every stage. Engine-side errors that the client caused (a prompt
too long, a chat template that raises) arrive as `EngineError` with the HTTP status to answer with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """A shape the output must take (stages.text.structured compiles it)."""

    kind: str  # json | json_object | regex | choice | grammar | structural_tag
    # the JSON schema (as JSON text), regex, choices (a JSON list), grammar, or structural tag
    # (vLLM's {structures, triggers}, as JSON text)
    value: str = ""
    param: str = "response_format"  # the request field it came from, named by errors


class BeamSearchParams(msgspec.Struct, frozen=True, array_like=True):
    """vLLM's use_beam_search: `width` beams searched together; each of the request's `width`
    choices is an engine request of its own that carries this, and the one with index 0 runs the
    search for all (stages.beam_group)."""

    width: int
    group: int  # the same for the choices of one request, unique among requests
    index: int  # this choice's place among them: it gets the index-th best hypothesis
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-request sampling and stopping, with vLLM's meanings and defaults.

    The one declaration of a sampling option below the HTTP schema: it travels to the stages as
    it is (msgpack, once per request), and the sampler reads its scalar fields by name
    (`gpu.sampler.ROW`)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None = what is left of the context
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # with special tokens kept: a space each side
    logprobs: int | None = None  # None = no logprobs; k >= 0 = sampled token's plus top k
    # vLLM's logprob_token_ids: these tokens' logprobs instead of the top k (logprobs = their count)
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    structured: StructuredOutput | None = None  # guided decoding: the output follows a grammar
    truncate_prompt_tokens: int | None = None  # keep k of the prompt's tokens; -1: max_model_len
    truncation_side: str = "left"  # left: keep the prompt's last k tokens; right: its first k
    bad_words: tuple[str, ...] = ()  # vLLM: words the output must not contain
    # vLLM: tokens the request may think for (inside its reasoning parser's tags) before the end
    # tag is forced; None: no limit
    thinking_token_budget: int | None = None
    beam: BeamSearchParams | None = None  # beam search instead of sampling


class ChatPrompt(msgspec.Struct, frozen=True, tag="chat"):
    messages: list[dict[str, Any]]  # OpenAI chat messages, as JSON values
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # the request's own (--trust-request-chat-template)
    # vLLM's: BOS (where the model has one) ahead of the template's text; off, as the template
    # writes its own
    add_special_tokens: bool = False


class TextPrompt(msgspec.Struct, frozen=True, tag="text"):
    text: str
    add_special_tokens: bool = True


class TokensPrompt(msgspec.Struct, frozen=True, tag="tokens"):
    token_ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokensPrompt


class LoraRequest(msgspec.Struct, frozen=True, array_like=True):
    """The LoRA adapter a request runs with (vLLM's LoRARequest): the server names it, execute
    loads its weights from `path` once (stages.lora reads and checks the directory)."""

    name: str
    lora_id: int  # unique for the server's life, from 1: a reloaded name gets a new one
    path: str


class GenerateRequest(msgspec.Struct, frozen=True):
    """One request to the engine; the render stage receives it as it is (msgpack)."""

    # The client's id (the response's; the n choices of one request share it). The engine gives
    # each GenerateRequest an int64 handle when it starts it (Engine.generate, Engine.render):
    # the stages, the rings and gpu/ know a request by that handle alone.
    request_id: str
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    priority: int = 0  # lower runs first (vLLM's convention); ties in arrival order
    arrival_ns: int = 0  # CLOCK_MONOTONIC when the server accepted it
    # Output parsers (stages.text.parsers) the detokenize stage runs for this request, by name.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # vLLM's cache_salt: prefix-cache blocks are shared only among requests with the same salt.
    cache_salt: str | None = None
    return_prompt_token_ids: bool = False  # the first output carries the prompt's token ids
    lora: LoraRequest | None = None  # the adapter the request's `model` named; None: the base
    # vLLM's stream_interval: outputs of at least this many tokens (raised to --stream-interval)
    stream_interval: int | None = None


class ToolCall(msgspec.Struct, frozen=True, array_like=True):
    """A complete function call the model wrote."""

    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI's `function.arguments`


class ToolCallDelta(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A piece of a function call as the request's tool-call parser reads it from the output:
    the first piece of call `index` opens it (id and name), the next ones carry its arguments'
    JSON text as the model writes it; the pieces' arguments, joined, are the call's. A call
    parsed whole is one piece."""

    index: int  # the call's place among the request's calls, from 0
    id: str = ""  # on the opening piece only
    name: str = ""  # on the opening piece only
    arguments: str = ""


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str  # the token's text ("bytes:\\xNN" style escapes are the server's business)
    token_bytes: bytes
    logprob: float
    rank: int  # 1-based rank in the model's distribution; 0 for a prompt's first token
    top: tuple[tuple[int, str, bytes, float], ...] = ()  # (id, text, bytes, logprob), best first


class RequestMetrics(msgspec.Struct, frozen=True, array_like=True):
    """The CLOCK_MONOTONIC stamps (ns) the stages took for one request, and the times derived.

    Schedule fills it when the request finishes; detokenize adds its own two figures."""

    arrival_ns: int  # the server accepted the request
    render_start_ns: int
    rendered_ns: int  # render finished (template + tokenize)
    scheduled_ns: int  # first scheduled (queue time ends)
    first_token_ns: int  # first output token left execute (prefill done)
    last_token_ns: int
    num_generated_tokens: int
    finished_ns: int = 0  # the detokenizer emitted the final delta
    detokenize_ns: int = 0  # time detokenize spent on this request's tokens
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    # prompt tokens this request computed and wrote into the prefix cache (vLLM's
    # num_cache_creation_tokens: its cached blocks' tokens less those it found there)
    num_cache_creation_tokens: int = 0
    num_recoveries: int = 0  # stage failures the request lived through (resumed, nothing lost)
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_histogram: tuple[int, ...] = ()

    @property
    def render_s(self) -> float:
        return _span_s(self.render_start_ns, self.rendered_ns)

    @property
    def queue_s(self) -> float:
        return _span_s(self.rendered_ns, self.scheduled_ns)

    @property
    def prefill_s(self) -> float:
        return _span_s(self.scheduled_ns, self.first_token_ns)

    @property
    def decode_s(self) -> float:
        return _span_s(self.first_token_ns, self.last_token_ns)

    @property
    def detokenize_s(self) -> float:
        return self.detokenize_ns / 1e9


def _span_s(start_ns: int, end_ns: int) -> float:
    return max(0.0, (end_ns - start_ns) / 1e9) if start_ns and end_ns else 0.0


class RequestOutput(msgspec.Struct, frozen=True):
    """What one engine step produced for one request (text is the new part only).

    A msgspec Struct rather than a frozen dataclass: the server builds one per streamed token, and
    a frozen dataclass's __init__ (a setattr per field) cost 1.4 us of the ~15 us per token the
    HTTP front end spends; the Struct costs 0.13."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...] | None  # on the first output only
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, when asked for
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # on the first output
    metrics: RequestMetrics | None = None  # on the final output
    reasoning: str = ""  # new reasoning text (with a reasoning parser; `text` is then the rest)
    tool_calls: tuple[ToolCallDelta, ...] = ()  # pieces of calls written in this step
    # On the final output, with a reasoning parser: the output tokens inside the reasoning.
    num_reasoning_tokens: int = 0
    # Where it came from, for the stage trace: the engine step that made it (-1: none) and when
    # its deltas reached the server (now_ns; 0: not from the pipeline)
    step_id: int = -1
    received_ns: int = 0
    engine: int = 0  # the data-parallel replica that made it (vLLM's engine index)


class RenderedPromptInfo(msgspec.Struct, frozen=True):
    """What render made of a request, as generation would see it (the /render endpoints)."""

    token_ids: list[int]  # the prompt's, after the chat template and any truncation
    text: str  # those tokens decoded, special tokens kept
    max_tokens: int  # the output budget, resolved against the context


class EngineError(Exception):
    """An error for one request, with the HTTP status and OpenAI error fields to answer with."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "BadRequestError",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # a 429 or 503 the client may retry: when


@dataclass(frozen=True, slots=True)
class ModelInfo:
    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    created: int  # Unix seconds the engine started
    # What runs the model (a CPU kernel level of gpu/cpu_isa.py, `torch` or `triton`), as execute
    # published it at start; None until then.
    kernels: str | None = None
    # Data-parallel replicas: with more than one, the server labels its metrics with vLLM's
    # `engine` (RequestOutput.engine says which replica made an output).
    num_engines: int = 1


class EngineClient(Protocol):
    """The engine as the server sees it."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def ready(self) -> bool:
        """True once every stage has reported ready and none has failed."""
        ...

    @property
    def not_ready_error(self) -> EngineError:
        """While not ready: why, as the 503 to answer with (Retry-After when it will pass)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; raises EngineError (before or during the stream)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def tokenize(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        """Token ids the engine would see for this prompt (chat template applied); EngineError on bad input."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (vLLM's token_strs); EngineError for an id outside it."""
        ...

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info document: the tokenizer's class, special tokens, template."""
        ...

    async def render(self, request: GenerateRequest) -> RenderedPromptInfo:
        """The request rendered exactly as `generate` would render it, and nothing generated;
        raises the EngineError generate would."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block no request holds; every request sent after this returns
        finds no prefix cached from before."""
        ...

    def check_lora(self, path: str) -> None:
        """Whether the LoRA adapter directory at `path` can be served (stages.lora.read_adapter):
        EngineError 400 that says why not, 404 where no adapter is found; reads its files."""
        ...

    def stats(self) -> Mapping[str, float]:
        """Engine-wide gauges and counters for /metrics (names as vLLM's where the meaning is the same)."""
        ...
