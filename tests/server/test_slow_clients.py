"""Clients that hold connections on a real Hypercorn server: a body trickled a byte at a time is
cut at --request-body-timeout with a 408, one address sends at most --max-body-reads-per-client
bodies at once (429 past it), and what Hypercorn refuses itself (a header block too large) has
an OpenAI error body. Other clients are served meanwhile."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from server.app import create_app
from server.config import ServerConfig
from server.limits import BODY_READ_GRACE_S
from tests.server.fake_engine import FakeEngine
from tests.server.live import LiveServer, free_port
from tests.server.test_drain import chat_body, post

BODY_TIMEOUT_S = 2.5  # past BODY_READ_GRACE_S: a held body is slow before it is cut
BODY_READS = 3


@pytest.fixture
def server() -> Iterator[LiveServer]:
    config = ServerConfig(
        port=free_port(),
        request_body_timeout_s=BODY_TIMEOUT_S,
        max_body_reads_per_client=BODY_READS,
    )
    with LiveServer(create_app(FakeEngine(), config), config) as live:
        yield live


def _port(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _slow_body(port: int) -> socket.socket:
    """A chat request whose headers promise 100,000 bytes, of which one has been sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{"
    )
    return sock


def _response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The status, the JSON body and what followed it, read until the server closes."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    return status, json.loads(rest[:length]), rest[length:]


def _served(port: int) -> bool:
    response = post(port, chat_body(2, stream=False))
    return response.status == 200 and bool(json.loads(response.read())["choices"])


def test_a_trickled_body_is_cut_at_the_timeout_with_a_408(server: LiveServer) -> None:
    port = _port(server)
    sock = _slow_body(port)
    started = time.monotonic()
    # a byte every 0.2 s: each read is quick, the body never completes
    sock.settimeout(0.2)
    answered = b""
    while time.monotonic() - started < 10 * BODY_TIMEOUT_S:
        try:
            sock.sendall(b" ")
            answered = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # the server closed while a byte was on its way
            break
        if answered:
            break
    took = time.monotonic() - started
    sock.settimeout(10)
    try:
        while chunk := sock.recv(65536):
            answered += chunk
    except OSError:
        pass
    sock.close()
    assert BODY_TIMEOUT_S * 0.9 < took < BODY_TIMEOUT_S + 3
    head, _, body = answered.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408"
    error = json.loads(body[: body.rindex(b"}") + 1])["error"]
    assert error["type"] == "RequestTimeoutError" and "--request-body-timeout" in error["message"]
    assert _served(port)


def test_one_address_sends_at_most_its_share_of_bodies_at_once(server: LiveServer) -> None:
    port = _port(server)
    held = [_slow_body(port) for _ in range(BODY_READS)]
    time.sleep(BODY_READ_GRACE_S + 0.3)  # each has been reading its body for a while
    refused = _slow_body(port)
    status, body, _ = _response(refused)  # answered at once, its body unread, and closed
    refused.close()
    assert status == 429
    assert "--max-body-reads-per-client" in body["error"]["message"]
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _served(port):  # the closed ones are let go
        time.sleep(0.1)
    assert _served(port)


def test_a_header_block_too_large_is_a_431_with_an_openai_body(server: LiveServer) -> None:
    sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=10)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    status, body, _ = _response(sock)
    sock.close()
    assert status == 431
    assert body["error"]["type"] == "RequestHeaderFieldsTooLargeError"
    assert "16384 bytes" in body["error"]["message"]
    assert _served(_port(server))


def test_a_burst_of_bodies_from_one_address_is_not_taken_for_a_slow_client(server: LiveServer):
    """More bodies than the limit in reading at once, none of them for long (a load test's
    burst): each request is served."""
    port = _port(server)
    body = json.dumps(chat_body(2, stream=False)).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    burst = []
    for _ in range(BODY_READS + 2):  # headers first: each is reading its body meanwhile
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(head + body[:1])
        burst.append(sock)
    time.sleep(0.2)
    for sock in burst:
        sock.sendall(body[1:])
    statuses = []
    for sock in burst:
        status, answer, _ = _response(sock)
        sock.close()
        statuses.append((status, bool(answer.get("choices"))))
    assert statuses == [(200, True)] * (BODY_READS + 2)
