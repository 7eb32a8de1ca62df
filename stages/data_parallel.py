"""`--data-parallel-size N`: N whole pipelines (engine replicas) behind one server, each request
routed to one of them by `stages/router.py`. It implements `stages.api.EngineClient`.

Each replica is an `Engine` of its own: its four stages, rings, KV cache and recovery. One that
fails restarts by itself while the others serve; the server is ready while any replica is, and
goes down only when every replica has given up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import structlog

from pipeline.errors import ActorFailed
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    ModelInfo,
    RenderedPromptInfo,
    RequestOutput,
    TextPrompt,
)
from stages.config import EngineConfig
from stages.engine import Engine
from stages.router import BYTES_PER_TOKEN, Policy, ReplicaLoad, Route, Router

log = structlog.get_logger("stages.data_parallel")


class DataParallelEngine:
    """Replicas of the engine, one per data-parallel rank, and the router in front of them."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.data_parallel_size
        # Without --threads, the replicas' model threads share the cores instead of each
        # taking all of them (CPU; a GPU replica's host threads matter little).
        threads = config.threads or max(1, (os.cpu_count() or 1) // size)
        first = Engine(dataclasses.replace(config, data_parallel_rank=0, threads=threads))
        # The others read the tokenizer from the first one's snapshot instead of the model file.
        self.replicas = [first] + [
            Engine(
                dataclasses.replace(
                    config,
                    data_parallel_rank=rank,
                    threads=threads,
                    # Each replica's tensor-parallel group has a rendezvous of its own.
                    master_port=config.master_port + rank if config.master_port else 0,
                    snapshot_dir=first.config.snapshot_dir,
                )
            )
            for rank in range(1, size)
        ]
        self.config = first.config
        self.router = Router(
            size,
            Policy(config.data_parallel_routing),
            chunk_bytes=config.block_size * BYTES_PER_TOKEN,
            capacity_chunks=first.num_blocks,
            # a quarter of a batch: a replica that far ahead of another takes no more for its cache
            balance_abs_threshold=max(1, config.max_num_seqs // 4),
            prefix_caching=config.enable_prefix_caching,
        )
        self._recoveries = [0] * size  # each replica's recoveries the router has seen
        # (request_id, id of the prompt) -> (replica, engine requests in flight): the n choices
        # of one request share its prompt object, so they go where the first went. The prompt's
        # id tells them from other requests a client sent under the same id; it is not reused
        # while an entry lives, as the requests in flight hold the prompt.
        self._pins: dict[tuple[str, int], tuple[int, int]] = {}
        self.down = asyncio.Event()  # set once every replica gave up: the server should exit
        self._watchers: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every replica side by side; if one cannot start, none is left running."""
        started = await asyncio.gather(
            *(_start_replica(rank, engine) for rank, engine in enumerate(self.replicas)),
            return_exceptions=True,
        )
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]
        loop = asyncio.get_running_loop()
        self._watchers = [loop.create_task(self._watch_down(e)) for e in self.replicas]
        log.info("replicas ready", data_parallel_size=len(self.replicas))

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*(engine.stop() for engine in self.replicas), return_exceptions=True)

    async def _watch_down(self, engine: Engine) -> None:
        await engine.down.wait()
        up = sum(not e.down.is_set() for e in self.replicas)
        log.error(
            "replica down",
            engine=engine.config.data_parallel_rank,
            reason=engine.down_reason,
            replicas_left=up,
        )
        if up == 0:
            self.down.set()

    @property
    def down_reason(self) -> str:
        return "; ".join(
            f"engine {rank}: {engine.down_reason}"
            for rank, engine in enumerate(self.replicas)
            if engine.down.is_set()
        )

    # -- EngineClient ----------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        info = self.replicas[0].model_info
        return dataclasses.replace(info, num_engines=len(self.replicas))

    @property
    def ready(self) -> bool:
        """While any replica serves, the server does: the others' requests wait out their restart."""
        return any(engine.ready for engine in self.replicas)

    @property
    def failure(self) -> ActorFailed | None:
        """A replica's stage failure while no replica serves; None while one does."""
        if self.ready:
            return None
        return next((e.failure for e in self.replicas if e.failure is not None), None)

    @property
    def last_output_ns(self) -> int:
        return max(engine.last_output_ns for engine in self.replicas)

    @property
    def not_ready_error(self) -> EngineError:
        """When no replica serves: the 503 of the one back soonest (down ones last)."""
        errors = [e.not_ready_error for e in self.replicas if not e.ready]
        return min(errors, key=lambda error: error.retry_after_s or float("inf"))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        # Routed at the first step, so that a 503 is raised where the engine's errors are.
        outputs = cast(
            AsyncGenerator[RequestOutput, None],
            self.replicas[self._choose(request)].generate(request),
        )
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # a client gone: the replica aborts the request now
            self._unpin((request.request_id, id(request.prompt)))

    def _choose(self, request: GenerateRequest) -> int:
        """The replica for this request (logged at debug with the reason), pinned while it runs;
        raises the 503 when none is ready."""
        pin = (request.request_id, id(request.prompt))
        pinned = self._pins.get(pin)
        # A beam search's choices meet in one scheduler (stages/beam_group.py): they never move;
        # a replica restarting then answers them its 503.
        beam = request.sampling.beam is not None
        if pinned is not None and (beam or self.replicas[pinned[0]].ready):
            replica = pinned[0]
            self._pins[pin] = (replica, pinned[1] + 1)
            log.debug(
                "routed", request_id=request.request_id, engine=replica, reason="same_request"
            )
            return replica
        route = self._route(request)
        # (a pinned replica that is restarting: this choice and the next go elsewhere)
        self._pins[pin] = (route.replica, (pinned[1] if pinned is not None else 0) + 1)
        log.debug(
            "routed",
            request_id=request.request_id,
            engine=route.replica,
            reason=route.reason,
            matched_bytes=route.matched_bytes,
            key_bytes=route.key_bytes,
        )
        return route.replica

    def _route(self, request: GenerateRequest) -> Route:
        for rank, engine in enumerate(self.replicas):
            if engine.num_recoveries != self._recoveries[rank]:  # a fresh pipeline: cache empty
                self._recoveries[rank] = engine.num_recoveries
                self.router.forget(rank)
        # The prefix caches key blocks by adapter as by salt (stages/scheduler.py), so does this.
        salt = request.cache_salt
        if request.lora is not None:
            salt = f"{salt or ''}\0lora {request.lora.lora_id}"
        key = self.router.key(request.prompt, salt)
        route = self.router.route(key, [_load(engine) for engine in self.replicas])
        if route is None:
            raise self.not_ready_error
        return route

    def _unpin(self, pin: tuple[str, int]) -> None:
        pinned = self._pins.get(pin)
        if pinned is None:
            return
        if pinned[1] <= 1:
            del self._pins[pin]
        else:
            self._pins[pin] = (pinned[0], pinned[1] - 1)

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(engine.abort(request_id) for engine in self.replicas))

    async def render(self, request: GenerateRequest) -> RenderedPromptInfo:
        """Rendering touches no KV cache: the least loaded ready replica does it."""
        ready = [e for e in self.replicas if e.ready]
        if not ready:
            raise self.not_ready_error
        return await min(ready, key=lambda e: e.num_in_flight).render(request)

    async def reset_prefix_cache(self) -> None:
        """Every replica that serves drops its cached prefixes; one that restarts comes back
        with none."""
        ready = [rank for rank, e in enumerate(self.replicas) if e.ready]
        if not ready:
            raise self.not_ready_error
        await asyncio.gather(*(self.replicas[rank].reset_prefix_cache() for rank in ready))
        for rank in range(len(self.replicas)):
            self.router.forget(rank)

    def check_lora(self, path: str) -> None:
        self.replicas[0].check_lora(path)  # every replica serves the same model and limits

    def tokenize(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return self.replicas[0].tokenize(prompt)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.replicas[0].detokenize(token_ids)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return self.replicas[0].token_strings(token_ids)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.replicas[0].tokenizer_info()

    def stats(self) -> Mapping[str, float]:
        """Each replica's figures under vLLM's `engine` label (`name{engine=1}`); summing over
        the label gives the server's."""
        stats: dict[str, float] = {}
        for rank, engine in enumerate(self.replicas):
            for key, value in engine.stats().items():
                name, brace, labels = key.partition("{")
                label = f"engine={rank}"
                stats[f"{name}{{{label},{labels}" if brace else f"{name}{{{label}}}"] = value
        return stats

    # -- profiling -------------------------------------------------------------------------------

    def read_traces(self) -> dict[str, np.ndarray]:
        """Each replica's stages' spans, named `<stage>.dp<rank>`."""
        return {
            f"{stage}.dp{rank}": spans
            for rank, engine in enumerate(self.replicas)
            for stage, spans in engine.read_traces().items()
        }

    def cpu_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for rank, engine in enumerate(self.replicas):
            for name, seconds in engine.cpu_seconds().items():
                out[name if name == "server" else f"{name}.dp{rank}"] = seconds
        return out


async def _start_replica(rank: int, engine: Engine) -> None:
    # Its own task's context: the replica's tasks (readers, watcher, recoveries) inherit it, so
    # that every line the replica logs in the server says which one it is.
    structlog.contextvars.bind_contextvars(engine=rank)
    await engine.start()


def _load(engine: Engine) -> ReplicaLoad:
    stats = engine.stats()
    in_flight = engine.num_in_flight
    return ReplicaLoad(
        ready=engine.ready,
        in_flight=in_flight,
        waiting=max(int(stats.get("num_requests_waiting", 0)), engine.num_waiting),
        # schedule publishes its gauges after its first step; before it, every block is free
        free_blocks=int(stats["num_free_blocks"] if stats.get("num_blocks") else engine.num_blocks),
        full=in_flight >= engine.max_in_flight,
    )


async def build_serving_engine(config: EngineConfig) -> Engine | DataParallelEngine:
    """The engine `pipeline-serve` runs: one pipeline, or --data-parallel-size of them."""
    engine: Engine | DataParallelEngine = (
        Engine(config) if config.data_parallel_size == 1 else DataParallelEngine(config)
    )
    await engine.start()
    return engine
