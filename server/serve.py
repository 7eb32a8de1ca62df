"""Runs the app on Hypercorn until a shutdown trigger fires."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart

from server.config import ServerConfig


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hypercorn = HypercornConfig()
    hypercorn.bind = [bind_address(config.host, config.port)]
    hypercorn.accesslog = None  # the app logs each request it finishes, with its request id
    # A Logger (not a path) makes Hypercorn log through the process's handlers, once.
    hypercorn.errorlog = logging.getLogger("hypercorn.error")
    hypercorn.graceful_timeout = config.shutdown_timeout_s
    return hypercorn


async def serve_app(
    app: Quart, config: ServerConfig, shutdown_trigger: Callable[[], Awaitable[object]]
) -> None:
    """Serves until `shutdown_trigger` returns, then lets open requests finish (graceful_timeout)."""
    await serve(app, hypercorn_config(config), shutdown_trigger=shutdown_trigger)
