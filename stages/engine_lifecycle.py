"""The engine's lifecycle: starting the pipeline, stopping it, and bringing it back after a stage
fails. Render and detokenize hold no KV and are restarted alone (`_recover_alone`): what render
may have lost is submitted again, and detokenize's rows are written again by schedule, of which
the engine drops those it has read. Schedule and execute restart with a fresh pipeline
(`_recover`), and every request in flight is submitted again with the tokens its client already
has (`common.Resume`), so streams go on with nothing lost or repeated. Past the restart budget
the engine gives up: in-flight requests fail with the reason and `down` is set, so that the
server exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time

import structlog

from pipeline.errors import ActorFailed
from pipeline.ring import Producer
from stages.api import EngineError
from stages.engine_readers import EngineReaders
from stages.engine_state import Flight, check_kv_fits
from stages.kv_size import published_num_blocks
from stages.published import KERNELS, published
from stages.rings import common, requests

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
# Stages with no KV state, restarted alone; the others restart with the whole pipeline.
RESTART_ALONE = ("render", "detokenize")
# How long the reader of a dead stage's ring may take to read what the stage published.
DRAIN_TIMEOUT_S = 5.0


class EngineLifecycle(EngineReaders):
    """Start, stop and recovery; the client API is Engine's (stages/engine.py)."""

    async def start(self) -> None:
        """Start every stage (the loop keeps serving while models load), then the reader tasks."""
        await self._start_pipeline()
        if not self.num_blocks:
            blocks = published_num_blocks(self.config)
            if blocks is None:
                raise RuntimeError("execute started without publishing its KV block count")
            self.num_blocks = blocks
            try:
                check_kv_fits(blocks, self.config.block_size, self.max_model_len)
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
        self.template_sandbox.close()
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

    async def _send(self, producer: Producer, handle: int, flight: Flight) -> None:
        if flight.output_ids:
            flight.num_recoveries += 1
        request, resume = flight.resubmission()
        await producer.send_async(requests.SUBMIT, requests.pack_submit(handle, request, resume))
        flight.submitted = True

    def _blame(self, flight: Flight) -> None:
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


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
