"""The engine as the server process sees it: it supervises the four stages and speaks to them over
rings. It implements `stages.api.EngineClient`.

The server process owns three ring ends: it writes requests and aborts to render, and reads render's
errors and detokenize's deltas. One reader task per ring fans what arrives out to per-request
queues; a watcher turns a dead stage into an error for every request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import numpy as np
import structlog

from pipeline.actor import ActorSpec
from pipeline.clock import process_cpu_s
from pipeline.errors import ActorFailed, RuntimeFault
from pipeline.ring import RingSpec
from pipeline.supervisor import Supervisor, SupervisorConfig
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    ModelInfo,
    RequestOutput,
    TextPrompt,
    TokenLogprob,
)
from stages.config import EngineConfig, num_kv_blocks, resolve_max_model_len
from stages.rings import common, deltas, plan, prompts, requests, results, tokens
from stages.scheduler import GAUGES
from stages.text.prompts import prompt_token_ids
from stages.text.tokenizer import load_tokenizer

log = structlog.get_logger("stages.engine")

STOP_ORDER = ("render", "schedule", "execute", "detokenize")
MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0


def pipeline_layout(config: EngineConfig) -> tuple[list[RingSpec], list[ActorSpec]]:
    """The rings and actors of DESIGN.md's drawing."""
    step_bytes = 256 * 1024 + 64 * config.max_num_seqs * 64  # block tables grow with context
    rings = [
        RingSpec("requests", requests.REQUESTS, n_slots=64, slot_bytes=64 * 1024),
        RingSpec("errors", requests.ERRORS, n_slots=16, slot_bytes=4096),
        RingSpec("prompts", prompts.PROMPTS, n_slots=64, slot_bytes=64 * 1024),
        RingSpec("plan", plan.PLAN, n_slots=4, slot_bytes=_round(step_bytes)),
        RingSpec("results", results.RESULTS, n_slots=4, slot_bytes=256 * 1024),
        RingSpec("tokens", tokens.TOKENS_VOCAB, n_slots=16, slot_bytes=256 * 1024),
        RingSpec("stop_hits", tokens.STOP_HITS, n_slots=16, slot_bytes=4096),
        RingSpec("deltas", deltas.DELTAS_VOCAB, n_slots=16, slot_bytes=256 * 1024),
    ]
    execute_entry = (
        "stages.actors.execute:ExecuteActor"
        if not config.dummy
        else "stages.actors.dummy:DummyExecuteActor"
    )
    # The asyncio stages do not spin: a spin blocks their whole event loop, several readers each
    # spin, and messages come once per step (milliseconds apart), so spinning would only burn one
    # of two cores. Execute, a blocking loop fed a step ahead, keeps the short default spin.
    actors = [
        ActorSpec(
            "render",
            "stages.actors.render:RenderActor",
            config,
            ("requests",),
            ("prompts", "errors"),
            spin_s=0.0,
        ),
        ActorSpec(
            "schedule",
            "stages.actors.schedule:ScheduleActor",
            config,
            ("prompts", "results", "stop_hits"),
            ("plan", "tokens"),
            spin_s=0.0,
        ),
        ActorSpec(
            "execute", execute_entry, config, ("plan",), ("results",), heartbeat_interval_s=0.5
        ),
        ActorSpec(
            "detokenize",
            "stages.actors.detokenize:DetokenizeActor",
            config,
            ("tokens",),
            ("deltas", "stop_hits"),
            spin_s=0.0,
        ),
    ]
    return rings, actors


def _round(n: int) -> int:
    return (n + 4095) // 4096 * 4096


class Engine:
    """Supervises the pipeline and serves requests through it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.bundle = load_tokenizer(config.model_path)
        self.max_model_len = resolve_max_model_len(config)
        self.num_blocks = num_kv_blocks(config)
        if self.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks * config.block_size} tokens, less than one "
                f"request of max_model_len={self.max_model_len}: raise --kv-cache-memory or lower "
                f"--max-model-len"
            )
        self._info = ModelInfo(
            served_model_name=config.served_model_name or config.model_path,
            model_path=config.model_path,
            max_model_len=self.max_model_len,
            vocab_size=self.bundle.vocab_size,
            created=int(time.time()),
        )
        self.supervisor = self._new_supervisor()
        self._restarts: list[float] = []  # monotonic times of recent restarts
        self._restarting: asyncio.Task[None] | None = None
        self._handles = itertools.count(1)
        self._streams: dict[int, asyncio.Queue[RequestOutput | EngineError]] = {}
        self._ids: dict[int, str] = {}
        self._send_lock = asyncio.Lock()
        self._aborts: asyncio.Queue[int] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = False
        self._failure: ActorFailed | None = None
        self.last_output_ns = 0
        """time.monotonic_ns() when deltas last came from detokenize: the sign a watchdog reads
        that the pipeline makes progress (server/systemd.py)."""

    # -- lifecycle -------------------------------------------------------------------------------

    def _new_supervisor(self) -> Supervisor:
        config = self.config
        rings, actors = pipeline_layout(config)
        return Supervisor(
            rings,
            actors,
            SupervisorConfig(
                startup_timeout_s=config.startup_timeout_s,
                # A step of a long prefill on two cores can take seconds; a stuck stage takes longer.
                heartbeat_timeout_s=120.0,
                log_format=config.log_format,
                log_level=config.log_level,
                spin_s=0.0,  # the server's event loop serves HTTP: it must not spin either
                process_title_prefix="pipeline-serve",  # ps shows "pipeline-serve: render"
            ),
            owner_inboxes=("errors", "deltas"),
            owner_outboxes=("requests",),
        )

    async def start(self) -> None:
        """Start every stage (the loop keeps serving while models load), then the reader tasks."""
        await self.supervisor.start_async()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_deltas()),
            loop.create_task(self._read_errors()),
            loop.create_task(self._send_aborts()),
            loop.create_task(self.supervisor.watch(self._on_failure)),
        ]
        self._ready = True
        log.info(
            "engine ready",
            model=self._info.served_model_name,
            max_model_len=self.max_model_len,
            kv_blocks=self.num_blocks,
        )

    async def stop(self) -> None:
        self._ready = False
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restarting
        await self._stop_pipeline()

    async def _stop_pipeline(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._tasks = []
        await asyncio.to_thread(self.supervisor.stop, STOP_ORDER)

    def _on_failure(self, failure: ActorFailed) -> None:
        """A stage died or hung: fail the requests in flight, then bring up a fresh pipeline.

        The server stays up throughout (/health says 503 until the new stages are ready). More than
        MAX_RESTARTS failures within RESTART_WINDOW_S leave the engine down, with the last reason.
        """
        self._ready = False
        self._failure = failure
        error = EngineError(f"the engine failed: {failure}", status=500, type="InternalServerError")
        for queue in self._streams.values():
            queue.put_nowait(error)
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restarts) > MAX_RESTARTS:
            log.error("engine failed too often; not restarting", reason=str(failure))
            return
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        log.warning("restarting the pipeline", reason=str(self._failure))
        await self._stop_pipeline()
        self.supervisor = self._new_supervisor()
        try:
            await self.start()
        except Exception as exc:
            log.error("the pipeline did not come back", error=str(exc))
            return
        self._failure = None

    # -- EngineClient ----------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def failure(self) -> ActorFailed | None:
        """The stage failure the pipeline is down for (restarting, or given up); None while up."""
        return self._failure

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self._ready:
            reason = f": {self._failure}" if self._failure else " yet"
            raise EngineError(
                f"the engine is not ready{reason}", status=503, type="ServiceUnavailableError"
            )
        handle = next(self._handles)
        queue: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        self._streams[handle] = queue
        self._ids[handle] = request.request_id
        finished = False
        try:
            arrays = requests.pack_submit(handle, request)
            async with self._send_lock:
                await self.supervisor.producers["requests"].send_async(requests.SUBMIT, arrays)
            while True:
                item = await queue.get()
                # A reader slower than the engine gets what piled up as one output (as vLLM does).
                while (
                    not queue.empty()
                    and not isinstance(item, EngineError)
                    and item.finish_reason is None
                ):
                    following = queue.get_nowait()
                    if isinstance(following, EngineError):
                        queue.put_nowait(following)  # yield what came before the error first
                        break
                    item = _merge(item, following)
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(handle, None)
            self._ids.pop(handle, None)
            if not finished:
                self._aborts.put_nowait(handle)

    async def abort(self, request_id: str) -> None:
        for handle, rid in list(self._ids.items()):
            if rid == request_id:
                queue = self._streams.pop(handle, None)
                self._aborts.put_nowait(handle)
                if queue is not None:
                    queue.put_nowait(EngineError("aborted", status=499, type="Aborted"))

    def tokenize(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return prompt_token_ids(self.bundle, prompt)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.bundle.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is out of vocabulary", param="tokens")
        return self.bundle.decode(list(token_ids))

    def stats(self) -> Mapping[str, float]:
        values = self.supervisor.gauges("schedule")
        stats = dict(zip(GAUGES, values, strict=False))
        stats["num_streams"] = len(self._streams)
        return stats

    # -- profiling -------------------------------------------------------------------------------

    def read_traces(self) -> dict[str, np.ndarray]:
        """Each stage's spans (pipeline/trace.py SPAN records) since the last call."""
        return {name: buffer.read_new() for name, buffer in self.supervisor.traces.items()}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (all threads) each process of the pipeline has used so far."""
        import os

        pids = {"server": os.getpid(), **self.supervisor.pids()}
        out = {}
        for name, pid in pids.items():
            with contextlib.suppress(ProcessLookupError):
                out[name] = process_cpu_s(pid)
        return out

    # -- readers ---------------------------------------------------------------------------------

    async def _send_aborts(self) -> None:
        producer = self.supervisor.producers["requests"]
        while True:
            handles = [await self._aborts.get()]
            while not self._aborts.empty():
                handles.append(self._aborts.get_nowait())
            async with self._send_lock:
                await producer.send_async(common.ABORT, common.pack_abort(handles))

    async def _read_errors(self) -> None:
        consumer = self.supervisor.consumers["errors"]
        with contextlib.suppress(RuntimeFault):
            while True:
                with await consumer.recv_async() as message:
                    handle, error = requests.unpack_error(message)
                queue = self._streams.get(handle)
                if queue is not None:
                    queue.put_nowait(error)

    async def _read_deltas(self) -> None:
        consumer = self.supervisor.consumers["deltas"]
        streams, ids = self._streams, self._ids
        with contextlib.suppress(RuntimeFault):
            while True:
                with await consumer.recv_async() as message:
                    batch = deltas.unpack_deltas(message)
                self.last_output_ns = time.monotonic_ns()
                for row, handle in enumerate(batch.handles):
                    queue = streams.get(handle)
                    if queue is not None:
                        queue.put_nowait(_output(ids.get(handle, ""), batch, row))


def _output(request_id: str, batch: deltas.DeltaBatch, row: int) -> RequestOutput:
    extra = batch.extra(row)
    prompt_ids, prompt_logprobs = None, None
    if extra.prompt_logprobs is not None:
        prompt_ids, prompt_logprobs = _prompt_logprobs(extra.prompt_logprobs)
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
    )


def _prompt_logprobs(
    rows: tuple[TokenLogprob, ...],
) -> tuple[tuple[int, ...] | None, tuple[TokenLogprob | None, ...]]:
    """(the prompt's token ids, its logprobs with None for the first token) from the rows
    detokenize gathered; a first row of rank 0 is position 0, which has no logprob."""
    if rows and rows[0].rank == 0:
        return tuple(r.token_id for r in rows), (None, *rows[1:])
    return None, (None, *rows)


def _merge(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one."""
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        logprobs = (first.logprobs or ()) + (second.logprobs or ())
    return RequestOutput(
        request_id=second.request_id,
        text=first.text + second.text,
        token_ids=first.token_ids + second.token_ids,
        prompt_token_ids=first.prompt_token_ids or second.prompt_token_ids,
        num_prompt_tokens=second.num_prompt_tokens,
        num_output_tokens=second.num_output_tokens,
        finish_reason=second.finish_reason,
        stop_reason=second.stop_reason,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs,
        metrics=second.metrics,
        reasoning=first.reasoning + second.reasoning,
        tool_calls=first.tool_calls + second.tool_calls,
    )


async def build_engine(config: EngineConfig) -> Engine:
    """An Engine whose stages are started (awaits model loading)."""
    engine = Engine(config)
    await engine.start()
    return engine
