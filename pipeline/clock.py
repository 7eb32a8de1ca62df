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
