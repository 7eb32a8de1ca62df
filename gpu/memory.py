"""How many bytes a CUDA device's KV cache gets under --gpu-memory-utilization (vLLM's meaning),
and the measurements of a running process that the sizing takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class DeviceMemory:
    """What the sizing knows of one device, in bytes."""

    total_bytes: int  # the device's memory
    weights_bytes: int  # what the loaded model holds
    peak_step_bytes: int  # what the largest step allocates on top of the weights, at its peak
    # Held outside torch's allocator: the CUDA context, cuBLAS workspaces, other processes.
    non_torch_bytes: int


def kv_cache_budget(memory: DeviceMemory, utilization: float) -> int:
    """Bytes for the KV cache: what remains of `utilization` of the device's memory after the
    weights, the peak step and the memory torch does not hold. ValueError when nothing remains,
    saying what took it."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    allowed = int(memory.total_bytes * utilization)
    taken = memory.weights_bytes + memory.peak_step_bytes + memory.non_torch_bytes
    if taken >= allowed:
        gib = 1 << 30
        raise ValueError(
            f"no memory is left for the KV cache: {utilization:g} of {memory.total_bytes / gib:.2f}"
            f" GiB is {allowed / gib:.2f} GiB, and the weights take {memory.weights_bytes / gib:.2f}"
            f", a peak step {memory.peak_step_bytes / gib:.2f} and memory outside torch "
            f"{memory.non_torch_bytes / gib:.2f}: raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens or set --kv-cache-memory"
        )
    return allowed - taken


def measure(device: torch.device, weights_bytes: int) -> DeviceMemory:
    """The device's figures after a profiled step (its peak since `reset_peak_memory_stats`)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device) - weights_bytes
    # Whatever is in use that torch's caching allocator did not reserve is not torch's.
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return DeviceMemory(
        total_bytes=total,
        weights_bytes=weights_bytes,
        peak_step_bytes=max(0, peak),
        non_torch_bytes=non_torch,
    )
