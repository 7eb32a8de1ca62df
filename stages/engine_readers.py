"""The engine's ring ends in the server process: the readers of detokenize's deltas and
render's errors, which fan what arrives out to the requests' queues, and the sender of aborts.
"""

from __future__ import annotations

import contextlib
import time

import structlog

from pipeline.clock import now_ns
from pipeline.errors import RuntimeFault
from stages.api import (
    EngineError,
    RenderedPromptInfo,
    RequestOutput,
    TokenLogprob,
)
from stages.engine_state import EngineState, Flight
from stages.rings import common, deltas, requests

log = structlog.get_logger("stages.engine")


class EngineReaders(EngineState):
    """The reader tasks, started with each pipeline (EngineLifecycle._start_tasks)."""

    async def _send_aborts(self) -> None:
        producer = self.supervisor.producers["requests"]
        while True:
            handles = [await self._aborts.get()]
            while not self._aborts.empty():
                handles.append(self._aborts.get_nowait())
            self._recent_aborts.extend(handles)
            async with self._send_lock:
                await producer.send_async(common.ABORT, common.pack_abort(handles))

    async def _read_errors(self) -> None:
        consumer = self.supervisor.consumers["errors"]
        with contextlib.suppress(RuntimeFault):
            while True:
                answer: RenderedPromptInfo | EngineError
                with await consumer.recv_async() as message:
                    if message.name == requests.RENDERED.name:
                        handle, answer = requests.unpack_rendered(message)
                    else:
                        handle, answer = requests.unpack_error(message)
                render = self._renders.get(handle)
                if render is not None:
                    if not render.done():  # else its client left
                        if isinstance(answer, EngineError):
                            render.set_exception(answer)
                        else:
                            render.set_result(answer)
                    continue
                flight = self._flights.get(handle)
                if flight is not None and isinstance(answer, EngineError):
                    flight.queue.put_nowait(answer)

    async def _read_deltas(self) -> None:
        consumer = self.supervisor.consumers["deltas"]
        flights = self._flights
        rank = self.config.data_parallel_rank
        with contextlib.suppress(RuntimeFault):
            while True:
                with await consumer.recv_async() as message:
                    batch = deltas.unpack_deltas(message)
                received = now_ns()
                self.last_output_ns = time.monotonic_ns()
                for row, handle in enumerate(batch.handles):
                    flight = flights.get(handle)
                    if flight is None:
                        continue
                    token = batch.token_ids[row]
                    if token >= 0:  # what a resubmission after a failure starts from
                        if batch.num_output_tokens[row] <= len(flight.output_ids):
                            continue  # read before detokenize was restarted, written again
                        self._num_tokens_read += 1
                        if flight.failures_without_progress:
                            flight.failures_without_progress, flight.failed_stage = 0, ""
                            self._probe_wake.set()
                        if not flight.output_ids:
                            flight.first_token_ns = now_ns()
                        flight.output_ids.append(token)
                    output = _output(flight.request.request_id, batch, row, received, rank)
                    flight.queue.put_nowait(output)
                    flight.unread += unread_cost(output)
                    if flight.unread > self.config.max_unread_tokens:
                        self._abort_unread(handle, flight)

    def _abort_unread(self, handle: int, flight: Flight) -> None:
        """Abort a request whose client stopped reading: what it has not read stays queued (it
        gets it, then the error, if it reads again); nothing more is added."""
        log.warning(
            "request aborted: its client is not reading",
            request_id=flight.request.request_id,
            unread_tokens=flight.unread,
            limit=self.config.max_unread_tokens,
        )
        self.num_aborted_unread += 1
        del self._flights[handle]
        self._aborts.put_nowait(handle)
        self._probe_wake.set()
        flight.queue.put_nowait(
            EngineError(
                f"the request was aborted: its client left more than "
                f"{self.config.max_unread_tokens} tokens unread (--max-unread-tokens)",
                status=408,
                type="RequestTimeoutError",
            )
        )


def _output(
    request_id: str, batch: deltas.DeltaBatch, row: int, received_ns: int, engine: int
) -> RequestOutput:
    extra = batch.extra(row)
    prompt_ids, prompt_logprobs = None, None
    if extra.prompt_logprobs is not None:
        prompt_ids, prompt_logprobs = _prompt_logprobs(extra.prompt_logprobs)
    if extra.prompt_token_ids is not None:
        prompt_ids = extra.prompt_token_ids
    token = batch.token_ids[row]
    return RequestOutput(
        request_id=request_id,
        text=batch.text(row),
        token_ids=(token,) if token >= 0 else (),
        prompt_token_ids=prompt_ids,
        num_prompt_tokens=batch.num_prompt_tokens[row],
        num_output_tokens=batch.num_output_tokens[row],
        finish_reason=common.FINISH_NAMES.get(batch.finishes[row]),
        stop_reason=extra.stop_reason,
        logprobs=extra.logprobs,
        prompt_logprobs=prompt_logprobs,
        metrics=extra.metrics,
        reasoning=extra.reasoning,
        tool_calls=extra.tool_calls,
        num_reasoning_tokens=extra.num_reasoning_tokens,
        step_id=batch.step_id,
        received_ns=received_ns,
        engine=engine,
    )


def _prompt_logprobs(
    rows: tuple[TokenLogprob, ...],
) -> tuple[tuple[int, ...] | None, tuple[TokenLogprob | None, ...]]:
    """(the prompt's token ids, its logprobs with None for the first token) from the rows
    detokenize gathered; a first row of rank 0 is position 0, which has no logprob."""
    if rows and rows[0].rank == 0:
        return tuple(r.token_id for r in rows), (None, *rows[1:])
    return None, (None, *rows)


def unread_cost(item: RequestOutput | EngineError) -> int:
    """What an output holds, in tokens, each of their top logprobs counted as one more (its
    prompt logprobs, which come once and are bounded by the prompt, are not counted)."""
    if isinstance(item, EngineError):
        return 0
    if item.logprobs is None:  # most outputs: no generator to build
        return len(item.token_ids)
    return len(item.token_ids) + sum(len(lp.top) for lp in item.logprobs)


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one, built once (merging them two at a time
    copied the text and tokens so far again for each)."""
    first, last = outputs[0], outputs[-1]
    if len(outputs) == 1:
        return first
    logprobs = None
    if any(o.logprobs is not None for o in outputs):
        logprobs = tuple(lp for o in outputs for lp in o.logprobs or ())
    return RequestOutput(
        request_id=last.request_id,
        text="".join(o.text for o in outputs),
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        prompt_token_ids=next((o.prompt_token_ids for o in outputs if o.prompt_token_ids), None),
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        logprobs=logprobs,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None),
        metrics=last.metrics,
        reasoning="".join(o.reasoning for o in outputs),
        tool_calls=tuple(c for o in outputs for c in o.tool_calls),
        num_reasoning_tokens=last.num_reasoning_tokens,
        step_id=last.step_id,
        received_ns=first.received_ns,  # the time the merged output waited starts with its first
        engine=last.engine,
    )


async def next_output(flight: Flight, gather: int) -> RequestOutput | EngineError:
    """The flight's next output: what piled up merged into one (a reader slower than the engine
    gets it as one, as vLLM does), and with `gather` > 1 what comes until it holds that many
    tokens or the request's end (--stream-interval). An error comes after what came before it."""
    queue = flight.queue
    item = await queue.get()
    flight.unread -= unread_cost(item)
    if isinstance(item, EngineError):
        return item
    run, tokens = [item], len(item.token_ids)
    while item.finish_reason is None and not (queue.empty() and tokens >= gather):
        following = await queue.get()
        if isinstance(following, EngineError):
            queue.put_nowait(following)  # yield what came before the error first
            break
        flight.unread -= unread_cost(following)
        run.append(following)
        item, tokens = following, tokens + len(following.token_ids)
    return merge_outputs(run)
