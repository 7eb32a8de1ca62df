"""Monotonic stamps taken in different processes order correctly."""

from __future__ import annotations

import multiprocessing

from pipeline.clock import elapsed_ms, now_ns, wall_offset_ns


def _stamp(queue) -> None:
    queue.put(now_ns())


def test_stamps_compare_across_processes():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    before = now_ns()
    proc = ctx.Process(target=_stamp, args=(queue,))
    proc.start()
    child = queue.get(timeout=30)
    proc.join()
    after = now_ns()
    assert before < child < after


def test_helpers():
    assert elapsed_ms(1_000_000, 3_500_000) == 2.5
    assert elapsed_ms(0, 5) == 0.0
    offset = wall_offset_ns()
    import time

    assert abs((now_ns() + offset) - time.time_ns()) < 50_000_000


def test_process_cpu_of_another_process_is_precise():
    import subprocess
    import sys
    import time

    import pytest

    from pipeline.clock import process_cpu_s

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.05: pass\nprint(1, flush=True)\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # it has burnt 50 ms
        used = process_cpu_s(proc.pid)
        assert 0.05 <= used < 5.0
        time.sleep(0.1)
        assert process_cpu_s(proc.pid) - used < 0.01  # asleep: no more CPU
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ProcessLookupError):
        process_cpu_s(proc.pid)
