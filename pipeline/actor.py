"""Actors: a stage is one OS process that reads its inbox rings and writes its outbox rings.

`AsyncActor.run` runs on a uvloop event loop; `SyncActor.run` is a plain loop for stages where a
blocking loop is faster. `run_actor` is the process entry: it titles the process (when the owner
gave a title), arms parent-death signalling, sets up logging bound with the stage name, attaches
the rings, reports attached, warms up, freezes the GC generations that warm-up created, reports
ready, and runs the actor until it returns or is told to stop (SIGTERM). An exception becomes the
actor's error text in the control block and exit code 1.

An async actor can outlive the death of a ring's peer when the supervisor restarts that peer alone:
it reads what the dead peer published, gets PeerDied, and `ActorContext.reattach` puts it on the
ring's next generation.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import gc
import importlib
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, ClassVar

import setproctitle
import structlog
import uvloop

from pipeline.broadcast import BroadcastHandle, BroadcastReader, BroadcastWriter
from pipeline.control import ActorState, ControlBlock, ControlHandle
from pipeline.errors import PeerDied, RingClosed
from pipeline.kept import KeptFile
from pipeline.logs import configure_logging
from pipeline.names import process_start_ticks
from pipeline.ring import Consumer, Producer, RingHandle
from pipeline.trace import TraceBuffer, TraceHandle

PR_SET_PDEATHSIG = 1
# How long a surviving actor waits for the successor of a ring whose peer died, and how often it
# looks: the supervisor creates it before it spawns the peer again.
REATTACH_TIMEOUT_S = 300.0
REATTACH_POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """What to run in one process: `entry` is "module:Class" of an AsyncActor or SyncActor."""

    name: str
    entry: str
    config: Any = None
    inboxes: tuple[str, ...] = ()
    outboxes: tuple[str, ...] = ()
    spin_s: float = 50e-6
    liveness_interval_s: float = 0.1
    heartbeat_interval_s: float = 0.5
    # Kept files (pipeline/kept.py) the actor finds again, as it left them, when it is restarted.
    kept_files: tuple[str, ...] = ()
    # The CPUs the process may run on (sched_setaffinity), set before the actor is made; empty:
    # wherever the OS puts it.
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ActorLaunch:
    """Everything a child process needs; pickled once at spawn."""

    spec: ActorSpec
    index: int
    control: ControlHandle
    rings: dict[str, RingHandle | BroadcastHandle]
    trace: TraceHandle
    parent_pid: int
    log_format: str
    log_level: str
    process_title: str | None = None  # what ps shows for the process (None: leave it)
    log_fields: tuple[tuple[str, str], ...] = ()  # bound to every line, beside stage=
    kept: dict[str, KeptFile] = field(default_factory=dict)  # by the names in spec.kept_files


class StopRequested(BaseException):
    """Raised in a SyncActor by SIGTERM: unwinds the loop like KeyboardInterrupt does."""


class ActorContext:
    """What an actor sees of the runtime: its config, rings, logger and stop/heartbeat hooks."""

    def __init__(self, launch: ActorLaunch, control: ControlBlock) -> None:
        spec = launch.spec
        self.name = spec.name
        self.config = spec.config
        self.log = structlog.get_logger("pipeline.actor")
        self.trace: TraceBuffer = launch.trace.attach()
        """Spans of this actor's work, for pipeline-bench (see pipeline/trace.py)."""
        self._control = control
        self._index = launch.index
        self.stopping = False
        self.kept = launch.kept
        options: dict[str, Any] = {
            "spin_s": spec.spin_s,
            "liveness_interval_s": spec.liveness_interval_s,
            "heartbeat": self.heartbeat,
        }
        self._options = options
        broadcast_options = {k: v for k, v in options.items() if k != "spin_s"}
        self.inbox: dict[str, Consumer] = {}
        self.outbox: dict[str, Producer] = {}
        self.broadcast_in: dict[str, BroadcastReader] = {}
        self.broadcast_out: dict[str, BroadcastWriter] = {}
        try:
            for ring in spec.inboxes:
                handle = launch.rings[ring]
                if isinstance(handle, BroadcastHandle):  # it never spins: no spin_s
                    self.broadcast_in[ring] = handle.reader_end(**broadcast_options)
                else:
                    self.inbox[ring] = Consumer(handle, **options)
            for ring in spec.outboxes:
                handle = launch.rings[ring]
                if isinstance(handle, BroadcastHandle):
                    self.broadcast_out[ring] = handle.writer(**broadcast_options)
                else:
                    self.outbox[ring] = Producer(handle, **options)
        except BaseException:
            self.close_rings()
            raise

    def heartbeat(self) -> None:
        self._control.beat(self._index)

    def set_gauges(self, values: list[float]) -> None:
        """Publish up to NUM_GAUGES (64) numbers for the owner to read (Supervisor.gauges)."""
        self._control.set_gauges(self._index, values)

    def close_rings(self) -> None:
        for end in (*self.outbox.values(), *self.inbox.values()):
            end.close()
        for broadcast in (*self.broadcast_out.values(), *self.broadcast_in.values()):
            broadcast.close()
        self.trace.close()

    async def reattach(self, ring: str, timeout_s: float = REATTACH_TIMEOUT_S) -> None:
        """Replace this actor's end of `ring`, whose peer died, by an end of the ring's next
        generation, which the supervisor creates when it restarts that peer alone. Read what the
        dead peer published first: the old end is closed here. PeerDied if no successor comes
        within timeout_s (the supervisor restarts more than the peer, or stops)."""
        ends: dict[str, Consumer] | dict[str, Producer] = (
            self.inbox if ring in self.inbox else self.outbox
        )
        old = ends[ring]
        handle = old.handle.successor()
        deadline = time.monotonic() + timeout_s
        while not handle.exists():
            if time.monotonic() > deadline:
                raise PeerDied(f"ring {ring!r}: no successor to the dead peer's ring")
            await asyncio.sleep(REATTACH_POLL_S)
        old.close()
        ends[ring] = type(old)(handle, **self._options)  # type: ignore[assignment]
        self.log.info("reattached", ring=ring, generation=handle.generation)


class AsyncActor(abc.ABC):
    """A stage whose loop is a coroutine on uvloop. SIGTERM cancels `run`."""

    mode: ClassVar[str] = "async"

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx

    def warm_up(self) -> None:
        """Load and prepare before reporting ready (a model, a tokenizer)."""

    @abc.abstractmethod
    async def run(self) -> None:
        """The actor's loop; return to exit cleanly."""


class SyncActor(abc.ABC):
    """A stage with a blocking loop. SIGTERM raises StopRequested inside `run`."""

    mode: ClassVar[str] = "sync"

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx

    def warm_up(self) -> None:
        """Load and prepare before reporting ready."""

    @abc.abstractmethod
    def run(self) -> None:
        """The actor's loop; return to exit cleanly."""


def load_entry(entry: str) -> type[AsyncActor] | type[SyncActor]:
    module_name, _, attr = entry.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, AsyncActor | SyncActor)):
        raise TypeError(f"{entry} is not an AsyncActor or SyncActor")
    return cls


def arm_parent_death_signal(parent_pid: int) -> None:
    """Have the kernel send SIGTERM when the parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(0)


def set_process_title(title: str, name: str) -> None:
    """`title` as the command line ps and `top -c` show, `name` as the command name (at most 15
    bytes) that plain top and pgrep show, so that each stage can be told apart there too."""
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(name)


def run_actor(launch: ActorLaunch) -> None:
    """Process entry of every actor."""
    if launch.process_title is not None:
        set_process_title(launch.process_title, launch.spec.name)
    if launch.spec.cpus:
        os.sched_setaffinity(0, launch.spec.cpus)
    # The supervisor owns the shutdown order; a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    arm_parent_death_signal(launch.parent_pid)
    configure_logging(
        launch.log_format, launch.log_level, stage=launch.spec.name, **dict(launch.log_fields)
    )
    log = structlog.get_logger("pipeline.actor")
    control = launch.control.attach()
    index = launch.index
    control.set_pid(index, os.getpid(), process_start_ticks(os.getpid()))
    control.set_state(index, ActorState.STARTING)
    control.beat(index)
    ctx: ActorContext | None = None
    try:
        ctx = ActorContext(launch, control)
        control.set_state(index, ActorState.ATTACHED)
        actor = load_entry(launch.spec.entry)(ctx)
        actor.warm_up()
        gc.collect()
        gc.freeze()
        control.beat(index)
        control.set_state(index, ActorState.READY)
        log.debug("actor ready", pid=os.getpid())
        if isinstance(actor, AsyncActor):
            uvloop.run(_run_async(actor, ctx, launch))
        else:
            _run_sync(actor)
        control.set_state(index, ActorState.EXITED)
    except BaseException as exc:
        if _is_clean_stop(exc):
            control.set_state(index, ActorState.EXITED)
            log.debug("actor stopped", reason=type(exc).__name__)
            return _exit(ctx, control, 0)

        control.set_error(index, "".join(traceback.format_exception_only(exc)).strip())
        control.set_state(index, ActorState.FAILED)
        if _only_peer_died(exc):  # the consequence of another's failure, not a cause
            log.warning("actor stopped: a peer died", error=str(exc))
            return _exit(ctx, control, PEER_DIED_EXIT_CODE)
        log.error("actor failed", exc_info=True)
        return _exit(ctx, control, 1)
    _exit(ctx, control, 0)


PEER_DIED_EXIT_CODE = 3  # the actor ended because the process at the other end of a ring died


def _only_peer_died(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_peer_died(e) for e in exc.exceptions)
    return isinstance(exc, PeerDied)


def _exit(ctx: ActorContext | None, control: ControlBlock, code: int) -> None:
    # Only a clean stop closes the rings: a closed end tells the peer to stop too, while a peer
    # of a failed actor sees it die, and may wait for a restarted one (ActorContext.reattach).
    if ctx is not None and code == 0:
        ctx.close_rings()
    control.close()
    sys.stderr.flush()
    os._exit(code)


def _is_clean_stop(exc: BaseException) -> bool:
    """SIGTERM, or an upstream peer that closed its end (the shutdown sequence), possibly grouped."""
    if isinstance(exc, StopRequested | RingClosed | asyncio.CancelledError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_clean_stop(e) for e in exc.exceptions)
    return False


def _run_sync(actor: SyncActor) -> None:
    def on_sigterm(signum: int, frame: object) -> None:
        actor.ctx.stopping = True
        raise StopRequested

    signal.signal(signal.SIGTERM, on_sigterm)
    actor.run()


async def _run_async(actor: AsyncActor, ctx: ActorContext, launch: ActorLaunch) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None

    def on_sigterm() -> None:
        ctx.stopping = True
        main.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)

    async def beat() -> None:
        while True:
            ctx.heartbeat()
            await asyncio.sleep(launch.spec.heartbeat_interval_s)

    heart = asyncio.create_task(beat())
    try:
        await actor.run()
    except asyncio.CancelledError:
        if not ctx.stopping:
            raise
    finally:
        heart.cancel()
