"""How many bytes a CUDA device's KV cache gets under --gpu-memory-utilization (vLLM's meaning),
and the measurements of a running process that the sizing takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    """What the sizing knows of one device, in bytes."""

    total_bytes: int  # the device's memory
    free_at_start_bytes: int  # free when this process began to load (others hold the rest)
    weights_bytes: int  # what the loaded model holds
    peak_step_bytes: int  # what the largest step allocates on top of the weights, at its peak
    # What this process holds outside torch's allocator since it began (cuBLAS workspaces,
    # Triton's modules).
    non_torch_bytes: int


def kv_cache_budget(memory: DeviceMemory, utilization: float) -> int:
    """Bytes for the KV cache: what remains of `utilization` of the device's memory after the
    weights, the peak step and this process's memory outside torch. ValueError, saying what to
    change, when other processes left less than that fraction free, or when nothing remains."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    allowed = int(memory.total_bytes * utilization)
    if memory.free_at_start_bytes < allowed:
        raise ValueError(
            f"{memory.free_at_start_bytes / GIB:.2f} GiB of the device's "
            f"{memory.total_bytes / GIB:.2f} were free at start, less than "
            f"--gpu-memory-utilization {utilization:g} asks for ({allowed / GIB:.2f} GiB): lower "
            f"it, or free the device of other processes"
        )
    taken = memory.weights_bytes + memory.peak_step_bytes + memory.non_torch_bytes
    if taken >= allowed:
        raise ValueError(
            f"no memory is left for the KV cache: {utilization:g} of {memory.total_bytes / GIB:.2f}"
            f" GiB is {allowed / GIB:.2f} GiB, and the weights take {memory.weights_bytes / GIB:.2f}"
            f", a peak step {memory.peak_step_bytes / GIB:.2f} and memory outside torch "
            f"{memory.non_torch_bytes / GIB:.2f}: raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens or set --kv-cache-memory"
        )
    return allowed - taken


@dataclass(slots=True, frozen=True)
class Baseline:
    """A device as this process found it, before it loaded anything."""

    free_bytes: int
    total_bytes: int
    non_torch_bytes: int  # in use and not reserved by torch: the CUDA context, other processes


def baseline(device: torch.device) -> Baseline:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return Baseline(free, total, (total - free) - torch.cuda.memory_reserved(device))


def measure(device: torch.device, start: Baseline, weights_bytes: int) -> DeviceMemory:
    """The device's figures after a profiled step (its peak since `reset_peak_memory_stats`)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    return DeviceMemory(
        total_bytes=total,
        free_at_start_bytes=start.free_bytes,
        weights_bytes=weights_bytes,
        peak_step_bytes=max(0, torch.cuda.max_memory_allocated(device) - weights_bytes),
        non_torch_bytes=max(0, non_torch - start.non_torch_bytes),
    )
