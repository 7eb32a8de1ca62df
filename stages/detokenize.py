"""The detokenize stage: token ids to text deltas, stop strings, logprob rows, and per-request metrics.

Text is built from each token's exact bytes through an incremental UTF-8 decoder, so a character
split across tokens is emitted whole, once its last byte arrives. Stop strings are matched on the
text; the tail that could still become a stop string is held back, so a partial stop string is never
streamed. A stop-string hit finishes the request here and tells the scheduler to free it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

import numpy as np

from gpu.tokenizer import load_tokenizer
from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from stages import messages as m
from stages.config import EngineConfig
from stages.parsers import OutputParser
from stages.wire import (
    DeltaExtra,
    DetokParams,
    WireLogprob,
    WireMetrics,
    WireToolCall,
    detok_decoder,
    encoder,
)


@dataclass(slots=True)
class TextState:
    """One request's detokenization state."""

    params: DetokParams
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    held: str = ""  # decoded text not yet emitted: it might begin a stop string
    busy_ns: int = 0  # time spent on this request here
    parser: OutputParser | None = None  # reasoning / tool calls, when the request asked for them
    # prompt logprobs by position, gathered over the prefill chunks until the first delta
    prompt_scores: dict[int, WireLogprob] | None = None

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


def stop_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in text: (index, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_suffix(text: str, stops: list[str]) -> int:
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
        is_stop_token = finish == m.FINISH_STOP and token >= 0
        if is_stop_token and token not in self.eos_ids:
            stop_reason = token
        show = token >= 0 and not (params.skip_special_tokens and token in self.special_ids)
        if is_stop_token and not params.include_stop_str_in_output:
            show = False
        if show:
            text += state.decoder.decode(self.token_bytes[token])
        if finish != m.FINISH_NONE:
            text += state.decoder.decode(b"", final=True)
        if params.stop:
            hit = stop_match(text, params.stop)
            if hit is not None:
                index, stop = hit
                end = index + len(stop) if params.include_stop_str_in_output else index
                del self.states[handle]
                return text[:end], m.FINISH_STOP, stop
            if finish == m.FINISH_NONE:
                keep = held_suffix(text, params.stop)
                state.held = text[len(text) - keep :] if keep else ""
                text = text[: len(text) - keep]
        if finish != m.FINISH_NONE:
            del self.states[handle]
        return text, finish, stop_reason


class DetokenizeActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        bundle = load_tokenizer(config.model_path)
        self.detok = Detokenizer(
            bundle.token_bytes, bundle.special_token_ids, frozenset(bundle.eos_token_ids)
        )

    async def run(self) -> None:
        inbox = self.ctx.inbox["tokens"]
        deltas, stop_hits = self.ctx.outbox["deltas"], self.ctx.outbox["stop_hits"]
        while True:
            message = await inbox.recv_async()
            started, depth = now_ns(), inbox.depth()
            with message:
                arrays, stopped = self.process(message)
            if stopped:
                await stop_hits.send_async(m.FINISHED, {"handles": np.array(stopped, np.int64)})
            if arrays is not None:
                await deltas.send_async(m.DELTAS, arrays)
            self.ctx.trace.record(
                m.SPAN_DETOKENIZE,
                started,
                now_ns(),
                batch=0 if arrays is None else len(arrays["rows"]),
                depth=depth,
            )

    def gather_prompt_logprobs(self, message, top_k: int) -> None:  # type: ignore[no-untyped-def]
        """Keeps each prompt chunk's logprobs by position (a recomputed chunk overwrites its own)."""
        rows = message["prompt_rows"].tolist()
        top_ids = message["prompt_top_ids"].reshape(len(rows), top_k).tolist()
        top_logprobs = message["prompt_top_logprobs"].reshape(len(rows), top_k).tolist()
        for i, (handle, position, token, logprob, rank) in enumerate(rows):
            state = self.detok.states.get(handle)
            if state is None or state.prompt_scores is None:
                continue
            k = state.params.num_prompt_logprobs
            top = [(t, lp) for t, lp in zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)]
            state.prompt_scores[position] = WireLogprob(
                token, logprob, rank, [t for t in top if t[0] >= 0]
            )

    def process(self, message) -> tuple[dict[str, np.ndarray] | None, list[int]]:  # type: ignore[no-untyped-def]
        offsets = message["new_offsets"].tolist()
        blob = message["new_detok"].tobytes()
        for i, handle in enumerate(message["new_handles"].tolist()):
            self.detok.add(handle, detok_decoder.decode(blob[offsets[i] : offsets[i + 1]]))
        meta = message["meta"].tolist()
        top_k = int(meta[1])
        if len(message["prompt_rows"]):
            self.gather_prompt_logprobs(message, int(meta[2]))
        rows, stamps = message["rows"], message["stamps"]
        top_ids = message["top_ids"].reshape(len(rows), top_k)
        top_logprobs = message["top_logprobs"].reshape(len(rows), top_k)
        out_rows, texts, extras, stopped = [], [], [], []
        for i, row in enumerate(rows.tolist()):
            handle, token, logprob, rank, finish, _, n_prompt, n_output, n_preempt, n_cached = row
            state = self.detok.states.get(handle)
            if state is None:
                continue
            t0 = now_ns()
            num_logprobs = state.params.num_logprobs
            text, final, stop_reason = self.detok.feed(handle, token, finish) or ("", finish, None)
            if final == m.FINISH_STOP and finish == m.FINISH_NONE:
                stopped.append(handle)  # a stop string: the scheduler still runs it
            reasoning, tool_calls = "", None
            if state.parser is not None:
                parsed = state.parser.feed(text, final != m.FINISH_NONE)
                text, reasoning = parsed.content, parsed.reasoning
                if parsed.tool_calls:
                    tool_calls = [
                        WireToolCall(c.id, c.name, c.arguments) for c in parsed.tool_calls
                    ]
            logprobs = None
            if num_logprobs >= 0 and token >= 0:
                top = list(
                    zip(
                        top_ids[i, :num_logprobs].tolist(),
                        top_logprobs[i, :num_logprobs].tolist(),
                        strict=True,
                    )
                )
                logprobs = [WireLogprob(token, logprob, rank, [t for t in top if t[0] >= 0])]
            state.busy_ns += now_ns() - t0
            metrics = None
            if final != m.FINISH_NONE:
                s = stamps[i]
                metrics = WireMetrics(
                    arrival_ns=int(s["arrival_ns"]),
                    render_start_ns=int(s["render_start_ns"]),
                    rendered_ns=int(s["rendered_ns"]),
                    scheduled_ns=int(s["scheduled_ns"]),
                    first_token_ns=int(s["first_token_ns"]),
                    last_token_ns=int(s["last_token_ns"]),
                    prefill_done_ns=int(s["prefill_done_ns"]),
                    finished_ns=now_ns(),
                    detokenize_ns=state.busy_ns,
                    num_preemptions=n_preempt,
                    num_cached_tokens=n_cached,
                )
            prompt_logprobs = None
            if state.prompt_scores is not None:  # the first delta carries them
                prompt_logprobs = [state.prompt_scores[p] for p in sorted(state.prompt_scores)]
                state.prompt_scores = None
            out_rows.append((handle, final, n_prompt, n_output, token))
            texts.append(text.encode("utf-8"))
            # Most rows are a token and its text: only the others carry an encoded extra.
            if (
                logprobs is None
                and stop_reason is None
                and metrics is None
                and not reasoning
                and tool_calls is None
                and prompt_logprobs is None
            ):
                extras.append(b"")
            else:
                extra = DeltaExtra(
                    logprobs, stop_reason, metrics, reasoning, tool_calls, prompt_logprobs
                )
                extras.append(encoder.encode(extra))
        if not out_rows:
            return None, stopped
        return {
            "rows": np.array(out_rows, m.DELTA_ROW),
            "text_offsets": np.cumsum([0, *map(len, texts)], dtype=np.int32),
            "text": np.frombuffer(b"".join(texts), np.uint8),
            "extra_offsets": np.cumsum([0, *map(len, extras)], dtype=np.int32),
            "extra": np.frombuffer(b"".join(extras), np.uint8),
        }, stopped
