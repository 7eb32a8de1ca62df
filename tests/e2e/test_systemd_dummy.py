"""`pipeline-serve dummy` as systemd runs it (Type=notify, WatchdogSec=1): what arrives on
$NOTIFY_SOCKET from start to stop, the process titles, the watchdog going quiet while a stage is
stopped mid-stream, the status while a killed stage is replaced, and the drain on SIGTERM letting
the stream finish."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.serving import ROOT, http_get
from tests.server.live import free_port

# A server under a service manager: `make test` runs it, `make test-fast` not
pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0
WATCHDOG_S = 1.0


class ServiceManager:
    """The listening end of $NOTIFY_SOCKET, keeping every datagram with the time it was read."""

    def __init__(self, path: Path) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(path))
        self.messages: list[str] = []

    def collect(self, seconds: float) -> list[str]:
        """The datagrams that arrive within `seconds`."""
        got: list[str] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.socket.settimeout(left)
            try:
                got.append(self.socket.recv(4096).decode())
            except TimeoutError:
                break
        self.messages += got
        return got

    def wait_for(self, message: str, timeout_s: float, process: subprocess.Popen) -> list[str]:
        """The datagrams up to and with the first that starts with `message`."""
        got: list[str] = []
        deadline = time.monotonic() + timeout_s
        while not any(m.startswith(message) for m in got):
            assert process.poll() is None, "pipeline-serve exited"
            assert time.monotonic() < deadline, f"no {message!r}; got {got}"
            got += self.collect(0.5)
        return got


def title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_serve_under_systemd(tmp_path: Path) -> None:
    manager = ServiceManager(tmp_path / "notify")
    port = free_port()
    environ = {
        **os.environ,
        "NOTIFY_SOCKET": str(tmp_path / "notify"),
        "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6)),
    }
    argv = [sys.executable, "-m", "server.cli", "dummy", "--port", str(port)]
    argv += ["--shutdown-timeout", "60", "--log-format", "json"]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=environ, stdout=log, stderr=log)
    try:
        started = manager.wait_for("READY=1", START_TIMEOUT_S, process)
        assert started[0] == "STATUS=loading dummy and starting stages"
        assert http_get(port, "/health")[0] == 200  # listening by the time READY=1 went out

        stages = {
            title(child.pid).removeprefix("pipeline-serve: "): child.pid
            for child in psutil.Process(process.pid).children()
            if title(child.pid).startswith("pipeline-serve: ")
        }
        assert title(process.pid) == "pipeline-serve: server"
        assert set(stages) == {"render", "schedule", "execute", "detokenize"}

        idle = manager.collect(2 * WATCHDOG_S)
        assert "STATUS=serving 0 streams" in started + idle
        assert idle.count("WATCHDOG=1") >= 3  # every half interval

        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body))
        stream = connection.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        os.kill(stages["execute"], signal.SIGSTOP)  # a hung stage: the stream stops moving
        try:
            manager.collect(WATCHDOG_S + 0.5)  # until its last output is older than the interval
            assert manager.collect(2 * WATCHDOG_S) == []
        finally:
            os.kill(stages["execute"], signal.SIGCONT)
        assert manager.collect(2 * WATCHDOG_S).count("WATCHDOG=1") >= 2
        assert "STATUS=serving 1 streams" in manager.messages

        os.kill(stages["execute"], signal.SIGKILL)  # the engine brings up fresh stages
        manager.wait_for("STATUS=restarting execute", 30, process)
        # The resumed stream may have ended by the next look (the client's socket buffers hold it).
        manager.wait_for("STATUS=serving ", 60, process)

        process.send_signal(signal.SIGTERM)
        events = [line.strip() for line in stream if line.strip()]
        assert events[-1] == b"data: [DONE]"
        last = json.loads(events[-2].removeprefix(b"data: "))
        assert last["choices"][0]["finish_reason"] == "length"  # it fit in the timeout
        assert process.wait(60) == 0
        stopping = manager.collect(0.5)
        assert any(m.startswith("STOPPING=1\nSTATUS=draining ") for m in manager.messages)
        assert stopping[-1] == "STATUS=stopping stages"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        manager.socket.close()
