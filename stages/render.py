"""The render stage: chat template, tokenization and prompt-length checks; one request at a time.

A request that cannot be rendered becomes an `error` record back to the server (a clear 400) and
never reaches the scheduler. Aborts pass through in order, so an abort never overtakes its request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpu.config import load_model_config
from gpu.tokenizer import TokenizerBundle, load_tokenizer
from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from stages import messages as m
from stages.api import EngineError, StructuredOutput
from stages.chat import render_chat
from stages.config import EngineConfig
from stages.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, prompt_opens_reasoning
from stages.structured import compile_grammar
from stages.wire import (
    DetokParams,
    WireChat,
    WireError,
    WireRequest,
    WireText,
    encoder,
    request_decoder,
)


def resolve_max_model_len(config: EngineConfig) -> int:
    model_len = load_model_config(config.model_path).max_position_embeddings
    return min(config.max_model_len, model_len) if config.max_model_len > 0 else model_len


def prompt_token_ids(bundle: TokenizerBundle, request: WireRequest) -> list[int]:
    """The prompt's token ids (the chat template applied); EngineError for a bad prompt."""
    prompt = request.prompt
    if isinstance(prompt, WireChat):
        text = render_chat(
            bundle.chat_template,
            prompt.messages,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            tools=prompt.tools,
            template_kwargs=prompt.chat_template_kwargs,
            bos_token=bundle.bos_token,
            eos_token=bundle.eos_token,
        )
        # The template writes BOS itself where the model wants one.
        return bundle.tokenizer.encode(text, add_special_tokens=False).ids
    if isinstance(prompt, WireText):
        if prompt.add_special_tokens:
            return bundle.encode(prompt.text)
        return bundle.tokenizer.encode(prompt.text, add_special_tokens=False).ids
    ids = list(prompt.token_ids)
    bad = [t for t in ids if not 0 <= t < bundle.vocab_size]
    if bad:
        raise EngineError(
            f"token id {bad[0]} is out of vocabulary (size {bundle.vocab_size})", param="prompt"
        )
    return ids


def bad_word_ids(bundle: TokenizerBundle, words: Sequence[str]) -> np.ndarray:
    """vLLM's bad_words as token sequences (each word alone and after a space, the two ways a
    tokenizer may see it), each followed by -1."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(bundle.tokenizer.encode(text, add_special_tokens=False).ids)
            if ids:
                sequences[ids] = None
    flat = [token for ids in sequences for token in (*ids, -1)]
    return np.asarray(flat, np.int32)


def check_lengths(num_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens to run with; EngineError when prompt (+ max_tokens) does not fit."""
    if num_prompt == 0:
        raise EngineError("the prompt is empty", param="prompt")
    if num_prompt >= max_model_len:
        raise EngineError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt} input tokens. Please reduce the length of the input messages.",
            param="messages",
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise EngineError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{max_tokens + num_prompt} tokens ({num_prompt} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


class RenderActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        self.bundle = load_tokenizer(config.model_path)
        self.max_model_len = resolve_max_model_len(config)
        self.eos_ids = list(self.bundle.eos_token_ids)

    async def run(self) -> None:
        inbox = self.ctx.inbox["requests"]
        prompts, errors = self.ctx.outbox["prompts"], self.ctx.outbox["errors"]
        while True:
            message = await inbox.recv_async()
            with message:
                if message.name == "abort":
                    aborted = message["handles"].copy()
                else:
                    aborted = None
                    handle = int(message["handle"][0])
                    arrival_ns = int(message["arrival_ns"][0])
                    payload = message["payload"].tobytes()
            if aborted is not None:
                await prompts.send_async(m.ABORT, {"handles": aborted})
                continue
            started = now_ns()
            try:
                arrays = self.render(request_decoder.decode(payload), arrival_ns, started, handle)
            except Exception as exc:
                if not isinstance(exc, EngineError):
                    # Whatever a request does to the tokenizer or template, the stage keeps serving.
                    self.ctx.log.exception("render failed", handle=handle)
                    exc = EngineError(f"could not render the prompt: {exc}", param="messages")
                body = encoder.encode(WireError(exc.message, exc.type, exc.param, exc.code))
                await errors.send_async(
                    m.ERROR,
                    {
                        "handle": np.array([handle], np.int64),
                        "status": np.array([exc.status], np.int32),
                        "payload": np.frombuffer(body, np.uint8),
                    },
                )
                continue
            await prompts.send_async(m.PROMPT, arrays)
            self.ctx.trace.record(
                m.SPAN_RENDER, started, now_ns(), batch=1, tokens=len(arrays["prompt_ids"])
            )

    def render(
        self, request: WireRequest, arrival_ns: int, started_ns: int, handle: int
    ) -> dict[str, np.ndarray]:
        s = request.sampling
        if request.reasoning_parser not in (None, *REASONING_PARSERS):
            raise EngineError(f"unknown reasoning parser {request.reasoning_parser!r}")
        if request.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise EngineError(f"unknown tool-call parser {request.tool_call_parser!r}")
        ids = prompt_token_ids(self.bundle, request)
        if s.truncate_prompt_tokens is not None:
            # vLLM's truncation: the prompt's last k tokens (-1: as many as the model takes)
            keep = s.truncate_prompt_tokens
            if keep < 0:  # what leaves room for max_tokens (or for one token)
                keep = max(1, self.max_model_len - (s.max_tokens or 1))
            ids = ids[-keep:]
        max_tokens = check_lengths(len(ids), s.max_tokens, self.max_model_len)
        stop_ids = list(s.stop_token_ids) + ([] if s.ignore_eos else self.eos_ids)
        bias = s.logit_bias or {}
        for token in (*bias, *(s.allowed_token_ids or ()), *s.stop_token_ids):
            if not 0 <= token < self.bundle.vocab_size:
                raise EngineError(f"token id {token} is out of vocabulary", param="logit_bias")
        grammar = ""
        if s.structured is not None:
            spec = s.structured
            grammar = compile_grammar(StructuredOutput(spec.kind, spec.value, spec.param))
        row = np.zeros(1, m.REQUEST_ROW)
        row[0] = (
            handle,
            request.priority,
            max_tokens,
            s.ignore_eos,
            arrival_ns,
            started_ns,
            now_ns(),
        )
        sampling = np.zeros(1, m.SAMPLING_ROW)
        sampling[0] = (
            s.temperature,
            s.top_p,
            s.top_k if s.top_k > 0 else 0,
            s.min_p,
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty,
            -1 if s.seed is None else s.seed & ((1 << 63) - 1),
            s.min_tokens,
            -1 if s.logprobs is None else s.logprobs,
            -1 if s.prompt_logprobs is None else s.prompt_logprobs,
        )
        detok = DetokParams(
            stop=list(s.stop),
            include_stop_str_in_output=s.include_stop_str_in_output,
            # Tool-call markup is often special tokens (Qwen's <tool_call>): keep it for the parser,
            # as vLLM's tool parsers do.
            skip_special_tokens=s.skip_special_tokens and request.tool_call_parser is None,
            num_logprobs=-1 if s.logprobs is None else s.logprobs,
            num_prompt_logprobs=-1 if s.prompt_logprobs is None else s.prompt_logprobs,
            reasoning_parser=request.reasoning_parser,
            tool_call_parser=request.tool_call_parser,
            reasoning_starts_inside=request.reasoning_parser is not None
            and prompt_opens_reasoning(self.bundle.decode(ids[-8:]), request.reasoning_parser),
        )
        return {
            "request": row,
            "sampling": sampling,
            "prompt_ids": np.asarray(ids, np.int32),
            "stop_ids": np.asarray(stop_ids, np.int32),
            "bias_ids": np.fromiter(bias.keys(), np.int32, len(bias)),
            "bias_values": np.fromiter(bias.values(), np.float32, len(bias)),
            "allowed_ids": np.asarray(s.allowed_token_ids or [], np.int32),
            "bad_words": bad_word_ids(self.bundle, s.bad_words),
            "detok": np.frombuffer(encoder.encode(detok), np.uint8),
            "grammar": np.frombuffer(grammar.encode(), np.uint8),
        }
