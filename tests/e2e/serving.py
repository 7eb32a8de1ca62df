"""`pipeline-serve` as a real process tree for end-to-end tests: start it, wait for /health, stop it."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over a Unix domain socket (a server started with --uds)."""

    def __init__(self, socket_path: Path) -> None:
        super().__init__("localhost", timeout=5)
        self._socket_path = str(socket_path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self._socket_path)


def http_get(port: int | Path, path: str) -> tuple[int, str]:
    """GET `path` from the server on 127.0.0.1:port, or on the Unix socket at `port` (a path)."""
    connection = (
        UnixConnection(port)
        if isinstance(port, Path)
        else http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    )
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


@contextlib.contextmanager
def running_server(
    args: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`python -m server.cli ARGS --port PORT`, ready (200 on /health) within 120 s; SIGTERM after.
    `env`: variables set for it besides ours."""
    argv = [sys.executable, "-m", "server.cli", *args, "--port", str(port), "--log-format", "json"]
    environ = {**os.environ, **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environ
        )
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, log_path.read_text()[-3000:]
                with contextlib.suppress(OSError):
                    if http_get(port, "/health")[0] == 200:
                        break
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.1)
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
