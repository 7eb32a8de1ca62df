"""--cpu-threads-bind: which cores the model's threads and the other stages get (the plan), and a
pipeline whose processes and threads run where the plan says."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from stages.config import EngineConfig
from stages.cpu_bind import CpuBinding, check_setting, parse_cpu_list, plan_binding
from stages.engine import Engine
from stages.engine_layout import pipeline_layout, resolve_binding
from tests.stages.conftest import LoopThread
from tests.stages.test_engine import collect, request

FOUR = frozenset({0, 1, 2, 3})


def test_auto_gives_each_thread_a_core_and_the_stages_what_is_left() -> None:
    assert plan_binding("auto", 2, FOUR) == CpuBinding(compute=(0, 1), others=(2, 3))
    # every core computes: the stages share the last thread's, not thread 0's (the step's own)
    assert plan_binding("auto", 0, frozenset({0, 1})) == CpuBinding((0, 1), (1,))
    assert plan_binding("auto", 1, frozenset({4, 7})) == CpuBinding((4,), (7,))
    assert plan_binding("none", 2, FOUR) is None


def test_a_list_of_cores_is_the_threads_cores() -> None:
    assert plan_binding("2-3", 0, FOUR) == CpuBinding((2, 3), (0, 1))
    assert plan_binding("3,1", 2, FOUR) == CpuBinding((1, 3), (0, 2))  # thread 0 the lowest
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)


@pytest.mark.parametrize(
    ("value", "threads", "message"),
    [
        ("auto", 5, "5 threads need as many cores"),
        ("0-2", 2, "names 3 cores for 2 threads"),
        ("3-5", 0, r"may not run on cores \[4, 5\]"),
    ],
)
def test_a_plan_the_machine_cannot_hold_is_refused(value: str, threads: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_binding(value, threads, FOUR)


@pytest.mark.parametrize("value", ["fast", "1-", "3-1", "0,0", "a-b", ""])
def test_a_value_that_is_no_list_of_cores_is_refused(value: str) -> None:
    with pytest.raises(ValueError):
        check_setting(value)


def test_the_layout_puts_each_stage_on_its_cores(tiny_chat_model: str) -> None:
    config = EngineConfig(model_path=tiny_chat_model, cpu_threads_bind="auto", threads=1)
    available = sorted(os.sched_getaffinity(0))
    # the other stages take the cores left over; on a one-core host, the compute thread's
    others = tuple(available[1:]) or (available[0],)
    resolved = resolve_binding(config)
    assert resolved.cpu_binding == CpuBinding((available[0],), others)
    _, actors = pipeline_layout(resolved)
    cpus = {a.name: a.cpus for a in actors}
    assert cpus["execute"] == (available[0],)
    assert cpus["render"] == cpus["schedule"] == cpus["detokenize"] == others
    assert all(a.config.threads == 1 for a in actors)
    unbound = {
        a.name: a.cpus
        for a in pipeline_layout(dataclasses.replace(config, cpu_threads_bind="none"))[1]
    }
    assert set(unbound.values()) == {()}


def test_binding_refuses_more_than_one_pipeline_or_rank(tiny_chat_model: str) -> None:
    for extra in ({"data_parallel_size": 2}, {"tensor_parallel_size": 2}, {"device": "cuda"}):
        config = EngineConfig(model_path=tiny_chat_model, cpu_threads_bind="auto", **extra)
        with pytest.raises(ValueError, match="one CPU pipeline"):
            resolve_binding(config)


def _thread_cores(pid: int) -> dict[int, set[int]]:
    return {
        int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(Path(f"/proc/{pid}/task"))
    }


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_bound_pipeline_runs_where_the_plan_says(tiny_chat_model: str) -> None:
    """Two compute threads on two cores: execute's main thread on the first, its OpenMP worker
    on the second, which the other stages share; the tokens are what an unbound pipeline gives."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    loop = LoopThread()
    outputs = []
    try:
        for bind in (f"{first},{second}", "none"):
            config = EngineConfig(
                model_path=tiny_chat_model,
                served_model_name="tiny",
                cpu_threads_bind=bind,
                threads=2,
                kv_cache_bytes=1 << 22,
                log_format="json",
                log_level="warning",
            )
            engine = Engine(config)
            loop.run(engine.start())
            try:
                req = request(temperature=0, max_tokens=6, ignore_eos=True)
                outputs.append([t for o in loop.run(collect(engine, req)) for t in o.token_ids])
                if bind == "none":
                    continue
                pids = engine.supervisor.pids()
                for stage in ("render", "schedule", "detokenize"):
                    assert os.sched_getaffinity(pids[stage]) == {second}, stage
                execute = _thread_cores(pids["execute"])
                assert execute[pids["execute"]] == {first}  # the main thread: the step's
                assert {second} in execute.values()  # the OpenMP worker
            finally:
                loop.run(engine.stop())
    finally:
        loop.close()
    assert outputs[0] == outputs[1]
