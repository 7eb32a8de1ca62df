"""Which CPUs the pipeline's processes run on (`--cpu-threads-bind`), as vLLM's CPU backend binds
its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND) and llama.cpp's --cpu-mask pins its threads.

Unbound, the OS moves the model's compute threads and the other stages between cores as it
likes; on a machine with few cores a stage woken by a token (schedule, detokenize, the server)
then often preempts execute's main thread, whose next step waits, while an OpenMP worker spins
on the other core. Bound, each compute thread has its own core and the other stages run on the
cores left over, or, where none is left, on the last compute thread's core, so that they preempt
a worker rather than the thread that runs the step's serial work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

NONE = "none"
AUTO = "auto"


@dataclass(frozen=True, slots=True)
class CpuBinding:
    compute: tuple[int, ...]  # core of each compute thread, in OpenMP thread order
    others: tuple[int, ...]  # the cores the other stages and the server share


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6): a list of cores in the kernel's cpulist form, in order, each
    once (ValueError otherwise)."""
    cores: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{text!r} is not a list of cores such as 0-3,6")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{part.strip()!r}: a range must not run backwards")
        cores += range(first, last + 1)
    if len(set(cores)) != len(cores):
        raise ValueError(f"{text!r} names a core twice")
    return tuple(cores)


def check_setting(value: str) -> str:
    """`--cpu-threads-bind`'s value, checked: none, auto, or a list of cores."""
    if value not in (NONE, AUTO):
        parse_cpu_list(value)
    return value


def plan_binding(
    value: str, threads: int, available: frozenset[int] | None = None
) -> CpuBinding | None:
    """The cores for `threads` compute threads (0: one per available core) under `value`; None
    for "none". "auto" takes the lowest available cores; a list, those cores (one thread each,
    in ascending order: `threads` must be 0 or its length). ValueError for a core this process may not run on."""
    if value == NONE:
        return None
    usable = frozenset(os.sched_getaffinity(0)) if available is None else available
    if value == AUTO:
        count = threads or len(usable)
        if count > len(usable):
            raise ValueError(
                f"--cpu-threads-bind auto: {count} threads need as many cores, this process may "
                f"run on {len(usable)}"
            )
        compute = tuple(sorted(usable)[:count])
    else:
        compute = tuple(sorted(parse_cpu_list(value)))  # thread 0, the step's own, the lowest
        if threads and threads != len(compute):
            raise ValueError(
                f"--cpu-threads-bind {value} names {len(compute)} cores for {threads} threads"
            )
        if missing := sorted(set(compute) - usable):
            raise ValueError(
                f"--cpu-threads-bind {value}: this process may not run on cores {missing} "
                f"(it may run on {sorted(usable)})"
            )
    others = tuple(sorted(usable - set(compute))) or compute[-1:]
    return CpuBinding(compute, others)
