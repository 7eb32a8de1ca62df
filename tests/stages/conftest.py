"""A running engine on a tiny random model, shared by the engine tests (starting one takes seconds)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from stages.config import EngineConfig
from stages.engine import Engine
from tests.stages.tiny import build_tiny_chat_model


class LoopThread:
    """An event loop in a thread of its own, for tests that drive async code from sync tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    return str(build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat")))


@pytest.fixture(scope="module")
def engine_loop(tiny_chat_model):
    """(engine, loop thread): the pipeline of four processes on the tiny model."""
    runner = LoopThread()
    config = EngineConfig(
        model_path=tiny_chat_model,
        served_model_name="tiny",
        max_num_seqs=16,
        max_waiting_requests=64,  # the many-streams test queues 64 behind 16 running
        max_num_batched_tokens=64,
        kv_cache_bytes=64
        * 2
        * 2
        * 16
        * 2
        * 16
        * 4,  # 64 blocks of 16 tokens: preemption is reachable
        threads=1,
        log_format="json",
        log_level="warning",
    )
    engine = Engine(config)
    runner.run(engine.start())
    yield engine, runner
    runner.run(engine.stop())
    runner.close()


@pytest.fixture
def pipeline(tiny_chat_model):
    """Starts engines on the tiny model (tests/stages/test_recovery.py:config with the given
    overrides), each on a loop thread of its own; stops them after the test."""
    from tests.stages.test_recovery import config

    started: list[tuple[Engine, LoopThread]] = []

    def start(**overrides) -> tuple[Engine, LoopThread]:
        runner = LoopThread()
        engine = Engine(config(tiny_chat_model, **overrides))
        runner.run(engine.start())
        started.append((engine, runner))
        return engine, runner

    yield start
    for engine, runner in started:
        runner.run(engine.stop())
        runner.close()
