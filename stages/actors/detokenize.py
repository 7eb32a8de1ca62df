"""The detokenize stage: token ids to text deltas, stop strings, logprob rows, tool calls and
reasoning, and each finished request's metrics (stages.text.detokenizer holds the text logic).

A stop-string hit finishes the request here and tells the scheduler to free it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.api import TokenLogprob
from stages.config import EngineConfig
from stages.rings import deltas, tokens
from stages.rings.common import FINISH_NONE, FINISH_STOP, PromptLogprobs
from stages.rings.deltas import DeltaExtra
from stages.rings.tokens import TokenBatch
from stages.text.detokenizer import Detokenizer
from stages.text.snapshot import tokenizer_of


class DetokenizeActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        bundle = tokenizer_of(config)
        self.token_bytes = bundle.token_bytes
        self.detok = Detokenizer(
            bundle.token_bytes, bundle.special_token_ids, frozenset(bundle.eos_token_ids)
        )

    async def run(self) -> None:
        inbox = self.ctx.inbox["tokens"]
        outbox, stop_hits = self.ctx.outbox["deltas"], self.ctx.outbox["stop_hits"]
        while True:
            message = await inbox.recv_async()
            started, depth = now_ns(), inbox.depth()
            with message:
                batch = tokens.unpack_tokens(message)
            arrays, stopped = self.process(batch)
            done = now_ns()  # the span ends where the hops to the server and schedule begin
            if stopped:
                await stop_hits.send_async(tokens.FINISHED, tokens.pack_finished(stopped))
            if arrays is not None:
                await outbox.send_async(deltas.DELTAS, arrays)
            self.ctx.trace.record(
                spans.SPAN_DETOKENIZE,
                started,
                done,
                batch=0 if arrays is None else len(arrays["rows"]),
                depth=depth,
                link=batch.step_id,
            )

    def logprob(
        self, token: int, logprob: float, rank: int, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        data = self.token_bytes
        return TokenLogprob(
            token,
            _text(data[token]),
            data[token],
            logprob,
            rank,
            tuple((t, _text(data[t]), data[t], lp) for t, lp in top if t >= 0),
        )

    def gather_prompt_logprobs(self, prompt: PromptLogprobs) -> None:
        """Keeps each prompt chunk's logprobs by position (a recomputed chunk overwrites its own)."""
        for entry in prompt.entries():
            state = self.detok.states.get(entry.handle)
            if state is None or state.prompt_scores is None:
                continue
            top = entry.top[: state.params.num_prompt_logprobs]
            state.prompt_scores[entry.position] = self.logprob(
                entry.token_id, entry.logprob, entry.rank, top
            )

    def replay(self, handle: int, token_ids: tuple[int, ...]) -> None:
        """Brings a request resumed after a stage failure to the text state it had: its client
        already has these tokens' text, so nothing is emitted, but held-back text (a possible stop
        string, a partial UTF-8 character) and the parsers' state come back as they were."""
        for token in token_ids:
            state = self.detok.states.get(handle)
            if state is None:
                return
            text = (self.detok.feed(handle, token, FINISH_NONE) or ("",))[0]
            if state.parser is not None:
                state.parser.feed(text, False)

    def process(self, batch: TokenBatch) -> tuple[dict[str, np.ndarray] | None, list[int]]:
        """One batch of sampled tokens: its new requests added (a resumed one replayed), its prompt
        logprobs kept, its rows fed; -> (the deltas, None when no row's request is here, and the
        requests a stop string finished)."""
        for handle, params in batch.new:
            self.detok.add(handle, params)
            self.replay(handle, params.replay_ids)
        if len(batch.prompt.rows):
            self.gather_prompt_logprobs(batch.prompt)
        out_rows, texts, extras, stopped = self.feed_rows(batch)
        if not out_rows:
            return None, stopped
        return deltas.pack_deltas(batch.step_id, out_rows, texts, extras), stopped

    def feed_rows(
        self, batch: TokenBatch
    ) -> tuple[list[tuple[int, int, int, int, int]], list[str], list[DeltaExtra | None], list[int]]:
        """Each row's token through its request's text state and parsers: (DELTA_ROW's fields,
        texts and extras, of the rows whose request is here; the requests a stop string
        finished)."""
        out_rows: list[tuple[int, int, int, int, int]] = []
        texts: list[str] = []
        extras: list[DeltaExtra | None] = []
        stopped: list[int] = []
        rows = batch.rows
        for i, (handle, token, finish, num_prompt, num_output) in enumerate(_columns(rows)):
            state = self.detok.states.get(handle)
            if state is None:
                continue
            t0 = now_ns()
            num_logprobs = state.params.num_logprobs
            text, final, stop_reason = self.detok.feed(handle, token, finish) or ("", finish, None)
            if final == FINISH_STOP and finish == FINISH_NONE:
                stopped.append(handle)  # a stop string: the scheduler still runs it
            reasoning, tool_calls, num_reasoning_tokens = "", (), 0
            if state.parser is not None:
                parsed = state.parser.feed(text, final != FINISH_NONE, token >= 0)
                text, reasoning, tool_calls = parsed.content, parsed.reasoning, parsed.tool_calls
                if final != FINISH_NONE:
                    num_reasoning_tokens = state.parser.num_reasoning_tokens
            logprobs = None
            if num_logprobs >= 0 and token >= 0:
                top = list(
                    zip(
                        batch.top_ids[i, :num_logprobs].tolist(),
                        batch.top_logprobs[i, :num_logprobs].tolist(),
                        strict=True,
                    )
                )
                logprob, rank = float(rows["logprob"][i]), int(rows["rank"][i])
                logprobs = (self.logprob(token, logprob, rank, top),)
            state.busy_ns += now_ns() - t0
            metrics = None
            if final != FINISH_NONE:
                metrics = tokens.request_metrics(batch.metrics[i], now_ns(), state.busy_ns)
            prompt_logprobs = None
            if state.prompt_scores is not None:  # the first delta carries them
                scores = state.prompt_scores
                prompt_logprobs = tuple(scores[p] for p in sorted(scores))
                state.prompt_scores = None
            prompt_ids = None
            if state.params.prompt_token_ids and not state.prompt_ids_sent:
                prompt_ids, state.prompt_ids_sent = state.params.prompt_token_ids, True
            out_rows.append((handle, final, num_prompt, num_output, token))
            texts.append(text)
            # Most rows are a token and its text: only the others carry an encoded extra.
            if (
                logprobs is None
                and stop_reason is None
                and metrics is None
                and not reasoning
                and not tool_calls
                and prompt_logprobs is None
                and prompt_ids is None
            ):
                extras.append(None)
            else:
                extras.append(
                    DeltaExtra(
                        logprobs,
                        stop_reason,
                        metrics,
                        reasoning,
                        tuple(tool_calls),
                        prompt_logprobs,
                        num_reasoning_tokens,
                        prompt_ids,
                    )
                )
        return out_rows, texts, extras, stopped


def _columns(rows: np.ndarray) -> Iterator[tuple[int, int, int, int, int]]:  # rows: [B] TOKEN_ROW
    """Each row's (handle, token id, finish, prompt tokens, output tokens) as Python ints: one
    tolist a column, not one a row."""
    return zip(
        rows["handle"].tolist(),
        rows["token_id"].tolist(),
        rows["finish"].tolist(),
        rows["num_prompt_tokens"].tolist(),
        rows["num_output_tokens"].tolist(),
        strict=True,
    )


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
