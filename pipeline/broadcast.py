"""One-writer, N-reader broadcast ring over POSIX shared memory: every reader gets every message.

After vLLM's `shm_broadcast.MessageQueue`: a ring of chunks, each with a written flag (the
sequence number of the message chunk it holds) and, per reader, a read flag (the reader's cursor:
it has read chunk s once its cursor passed s). The writer reuses a chunk only once every reader
has read it; a message larger than a chunk spans several, FIRST ... LAST, in order.

Unlike MessageQueue nothing polls: each reader has its own pair of counting semaphores, `items`
(chunks published to it) and `spaces` (chunks it has freed). The writer takes a space of every
reader before it writes a chunk and posts every reader's items after; so an idle reader sleeps
in sem_timedwait. Every wait is cut into slices of `liveness_interval_s`, after each of which the
peer's liveness and closed flag are checked: a reader that died becomes `PeerDied` for the writer
once it needs that reader's chunk, never a hang. Readers copy each message out as they read it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import posix_ipc

from pipeline.clock import now_ns
from pipeline.errors import LayoutMismatch, PeerDied, ProtocolError, RingClosed
from pipeline.names import process_start_ticks, same_process_alive
from pipeline.records import ALIGN, Record, Vocabulary
from pipeline.waits import try_acquire, wait_in_slices

MAGIC = 0x70736572_62636131  # "pserbca1"
VERSION = 1
HEADER_BYTES = 4096
CHUNK_HEADER = struct.Struct("<IIQQII")  # type_id, flags, seq (the written flag), message, chunk
CHUNK_HEADER_BYTES = 32
FIRST, LAST = 1, 2
LINE = 8  # int64s per 64-byte cache line

# Header as int64s: line 0 the geometry, line 1 the writer, line 2 + k reader k; each end writes
# only its own line.
H_MAGIC, H_VERSION, H_LAYOUT, H_CHUNKS, H_CHUNK_BYTES, H_READERS = 0, 1, 2, 3, 4, 5
PID, START, CLOSED, SEQ = 0, 1, 2, 3  # within an end's line
WRITER_LINE = 1
MAX_READERS = HEADER_BYTES // 64 - 2


@dataclass(frozen=True, slots=True)
class BroadcastSpec:
    """What a broadcast ring carries, to how many readers, and its geometry."""

    name: str
    vocabulary: Vocabulary
    n_readers: int
    n_chunks: int = 8
    chunk_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.n_readers <= MAX_READERS:
            raise ValueError(f"broadcast {self.name!r}: n_readers must be 1..{MAX_READERS}")
        if self.n_chunks < 2:
            raise ValueError(f"broadcast {self.name!r}: n_chunks must be >= 2")
        if self.chunk_bytes < CHUNK_HEADER_BYTES + 4 * ALIGN or self.chunk_bytes % 64:
            raise ValueError(
                f"broadcast {self.name!r}: chunk_bytes must be a multiple of 64, >= 128"
            )

    @property
    def segment_bytes(self) -> int:
        return HEADER_BYTES + self.n_chunks * self.chunk_bytes


@dataclass(frozen=True, slots=True)
class BroadcastHandle:
    """The names of one broadcast ring's objects; picklable. `reader` is the index a reading
    process attaches as (the supervisor sets it per process); -1 for the writer."""

    spec: BroadcastSpec
    base: str  # e.g. "pserve.1234.ab12cd34.forward"
    reader: int = -1

    @property
    def shm_name(self) -> str:
        return f"/{self.base}"

    def items_name(self, reader: int) -> str:
        return f"/{self.base}.items{reader}"

    def spaces_name(self, reader: int) -> str:
        return f"/{self.base}.spaces{reader}"

    def for_reader(self, reader: int) -> BroadcastHandle:
        if not 0 <= reader < self.spec.n_readers:
            raise ValueError(f"broadcast {self.spec.name!r} has no reader {reader}")
        return replace(self, reader=reader)

    @classmethod
    def create(cls, namespace: str, spec: BroadcastSpec) -> BroadcastHandle:
        """Create the segment and each reader's two semaphores, and write the header."""
        handle = cls(spec, f"{namespace}.{spec.name}")
        try:
            shm = posix_ipc.SharedMemory(
                handle.shm_name, posix_ipc.O_CREX, mode=0o600, size=spec.segment_bytes
            )
            with contextlib.closing(mmap.mmap(shm.fd, HEADER_BYTES)) as header_map:
                header = np.frombuffer(header_map, np.int64, HEADER_BYTES // 8)
                header[H_MAGIC], header[H_VERSION] = MAGIC, VERSION
                header[H_LAYOUT] = spec.vocabulary.layout_hash
                header[H_CHUNKS], header[H_CHUNK_BYTES] = spec.n_chunks, spec.chunk_bytes
                header[H_READERS] = spec.n_readers
                del header
            shm.close_fd()
            for k in range(spec.n_readers):
                for name, value in (
                    (handle.items_name(k), 0),
                    (handle.spaces_name(k), spec.n_chunks),
                ):
                    posix_ipc.Semaphore(
                        name, posix_ipc.O_CREX, mode=0o600, initial_value=value
                    ).close()
        except BaseException:
            handle.unlink()
            raise
        return handle

    def unlink(self) -> None:
        """Remove the names; attached processes keep working. Missing names are fine."""
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.shm_name)
        for k in range(self.spec.n_readers):
            for name in (self.items_name(k), self.spaces_name(k)):
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_semaphore(name)

    def writer(self, **options: float | Callable[[], None] | None) -> BroadcastWriter:
        return BroadcastWriter(self, **options)

    def reader_end(self, **options: float | Callable[[], None] | None) -> BroadcastReader:
        return BroadcastReader(self, **options)


class _End:
    """What both ends share: the mapping, the header lines and the sliced, checked waits."""

    _role = ""

    def __init__(
        self,
        handle: BroadcastHandle,
        line: int,
        *,
        liveness_interval_s: float = 0.1,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        self.handle = handle
        self.spec = spec = handle.spec
        self.liveness_interval_s = liveness_interval_s
        self.heartbeat = heartbeat
        self._closed = False
        self._line = line
        try:
            shm = posix_ipc.SharedMemory(handle.shm_name)
        except posix_ipc.ExistentialError:
            raise LayoutMismatch(f"broadcast {spec.name!r}: no segment {handle.shm_name}") from None
        try:
            if shm.size != spec.segment_bytes:
                raise LayoutMismatch(
                    f"broadcast {spec.name!r}: segment has {shm.size} bytes, "
                    f"expected {spec.segment_bytes}"
                )
            self._map = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        self._hdr = memoryview(self._map)[:HEADER_BYTES].cast("q")
        found = tuple(int(self._hdr[i]) for i in range(6))
        expected = (
            MAGIC,
            VERSION,
            spec.vocabulary.layout_hash,
            spec.n_chunks,
            spec.chunk_bytes,
            spec.n_readers,
        )
        if found != expected:
            self._unmap()
            raise LayoutMismatch(
                f"broadcast {spec.name!r}: segment header {found} does not match {expected}"
            )
        # chunks: [n_chunks, chunk_bytes] uint8
        self._chunks = np.frombuffer(
            self._map, np.uint8, spec.n_chunks * spec.chunk_bytes, HEADER_BYTES
        ).reshape(spec.n_chunks, spec.chunk_bytes)
        self._capacity = spec.chunk_bytes - CHUNK_HEADER_BYTES
        self._items = [posix_ipc.Semaphore(handle.items_name(k)) for k in range(spec.n_readers)]
        self._spaces = [posix_ipc.Semaphore(handle.spaces_name(k)) for k in range(spec.n_readers)]
        self._claim()

    def _field(self, line: int, field: int) -> int:
        return int(self._hdr[line * LINE + field])

    def _claim(self) -> None:
        other = self._field(self._line, PID)
        if (
            other
            and other != os.getpid()
            and same_process_alive(other, self._field(self._line, START))
        ):
            # The line is the live owner's: let go of this end without marking it closed.
            self._closed = True
            for sem in (*self._items, *self._spaces):
                sem.close()
            self._unmap()
            raise ProtocolError(f"broadcast {self.spec.name!r}: {self._role} taken by pid {other}")
        base = self._line * LINE
        self._hdr[base + START] = process_start_ticks(os.getpid())
        self._hdr[base + PID] = os.getpid()

    def _wait(
        self, sem: posix_ipc.Semaphore, peers: list[tuple[int, str]], timeout_s: float | None
    ) -> None:
        """Take `sem`, checking after each slice that every peer (header line, name) is alive and
        open: a writer waiting for one reader also learns of another's death."""
        if try_acquire(sem):
            return
        wait_in_slices(
            sem,
            now_ns(),
            timeout_s,
            self.liveness_interval_s,
            lambda: self._check_peers(sem, peers),
            f"broadcast {self.spec.name!r}: {self._role} waited {timeout_s} s",
        )

    def _check_peers(self, sem: posix_ipc.Semaphore, peers: list[tuple[int, str]]) -> bool:
        """After a wait slice: True if the semaphore was taken late, else raise if a peer is gone."""
        for line, peer in peers:
            pid = self._field(line, PID)
            if self._field(line, CLOSED):
                if try_acquire(sem):
                    return True
                raise RingClosed(f"broadcast {self.spec.name!r}: the {peer} closed its end")
            if pid and not same_process_alive(pid, self._field(line, START)):
                if try_acquire(sem):
                    return True
                raise PeerDied(f"broadcast {self.spec.name!r}: the {peer} (pid {pid}) died")
        if self.heartbeat is not None:
            self.heartbeat()
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Mark this end closed (the peers see it after their current wait slice) and unmap."""
        if self._closed:
            return
        self._closed = True
        self._hdr[self._line * LINE + CLOSED] = 1
        for sem in (*self._items, *self._spaces):
            sem.close()
        self._unmap()

    def _unmap(self) -> None:
        self._hdr.release()
        self._chunks = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> _End:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BroadcastWriter(_End):
    """The one writing end: `send` publishes a message to every reader."""

    _role = "writer"

    def __init__(
        self, handle: BroadcastHandle, **options: float | Callable[[], None] | None
    ) -> None:
        super().__init__(handle, WRITER_LINE, **options)  # type: ignore[arg-type]
        self._seq = self._field(WRITER_LINE, SEQ)
        self._type_ids = {r.name: i for i, r in enumerate(self.spec.vocabulary.records)}
        self._readers = [(2 + k, f"reader {k}") for k in range(self.spec.n_readers)]
        # Spaces taken for the next chunk; kept across a wait that timed out, so none leaks.
        self._held = [False] * self.spec.n_readers
        self._staging = np.empty(0, np.uint8)
        self._pending: tuple[int, np.ndarray, int] | None = None  # type_id, body, bytes sent

    def send(
        self, record: Record | str, arrays: Mapping[str, np.ndarray], timeout_s: float | None = None
    ) -> None:
        """Publish one message to every reader, waiting (up to timeout_s per chunk) for chunks
        that every reader has read. A message that fits a chunk is written straight into it; a
        larger one is staged and sent chunk by chunk (one that timed out midway is finished by
        the next send, so no reader sees half a message followed by another)."""
        if self._closed:
            raise RingClosed(f"broadcast {self.spec.name!r}: writer already closed")
        if self._pending is not None:
            self._flush(timeout_s)
        name = record if isinstance(record, str) else record.name
        type_id = self._type_ids.get(name)
        if type_id is None:
            raise ValueError(f"broadcast {self.spec.name!r} carries no record {name!r}")
        rec = self.spec.vocabulary.records[type_id]
        counts = rec.counts_of(arrays)
        size = rec.body_bytes(counts)
        if size <= self._capacity:
            self._take_spaces(timeout_s)
            offset = HEADER_BYTES + (self._seq % self.spec.n_chunks) * self.spec.chunk_bytes
            for field, view in rec.write_layout(
                self._map, offset + CHUNK_HEADER_BYTES, counts
            ).items():
                view[...] = arrays[field]
            self._commit(type_id, FIRST | LAST, size, size)
            return
        if self._staging.size < size:
            self._staging = np.empty(size, np.uint8)
        body = self._staging[:size]
        for field, view in rec.write_layout(body, 0, counts).items():
            view[...] = arrays[field]
        self._pending = (type_id, body, 0)
        self._flush(timeout_s)

    def _flush(self, timeout_s: float | None) -> None:
        """Send the chunks left of a staged message."""
        while self._pending is not None:
            type_id, body, sent = self._pending
            chunk = min(self._capacity, len(body) - sent)
            self._take_spaces(timeout_s)
            index = self._seq % self.spec.n_chunks
            self._chunks[index, CHUNK_HEADER_BYTES : CHUNK_HEADER_BYTES + chunk] = body[
                sent : sent + chunk
            ]
            flags = (FIRST if sent == 0 else 0) | (LAST if sent + chunk == len(body) else 0)
            self._commit(type_id, flags, len(body), chunk)
            self._pending = None if flags & LAST else (type_id, body, sent + chunk)

    def _take_spaces(self, timeout_s: float | None) -> None:
        """A space of every reader: each has read what the next chunk held before."""
        for k, spaces in enumerate(self._spaces):
            if not self._held[k]:
                self._wait(spaces, self._readers, timeout_s)
                self._held[k] = True

    def _commit(self, type_id: int, flags: int, message_bytes: int, chunk: int) -> None:
        """Stamp the next chunk with its sequence number (its written flag) and wake every reader."""
        seq = self._seq
        offset = HEADER_BYTES + (seq % self.spec.n_chunks) * self.spec.chunk_bytes
        CHUNK_HEADER.pack_into(self._map, offset, type_id, flags, seq, message_bytes, chunk, 0)
        self._seq = seq + 1
        self._hdr[WRITER_LINE * LINE + SEQ] = seq + 1
        self._held = [False] * self.spec.n_readers
        for items in self._items:
            items.release()


class BroadcastReader(_End):
    """Reader `handle.reader` of a broadcast ring: every message the writer sends, in order."""

    _role = "reader"

    def __init__(
        self, handle: BroadcastHandle, **options: float | Callable[[], None] | None
    ) -> None:
        if not 0 <= handle.reader < handle.spec.n_readers:
            raise ValueError(
                f"broadcast {handle.spec.name!r}: reader index {handle.reader} out of range"
            )
        self.index = handle.reader
        super().__init__(handle, 2 + handle.reader, **options)  # type: ignore[arg-type]
        self._seq = self._field(self._line, SEQ)
        self._partial: tuple[np.ndarray, int] | None = None  # a message's chunks read so far

    def recv(self, timeout_s: float | None = None) -> tuple[str, dict[str, np.ndarray]]:
        """The next message as (record name, arrays of a private copy), waiting up to timeout_s
        per chunk (None: for ever, while the writer lives). The chunks of a message read before
        a timeout are kept for the next call."""
        if self._closed:
            raise RingClosed(f"broadcast {self.spec.name!r}: reader already closed")
        records = self.spec.vocabulary.records
        items, spaces = self._items[self.index], self._spaces[self.index]
        buffer, received = self._partial if self._partial is not None else (None, 0)
        while True:
            self._wait(items, [(WRITER_LINE, "writer")], timeout_s)
            index = self._seq % self.spec.n_chunks
            type_id, flags, seq, message_bytes, chunk, _ = CHUNK_HEADER.unpack_from(
                self._map, HEADER_BYTES + index * self.spec.chunk_bytes
            )
            if seq != self._seq or chunk > self._capacity or type_id >= len(records):
                raise ProtocolError(
                    f"broadcast {self.spec.name!r}: chunk {index} holds sequence {seq} type "
                    f"{type_id}, expected sequence {self._seq}"
                )
            if (buffer is None) != bool(flags & FIRST):
                raise ProtocolError(f"broadcast {self.spec.name!r}: chunk out of message order")
            if buffer is None:
                buffer = np.empty(message_bytes, np.uint8)
            if received + chunk > len(buffer):
                raise ProtocolError(f"broadcast {self.spec.name!r}: message overruns its size")
            buffer[received : received + chunk] = self._chunks[
                index, CHUNK_HEADER_BYTES : CHUNK_HEADER_BYTES + chunk
            ]
            received += chunk
            self._seq += 1
            self._hdr[self._line * LINE + SEQ] = self._seq  # the read flag of every chunk up to it
            spaces.release()
            self._partial = None if flags & LAST else (buffer, received)
            if flags & LAST:
                if received != len(buffer):
                    raise ProtocolError(f"broadcast {self.spec.name!r}: message ended short")
                record = records[type_id]
                return record.name, record.read_views(buffer)
