"""Which device execute runs on: `--device` resolved (auto: CUDA when torch sees a device), and the
CUDA device each execute process holds, by data-parallel replica and tensor-parallel rank.

Torch-free: the server resolves `auto` by asking a child interpreter, so that it never loads torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

DEVICE_CHOICES = ("auto", "cpu", "cuda")
# Where the NVIDIA kernel driver shows itself; without it torch cannot see a device either, and
# `auto` is decided without starting an interpreter.
_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl")
_PROBE = "import torch; print(torch.cuda.is_available())"


def torch_sees_cuda() -> bool:
    """`torch.cuda.is_available()`, asked in a child interpreter (about a second, and only where
    an NVIDIA driver is installed)."""
    if not any(os.path.exists(path) for path in _DRIVER_PATHS):
        return False
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    return probe.stdout.strip() == "True"


def resolve_device(choice: str, sees_cuda: Callable[[], bool] = torch_sees_cuda) -> str:
    """The device --device `choice` names: cpu, cuda, or for auto CUDA when torch sees one."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device {choice!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if choice != "auto":
        return choice
    return "cuda" if sees_cuda() else "cpu"


def default_dtype(device: str) -> str:
    """The model dtype when --dtype is auto: bfloat16 on CUDA (as vLLM serves bf16 checkpoints),
    float32 on CPU (the native CPU kernels take float32)."""
    return "bfloat16" if device == "cuda" else "float32"


@dataclass(slots=True, frozen=True)
class CudaPlacement:
    """The CUDA device one execute process holds."""

    index: int  # torch's `cuda:<index>` in a process that sees CUDA_VISIBLE_DEVICES
    visible_id: str  # that device's CUDA_VISIBLE_DEVICES entry (a number or GPU UUID), or index

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}"


def cuda_placement(
    replica: int,
    rank: int,
    tensor_parallel_size: int,
    visible_devices: str | None,
    device_count: int,
) -> CudaPlacement:
    """Replica r, rank k holds the (r * TP + k)-th visible device, in CUDA_VISIBLE_DEVICES order
    (`visible_devices`, None when unset: every one of `device_count`). ValueError when there are
    not that many."""
    if not 0 <= rank < tensor_parallel_size or replica < 0:
        raise ValueError(f"no rank {rank} of tensor-parallel size {tensor_parallel_size}")
    if visible_devices is None:
        ids = [str(i) for i in range(device_count)]
    else:
        ids = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    available = min(len(ids), device_count)
    index = replica * tensor_parallel_size + rank
    if index >= available:
        shown = "unset" if visible_devices is None else repr(visible_devices)
        raise ValueError(
            f"replica {replica}, rank {rank} (tensor-parallel size {tensor_parallel_size}) "
            f"needs CUDA device {index}, but only {available} are visible "
            f"(CUDA_VISIBLE_DEVICES {shown})"
        )
    return CudaPlacement(index=index, visible_id=ids[index])
