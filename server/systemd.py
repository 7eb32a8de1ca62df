"""systemd's notify protocol (sd_notify(3)) in the standard library: READY=1, STATUS= lines,
WATCHDOG=1 only while the pipeline makes progress, STOPPING=1. Without $NOTIFY_SOCKET (not
started by systemd, or Type= other than notify) every call does nothing."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

log = structlog.get_logger("server")

STATUS_PERIOD_S = 1.0  # how often `monitor` looks at the pipeline


class Notifier:
    """Datagrams to the service manager's socket; `watchdog_s` is $WATCHDOG_USEC in seconds when
    the watchdog is on for this process, else None."""

    def __init__(self, address: str | bytes | None, watchdog_s: float | None = None) -> None:
        self._address = address
        self.watchdog_s = watchdog_s if address is not None else None
        self._socket: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], pid: int) -> Notifier:
        """As sd_notify and sd_watchdog_enabled read the environment systemd gives the service."""
        path = environ.get("NOTIFY_SOCKET", "")
        address: str | bytes | None = None
        if path.startswith("@"):  # the abstract namespace
            address = b"\0" + path[1:].encode()
        elif path.startswith("/"):
            address = path
        elif path:
            log.warning("NOTIFY_SOCKET is not a unix socket path; not notifying", address=path)
        return cls(address, _watchdog_s(environ, pid))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> None:
        """One datagram of newline-separated VARIABLE=value assignments; a service manager gone
        away is logged once and never stops the server."""
        if self._address is None:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.sendto("\n".join(assignments).encode(), self._address)
        except OSError as error:
            if not self._failed:
                log.warning("cannot notify systemd", error=str(error))
            self._failed = True

    def ready(self) -> None:
        self.notify("READY=1")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _watchdog_s(environ: Mapping[str, str], pid: int) -> float | None:
    usec, watchdog_pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
    if not usec:
        return None
    try:
        if watchdog_pid and int(watchdog_pid) != pid:
            return None  # the watchdog is some other process's (sd_watchdog_enabled's rule)
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC or WATCHDOG_PID is not a number; no watchdog", usec=usec)
        return None
    return value / 1e6 if value > 0 else None


@dataclass(slots=True, frozen=True)
class PipelineState:
    """What `monitor` reads of the server at each look."""

    ready: bool  # every stage is up (not starting, not restarting after a failure)
    in_flight: int  # engine requests being served
    last_output_ns: int  # time.monotonic_ns() of the engine's last output
    waiting_since_ns: int | None = None  # since when the longest-waiting request has waited
    draining: bool = False
    failed_stage: str | None = None  # the stage whose failure the pipeline restarts after


def status_line(state: PipelineState) -> str:
    if state.draining:
        return f"draining {state.in_flight} streams"
    if not state.ready:
        return f"restarting {state.failed_stage}" if state.failed_stage else "starting stages"
    return f"serving {state.in_flight} streams"


def making_progress(state: PipelineState, now_ns: int, window_s: float) -> bool:
    """Healthy, and either no request waits for the engine or there was output within `window_s`
    (or the wait began within it): a hung stage fails this, a client that reads slowly does not."""
    if not state.ready:
        return False
    if state.waiting_since_ns is None:
        return True
    return now_ns - max(state.last_output_ns, state.waiting_since_ns) < window_s * 1e9


async def monitor(
    notifier: Notifier,
    read_state: Callable[[], PipelineState],
    period_s: float = STATUS_PERIOD_S,
) -> None:
    """Until cancelled: STATUS= whenever the line changes; with the watchdog on, WATCHDOG=1 every
    half of its interval while the pipeline makes progress, and none while it makes none (then
    systemd kills and restarts the service when the interval runs out)."""
    if not notifier.enabled:
        return
    watchdog_s = notifier.watchdog_s
    ping_every_s = watchdog_s / 2 if watchdog_s is not None else None
    if ping_every_s is not None:
        period_s = min(period_s, ping_every_s)
    last_line = ""
    last_ping = -float("inf")
    stalled = False
    while True:
        state = read_state()
        line = status_line(state)
        if line != last_line:
            notifier.status(line)
            last_line = line
        if watchdog_s is not None and ping_every_s is not None:
            now = time.monotonic()
            if making_progress(state, time.monotonic_ns(), watchdog_s):
                if stalled:
                    log.info("the pipeline makes progress again; pinging systemd's watchdog")
                    stalled = False
                if now - last_ping >= ping_every_s * 0.99:  # sleeps can end a hair early
                    notifier.watchdog()
                    last_ping = now
            elif not stalled:
                log.warning(
                    "the pipeline makes no progress; not pinging systemd's watchdog",
                    ready=state.ready,
                    in_flight=state.in_flight,
                    watchdog_s=watchdog_s,
                )
                stalled = True
        await asyncio.sleep(period_s)
