"""Ring invariant 6 for the blocking ends of both ring kinds: a semaphore wait cut into slices,
after each of which the caller checks its peers, so that a dead peer is an error and never a hang."""

from __future__ import annotations

from collections.abc import Callable

import posix_ipc

from pipeline.clock import now_ns
from pipeline.errors import RingTimeout


def try_acquire(sem: posix_ipc.Semaphore) -> bool:
    """Take the semaphore if that needs no wait."""
    try:
        sem.acquire(0)
        return True
    except posix_ipc.BusyError:
        return False


def deadline_ns(start_ns: int, timeout_s: float | None) -> int | None:
    return None if timeout_s is None else start_ns + int(timeout_s * 1e9)


def next_slice_s(deadline: int | None, slice_s: float) -> float:
    """The next wait: a slice, or what is left before the deadline if that is shorter."""
    if deadline is None:
        return slice_s
    return max(0.0, min(slice_s, (deadline - now_ns()) / 1e9))


def wait_in_slices(
    sem: posix_ipc.Semaphore,
    start_ns: int,
    timeout_s: float | None,
    slice_s: float,
    check_peers: Callable[[], bool],
    timeout_message: str,
) -> None:
    """Take `sem` within timeout_s of start_ns (None: however long), waking every slice_s to run
    check_peers, which raises if a peer is gone and says True if it took the semaphore itself."""
    deadline = deadline_ns(start_ns, timeout_s)
    while True:
        try:
            sem.acquire(next_slice_s(deadline, slice_s))
            return
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            pass
        if check_peers():
            return
        if deadline is not None and now_ns() >= deadline:
            raise RingTimeout(timeout_message)
