"""vLLM's --uds: the server answers on a Unix domain socket instead of a TCP port, and removes the
socket file when it stops."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=5)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self._path)


def _get(path: Path, route: str) -> tuple[int, str]:
    connection = _UnixConnection(path)
    try:
        connection.request("GET", route)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def test_the_server_answers_on_a_unix_socket_and_removes_it(tmp_path: Path):
    path = tmp_path / "pipeline-serve.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # left by a server before: replaced
        stale.bind(str(path))
    argv = [sys.executable, "-m", "server.cli", "dummy", "--uds", str(path), "--log-format", "json"]
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if _get(path, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        models = json.loads(_get(path, "/v1/models")[1])
        assert [card["id"] for card in models["data"]] == ["dummy"]
        ready = [json.loads(line) for line in log.read_text().splitlines() if '"ready"' in line]
        assert any(line.get("url") == f"unix:{path}" for line in ready), ready
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 0
    assert not path.exists()
