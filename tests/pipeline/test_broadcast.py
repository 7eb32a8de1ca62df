"""The broadcast ring: every reader gets every message, in order and intact; a dead reader is an
error for the writer, not a hang; idle readers sleep; nothing stays in /dev/shm."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest

from pipeline.broadcast import BroadcastHandle, BroadcastSpec
from pipeline.errors import LayoutMismatch, PeerDied, RingClosed, RingTimeout
from pipeline.names import names_in_shm, new_namespace
from tests.pipeline import broadcast_peers
from tests.pipeline.peers import BLOB, VOCAB, make_blob

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def broadcast_factory():
    handles: list[BroadcastHandle] = []

    def make(n_readers: int = 4, n_chunks: int = 4, chunk_bytes: int = 1024) -> BroadcastHandle:
        spec = BroadcastSpec("b", VOCAB, n_readers, n_chunks, chunk_bytes)
        handle = BroadcastHandle.create(new_namespace(), spec)
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        handle.unlink()


def blob(size: int) -> dict[str, np.ndarray]:
    return make_blob(random.Random(size), size, 0) | {"data": np.arange(size, dtype=np.uint8)}


def test_four_readers_get_every_message_in_order_across_wraparound(broadcast_factory):
    """Random sizes up to 3 chunks through a 4-chunk ring: it wraps about 300 times, and the
    slowest reader holds the writer back without any reader missing or garbling a message."""
    handle = broadcast_factory(n_readers=4, n_chunks=4, chunk_bytes=1024)
    results = SPAWN.Queue()
    readers = [
        SPAWN.Process(
            target=broadcast_peers.read_all,
            args=(handle.for_reader(k), results, 0.002 if k == 3 else 0.0),
        )
        for k in range(4)
    ]
    for proc in readers:
        proc.start()
    count = 400
    rng = random.Random(5)
    with handle.writer() as writer:
        for seq in range(count):
            writer.send(BLOB, make_blob(rng, seq, 3000), timeout_s=30)
    got = sorted(results.get(timeout=60) for _ in readers)
    for proc in readers:
        proc.join(10)
        assert proc.exitcode == 0
    for k, (reader, seen, corrupt) in enumerate(got):
        assert reader == k
        assert seen == list(range(count))
        assert corrupt == 0


def test_multi_chunk_message_arrives_whole(broadcast_factory):
    handle = broadcast_factory(n_readers=2, n_chunks=2, chunk_bytes=256)
    r0, r1 = (handle.for_reader(k).reader_end() for k in range(2))
    with r0, r1, handle.writer() as writer:
        writer.send(BLOB, blob(300), timeout_s=1)  # 352 body bytes: both 224-byte chunks
        for reader in (r0, r1):
            name, arrays = reader.recv(timeout_s=1)
            assert name == "blob"
            assert np.array_equal(arrays["data"], np.arange(300, dtype=np.uint8))


def test_writer_waits_for_the_slowest_reader(broadcast_factory):
    handle = broadcast_factory(n_readers=2, n_chunks=2, chunk_bytes=256)
    r0, r1 = (handle.for_reader(k).reader_end() for k in range(2))
    with r0, r1, handle.writer() as writer:
        writer.send(BLOB, blob(10))
        writer.send(BLOB, blob(11))
        for _ in range(2):
            r0.recv(timeout_s=1)
        with pytest.raises(RingTimeout):  # reader 1 has read neither chunk
            writer.send(BLOB, blob(12), timeout_s=0.2)
        assert len(r1.recv(timeout_s=1)[1]["data"]) == 10
        writer.send(BLOB, blob(12), timeout_s=1)  # the timed-out send leaked no space
        assert [len(r1.recv(timeout_s=1)[1]["data"]) for _ in range(2)] == [11, 12]
        assert len(r0.recv(timeout_s=1)[1]["data"]) == 12


def test_a_large_message_cut_by_timeouts_is_finished_whole(broadcast_factory):
    """A three-chunk message through a two-chunk ring to a reader that comes late: both ends
    time out midway, and the next calls carry on where they stopped."""
    handle = broadcast_factory(n_readers=1, n_chunks=2, chunk_bytes=256)
    with handle.for_reader(0).reader_end() as reader, handle.writer() as writer:
        with pytest.raises(RingTimeout):
            writer.send(BLOB, blob(500), timeout_s=0.2)  # 2 of its 3 chunks sent
        with pytest.raises(RingTimeout):
            reader.recv(timeout_s=0.2)  # reads those 2, waits for the third
        writer.send(BLOB, blob(7), timeout_s=1)  # sends the third first, then this one
        _, arrays = reader.recv(timeout_s=1)
        assert np.array_equal(arrays["data"], np.arange(500, dtype=np.uint16).astype(np.uint8))
        assert len(reader.recv(timeout_s=1)[1]["data"]) == 7


def test_killed_reader_is_a_clear_error_for_the_writer(broadcast_factory):
    handle = broadcast_factory(n_readers=2, n_chunks=2, chunk_bytes=256)
    attached = SPAWN.Event()
    proc = SPAWN.Process(
        target=broadcast_peers.attach_and_hold, args=(handle.for_reader(1), attached)
    )
    proc.start()
    assert attached.wait(30)
    with handle.for_reader(0).reader_end(), handle.writer() as writer:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        start = time.monotonic()
        with pytest.raises(PeerDied, match=rf"reader 1 \(pid {proc.pid}\) died"):
            for size in range(10):  # fills the ring, then needs reader 1's chunk
                writer.send(BLOB, blob(size), timeout_s=5)
        assert time.monotonic() - start < 2.0


def test_killed_writer_and_closed_writer_end_the_readers(broadcast_factory):
    handle = broadcast_factory(n_readers=1)
    with handle.for_reader(0).reader_end() as reader:
        with handle.writer() as writer:
            writer.send(BLOB, blob(5))
        assert len(reader.recv(timeout_s=1)[1]["data"]) == 5  # published before the close
        with pytest.raises(RingClosed):
            reader.recv(timeout_s=5)


def test_layout_mismatch_fails_loudly(broadcast_factory):
    handle = broadcast_factory(n_readers=2)
    other = BroadcastSpec("b", VOCAB, 3, handle.spec.n_chunks, handle.spec.chunk_bytes)
    with pytest.raises(LayoutMismatch):
        BroadcastHandle(other, handle.base, 0).reader_end()


def test_idle_reader_costs_almost_no_cpu(broadcast_factory):
    import psutil

    handle = broadcast_factory(n_readers=1)
    with handle.writer():
        proc = SPAWN.Process(target=broadcast_peers.wait_idle, args=(handle.for_reader(0), 6.0))
        proc.start()
        ps = psutil.Process(proc.pid)
        time.sleep(2.0)  # interpreter start-up and imports are not idle time
        before = ps.cpu_times()
        time.sleep(3.0)
        after = ps.cpu_times()
        proc.kill()
        proc.join()
    used_s = (after.user - before.user) + (after.system - before.system)
    assert used_s / 3.0 < 0.02, f"idle reader used {used_s / 3.0:.1%} of a core"


def test_names_are_prefixed_and_all_removed():
    ns = new_namespace()
    handle = BroadcastHandle.create(ns, BroadcastSpec("names", VOCAB, 4, 2, 256))
    made = names_in_shm(ns)
    assert len(made) == 1 + 2 * 4
    assert all(n.removeprefix("sem.").startswith("pserve.") for n in made)
    with handle.writer(), handle.for_reader(2).reader_end():
        handle.unlink()  # attached ends keep working once the names are gone
        assert names_in_shm(ns) == []
    assert names_in_shm(ns) == []
