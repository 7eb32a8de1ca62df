"""The notify protocol against a socket the test binds, as systemd would: the datagrams, the
abstract namespace, WATCHDOG_PID, and the monitor's watchdog pings, which stop while the pipeline
makes no progress."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.systemd import Notifier, PipelineState, making_progress, monitor, status_line

pytestmark = pytest.mark.anyio


class ServiceManager:
    """The listening end of $NOTIFY_SOCKET."""

    def __init__(self, address: str | bytes, environ_value: str) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(address)
        self.socket.setblocking(False)
        self.environ = {"NOTIFY_SOCKET": environ_value}

    def received(self) -> list[str]:
        """Every datagram that arrived so far."""
        datagrams = []
        while True:
            try:
                datagrams.append(self.socket.recv(4096).decode())
            except BlockingIOError:
                return datagrams


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ServiceManager]:
    path = str(tmp_path / "notify")
    listening = ServiceManager(path, path)
    yield listening
    listening.socket.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier.from_environ({"WATCHDOG_USEC": "1000000"}, os.getpid())
    assert not notifier.enabled and notifier.watchdog_s is None
    notifier.ready()  # and does not fail
    notifier.stopping("stopping")


def test_each_message_is_one_datagram(manager: ServiceManager) -> None:
    notifier = Notifier.from_environ(manager.environ, os.getpid())
    notifier.ready()
    notifier.status("serving 3 streams")
    notifier.watchdog()
    notifier.stopping("draining 3 streams")
    assert manager.received() == [
        "READY=1",
        "STATUS=serving 3 streams",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=draining 3 streams",
    ]
    notifier.close()


def test_abstract_namespace_address() -> None:
    name = f"pserve-test-{uuid.uuid4().hex}"
    manager = ServiceManager(b"\0" + name.encode(), "@" + name)
    try:
        Notifier.from_environ(manager.environ, os.getpid()).ready()
        assert manager.received() == ["READY=1"]
    finally:
        manager.socket.close()


def test_a_vanished_manager_does_not_stop_the_server(tmp_path: Path) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "gone")}, os.getpid())
    notifier.ready()
    notifier.watchdog()


def test_watchdog_is_ours_unless_it_names_another_pid(manager: ServiceManager) -> None:
    environ = {**manager.environ, "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_environ(environ, os.getpid()).watchdog_s == 30.0
    mine = {**environ, "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_environ(mine, os.getpid()).watchdog_s == 30.0
    other = {**environ, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_environ(other, os.getpid()).watchdog_s is None


def test_status_lines() -> None:
    now = time.monotonic_ns()
    assert status_line(PipelineState(True, 3, now)) == "serving 3 streams"
    assert status_line(PipelineState(True, 2, now, now, draining=True)) == "draining 2 streams"
    assert status_line(PipelineState(False, 0, now, failed_stage="execute")) == "restarting execute"
    assert status_line(PipelineState(False, 0, now)) == "starting stages"


def test_progress_means_no_request_waits_long_for_the_engine() -> None:
    now = time.monotonic_ns()
    long_ago, just_now = now - 10 * 10**9, now - 10**8
    # A request whose client reads slowly is not waiting: no output for long is fine then.
    assert making_progress(PipelineState(True, 1, long_ago, None), now, 1.0)
    assert not making_progress(PipelineState(True, 1, long_ago, long_ago), now, 1.0)
    assert making_progress(PipelineState(True, 1, long_ago, just_now), now, 1.0)  # began to wait
    assert making_progress(PipelineState(True, 1, just_now, long_ago), now, 1.0)  # output came
    assert not making_progress(PipelineState(False, 0, now), now, 1.0)  # restarting


class FakePipeline:
    """A progress source the test steers: idle, busy producing output or stuck, or restarting."""

    def __init__(self) -> None:
        self.ready = True
        self.in_flight = 0
        self.last_output_ns = time.monotonic_ns()
        self.waiting_since_ns: int | None = None
        self.producing = False

    def state(self) -> PipelineState:
        if self.in_flight and self.waiting_since_ns is None:
            self.waiting_since_ns = time.monotonic_ns()
        if self.producing:
            self.last_output_ns = time.monotonic_ns()
        return PipelineState(
            self.ready,
            self.in_flight,
            self.last_output_ns,
            self.waiting_since_ns if self.in_flight else None,
            failed_stage=None if self.ready else "execute",
        )


async def test_watchdog_pings_only_while_the_pipeline_makes_progress(
    manager: ServiceManager,
) -> None:
    watchdog_s = 0.4  # pings every 0.2 s
    environ = {**manager.environ, "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}
    notifier = Notifier.from_environ(environ, os.getpid())
    pipeline = FakePipeline()
    task = asyncio.create_task(monitor(notifier, pipeline.state))

    async def during(seconds: float) -> list[str]:
        manager.received()
        await asyncio.sleep(seconds)
        return manager.received()

    try:
        idle = await during(1.0)
        assert idle.count("WATCHDOG=1") >= 3  # idle: nothing to make progress on
        pipeline.in_flight, pipeline.producing = 2, True
        busy = await during(1.0)
        assert busy.count("WATCHDOG=1") >= 3 and "STATUS=serving 2 streams" in busy
        pipeline.producing = False  # a hung stage: requests wait, no output comes
        await asyncio.sleep(watchdog_s)  # the last output ages past the interval
        assert await during(1.0) == []
        pipeline.producing = True  # it came back
        assert (await during(0.6)).count("WATCHDOG=1") >= 2
        pipeline.ready, pipeline.in_flight = False, 0  # a stage died; the engine restarts it
        restarting = await during(0.6)
        assert restarting == ["STATUS=restarting execute"]
    finally:
        task.cancel()
        notifier.close()
