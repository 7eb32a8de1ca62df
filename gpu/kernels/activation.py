"""Triton SwiGLU activation: silu(gate) * up over a fused gate/up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import check_launchable


@triton.jit
def _silu_mul_kernel(
    out_ptr,
    gate_up_ptr,
    stride_in,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + offs, mask=mask, other=0.0)
    gate_f32 = gate.to(tl.float32)
    out = gate_f32 * tl.sigmoid(gate_f32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2I] -> [N, I]
    """silu(gate_up[:, :I]) * gate_up[:, I:], computed in float32."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be [N, 2I] with contiguous rows, got {tuple(gate_up.shape)}"
        )
    check_launchable(gate_up)
    num_rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(num_rows, triton.cdiv(intermediate, block))](
        out,
        gate_up,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
    )
    return out
