"""Process entries and actors the runtime tests spawn (importable, as spawn requires)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import random
import signal
import threading
import time
import zlib

import numpy as np

from pipeline.actor import AsyncActor, SyncActor
from pipeline.clock import now_ns
from pipeline.errors import PeerDied, RuntimeFault
from pipeline.records import Record, Vocabulary
from pipeline.ring import RingHandle

BLOB = Record("blob", ("meta", np.int64), ("data", np.uint8))
VOCAB = Vocabulary("test", [BLOB])
# meta: [seq, crc32 of data, send time ns]


def make_blob(rng: random.Random, seq: int, max_bytes: int) -> dict[str, np.ndarray]:
    size = rng.randint(0, max_bytes)
    data = np.frombuffer(rng.randbytes(size), np.uint8)
    return {"meta": np.array([seq, zlib.crc32(data), now_ns()], np.int64), "data": data}


def produce(handle: RingHandle, count: int, max_bytes: int, seed: int, pause_s: float) -> None:
    """Send `count` random blobs, pausing up to pause_s between them; count < 0: for ever."""
    rng = random.Random(seed)
    with handle.producer() as producer:
        seq = 0
        while count < 0 or seq < count:
            producer.send(BLOB, make_blob(rng, seq, max_bytes))
            seq += 1
            if pause_s:
                time.sleep(rng.random() * pause_s)


def produce_async(
    handle: RingHandle, count: int, max_bytes: int, seed: int, pause_s: float
) -> None:
    async def main() -> None:
        rng = random.Random(seed)
        with handle.producer() as producer:
            for seq in range(count):
                await producer.send_async(BLOB, make_blob(rng, seq, max_bytes))
                if pause_s:
                    await asyncio.sleep(rng.random() * pause_s)

    asyncio.run(main())


def consume_idle(handle: RingHandle, use_async: bool, seconds: float) -> None:
    """Wait on an empty ring (the CPU test measures this process)."""
    with handle.consumer() as consumer:
        if use_async:

            async def main() -> None:
                with contextlib.suppress(RuntimeFault):
                    await consumer.recv_async(timeout_s=seconds)

            asyncio.run(main())
        else:
            with contextlib.suppress(RuntimeFault):
                consumer.recv(timeout_s=seconds)


def attach_and_hold(handle: RingHandle, attached) -> None:  # type: ignore[no-untyped-def]
    """Attach as the consumer, say so, and never read (the test kills this process)."""
    with handle.consumer():
        attached.set()
        time.sleep(60)


def check_blob(message) -> int:  # type: ignore[no-untyped-def]
    seq, crc, _ = message["meta"].tolist()
    assert zlib.crc32(message["data"]) == crc, f"message {seq} corrupted"
    return seq


class Doubler(AsyncActor):
    """Reads blobs, writes each back with its data doubled (mod 256)."""

    async def run(self) -> None:
        inbox, outbox = self.ctx.inbox["in"], self.ctx.outbox["mid"]
        while True:
            with await inbox.recv_async() as msg:
                meta, data = msg["meta"].copy(), (msg["data"].astype(np.uint16) * 2 % 256)
            await outbox.send_async(BLOB, {"meta": meta, "data": data.astype(np.uint8)})


class DyingDoubler(AsyncActor):
    """An actor whose main thread ends and whose process is killed a second later, as a killed
    process with busy threads dies: its peers see it dead (/proc shows the main thread a
    zombie) a second before the supervisor can reap it."""

    async def run(self) -> None:
        def kill_later() -> None:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_later, daemon=True).start()
        await asyncio.sleep(0.3)
        # the exit system call, not exit_group: only the calling (main) thread ends
        ctypes.CDLL(None).syscall(SYS_EXIT, 0)


# The exit system call's number (ends one thread; exit_group ends the process)
SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine(), 60)


class Incrementer(SyncActor):
    """Reads blobs, writes each back with its data plus one (mod 256)."""

    def run(self) -> None:
        inbox, outbox = self.ctx.inbox["mid"], self.ctx.outbox["out"]
        while True:
            with inbox.recv() as msg:
                meta, data = msg["meta"].copy(), (msg["data"].astype(np.uint16) + 1) % 256
            outbox.send(BLOB, {"meta": meta, "data": data.astype(np.uint8)})


class Fanner(SyncActor):
    """Reads blobs from its ring and broadcasts each to every reader of "fan"."""

    def run(self) -> None:
        inbox, fan = self.ctx.inbox["in"], self.ctx.broadcast_out["fan"]
        while True:
            with inbox.recv() as msg:
                fan.send(BLOB, msg.arrays)


class FanReader(SyncActor):
    """Reads each broadcast blob and writes it back with its data plus its reader index."""

    def run(self) -> None:
        fan = self.ctx.broadcast_in["fan"]
        (outbox,) = self.ctx.outbox.values()
        while True:
            _, arrays = fan.recv()
            data = (arrays["data"].astype(np.uint16) + fan.index) % 256
            outbox.send(BLOB, {"meta": arrays["meta"], "data": data.astype(np.uint8)})


class RemembersFirstPid(Doubler):
    """A Doubler that writes the pid of its first process to its kept file, and publishes what
    the file holds as gauge 0: a restarted one publishes its first process's pid."""

    def warm_up(self) -> None:
        kept = self.ctx.kept["first_pid"]
        if not kept.complete():
            kept.clear()
            with open(kept.path, "w") as f:
                f.write(str(os.getpid()))
            kept.seal()
        with open(kept.path) as f:
            self.first_pid = int(f.read())

    async def run(self) -> None:
        self.ctx.set_gauges([float(self.first_pid)])
        await super().run()


class ReattachingIncrementer(AsyncActor):
    """An Incrementer on asyncio that outlives its upstream peer: when the ring's producer dies it
    attaches the ring's successor (the supervisor restarting that peer alone)."""

    async def run(self) -> None:
        while True:
            try:
                with await self.ctx.inbox["mid"].recv_async() as msg:
                    meta, data = msg["meta"].copy(), (msg["data"].astype(np.uint16) + 1) % 256
            except PeerDied:
                await self.ctx.reattach("mid")
                continue
            await self.ctx.outbox["out"].send_async(
                BLOB, {"meta": meta, "data": data.astype(np.uint8)}
            )


class FailsWarmUp(AsyncActor):
    def warm_up(self) -> None:
        raise RuntimeError("weights file is missing")

    async def run(self) -> None:
        await asyncio.sleep(3600)


class Idle(AsyncActor):
    async def run(self) -> None:
        await asyncio.Event().wait()


class EndsSoon(AsyncActor):
    """Runs half a second, then returns: the actor ends cleanly (exit code 0)."""

    async def run(self) -> None:
        await asyncio.sleep(0.5)


class StopsHeartbeating(SyncActor):
    def run(self) -> None:
        time.sleep(3600)


class Reporter(AsyncActor):
    """Publishes two gauges and one span, then idles."""

    async def run(self) -> None:
        self.ctx.trace.record(kind=9, t_start_ns=now_ns(), t_end_ns=now_ns(), tokens=5)
        self.ctx.set_gauges([42.0, 0.5])
        await asyncio.Event().wait()
