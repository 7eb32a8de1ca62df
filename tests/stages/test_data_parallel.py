"""Data-parallel replicas behind one engine client: both serve, a shared prefix finds its cache,
other prompts spread by load, a killed replica's stage fails none of the other's requests, and
/metrics names each replica. Real pipelines on the dummy and the tiny random model."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import msgspec
import pytest

from pipeline.clock import now_ns
from pipeline.names import names_in_shm
from server.metrics import ServerMetrics
from stages.api import BeamSearchParams, GenerateRequest, SamplingParams, TextPrompt
from stages.config import EngineConfig
from stages.data_parallel import DataParallelEngine
from stages.router import Route
from tests.stages.conftest import LoopThread

# Replicas start a pipeline each: `make test` runs them, `make test-fast` not
pytestmark = pytest.mark.slow

# 700 bytes in common, about 44 blocks of 16 tokens: worth routing to where it is cached
SHARED = "The following is a report on the migration of arctic terns across the oceans. " * 9


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
        "data_parallel_size": 2,
    }
    values.update(overrides)
    return EngineConfig(**values)


def request(request_id: str, prompt: str, **sampling) -> GenerateRequest:
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **sampling}
    return GenerateRequest(
        request_id, TextPrompt(prompt), SamplingParams(**sampling), arrival_ns=now_ns()
    )


async def run(engine: DataParallelEngine, req: GenerateRequest, on_token=None):
    """(token ids, final output) of one request."""
    ids, last = [], None
    async for out in engine.generate(req):
        ids += out.token_ids
        last = out
        if on_token is not None:
            await on_token()
    return ids, last


async def run_all(engine: DataParallelEngine, reqs: list[GenerateRequest]):
    return await asyncio.gather(*(run(engine, r) for r in reqs))


@pytest.fixture
def replicas(tiny_chat_model):
    """Starts a DataParallelEngine of the given config on a loop thread; stops it after."""
    started: list[tuple[DataParallelEngine, LoopThread]] = []

    def start(**overrides) -> tuple[DataParallelEngine, LoopThread]:
        runner = LoopThread()
        engine = DataParallelEngine(config(tiny_chat_model, **overrides))
        runner.run(engine.start())
        started.append((engine, runner))
        return engine, runner

    yield start
    for engine, runner in started:
        namespaces = [replica.supervisor.namespace for replica in engine.replicas]
        runner.run(engine.stop())
        runner.close()
        assert [n for n in names_in_shm() if any(ns in n for ns in namespaces)] == []


def in_flight(engine: DataParallelEngine) -> list[int]:
    return [replica.num_in_flight for replica in engine.replicas]


def test_both_replicas_serve_and_spread_distinct_prompts(replicas):
    engine, runner = replicas(dummy=True)

    async def four_at_once():
        counts: list[list[int]] = []

        async def one(i: int):
            async def seen():
                counts.append(in_flight(engine))

            return await run(engine, request(f"r{i}", f"Question {i}: why?", max_tokens=64), seen)

        results = await asyncio.gather(*(one(i) for i in range(4)))
        return results, counts

    results, counts = runner.run(four_at_once())
    assert all(last.num_output_tokens == 64 for _, last in results)
    assert [2, 2] in counts  # all four running, two on each
    served = [
        value
        for key, value in engine.stats().items()
        if key.startswith("prefix_cache_queries_total{")
    ]
    assert len(served) == 2 and all(value > 0 for value in served)


@pytest.mark.parametrize(("routing", "cached"), [("cache_aware", True), ("round_robin", False)])
def test_a_prompt_sharing_a_long_prefix_finds_it_cached_where_the_first_went(
    replicas, routing, cached
):
    engine, runner = replicas(dummy=True, data_parallel_routing=routing)
    first = runner.run(run(engine, request("a", SHARED + "First question: how far?")))[1]
    assert first.metrics.num_cached_prompt_tokens == 0
    second = runner.run(run(engine, request("b", SHARED + "Second question: how fast?")))[1]
    assert (second.metrics.num_cached_prompt_tokens > 100) is cached


def test_the_choices_of_one_request_go_to_one_replica(replicas):
    engine, runner = replicas(dummy=True)

    async def three_choices():
        counts: list[list[int]] = []

        async def seen():
            counts.append(in_flight(engine))

        # as the server fans out n = 3: one prompt, a seed per choice
        first = request("n3", "Tell a story", max_tokens=32, temperature=1.0, seed=1)
        choices = [
            msgspec.structs.replace(first, sampling=msgspec.structs.replace(first.sampling, seed=s))
            for s in (1, 2, 3)
        ]
        # another request under the same id (a client's own) is routed on its own
        other = request("n3", "Something else entirely", max_tokens=32)
        await asyncio.gather(*(run(engine, r, seen) for r in [*choices, other]))
        return counts

    counts = runner.run(three_choices())
    assert [3, 1] in counts or [1, 3] in counts
    assert engine._pins == {}


def test_per_replica_metrics_carry_the_engine_label_and_sum_to_the_server(replicas):
    engine, runner = replicas(dummy=True)
    runner.run(run_all(engine, [request("a", "Hello"), request("b", "Hi")]))
    text = ServerMetrics(engine.stats, "tiny").render().decode()
    blocks = engine.replicas[0].num_blocks
    for rank in (0, 1):
        assert f'vllm:num_requests_running{{engine="{rank}",model_name="tiny"}}' in text
        assert f'vllm:num_blocks{{engine="{rank}",model_name="tiny"}} {float(blocks)}' in text
    # no unlabelled duplicate: a sum over every series counts each replica once
    assert 'vllm:num_requests_running{model_name="tiny"}' not in text


def test_a_killed_replica_fails_none_of_the_others_requests(replicas):
    """SIGKILL of replica 1's execute mid-stream: replica 0's streams never notice, the server
    stays ready and sends new requests to replica 0 meanwhile, and replica 1's streams resume
    with the tokens of an uninterrupted run."""
    engine, runner = replicas()
    prompts = [f"Tell me about the number {i} and why it matters." for i in range(4)]
    reqs = [request(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
    expected = runner.run(run_all(engine, reqs), timeout=240)
    victim = engine.replicas[1]
    ready_throughout: list[bool] = []
    killed = asyncio.Event()

    async def go():
        streaming: set[str] = set()  # killed once every stream has output (so each resumes)

        def watch(request_id: str):
            async def on_token():
                ready_throughout.append(engine.ready)
                streaming.add(request_id)
                if not killed.is_set() and len(streaming) == 4:
                    killed.set()
                    os.kill(victim.supervisor.pids()["execute"], signal.SIGKILL)

            return on_token

        streams = [asyncio.ensure_future(run(engine, r, watch(r.request_id))) for r in reqs]
        await killed.wait()
        while victim.ready:
            await asyncio.sleep(0.01)
        during = await run(engine, request("during", "A question while one replica restarts."))
        return await asyncio.gather(*streams), during

    again, during = runner.run(go(), timeout=240)
    assert killed.is_set() and all(ready_throughout)
    assert during[1].num_output_tokens == 8 and during[1].metrics.num_recoveries == 0
    recoveries = sorted(last.metrics.num_recoveries for _, last in again)
    assert recoveries == [0, 0, 1, 1]  # two requests were on each replica
    for (ids, _), (ids_again, _) in zip(expected, again, strict=True):
        assert ids_again == ids
    deadline = time.monotonic() + 60
    while not victim.ready:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert victim.num_recoveries == 1 and engine.replicas[0].num_recoveries == 0


def test_the_server_is_down_only_once_every_replica_gave_up(replicas):
    engine, runner = replicas(dummy=True, max_stage_restarts=0)

    async def kill(rank: int):
        os.kill(engine.replicas[rank].supervisor.pids()["schedule"], signal.SIGKILL)
        await asyncio.wait_for(engine.replicas[rank].down.wait(), 30)

    runner.run(kill(0))
    assert engine.ready and not engine.down.is_set()
    assert runner.run(run(engine, request("a", "Still there?")))[1].num_output_tokens == 8
    runner.run(kill(1))
    runner.run(asyncio.wait_for(engine.down.wait(), 10))
    assert not engine.ready
    error = engine.not_ready_error
    assert error.status == 503 and "gave up" in error.message
    assert "engine 0" in engine.down_reason and "engine 1" in engine.down_reason


def test_replicas_of_two_tensor_parallel_ranks_each_write_the_text_of_one_process(replicas):
    """DP=2 x TP=2 (docs/SERVING.md's 4-GPU layout, on gloo): each replica's group has a rendezvous
    of its own, and every request writes the greedy tokens of one process."""
    prompts = [f"Question {i}: what is the weather on day {i}?" for i in range(4)]
    engine, runner = replicas(data_parallel_size=1)
    expected = runner.run(run_all(engine, [request(f"r{i}", p) for i, p in enumerate(prompts)]))
    engine, runner = replicas(tensor_parallel_size=2, master_port=_free_port())
    got = runner.run(
        run_all(engine, [request(f"r{i}", p) for i, p in enumerate(prompts)]), timeout=240
    )
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    assert [r.num_in_flight for r in engine.replicas] == [0, 0]
    ports = {replica.config.master_port for replica in engine.replicas}
    assert len(ports) == 2  # --master-port P: replica r's group meets at P + r


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_beam_searchs_choices_stay_on_their_replica_while_it_restarts():
    """Sampled choices of a request move off a replica that is restarting; a beam search's
    cannot (its leader gathers them in one scheduler), so they stay and get its 503."""
    engine = object.__new__(DataParallelEngine)
    engine.replicas = [SimpleNamespace(ready=True), SimpleNamespace(ready=False)]
    engine._route = lambda req: Route(0, "only_ready", 0, 0)  # type: ignore[method-assign]
    sampled = request("n2", "Hi", max_tokens=4)
    beam = msgspec.structs.replace(
        sampled,
        sampling=msgspec.structs.replace(
            sampled.sampling, beam=BeamSearchParams(2, group=1, index=1)
        ),
    )
    for req, expected in ((sampled, 0), (beam, 1)):
        engine._pins = {(req.request_id, id(req.prompt)): (1, 1)}
        assert engine._choose(req) == expected
