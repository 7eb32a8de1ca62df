"""The drain on a real Hypercorn server: after the shutdown signal new requests get a 503 with
Retry-After, a stream that fits in --shutdown-timeout finishes, one that does not ends with an
error event and [DONE], and a non-streaming request that does not fit gets a 503 body."""

from __future__ import annotations

import http.client
import json
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from server.app import create_app
from server.config import ServerConfig
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer, free_port

TOKEN_DELAY_S = 0.2


def words(count: int) -> str:
    return " ".join(f"w{i}" for i in range(count))


def chat_body(count: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": words(count)}], "stream": stream, **extra}


def post(port: int, body: dict[str, Any]) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    return connection.getresponse()


def get(port: int, path: str) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", path)
    return connection.getresponse()


def events(response: http.client.HTTPResponse) -> Iterator[Any]:
    """Each SSE event's JSON as it arrives; "[DONE]" as the string."""
    while line := response.readline():
        text = line.decode().strip()
        if text:
            payload = text.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[LiveServer] = []

    def start(engine: FakeEngine, shutdown_timeout_s: float) -> LiveServer:
        config = ServerConfig(port=free_port(), shutdown_timeout_s=shutdown_timeout_s)
        live = LiveServer(create_app(engine, config), config).__enter__()
        servers.append(live)
        return live

    yield start
    for live in servers:
        live.__exit__(None, None, None)


def assert_refused(port: int, shutdown_timeout_s: float) -> None:
    refused = post(port, chat_body(2, stream=False))
    assert refused.status == 503
    retry_after = int(refused.getheader("Retry-After") or "0")
    assert 1 <= retry_after <= max(1, math.ceil(shutdown_timeout_s))  # until the drain is over
    error = json.loads(refused.read())["error"]
    assert error["type"] == "ServiceUnavailableError" and "shutting down" in error["message"]
    health = get(port, "/health")
    assert health.status == 503 and health.getheader("Retry-After") is not None
    assert get(port, "/metrics").status == 200  # scrapes still see the drain


def test_a_stream_that_fits_in_the_timeout_finishes(serve) -> None:
    engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
    live = serve(engine, shutdown_timeout_s=10.0)
    port = live._config.port
    stream = events(post(port, chat_body(6, stream=True)))
    assert next(stream)["choices"][0]["delta"]["role"] == "assistant"
    live.begin_shutdown()
    time.sleep(0.1)
    assert_refused(port, 10.0)
    rest = list(stream)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in rest[:-1]) == words(6)
    assert not any("error" in e for e in rest[:-1])
    assert live.wait_stopped(5.0), "the server did not stop once the stream had finished"
    assert engine.aborted == []


def test_requests_that_do_not_fit_end_with_an_error(serve) -> None:
    engine = FakeEngine(token_delay_s=TOKEN_DELAY_S)
    live = serve(engine, shutdown_timeout_s=0.6)
    port = live._config.port
    stream = events(post(port, chat_body(25, stream=True)))
    choices = events(post(port, chat_body(25, stream=True, n=2)))
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(post, port, chat_body(25, stream=False))
        next(stream), next(choices)
        while len(engine.requests) < 4:  # the non-streaming request is in the engine too
            time.sleep(0.01)
        started = time.monotonic()
        live.begin_shutdown()
        time.sleep(0.1)
        assert_refused(port, 0.6)
        for ended in (list(stream), list(choices)):
            assert ended[-1] == "[DONE]"
            error = ended[-2]["error"]
            assert error["type"] == "ServiceUnavailableError"
            assert "shut down before the request finished" in error["message"]
            assert not any(c.get("finish_reason") for e in ended[:-2] for c in e["choices"])
        response = whole.result(10)
        assert response.status == 503 and response.getheader("Retry-After") == "1"
        assert "shutdown timeout 0.6 s" in json.loads(response.read())["error"]["message"]
    # 25 tokens take 5 s; the drain ended them after its 0.6 s.
    assert time.monotonic() - started < 3.0
    assert live.wait_stopped(5.0)
    assert len(engine.aborted) == 4 and not engine.running
