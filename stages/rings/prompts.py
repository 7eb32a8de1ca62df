"""The prompts ring (render -> schedule): rendered requests, and aborts and prefix-cache resets in
their order."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from pipeline.records import Record, Vocabulary
from stages.api import LoraRequest, SamplingParams
from stages.rings.common import ABORT, RESET_PREFIX_CACHE, Resume, Views
from stages.text.thinking import ThinkingBudget


class RenderedRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request's parameters with what render resolved, for schedule and execute.

    Travels once per request: render -> schedule (which reads the lengths and stop ids) ->
    execute (which builds its sampling rows from `sampling`)."""

    sampling: SamplingParams  # as the client sent it
    max_tokens: int  # resolved against the context
    stop_token_ids: tuple[int, ...]  # the request's, and the model's EOS ids unless ignore_eos
    bad_words: tuple[tuple[int, ...], ...] = ()  # each bad word's tokens, alone and after a space
    grammar: str = ""  # compiled llguidance grammar (stages.text.structured); "": unconstrained
    # The tokens that end the reasoning, after which the grammar holds (vLLM's structured
    # outputs with a reasoning parser, enable_in_reasoning false); (): from the first token.
    grammar_after: tuple[int, ...] = ()
    resume: Resume | None = None  # resubmitted after a stage failure: the outputs already sent
    cache_salt: str | None = None  # mixed into the first prompt block's hash (prefix caching)
    thinking: ThinkingBudget | None = None  # thinking_token_budget, with the tags as tokens
    lora: LoraRequest | None = None  # the adapter it runs with; None: the base model

    @property
    def cacheable(self) -> bool:
        """Whether the prefix cache may skip prompt positions: not when every position must be
        computed (prompt logprobs) or seen by execute (the repetition penalty reads them)."""
        return self.sampling.prompt_logprobs is None and self.sampling.repetition_penalty == 1.0


rendered_decoder = msgspec.msgpack.Decoder(RenderedRequest)

REQUEST_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("priority", np.int32),
        ("arrival_ns", np.int64),
        ("render_start_ns", np.int64),
        ("rendered_ns", np.int64),
    ]
)
PROMPT = Record(
    "prompt",
    ("request", REQUEST_ROW),  # [1]
    ("prompt_ids", np.int32),  # [P]
    ("rendered", np.uint8),  # msgpack RenderedRequest, forwarded to execute untouched
    ("detok", np.uint8),  # msgpack stages.rings.tokens.DetokParams, forwarded to detokenize
)
PROMPTS = Vocabulary("prompts", [PROMPT, ABORT, RESET_PREFIX_CACHE])


@dataclass(slots=True, frozen=True)
class RenderedPrompt:
    handle: int
    priority: int
    arrival_ns: int
    render_start_ns: int
    rendered_ns: int
    prompt_ids: np.ndarray  # [P] int32
    rendered: bytes  # msgpack RenderedRequest
    detok: bytes  # msgpack DetokParams

    def request(self) -> RenderedRequest:
        return rendered_decoder.decode(self.rendered)


def pack_prompt(prompt: RenderedPrompt) -> dict[str, np.ndarray]:
    row = np.zeros(1, REQUEST_ROW)
    row[0] = (
        prompt.handle,
        prompt.priority,
        prompt.arrival_ns,
        prompt.render_start_ns,
        prompt.rendered_ns,
    )
    return {
        "request": row,
        "prompt_ids": np.asarray(prompt.prompt_ids, np.int32),
        "rendered": np.frombuffer(prompt.rendered, np.uint8),
        "detok": np.frombuffer(prompt.detok, np.uint8),
    }


def unpack_prompt(views: Views) -> RenderedPrompt:
    handle, priority, arrival_ns, render_start_ns, rendered_ns = views["request"][0].tolist()
    return RenderedPrompt(
        handle=handle,
        priority=priority,
        arrival_ns=arrival_ns,
        render_start_ns=render_start_ns,
        rendered_ns=rendered_ns,
        prompt_ids=views["prompt_ids"].copy(),
        rendered=views["rendered"].tobytes(),
        detok=views["detok"].tobytes(),
    )
