"""Compiling the Triton kernels for a CUDA architecture with no GPU present.

Inside `compiling_for(arch)`, a kernel wrapper called on `meta` tensors runs as it would on a
GPU of that architecture (its checks, its grid, its constexprs, Triton's specialisation of the
integer arguments) but each launch only compiles, with the ptxas the triton wheel bundles, and
is recorded: the grid, the registers and spills ptxas reports, the shared memory, and how many
of its CTAs fit on one SM. Nothing is launched and no memory is touched.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from gpu.kernels import launch

# What one SM holds, by compute capability (CUDA C Programming Guide, "Technical Specifications
# per Compute Capability"): registers, resident warps, resident CTAs, shared memory.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated to a warp in units of 256
WARPS_PER_SM = 64
CTAS_PER_SM = 32
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
SHARED_RESERVED_PER_CTA = 1024
# SMs of the part each architecture is checked for (A100 SXM, H100 SXM): what the wrappers'
# split decisions see.
MULTIPROCESSORS = {80: 108, 90: 132}
MAX_GRID = (2**31 - 1, 65535, 65535)

_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True, slots=True)
class Variant:
    """One compiled specialisation of a kernel."""

    kernel: str
    arch: int
    first_label: str  # the launch that compiled it
    registers: int
    spill_bytes: int  # spill stores + spill loads, as ptxas -v reports them
    shared_bytes: int
    num_warps: int
    ctas_per_sm: int
    tensor_cores: bool  # its PTX has mma instructions
    compile_s: float

    @property
    def fits(self) -> bool:
        return self.spill_bytes == 0 and self.ctas_per_sm > 0


@dataclass(frozen=True, slots=True)
class Launch:
    """One launch a wrapper made: its kernel's variant and grid, under the caller's label."""

    label: str
    variant: Variant
    grid: tuple[int, int, int]

    @property
    def grid_fits(self) -> bool:
        return all(0 < n <= limit for n, limit in zip(self.grid, MAX_GRID, strict=True))


@dataclass(slots=True)
class Compilations:
    """What `compiling_for` recorded; `label` names the launches that follow."""

    arch: int
    label: str = ""
    launches: list[Launch] = field(default_factory=list)


# Every variant compiled in this process, by its kernel object: Triton keeps the kernel in memory
# (and then runs no ptxas) when a later check meets the same variant again.
_VARIANTS: dict[int, Variant] = {}


def ctas_per_sm(arch: int, registers: int, num_warps: int, shared_bytes: int) -> int:
    """CTAs of one kernel resident on an SM at once, bounded by registers, warps, shared memory."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // max(per_warp, 1) // num_warps
    by_warps = WARPS_PER_SM // num_warps
    by_shared = SHARED_PER_SM[arch] // (shared_bytes + SHARED_RESERVED_PER_CTA)
    return min(by_registers, by_warps, by_shared, CTAS_PER_SM)


class _AheadOfTimeDriver:
    """The part of Triton's driver interface a launch asks before it compiles."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)
        # Not an integer: a real GPU's device 0 keeps its own compiled kernels.
        self.device = f"ahead-of-time-sm{arch}"

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device: object = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[Compilations]:
    """Within, kernel wrappers called on meta tensors compile for sm_<arch> and launch nothing.

    Uses a private Triton cache, so that ptxas runs (and reports) for every new variant.
    """
    if arch not in MULTIPROCESSORS:
        raise ValueError(f"no occupancy table for sm_{arch}; known: {sorted(MULTIPROCESSORS)}")
    record = Compilations(arch)
    run = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        log = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(log):
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        variant = _VARIANTS.get(id(kernel))
        if variant is None:
            variant = _variant(
                self.fn.__name__,
                arch,
                record.label,
                kernel,
                log.getvalue(),
                time.perf_counter() - started,
            )
            _VARIANTS[id(kernel)] = variant
        dims = tuple(grid) + (1,) * (3 - len(grid))
        record.launches.append(Launch(record.label, variant, (dims[0], dims[1], dims[2])))
        return kernel

    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache:
        saved = (knobs.cache.dir, knobs.nvidia.dump_ptxas_log)
        # Read without creating it: on a machine with no GPU there is no default driver.
        active = driver._active
        knobs.cache.dir, knobs.nvidia.dump_ptxas_log = cache, True
        driver.set_active(_AheadOfTimeDriver(arch))  # type: ignore[arg-type]
        JITFunction.run = compile_only  # type: ignore[method-assign]
        launch.ahead_of_time_multiprocessors = MULTIPROCESSORS[arch]
        try:
            yield record
        finally:
            launch.ahead_of_time_multiprocessors = None
            JITFunction.run = run  # type: ignore[method-assign]
            driver._active = active
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log = saved


def _variant(
    name: str, arch: int, label: str, kernel: Any, ptxas_log: str, compile_s: float
) -> Variant:
    usage = _PTXAS_USAGE.search(ptxas_log)
    spills = _PTXAS_SPILLS.search(ptxas_log)
    if usage is None or spills is None:
        raise RuntimeError(f"ptxas reported no register use for {name}:\n{ptxas_log}")
    registers = int(usage.group(1))
    shared = int(kernel.metadata.shared)
    warps = int(kernel.metadata.num_warps)
    return Variant(
        kernel=name,
        arch=arch,
        first_label=label,
        registers=registers,
        spill_bytes=int(spills.group(1)) + int(spills.group(2)),
        shared_bytes=shared,
        num_warps=warps,
        ctas_per_sm=ctas_per_sm(arch, registers, warps, shared),
        tensor_cores="mma." in kernel.asm["ptx"],
        compile_s=compile_s,
    )
