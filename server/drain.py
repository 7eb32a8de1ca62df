"""The end of serving: refuse new requests, let those in flight finish for a while, end the rest.

Every engine request's outputs pass through an `InFlight` of the app's `Drain`, so the server
knows how many it is serving and can end them; `Drain.run` is what `server.serve.serve_app` does
between the shutdown signal and Hypercorn's stop (docs/ARCHITECTURE.md, "Shutdown sequence").
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator

import msgspec
import structlog
from quart import Blueprint, Quart, Response, current_app, request

from server.errors import APIError, retry_after_header
from stages.api import RequestOutput

log = structlog.get_logger("server")

EXTENSION = "pipeline_serve.drain"
STILL_SERVED = frozenset({"/metrics"})  # a scrape during the drain sees it to the end
POLL_S = 0.05


class ShuttingDown(APIError):
    """A 503 because the server is stopping: for a new request, or one the shutdown timeout ended.
    Its response says when to come back (Retry-After) and closes the connection."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, status=503, retry_after_s=retry_after_s)


class Drain:
    """The engine requests in flight, and the drain that ends serving."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # Weak: a response dropped before its body was read (a client gone at once) leaves no entry.
        self._in_flight: weakref.WeakSet[InFlight] = weakref.WeakSet()
        self._deadline: float | None = None  # time.monotonic() when the drain ends what is left
        self._ending = False

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def oldest_wait_ns(self) -> int | None:
        """time.monotonic_ns() since which the longest-waiting request has waited for the engine's
        next output; None when none waits (a request whose client reads slowly does not)."""
        return min(
            (f.waiting_since_ns for f in self._in_flight if f.waiting_since_ns is not None),
            default=None,
        )

    def track(self, outputs: AsyncIterator[RequestOutput]) -> InFlight:
        """`outputs` as an iterator the drain can end; raises ShuttingDown once it ends requests."""
        if self._ending:
            raise self.ended()
        flight = InFlight(self, outputs)
        self._in_flight.add(flight)
        return flight

    def _retry_after_s(self) -> float:
        """Until the drain is over: the earliest this address can serve again (restarted)."""
        return 0.0 if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def refused(self) -> ShuttingDown:
        return ShuttingDown(
            "the server is shutting down and takes no new requests", self._retry_after_s()
        )

    def ended(self) -> ShuttingDown:
        return ShuttingDown(
            f"the server shut down before the request finished "
            f"(shutdown timeout {self.timeout_s:g} s)",
            self._retry_after_s(),
        )

    async def run(self, grace_s: float) -> None:
        """Refuse new requests from now on; give those in flight `timeout_s` to finish, then end
        them (each gets a ShuttingDown) and give them `grace_s` to write it."""
        self._deadline = time.monotonic() + self.timeout_s
        log.info("draining", in_flight=self.in_flight, timeout_s=self.timeout_s)
        if await self._wait_idle(self._deadline):
            log.info("drained")
            return
        log.warning("shutdown timeout: ending the requests in flight", in_flight=self.in_flight)
        self._ending = True
        for flight in list(self._in_flight):
            flight.end()
        await self._wait_idle(time.monotonic() + grace_s)

    async def _wait_idle(self, deadline: float) -> bool:
        while self._in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True


class InFlight:
    """One engine request's outputs as the drain sees them. `end` makes the iteration raise
    ShuttingDown: at once if the request is waiting for the engine, else at its next output."""

    __slots__ = ("__weakref__", "_drain", "_ended", "_outputs", "_waiting", "waiting_since_ns")

    def __init__(self, drain: Drain, outputs: AsyncIterator[RequestOutput]) -> None:
        self._drain = drain
        self._outputs = outputs
        self._waiting: asyncio.Task[object] | None = None  # the task inside `await`, if any
        self.waiting_since_ns: int | None = None  # time.monotonic_ns() it began to, if it is
        self._ended = False

    def __aiter__(self) -> InFlight:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            await self.aclose()
            raise self._drain.ended()
        task = self._waiting = asyncio.current_task()
        self.waiting_since_ns = time.monotonic_ns()
        try:
            output = await anext(self._outputs)
        except asyncio.CancelledError:
            self._drain._in_flight.discard(self)
            # Ours (end) and no one else's: the task goes on, to answer the error.
            if self._ended and task is not None and task.uncancel() == 0:
                raise self._drain.ended() from None
            raise
        except BaseException:
            self._drain._in_flight.discard(self)
            raise
        finally:
            self._waiting = self.waiting_since_ns = None
        if output.finish_reason is not None:
            self._drain._in_flight.discard(self)
        return output

    def end(self) -> None:
        self._ended = True
        if self._waiting is not None:
            # The task is suspended in __anext__'s await: the cancellation lands there (in the
            # engine's stream, which aborts the request) and comes out as ShuttingDown.
            self._waiting.cancel()

    async def aclose(self) -> None:
        self._drain._in_flight.discard(self)
        aclose = getattr(self._outputs, "aclose", None)
        if aclose is not None:
            await aclose()


routes = Blueprint("drain", __name__)


def install_drain(app: Quart, drain: Drain) -> None:
    """While `drain` drains, `app` answers every request but /metrics with a ShuttingDown 503."""
    app.extensions[EXTENSION] = drain
    app.register_blueprint(routes)


def app_drain(app: Quart) -> Drain:
    drain: Drain = app.extensions[EXTENSION]
    return drain


@routes.before_app_request
async def refuse_while_draining() -> None:
    drain = app_drain(current_app)
    if drain.draining and request.path not in STILL_SERVED:
        raise drain.refused()


@routes.app_errorhandler(ShuttingDown)
async def shutting_down(error: ShuttingDown) -> Response:
    return Response(
        msgspec.json.encode(error.body()),
        status=error.status,
        content_type="application/json",
        headers={
            "Retry-After": retry_after_header(error.retry_after_s or 0.0),  # at least 1
            "Connection": "close",
        },
    )
