"""Single-producer single-consumer message ring over POSIX shared memory.

Segment: a 4 KiB header, then `n_slots` slots of `slot_bytes`. A slot is a 32-byte slot header and a
chunk of one message body (see records.py). The producer writes arrays straight into a slot and
publishes it; the consumer reads zero-copy views that stay valid until it releases the slot. A message
larger than a slot travels as consecutive chunks, FIRST ... LAST, in order; the consumer copies the
chunks into one buffer as they come, so even a ring of two slots passes any size.

Ordering is a release/acquire pair of counting semaphores: `spaces` (free slots) and `items`
(published slots). Waiting spins briefly, then blocks: a synchronous end sleeps in `sem_timedwait`;
an asyncio end marks itself sleeping in the header and waits on a FIFO that the peer writes one byte
to after publishing (the peer reads that flag only after its semaphore post, and the waiter checks the
semaphore again after setting it, so no wake-up is lost). Every wait is cut into slices of
`liveness_interval_s`, after each of which the peer's liveness and closed flag are checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import posix_ipc

from pipeline.clock import now_ns
from pipeline.errors import LayoutMismatch, PeerDied, ProtocolError, RingClosed, RingTimeout
from pipeline.names import SHM_DIR, process_start_ticks, same_process_alive
from pipeline.records import ALIGN, Record, Vocabulary, align_up
from pipeline.waits import deadline_ns, next_slice_s, try_acquire, wait_in_slices

MAGIC = 0x70736572_76657231  # "pserver1"
RING_VERSION = 1
SEGMENT_HEADER_BYTES = 4096
SLOT_HEADER = struct.Struct("<IIQQII")  # type_id, flags, slot_seq, message_bytes, chunk_bytes, pad
SLOT_HEADER_BYTES = 32
FIRST, LAST = 1, 2

# Indices into the segment header viewed as int64. The producer's and the consumer's fields sit on
# separate cache lines so that the two ends do not write the same line.
H_MAGIC, H_VERSION, H_LAYOUT, H_SLOTS, H_SLOT_BYTES = 0, 1, 2, 3, 4
P_PID, P_START, P_CLOSED, P_SLEEPING, P_SEQ = 8, 9, 10, 11, 12
C_PID, C_START, C_CLOSED, C_SLEEPING, C_SEQ = 16, 17, 18, 19, 20


@dataclass(frozen=True, slots=True)
class RingSpec:
    """What a ring carries and its geometry."""

    name: str
    vocabulary: Vocabulary
    n_slots: int = 64
    slot_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.n_slots < 2:
            raise ValueError(f"ring {self.name!r}: n_slots must be >= 2")
        if self.slot_bytes < SLOT_HEADER_BYTES + 4 * ALIGN or self.slot_bytes % 64:
            raise ValueError(f"ring {self.name!r}: slot_bytes must be a multiple of 64, >= 128")

    @property
    def chunk_capacity(self) -> int:
        """Body bytes one slot holds."""
        return self.slot_bytes - SLOT_HEADER_BYTES

    @property
    def segment_bytes(self) -> int:
        return SEGMENT_HEADER_BYTES + self.n_slots * self.slot_bytes


@dataclass(frozen=True, slots=True)
class RingHandle:
    """The names of one ring's objects. Picklable: this is what a process gets to attach.

    A ring whose peer died and was restarted alone is replaced by its next generation: the same
    spec under the next name (`successor`), which a surviving end can find by itself.
    """

    spec: RingSpec
    base: str  # e.g. "pserve.1234.ab12cd34.render_in"
    generation: int = 0  # 0: the ring the pipeline started with

    @property
    def stem(self) -> str:
        return self.base if self.generation == 0 else f"{self.base}.g{self.generation}"

    @property
    def shm_name(self) -> str:
        return f"/{self.stem}"

    @property
    def items_name(self) -> str:
        return f"/{self.stem}.items"

    @property
    def spaces_name(self) -> str:
        return f"/{self.stem}.spaces"

    @property
    def consumer_fifo(self) -> str:
        return os.path.join(SHM_DIR, f"{self.stem}.cwake")

    @property
    def producer_fifo(self) -> str:
        return os.path.join(SHM_DIR, f"{self.stem}.pwake")

    def successor(self) -> RingHandle:
        """The handle of the ring that replaces this one (not created by this call)."""
        return RingHandle(self.spec, self.base, self.generation + 1)

    def exists(self) -> bool:
        """Whether the segment's name is there to attach to (created and not yet unlinked)."""
        return os.path.exists(os.path.join(SHM_DIR, self.stem))

    def ends_attached(self) -> bool:
        """Whether a producer and a consumer have both attached (their pids are in the header)."""
        try:
            shm = posix_ipc.SharedMemory(self.shm_name)
        except posix_ipc.ExistentialError:
            return False
        try:
            with contextlib.closing(mmap.mmap(shm.fd, SEGMENT_HEADER_BYTES)) as header_map:
                header = memoryview(header_map).cast("q")
                attached = bool(header[P_PID] and header[C_PID])
                header.release()
        finally:
            shm.close_fd()
        return attached

    @classmethod
    def create(cls, namespace: str, spec: RingSpec, generation: int = 0) -> RingHandle:
        """Create the segment, both semaphores and both wake FIFOs, and write the header."""
        handle = cls(spec, f"{namespace}.{spec.name}", generation)
        try:
            shm = posix_ipc.SharedMemory(
                handle.shm_name, posix_ipc.O_CREX, mode=0o600, size=spec.segment_bytes
            )
            with contextlib.closing(mmap.mmap(shm.fd, SEGMENT_HEADER_BYTES)) as header_map:
                header = np.frombuffer(header_map, np.int64, SEGMENT_HEADER_BYTES // 8)
                header[H_MAGIC] = MAGIC
                header[H_VERSION] = RING_VERSION
                header[H_LAYOUT] = spec.vocabulary.layout_hash
                header[H_SLOTS] = spec.n_slots
                header[H_SLOT_BYTES] = spec.slot_bytes
                del header
            shm.close_fd()
            for name, value in ((handle.items_name, 0), (handle.spaces_name, spec.n_slots)):
                posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=value).close()
            os.mkfifo(handle.consumer_fifo, 0o600)
            os.mkfifo(handle.producer_fifo, 0o600)
        except BaseException:
            handle.unlink()
            raise
        return handle

    def unlink(self) -> None:
        """Remove the names; attached processes keep working. Missing names are fine."""
        for unlink in (
            lambda: posix_ipc.unlink_shared_memory(self.shm_name),
            lambda: posix_ipc.unlink_semaphore(self.items_name),
            lambda: posix_ipc.unlink_semaphore(self.spaces_name),
            lambda: os.unlink(self.consumer_fifo),
            lambda: os.unlink(self.producer_fifo),
        ):
            with contextlib.suppress(posix_ipc.ExistentialError, FileNotFoundError):
                unlink()

    def producer(self, **options: float | Callable[[], None] | None) -> Producer:
        return Producer(self, **options)

    def consumer(self, **options: float | Callable[[], None] | None) -> Consumer:
        return Consumer(self, **options)


class _RingEnd:
    """What both ends share: the mapping, the semaphores, the wake FIFOs and the waits."""

    _own: tuple[int, int, int, int, int]  # pid, start, closed, sleeping, seq fields of this end
    _peer: tuple[int, int, int, int, int]
    _role = ""
    _seq: int  # slots this end has published (producer) or released (consumer)
    _progress: tuple[int, int]  # the wait is over when header[index] + slack > _seq

    def __init__(
        self,
        handle: RingHandle,
        *,
        spin_s: float = 50e-6,
        liveness_interval_s: float = 0.1,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        self.handle = handle
        self.spec = handle.spec
        self.vocabulary = handle.spec.vocabulary
        self.spin_ns = int(spin_s * 1e9)
        self.liveness_interval_s = liveness_interval_s
        self.heartbeat = heartbeat
        self._closed = False
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        # Views of in-slot messages by (type id, slot, element counts): steady traffic repeats shapes,
        # and building numpy views is most of the cost of a small message.
        self._views: dict[tuple[int, int, tuple[int, ...]], tuple[int, dict[str, np.ndarray]]] = {}
        try:
            shm = posix_ipc.SharedMemory(handle.shm_name)
        except posix_ipc.ExistentialError:
            raise LayoutMismatch(f"ring {self.spec.name!r}: no segment {handle.shm_name}") from None
        try:
            if shm.size != self.spec.segment_bytes:
                raise LayoutMismatch(
                    f"ring {self.spec.name!r}: segment has {shm.size} bytes, "
                    f"expected {self.spec.segment_bytes}"
                )
            self._map = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        # The header as int64s: a memoryview, whose item access is several times cheaper than numpy's.
        self._hdr = memoryview(self._map)[:SEGMENT_HEADER_BYTES].cast("q")
        self._check_layout()
        self._offsets = [
            SEGMENT_HEADER_BYTES + i * self.spec.slot_bytes for i in range(self.spec.n_slots)
        ]
        self._n_slots = self.spec.n_slots
        self._chunk_capacity = self.spec.chunk_capacity
        self._views_limit = 4 * self._n_slots + 64
        self._progress = (P_SEQ, 0) if self._role == "consumer" else (C_SEQ, self._n_slots)
        # slots: [n_slots, slot_bytes] uint8, one row per slot
        self._slots = np.frombuffer(
            self._map, np.uint8, self.spec.n_slots * self.spec.slot_bytes, SEGMENT_HEADER_BYTES
        ).reshape(self.spec.n_slots, self.spec.slot_bytes)
        self._items = posix_ipc.Semaphore(handle.items_name)
        self._spaces = posix_ipc.Semaphore(handle.spaces_name)
        own_fifo, peer_fifo = (handle.producer_fifo, handle.consumer_fifo)
        if self._role == "consumer":
            own_fifo, peer_fifo = peer_fifo, own_fifo
        self._wake_fd = os.open(own_fifo, os.O_RDWR | os.O_NONBLOCK)
        self._peer_wake_fd = os.open(peer_fifo, os.O_RDWR | os.O_NONBLOCK)
        self._claim()

    # -- set-up and teardown ------------------------------------------------------------------

    def _check_layout(self) -> None:
        h = self._hdr
        expected = (MAGIC, RING_VERSION, self.vocabulary.layout_hash)
        found = (int(h[H_MAGIC]), int(h[H_VERSION]), int(h[H_LAYOUT]))
        if found != expected:
            self._unmap()
            raise LayoutMismatch(
                f"ring {self.spec.name!r}: segment layout {found[2]:#x} (magic {found[0]:#x}, "
                f"version {found[1]}) does not match {self.vocabulary!r} layout {expected[2]:#x}"
            )
        if (int(h[H_SLOTS]), int(h[H_SLOT_BYTES])) != (self.spec.n_slots, self.spec.slot_bytes):
            self._unmap()
            raise LayoutMismatch(f"ring {self.spec.name!r}: slot geometry differs from the spec")

    def _claim(self) -> None:
        pid_i, start_i = self._own[0], self._own[1]
        other_pid = int(self._hdr[pid_i])
        live_other = other_pid and other_pid != os.getpid()
        if live_other and same_process_alive(other_pid, int(self._hdr[start_i])):
            self.close()
            raise ProtocolError(
                f"ring {self.spec.name!r} already has a {self._role} (pid {other_pid})"
            )
        self._hdr[start_i] = process_start_ticks(os.getpid())
        self._hdr[pid_i] = os.getpid()

    def close(self) -> None:
        """Mark this end closed, wake the peer so it notices, and drop the mapping."""
        if self._closed:
            return
        self._closed = True
        self._hdr[self._own[2]] = 1
        self._wake_peer(force=True)
        if self._reader_loop is not None and not self._reader_loop.is_closed():
            self._reader_loop.remove_reader(self._wake_fd)
        self._reader_loop = None
        for fd in (self._wake_fd, self._peer_wake_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._items.close()
        self._spaces.close()
        self._unmap()

    def _unmap(self) -> None:
        self._views.clear()
        self._hdr.release()
        self._hdr = self._slots = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            # Views a caller still holds keep the mapping alive; it goes with them.
            self._map.close()

    def __enter__(self) -> _RingEnd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def depth(self) -> int:
        """Slots published and not yet released: the queue depth."""
        return int(self._hdr[P_SEQ] - self._hdr[C_SEQ])

    def peer_pid(self) -> int:
        return int(self._hdr[self._peer[0]])

    # -- waking ----------------------------------------------------------------------------------

    def _cache_views(
        self, key: tuple[int, int, tuple[int, ...]], size: int, views: dict[str, np.ndarray]
    ) -> None:
        if len(self._views) >= self._views_limit:
            self._views.clear()
        self._views[key] = (size, views)

    def _wake_peer(self, force: bool = False) -> None:
        if force or self._hdr[self._peer[3]]:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._peer_wake_fd, b"\x01")

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_fd, 4096):
                pass
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _ensure_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._reader_loop is loop:
            return
        if self._reader_loop is not None and not self._reader_loop.is_closed():
            self._reader_loop.remove_reader(self._wake_fd)
        loop.add_reader(self._wake_fd, self._on_wake)
        self._reader_loop = loop

    # -- waiting ---------------------------------------------------------------------------------

    def _check_peer(self, sem: posix_ipc.Semaphore) -> bool:
        """After a wait slice: True if the semaphore was taken late, else raise if the peer is gone."""
        peer_pid = int(self._hdr[self._peer[0]])
        if self._hdr[self._peer[2]]:
            if try_acquire(sem):
                return True
            raise RingClosed(f"ring {self.spec.name!r}: the {_other(self._role)} closed its end")
        if peer_pid and not same_process_alive(peer_pid, int(self._hdr[self._peer[1]])):
            if try_acquire(sem):
                return True
            raise PeerDied(
                f"ring {self.spec.name!r}: the {_other(self._role)} (pid {peer_pid}) died"
            )
        if self.heartbeat is not None:
            self.heartbeat()
        return False

    def _spin(self, sem: posix_ipc.Semaphore, start_ns: int) -> bool:
        """Spin up to spin_ns for the semaphore; True if taken.

        It watches the peer's plain sequence counter, which is only read here, and touches the
        semaphore only once that says it will succeed: polling the semaphore itself would pull its
        cache line away from the peer at every try.
        """
        hdr, (index, slack) = self._hdr, self._progress
        spin_end = start_ns + self.spin_ns
        while now_ns() < spin_end:
            if hdr[index] + slack > self._seq and try_acquire(sem):
                return True
        return False

    def _wait(self, sem: posix_ipc.Semaphore, timeout_s: float | None) -> None:
        if try_acquire(sem):
            return
        start = now_ns()
        if self.spin_ns and self._spin(sem, start):
            return
        wait_in_slices(
            sem,
            start,
            timeout_s,
            self.liveness_interval_s,
            lambda: self._check_peer(sem),
            f"ring {self.spec.name!r}: {self._role} waited {timeout_s} s",
        )

    async def _wait_async(self, sem: posix_ipc.Semaphore, timeout_s: float | None) -> None:
        if try_acquire(sem):
            return
        start = now_ns()
        if self.spin_ns and self._spin(sem, start):
            return
        loop = asyncio.get_running_loop()
        self._ensure_reader(loop)
        deadline = deadline_ns(start, timeout_s)
        sleeping = self._own[3]
        while True:
            slice_s = next_slice_s(deadline, self.liveness_interval_s)
            self._hdr[sleeping] = 1
            try:
                # Check again after raising the flag: a post that came before it sent no wake-up.
                if try_acquire(sem):
                    return
                waiter = loop.create_future()
                self._waiter = waiter
                timer = loop.call_later(slice_s, _resolve, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                    self._waiter = None
            finally:
                if self._hdr is not None:
                    self._hdr[sleeping] = 0
            if try_acquire(sem):
                return
            if self._check_peer(sem):
                return
            if deadline is not None and now_ns() >= deadline:
                raise RingTimeout(f"ring {self.spec.name!r}: {self._role} waited {timeout_s} s")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _other(role: str) -> str:
    return "consumer" if role == "producer" else "producer"


class Producer(_RingEnd):
    """The writing end. One message at a time: `reserve` (or `send`), fill the views, `commit`."""

    _own = (P_PID, P_START, P_CLOSED, P_SLEEPING, P_SEQ)
    _peer = (C_PID, C_START, C_CLOSED, C_SLEEPING, C_SEQ)
    _role = "producer"

    def __init__(self, handle: RingHandle, **options: object) -> None:
        super().__init__(handle, **options)  # type: ignore[arg-type]
        self._seq = int(self._hdr[P_SEQ])
        self._holds_space = False  # a slot acquired and not yet published
        # The reserved message: (type_id, body bytes, staging buffer or None when it is in its slot).
        self._draft: tuple[int, int, np.ndarray | None] | None = None
        self._staging = np.empty(0, np.uint8)
        self._pending: tuple[int, np.ndarray, int] | None = None  # type_id, body, bytes sent
        self._type_ids = {r.name: i for i, r in enumerate(self.vocabulary.records)}
        # The shape whose counts each slot holds now, so an unchanged one is not written again.
        self._slot_shapes: list[tuple[int, int, tuple[int, ...]] | None] = [None] * self._n_slots

    # -- sync API --------------------------------------------------------------------------------

    def reserve(
        self, record: Record | str, counts: Sequence[int], timeout_s: float | None = None
    ) -> dict[str, np.ndarray]:
        """Space for one message with these element counts: writable views to fill, then `commit()`.

        When the message fits in a slot the views point into it (zero copy); a larger message is
        staged and sent in chunks by commit.
        """
        if self._pending is not None:
            self._flush_pending_sync(timeout_s)
        type_id, rec = self._lookup(record)
        # Fast path: this shape was laid out in this slot before; its views are still valid.
        slot = self._seq % self._n_slots
        key = (type_id, slot, tuple(counts))
        cached = self._views.get(key)
        if cached is not None and not self._holds_space:
            try:
                self._spaces.acquire(0)
            except posix_ipc.BusyError:
                self._wait(self._spaces, timeout_s)
            self._holds_space = True
            size, views = cached
            if self._slot_shapes[slot] != key:  # the counts in the slot are another message's
                rec.pack_counts(self._map, self._offsets[slot] + SLOT_HEADER_BYTES, counts)
                self._slot_shapes[slot] = key
            self._draft = (type_id, size, None)
            return views
        size = rec.body_bytes(counts)
        if size <= self._chunk_capacity and not self._holds_space:
            try:
                self._spaces.acquire(0)
            except posix_ipc.BusyError:
                self._wait(self._spaces, timeout_s)
            self._holds_space = True
        return self._layout(type_id, rec, counts, size)

    def commit(self, timeout_s: float | None = None) -> None:
        """Publish the reserved message (waiting for slots if it is larger than one)."""
        if self._start_commit():
            self._flush_pending_sync(timeout_s)

    def send(
        self, record: Record | str, arrays: Mapping[str, np.ndarray], timeout_s: float | None = None
    ) -> None:
        """Copy the given arrays into a message and publish it."""
        rec = self._lookup(record)[1]
        views = self.reserve(rec, rec.counts_of(arrays), timeout_s)
        for name, view in views.items():
            view[...] = arrays[name]
        self.commit(timeout_s)

    # -- async API (cancellation-safe: a cancelled call loses nothing it had published) -----------

    async def reserve_async(
        self, record: Record | str, counts: Sequence[int], timeout_s: float | None = None
    ) -> dict[str, np.ndarray]:
        if self._pending is not None:
            await self._flush_pending_async(timeout_s)
        type_id, rec = self._lookup(record)
        size = rec.body_bytes(counts)
        if size <= self._chunk_capacity and not self._holds_space:
            await self._wait_async(self._spaces, timeout_s)
            self._holds_space = True
        return self._layout(type_id, rec, counts, size)

    async def commit_async(self, timeout_s: float | None = None) -> None:
        if self._start_commit():
            await self._flush_pending_async(timeout_s)

    async def send_async(
        self, record: Record | str, arrays: Mapping[str, np.ndarray], timeout_s: float | None = None
    ) -> None:
        rec = self._lookup(record)[1]
        views = await self.reserve_async(rec, rec.counts_of(arrays), timeout_s)
        for name, view in views.items():
            view[...] = arrays[name]
        await self.commit_async(timeout_s)

    async def flush_async(self, timeout_s: float | None = None) -> None:
        """Finish a large message whose sending was cancelled midway."""
        await self._flush_pending_async(timeout_s)

    # -- internals -------------------------------------------------------------------------------

    def _lookup(self, record: Record | str) -> tuple[int, Record]:
        if self._closed:
            raise RingClosed(f"ring {self.spec.name!r}: producer already closed")
        name = record if isinstance(record, str) else record.name
        type_id = self._type_ids.get(name)
        if type_id is None:
            raise ValueError(f"ring {self.spec.name!r} carries no record {name!r}")
        return type_id, self.vocabulary.records[type_id]

    def _layout(
        self, type_id: int, rec: Record, counts: Sequence[int], size: int
    ) -> dict[str, np.ndarray]:
        if size <= self._chunk_capacity:
            self._draft = (type_id, size, None)
            slot = self._seq % self._n_slots
            offset = self._offsets[slot] + SLOT_HEADER_BYTES
            key = (type_id, slot, tuple(counts))
            self._slot_shapes[slot] = key
            cached = self._views.get(key)
            if cached is None:
                views = rec.write_layout(self._map, offset, counts)
                self._cache_views(key, size, views)
                return views
            rec.pack_counts(self._map, offset, counts)
            return cached[1]
        if self._staging.size < size:
            self._staging = np.empty(align_up(size, 1 << 16), np.uint8)
        body = self._staging[:size]
        self._draft = (type_id, size, body)
        return rec.write_layout(body, 0, counts)

    def _start_commit(self) -> bool:
        """Publish an in-slot message now; queue a large one. True if chunks are left to send."""
        draft = self._draft
        if draft is None:
            raise ProtocolError(f"ring {self.spec.name!r}: commit without a reserved message")
        self._draft = None
        type_id, size, body = draft
        if body is None:
            self._publish_slot(type_id, FIRST | LAST, size, size)
            return False
        self._pending = (type_id, body, 0)
        return True

    def _publish_slot(self, type_id: int, flags: int, message_bytes: int, chunk_bytes: int) -> None:
        seq = self._seq
        SLOT_HEADER.pack_into(
            self._map,
            self._offsets[seq % self._n_slots],
            type_id,
            flags,
            seq,
            message_bytes,
            chunk_bytes,
            0,
        )
        self._seq = seq + 1
        self._holds_space = False
        self._hdr[P_SEQ] = seq + 1
        self._items.release()
        if self._hdr[C_SLEEPING]:
            self._wake_peer(force=True)

    def _send_chunk(self) -> None:
        assert self._pending is not None
        type_id, body, sent = self._pending
        chunk = min(self._chunk_capacity, len(body) - sent)
        slot = self._seq % self._n_slots
        self._slots[slot, SLOT_HEADER_BYTES : SLOT_HEADER_BYTES + chunk] = body[sent : sent + chunk]
        self._slot_shapes[slot] = None
        flags = (FIRST if sent == 0 else 0) | (LAST if sent + chunk == len(body) else 0)
        self._publish_slot(type_id, flags, len(body), chunk)
        sent += chunk
        self._pending = None if sent == len(body) else (type_id, body, sent)

    def _flush_pending_sync(self, timeout_s: float | None) -> None:
        while self._pending is not None:
            if not self._holds_space:
                self._wait(self._spaces, timeout_s)
                self._holds_space = True
            self._send_chunk()

    async def _flush_pending_async(self, timeout_s: float | None) -> None:
        while self._pending is not None:
            if not self._holds_space:
                await self._wait_async(self._spaces, timeout_s)
                self._holds_space = True
            self._send_chunk()


class Message:
    """A received message: zero-copy `arrays`, valid until `release()` (or the end of a with block)."""

    __slots__ = ("_consumer", "arrays", "record", "type_id")

    def __init__(
        self, record: Record, type_id: int, arrays: dict[str, np.ndarray], consumer: Consumer
    ) -> None:
        self.record = record
        self.type_id = type_id
        self.arrays = arrays
        self._consumer = consumer

    @property
    def name(self) -> str:
        return self.record.name

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def release(self) -> None:
        self._consumer.release()

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self._consumer.release()


class Consumer(_RingEnd):
    """The reading end. Hold at most one message; release it before the next receive."""

    _own = (C_PID, C_START, C_CLOSED, C_SLEEPING, C_SEQ)
    _peer = (P_PID, P_START, P_CLOSED, P_SLEEPING, P_SEQ)
    _role = "consumer"

    def __init__(self, handle: RingHandle, **options: object) -> None:
        super().__init__(handle, **options)  # type: ignore[arg-type]
        self._seq = int(self._hdr[C_SEQ])
        self._holding: int = 0  # 0 none, 1 an in-slot message, 2 a reassembled one
        self._partial: tuple[int, np.ndarray, int] | None = None  # type_id, buffer, bytes received
        self._assembly = np.empty(0, np.uint8)
        self._records = self.vocabulary.records
        self._message = Message(self._records[0], 0, {}, self)

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next message, waiting up to timeout_s (None: for ever, while the producer lives)."""
        if self._holding or self._closed:
            self._refuse()
        while True:
            try:
                self._items.acquire(0)
            except posix_ipc.BusyError:
                self._wait(self._items, timeout_s)
            message = self._take_slot()
            if message is not None:
                return message

    async def recv_async(self, timeout_s: float | None = None) -> Message:
        """As recv, without blocking the event loop; a cancelled call loses no message."""
        if self._holding or self._closed:
            self._refuse()
        while True:
            await self._wait_async(self._items, timeout_s)
            message = self._take_slot()
            if message is not None:
                return message

    def poll(self) -> Message | None:
        """A message if one is ready now (a large one only once all of it is here), else None."""
        if self._holding or self._closed:
            self._refuse()
        while True:
            try:
                self._items.acquire(0)
            except posix_ipc.BusyError:
                return None
            message = self._take_slot()
            if message is not None:
                return message

    def release(self) -> None:
        """Give the held message's slot back to the producer; its views become invalid."""
        if self._holding == 1:
            self._free_slot()
        self._holding = 0

    def _refuse(self) -> None:
        if self._closed:
            raise RingClosed(f"ring {self.spec.name!r}: consumer already closed")
        raise ProtocolError(f"ring {self.spec.name!r}: release the held message first")

    def _free_slot(self) -> None:
        self._seq += 1
        self._hdr[C_SEQ] = self._seq
        self._spaces.release()
        if self._hdr[P_SLEEPING]:
            self._wake_peer(force=True)

    def _take_slot(self) -> Message | None:
        """Read the slot just acquired: a whole message, or one chunk of a large one (None)."""
        seq = self._seq
        slot = seq % self._n_slots
        offset = self._offsets[slot]
        type_id, flags, slot_seq, message_bytes, chunk_bytes, _ = SLOT_HEADER.unpack_from(
            self._map, offset
        )
        if slot_seq != seq or chunk_bytes > self._chunk_capacity or type_id >= len(self._records):
            raise ProtocolError(
                f"ring {self.spec.name!r}: slot {slot} holds sequence {slot_seq} type {type_id}, "
                f"expected sequence {seq} (chunk {chunk_bytes} bytes)"
            )
        record = self._records[type_id]
        if flags == FIRST | LAST and self._partial is None:
            self._holding = 1
            body = offset + SLOT_HEADER_BYTES
            key = (type_id, slot, record.unpack_counts(self._map, body))
            cached = self._views.get(key)
            if cached is not None and cached[0] == chunk_bytes:
                views = cached[1]
            else:
                views = record.read_views(self._map, body, chunk_bytes)
                self._cache_views(key, chunk_bytes, views)
            # One Message object serves every in-slot message: only one is held at a time.
            message = self._message
            message.record, message.type_id, message.arrays = record, type_id, views
            return message
        return self._take_chunk(record, type_id, flags, message_bytes, chunk_bytes, slot)

    def _take_chunk(
        self,
        record: Record,
        type_id: int,
        flags: int,
        message_bytes: int,
        chunk_bytes: int,
        slot: int,
    ) -> Message | None:
        if flags & FIRST:
            if self._partial is not None:
                raise ProtocolError(
                    f"ring {self.spec.name!r}: new message before the last one ended"
                )
            if self._assembly.size < message_bytes:
                self._assembly = np.empty(align_up(message_bytes, 1 << 16), np.uint8)
            self._partial = (type_id, self._assembly[:message_bytes], 0)
        if self._partial is None or self._partial[0] != type_id:
            raise ProtocolError(f"ring {self.spec.name!r}: continuation chunk without a start")
        _, buffer, received = self._partial
        if received + chunk_bytes > len(buffer):
            raise ProtocolError(f"ring {self.spec.name!r}: large message overruns its size")
        buffer[received : received + chunk_bytes] = self._slots[
            slot, SLOT_HEADER_BYTES : SLOT_HEADER_BYTES + chunk_bytes
        ]
        received += chunk_bytes
        self._free_slot()
        if not flags & LAST:
            self._partial = (type_id, buffer, received)
            return None
        self._partial = None
        if received != len(buffer):
            raise ProtocolError(f"ring {self.spec.name!r}: large message ended short")
        self._holding = 2
        return Message(record, type_id, record.read_views(buffer), self)
