"""Token ids to text, per request: exact bytes through an incremental UTF-8 decoder (a character
split across tokens comes out whole, once its last byte arrives), and stop strings matched on the
text with the tail that could still become one held back, so a partial stop string never streams."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

from stages.api import TokenLogprob
from stages.rings.common import FINISH_NONE, FINISH_STOP
from stages.rings.tokens import DetokParams
from stages.text.parsers import OutputParser


@dataclass(slots=True)
class TextState:
    """One request's detokenization state."""

    params: DetokParams
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    held: str = ""  # decoded text not yet emitted: it might begin a stop string
    # What the last shown token was (None before any): with spaces_between_special_tokens, a
    # special token and its neighbours are set apart by one space, as HF's detokenizer joins them.
    last_special: bool | None = None
    busy_ns: int = 0  # time spent on this request here
    parser: OutputParser | None = None  # reasoning / tool calls, when the request asked for them
    # prompt logprobs by position, gathered over the prefill chunks until the first delta
    prompt_scores: dict[int, TokenLogprob] | None = None
    prompt_ids_sent: bool = False  # the first delta carried the prompt's ids (when asked for)

    def __post_init__(self) -> None:
        p = self.params
        if p.reasoning_parser is not None or p.tool_call_parser is not None:
            self.parser = OutputParser(
                p.reasoning_parser, p.tool_call_parser, p.reasoning_starts_inside
            )
        if p.num_prompt_logprobs >= 0:
            self.prompt_scores = {}

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.params.stop), default=0)


def stop_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in text: (index, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that is the start of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class Detokenizer:
    """The per-request text logic, separate from the actor so tests can drive it directly."""

    def __init__(
        self, token_bytes: tuple[bytes, ...], special_ids: frozenset[int], eos_ids: frozenset[int]
    ) -> None:
        self.token_bytes = token_bytes
        self.special_ids = special_ids
        self.eos_ids = eos_ids
        self.states: dict[int, TextState] = {}

    def add(self, handle: int, params: DetokParams) -> None:
        self.states[handle] = TextState(params)

    def feed(
        self, handle: int, token: int, finish: int
    ) -> tuple[str, int, str | int | None] | None:
        """New text, the finish (maybe a stop string's), and the stop reason; None if unknown."""
        state = self.states.get(handle)
        if state is None:
            return None
        params = state.params
        text = state.held
        stop_reason: str | int | None = None
        is_stop_token = finish == FINISH_STOP and token >= 0
        if is_stop_token and token not in self.eos_ids:
            stop_reason = token
        show = token >= 0 and not (params.skip_special_tokens and token in self.special_ids)
        if is_stop_token and not params.include_stop_str_in_output:
            show = False
        if show:
            special = token in self.special_ids
            if params.spaces_between_special_tokens:
                if state.last_special is not None and (special or state.last_special):
                    text += state.decoder.decode(b"", final=True) + " "
                state.last_special = special
            text += state.decoder.decode(self.token_bytes[token])
        if finish != FINISH_NONE:
            text += state.decoder.decode(b"", final=True)
        if params.stop:
            hit = stop_match(text, params.stop)
            if hit is not None:
                index, stop = hit
                end = index + len(stop) if params.include_stop_str_in_output else index
                del self.states[handle]
                return text[:end], FINISH_STOP, stop
            if finish == FINISH_NONE:
                keep = held_suffix(text, params.stop)
                state.held = text[len(text) - keep :] if keep else ""
                text = text[: len(text) - keep]
        if finish != FINISH_NONE:
            del self.states[handle]
        return text, finish, stop_reason
