"""`pipeline-serve dummy --data-parallel-size 2` as a process tree: two titled pipelines behind
one port, /health while one replica restarts, /metrics per replica, the routing decision in the
debug log, and nothing left behind after SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from pipeline.names import names_in_shm
from tests.e2e.serving import http_get, running_server
from tests.server.live import free_port

# Two replicas behind a server: `make test` runs it, `make test-fast` not
pytestmark = pytest.mark.slow

PROMPT = "A long shared preamble about the history of the printing press. " * 12


def complete(port: int, prompt: str) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"model": "dummy", "prompt": prompt, "max_tokens": 4}
        connection.request("POST", "/v1/completions", json.dumps(body))
        response = connection.getresponse()
        assert response.status == 200, response.read()
        return json.loads(response.read())
    finally:
        connection.close()


def stage_pids(server: psutil.Process) -> dict[str, int]:
    titles = {}
    for child in server.children():
        cmdline = " ".join(child.cmdline())
        if cmdline.startswith("pipeline-serve dp"):
            titles[cmdline.split()[1].rstrip(":") + " " + cmdline.split()[2]] = child.pid
    return titles


def test_two_replicas_behind_one_server(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    args = ["dummy", "--data-parallel-size", "2", "--log-level", "debug"]
    with running_server(args, port, log_path) as process:
        pids = stage_pids(psutil.Process(process.pid))
        assert set(pids) == {
            f"dp{rank} {stage}"
            for rank in (0, 1)
            for stage in ("render", "schedule", "execute", "detokenize")
        }
        complete(port, PROMPT + "Who built the first one?")
        complete(port, PROMPT + "When did it reach Venice?")
        routed = [
            line
            for line in (
                json.loads(raw) for raw in log_path.read_text().splitlines() if raw[:1] == "{"
            )
            if line.get("event") == "routed"
        ]
        assert [line["reason"] for line in routed] == ["load", "prefix"]
        assert routed[0]["engine"] == routed[1]["engine"]

        _, metrics = http_get(port, "/metrics")
        for rank in (0, 1):
            assert f'vllm:num_blocks{{engine="{rank}",model_name="dummy"}}' in metrics
        # the server's own counts, under the replica that served each request (vLLM's `engine`)
        served, idle = routed[0]["engine"], 1 - routed[0]["engine"]
        for rank, requests in ((served, 2.0), (idle, 0.0)):
            labels = f'engine="{rank}",model_name="dummy"'
            assert f"vllm:e2e_request_latency_seconds_count{{{labels}}} {requests}" in metrics
            assert f"vllm:generation_tokens_total{{{labels}}} {requests * 4}" in metrics
            assert f"vllm:inter_token_latency_seconds_count{{{labels}}}" in metrics
        assert (
            f'vllm:inter_token_latency_seconds_count{{engine="{idle}",model_name="dummy"}} 0.0'
            in (metrics)
        )
        assert 'vllm:e2e_request_latency_seconds_count{model_name="dummy"}' not in metrics

        # replica 1 restarting: the server is still healthy and serves through replica 0
        os.kill(pids["dp1 schedule"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "restarting the pipeline" not in log_path.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http_get(port, "/health")[0] == 200
        complete(port, "Anyone there?")
    assert process.returncode == 0
    left = [n for n in names_in_shm() if n.split(".")[1] == str(process.pid)]
    assert left == []
