"""Owner processes for the supervisor tests: each runs a Supervisor and is then signalled or killed."""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from pipeline.actor import ActorSpec
from pipeline.logs import configure_logging
from pipeline.ring import RingSpec
from pipeline.supervisor import Supervisor, SupervisorConfig, until_signal
from tests.pipeline.peers import BLOB, VOCAB


def chain() -> Supervisor:
    rings = [RingSpec(n, VOCAB, 8, 4096) for n in ("in", "mid", "out")]
    actors = [
        ActorSpec("doubler", "tests.pipeline.peers:Doubler", inboxes=("in",), outboxes=("mid",)),
        ActorSpec(
            "incrementer", "tests.pipeline.peers:Incrementer", inboxes=("mid",), outboxes=("out",)
        ),
    ]
    return Supervisor(
        rings,
        actors,
        SupervisorConfig(log_format="json"),
        owner_inboxes=("out",),
        owner_outboxes=("in",),
    )


def serve_until_signal() -> None:
    """Start the chain, print the actor pids, run until SIGTERM/SIGINT, stop in order."""
    sup = chain()
    sup.start()
    sup.producers["in"].send(BLOB, {"meta": np.zeros(3, np.int64), "data": np.array([5], np.uint8)})
    with sup.consumers["out"].recv(timeout_s=10) as msg:
        assert msg["data"].tolist() == [11]

    async def main() -> None:
        waiting = asyncio.create_task(until_signal())
        await asyncio.sleep(0)  # the handlers are installed before we say we are ready
        print("READY", sup.namespace, *sup.pids().values(), flush=True)
        await waiting

    asyncio.run(main())
    sup.stop(order=["doubler", "incrementer"])
    print("STOPPED", flush=True)


def hang_in_start() -> None:
    """Create names and spawn an actor that never gets ready; the test SIGKILLs this process."""
    rings = [RingSpec("x", VOCAB, 2, 256)]
    actors = [ActorSpec("slow", "tests.pipeline.peers:FailsWarmUp", inboxes=("x",))]
    sup = Supervisor(rings, actors, SupervisorConfig(log_format="json"), owner_outboxes=("x",))
    sup._unlink_names = lambda: None  # type: ignore[method-assign]  # keep the names, as if killed early
    sup._wait_for = lambda state: time.sleep(3600)  # type: ignore[method-assign]
    print("STARTING", flush=True)
    sup.start()


if __name__ == "__main__":
    configure_logging("json")
    {"serve": serve_until_signal, "hang": hang_in_start}[sys.argv[1]]()
