"""Descriptors a spawned actor inherits, and kept files: anonymous memory an actor fills once and
finds again when it is restarted (prepared model weights), held open by the supervisor so that it
lasts exactly as long as the supervisor, whatever kills it, and has no name to leave behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from multiprocessing import reduction

# Sealed against any change: the writer finished, and the file is what it wrote.
_COMPLETE_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def inherit_fd(fd: int) -> object:
    """Wraps `fd` while a child is being spawned (multiprocessing's spawn pickles its arguments)
    so that the child gets a copy of it: call it from a `__reduce__`."""
    return reduction.DupFd(fd)


def inherited_fd(wrapped: object) -> int:
    """The child's descriptor from what `inherit_fd` wrapped."""
    return int(wrapped.detach())  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class KeptFile:
    """A memfd named for /proc only (`pserve.<namespace>.<actor>.<what>`, never in /dev/shm).

    Its writer seals it when done (`seal`), so a reader knows a file is whole (`complete`): one
    whose writer died midway is cleared (`clear`) and written again.
    """

    name: str
    fd: int

    @classmethod
    def create(cls, name: str) -> KeptFile:
        return cls(name, os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return _inherited, (self.name, inherit_fd(self.fd))

    @property
    def path(self) -> str:
        """A path that opens the file, in the process that holds the descriptor."""
        return f"/proc/self/fd/{self.fd}"

    @property
    def size_bytes(self) -> int:
        return os.fstat(self.fd).st_size

    def complete(self) -> bool:
        return fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & _COMPLETE_SEALS == _COMPLETE_SEALS

    def seal(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _COMPLETE_SEALS)

    def clear(self) -> None:
        os.ftruncate(self.fd, 0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _inherited(name: str, wrapped: object) -> KeptFile:
    return KeptFile(name, inherited_fd(wrapped))
