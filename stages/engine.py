"""The engine as the server process sees it: it supervises the four stages and speaks to them over
rings. It implements `stages.api.EngineClient`.

The server process owns three ring ends: it writes requests and aborts to render, and reads render's
errors and detokenize's deltas. One reader task per ring fans what arrives out to per-request
queues. A watcher turns a dead or hung stage into a recovery. Render and detokenize hold no KV and
are restarted alone (`_recover_alone`): what render may have lost is submitted again, and
detokenize's rows are written again by schedule, of which the engine drops those it has read.
Schedule and execute restart with a fresh pipeline (`_recover`), and every request in flight is
submitted again with the tokens its client already has (`common.Resume`), so streams go on with
nothing lost or repeated. Past the restart budget the engine gives up: in-flight requests fail with
the reason and `down` is set, so that the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import structlog

from pipeline.actor import ActorSpec
from pipeline.broadcast import BroadcastSpec
from pipeline.clock import now_ns, process_cpu_s
from pipeline.errors import ActorFailed, RuntimeFault
from pipeline.kept import KeptFile
from pipeline.ring import Producer, RingSpec
from pipeline.supervisor import Supervisor, SupervisorConfig
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    ModelInfo,
    RenderedPromptInfo,
    RequestOutput,
    TextPrompt,
    TokenLogprob,
)
from stages.config import (
    EngineConfig,
    num_kv_blocks,
    resolve_max_model_len,
    sized_from_device_memory,
)
from stages.draft_vocab import check_draft_vocabulary
from stages.kv_size import published_num_blocks
from stages.lora import LoraError, read_adapter
from stages.published import KERNELS, published
from stages.rings import common, deltas, forward, plan, prompts, requests, results, tokens
from stages.rings.gauges import GAUGES
from stages.text.checkpoint import (
    UnsupportedModelError,
    load_model_config,
    quantized_shard_problem,
)
from stages.text.prompts import prompt_token_ids
from stages.text.snapshot import tokenizer_of, write_snapshot

log = structlog.get_logger("stages.engine")

STOP_ORDER = ("render", "schedule", "execute", "detokenize")
# Retry-After of a 503 while the pipeline restarts, until a restart has been timed.
FIRST_RESTART_ESTIMATE_S = 10.0
# A request in flight at two failures of one stage in a row with no token between them is a
# suspect: it is resubmitted alone, one suspect at a time, each once the one before has made
# progress. A suspect whose resubmission alone is followed within PROBE_BLAME_WINDOW_S by a third
# failure of that stage caused them (a request that crashes a stage does so at once), and fails by
# itself instead of taking the engine down with it.
SUSPECT_AFTER_FAILURES = 2
BLAMED_AFTER_FAILURES = 3
PROBE_BLAME_WINDOW_S = 2.0
OVERLOAD_RETRY_AFTER_S = 1.0
# Stages with no KV state, restarted alone; the others restart with the whole pipeline.
RESTART_ALONE = ("render", "detokenize")
# How long the reader of a dead stage's ring may take to read what the stage published.
DRAIN_TIMEOUT_S = 5.0
# Aborts sent lately, sent again after a restart of render (which may have died holding them).
RECENT_ABORTS = 4096


def pipeline_layout(
    config: EngineConfig,
) -> tuple[list[RingSpec | BroadcastSpec], list[ActorSpec]]:
    """The rings and actors of docs/ARCHITECTURE.md's drawing ("Processes and rings")."""
    step_bytes = 256 * 1024 + 64 * config.max_num_seqs * 64  # block tables grow with context
    rings: list[RingSpec | BroadcastSpec] = [
        RingSpec("requests", requests.REQUESTS, n_slots=64, slot_bytes=64 * 1024),
        # Errors, and the answers to render-only requests (a prompt's ids and text: 64 KiB is
        # about 8k tokens in one slot; longer ones take several).
        RingSpec("errors", requests.ERRORS, n_slots=16, slot_bytes=64 * 1024),
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
    tp_rings, config, tp_ranks = _tensor_parallel_ranks(config, step_bytes)
    execute_out = ("results", "forward") if tp_rings else ("results",)
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
            "execute",
            execute_entry,
            config,
            ("plan",),
            execute_out,
            heartbeat_interval_s=0.5,
            kept_files=("weights",),  # the prepared model, mapped again after a restart
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
    return rings + tp_rings, actors + tp_ranks


def _tensor_parallel_ranks(
    config: EngineConfig, step_bytes: int
) -> tuple[list[BroadcastSpec], EngineConfig, list[ActorSpec]]:
    """With --tensor-parallel-size N > 1: the `forward` broadcast ring from rank 0 (execute) to
    the N - 1 others, rank 0's config (the stages share it) and the other ranks' actors, every
    config naming the group's rendezvous port and the rank's own number."""
    size = config.tensor_parallel_size
    if size == 1:
        return [], config, []
    if config.dummy:
        raise ValueError("--tensor-parallel-size needs a model; the dummy execute has none")
    config = dataclasses.replace(
        config, master_port=config.master_port or _free_port(config.master_addr)
    )
    ring = BroadcastSpec(
        "forward", forward.FORWARD_VOCAB, size - 1, n_chunks=4, chunk_bytes=_round(step_bytes)
    )
    ranks = [
        ActorSpec(
            f"execute.rank{rank}",
            "stages.actors.execute_rank:ExecuteRankActor",
            dataclasses.replace(config, tensor_parallel_rank=rank),
            ("forward",),
            heartbeat_interval_s=0.5,
        )
        for rank in range(1, size)
    ]
    return [ring], config, ranks


def _free_port(host: str) -> int:
    """A TCP port free now on host, for the group's rendezvous (a fresh one at each start, so a
    restarted group never meets its predecessor's sockets)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _round(n: int) -> int:
    return (n + 4095) // 4096 * 4096


@dataclass(slots=True)
class _Flight:
    """A request in flight, as much as it takes to submit it again after a stage failure."""

    request: GenerateRequest
    queue: asyncio.Queue[RequestOutput | EngineError]
    output_ids: list[int] = field(default_factory=list)  # the output tokens read so far
    first_token_ns: int = 0  # when the first of them was read
    num_recoveries: int = 0
    failures_without_progress: int = 0  # failures of one stage it was in since its last token
    failed_stage: str = ""  # the stage those failures were of
    probe_sent_s: float = 0.0  # monotonic time it was last resubmitted alone, as a suspect
    unread: int = 0  # what its queue holds that the client has not read, in _unread_cost units
    submitted: bool = False  # sent to the current pipeline (or to be sent by a recovery)
    suspect: bool = False  # held back until the suspects before it have made progress

    def resubmission(self) -> tuple[GenerateRequest, common.Resume | None]:
        """What to submit to a fresh pipeline: the request again if its client has nothing yet,
        else the request without what its first output carried (prompt logprobs) and a Resume."""
        if not self.output_ids:
            return self.request, None
        request = self.request
        if request.sampling.prompt_logprobs is not None:
            sampling = msgspec.structs.replace(request.sampling, prompt_logprobs=None)
            request = msgspec.structs.replace(request, sampling=sampling)
        return request, common.Resume(
            tuple(self.output_ids), self.first_token_ns, self.num_recoveries
        )


class Engine:
    """Supervises the pipeline and serves requests through it."""

    def __init__(self, config: EngineConfig) -> None:
        model_config = load_model_config(config.model_path)
        if config.tensor_parallel_size > 1 and config.quantization is not None:
            problem = quantized_shard_problem(model_config, config.tensor_parallel_size)
            if problem:  # refused before any stage starts, as a head split no rank count fits
                raise UnsupportedModelError(f"{problem}: add --quantization none")
        self.bundle = tokenizer_of(config)  # --tokenizer and --chat-template applied
        self.max_model_len = resolve_max_model_len(config)
        # Sized from device memory, the count is known once execute has published it (start).
        self.num_blocks = 0 if sized_from_device_memory(config) else num_kv_blocks(config)
        if self.num_blocks:
            _check_kv_fits(self.num_blocks, config.block_size, self.max_model_len)
        if config.speculative is not None and config.speculative.model is not None:
            check_draft_vocabulary(config.speculative.model, self.bundle, model_config)
        # The stages read the tokenizer and model config from this snapshot (removed at stop).
        self._snapshot_dir = tempfile.mkdtemp(prefix="pipeline-serve-")
        self._model_config = model_config
        write_snapshot(self._snapshot_dir, self.bundle, model_config)
        config = dataclasses.replace(config, snapshot_dir=self._snapshot_dir)
        self.config = config
        self._info = ModelInfo(
            served_model_name=config.served_model_name or config.model_path,
            model_path=config.model_path,
            max_model_len=self.max_model_len,
            vocab_size=self.bundle.vocab_size,
            created=int(time.time()),
        )
        waiting = config.max_waiting_requests
        self.max_waiting = config.max_num_seqs if waiting is None else waiting
        self.max_in_flight = config.max_num_seqs + self.max_waiting
        self.supervisor = self._new_supervisor()
        self._failures: list[float] = []  # monotonic times of recent stage failures
        self._restarting: asyncio.Task[None] | None = None
        self._handles = itertools.count(1)
        self._flights: dict[int, _Flight] = {}
        self._renders: dict[int, asyncio.Future[RenderedPromptInfo]] = {}  # render-only requests
        self._num_resets = 0  # prefix-cache resets sent (each carries its number, for the logs)
        self._send_lock = asyncio.Lock()
        self._probe_wake = asyncio.Event()  # a suspect made progress or left
        self._aborts: asyncio.Queue[int] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.num_aborted_unread = 0  # requests aborted because their client stopped reading
        self._ready = False
        self._failure: ActorFailed | None = None
        self.last_output_ns = 0
        """time.monotonic_ns() when deltas last came from detokenize: the sign a watchdog reads
        that the pipeline makes progress (server/systemd.py)."""
        self._failed_at_s = 0.0  # monotonic time of the last stage failure
        self._restart_s: float | None = None  # how long the last recovery took
        self.num_recoveries = 0  # pipelines brought back, each with its requests resumed
        self.num_rejected = 0  # requests refused with 429 because too many were waiting
        self.down = asyncio.Event()  # set when the engine gave up: the server should exit
        self.down_reason = ""
        self._num_tokens_read = 0  # output tokens read from deltas, ever (progress, for recovery)
        # The last stage restarted alone, and _num_tokens_read when it was back: the same stage
        # failing again with no token since restarts the whole pipeline, whose resubmissions
        # find a request that kills the stage (SUSPECT_AFTER_FAILURES).
        self._alone: tuple[str, int] | None = None
        self._recent_aborts: deque[int] = deque(maxlen=RECENT_ABORTS)

    # -- lifecycle -------------------------------------------------------------------------------

    def _new_supervisor(self, kept: dict[str, dict[str, KeptFile]] | None = None) -> Supervisor:
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
                # ps shows "pipeline-serve: render" ("pipeline-serve dp1: render" for replica 1)
                process_title_prefix=_process_title(config),
                log_fields=_replica_fields(config),
            ),
            owner_inboxes=("errors", "deltas"),
            owner_outboxes=("requests",),
            kept=kept,  # execute's prepared weights, kept across restarts
        )

    async def start(self) -> None:
        """Start every stage (the loop keeps serving while models load), then the reader tasks."""
        await self._start_pipeline()
        if not self.num_blocks:
            blocks = published_num_blocks(self.config)
            if blocks is None:
                raise RuntimeError("execute started without publishing its KV block count")
            self.num_blocks = blocks
            try:
                _check_kv_fits(blocks, self.config.block_size, self.max_model_len)
            except ValueError:
                await self._stop_pipeline()
                raise
        self._info = dataclasses.replace(self._info, kernels=published(self.config, KERNELS))
        self._ready = True
        log.info(
            "engine ready",
            model=self._info.served_model_name,
            max_model_len=self.max_model_len,
            kv_blocks=self.num_blocks,
            kernels=self._info.kernels,
        )

    async def _start_pipeline(self) -> None:
        await self.supervisor.start_async()
        self._start_tasks()

    def _start_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_deltas()),
            loop.create_task(self._read_errors()),
            loop.create_task(self._send_aborts()),
            loop.create_task(self._probe_suspects()),
            loop.create_task(self.supervisor.watch(self._on_failure)),
        ]

    async def stop(self) -> None:
        self._ready = False
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restarting
        await self._stop_pipeline()
        shutil.rmtree(self._snapshot_dir, ignore_errors=True)

    async def _stop_pipeline(self) -> None:
        await self._stop_tasks()
        await asyncio.to_thread(self.supervisor.stop, STOP_ORDER)

    async def _stop_tasks(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for task in self._tasks:
            if task is not current:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._tasks = []

    def _on_failure(self, failure: ActorFailed) -> None:
        """A stage died or hung: restart it alone (render, detokenize) or with a fresh pipeline
        (schedule, execute), and resume every request in flight.

        The server stays up throughout (503 with Retry-After until the new stages are ready).
        More than config.max_stage_restarts failures within config.stage_restart_window_s, a
        failed restart included, and the engine gives up.
        """
        self._ready = False
        self._failure = failure
        self._failed_at_s = time.monotonic()
        # Render-only requests are not resumed: they fail with the 503 a client may retry.
        for future in self._renders.values():
            if not future.done():
                future.set_exception(self.not_ready_error)
        self._renders.clear()
        if self._over_budget():
            self._give_up(failure)
            return
        alone = failure.actor in RESTART_ALONE and self._alone != (
            failure.actor,
            self._num_tokens_read,
        )
        recovery = self._recover_alone(failure) if alone else self._recover(failure)
        self._restarting = asyncio.get_running_loop().create_task(recovery)

    def _over_budget(self) -> bool:
        now = time.monotonic()
        window = self.config.stage_restart_window_s
        self._failures = [t for t in self._failures if now - t < window] + [now]
        return len(self._failures) > self.config.max_stage_restarts

    async def _recover_alone(self, failure: ActorFailed) -> None:
        """Restart only the stage that failed, render or detokenize, while schedule and execute
        keep their KV. First read what it published (its reader ends once the ring is empty).
        After render, every request with no output yet is submitted again (schedule drops those
        it has), and the recent aborts and prefix-cache reset too; after detokenize, schedule
        replays, and `_read_deltas` drops the rows already read. Should that fail, the whole
        pipeline restarts."""
        started = time.monotonic()
        stage = failure.actor
        log.warning(
            "restarting a stage alone",
            failed=stage,
            reason=failure.reason,
            in_flight=len(self._flights),
        )
        try:
            self.supervisor.kill(stage)  # a hung one: its rings end only once it is gone
            reader = self._tasks[0] if stage == "detokenize" else self._tasks[1]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), DRAIN_TIMEOUT_S)
            await self._stop_tasks()
            await self.supervisor.restart_async(stage)
            self._start_tasks()
            if stage == "render":
                await self._resubmit(unanswered_only=True)
                await self._send_again_what_render_held()
        except Exception as exc:
            log.error("the stage did not come back alone", failed=stage, error=str(exc))
            failure = exc if isinstance(exc, ActorFailed) else ActorFailed(stage, str(exc))
            self._failure, self._failed_at_s = failure, time.monotonic()
            if self._over_budget():
                await self._stop_pipeline()
                self._give_up(failure)
                return
            await self._recover(failure)
            return
        self._alone = (stage, self._num_tokens_read)
        self._recovered(failure, time.monotonic() - started)

    async def _send_again_what_render_held(self) -> None:
        producer = self.supervisor.producers["requests"]
        async with self._send_lock:
            if self._recent_aborts:
                aborts = common.pack_abort(list(self._recent_aborts))
                await producer.send_async(common.ABORT, aborts)
            if self._num_resets:
                reset = common.pack_reset_prefix_cache(self._num_resets)
                await producer.send_async(common.RESET_PREFIX_CACHE, reset)

    async def _recover(self, failure: ActorFailed) -> None:
        started = time.monotonic()
        while True:
            log.warning(
                "restarting the pipeline",
                failed=failure.actor,
                reason=failure.reason,
                in_flight=len(self._flights),
            )
            kept = self.supervisor.take_kept()
            await self._stop_pipeline()
            self.supervisor = self._new_supervisor(kept)
            try:
                await self._start_pipeline()
                await self._resubmit()
                break
            except Exception as exc:
                log.error("the pipeline did not come back", error=str(exc))
                failure = exc if isinstance(exc, ActorFailed) else ActorFailed("engine", str(exc))
                self._failure, self._failed_at_s = failure, time.monotonic()
                if self._over_budget():
                    await self._stop_pipeline()
                    self._give_up(failure)
                    return
        self._alone = None
        self._recovered(failure, time.monotonic() - started)

    def _recovered(self, failure: ActorFailed, elapsed: float) -> None:
        self._restart_s = elapsed
        self.num_recoveries += 1
        self._failure = None
        self._ready = True
        log.info(
            "pipeline recovered",
            failed=failure.actor,
            recovery_s=round(elapsed, 3),
            resumed=len(self._flights),
        )

    async def _resubmit(self, unanswered_only: bool = False) -> None:
        """Every request in flight (`unanswered_only`: those with no output yet, which render
        may have held), to the fresh stages, in the order they arrived; suspects (see
        SUSPECT_AFTER_FAILURES) are left to _probe_suspects."""
        producer = self.supervisor.producers["requests"]
        async with self._send_lock:
            stage = self._failure.actor if self._failure is not None else ""
            for handle, flight in sorted(self._flights.items()):
                if unanswered_only and flight.output_ids:
                    continue
                if flight.submitted:  # held-back suspects were in flight at none of the failures
                    same = flight.failed_stage in ("", stage)
                    flight.failures_without_progress = (
                        flight.failures_without_progress + 1 if same else 1
                    )
                    flight.failed_stage = stage
                if flight.failures_without_progress >= BLAMED_AFTER_FAILURES:
                    if self._failed_at_s - flight.probe_sent_s < PROBE_BLAME_WINDOW_S:
                        self._blame(flight)
                        continue
                    flight.failures_without_progress = SUSPECT_AFTER_FAILURES  # not at once
                if flight.failures_without_progress >= SUSPECT_AFTER_FAILURES:
                    flight.suspect, flight.submitted = True, False
                    continue
                await self._send(producer, handle, flight)
        self._probe_wake.set()

    async def _send(self, producer: Producer, handle: int, flight: _Flight) -> None:
        if flight.output_ids:
            flight.num_recoveries += 1
        request, resume = flight.resubmission()
        await producer.send_async(requests.SUBMIT, requests.pack_submit(handle, request, resume))
        flight.submitted = True

    def _blame(self, flight: _Flight) -> None:
        log.error(
            "a request failed the stages alone; not resubmitting it",
            request_id=flight.request.request_id,
            failures=flight.failures_without_progress,
        )
        flight.queue.put_nowait(
            EngineError(
                f"the request was in flight at {flight.failures_without_progress} stage failures "
                f"in a row with no output between them, the last alone: {self._failure}",
                500,
                "InternalServerError",
            )
        )

    async def _probe_suspects(self) -> None:
        """Sends the held-back suspects one at a time, the next once the last has a token or is
        gone: if one of them brings a stage down again, it is the only one in question."""
        producer = self.supervisor.producers["requests"]
        probe_handle = 0
        while True:
            await self._probe_wake.wait()
            self._probe_wake.clear()
            probe = self._flights.get(probe_handle)
            if probe is not None and probe.failures_without_progress:
                continue  # the last one sent has not shown it is harmless yet
            suspects = [h for h, f in sorted(self._flights.items()) if f.suspect]
            if suspects:
                probe_handle = suspects[0]
                probe = self._flights[probe_handle]
                probe.suspect = False
                async with self._send_lock:
                    await self._send(producer, probe_handle, probe)
                probe.probe_sent_s = time.monotonic()

    def _give_up(self, failure: ActorFailed) -> None:
        window = self.config.stage_restart_window_s
        self.down_reason = (
            f"the engine gave up after {_plural(len(self._failures), 'stage failure')} within "
            f"{window:g} s; the last: {failure}"
        )
        log.error("engine down", reason=self.down_reason, failed_requests=len(self._flights))
        error = EngineError(self.down_reason, status=500, type="InternalServerError")
        for flight in self._flights.values():
            flight.queue.put_nowait(error)
        self.down.set()
        # No stage outlives the decision: stop what is left of the pipeline now.
        self._restarting = asyncio.get_running_loop().create_task(self._stop_pipeline())

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

    @property
    def not_ready_error(self) -> EngineError:
        """Why the engine takes no requests now, as the 503 to answer with."""
        if self.down.is_set():
            return EngineError(self.down_reason, 503, "ServiceUnavailableError")
        if self._failure is not None:
            return EngineError(
                f"the engine is restarting after a stage failure: {self._failure}",
                503,
                "ServiceUnavailableError",
                retry_after_s=self._restart_s or FIRST_RESTART_ESTIMATE_S,
            )
        return EngineError(
            "the engine is not ready yet",
            503,
            "ServiceUnavailableError",
            retry_after_s=FIRST_RESTART_ESTIMATE_S,
        )

    @property
    def num_in_flight(self) -> int:
        """Requests sent and not yet finished or aborted."""
        return len(self._flights)

    @property
    def num_waiting(self) -> int:
        """Requests in flight beyond what the scheduler can run at once."""
        return max(0, len(self._flights) - self.config.max_num_seqs)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self._ready:
            raise self.not_ready_error
        if len(self._flights) >= self.max_in_flight:
            self.num_rejected += 1
            raise EngineError(
                f"the server is overloaded: {self.num_waiting} requests are already waiting "
                f"(--max-waiting-requests {self.max_waiting}); retry later",
                429,
                "RateLimitError",
                retry_after_s=OVERLOAD_RETRY_AFTER_S,
            )
        handle = next(self._handles)
        queue: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        flight = _Flight(request, queue)
        self._flights[handle] = flight
        finished = False
        try:
            arrays = requests.pack_submit(handle, request)
            async with self._send_lock:
                if not flight.submitted:  # a recovery may have sent it already
                    flight.submitted = True
                    # A pipeline that fails now leaves the request to the recovery's resubmission.
                    with contextlib.suppress(RuntimeFault):
                        await self.supervisor.producers["requests"].send_async(
                            requests.SUBMIT, arrays
                        )
            while True:
                item = await queue.get()
                flight.unread -= _unread_cost(item)
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
                    flight.unread -= _unread_cost(following)
                    item = _merge(item, following)
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if self._flights.pop(handle, None) is flight and flight.failures_without_progress:
                self._probe_wake.set()
            if not finished:
                self._aborts.put_nowait(handle)

    async def abort(self, request_id: str) -> None:
        for handle, flight in list(self._flights.items()):
            if flight.request.request_id == request_id:
                del self._flights[handle]
                self._aborts.put_nowait(handle)
                self._probe_wake.set()
                flight.queue.put_nowait(EngineError("aborted", status=499, type="Aborted"))

    async def render(self, request: GenerateRequest) -> RenderedPromptInfo:
        """Render runs the request through the path a generation takes (template, truncation,
        length checks, grammar) and answers on `errors` instead of sending it to schedule."""
        if not self._ready:
            raise self.not_ready_error
        handle = next(self._handles)
        future: asyncio.Future[RenderedPromptInfo] = asyncio.get_running_loop().create_future()
        self._renders[handle] = future
        try:
            async with self._send_lock:
                await self.supervisor.producers["requests"].send_async(
                    requests.RENDER, requests.pack_render(handle, request)
                )
            return await future
        except RuntimeFault:
            raise self.not_ready_error from None
        finally:
            self._renders.pop(handle, None)

    async def reset_prefix_cache(self) -> None:
        """Sent in order with the requests: schedule drops the cached prefixes before it sees any
        request sent after this returns. A pipeline that fails meanwhile starts with an empty
        cache, which is as good."""
        if not self._ready:
            raise self.not_ready_error
        self._num_resets += 1
        with contextlib.suppress(RuntimeFault):
            async with self._send_lock:
                await self.supervisor.producers["requests"].send_async(
                    common.RESET_PREFIX_CACHE, common.pack_reset_prefix_cache(self._num_resets)
                )

    def check_lora(self, path: str) -> None:
        if self.config.lora is None:
            raise EngineError("LoRA is not enabled: start the server with --enable-lora")
        try:
            read_adapter(path, self._model_config, self.config.lora.max_lora_rank)
        except LoraError as error:
            raise EngineError(
                str(error),
                status=404 if error.not_found else 400,
                type="NotFoundError" if error.not_found else "BadRequestError",
            ) from error

    def tokenize(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return prompt_token_ids(
            self.bundle, prompt, content_format=self.config.chat_template_content_format
        )

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self._check_vocabulary(token_ids)
        return self.bundle.decode(list(token_ids))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        self._check_vocabulary(token_ids)
        return self.bundle.token_strings(list(token_ids))

    def tokenizer_info(self) -> dict[str, Any]:
        return self.bundle.info(self.model_info.max_model_len)

    def _check_vocabulary(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.bundle.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is out of vocabulary", param="tokens")

    def stats(self) -> Mapping[str, float]:
        values = self.supervisor.gauges("schedule")
        stats = dict(zip(GAUGES, values, strict=False))
        spec = self.config.speculative
        if spec is not None:  # schedule publishes them after GAUGES, one per draft position
            per_pos = values[len(GAUGES) : len(GAUGES) + spec.num_speculative_tokens]
            for position, value in enumerate(per_pos):
                stats[f"spec_decode_num_accepted_tokens_per_pos_total{{position={position}}}"] = (
                    value
                )
        stats["num_streams"] = len(self._flights)
        stats["num_requests_rejected_total"] = self.num_rejected  # 429: too many waiting
        # aborted because their client left more than --max-unread-tokens unread
        stats["num_requests_aborted_unread_total"] = self.num_aborted_unread
        stats["num_stage_recoveries_total"] = self.num_recoveries
        if self._info.kernels is not None:  # an info gauge: which kernels run the model
            stats[f"kernels_info{{kernels={self._info.kernels}}}"] = 1.0
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
        with contextlib.suppress(RuntimeFault):
            while True:
                with await consumer.recv_async() as message:
                    batch = deltas.unpack_deltas(message)
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
                    output = _output(flight.request.request_id, batch, row)
                    flight.queue.put_nowait(output)
                    flight.unread += _unread_cost(output)
                    if flight.unread > self.config.max_unread_tokens:
                        self._abort_unread(handle, flight)

    def _abort_unread(self, handle: int, flight: _Flight) -> None:
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


def _process_title(config: EngineConfig) -> str:
    if config.data_parallel_size == 1:
        return "pipeline-serve"
    return f"pipeline-serve dp{config.data_parallel_rank}"


def _replica_fields(config: EngineConfig) -> tuple[tuple[str, str], ...]:
    """What tells one data-parallel replica's stage logs from another's (vLLM's `engine`)."""
    if config.data_parallel_size == 1:
        return ()
    return (("engine", str(config.data_parallel_rank)),)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _output(request_id: str, batch: deltas.DeltaBatch, row: int) -> RequestOutput:
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
    )


def _prompt_logprobs(
    rows: tuple[TokenLogprob, ...],
) -> tuple[tuple[int, ...] | None, tuple[TokenLogprob | None, ...]]:
    """(the prompt's token ids, its logprobs with None for the first token) from the rows
    detokenize gathered; a first row of rank 0 is position 0, which has no logprob."""
    if rows and rows[0].rank == 0:
        return tuple(r.token_id for r in rows), (None, *rows[1:])
    return None, (None, *rows)


def _unread_cost(item: RequestOutput | EngineError) -> int:
    """What an output holds, in tokens, each of their top logprobs counted as one more (its
    prompt logprobs, which come once and are bounded by the prompt, are not counted)."""
    if isinstance(item, EngineError):
        return 0
    return len(item.token_ids) + sum(len(lp.top) for lp in item.logprobs or ())


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
        num_reasoning_tokens=second.num_reasoning_tokens,
    )


def _check_kv_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens, less than one request of "
            f"max_model_len={max_model_len}: raise --kv-cache-memory or "
            f"--gpu-memory-utilization, or lower --max-model-len"
        )


async def build_engine(config: EngineConfig) -> Engine:
    """An Engine whose stages are started (awaits model loading)."""
    engine = Engine(config)
    await engine.start()
    return engine
