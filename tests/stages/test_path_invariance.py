"""A greedy request writes the same tokens, with the same logprobs to the bit, however its
tokens were computed: alone, in a batch beside other requests' prefill chunks and decodes, after
a prefix-cache hit, with its prompt cut into chunks at other places, and recomputed after
execute was killed under it. At every CPU kernel level this host runs, and with int4 weights
(the default model's) as with float32 ones."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gpu import native
from pipeline.clock import now_ns
from stages.api import GenerateRequest, SamplingParams, TextPrompt
from stages.config import EngineConfig
from stages.engine import Engine
from tests.cpu_levels import NATIVE_LEVELS
from tests.stages.conftest import LoopThread
from tests.stages.test_recovery import wait_recovered

pytestmark = pytest.mark.skipif(not NATIVE_LEVELS, reason="needs a C compiler")

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "tokens",
    "stream",
]
# Prompts of 40 to 70 tokens sharing a long prefix: the prefix cache serves part of the later ones
PROMPTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(20 + 5 * i)) for i in range(4)]
PROMPTS += [PROMPTS[3] + " and then some more words"]


def _request(i: int, name: str) -> GenerateRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    return GenerateRequest(f"{name}{i}", TextPrompt(PROMPTS[i]), sampling, arrival_ns=now_ns())


async def _run(engine: Engine, name: str, indices: list[int], on_token=None):
    """Each request's [(token id, logprob)], all sent at once."""

    async def one(i: int) -> list[tuple[int, float]]:
        got: list[tuple[int, float]] = []
        async for out in engine.generate(_request(i, name)):
            got += [(lp.token_id, lp.logprob) for lp in out.logprobs or ()]
            if on_token is not None:
                await on_token()
        return got

    return await asyncio.gather(*(one(i) for i in indices))


# The level the server picks runs in `make test-fast`; the lower ones, in `make test`
LEVELS = [
    pytest.param(level, marks=() if level == NATIVE_LEVELS[-1] else pytest.mark.slow)
    for level in NATIVE_LEVELS
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_greedy_tokens_and_logprobs_do_not_depend_on_the_path(level, quantization, tiny_chat_model):
    with native.using_level(level):
        _check_every_path(quantization, tiny_chat_model)


def _check_every_path(quantization: str, tiny_chat_model) -> None:
    runner = LoopThread()
    config = EngineConfig(
        model_path=tiny_chat_model,
        served_model_name="tiny",
        max_num_seqs=8,
        max_num_batched_tokens=24,  # prompts take 2-3 chunks alone, cut elsewhere in a batch
        kv_cache_bytes=2 * 1024 * 1024,
        quantization=quantization,
        threads=2,
        log_format="json",
        log_level="error",
    )
    engine = Engine(config)
    runner.run(engine.start())
    try:
        everything = list(range(len(PROMPTS)))
        alone = [runner.run(_run(engine, "alone", [i]))[0] for i in everything]
        assert engine.stats()["prefix_cache_hits_total"] > 0  # the shared prefix was reused
        runner.run(engine.reset_prefix_cache())
        assert runner.run(_run(engine, "batch", everything)) == alone
        assert runner.run(_run(engine, "cached", everything)) == alone
        killed = []

        async def kill_execute_once():
            if not killed and engine.ready:
                killed.append(os.kill(engine.supervisor.pids()["execute"], signal.SIGKILL))

        runner.run(engine.reset_prefix_cache())
        resumed = runner.run(_run(engine, "resumed", everything, kill_execute_once), 240)
        wait_recovered(engine, 1)
        assert resumed == alone
    finally:
        runner.run(engine.stop())
        runner.close()


def test_steps_planned_after_each_result_write_the_same_tokens(tiny_chat_model):
    """--no-async-scheduling (each step planned after the one before returned) changes when
    steps are planned, not what they compute."""
    results = []
    for async_scheduling in (True, False):
        runner = LoopThread()
        engine = Engine(
            EngineConfig(
                model_path=tiny_chat_model,
                served_model_name="tiny",
                max_num_seqs=8,
                max_num_batched_tokens=24,
                kv_cache_bytes=2 * 1024 * 1024,
                quantization="int4",
                threads=2,
                log_format="json",
                log_level="error",
                async_scheduling=async_scheduling,
            )
        )
        runner.run(engine.start())
        try:
            results.append(runner.run(_run(engine, "batch", list(range(len(PROMPTS))))))
        finally:
            runner.run(engine.stop())
            runner.close()
    assert results[0] == results[1]
