"""Runs the app on Hypercorn until a shutdown trigger fires, then drains it (server.drain)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from itertools import chain

import h11
import msgspec
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import ASGIFramework, ASGIReceiveCallable, ASGISendCallable, Scope
from quart import Quart

from server.config import ServerConfig
from server.drain import app_drain
from server.errors import error_body, error_type_for

# After the drain, how long the responses it ended get to write their error and [DONE], and
# idle keep-alive connections to close, before Hypercorn cancels what is left.
FINAL_WRITE_GRACE_S = 5.0
BACKLOG = 100  # Hypercorn's default


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket, as Hypercorn would make it for `host:port`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_unix_socket(path: str) -> socket.socket:
    """A bound, listening Unix domain socket at `path` (vLLM's --uds); a socket file left there
    by a server before this one is replaced, any other file is an error."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise FileExistsError(f"--uds {path}: a file that is not a socket is there")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


# What Hypercorn refuses before the app sees a request, and why
_REFUSED_BEFORE_THE_APP = {
    400: "The request is not valid HTTP/1.1",
    431: "The request's header block is too large: this server holds at most {limit} bytes of "
    "one still arriving",
}


async def _send_openai_error_response(self: H11Protocol, status_code: int) -> None:
    """Hypercorn's answer to a request h11 refuses (its header block too large: 431, or not
    HTTP: 400), with the OpenAI error body the app gives every other error in place of
    Hypercorn's empty one."""
    message = _REFUSED_BEFORE_THE_APP.get(status_code, "The request was refused").format(
        limit=self.config.h11_max_incomplete_size
    )
    body = msgspec.json.encode(error_body(message, error_type_for(status_code)))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await self._send_h11_event(
        h11.Response(
            status_code=status_code,
            headers=list(chain(headers, self.config.response_headers("h11"))),
        )
    )
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


H11Protocol._send_error_response = _send_openai_error_response  # type: ignore[method-assign]


def hypercorn_config(listening_fd: int, config: ServerConfig) -> HypercornConfig:
    hypercorn = HypercornConfig()
    hypercorn.bind = [f"fd://{listening_fd}"]
    hypercorn.root_path = config.root_path  # ASGI root_path (see under_root_path)
    if config.ssl_certfile is not None:  # HTTPS, on the same listening socket
        hypercorn.certfile = config.ssl_certfile
        hypercorn.keyfile = config.ssl_keyfile
    hypercorn.backlog = BACKLOG
    hypercorn.accesslog = None  # the app logs each request it finishes, with its request id
    # A Logger (not a path) makes Hypercorn log through the process's handlers, once.
    hypercorn.errorlog = logging.getLogger("hypercorn.error")
    hypercorn.graceful_timeout = FINAL_WRITE_GRACE_S
    return hypercorn


def under_root_path(app: ASGIFramework, root_path: str) -> ASGIFramework:
    """The app behind a proxy that serves it under `root_path` (--root-path): a request path
    is served with or without the prefix. Paths the proxy stripped get it back, as uvicorn puts
    it back for vLLM, and Quart takes it off again (an ASGI path includes the root path)."""
    if not root_path:
        return app

    async def asgi(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope["path"]
            if path != root_path and not path.startswith(root_path + "/"):
                scope = {**scope, "path": root_path + path}  # type: ignore[assignment]
        await app(scope, receive, send)

    return asgi


async def serve_app(
    app: Quart,
    config: ServerConfig,
    shutdown_trigger: Callable[[], Awaitable[object]],
    on_listening: Callable[[], None] = lambda: None,
) -> None:
    """Serves until `shutdown_trigger` returns, then drains: the port stays open and answers 503
    while the requests in flight get `config.shutdown_timeout_s` to finish; then Hypercorn stops.

    The socket listens before `on_listening` is called, so a client told then can connect at once.
    """
    drain = app_drain(app)
    if config.uds is not None:
        sock = listen_unix_socket(config.uds)
    else:
        sock = listen_socket(config.host, config.port)
    on_listening()

    async def drained() -> None:
        await shutdown_trigger()
        await drain.run(FINAL_WRITE_GRACE_S)

    # Hypercorn takes the descriptor over (it wraps it in a socket of its own and closes that).
    try:
        await serve(
            under_root_path(app, config.root_path),
            hypercorn_config(sock.detach(), config),
            shutdown_trigger=drained,
        )
    finally:
        if config.uds is not None:  # the socket file goes with the server
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config.uds)
