"""Per-actor trace buffers: spans of work written into shared memory, read by the owner on demand.

A trace buffer is an overwrite ring of fixed-size span records in its own segment. The actor never
waits on it: writing a span is a few stores, and when nobody reads, old spans are simply overwritten.
The owner copies out the spans written since it last looked (or the last `capacity`), checking each
record's sequence number so that a record overwritten while it was being copied is dropped, not
misread.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass

import numpy as np
import posix_ipc

SPAN = np.dtype(
    [
        (
            "seq",
            np.int64,
        ),  # 1-based write sequence; a slot whose seq is not the one expected is stale
        ("kind", np.int32),  # what the span is, in the actor's own numbering
        ("batch", np.int32),  # sequences (or messages) handled
        ("t_start_ns", np.int64),
        ("t_end_ns", np.int64),
        ("tokens", np.int64),  # tokens handled
        ("wait_ns", np.int64),  # time the actor waited on its inbox before this span
        ("depth", np.int32),  # inbox queue depth when the span started
        ("aux", np.int32),  # the actor's own extra number
        ("cpu_ns", np.int64),  # CPU time the process spent in the span (all its threads)
        # The actor's own work between the end of its wait and the span's start (taking the
        # message apart): the wait was [t_start_ns - lead_ns - wait_ns, t_start_ns - lead_ns].
        ("lead_ns", np.int64),
        # An id the spans of one unit of work share across actors (the owner's numbering; -1
        # when none): what joins one piece of work's spans into its way through the pipeline.
        ("link", np.int64),
    ]
)
HEADER_BYTES = 64  # int64 [written]
_SPAN_STRUCT = struct.Struct("<qiiqqqqiiqqq")
assert _SPAN_STRUCT.size == SPAN.itemsize


@dataclass(frozen=True, slots=True)
class TraceHandle:
    name: str  # "/pserve.<pid>.<nonce>.trace.<actor>"
    capacity: int

    @classmethod
    def create(cls, namespace: str, actor: str, capacity: int = 8192) -> TraceHandle:
        handle = cls(f"/{namespace}.trace.{actor}", capacity)
        shm = posix_ipc.SharedMemory(
            handle.name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES + capacity * SPAN.itemsize
        )
        shm.close_fd()
        return handle

    def unlink(self) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    def attach(self) -> TraceBuffer:
        return TraceBuffer(self)


class TraceBuffer:
    """One actor's spans. `record` is the writer's side; `read_new` the owner's."""

    def __init__(self, handle: TraceHandle) -> None:
        shm = posix_ipc.SharedMemory(handle.name)
        try:
            self._attach(mmap.mmap(shm.fd, shm.size), handle.capacity)
        finally:
            shm.close_fd()

    @classmethod
    def local(cls, capacity: int = 8192) -> TraceBuffer:
        """A buffer in this process's own memory, for spans the owner records itself."""
        buffer = cls.__new__(cls)
        buffer._attach(mmap.mmap(-1, HEADER_BYTES + capacity * SPAN.itemsize), capacity)
        return buffer

    def _attach(self, mapping: mmap.mmap, capacity: int) -> None:
        self._map = mapping
        self.capacity = capacity
        self._written = memoryview(self._map)[:8].cast("q")
        self._spans = np.frombuffer(self._map, SPAN, capacity, HEADER_BYTES)
        self._seqs = self._spans["seq"]  # a strided view: the seq field of every slot
        self._read = 0

    def record(
        self,
        kind: int,
        t_start_ns: int,
        t_end_ns: int,
        batch: int = 0,
        tokens: int = 0,
        wait_ns: int = 0,
        depth: int = 0,
        aux: int = 0,
        cpu_ns: int = 0,
        lead_ns: int = 0,
        link: int = -1,
    ) -> None:
        seq = self._written[0] + 1
        offset = HEADER_BYTES + ((seq - 1) % self.capacity) * SPAN.itemsize
        # The record goes in with seq 0 (invalid) and gets its seq last, so a reader never takes a
        # half-written record for a whole one.
        _SPAN_STRUCT.pack_into(
            self._map,
            offset,
            0,
            kind,
            batch,
            t_start_ns,
            t_end_ns,
            tokens,
            wait_ns,
            depth,
            aux,
            cpu_ns,
            lead_ns,
            link,
        )
        self._seqs[(seq - 1) % self.capacity] = seq
        self._written[0] = seq

    def read_new(self) -> np.ndarray:
        """Spans written since the last call (at most `capacity`), oldest first; a copy."""
        written = self._written[0]
        first = max(self._read, written - self.capacity)
        if written <= first:
            return np.zeros(0, SPAN)
        indices = np.arange(first, written) % self.capacity
        out = self._spans[indices].copy()
        out = out[out["seq"] == np.arange(first + 1, written + 1)]
        self._read = written
        return out

    def close(self) -> None:
        self._written.release()
        self._spans = self._seqs = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()
