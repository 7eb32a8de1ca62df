"""What every kernel wrapper checks before a launch: a device Triton can run on."""

from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of Triton's when a kernel cannot run on these tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
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
