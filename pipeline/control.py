"""The control block: one shared-memory row per actor with its state, pid, heartbeat and last error.

The supervisor creates it; each actor writes only its own row. The supervisor reads the rows for the
start-up handshake (attached, then ready), for heartbeats, and for the error text of an actor that died.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
from dataclasses import dataclass

import numpy as np
import posix_ipc

from pipeline.clock import now_ns
from pipeline.kept import inherit_fd, inherited_fd

ROW_BYTES = 1024
NUM_GAUGES = 64
GAUGES_AT = 64  # float64 gauges an actor publishes for the owner (what each means is the actor's)
ERROR_AT = GAUGES_AT + 8 * NUM_GAUGES
ERROR_BYTES = ROW_BYTES - ERROR_AT
# int64 fields at the start of a row
F_STATE, F_PID, F_START, F_HEARTBEAT, F_ERROR_LEN = 0, 1, 2, 3, 4


class ActorState(enum.IntEnum):
    NEW = 0
    STARTING = 1
    ATTACHED = 2
    READY = 3
    STOPPING = 4
    EXITED = 5
    FAILED = 6


@dataclass(frozen=True, slots=True)
class ControlHandle:
    name: str  # shared-memory name, "/pserve.<pid>.<nonce>.control"
    n_rows: int
    # The creator's open descriptor of the segment. A child spawned with the handle inherits it
    # (see __reduce__), so an actor restarted after the name was unlinked still attaches.
    fd: int = -1

    @classmethod
    def create(cls, namespace: str, n_rows: int) -> ControlHandle:
        name = f"/{namespace}.control"
        shm = posix_ipc.SharedMemory(
            name, posix_ipc.O_CREX, mode=0o600, size=max(1, n_rows) * ROW_BYTES
        )
        return cls(name, n_rows, shm.fd)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        if self.fd < 0:
            return ControlHandle, (self.name, self.n_rows)
        return _inherited, (self.name, self.n_rows, inherit_fd(self.fd))

    def unlink(self) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    def close_fd(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)

    def attach(self) -> ControlBlock:
        return ControlBlock(self)


class ControlBlock:
    """A mapping of the control block; `row(i)` is actor i's view."""

    def __init__(self, handle: ControlHandle) -> None:
        if handle.fd >= 0:
            self._map = mmap.mmap(handle.fd, max(1, handle.n_rows) * ROW_BYTES)
        else:
            shm = posix_ipc.SharedMemory(handle.name)
            try:
                self._map = mmap.mmap(shm.fd, shm.size)
            finally:
                shm.close_fd()
        # rows: [n_rows, ROW_BYTES] uint8
        self._rows = np.frombuffer(self._map, np.uint8).reshape(-1, ROW_BYTES)
        self._ints = np.frombuffer(self._map, np.int64).reshape(-1, ROW_BYTES // 8)
        self._floats = np.frombuffer(self._map, np.float64).reshape(-1, ROW_BYTES // 8)

    def state(self, i: int) -> ActorState:
        return ActorState(int(self._ints[i, F_STATE]))

    def set_state(self, i: int, state: ActorState) -> None:
        self._ints[i, F_STATE] = int(state)

    def pid(self, i: int) -> int:
        return int(self._ints[i, F_PID])

    def set_pid(self, i: int, pid: int, start_ticks: int) -> None:
        self._ints[i, F_START] = start_ticks
        self._ints[i, F_PID] = pid

    def beat(self, i: int) -> None:
        self._ints[i, F_HEARTBEAT] = now_ns()

    def heartbeat_ns(self, i: int) -> int:
        return int(self._ints[i, F_HEARTBEAT])

    def set_gauges(self, i: int, values: list[float]) -> None:
        if len(values) > NUM_GAUGES:
            raise ValueError(f"{len(values)} gauges; a control row holds {NUM_GAUGES}")
        first = GAUGES_AT // 8
        self._floats[i, first : first + len(values)] = values

    def gauges(self, i: int) -> list[float]:
        first = GAUGES_AT // 8
        return self._floats[i, first : first + NUM_GAUGES].tolist()

    def reset(self, i: int) -> None:
        """Clear row i for a new process of the same actor."""
        self._rows[i, :] = 0

    def set_error(self, i: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[:ERROR_BYTES]
        self._rows[i, ERROR_AT : ERROR_AT + len(data)] = np.frombuffer(data, np.uint8)
        self._ints[i, F_ERROR_LEN] = len(data)

    def error(self, i: int) -> str:
        n = int(self._ints[i, F_ERROR_LEN])
        return bytes(self._rows[i, ERROR_AT : ERROR_AT + n]).decode("utf-8", "replace")

    def close(self) -> None:
        self._rows = self._ints = self._floats = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()


def _inherited(name: str, n_rows: int, fd: object) -> ControlHandle:
    return ControlHandle(name, n_rows, inherited_fd(fd))
