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

from gpu.tokenizer import load_tokenizer
from pipeline.actor import ActorSpec
from pipeline.clock import process_cpu_s
from pipeline.errors import ActorFailed, RuntimeFault
from pipeline.ring import RingSpec
from pipeline.supervisor import Supervisor, SupervisorConfig
from stages import messages as m
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    ModelInfo,
    RequestMetrics,
    RequestOutput,
    TextPrompt,
    TokenLogprob,
    ToolCall,
)
from stages.config import EngineConfig, num_kv_blocks
from stages.render import prompt_token_ids, resolve_max_model_len
from stages.schedule import GAUGES
from stages.wire import (
    DeltaExtra,
    WireLogprob,
    WireMetrics,
    encode_request,
    error_decoder,
    extra_decoder,
)

log = structlog.get_logger("stages.engine")

STOP_ORDER = ("render", "schedule", "execute", "detokenize")
MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0
_PLAIN = DeltaExtra()  # a delta row with only a token and its text


def pipeline_layout(config: EngineConfig) -> tuple[list[RingSpec], list[ActorSpec]]:
    """The rings and actors of DESIGN.md's drawing."""
    step_bytes = 256 * 1024 + 64 * config.max_num_seqs * 64  # block tables grow with context
    rings = [
        RingSpec("requests", m.REQUESTS, n_slots=64, slot_bytes=64 * 1024),
        RingSpec("errors", m.ERRORS, n_slots=16, slot_bytes=4096),
        RingSpec("prompts", m.PROMPTS, n_slots=64, slot_bytes=64 * 1024),
        RingSpec("plan", m.PLAN, n_slots=4, slot_bytes=_round(step_bytes)),
        RingSpec("results", m.RESULTS, n_slots=4, slot_bytes=256 * 1024),
        RingSpec("tokens", m.TOKENS_VOCAB, n_slots=16, slot_bytes=256 * 1024),
        RingSpec("stop_hits", m.STOP_HITS, n_slots=16, slot_bytes=4096),
        RingSpec("deltas", m.DELTAS_VOCAB, n_slots=16, slot_bytes=256 * 1024),
    ]
    execute_entry = (
        "stages.execute:ExecuteActor" if not config.dummy else "stages.dummy:DummyExecuteActor"
    )
    # The asyncio stages do not spin: a spin blocks their whole event loop, several readers each
    # spin, and messages come once per step (milliseconds apart), so spinning would only burn one
    # of two cores. Execute, a blocking loop fed a step ahead, keeps the short default spin.
    actors = [
        ActorSpec(
            "render",
            "stages.render:RenderActor",
            config,
            ("requests",),
            ("prompts", "errors"),
            spin_s=0.0,
        ),
        ActorSpec(
            "schedule",
            "stages.schedule:ScheduleActor",
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
            "stages.detokenize:DetokenizeActor",
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
            payload = np.frombuffer(encode_request(request), np.uint8)
            async with self._send_lock:
                await self.supervisor.producers["requests"].send_async(
                    m.SUBMIT,
                    {
                        "handle": np.array([handle], np.int64),
                        "arrival_ns": np.array([request.arrival_ns], np.int64),
                        "payload": payload,
                    },
                )
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
        from stages.wire import WireChat, WireRequest, WireSampling, WireText

        wire = (
            WireChat(
                messages=[dict(x) for x in prompt.messages],
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                chat_template_kwargs=dict(prompt.chat_template_kwargs or {}),
                tools=[dict(t) for t in prompt.tools] if prompt.tools else None,
            )
            if isinstance(prompt, ChatPrompt)
            else WireText(prompt.text, prompt.add_special_tokens)
        )
        return prompt_token_ids(self.bundle, WireRequest(wire, WireSampling()))

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
                await producer.send_async(m.ABORT, {"handles": np.array(handles, np.int64)})

    async def _read_errors(self) -> None:
        consumer = self.supervisor.consumers["errors"]
        with contextlib.suppress(RuntimeFault):
            while True:
                with await consumer.recv_async() as message:
                    handle = int(message["handle"][0])
                    status = int(message["status"][0])
                    body = error_decoder.decode(message["payload"].tobytes())
                queue = self._streams.get(handle)
                if queue is not None:
                    queue.put_nowait(
                        EngineError(body.message, status, body.type, body.param, body.code)
                    )

    async def _read_deltas(self) -> None:
        consumer = self.supervisor.consumers["deltas"]
        with contextlib.suppress(RuntimeFault):
            while True:
                with await consumer.recv_async() as message:
                    rows = message["rows"].tolist()
                    text_offsets = message["text_offsets"].tolist()
                    text = message["text"].tobytes()
                    extra_offsets = message["extra_offsets"].tolist()
                    extra = message["extra"].tobytes()
                for i, (handle, finish, n_prompt, n_output, token) in enumerate(rows):
                    queue = self._streams.get(handle)
                    if queue is None:
                        continue
                    start, end = extra_offsets[i], extra_offsets[i + 1]
                    info = extra_decoder.decode(extra[start:end]) if end > start else _PLAIN
                    prompt_ids, prompt_logprobs = None, None
                    if info.prompt_logprobs is not None:
                        prompt_ids, prompt_logprobs = self._prompt_logprobs(info.prompt_logprobs)
                    queue.put_nowait(
                        RequestOutput(
                            request_id=self._ids.get(handle, ""),
                            text=text[text_offsets[i] : text_offsets[i + 1]].decode("utf-8"),
                            token_ids=(token,) if token >= 0 else (),
                            prompt_token_ids=prompt_ids,
                            num_prompt_tokens=n_prompt,
                            num_output_tokens=n_output,
                            finish_reason=m.FINISH_NAMES.get(finish),
                            stop_reason=info.stop_reason,
                            logprobs=self._logprobs(info.logprobs) if info.logprobs else None,
                            prompt_logprobs=prompt_logprobs,
                            metrics=_metrics(info.metrics, n_output) if info.metrics else None,
                            reasoning=info.reasoning,
                            tool_calls=tuple(
                                ToolCall(c.id, c.name, c.arguments) for c in info.tool_calls
                            )
                            if info.tool_calls
                            else (),
                        )
                    )

    def _prompt_logprobs(
        self, rows: list[WireLogprob]
    ) -> tuple[tuple[int, ...] | None, tuple[TokenLogprob | None, ...]]:
        """(the prompt's token ids, its logprobs with None for the first token) from the rows
        detokenize gathered; the first row is position 0 (rank 0, no logprob)."""
        if rows and rows[0].rank == 0:
            return tuple(r.token_id for r in rows), (None, *self._logprobs(rows[1:]))
        return None, (None, *self._logprobs(rows))

    def _logprobs(self, rows: list[WireLogprob]) -> tuple[TokenLogprob, ...]:
        token_bytes = self.bundle.token_bytes
        return tuple(
            TokenLogprob(
                token_id=r.token_id,
                token=_token_text(token_bytes[r.token_id]),
                token_bytes=token_bytes[r.token_id],
                logprob=r.logprob,
                rank=r.rank,
                top=tuple((t, _token_text(token_bytes[t]), token_bytes[t], lp) for t, lp in r.top),
            )
            for r in rows
        )


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


def _token_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _metrics(w: WireMetrics, num_tokens: int) -> RequestMetrics:
    def span(a: int, b: int) -> float:
        return max(0.0, (b - a) / 1e9) if a and b else 0.0

    return RequestMetrics(
        arrival_ns=w.arrival_ns,
        rendered_ns=w.rendered_ns,
        scheduled_ns=w.scheduled_ns,
        first_token_ns=w.first_token_ns,
        last_token_ns=w.last_token_ns,
        finished_ns=w.finished_ns,
        render_s=span(w.render_start_ns, w.rendered_ns),
        queue_s=span(w.rendered_ns, w.scheduled_ns),
        prefill_s=span(w.scheduled_ns, w.prefill_done_ns),
        decode_s=span(w.prefill_done_ns, w.last_token_ns),
        detokenize_s=w.detokenize_ns / 1e9,
        num_generated_tokens=num_tokens,
        num_preemptions=w.num_preemptions,
        num_cached_prompt_tokens=w.num_cached_tokens,
    )


async def build_engine(config: EngineConfig) -> Engine:
    """An Engine whose stages are started (awaits model loading)."""
    engine = Engine(config)
    await engine.start()
    return engine
