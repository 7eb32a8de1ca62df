"""Supervisor: handshake, names unlinked, failures reported with a reason, ordered shutdown, no leftovers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pipeline.actor import ActorSpec
from pipeline.broadcast import BroadcastSpec
from pipeline.errors import ActorFailed
from pipeline.names import names_in_shm, pid_alive, sweep_stale
from pipeline.ring import RingSpec
from pipeline.supervisor import Supervisor, SupervisorConfig
from tests.pipeline.owners import chain
from tests.pipeline.peers import BLOB, VOCAB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_gone(pids, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def owner_process():
    """Start an owner process (tests/pipeline/owners.py); it is killed after the test whatever happens."""
    started: list[subprocess.Popen] = []

    def start(mode: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.pipeline.owners", mode],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_chain_of_actors_processes_messages_and_leaves_no_names():
    with chain() as sup:
        assert names_in_shm(sup.namespace) == []  # unlinked once everyone attached
        producer, consumer = sup.producers["in"], sup.consumers["out"]
        for i in range(200):
            data = np.arange(i % 50, dtype=np.uint8)
            producer.send(BLOB, {"meta": np.array([i, 0, 0], np.int64), "data": data})
            with consumer.recv(timeout_s=10) as msg:
                assert msg["meta"][0] == i
                np.testing.assert_array_equal(msg["data"], (data.astype(int) * 2 + 1) % 256)
        pids = list(sup.pids().values())
        assert sup.check() is None
    assert wait_gone(pids)


def test_failed_warm_up_fails_start_with_the_error_text():
    rings = [RingSpec("x", VOCAB, 2, 256)]
    actors = [ActorSpec("loader", "tests.pipeline.peers:FailsWarmUp", inboxes=("x",))]
    sup = Supervisor(rings, actors, SupervisorConfig(log_format="json"), owner_outboxes=("x",))
    with pytest.raises(ActorFailed, match=r"loader.*exited with code 1.*weights file is missing"):
        sup.start()
    assert names_in_shm(sup.namespace) == []


def test_killed_actor_is_reported_within_a_bounded_time():
    with chain() as sup:
        victim = sup.pids()["incrementer"]
        failures: list[ActorFailed] = []

        async def main() -> float:
            watcher = asyncio.create_task(sup.watch(failures.append))
            await asyncio.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
            start = time.monotonic()
            await asyncio.wait_for(watcher, 5)
            return time.monotonic() - start

        elapsed = asyncio.run(main())
    assert elapsed < 1.0
    assert failures[0].actor == "incrementer"
    assert "SIGKILL" in failures[0].reason


def incrementer_fed_by(doubler: str) -> Supervisor:
    """The incrementer, listed first, reading what a doubler (`tests.pipeline.peers`'s class of
    that name) writes: the owner feeds "in" and reads "out"."""
    rings = [RingSpec(n, VOCAB, 8, 4096) for n in ("in", "mid", "out")]
    actors = [
        ActorSpec(
            "incrementer", "tests.pipeline.peers:Incrementer", inboxes=("mid",), outboxes=("out",)
        ),
        ActorSpec("doubler", f"tests.pipeline.peers:{doubler}", inboxes=("in",), outboxes=("mid",)),
    ]
    config = SupervisorConfig(log_format="json")
    return Supervisor(rings, actors, config, owner_inboxes=("out",), owner_outboxes=("in",))


def test_the_killed_actor_is_the_failure_not_the_peer_that_ended_because_of_it():
    """Killing the doubler ends the incrementer downstream (its ring's producer died): the
    failure names the doubler, though the incrementer comes first in the supervisor's list."""
    from pipeline.actor import PEER_DIED_EXIT_CODE

    with incrementer_fed_by("Doubler") as sup:
        os.kill(sup.pids()["doubler"], signal.SIGKILL)
        incrementer = sup._procs[0]
        incrementer.join(10)
        assert incrementer.exitcode == PEER_DIED_EXIT_CODE
        failure = sup.check()
    assert failure is not None and failure.actor == "doubler" and "SIGKILL" in failure.reason


def test_a_peer_that_sees_the_cause_die_first_is_not_named_for_it():
    """The doubler's main thread ends a second before its process can be reaped (as a killed
    process with busy threads dies): the incrementer sees it dead and exits first, yet the
    failure the watch reports is the doubler's kill."""
    from pipeline.actor import PEER_DIED_EXIT_CODE

    failures: list[ActorFailed] = []
    with incrementer_fed_by("DyingDoubler") as sup:
        asyncio.run(asyncio.wait_for(sup.watch(failures.append), 10))
        incrementer = sup._procs[0]
    assert incrementer.exitcode == PEER_DIED_EXIT_CODE  # it ended first, because of the doubler
    assert failures[0].actor == "doubler" and "SIGKILL" in failures[0].reason


class ReapedAfterFirstLook:
    """A child process whose exit code reads None the first time, as when `check` looks at it
    just before it is reaped; every later read is the real one."""

    def __init__(self, proc):
        self._proc, self._looked = proc, False

    @property
    def exitcode(self):
        if not self._looked:
            self._looked = True
            return None
        return self._proc.exitcode

    def __getattr__(self, name):
        return getattr(self._proc, name)


def test_a_cause_reaped_while_its_consequence_is_judged_is_still_the_one_named():
    """The doubler is killed and reaped between the moment `check` reads its exit code and the
    moment it asks whether a cause is still dying: the failure named is still the doubler's."""
    from pipeline.actor import PEER_DIED_EXIT_CODE

    with incrementer_fed_by("Doubler") as sup:
        incrementer, doubler = sup._procs
        os.kill(doubler.pid, signal.SIGKILL)
        incrementer.join(10)
        doubler.join(10)
        assert incrementer.exitcode == PEER_DIED_EXIT_CODE
        sup._procs[1] = ReapedAfterFirstLook(doubler)
        try:
            failure = sup.check() or sup.check()
        finally:
            sup._procs[1] = doubler
    assert failure is not None and failure.actor == "doubler" and "SIGKILL" in failure.reason


def roundtrip(sup: Supervisor, seq: int) -> None:
    data = np.arange(seq % 50, dtype=np.uint8)
    sup.producers["in"].send(BLOB, {"meta": np.array([seq, 0, 0], np.int64), "data": data})
    with sup.consumers["out"].recv(timeout_s=30) as msg:
        assert msg["meta"][0] == seq
        np.testing.assert_array_equal(msg["data"], (data.astype(int) * 2 + 1) % 256)


def test_one_actor_restarts_alone_its_peer_reattaches_and_its_kept_file_survives():
    """The doubler is killed and restarted alone: the incrementer keeps its process and moves to
    the fresh ring, the owner's end too, messages flow again, the restarted doubler finds what
    its first process kept, and no name is left."""
    rings = [RingSpec(n, VOCAB, 8, 4096) for n in ("in", "mid", "out")]
    actors = [
        ActorSpec(
            "doubler",
            "tests.pipeline.peers:RemembersFirstPid",
            inboxes=("in",),
            outboxes=("mid",),
            kept_files=("first_pid",),
        ),
        ActorSpec(
            "incrementer",
            "tests.pipeline.peers:ReattachingIncrementer",
            inboxes=("mid",),
            outboxes=("out",),
        ),
    ]
    config = SupervisorConfig(log_format="json")
    with Supervisor(rings, actors, config, owner_inboxes=("out",), owner_outboxes=("in",)) as sup:
        roundtrip(sup, 0)
        before = sup.pids()
        failures: list[ActorFailed] = []

        async def kill_and_restart() -> None:
            watch = asyncio.create_task(sup.watch(failures.append))
            os.kill(before["doubler"], signal.SIGKILL)
            await asyncio.wait_for(watch, 10)
            await sup.restart_async("doubler")

        asyncio.run(kill_and_restart())
        after = sup.pids()
        assert [f.actor for f in failures] == ["doubler"]
        assert after["incrementer"] == before["incrementer"]
        assert after["doubler"] != before["doubler"] and pid_alive(after["doubler"])
        for seq in range(1, 20):
            roundtrip(sup, seq)
        assert sup.gauges("doubler")[0] == before["doubler"]
        assert sup.check() is None
        assert names_in_shm(sup.namespace) == []
        kept = sup._kept["doubler"]["first_pid"]
        assert holds(kept.fd, kept.name)  # anonymous memory: never a name in /dev/shm
    assert wait_gone(list(after.values()))
    assert not holds(kept.fd, kept.name)  # it went with the supervisor's stop


def holds(fd: int, name: str) -> bool:
    try:
        return name in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


def test_hung_actor_is_reported_by_its_heartbeat():
    rings = [RingSpec("x", VOCAB, 2, 256)]
    actors = [ActorSpec("stuck", "tests.pipeline.peers:StopsHeartbeating", inboxes=("x",))]
    config = SupervisorConfig(log_format="json", heartbeat_timeout_s=1.0, stop_timeout_s=1.0)
    with Supervisor(rings, actors, config, owner_outboxes=("x",)) as sup:
        deadline = time.monotonic() + 5
        while sup.check() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        failure = sup.check()
    assert failure is not None and "no heartbeat" in failure.reason


def test_ring_reader_gets_peer_died_when_upstream_actor_is_killed():
    with chain() as sup:
        os.kill(sup.pids()["incrementer"], signal.SIGKILL)
        with pytest.raises(Exception, match="died"):
            sup.consumers["out"].recv(timeout_s=5)


def test_sigterm_to_the_owner_stops_everything_in_order(owner_process):
    owner = owner_process("serve")
    line = owner.stdout.readline().split()
    assert line[0] == "READY", line
    namespace, pids = line[1], [int(p) for p in line[2:]]
    assert names_in_shm(namespace) == []
    owner.send_signal(signal.SIGTERM)
    assert owner.stdout.readline().strip() == "STOPPED"
    assert owner.wait(10) == 0
    assert wait_gone(pids)


def test_sigkill_of_the_whole_tree_leaves_nothing(owner_process):
    owner = owner_process("serve")
    line = owner.stdout.readline().split()
    namespace, pids = line[1], [int(p) for p in line[2:]]
    owner.kill()
    owner.wait()
    assert wait_gone(pids), "children outlived their parent (parent-death signal)"
    assert names_in_shm(namespace) == []


def test_supervisor_killed_during_start_leaves_names_the_next_start_sweeps(owner_process):
    owner = owner_process("hang")
    assert owner.stdout.readline().strip() == "STARTING"
    deadline = time.monotonic() + 10
    stale: list[str] = []
    while time.monotonic() < deadline and not stale:
        stale = [n for n in names_in_shm() if f".{owner.pid}." in n]
        time.sleep(0.05)
    owner.kill()
    owner.wait()
    assert stale, "the owner should have created its names before it was killed"
    assert set(stale) <= set(names_in_shm())
    removed = sweep_stale()
    assert set(stale) <= set(removed)
    assert not [n for n in names_in_shm() if f".{owner.pid}." in n]
    time.sleep(0.5)  # the orphaned actor exits on its parent-death signal


def test_broadcast_ring_reaches_every_reader_actor_and_leaves_no_names():
    rings: list[RingSpec | BroadcastSpec] = [
        RingSpec(n, VOCAB, 8, 4096) for n in ("in", "out0", "out1", "out2")
    ]
    rings.append(BroadcastSpec("fan", VOCAB, n_readers=3, n_chunks=4, chunk_bytes=1024))
    actors = [
        ActorSpec("fanner", "tests.pipeline.peers:Fanner", inboxes=("in",), outboxes=("fan",))
    ]
    actors += [
        ActorSpec(
            f"reader{k}", "tests.pipeline.peers:FanReader", inboxes=("fan",), outboxes=(f"out{k}",)
        )
        for k in range(3)
    ]
    outs = ("out0", "out1", "out2")
    config = SupervisorConfig(log_format="json")
    with Supervisor(rings, actors, config, owner_inboxes=outs, owner_outboxes=("in",)) as sup:
        assert names_in_shm(sup.namespace) == []
        for i in range(50):
            data = np.arange(i * 40 % 3000, dtype=np.uint16).astype(np.uint8)  # some span chunks
            sup.producers["in"].send(BLOB, {"meta": np.array([i, 0, 0], np.int64), "data": data})
            for k, out in enumerate(outs):
                with sup.consumers[out].recv(timeout_s=10) as msg:
                    assert msg["meta"][0] == i
                    np.testing.assert_array_equal(msg["data"], (data.astype(int) + k) % 256)
        pids = list(sup.pids().values())
    assert wait_gone(pids)
    with pytest.raises(ValueError, match="exactly one producer and 3 consumers"):
        Supervisor(rings, actors[:3], config, owner_inboxes=outs, owner_outboxes=("in",))


def test_topology_is_checked():
    rings = [RingSpec("x", VOCAB, 2, 256)]
    with pytest.raises(ValueError, match="exactly one producer and one consumer"):
        Supervisor(rings, [ActorSpec("a", "tests.pipeline.peers:Idle", inboxes=("x",))])


def _proc_text(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def test_actor_processes_carry_the_owners_title():
    """ps shows "<prefix>: <actor>" for each actor, top its name, instead of multiprocessing's
    `python -c from multiprocessing.spawn import spawn_main ...`."""
    rings = [RingSpec(n, VOCAB, 8, 4096) for n in ("in", "mid", "out")]
    actors = [
        ActorSpec("doubler", "tests.pipeline.peers:Doubler", inboxes=("in",), outboxes=("mid",)),
        ActorSpec(
            "incrementer", "tests.pipeline.peers:Incrementer", inboxes=("mid",), outboxes=("out",)
        ),
    ]
    config = SupervisorConfig(log_format="json", process_title_prefix="ptest")
    with Supervisor(rings, actors, config, owner_inboxes=("out",), owner_outboxes=("in",)) as sup:
        pids = sup.pids()
        assert {name: _proc_text(pid, "cmdline") for name, pid in pids.items()} == {
            "doubler": "ptest: doubler",
            "incrementer": "ptest: incrementer",
        }
        assert {name: _proc_text(pid, "comm") for name, pid in pids.items()} == {
            "doubler": "doubler",
            "incrementer": "incrementer",
        }
    with chain() as untitled:  # no prefix: the process keeps its command line
        pid = untitled.pids()["doubler"]
        assert "multiprocessing" in _proc_text(pid, "cmdline")


def test_a_child_that_ended_cleanly_does_not_make_the_watch_spin_and_the_watch_can_be_stopped():
    rings = [RingSpec("in", VOCAB, 8, 4096)]
    actors = [
        ActorSpec("ends", "tests.pipeline.peers:EndsSoon"),
        ActorSpec("idle", "tests.pipeline.peers:Idle", inboxes=("in",)),
    ]
    sup = Supervisor(rings, actors, SupervisorConfig(log_format="json"), owner_outboxes=("in",))
    sup.start()
    try:
        failures: list[ActorFailed] = []

        async def main() -> tuple[float, bool]:
            watcher = asyncio.create_task(sup.watch(failures.append, period_s=0.2))
            await asyncio.sleep(1.0)  # "ends" is gone by now: a readable sentinel, no failure
            cpu = time.process_time()
            await asyncio.sleep(1.5)
            spent = time.process_time() - cpu
            watcher.cancel()
            await asyncio.wait({watcher}, timeout=2)
            stopped = watcher.done()
            if not stopped:
                sup.stop()  # the watch ends once its supervisor is stopped
                await asyncio.wait({watcher}, timeout=5)
            return spent, stopped

        spent, stopped = asyncio.run(main())
    finally:
        sup.stop()
    assert not failures
    assert spent < 0.2  # a spinning watch burns the whole 1.5 s
    assert stopped  # cancelling the watch ends it
