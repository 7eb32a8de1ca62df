"""The supervisor: creates the rings, spawns the actors, runs the start-up handshake, watches them, and
shuts them down in order.

Start-up: sweep names of dead supervisors; create the control block and every ring under a fresh
namespace; spawn each actor; wait until every actor (and the owner's own ring ends) has attached;
unlink every name, so that nothing stays in /dev/shm whatever dies later; wait until every actor is
ready. A child that dies or fails during start-up fails `start()` with its reason.

Watching: a dead child is seen at once through its process sentinel, a hung one by its heartbeat
going stale; either becomes an `ActorFailed(actor, reason)` for the owner.

Restarting one actor alone (`restart_async`): fresh rings for its edges, a new process on them; the
owner's ends and the surviving peers' move to the fresh rings, which are unlinked once all have
attached, as at start. A kept file (pipeline/kept.py) outlives the actor's restarts.

Shutdown (`stop`): SIGTERM to the actors in the order given (upstream first), each given
`stop_timeout_s` to exit before SIGKILL; then the owner's ring ends and the control block are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.process
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import structlog

from pipeline.actor import PEER_DIED_EXIT_CODE, ActorLaunch, ActorSpec, run_actor
from pipeline.broadcast import BroadcastHandle, BroadcastSpec
from pipeline.clock import now_ns
from pipeline.control import ActorState, ControlBlock, ControlHandle
from pipeline.errors import ActorFailed
from pipeline.kept import KeptFile
from pipeline.names import new_namespace, pid_alive, sweep_stale
from pipeline.ring import Consumer, Producer, RingHandle, RingSpec
from pipeline.trace import TraceBuffer, TraceHandle

log = structlog.get_logger("pipeline.supervisor")

OWNER = "owner"
# How long an actor that ended because a peer died waits to be named the failure while that
# peer is still being torn down (a large process's memory can take a second to unmap)
CAUSE_GRACE_S = 10.0
"""The name under which the supervising process's own ring ends are declared."""


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    startup_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 30.0
    stop_timeout_s: float = 5.0
    log_format: str = "auto"
    log_level: str = "info"
    spin_s: float = 50e-6
    liveness_interval_s: float = 0.1
    # Set: each actor's process is titled "<prefix>: <actor name>" in ps and top.
    process_title_prefix: str | None = None
    # Fields bound to every line each actor logs, beside stage= (e.g. which of several pipelines).
    log_fields: tuple[tuple[str, str], ...] = ()


class Supervisor:
    """Owns a set of actors and the rings between them (and the owner's own ends of some rings)."""

    def __init__(
        self,
        rings: Sequence[RingSpec | BroadcastSpec],
        actors: Sequence[ActorSpec],
        config: SupervisorConfig | None = None,
        owner_inboxes: Sequence[str] = (),
        owner_outboxes: Sequence[str] = (),
        kept: dict[str, dict[str, KeptFile]] | None = None,
    ) -> None:
        """`kept`: kept files a supervisor before this one handed over (`take_kept`)."""
        self.config = config or SupervisorConfig()
        self.ring_specs = {r.name: r for r in rings}
        self.actor_specs = list(actors)
        self._owner_inboxes = tuple(owner_inboxes)
        self._owner_outboxes = tuple(owner_outboxes)
        self._check_topology()
        self.namespace = ""
        self._handles: dict[str, RingHandle] = {}
        self._broadcasts: dict[str, BroadcastHandle] = {}
        self._control_handle: ControlHandle | None = None
        self._control: ControlBlock | None = None
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._traces: dict[str, TraceHandle] = {}
        self._kept: dict[str, dict[str, KeptFile]] = kept or {}  # by actor, then file name
        self.traces: dict[str, TraceBuffer] = {}
        """Each actor's trace buffer, owner side: `read_new()` gives the spans since the last read."""
        self.consumers: dict[str, Consumer] = {}
        self.producers: dict[str, Producer] = {}
        self._failure: ActorFailed | None = None
        self._consequence_seen_ns: int | None = None  # when a peer-died exit was first seen
        self._stopped = False

    def _check_topology(self) -> None:
        """Every ring: exactly one producer and one consumer, a broadcast ring one producer and
        its n_readers consumers, all actors (ring invariant 1)."""
        producers: dict[str, list[str]] = {name: [] for name in self.ring_specs}
        consumers: dict[str, list[str]] = {name: [] for name in self.ring_specs}
        ends = [(a.name, a.inboxes, a.outboxes) for a in self.actor_specs]
        ends.append((OWNER, self._owner_inboxes, self._owner_outboxes))
        for who, inboxes, outboxes in ends:
            for ring in inboxes:
                consumers.setdefault(ring, []).append(who)
            for ring in outboxes:
                producers.setdefault(ring, []).append(who)
        for ring in sorted(set(producers) | set(consumers)):
            if ring not in self.ring_specs:
                raise ValueError(f"ring {ring!r} is used but not declared")
            spec = self.ring_specs[ring]
            readers = spec.n_readers if isinstance(spec, BroadcastSpec) else 1
            if len(producers[ring]) != 1 or len(consumers[ring]) != readers:
                wanted = "one consumer" if readers == 1 else f"{readers} consumers"
                raise ValueError(
                    f"ring {ring!r} needs exactly one producer and {wanted}, has "
                    f"producers {producers[ring]} and consumers {consumers[ring]}"
                )
            if isinstance(spec, BroadcastSpec) and OWNER in (*producers[ring], *consumers[ring]):
                raise ValueError(f"broadcast ring {ring!r} connects actors only")
        names = [a.name for a in self.actor_specs]
        if len(set(names)) != len(names) or OWNER in names:
            raise ValueError(f"actor names must be unique and not {OWNER!r}: {names}")

    # -- start-up --------------------------------------------------------------------------------

    def start(self) -> None:
        """Create, spawn, handshake. Raises ActorFailed (after cleaning up) if an actor fails."""
        try:
            self._launch()
            for _ in self._handshake():
                time.sleep(0.005)
        except BaseException:
            self.stop()
            raise

    async def start_async(self) -> None:
        """As start, from an event loop: the loop keeps running while the actors warm up.

        The actors are spawned from the loop's thread, on purpose: the kernel's parent-death signal
        fires when the spawning thread ends, so spawning from a worker thread would be fragile.
        """
        try:
            self._launch()
            for _ in self._handshake():
                await asyncio.sleep(0.005)
        except BaseException:
            self.stop()
            raise

    def _launch(self) -> None:
        sweep_stale()
        self.namespace = new_namespace()
        self._control_handle = ControlHandle.create(self.namespace, len(self.actor_specs))
        self._control = self._control_handle.attach()
        for spec in self.ring_specs.values():
            if isinstance(spec, BroadcastSpec):
                self._broadcasts[spec.name] = BroadcastHandle.create(self.namespace, spec)
            else:
                self._handles[spec.name] = RingHandle.create(self.namespace, spec)
        for actor in self.actor_specs:
            self._traces[actor.name] = TraceHandle.create(self.namespace, actor.name)
            self.traces[actor.name] = self._traces[actor.name].attach()
            adopted = self._kept.get(actor.name, {})
            self._kept[actor.name] = {
                name: adopted.get(name) or KeptFile.create(f"{self.namespace}.{actor.name}.{name}")
                for name in actor.kept_files
            }
        self._spawn_all()
        for ring in self._owner_inboxes:
            self.consumers[ring] = Consumer(self._handles[ring], **self._end_options)
        for ring in self._owner_outboxes:
            self.producers[ring] = Producer(self._handles[ring], **self._end_options)

    @property
    def _end_options(self) -> dict[str, float]:
        return {
            "spin_s": self.config.spin_s,
            "liveness_interval_s": self.config.liveness_interval_s,
        }

    def _handshake(self) -> Iterator[None]:
        """Yields while waiting; returns once every actor is ready (names unlinked on the way)."""
        yield from self._wait_for(ActorState.ATTACHED)
        self._unlink_names()
        yield from self._wait_for(ActorState.READY)
        log.info(
            "actors ready", actors=[a.name for a in self.actor_specs], namespace=self.namespace
        )

    def _spawn_all(self) -> None:
        readers_so_far = dict.fromkeys(self._broadcasts, 0)
        for index, spec in enumerate(self.actor_specs):
            rings: dict[str, RingHandle | BroadcastHandle] = {}
            for ring in (*spec.inboxes, *spec.outboxes):
                if ring in self._handles:
                    rings[ring] = self._handles[ring]
                elif ring in spec.inboxes:  # readers are numbered in the order actors are declared
                    rings[ring] = self._broadcasts[ring].for_reader(readers_so_far[ring])
                    readers_so_far[ring] += 1
                else:
                    rings[ring] = self._broadcasts[ring]
            self._procs.append(self._spawn(index, spec, rings))

    def _spawn(
        self, index: int, spec: ActorSpec, rings: dict[str, RingHandle | BroadcastHandle]
    ) -> multiprocessing.process.BaseProcess:
        assert self._control_handle is not None
        prefix = self.config.process_title_prefix
        launch = ActorLaunch(
            spec=spec,
            index=index,
            control=self._control_handle,
            rings=rings,
            trace=self._traces[spec.name],
            parent_pid=os.getpid(),
            log_format=self.config.log_format,
            log_level=self.config.log_level,
            process_title=None if prefix is None else f"{prefix}: {spec.name}",
            log_fields=self.config.log_fields,
            kept=self._kept[spec.name],
        )
        proc = multiprocessing.get_context("spawn").Process(
            target=run_actor, args=(launch,), name=f"pserve-{spec.name}"
        )
        proc.start()
        return proc

    def kill(self, actor: str) -> None:
        """SIGKILL the actor if it is alive (one that stopped heartbeating, before a restart)."""
        index = next(i for i, spec in enumerate(self.actor_specs) if spec.name == actor)
        if self._procs[index].exitcode is None:
            self._procs[index].kill()

    def take_kept(self) -> dict[str, dict[str, KeptFile]]:
        """Hand the kept files over (to the supervisor of a fresh pipeline): stop keeps them."""
        kept, self._kept = self._kept, {}
        return kept

    async def restart_async(self, actor: str) -> None:
        """Bring back one actor alone while the others run on; it is killed first if it is not
        dead (a stale heartbeat). Each of its rings is replaced by the ring's next generation,
        and the owner's ends of them here: the owner reads what the dead actor published before
        it calls this. Surviving peers find their ring's peer dead and reattach
        (ActorContext.reattach). Raises ActorFailed, as start does, when the new process or a
        peer fails meanwhile; what was made for it is freed by stop then.
        """
        index = next(i for i, spec in enumerate(self.actor_specs) if spec.name == actor)
        spec = self.actor_specs[index]
        dead = self._procs[index]
        if dead.exitcode is None:
            dead.kill()
        await asyncio.to_thread(dead.join)
        assert self._control is not None
        fresh = [*spec.inboxes, *spec.outboxes]
        if any(ring in self._broadcasts for ring in fresh):
            raise ValueError(f"{actor} has a broadcast ring: it restarts with its whole group")
        for ring in fresh:
            old = self._handles[ring]
            self._handles[ring] = RingHandle.create(self.namespace, old.spec, old.generation + 1)
        self.traces.pop(actor).close()
        self._traces[actor] = TraceHandle.create(self.namespace, actor)
        self.traces[actor] = self._traces[actor].attach()
        self._control.reset(index)
        self._failure = None
        self._consequence_seen_ns = None
        self._procs[index] = self._spawn(index, spec, {r: self._handles[r] for r in fresh})
        for ring in fresh:
            if ring in self._owner_inboxes:
                self.consumers[ring].close()
                self.consumers[ring] = Consumer(self._handles[ring], **self._end_options)
            if ring in self._owner_outboxes:
                self.producers[ring].close()
                self.producers[ring] = Producer(self._handles[ring], **self._end_options)
        for _ in self._wait_for(ActorState.ATTACHED):
            await asyncio.sleep(0.005)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not all(self._handles[ring].ends_attached() for ring in fresh):
            failure = self.check()
            if failure is not None:
                raise failure
            ended = [
                s.name
                for s, p in zip(self.actor_specs, self._procs, strict=True)
                if p.exitcode is not None
            ]
            if ended:
                raise ActorFailed(ended[0], "ended while a peer was restarted")
            if time.monotonic() > deadline:
                raise ActorFailed(actor, "its peers did not attach to its fresh rings")
            await asyncio.sleep(0.005)
        for ring in fresh:
            self._handles[ring].unlink()
        self._traces[actor].unlink()
        for _ in self._wait_for(ActorState.READY):
            await asyncio.sleep(0.005)
        log.info("actor restarted", actor=actor, pid=self._procs[index].pid)

    def _wait_for(self, state: ActorState) -> Iterator[None]:
        deadline = time.monotonic() + self.config.startup_timeout_s
        last_progress = time.monotonic()
        while True:
            failure = self.check()
            if failure is not None:
                raise failure
            assert self._control is not None
            states = [self._control.state(i) for i in range(len(self.actor_specs))]
            for proc, actor_state in zip(self._procs, states, strict=True):
                if actor_state in (ActorState.FAILED, ActorState.EXITED):
                    proc.join(self.config.stop_timeout_s)  # it is on its way out: report its exit
            failure = self.check()
            if failure is not None:
                raise failure
            waiting = [
                spec.name
                for spec, actor_state in zip(self.actor_specs, states, strict=True)
                if actor_state < state
            ]
            if not waiting:
                return
            now = time.monotonic()
            if now > deadline:
                raise ActorFailed(
                    waiting[0], f"not {state.name.lower()} after {self.config.startup_timeout_s} s"
                )
            if now - last_progress > 5.0:
                log.info("waiting for actors", state=state.name.lower(), actors=waiting)
                last_progress = now
            yield

    def _unlink_names(self) -> None:
        for handle in self._handles.values():
            handle.unlink()
        for broadcast in self._broadcasts.values():
            broadcast.unlink()
        for trace in self._traces.values():
            trace.unlink()
        if self._control_handle is not None:
            self._control_handle.unlink()

    # -- watching --------------------------------------------------------------------------------

    def gauges(self, actor: str) -> list[float]:
        """The numbers an actor last published with ActorContext.set_gauges."""
        if self._control is None:
            return []
        index = next(i for i, spec in enumerate(self.actor_specs) if spec.name == actor)
        return self._control.gauges(index)

    def pids(self) -> dict[str, int]:
        return {
            spec.name: proc.pid or 0
            for spec, proc in zip(self.actor_specs, self._procs, strict=False)
        }

    def check(self) -> ActorFailed | None:
        """The first failure seen (a dead child, a failed start, a stale heartbeat), else None.

        An actor that ended only because a peer died names the failure only when no other is
        dead or dying: the one that died first is the cause the owner reports and acts on.
        """
        if self._failure is not None or self._control is None:
            return self._failure
        consequence: ActorFailed | None = None
        for i, (spec, proc) in enumerate(zip(self.actor_specs, self._procs, strict=False)):
            state = self._control.state(i)
            if proc.exitcode is not None and not self._stopped:
                if state == ActorState.EXITED and proc.exitcode == 0:
                    continue
                failure = ActorFailed(spec.name, self._death_reason(i, proc))
                if proc.exitcode == PEER_DIED_EXIT_CODE:
                    consequence = consequence or failure
                    continue
                self._failure = failure
                break
            if state == ActorState.READY and self.config.heartbeat_timeout_s > 0:
                age_s = (now_ns() - self._control.heartbeat_ns(i)) / 1e9
                if age_s > self.config.heartbeat_timeout_s:
                    self._failure = ActorFailed(
                        spec.name, f"no heartbeat for {age_s:.1f} s (pid {proc.pid})"
                    )
                    break
        if self._failure is None and consequence is not None:
            if self._cause_still_dying():
                return None
            self._failure = consequence
        if self._failure is not None:
            log.error("actor failed", actor=self._failure.actor, reason=self._failure.reason)
        return self._failure

    def _cause_still_dying(self) -> bool:
        """True while an actor whose end a peer saw die is not yet reaped, for at most
        CAUSE_GRACE_S: /proc shows a killed process's main thread dead (what the peer reads)
        while its other threads still tear down, and only then can it be waited for.

        Also true for one reaped since `check` looked at it (its exit code, read again here, is
        a failure's): the next check names it, where naming the consequence now would not."""
        now = now_ns()
        if self._consequence_seen_ns is None:
            self._consequence_seen_ns = now
        if (now - self._consequence_seen_ns) / 1e9 > CAUSE_GRACE_S:
            return False
        return any(self._dying_or_newly_failed(proc) for proc in self._procs)

    @staticmethod
    def _dying_or_newly_failed(proc: multiprocessing.process.BaseProcess) -> bool:
        if proc.pid is None:
            return False
        code = proc.exitcode
        if code is None:
            return not pid_alive(proc.pid)
        return code not in (0, PEER_DIED_EXIT_CODE)

    def _death_reason(self, i: int, proc: multiprocessing.process.BaseProcess) -> str:
        assert self._control is not None
        code = proc.exitcode
        if code is not None and code < 0:
            reason = f"killed by {signal.Signals(-code).name} (pid {proc.pid})"
        else:
            reason = f"exited with code {code} (pid {proc.pid})"
        error = self._control.error(i)
        return f"{reason}: {error}" if error else reason

    async def watch(self, on_failure: Callable[[ActorFailed], None], period_s: float = 0.5) -> None:
        """Run in the owner's event loop: call on_failure once for the first failure, then return.

        Child exits are seen at once through their sentinels; heartbeats are read every period_s.
        """
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        watched = {p.sentinel: p for p in self._procs}
        for fd in watched:
            loop.add_reader(fd, wake.set)
        try:
            while not self._stopped:
                failure = self.check()
                if failure is not None:
                    on_failure(failure)
                    return
                # A child that ended without a failure (cleanly) keeps its sentinel readable:
                # stop watching it, or every wait would return at once and spin a core.
                for fd in [fd for fd, p in watched.items() if p.exitcode is not None]:
                    loop.remove_reader(fd)
                    del watched[fd]
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
                # comes as the wait ends, and the watch would outlive its owner's stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(period_s):
                        await wake.wait()
                wake.clear()
        finally:
            for fd in watched:
                loop.remove_reader(fd)

    # -- shutdown --------------------------------------------------------------------------------

    def stop(self, order: Iterable[str] | None = None) -> None:
        """Stop every actor (in `order`, upstream first; default: declaration order) and free all."""
        if self._stopped:
            return
        self._stopped = True
        names = list(order) if order is not None else [a.name for a in self.actor_specs]
        names += [a.name for a in self.actor_specs if a.name not in names]
        by_name = {
            spec.name: proc for spec, proc in zip(self.actor_specs, self._procs, strict=False)
        }
        for name in names:
            proc = by_name.get(name)
            if proc is None or proc.exitcode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)  # type: ignore[arg-type]
            proc.join(self.config.stop_timeout_s)
            if proc.exitcode is None:
                log.warning("actor did not stop; killing it", actor=name, pid=proc.pid)
                proc.kill()
                proc.join(5.0)
        for end in (*self.producers.values(), *self.consumers.values()):
            end.close()
        for trace in self.traces.values():
            trace.close()
        self.traces.clear()
        self._unlink_names()
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._control_handle is not None:
            self._control_handle.close_fd()
        for kept in self._kept.values():
            for file in kept.values():
                file.close()
        self._kept.clear()
        log.info("actors stopped", namespace=self.namespace)

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def until_signal(signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> int:
    """Wait in the owner's event loop until one of these signals arrives; return its number."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        if not got.done():
            got.set_result(signum)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, int(sig))
    try:
        return await got
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
