"""What every kernel wrapper checks before a launch: a device Triton can run on."""

from __future__ import annotations

import functools

import torch
import triton

# Set by gpu.kernels.aot.compiling_for: the SM count of the GPU compiled for, and the sign that
# meta tensors stand for that GPU's.
ahead_of_time_multiprocessors: int | None = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of Triton's when a kernel cannot run on these tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "meta" and ahead_of_time_multiprocessors is not None:
        return
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU use the torch path, "
            "or set TRITON_INTERPRET=1 before importing triton to run them in the interpreter"
        )


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether attention must upcast its tl.dot operands to float32.

    Triton's interpreter computes bfloat16 `tl.dot` wrongly (it multiplies the raw bits), so
    under the interpreter bf16 operands go through float32; on a GPU they stay bf16.
    """
    return dtype == torch.bfloat16 and interpreting()


def targets_gpu(device: torch.device) -> bool:
    """Whether a launch on this device runs (or is compiled) for a GPU: CUDA, or meta tensors
    inside gpu.kernels.aot.compiling_for."""
    return device.type == "cuda" or (
        device.type == "meta" and ahead_of_time_multiprocessors is not None
    )


def multiprocessor_count(device: torch.device) -> int:
    """The SMs of the GPU a kernel launches on (of the one compiled for, ahead of time)."""
    if device.type == "meta" and ahead_of_time_multiprocessors is not None:
        return ahead_of_time_multiprocessors
    return _cuda_multiprocessors(device)


@functools.cache
def _cuda_multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
