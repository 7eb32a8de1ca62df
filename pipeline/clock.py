"""Timestamps that compare across processes: CLOCK_MONOTONIC in nanoseconds is one clock per host."""

from __future__ import annotations

import time

now_ns = time.monotonic_ns
"""Nanoseconds of CLOCK_MONOTONIC; the same clock in every process on the host."""


def wall_offset_ns() -> int:
    """Nanoseconds to add to a monotonic stamp to get Unix time (for `created` fields and logs)."""
    return time.time_ns() - time.monotonic_ns()


def elapsed_ms(start_ns: int, end_ns: int) -> float:
    """Milliseconds between two monotonic stamps; 0.0 when either is unset (0)."""
    if start_ns <= 0 or end_ns <= 0:
        return 0.0
    return (end_ns - start_ns) / 1e6


def process_cpu_s(pid: int) -> float:
    """CPU seconds (all threads) the process has used, to the nanosecond.

    The kernel's per-process CPU clock: clockid ((~pid) << 3) | 2 (CPUCLOCK_SCHED of that process),
    where /proc's tick counts would round to 10 ms. Raises ProcessLookupError for a process gone.
    """
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError as exc:
        raise ProcessLookupError(pid) from exc
