"""--tensor-parallel-size 2 through the real pipeline on the tiny model (gloo on CPU): the text of
one rank, and a rank killed under load takes its group down and the group restarts as one."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import psutil
import pytest

from pipeline.errors import ActorFailed
from pipeline.names import names_in_shm
from stages.api import BeamSearchParams, GenerateRequest
from stages.config import num_kv_blocks
from stages.engine import Engine
from stages.kv_size import published_num_blocks
from stages.speculative_config import SpeculativeConfig
from tests.stages.conftest import LoopThread
from tests.stages.test_recovery import config, request, run_all, wait_ready

# Rank groups over gloo start many processes: `make test` runs them, `make test-fast` not
pytestmark = pytest.mark.slow


@pytest.fixture
def engines(tiny_chat_model, monkeypatch):
    """Starts engines of the given overrides; records each failure the engine acts on."""
    started: list[tuple[Engine, LoopThread]] = []
    failures: list[ActorFailed] = []
    on_failure = Engine._on_failure

    def record(self: Engine, failure: ActorFailed) -> None:
        failures.append(failure)
        on_failure(self, failure)

    monkeypatch.setattr(Engine, "_on_failure", record)

    def start(**overrides) -> tuple[Engine, LoopThread]:
        runner = LoopThread()
        engine = Engine(config(tiny_chat_model, **overrides))
        runner.run(engine.start(), timeout=180)
        started.append((engine, runner))
        return engine, runner

    yield start, failures
    for engine, runner in started:
        runner.run(engine.stop())
        runner.close()


def test_two_ranks_write_the_text_of_one_and_a_killed_rank_restarts_the_group(engines):
    start, failures = engines
    reqs = [request(i) for i in range(4)]
    engine, runner = start()
    expected = runner.run(run_all(engine, reqs), timeout=120)
    runner.run(engine.stop())

    # A cache sized as from device memory (on CPU: by kv_cache_bytes), so that the group
    # publishes its block count at the first start and every rank allocates it again after.
    engine, runner = start(tensor_parallel_size=2, gpu_memory_utilization=0.9)
    pids = engine.supervisor.pids()
    assert set(pids) == {"render", "schedule", "execute", "execute.rank1", "detokenize"}
    blocks = num_kv_blocks(engine.config)
    assert engine.num_blocks == published_num_blocks(engine.config) == blocks
    got = runner.run(run_all(engine, reqs), timeout=120)
    assert [g[:2] for g in got] == [e[:2] for e in expected]

    for victim in ("execute.rank1", "execute"):
        killed = False

        async def kill_once(num_tokens: int, victim: str = victim) -> None:
            nonlocal killed
            if not killed and engine.ready:
                killed = True
                os.kill(engine.supervisor.pids()[victim], signal.SIGKILL)

        old_pids = engine.supervisor.pids()
        namespace = engine.supervisor.namespace
        again = runner.run(run_all(engine, reqs, kill_once), timeout=240)
        wait_ready(engine)
        assert failures[-1].actor == victim  # the rank that died is named, not its group
        for (ids, text, _), (ids_again, text_again, last) in zip(expected, again, strict=True):
            assert (ids_again, text_again) == (ids, text)
            assert last.finish_reason is not None
        assert max(out[2].metrics.num_recoveries for out in again) >= 1
        new_pids = engine.supervisor.pids()
        assert not set(new_pids.values()) & set(old_pids.values())  # every rank restarted
        assert all(not _alive(pid) for pid in old_pids.values())
        assert [n for n in names_in_shm() if namespace in n] == []
        assert engine.num_blocks == published_num_blocks(engine.config) == blocks
    assert len(failures) == 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().split(b") ")[1][:1] not in (b"Z", b"X")


def test_two_ranks_verify_drafts_as_one_does(engines):
    """Speculative decoding over two ranks: the draft rows' split attention travels in the
    forward inputs, so verified steps write the greedy text of one rank without drafts."""
    start, _ = engines
    reqs = [request(i) for i in range(3)]
    engine, runner = start()
    expected = runner.run(run_all(engine, reqs), timeout=120)
    runner.run(engine.stop())
    speculative = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3, "adaptive_draft_length": false}'
    )
    engine, runner = start(tensor_parallel_size=2, speculative=speculative)
    got = runner.run(run_all(engine, reqs), timeout=120)
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert engine.stats()["spec_decode_num_draft_tokens_total"] > 0
    rank = psutil.Process(engine.supervisor.pids()["execute.rank1"])
    before = rank.cpu_times()
    time.sleep(2.0)
    after = rank.cpu_times()
    idle = (after.user - before.user + after.system - before.system) / 2.0
    assert idle < 0.03, f"an idle rank used {idle:.1%} of a core"  # it sleeps on the ring


def test_two_ranks_search_beams_as_one_does(engines):
    """Beam search over two ranks: the blocks beams copy on write are copied on every rank (the
    copies ride the forward inputs), so each hypothesis is the one rank's."""
    start, _ = engines
    width = 3

    def search(group: int, prompt_index: int) -> list[GenerateRequest]:
        base = request(prompt_index, max_tokens=12)
        return [
            msgspec.structs.replace(
                base,
                request_id=f"{base.request_id}-beam{index}",
                sampling=msgspec.structs.replace(
                    base.sampling,
                    beam=BeamSearchParams(width, group=group, index=index),
                ),
            )
            for index in range(width)
        ]

    reqs = search(1, 0) + search(2, 1)
    engine, runner = start()
    expected = runner.run(run_all(engine, reqs), timeout=120)
    runner.run(engine.stop())
    engine, runner = start(tensor_parallel_size=2)
    got = runner.run(run_all(engine, reqs), timeout=120)
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert len({tuple(e[0]) for e in expected[:width]}) == width  # the beams differ


def test_two_ranks_run_lora_adapters_as_one_does(engines, tiny_chat_model, tmp_path):
    """LoRA under tensor parallelism: each rank loads its cut of the adapters a step names (the
    step's adapter ids and directories travel in the forward inputs), so requests on two
    adapters and on the base model write the greedy text of one rank."""
    from stages.api import LoraRequest
    from stages.lora import LoraConfig
    from tests.lora_adapters import build_peft_adapter

    start, _ = engines
    adapters = [
        LoraRequest("alpha", 1, str(build_peft_adapter(tiny_chat_model, tmp_path / "a", seed=1))),
        LoraRequest(
            "beta",
            2,
            str(
                build_peft_adapter(
                    tiny_chat_model, tmp_path / "b", seed=2, rank=4, targets=("o_proj", "up_proj")
                )
            ),
        ),
        None,
    ]
    reqs = [
        msgspec.structs.replace(request(i, max_tokens=16), lora=lora)
        for i, lora in enumerate(adapters)
    ]
    lora = LoraConfig(max_loras=2, max_lora_rank=8)
    engine, runner = start(lora=lora)
    expected = runner.run(run_all(engine, reqs), timeout=120)
    base = runner.run(run_all(engine, [msgspec.structs.replace(reqs[0], lora=None)]), timeout=120)
    assert expected[0][0] != base[0][0]  # the adapter changes the text
    runner.run(engine.stop())
    engine, runner = start(tensor_parallel_size=2, lora=lora)
    got = runner.run(run_all(engine, reqs), timeout=120)
    assert [g[:2] for g in got] == [e[:2] for e in expected]
