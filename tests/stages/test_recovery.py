"""Nothing lost: a stage killed under load costs the streams latency, never a token, and an engine
past its restart budget fails loudly. Real pipelines on the tiny random model."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import msgspec
import pytest

from pipeline.clock import now_ns
from pipeline.names import names_in_shm
from stages.api import EngineError, GenerateRequest, SamplingParams, TextPrompt
from stages.config import EngineConfig
from stages.engine import Engine

STAGES = ("render", "schedule", "execute", "detokenize")
PROMPTS = [f"Tell me about the number {i} and why it matters." for i in range(6)]


def config(model: str, **overrides) -> EngineConfig:
    values = {
        "model_path": model,
        "served_model_name": "tiny",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "kv_cache_bytes": 2 * 1024 * 1024,
        "threads": 1,
        "log_format": "json",
        "log_level": "error",
        "max_stage_restarts": 100,
    }
    values.update(overrides)
    return EngineConfig(**values)


def request(i: int, **sampling) -> GenerateRequest:
    sampling = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True, **sampling}
    return GenerateRequest(
        f"r{i}",
        TextPrompt(PROMPTS[i % len(PROMPTS)]),
        SamplingParams(**sampling),
        arrival_ns=now_ns(),
    )


async def run_all(engine: Engine, requests: list[GenerateRequest], on_token=None):
    """Each request's (token ids, text, final output)."""

    async def one(req):
        ids, text, last = [], "", None
        async for out in engine.generate(req):
            ids += out.token_ids
            text += out.text
            last = out
            if on_token is not None:
                await on_token(len(out.token_ids))
        return ids, text, last

    return await asyncio.gather(*(one(r) for r in requests))


def wait_recovered(engine: Engine, recoveries: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.num_recoveries < recoveries and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_recoveries == recoveries
    wait_ready(engine)


def wait_ready(engine: Engine, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.ready


@pytest.mark.slow
def test_chaos_streams_outlive_random_stage_kills_with_the_text_of_an_uninterrupted_run(pipeline):
    """Greedy and seeded streams, with a stop string and a character-level parser state in
    play; SIGKILL of random stages at random moments: every stream completes with exactly the
    tokens and text of a run with no failure, the KV cache ends empty, no old name is left."""
    engine, runner = pipeline()
    reqs = [request(i) for i in range(4)] + [
        request(4, temperature=1.0, seed=7),
        request(5, temperature=0.8, top_p=0.9, seed=11, stop=("zz",), ignore_eos=False),
    ]
    expected = runner.run(run_all(engine, reqs))
    rng = random.Random(0)
    kills: list[str] = []
    namespaces = {engine.supervisor.namespace}
    tokens_seen = 0
    next_kill_at = rng.randint(5, 40)

    async def maybe_kill(num_tokens: int):
        nonlocal tokens_seen, next_kill_at
        tokens_seen += num_tokens
        # One failure at a time: a kill before the last is noticed would share its recovery.
        recovered = engine.ready and engine.num_recoveries == len(kills)
        if tokens_seen >= next_kill_at and len(kills) < 3 and recovered:
            stage = rng.choice(STAGES)
            namespaces.add(engine.supervisor.namespace)
            os.kill(engine.supervisor.pids()[stage], signal.SIGKILL)
            kills.append(stage)
            next_kill_at = tokens_seen + rng.randint(20, 80)

    again = runner.run(run_all(engine, [r for r in reqs], maybe_kill), timeout=240)
    assert len(kills) == 3, kills
    wait_recovered(engine, 3)  # a kill at the last token is seen after the streams end
    for (ids, text, _), (ids_again, text_again, last) in zip(expected, again, strict=True):
        assert ids_again == ids
        assert text_again == text
        assert last.finish_reason is not None
    assert max(out[2].metrics.num_recoveries for out in again) >= 1
    deadline = time.monotonic() + 10  # schedule publishes its gauges after the last tokens
    while engine.stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]  # no KV block held by a lost request
    namespaces.discard(engine.supervisor.namespace)
    left = [n for n in names_in_shm() if any(ns in n for ns in namespaces)]
    assert left == []


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["render", "detokenize"])
def test_render_or_detokenize_killed_under_streams_restarts_alone_and_nothing_is_lost(
    pipeline, stage
):
    """Two rounds of streams, the stage SIGKILLed mid-stream in each: only it is restarted (the
    other stages keep their processes, and schedule its KV: every request still finds its prompt
    in the prefix cache of the run before), every stream ends with the tokens, text and logprobs
    of the run before, no request had to be resumed, no KV block is held and no name is left."""
    engine, runner = pipeline()
    reqs = [request(i, max_tokens=100) for i in range(4)] + [
        request(4, temperature=1.0, seed=7, logprobs=2, max_tokens=100),
        request(5, temperature=0.8, top_p=0.9, seed=11, stop=("zz",), ignore_eos=False),
    ]
    logprobs_seen: dict[str, list] = {}
    generate = engine.generate

    async def recording(req):  # each request's logprob entries, as its client reads them
        async for out in generate(req):
            logprobs_seen.setdefault(req.request_id, []).extend(out.logprobs or ())
            yield out

    engine.generate = recording  # type: ignore[method-assign]
    expected = runner.run(run_all(engine, reqs))
    logprobs_before = logprobs_seen.pop(reqs[4].request_id)
    assert len(logprobs_before) == 100
    before = engine.supervisor.pids()
    namespace = engine.supervisor.namespace
    kills: list[int] = []
    for round_ in range(2):
        tokens_seen = 0

        async def kill_once(num_tokens: int, round_: int = round_):
            nonlocal tokens_seen
            tokens_seen += num_tokens
            if len(kills) == round_ and tokens_seen >= 12:
                pid = engine.supervisor.pids()[stage]
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)

        again = runner.run(run_all(engine, reqs, kill_once), timeout=240)
        assert len(kills) == round_ + 1
        wait_recovered(engine, round_ + 1)  # render's restart may outlast the streams
        for (ids, text, last), (ids_again, text_again, last_again) in zip(
            expected, again, strict=True
        ):
            assert ids_again == ids
            assert text_again == text
            assert last_again.finish_reason == last.finish_reason
            assert last_again.metrics.num_recoveries == 0
            assert last_again.metrics.num_cached_prompt_tokens > 0
        assert rounded(logprobs_seen.pop(reqs[4].request_id)) == rounded(logprobs_before)
    after = engine.supervisor.pids()
    assert {s: p for s, p in after.items() if s != stage} == {
        s: p for s, p in before.items() if s != stage
    }
    assert after[stage] not in (before[stage], *kills)
    assert engine.supervisor.namespace == namespace  # the same pipeline, not a fresh one
    deadline = time.monotonic() + 10
    while engine.stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert names_in_shm(namespace) == []


@pytest.mark.slow
def test_an_execute_restart_maps_the_weights_the_first_execute_kept(pipeline):
    """The first execute writes its prepared model to a kept file (anonymous memory that the
    engine's supervisors hand on) and runs on the file's pages. Killed mid-stream, it is
    restarted with a fresh pipeline whose execute maps that same file instead of loading the
    checkpoint again, and the streams end with the text of an uninterrupted run."""
    engine, runner = pipeline()
    reqs = [request(i) for i in range(3)]
    expected = runner.run(run_all(engine, reqs))
    first = engine.supervisor.pids()["execute"]
    kept = kept_weights(first)
    assert len(kept) == 1
    killed = False

    async def kill_execute(num_tokens: int):
        nonlocal killed
        if not killed:
            os.kill(first, signal.SIGKILL)
            killed = True

    again = runner.run(run_all(engine, reqs, kill_execute), timeout=240)
    wait_recovered(engine, 1)
    second = engine.supervisor.pids()["execute"]
    assert second != first
    assert kept_weights(second) == kept  # the same file: its name is the first pipeline's
    assert [r[:2] for r in again] == [r[:2] for r in expected]
    assert max(r[2].metrics.num_recoveries for r in again) == 1


def kept_weights(pid: int) -> set[str]:
    """The kept weights files process `pid` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-2] for line in maps if ".execute.weights" in line}


def rounded(logprobs: list) -> list:
    """Logprob entries to 1e-3: a step's batch, which differs between runs, moves the last
    float32 bits of what it computes."""
    return [
        (lp.token_id, lp.token, round(lp.logprob, 3), [(t[0], round(t[3], 3)) for t in lp.top])
        for lp in logprobs
    ]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["render", "detokenize"])
def test_a_kill_before_any_output_resubmits_the_request_whole(pipeline, stage):
    engine, runner = pipeline()
    reference = runner.run(run_all(engine, [request(0, max_tokens=8)]))

    async def killed_at_once():
        os.kill(engine.supervisor.pids()[stage], signal.SIGKILL)
        return await run_all(engine, [request(0, max_tokens=8)])

    assert runner.run(killed_at_once(), timeout=120)[0][:2] == reference[0][:2]


def test_requests_arriving_during_a_restart_get_a_503_with_the_reason_and_retry_after(pipeline):
    engine, runner = pipeline(dummy=True)

    async def during_restart():
        os.kill(engine.supervisor.pids()["schedule"], signal.SIGKILL)
        while engine.ready:
            await asyncio.sleep(0.01)
        return await run_all(engine, [request(0)])

    with pytest.raises(EngineError) as info:
        runner.run(during_restart())
    assert info.value.status == 503
    assert "restarting after a stage failure" in info.value.message
    # The reason names the stage that died, or (when execute sees it first, on a loaded machine)
    # execute's report that schedule's output ring lost its producer.
    assert "schedule" in info.value.message or "ring 'plan'" in info.value.message
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    wait_ready(engine)
    assert runner.run(run_all(engine, [request(1, max_tokens=3)]))[0][2].num_output_tokens == 3


def test_past_the_restart_budget_the_engine_fails_in_flight_requests_and_goes_down(pipeline):
    engine, runner = pipeline(dummy=True, max_stage_restarts=1)
    namespace = engine.supervisor.namespace

    async def kill_twice():
        os.kill(engine.supervisor.pids()["execute"], signal.SIGKILL)
        while engine.ready:
            await asyncio.sleep(0.01)
        while not engine.ready:
            await asyncio.sleep(0.02)

        async def kill_detokenize(
            num_tokens: int,
        ):  # mid-stream: the second failure is past the budget
            if engine.ready:
                os.kill(engine.supervisor.pids()["detokenize"], signal.SIGKILL)

        try:
            await run_all(engine, [request(0, max_tokens=200)], kill_detokenize)
        except EngineError as error:
            await asyncio.wait_for(engine.down.wait(), 30)
            return error
        return None

    error = runner.run(kill_twice(), timeout=120)
    assert isinstance(error, EngineError) and error.status == 500
    assert "gave up after 2 stage failures" in error.message and "detokenize" in error.message
    assert engine.down.is_set() and not engine.ready
    assert "gave up" in engine.not_ready_error.message
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in engine.supervisor.pids().values()):
        assert time.monotonic() < deadline, "stages outlived the engine's decision to give up"
        time.sleep(0.05)
    assert not [n for n in names_in_shm() if namespace in n]


def pid_alive(pid: int) -> bool:
    from pipeline.names import pid_alive as alive

    return alive(pid)


def test_beyond_max_waiting_requests_a_429_with_retry_after_and_nothing_admitted_is_lost(pipeline):
    engine, runner = pipeline(dummy=True, max_num_seqs=2, max_waiting_requests=2)

    async def flood():
        outcomes = await asyncio.gather(
            *(run_all(engine, [request(i, max_tokens=200)]) for i in range(7)),
            return_exceptions=True,
        )
        return outcomes

    outcomes = runner.run(flood(), timeout=120)
    refused = [o for o in outcomes if isinstance(o, EngineError)]
    served = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(served) == 4 and len(refused) == 3
    for error in refused:
        assert error.status == 429 and error.type == "RateLimitError" and error.retry_after_s
    assert all(o[0][2].num_output_tokens == 200 for o in served)
    stats = engine.stats()
    assert stats["num_requests_rejected_total"] == 3
    assert stats["admission_rejections_total{reason=max_num_queued_reqs}"] == 3  # vLLM's name


@pytest.mark.slow
def test_a_request_that_crashes_a_stage_each_time_fails_alone(pipeline):
    """A priority past int32 (the server's schema refuses it) crashes render whenever it is
    rendered: after three failures in a row with no token between (the last with it in flight alone), it is failed and the others go
    on; the engine stays up."""
    engine, runner = pipeline(dummy=True)
    poison = msgspec.structs.replace(request(0, max_tokens=5), priority=2**40)

    async def together():
        return await asyncio.gather(
            run_all(engine, [request(1, max_tokens=300)]),
            run_all(engine, [poison]),
            return_exceptions=True,
        )

    normal, failed = runner.run(together(), timeout=120)
    assert isinstance(failed, EngineError) and failed.status == 500
    assert "3 stage failures in a row" in failed.message and "render" in failed.message
    assert normal[0][2].num_output_tokens == 300
    assert engine.ready and not engine.down.is_set()
