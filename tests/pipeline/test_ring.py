"""The ring protocol: integrity, order, large messages, backpressure, peer death, cancellation, idle CPU."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest

from pipeline.errors import LayoutMismatch, PeerDied, ProtocolError, RingClosed, RingTimeout
from pipeline.names import names_in_shm, new_namespace
from pipeline.records import Record, Vocabulary, encode
from pipeline.ring import RingHandle, RingSpec
from tests.pipeline import peers
from tests.pipeline.peers import BLOB, VOCAB, check_blob

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def ring_factory():
    handles: list[RingHandle] = []

    def make(n_slots: int = 8, slot_bytes: int = 4096, vocab: Vocabulary = VOCAB) -> RingHandle:
        handle = RingHandle.create(new_namespace(), RingSpec("r", vocab, n_slots, slot_bytes))
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        handle.unlink()


def spawn(target, *args) -> multiprocessing.process.BaseProcess:
    proc = SPAWN.Process(target=target, args=args)
    proc.start()
    return proc


def test_records_roundtrip_every_dtype_kind(ring_factory):
    point = np.dtype([("x", np.int32), ("y", np.float64), ("tag", "S4")])
    rec = Record(
        "mixed", ("ids", np.int64), ("probs", np.float32), ("points", point), ("flags", bool)
    )
    handle = ring_factory(vocab=Vocabulary("v", [rec]))
    arrays = {
        "ids": np.arange(5, dtype=np.int64),
        "probs": np.linspace(0, 1, 7, dtype=np.float32),
        "points": np.array([(1, 2.5, b"ab"), (3, -1.0, b"cdef")], point),
        "flags": np.array([True, False, True]),
    }
    with handle.producer() as producer, handle.consumer() as consumer:
        producer.send("mixed", arrays)
        with consumer.recv(timeout_s=1) as msg:
            for name, expected in arrays.items():
                np.testing.assert_array_equal(msg[name], expected)
                assert msg[name].dtype == expected.dtype
    body = encode(rec, arrays)
    np.testing.assert_array_equal(rec.read_views(body)["points"], arrays["points"])


def test_zero_copy_views_point_into_the_slot(ring_factory):
    handle = ring_factory()
    with handle.producer() as producer, handle.consumer() as consumer:
        draft = producer.reserve(BLOB, [3, 4])
        draft["meta"][:] = [0, 0, 0]
        draft["data"][:] = [1, 2, 3, 4]
        producer.commit()
        msg = consumer.recv(timeout_s=1)
        # The view aliases shared memory: the consumer sees exactly what was written in place.
        assert not msg["data"].flags.owndata
        assert msg["data"].tolist() == [1, 2, 3, 4]
        with pytest.raises(ProtocolError):
            consumer.recv(timeout_s=0.01)  # still holding the first message
        msg.release()


def test_layout_mismatch_fails_loudly(ring_factory):
    handle = ring_factory()
    other = Vocabulary("test", [Record("blob", ("meta", np.int64), ("data", np.int16))])
    stale = RingHandle(
        RingSpec("r", other, handle.spec.n_slots, handle.spec.slot_bytes), handle.base
    )
    with pytest.raises(LayoutMismatch, match="does not match"):
        stale.consumer()
    bigger = RingHandle(
        RingSpec("r", VOCAB, handle.spec.n_slots * 2, handle.spec.slot_bytes), handle.base
    )
    with pytest.raises(LayoutMismatch):
        bigger.producer()


def test_second_producer_is_refused(ring_factory):
    handle = ring_factory()
    proc = spawn(peers.produce, handle, -1, 16, 0, 0.01)
    try:
        with handle.consumer() as consumer:
            consumer.recv(timeout_s=10).release()
            with pytest.raises(ProtocolError, match="already has a producer"):
                handle.producer()
    finally:
        proc.kill()
        proc.join()


@pytest.mark.parametrize(
    ("n_slots", "slot_bytes", "max_bytes", "consumer_pause_s", "producer_pause_s"),
    [
        (2, 256, 2000, 0.0, 0.0),  # ring of two, most messages span many slots
        (2, 4096, 3000, 0.0005, 0.0),  # slow consumer: producer blocks on a full ring
        (64, 1024, 5000, 0.0, 0.0005),  # fast consumer waits on a slow producer
        (256, 65536, 200_000, 0.0, 0.0),  # large ring, messages larger than a slot
    ],
)
def test_two_process_stress(
    ring_factory, n_slots, slot_bytes, max_bytes, consumer_pause_s, producer_pause_s
):
    handle = ring_factory(n_slots, slot_bytes)
    count = 600
    with handle.consumer() as consumer:
        proc = spawn(peers.produce, handle, count, max_bytes, 7, producer_pause_s)
        rng = random.Random(1)
        received = []
        for _ in range(count):
            with consumer.recv(timeout_s=20) as msg:
                received.append(check_blob(msg))
            if consumer_pause_s:
                time.sleep(rng.random() * consumer_pause_s)
        proc.join(10)
        assert proc.exitcode == 0
        with pytest.raises(RingClosed):
            consumer.recv(timeout_s=5)
    assert received == list(range(count))  # in order, none lost, wrapped around many times


def test_killed_producer_gives_a_clear_error_within_the_timeout(ring_factory):
    handle = ring_factory(n_slots=4, slot_bytes=1024)
    with handle.consumer() as consumer:
        proc = spawn(peers.produce, handle, -1, 3000, 3, 0.0)
        for _ in range(50):
            with consumer.recv(timeout_s=10) as msg:
                check_blob(msg)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        start = time.monotonic()
        with pytest.raises(PeerDied, match=r"producer \(pid \d+\) died"):
            while True:  # drain what was published before the kill, then the error
                with consumer.recv(timeout_s=5) as msg:
                    pass
        assert time.monotonic() - start < 2.0


def test_blocked_producer_sees_a_dead_consumer(ring_factory):
    handle = ring_factory(n_slots=2, slot_bytes=256)
    attached = SPAWN.Event()
    proc = spawn(peers.attach_and_hold, handle, attached)
    assert attached.wait(30)  # attached, and never reads: the ring fills
    with handle.producer() as producer:
        producer.send(BLOB, {"meta": np.zeros(3, np.int64), "data": np.zeros(10, np.uint8)})
        producer.send(BLOB, {"meta": np.zeros(3, np.int64), "data": np.zeros(10, np.uint8)})
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with pytest.raises(PeerDied, match="consumer"):
            producer.send(
                BLOB, {"meta": np.zeros(3, np.int64), "data": np.zeros(10, np.uint8)}, timeout_s=5
            )


def test_timeout_with_a_live_idle_peer(ring_factory):
    handle = ring_factory()
    with handle.producer(), handle.consumer() as consumer:
        start = time.monotonic()
        with pytest.raises(RingTimeout):
            consumer.recv(timeout_s=0.2)
        assert 0.15 < time.monotonic() - start < 1.0


def test_async_cancellation_loses_nothing(ring_factory):
    handle = ring_factory(n_slots=4, slot_bytes=512)
    count = 400

    async def main() -> list[int]:
        received = []
        rng = random.Random(5)
        with handle.consumer() as consumer:
            proc = spawn(peers.produce, handle, count, 3000, 11, 0.002)
            cancelled = 0
            while len(received) < count:
                # Cancel receives over and over, many of them midway through a multi-slot message.
                try:
                    msg = await asyncio.wait_for(
                        consumer.recv_async(timeout_s=20), rng.random() * 0.002
                    )
                except TimeoutError:
                    cancelled += 1
                    continue
                with msg:
                    received.append(check_blob(msg))
            proc.join(10)
        assert cancelled > 20
        return received

    assert asyncio.run(main()) == list(range(count))


def test_async_producer_cancelled_midway_finishes_the_message(ring_factory):
    handle = ring_factory(n_slots=2, slot_bytes=256)
    rng = random.Random(3)

    async def main() -> None:
        with handle.producer() as producer, handle.consumer() as consumer:
            sent = peers.make_blob(rng, 0, 0)
            sent["data"] = np.arange(2000, dtype=np.int64).astype(np.uint8)
            sent["meta"][1] = peers.zlib.crc32(sent["data"])
            task = asyncio.create_task(producer.send_async(BLOB, sent))
            await asyncio.sleep(0.01)  # it fills both slots and waits for space
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async def drain() -> np.ndarray:
                with await consumer.recv_async(timeout_s=5) as msg:
                    check_blob(msg)
                    return msg["data"].copy()

            reader = asyncio.create_task(drain())
            await producer.flush_async(timeout_s=5)
            np.testing.assert_array_equal(await reader, sent["data"])

    asyncio.run(main())


@pytest.mark.parametrize("use_async", [False, True])
def test_idle_consumer_costs_almost_no_cpu(ring_factory, use_async):
    import psutil

    handle = ring_factory()
    with handle.producer():
        proc = spawn(peers.consume_idle, handle, use_async, 6.0)
        ps = psutil.Process(proc.pid)
        time.sleep(2.0)  # interpreter start-up and imports are not idle time
        before = ps.cpu_times()
        time.sleep(3.0)
        after = ps.cpu_times()
        used_s = (after.user - before.user) + (after.system - before.system)
        proc.kill()
        proc.join()
    assert used_s / 3.0 < 0.02, f"idle consumer used {used_s / 3.0:.1%} of a core"


def test_names_are_prefixed_and_removable():
    ns = new_namespace()
    handle = RingHandle.create(ns, RingSpec("names", VOCAB, 2, 256))
    made = names_in_shm(ns)
    assert len(made) == 5 and all(n.removeprefix("sem.").startswith("pserve.") for n in made)
    handle.unlink()
    assert names_in_shm(ns) == []


def test_repeated_and_alternating_shapes_keep_their_counts(ring_factory):
    handle = ring_factory(n_slots=2, slot_bytes=1024)
    shapes = [3, 5] * 4 + [5, 3] * 4 + [3, 3, 7, 3]  # slots see the same shape, then the other
    with handle.producer() as producer, handle.consumer() as consumer:
        for i, size in enumerate(shapes):
            data = np.full(size, i, np.uint8)
            producer.send(BLOB, {"meta": np.array([i, 0, 0], np.int64), "data": data})
            with consumer.recv(timeout_s=1) as msg:
                assert msg["data"].tolist() == data.tolist()
                assert msg["meta"][0] == i
