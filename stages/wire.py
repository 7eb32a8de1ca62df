"""The variable-shaped parts of messages, as typed msgspec structs encoded with msgpack.

These travel once per request (the request itself, its detokenize parameters, an error) or once per
step per request inside a batched record (the extras of a delta). Never pickle.
"""

from __future__ import annotations

from typing import Any

import msgspec

from stages import api


class WireChat(msgspec.Struct, tag="chat"):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class WireText(msgspec.Struct, tag="text"):
    text: str
    add_special_tokens: bool = True


class WireTokens(msgspec.Struct, tag="tokens"):
    token_ids: list[int]


class WireSampling(msgspec.Struct):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured: WireStructured | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] = []


class WireStructured(msgspec.Struct):
    kind: str
    value: str = ""
    param: str = "response_format"


class WireRequest(msgspec.Struct):
    prompt: WireChat | WireText | WireTokens
    sampling: WireSampling
    priority: int = 0
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


class DetokParams(msgspec.Struct):
    """What detokenize needs of a request; render writes it, schedule forwards it untouched."""

    stop: list[str] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_logprobs: int = -1  # < 0: none
    num_prompt_logprobs: int = -1  # < 0: none
    reasoning_parser: str | None = None  # stages.parsers names
    tool_call_parser: str | None = None
    reasoning_starts_inside: bool = False  # the prompt ended inside an open think tag


class WireError(msgspec.Struct):
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: str | None = None


class WireLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class WireMetrics(msgspec.Struct, array_like=True):
    arrival_ns: int
    render_start_ns: int
    rendered_ns: int
    scheduled_ns: int
    first_token_ns: int
    last_token_ns: int
    prefill_done_ns: int
    finished_ns: int
    detokenize_ns: int
    num_preemptions: int
    num_cached_tokens: int = 0


class WireToolCall(msgspec.Struct, array_like=True):
    id: str
    name: str
    arguments: str


class DeltaExtra(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a delta row carries beyond its token and text; rows with none of it carry no bytes."""

    logprobs: list[WireLogprob] | None = None
    stop_reason: str | int | None = None
    metrics: WireMetrics | None = None
    reasoning: str = ""
    tool_calls: list[WireToolCall] | None = None
    # on a request's first delta, when asked for: the prompt's tokens from position 0, each with
    # its logprob (position 0 has none: rank 0) and top-k
    prompt_logprobs: list[WireLogprob] | None = None


def encode_request(request: api.GenerateRequest) -> bytes:
    prompt: WireChat | WireText | WireTokens
    p = request.prompt
    if isinstance(p, api.ChatPrompt):
        prompt = WireChat(
            messages=[dict(m) for m in p.messages],
            add_generation_prompt=p.add_generation_prompt,
            continue_final_message=p.continue_final_message,
            chat_template_kwargs=dict(p.chat_template_kwargs) if p.chat_template_kwargs else None,
            tools=[dict(t) for t in p.tools] if p.tools else None,
        )
    elif isinstance(p, api.TextPrompt):
        prompt = WireText(p.text, p.add_special_tokens)
    else:
        prompt = WireTokens(list(p.token_ids))
    s = request.sampling
    sampling = WireSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        seed=s.seed,
        max_tokens=s.max_tokens,
        min_tokens=s.min_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        logit_bias=dict(s.logit_bias) if s.logit_bias else None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        structured=WireStructured(s.structured.kind, s.structured.value, s.structured.param)
        if s.structured is not None
        else None,
        truncate_prompt_tokens=s.truncate_prompt_tokens,
        bad_words=list(s.bad_words),
    )
    return msgspec.msgpack.encode(
        WireRequest(
            prompt,
            sampling,
            request.priority,
            reasoning_parser=request.reasoning_parser,
            tool_call_parser=request.tool_call_parser,
        )
    )


request_decoder = msgspec.msgpack.Decoder(WireRequest)
detok_decoder = msgspec.msgpack.Decoder(DetokParams)
error_decoder = msgspec.msgpack.Decoder(WireError)
extra_decoder = msgspec.msgpack.Decoder(DeltaExtra)
encoder = msgspec.msgpack.Encoder()
