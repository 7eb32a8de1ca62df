"""A real Hypercorn server on 127.0.0.1 in a background thread, for tests that use real clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from types import TracebackType

import uvloop
from quart import Quart

from server.config import ServerConfig
from server.serve import serve_app

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LiveServer:
    def __init__(self, app: Quart, config: ServerConfig) -> None:
        self._app = app
        self._config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)
        self.url = f"http://{config.host}:{config.port}"

    def _run(self) -> None:
        uvloop.run(self._serve())  # the loop pipeline-serve runs on

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await serve_app(self._app, self._config, self._stop.wait)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self._config.host, self._config.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"the test server did not start on {self.url}")

    def begin_shutdown(self) -> None:
        """What SIGTERM does to pipeline-serve: the drain starts (server.drain)."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # it stopped meanwhile: its loop is closed
                self._loop.call_soon_threadsafe(self._stop.set)

    def wait_stopped(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.begin_shutdown()
        self.wait_stopped()
