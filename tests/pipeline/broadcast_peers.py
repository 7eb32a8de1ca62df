"""Process entries the broadcast tests spawn (importable, as spawn requires)."""

from __future__ import annotations

import contextlib
import time
import zlib

from pipeline.broadcast import BroadcastHandle
from pipeline.errors import RingClosed, RuntimeFault


def read_all(handle: BroadcastHandle, results, pause_s: float) -> None:  # type: ignore[no-untyped-def]
    """Read until the writer closes; put (reader, sequence numbers read, corrupt count) on results."""
    seen, corrupt = [], 0
    with handle.reader_end() as reader, contextlib.suppress(RingClosed):
        while True:
            _, arrays = reader.recv(timeout_s=30)
            seq, crc, _ = arrays["meta"].tolist()
            corrupt += zlib.crc32(arrays["data"]) != crc
            seen.append(seq)
            if pause_s and seq % 7 == handle.reader:
                time.sleep(pause_s)
    results.put((handle.reader, seen, corrupt))


def attach_and_hold(handle: BroadcastHandle, attached) -> None:  # type: ignore[no-untyped-def]
    """Attach as a reader, say so, and never read (the test kills this process)."""
    with handle.reader_end():
        attached.set()
        time.sleep(60)


def wait_idle(handle: BroadcastHandle, seconds: float) -> None:
    """Wait on an empty ring (the CPU test measures this process)."""
    with handle.reader_end() as reader, contextlib.suppress(RuntimeFault):
        reader.recv(timeout_s=seconds)
