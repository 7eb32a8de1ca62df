"""vLLM's --uds: the server answers on a Unix domain socket instead of a TCP port, and removes the
socket file when it stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.serving import http_get

ROOT = Path(__file__).parents[2]


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
                if http_get(path, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        models = json.loads(http_get(path, "/v1/models")[1])
        assert [card["id"] for card in models["data"]] == ["dummy"]
        ready = [json.loads(line) for line in log.read_text().splitlines() if '"ready"' in line]
        assert any(line.get("url") == f"unix:{path}" for line in ready), ready
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 0
    assert not path.exists()
