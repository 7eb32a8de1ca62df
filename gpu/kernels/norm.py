"""Triton RMSNorm, alone or fused with the residual add that precedes it in a Llama block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import check_launchable


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Rounded to the activation dtype before normalising, as an unfused `x + residual` is.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x_f32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x_f32 * x_f32, axis=0) / HIDDEN + eps)
    # Rounded to x's dtype before the weight, as HF does; the product is formed in float32 and
    # rounded once, which equals a 16-bit multiply (and the interpreter cannot multiply bf16).
    normed = (x_f32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * weight).to(x.dtype), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, hidden] with contiguous rows, got {tuple(x.shape)}")
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    tensors = (x, weight) if residual is None else (x, residual, weight)
    check_launchable(*tensors)

    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    if x.shape[0] == 0:
        return out, residual_out
    _rms_norm_kernel[(x.shape[0],)](
        out,
        out if residual_out is None else residual_out,
        x,
        x if residual is None else residual,
        weight,
        eps,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        BLOCK=triton.next_power_of_2(hidden),
        ADD_RESIDUAL=residual is not None,
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [N, hidden], dtype of x
    """HF Llama RMSNorm: normalise in float32, round to x's dtype, then scale by weight."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [N, hidden]
    residual: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual), x + residual)
    """One pass for `residual = x + residual; normed = rms_norm(residual)`; inputs are not changed."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None  # _launch returns one whenever a residual is given
    return out, residual_out
